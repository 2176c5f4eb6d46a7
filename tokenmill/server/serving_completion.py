"""``POST /v1/completions``: prompts (text, ids, or lists of either), echo, legacy logprobs."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.outputs import RequestOutput, TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import APIError, CompletionRequest
from tokenmill.server.serving import OpenAIServing, Usage, clamp_logprob, collect, first_or_error, merge_streams, request_id
from tokenmill.server.streaming import stream_response
from tokenmill.server.structured import check_constraint, constraint_for


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint (OpenAI's legacy API with vLLM's extras)."""

    def completion_logprobs(self, token_ids: list[int], lps: list[TokenLogprobs | None], offset: int,
                            prompt_ids: list[int] | None = None,
                            prompt_lps: list[TokenLogprobs | None] | None = None) -> tuple[dict[str, Any], int]:
        """The legacy completions ``logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs``,
        ``text_offset``) for echoed prompt tokens (their logprobs from ``prompt_lps`` when computed,
        else None) followed by generated ones; returns it and the text offset after the last token."""
        ts = self.token_strings
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if prompt_ids:
            token_ids = list(prompt_ids) + list(token_ids)
            lps = list(prompt_lps if prompt_lps is not None else [None] * len(prompt_ids)) + list(lps)
        for tid, lp in zip(token_ids, lps):
            s = ts.get(tid)[0]
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if lp is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(clamp_logprob(lp.logprob))
            d = {ts.get(t)[0]: clamp_logprob(v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            d.setdefault(s, clamp_logprob(lp.logprob))
            top.append(d)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}, offset

    async def create_completion(self, body: CompletionRequest) -> Any:
        """Serve one completions request (streamed or not).

        Raises:
            APIError: validation (400), unknown model (404), admission (400/429), dead engine (503).
        """
        state = self.state
        arrival = time.time()
        body.check()
        lora = self.check_model(body.model)
        self.check_request_token_ids(body)
        self.check_priority(body.priority)
        p = body.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif all(isinstance(x, int) for x in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        prompts: list[tuple[str | None, list[int]]] = []
        for it in items:
            if isinstance(it, str):
                prompts.append((it, await self.encode(it, body.add_special_tokens, param="prompt")))
            else:
                prompts.append((None, list(it)))
        if any(len(ids) == 0 for _, ids in prompts):
            raise APIError("prompt must contain at least one token", param="prompt")
        plp = body.effective_prompt_logprobs
        constraint = constraint_for(body)
        if constraint is not None:
            await check_constraint(constraint, state.config.model)
        # echo with max_tokens 0 and prompt logprobs: the engine must run the prompt; it samples one
        # token that is not returned (vLLM does the same)
        echo_only = body.echo_without_generation and plp is not None
        params_list: list[SamplingParams] = []
        for _, ids in prompts:
            mt = 1 if echo_only else self.resolve_max_tokens(len(ids), body.max_tokens)
            params_list.append(body.sampling_params(mt, body.logprobs, plp,
                                                    constraint.params if constraint is not None else None))
        n = body.n
        ticket = self.admit(n * len(prompts), n * sum(len(ids) for _, ids in prompts), body.priority,
                            body.is_batch, arrival, max_tokens=max((p.max_tokens or 0) for p in params_list) or None)
        rid = request_id("cmpl", body.request_id)
        created = int(time.time())
        engine_ids = [rid if len(prompts) == 1 else f"{rid}-p{i}" for i in range(len(prompts))]
        extra = {"lora_request": lora} if lora is not None else {}
        gens = [state.engine.generate(engine_ids[i], text, ids, params_list[i],
                                      body.priority, body.cache_salt, arrival, batch=body.is_batch, **extra)
                for i, (text, ids) in enumerate(prompts)]
        self.admitted(ticket, engine_ids)
        usage = Usage([len(ids) for _, ids in prompts], count_completion=not echo_only)

        def echo_text(i: int) -> str:
            text, ids = prompts[i]
            return text if text is not None else state.tokenizer.decode(ids)

        merged = merge_streams(gens)
        if body.stream:
            first = await first_or_error(merged)
            offsets: dict[int, int] = {}
            started: set[int] = set()

            def completion_choices(i: int, out: RequestOutput) -> list[dict[str, Any]]:
                choices = []
                for c in out.outputs:
                    gi = i * n + c.index
                    text, gen_ids, gen_lps = ("", [], []) if echo_only else (c.text, c.token_ids, c.logprobs or [])
                    prompt_ids = None
                    if gi not in started:
                        started.add(gi)
                        if body.echo:
                            text = echo_text(i) + text
                            prompt_ids = prompts[i][1]
                    elif not text and c.finish_reason is None and body.logprobs is None:
                        continue  # nothing to show yet (e.g. half a UTF-8 character)
                    lp = None
                    if body.logprobs is not None:
                        lp, offsets[gi] = self.completion_logprobs(gen_ids, gen_lps, offsets.get(gi, 0), prompt_ids,
                                                                   out.prompt_logprobs)
                    fr, sr = ("length", None) if echo_only and c.finish_reason else (c.finish_reason, c.stop_reason)
                    choices.append({"index": gi, "text": text, "logprobs": lp, "finish_reason": fr,
                                    "stop_reason": sr})
                return choices

            head = {"id": rid, "object": "text_completion", "created": created, "model": lora.lora_name if lora is not None else state.model_name}
            return stream_response(merged, first, usage, head, body.stream_options, completion_choices)

        # Non-streaming: collect everything.
        res = await collect(merged, usage, n)
        choices = []
        for gi in sorted(res.texts):
            i = gi // n
            if echo_only:
                res.texts[gi], res.token_ids[gi], res.logprobs[gi] = [], [], []
            text = "".join(res.texts[gi])
            lp = None
            if body.echo:
                text = echo_text(i) + text
            if body.logprobs is not None:
                lp, _ = self.completion_logprobs(res.token_ids[gi], res.logprobs[gi], 0,
                                                 prompts[i][1] if body.echo else None, res.prompt_logprobs.get(i))
            fr, sr = ("length", None) if echo_only else res.finish.get(gi, (None, None))
            choice = {"index": gi, "text": text, "logprobs": lp, "finish_reason": fr, "stop_reason": sr}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.vllm_prompt_logprobs(prompts[i][1], res.prompt_logprobs.get(i))
            choices.append(choice)
        resp = {"id": rid, "object": "text_completion", "created": created, "model": lora.lora_name if lora is not None else state.model_name,
                "choices": choices, "usage": usage.to_dict()}
        if res.kv_transfer_params is not None:    # P/D disaggregation: where the prefill server keeps the KV
            resp["kv_transfer_params"] = res.kv_transfer_params
        return JSONResponse(resp)
