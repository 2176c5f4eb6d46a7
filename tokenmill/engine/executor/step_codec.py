"""The step description rank 0's scheduler sends to workers: new requests in full, running ones as deltas.

vLLM v1's scheduler output (``vllm/v1/core/sched/output.py``) has the same
shape: a worker caches each request's block table, prompt, sampling
parameters and generated tokens the first time it sees the request, and every
later step carries only what changed (this step's tokens and position, block
ids appended, tokens generated since). The worker rebuilds the full
:class:`~tokenmill.core.sched_output.SchedulerOutput` from its cache, so the
model runner is the same one the single-process engine uses.

A request is sent in full again when the scheduler marks it ``new`` (admitted
or re-admitted after a preemption) or when its block table or generated
tokens did not grow by appending (never expected; checked because it is free).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput

# Fields a worker caches per request; everything else of a ScheduledRequest travels every step.
CACHED_FIELDS = ("req_id", "prompt_token_ids", "sampling_params", "block_ids", "output_token_ids")
PER_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduledRequest) if f.name not in CACHED_FIELDS)


@dataclass
class RequestDelta:
    """A running request's change since the worker last saw it.

    Attributes:
        req_id: request id.
        new_block_ids: block ids appended to its block table.
        new_output_token_ids: tokens it generated since.
        fields: every per-step field (``token_ids``, ``num_computed_tokens``,
            ``sample``, ``new``, ``prompt_logprobs`` and any field added later).
    """

    req_id: str
    new_block_ids: list[int]
    new_output_token_ids: list[int]
    fields: dict


@dataclass
class StepDescription:
    """One step as the workers receive it.

    Attributes:
        items: the step's requests in batch order: a full
            :class:`ScheduledRequest` for a new one, a :class:`RequestDelta`
            for a running one.
        total_num_scheduled_tokens: tokens in the flattened batch.
        preempted_req_ids, finished_req_ids: as in :class:`SchedulerOutput`;
            the worker drops their cached state.
        num_spec_tokens: as in :class:`SchedulerOutput` (draft tokens to propose for the next step).
        grammar_bitmask: as in :class:`SchedulerOutput` (structured outputs; pickled filled).
    """

    items: list = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    num_spec_tokens: int = 0
    grammar_bitmask: Any = None

    @property
    def num_new(self) -> int:
        return sum(isinstance(i, ScheduledRequest) for i in self.items)


class StepEncoder:
    """Rank 0's side: remembers what the workers hold and encodes each step as a diff."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int, int]] = {}   # req_id -> (blocks, outputs, last block id)

    def encode(self, so: SchedulerOutput) -> StepDescription:
        """The :class:`StepDescription` of ``so``; updates what the workers are known to hold."""
        items: list = []
        for r in so.scheduled:
            sent = self._sent.get(r.req_id)
            nb, no = len(r.block_ids), len(r.output_token_ids)
            if (r.new or sent is None or nb < sent[0] or no < sent[1]
                    or (sent[0] and r.block_ids[sent[0] - 1] != sent[2])):
                items.append(r)
            else:
                items.append(RequestDelta(r.req_id, r.block_ids[sent[0]:], r.output_token_ids[sent[1]:],
                                          {f: getattr(r, f) for f in PER_STEP_FIELDS}))
            self._sent[r.req_id] = (nb, no, r.block_ids[-1] if nb else -1)
        for rid in so.preempted_req_ids:
            self._sent.pop(rid, None)
        for rid in so.finished_req_ids:
            self._sent.pop(rid, None)
        return StepDescription(items, so.total_num_scheduled_tokens, list(so.preempted_req_ids),
                               set(so.finished_req_ids), so.num_spec_tokens, so.grammar_bitmask)

    @property
    def num_cached(self) -> int:
        """Requests the workers are known to cache."""
        return len(self._sent)


class StepDecoder:
    """A worker's side: rebuilds each step's :class:`SchedulerOutput` from the diff and its cache.

    Raises (from :meth:`decode`):
        KeyError: a delta for a request the worker never saw in full
            (the two sides disagree; a bug).
    """

    def __init__(self) -> None:
        self._reqs: dict[str, ScheduledRequest] = {}

    def decode(self, desc: StepDescription) -> SchedulerOutput:
        for rid in desc.preempted_req_ids:
            self._reqs.pop(rid, None)
        for rid in desc.finished_req_ids:
            self._reqs.pop(rid, None)
        scheduled: list[ScheduledRequest] = []
        for item in desc.items:
            if isinstance(item, ScheduledRequest):
                req = dataclasses.replace(item, block_ids=list(item.block_ids),
                                          output_token_ids=list(item.output_token_ids))
                self._reqs[item.req_id] = req
            else:
                req = self._reqs[item.req_id]
                req.block_ids.extend(item.new_block_ids)
                req.output_token_ids.extend(item.new_output_token_ids)
                for k, v in item.fields.items():
                    setattr(req, k, v)
            scheduled.append(req)
        return SchedulerOutput(scheduled=scheduled, total_num_scheduled_tokens=desc.total_num_scheduled_tokens,
                               preempted_req_ids=list(desc.preempted_req_ids),
                               finished_req_ids=set(desc.finished_req_ids),
                               num_spec_tokens=desc.num_spec_tokens, grammar_bitmask=desc.grammar_bitmask)

    @property
    def num_cached(self) -> int:
        return len(self._reqs)
