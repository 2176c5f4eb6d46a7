"""``POST /v1/chat/completions``: the chat template, one conversation, chat-style logprobs."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.outputs import RequestOutput, TokenLogprobs
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import OpenAIServing, Usage, clamp_logprob, collect, first_or_error, merge_streams, request_id
from tokenmill.server.streaming import stream_response


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint (OpenAI's API with vLLM's extras)."""

    def chat_logprobs(self, token_ids: list[int], lps: list[TokenLogprobs | None], top_n: int
                      ) -> list[dict[str, Any]]:
        """``logprobs.content``: per generated token its text, logprob, bytes and top ``top_n`` alternatives."""
        ts = self.token_strings
        content = []
        for tid, lp in zip(token_ids, lps):
            s, b = ts.get(tid)
            entry: dict[str, Any] = {"token": s, "logprob": clamp_logprob(lp.logprob) if lp else 0.0, "bytes": b,
                                     "top_logprobs": []}
            if lp is not None:
                for t, v in list(zip(lp.top_token_ids, lp.top_logprobs))[:top_n]:
                    ts_, tb = ts.get(t)
                    entry["top_logprobs"].append({"token": ts_, "logprob": clamp_logprob(v), "bytes": tb})
            content.append(entry)
        return content

    async def create_chat_completion(self, body: ChatCompletionRequest) -> Any:
        """Serve one chat request (streamed or not).

        Raises:
            APIError: validation (400), unknown model (404), admission (400/429), dead engine (503).
        """
        state = self.state
        arrival = time.time()
        body.check()
        lora = self.check_model(body.model)
        self.check_request_token_ids(body)
        self.check_priority(body.priority)
        prompt = self.render_chat(body.messages, body.add_generation_prompt, body.continue_final_message,
                                  body.chat_template, body.chat_template_kwargs)
        ids = await self.encode(prompt, body.add_special_tokens, param="messages")
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        mt = self.resolve_max_tokens(len(ids), body.requested_max_tokens, param)
        params = body.sampling_params(mt, body.num_logprobs, body.prompt_logprobs)
        n = body.n
        ticket = self.admit(n, n * len(ids), body.priority, body.is_batch, arrival, max_tokens=mt)
        rid = request_id("chatcmpl", body.request_id)
        created = int(time.time())
        extra = {"lora_request": lora} if lora is not None else {}
        merged = merge_streams([state.engine.generate(rid, prompt, ids, params, body.priority, body.cache_salt,
                                                      arrival, batch=body.is_batch, **extra)])
        self.admitted(ticket, [rid])
        usage = Usage([len(ids)])
        top_n = body.top_logprobs or 0

        if body.stream:
            first = await first_or_error(merged)
            started: set[int] = set()

            def chat_choices(_: int, out: RequestOutput) -> list[dict[str, Any]]:
                choices = []
                for c in out.outputs:
                    if c.index not in started:
                        # The role is announced together with the first generated token.
                        started.add(c.index)
                        delta: dict[str, Any] = {"role": "assistant", "content": c.text}
                    elif not c.text and c.finish_reason is None and not body.logprobs:
                        continue  # nothing to show yet (e.g. half a UTF-8 character)
                    else:
                        delta = {"content": c.text} if c.text else {}
                    lp = None
                    if body.logprobs:
                        lp = {"content": self.chat_logprobs(c.token_ids, c.logprobs or [], top_n)}
                    choices.append({"index": c.index, "delta": delta, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                return choices

            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": lora.lora_name if lora is not None else state.model_name}
            return stream_response(merged, first, usage, head, body.stream_options, chat_choices)

        res = await collect(merged, usage, n=1)
        choices = []
        for idx in sorted(res.texts):
            fr, sr = res.finish.get(idx, (None, None))
            lp = ({"content": self.chat_logprobs(res.token_ids[idx], res.logprobs[idx], top_n)}
                  if body.logprobs else None)
            choices.append({"index": idx, "message": {"role": "assistant", "content": "".join(res.texts[idx])},
                            "logprobs": lp, "finish_reason": fr, "stop_reason": sr})
        resp: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created,
                                "model": lora.lora_name if lora is not None else state.model_name, "choices": choices, "usage": usage.to_dict()}
        if res.kv_transfer_params is not None:    # P/D disaggregation: where the prefill server keeps the KV
            resp["kv_transfer_params"] = res.kv_transfer_params
        if body.prompt_logprobs is not None:   # vLLM puts them on the response, not the choice
            resp["prompt_logprobs"] = self.vllm_prompt_logprobs(ids, res.prompt_logprobs.get(0))
        return JSONResponse(resp)
