"""``POST /v1/chat/completions``: the chat template, one conversation, chat-style logprobs."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.outputs import RequestOutput, TokenLogprobs
from tokenmill.server.chat_prompt import tool_prompt
from tokenmill.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from tokenmill.server.serving import OpenAIServing, Usage, clamp_logprob, collect, first_or_error, merge_streams, request_id
from tokenmill.server.streaming import stream_response
from tokenmill.server.structured import check_constraint, constraint_for, structural_tags_supported
from tokenmill.server.tool_parsers import (NamedToolParser, RequiredToolParser, ToolCallStreamer, ToolParser,
                                           get_tool_parser, parse_final)


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint (OpenAI's API with vLLM's extras), tools included.

    Tool choice (OpenAI's, served as vLLM serves it): ``none`` leaves the text alone; ``auto`` parses the
    model's text with ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``); ``required`` and a
    named function constrain decoding to the tools' parameter schemas
    (:mod:`tokenmill.server.structured`) and read the calls back. A response with tool calls has
    ``message.tool_calls`` and ``finish_reason: "tool_calls"`` (``"stop"`` for a named function, as OpenAI
    and vLLM answer a forced call).
    """

    def tool_reader(self, body: ChatCompletionRequest) -> ToolParser | None:
        """The parser that reads tool calls out of this request's output (None: no tool calls).

        Raises:
            APIError: 400 for ``tool_choice: "auto"`` on a server without ``--enable-auto-tool-choice``.
        """
        if not body.tools:
            return None
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        tc = body.effective_tool_choice
        if isinstance(tc, NamedToolChoice):
            return NamedToolParser(tc.function.name, tools)
        if tc == "required":
            return RequiredToolParser(tools)
        if tc == "auto":
            cfg = self.state.config.server
            if not (cfg.enable_auto_tool_choice and cfg.tool_call_parser):
                raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                               "to be set (or send tool_choice \"required\", \"none\" or a named function)",
                               param="tool_choice")
            return get_tool_parser(cfg.tool_call_parser)(tools)
        return None

    def tool_prompt(self, body: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, ToolParser | None,
                                                               str | None]:
        """``(tools the template sees, the call syntax, the fallback's instructions)`` for rendering
        (:func:`tokenmill.server.chat_prompt.tool_prompt` under this server's config)."""
        cfg = self.state.config.server
        return tool_prompt(body, cfg.tool_call_parser, cfg.exclude_tools_when_tool_choice_none)

    def strip_special(self, text: str) -> str:
        """``text`` without a trailing end-of-sequence token (present when special tokens are kept)."""
        tok = self.state.tokenizer
        for s in (getattr(tok, "eos_token", None), getattr(tok, "pad_token", None), "<|eot_id|>", "<|eom_id|>"):
            if isinstance(s, str) and s and text.endswith(s):
                return text[:-len(s)]
        return text

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
        reader = self.tool_reader(body)
        tools, fmt, instructions = self.tool_prompt(body)
        prompt = self.render_chat(body.messages, body.add_generation_prompt, body.continue_final_message,
                                  body.chat_template, body.chat_template_kwargs, tools, fmt, instructions)
        ids = await self.encode(prompt, body.add_special_tokens, param="messages")
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        mt = self.resolve_max_tokens(len(ids), body.requested_max_tokens, param, prompt_param="messages")
        auto = (reader if reader is not None and body.effective_tool_choice == "auto"
                and structural_tags_supported(state.config.model) else None)
        constraint = constraint_for(body, auto)
        if constraint is not None:
            await check_constraint(constraint, state.config.model)
        keep_special = reader is not None and not reader.skip_special_tokens
        # OpenAI (and vLLM) finish a forced named function with "stop"; auto and required calls with "tool_calls"
        calls_finish = "stop" if isinstance(body.effective_tool_choice, NamedToolChoice) else "tool_calls"
        # parallel_tool_calls false: the first call only (required is held to one by its schema already)
        max_calls = 1 if body.parallel_tool_calls is False else None
        params = body.sampling_params(mt, body.num_logprobs, body.prompt_logprobs,
                                      constraint.params if constraint is not None else None,
                                      skip_special_tokens=False if keep_special else None)
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
            streamers: dict[int, ToolCallStreamer] = {}

            def tool_delta(c: Any, first_delta: bool) -> dict[str, Any] | None:
                """The delta of one choice's output when tool calls are read (None: nothing to send)."""
                st = streamers.get(c.index)
                if st is None:      # one streamer per choice; the parser itself keeps no state
                    st = streamers[c.index] = ToolCallStreamer(reader, max_calls)
                final = c.finish_reason is not None
                text = self.strip_special(c.text) if final and keep_special else c.text
                content, entries = st.feed(text, final)
                delta: dict[str, Any] = {"role": "assistant"} if first_delta else {}
                if entries:
                    if first_delta:
                        delta["content"] = content or None
                    elif content:
                        delta["content"] = content
                    delta["tool_calls"] = entries
                elif content or first_delta:
                    delta["content"] = content
                if not content and not entries and not first_delta and not final and not body.logprobs:
                    return None
                return delta

            def chat_choices(_: int, out: RequestOutput) -> list[dict[str, Any]]:
                choices = []
                for c in out.outputs:
                    fr = c.finish_reason
                    if reader is not None:
                        first_delta = c.index not in started
                        started.add(c.index)
                        d = tool_delta(c, first_delta)
                        if d is None:
                            continue
                        delta: dict[str, Any] = d
                        if fr == "stop" and streamers[c.index].called:
                            fr = calls_finish
                    elif c.index not in started:
                        # The role is announced together with the first generated token.
                        started.add(c.index)
                        delta = {"role": "assistant", "content": c.text}
                    elif not c.text and c.finish_reason is None and not body.logprobs:
                        continue  # nothing to show yet (e.g. half a UTF-8 character)
                    else:
                        delta = {"content": c.text} if c.text else {}
                    lp = None
                    if body.logprobs:
                        lp = {"content": self.chat_logprobs(c.token_ids, c.logprobs or [], top_n)}
                    choices.append({"index": c.index, "delta": delta, "logprobs": lp,
                                    "finish_reason": fr, "stop_reason": c.stop_reason})
                return choices

            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": lora.lora_name if lora is not None else state.model_name}
            return stream_response(merged, first, usage, head, body.stream_options, chat_choices)

        res = await collect(merged, usage, n=1)
        choices = []
        for idx in sorted(res.texts):
            fr, sr = res.finish.get(idx, (None, None))
            lp = ({"content": self.chat_logprobs(res.token_ids[idx], res.logprobs[idx], top_n)}
                  if body.logprobs else None)
            message: dict[str, Any] = {"role": "assistant", "content": "".join(res.texts[idx])}
            if reader is not None:
                text = self.strip_special(message["content"]) if keep_special else message["content"]
                content, calls = parse_final(reader, text, max_calls)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    if fr == "stop":
                        fr = calls_finish
            choices.append({"index": idx, "message": message, "logprobs": lp, "finish_reason": fr,
                            "stop_reason": sr})
        resp: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created,
                                "model": lora.lora_name if lora is not None else state.model_name, "choices": choices, "usage": usage.to_dict()}
        if res.kv_transfer_params is not None:    # P/D disaggregation: where the prefill server keeps the KV
            resp["kv_transfer_params"] = res.kv_transfer_params
        if body.prompt_logprobs is not None:   # vLLM puts them on the response, not the choice
            resp["prompt_logprobs"] = self.vllm_prompt_logprobs(ids, res.prompt_logprobs.get(0))
        return JSONResponse(resp)
