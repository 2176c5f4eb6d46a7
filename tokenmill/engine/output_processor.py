"""Turns the core's token ids into text: detokenization, stop strings, n > 1.

Runs in the front end (the API process, or in-process for the offline
``LLM``), never in the engine core, so that detokenization does not stall a
step. A request with ``n`` choices is sent to the core as ``n`` child requests
``"{request_id}-{i}"`` (when n == 1, the child id is the request id itself);
they share the prompt's cached blocks through the prefix cache.
"""

from __future__ import annotations

import time
import dataclasses
from dataclasses import dataclass, field

from tokenmill.core.sched_output import EngineCoreOutput
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The engine-side params of choice ``index`` of a request with ``params.n`` choices.

    Each child is a request with ``n = 1``; a seeded request's choice ``i``
    uses ``seed + i`` so the choices differ. Every child computes the
    prompt logprobs (if asked): a choice streams its first token only with
    them, and a sibling that read the prompt from the prefix cache could
    otherwise start before the one computing them.
    """
    if params.n == 1:
        return params
    return dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index)


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Core-side ids of a request's ``n`` choices."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


@dataclass
class _ChoiceState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: dict[str, _ChoiceState]
    metrics: RequestMetrics
    cached_by_choice: dict[int, int] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    error: str | None = None
    error_code: int = 400
    kv_transfer_params: dict | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache: the least over the choices reported so far.

        With ``n > 1`` the choices are sibling engine requests over the same
        prompt; the first one scheduled computes the prompt and the others
        then hit its blocks, so the minimum is what the cache held for this
        request (the maximum would count the request's own work as cached).
        """
        return min(self.cached_by_choice.values(), default=0)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())


class OutputProcessor:
    """Front-end state of every live request.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``/``convert_ids_to_tokens``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, tuple[str, str]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> list[str]:
        """Register a request; returns the child ids to send to the core.

        Raises:
            ValueError: the request id is already live.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = child_request_ids(request_id, params.n)
        choices = {cid: _ChoiceState(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params))
                   for i, cid in enumerate(ids)}
        self._requests[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), params, choices,
            RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.time()))
        for cid in ids:
            self._child_to_parent[cid] = (request_id, cid)
        return ids

    def child_ids(self, request_id: str) -> list[str]:
        """Core-side ids of a live request (empty when unknown)."""
        st = self._requests.get(request_id)
        return list(st.choices) if st else []

    @property
    def num_requests(self) -> int:
        """Live requests (added, not yet removed)."""
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def remove_request(self, request_id: str) -> None:
        """Forget a request (after abort or when its final output was consumed)."""
        st = self._requests.pop(request_id, None)
        if st:
            for cid in st.choices:
                self._child_to_parent.pop(cid, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply core outputs.

        Returns:
            (deltas, stop_ids): one :class:`RequestOutput` per touched request
            whose choices carry only the *new* text / token ids / logprobs of
            this batch (``finish_reason`` set on the final delta of a choice);
            and the child ids whose stop string matched, which the caller must
            finish in the core (``EngineCore.stop_requests``). A finished request
            stays here (for :meth:`final_output`) until the caller calls
            :meth:`remove_request`; the async engine does so as it delivers the
            last delta (forgetting it leaked every finished request's state).
        """
        touched: dict[str, dict[int, CompletionOutput]] = {}
        stop_ids: list[str] = []
        now = time.time()
        for out in outputs:
            key = self._child_to_parent.get(out.req_id)
            if key is None:
                continue  # already finished here (e.g. stop string) or unknown
            st = self._requests[key[0]]
            ch = st.choices[key[1]]
            if ch.finish_reason is not None:
                continue
            m = st.metrics
            if out.first_scheduled_time and (m.first_scheduled_time is None or out.first_scheduled_time < m.first_scheduled_time):
                m.first_scheduled_time = out.first_scheduled_time
            st.cached_by_choice.setdefault(ch.index, out.num_cached_tokens)
            if out.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = out.prompt_logprobs   # every choice computes the same; the first wins
            delta = touched.setdefault(st.request_id, {}).setdefault(
                ch.index, CompletionOutput(index=ch.index, logprobs=[] if st.params.logprobs is not None else None))
            new_ids = out.new_token_ids
            if new_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                text = ch.detokenizer.update(new_ids)
                if ch.detokenizer.stop_matched is not None:
                    # Keep the tokens up to the one that completed the stop string (a step that emitted
                    # several, e.g. accepted draft tokens, drops the ones after it).
                    ch.finish_reason, ch.stop_reason = "stop", ch.detokenizer.stop_matched
                    stop_ids.append(out.req_id)
                    keep = (ch.detokenizer.num_tokens_at_stop or 0) - len(ch.token_ids)
                    if 0 < keep < len(new_ids):
                        new_ids = new_ids[:keep]
                        out = dataclasses.replace(out, new_token_ids=new_ids,
                                                  new_logprobs=list(out.new_logprobs)[:keep])
                ch.token_ids.extend(new_ids)
                delta.token_ids.extend(new_ids)
                if st.params.logprobs is not None:
                    lps = list(out.new_logprobs) + [None] * (len(new_ids) - len(out.new_logprobs))
                    ch.logprobs.extend(lps)
                    delta.logprobs.extend(lps)
                ch.text += text
                delta.text += text
            if ch.finish_reason is None and out.finish_reason is not None:
                tail = ch.detokenizer.finish()
                ch.text += tail
                delta.text += tail
                ch.finish_reason = out.finish_reason
                ch.stop_reason = out.stop_reason
                if out.kv_transfer_params is not None:
                    st.kv_transfer_params = out.kv_transfer_params
                if out.error:
                    st.error, st.error_code = out.error, out.error_code
            if ch.finish_reason is not None:
                delta.finish_reason, delta.stop_reason = ch.finish_reason, ch.stop_reason
                m.finished_time = out.finished_time or now
        results: list[RequestOutput] = []
        for rid, deltas in touched.items():
            st = self._requests[rid]
            results.append(RequestOutput(
                request_id=rid, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                outputs=[deltas[i] for i in sorted(deltas)], finished=st.finished,
                num_cached_tokens=st.num_cached_tokens, metrics=st.metrics, error=st.error,
                error_code=st.error_code, prompt_logprobs=st.prompt_logprobs,
                kv_transfer_params=st.kv_transfer_params))
        return results, stop_ids

    def final_output(self, request_id: str) -> RequestOutput:
        """The cumulative output of a request (all choices, full text).

        Raises:
            KeyError: unknown request id.
        """
        st = self._requests[request_id]
        return RequestOutput(
            request_id=request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
            outputs=[CompletionOutput(index=c.index, text=c.text, token_ids=list(c.token_ids),
                                      logprobs=list(c.logprobs) if st.params.logprobs is not None else None,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for c in sorted(st.choices.values(), key=lambda c: c.index)],
            finished=st.finished, num_cached_tokens=st.num_cached_tokens, metrics=st.metrics, error=st.error,
            error_code=st.error_code, prompt_logprobs=st.prompt_logprobs,
            kv_transfer_params=st.kv_transfer_params)
