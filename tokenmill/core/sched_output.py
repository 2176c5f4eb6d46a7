"""The contract between the scheduler and the model runner.

The scheduler emits one :class:`SchedulerOutput` per step; the model runner
computes exactly the tokens listed there and returns a :class:`ModelRunnerOutput`
with one sampled token per request whose ``sample`` flag is set. Both are plain
data (no torch), so the scheduler is testable with no model at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.outputs import TokenLogprobs
from tokenmill.sampling_params import SamplingParams

__all__ = ["ScheduledRequest", "SchedulerOutput", "ModelRunnerOutput", "EngineCoreOutput", "TokenLogprobs"]


@dataclass
class ScheduledRequest:
    """One request's slice of a step.

    Attributes:
        req_id: request id.
        token_ids: the tokens to compute this step, ``[num_scheduled_tokens]``
            (a prompt chunk, or the last sampled token for decode).
        num_computed_tokens: how many tokens already have K/V in the cache
            before this step; the position of ``token_ids[0]``.
        block_ids: the request's whole block table (block ids in order), long
            enough to hold ``num_computed_tokens + len(token_ids)`` tokens.
        sample: True when this step reaches the last known token, so the
            runner samples a next token for the request.
        sampling_params: the request's parameters (for the sampler).
        prompt_token_ids: prompt ids (for the repetition penalty).
        output_token_ids: generated ids so far (penalties; the list is the
            request's own, read-only for the runner).
        new: True the first time the runner sees this request id since it was
            (re)scheduled from the waiting queue: the runner (re)initialises
            per-request state (e.g. the seeded generator).
        prompt_logprobs: top entries per prompt token when the runner must
            return prompt logprobs for the prompt positions of this chunk
            (:attr:`ModelRunnerOutput.prompt_logprobs`); None otherwise.
        spec_token_ids: draft tokens to verify, ``[num_draft_tokens]``;
            they are the last ``len(spec_token_ids)`` entries of
            ``token_ids`` (only on a sampling step). The runner samples at
            the last real token and at every draft position.
        lora_request: the request's LoRA adapter (``lora_int_id``, ``lora_name``, ``lora_path``),
            None for the base model; the runner maps the request's rows to its adapter slot.
    """

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new: bool = False
    prompt_logprobs: int | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What one engine step computes.

    Attributes:
        scheduled: requests in this step's flattened batch, in batch order
            (running requests first, then newly admitted ones).
        total_num_scheduled_tokens: sum of ``len(token_ids)``; never above
            ``max_num_batched_tokens``.
        preempted_req_ids: requests preempted (blocks freed) during this
            scheduling pass.
        finished_req_ids: requests that finished or were aborted since the
            previous step; the runner drops their per-request state.
        num_spec_tokens: speculative decoding: how many draft tokens the
            runner proposes per sampling request for the next step (the
            dynamic draft length for the current batch size; 0: none).
        kv_connector_metadata: with a KV connector, its orders for the worker side this step
            (:class:`tokenmill.kv_transfer.base.KVConnectorMetadata`); None without one.
        grammar_bitmask: structured outputs: the step's token bitmask for the constrained sampling
            rows (:class:`tokenmill.structured_output.manager.GrammarBitmask`, being filled while the
            forward runs; the runner calls its ``apply(logits)``); None when no row is constrained.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    num_spec_tokens: int = 0
    kv_connector_metadata: Any = None
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.req_id: len(s.token_ids) for s in self.scheduled}


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, one per request whose ``sample`` flag was set.

    Attributes:
        req_ids: the sampling requests, in batch order.
        sampled_token_ids: ``[len(req_ids)]`` ints.
        logprobs: per request, a :class:`TokenLogprobs` when the request asked
            for logprobs, else None.
        prompt_logprobs: per request with ``ScheduledRequest.prompt_logprobs``:
            ``(first, entries)``, the logprobs of prompt tokens ``first,
            first + 1, ...`` (each given the tokens before it) that this
            step's chunk predicts; ``first >= 1``.
        verified_token_ids: speculative decoding, per request that verified
            drafts: every token the step emits (the accepted drafts, then the
            target's own token); its first entry equals the request's
            ``sampled_token_ids`` entry.
        verified_logprobs: the target's logprobs of those tokens (entries
            None when not asked for).
        draft_token_ids: per request, the drafts proposed for its next step.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What the core reports for one request after a step (sent to the front end).

    Attributes:
        req_id: request id.
        new_token_ids: tokens generated this step (empty for a finish without
            tokens, e.g. an abort or a rejection).
        new_logprobs: per new token, its :class:`TokenLogprobs` or None.
        finish_reason: 'stop', 'length', 'abort', 'error' or None.
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: prompt tokens served from the prefix cache.
        error: message when ``finish_reason == 'error'``.
        error_code: HTTP-style status of that error: 400 for a request that
            can never be served, 500 for a failure inside the engine.
        arrival_time, first_scheduled_time, first_token_time, finished_time:
            ``time.time()`` seconds (None when not reached).
        num_prompt_tokens: prompt length in tokens.
        num_preemptions: how often the request was preempted.
        prompt_logprobs: with the first token of a request that asked for
            them: ``[num_prompt_tokens]``, None for the first prompt token,
            then each token's :class:`TokenLogprobs` given the ones before it.
        kv_transfer_params: with the finishing output of a request a KV connector keeps for a decode
            server: where its KV is (vLLM's ``kv_transfer_params``); else None.
    """

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: int = 400
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None
