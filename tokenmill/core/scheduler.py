"""Iteration-level scheduler with a token budget, chunked prefill and preemption by recompute.

Every step (Orca, Yu et al., OSDI'22, §3.1: iteration-level scheduling) the
scheduler hands out at most ``max_num_batched_tokens`` tokens:

1. :meth:`Scheduler._schedule_running` — running requests first, in
   admission order: each gets its next token (decode) or the next chunk of
   its prompt. When the pool has no block for it, the lowest-priority,
   latest-arriving running request is preempted (:meth:`Scheduler._preempt`).
2. :meth:`Scheduler._schedule_waiting` — then waiting requests in policy
   order, each starting from its prefix-cache hit, until the budget, the
   ``max_num_seqs`` cap or the pool runs out. Skipped entirely in a step that
   preempted (vLLM v1 does the same: admitting would only cause more
   preemption).

Long prompts take whatever budget is left (chunked prefill, Sarathi-Serve,
Agrawal et al., arXiv 2403.02310, §4.1-4.2: decodes are never stalled by a
prefill). With ``long_prefill_token_threshold`` > 0 no request gets more
prompt tokens than that in one step (vLLM's flag of the same name), so the
budget a long prompt leaves admits the requests behind it: a short request
no longer waits for the whole long prompt before its first token.
``num_computed_tokens`` is advanced in :meth:`Scheduler.schedule`
for the tokens handed out (vLLM v1 style), so the next step's schedule already
assumes them computed.

Preemption is by recompute (PagedAttention, arXiv 2309.06180, §4.5): the victim
frees all blocks and goes back to the front of the waiting queue; its prefix,
including generated tokens, is recomputed when it is re-admitted (usually
mostly from the prefix cache).

Head-of-line blocking: a waiting request that does not fit (pool or, with
chunked prefill off, budget) stays at the head and nothing behind it is
admitted that step. This keeps fcfs order strict and avoids starving long
requests. A running request is preempted to admit a waiting one only when
the waiting one outranks it: an interactive request over the batch lane, and
under the ``priority`` policy a request of higher priority (lower value) over
the lowest-priority running one (:meth:`Scheduler._preempt_for`), so a
high-priority request at a full house starts in the next step.

Speculative decoding (:mod:`tokenmill.spec_decode`): speculative tokens are
just extra tokens to verify. A decoding request's draft tokens
(``request.spec_token_ids``, proposed by the runner in the previous step) are
scheduled after its last token; they count in the token budget and get KV
slots. They are cut so that the request can never pass ``max_model_len`` or
``max_tokens`` even if all are accepted, to the budget left, and to the
dynamic draft length for the current batch size
(``num_speculative_tokens_per_batch_size``); when the pool cannot hold them the
drafts are dropped before anything is preempted. After verification
``num_computed_tokens`` rolls back over the rejected positions (their slots
are overwritten later; only full blocks of accepted tokens are ever hashed
into the prefix cache, because rejected drafts never enter
``all_token_ids``).

Running requests are served in admission order, so with
``max_num_batched_tokens < max_num_seqs`` the last running requests may get
no token in a step (as in vLLM); keep the budget at least ``max_num_seqs``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.kv_cache_manager import KVCacheManager, cdiv
from tokenmill.core.prefix_cache import PrefixCacheStats, update_block_hashes
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import FCFSQueue, LanedQueue, PriorityQueue
from tokenmill.core.spec_decode_stats import SpecDecodingStats
from tokenmill.core.step_budget import MAX_HOLD_S, StepBudget, plan_step
from tokenmill.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)


class RequestRejectedError(ValueError):
    """A request can never be served (empty prompt, too long for the context, or larger than the whole KV pool)."""


# Most remaining-output-token counts of running requests reported in a QueueState.
MAX_REMAINING_REPORTED = 256


@dataclass
class QueueState:
    """The scheduler's queues in tokens still to compute, for admission control (plain data).

    Attributes:
        waiting_by_priority: interactive waiting requests, ``{priority: (requests, tokens)}``;
            tokens are those still to prefill (the prompt, plus generated
            tokens for a preempted request; prefix-cache hits not deducted).
        batch_waiting: batch-lane waiting requests and their tokens, ``(requests, tokens)``.
        running_prefill: running interactive requests still in prefill: ``(requests, tokens left)``.
        batch_running_prefill: the same for running batch-lane requests.
        num_decoding: running requests past their prompt (one token per step each).
        num_batch_running: running batch-lane requests (decoding or not).
        remaining_output_tokens: tokens each running request may still generate
            (``max_tokens`` minus generated; EOS may end it sooner), ascending,
            at most :data:`MAX_REMAINING_REPORTED` entries.
        max_num_seqs: the running-set cap.
        max_num_batched_tokens: the per-step token budget.
    """

    waiting_by_priority: dict[int, tuple[int, int]] = field(default_factory=dict)
    batch_waiting: tuple[int, int] = (0, 0)
    running_prefill: tuple[int, int] = (0, 0)
    batch_running_prefill: tuple[int, int] = (0, 0)
    num_decoding: int = 0
    num_batch_running: int = 0
    remaining_output_tokens: list[int] = field(default_factory=list)
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes.

    Args:
        scheduler_config: budget (``max_num_batched_tokens``), ``max_num_seqs``,
            policy (``fcfs`` or ``priority``), ``enable_chunked_prefill``.
        cache_config: ``block_size`` and ``enable_prefix_caching``.
        max_model_len: context limit in tokens (prompt + output).
        num_kv_blocks: KV pool size in blocks.
        speculative_config: enables draft tokens (None: off).
        kv_connector: a KV connector's scheduler side (prefill-decode disaggregation, see
            :mod:`tokenmill.kv_transfer.base`; duck-typed, the core imports no connector). None: off.
            A waiting request whose prompt K/V the connector can load waits in
            ``WAITING_FOR_REMOTE_KVS`` (holding its blocks, taking no seat and no budget) while the
            load runs; when it completes its ``num_computed_tokens`` jumps to the end of the loaded
            prompt (the last prompt token is always computed, for its logits); when it fails the
            request recomputes its prompt. A finished request the connector keeps for a consumer
            holds its blocks until :meth:`update_from_kv_connector` reports them sent.
        structured_output: the engine's structured-output manager
            (:class:`tokenmill.structured_output.manager.StructuredOutputManager`, duck-typed). A
            constrained request waits in ``WAITING_FOR_FSM`` (no seat, no budget, no blocks) while its
            grammar compiles, then joins the waiting queue; a constraint that fails to compile (or
            compiles past the time limit) finishes it with an error (400). Emitted tokens advance its
            matcher; the grammar's forced tokens become its next drafts (``Request.spec_forced``; at
            most ``num_forced_draft_tokens``) and a proposer's drafts are cut to what the grammar allows.
            None: constrained requests are rejected.

    Attributes:
        kv_cache_manager: the :class:`KVCacheManager` this scheduler owns.
        requests: every unfinished request by id.
        running: running requests in admission order.

    Raises:
        ValueError: ``max_model_len <= 0`` or ``num_kv_blocks <= 0``.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 max_model_len: int, num_kv_blocks: int,
                 speculative_config: SpeculativeConfig | None = None, kv_connector: Any = None,
                 structured_output: Any = None, max_loras: int = 0, lora_ready: Any = None) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {max_model_len}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # prompt tokens one request may take per step (0: the whole budget); only with chunked prefill
        self.long_prefill_cap = scheduler_config.long_prefill_token_threshold if self.enable_chunked_prefill else 0
        self.policy = scheduler_config.scheduling_policy
        # step-latency budget (tokenmill.core.step_budget): the engine core sets ``step_timing`` to its step-time
        # model's snapshot function; None (or a target of 0) schedules by the token budget and seats alone
        self.target_step_latency_ms = scheduler_config.target_step_latency_ms
        self.step_timing: Any = None
        self.last_step_budget: StepBudget | None = None
        self._max_running = self.max_num_seqs
        self._clock = time.monotonic
        self._queued_at: dict[str, float] = {}   # request id -> when it was added (until first admitted)
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, self.block_size, cache_config.enable_prefix_caching)

        self.requests: dict[str, Request] = {}
        self._seq_counter = itertools.count()
        self._seq_of: dict[str, int] = {}
        self.waiting = LanedQueue(
            (lambda: PriorityQueue(self._seq_of)) if self.policy == "priority" else FCFSQueue)
        self.running: list[Request] = []
        self._num_waiting_tokens = 0
        # Finished or aborted since the last schedule(): reported to the runner.
        self._finished_req_ids: set[str] = set()
        # Outputs of requests that finished without running (max_tokens == 0).
        self._pending_outputs: list[EngineCoreOutput] = []
        self._num_preemptions_total = 0
        # requests scheduled in the step being built (schedule() resets it)
        self._step_scheduled: dict[str, ScheduledRequest] = {}
        self.spec_config = speculative_config
        # A draft model writes its K/V for the drafts it proposes after a step: keep that many slots spare.
        self.num_lookahead_tokens = (speculative_config.num_speculative_tokens
                                     if speculative_config and speculative_config.method == "draft_model" else 0)
        self.spec_stats = SpecDecodingStats()
        self._spec_k = 0  # draft length allowed in the step being scheduled
        self.kv_connector = kv_connector
        # requests whose prompt K/V a connector is loading (status WAITING_FOR_REMOTE_KVS)
        self.waiting_for_remote: dict[str, Request] = {}
        # finished requests whose blocks stay held: kept for a consumer to pull, or aborted while
        # loading (the load thread may still write into them until it reports)
        self._kv_held: dict[str, Request] = {}
        # LoRA: at most max_loras distinct adapters in a step (0: no adapters); lora_ready(request) ->
        # (resident, error) asks the runner whether the adapter is loaded (starting its load when not)
        self.max_loras = max_loras
        self.lora_ready = lora_ready
        # prompt tokens by where their K/V came from (vLLM's prompt_tokens_by_source)
        self.prompt_tokens_by_source = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self.structured_output = structured_output
        # requests whose grammar is compiling (status WAITING_FOR_FSM)
        self.waiting_for_grammar: dict[str, Request] = {}
        # grammar-forced drafts: not with a draft model (its drafts carry the q the rejection rule needs)
        self._forced_k = (structured_output.num_forced_draft_tokens
                          if structured_output is not None and self.num_lookahead_tokens == 0 else 0)
        self._forced_max_batch = getattr(structured_output, "forced_draft_max_batch", 1 << 30)
        self._forced_k_step = 0     # forced-draft length allowed in the step being scheduled

    # -- accessors -----------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the requests in the waiting queue (preempted ones included)."""
        return self._num_waiting_tokens

    @property
    def num_preemptions_total(self) -> int:
        """Preemptions since start."""
        return self._num_preemptions_total

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks referenced by a request, in [0, 1]."""
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache queries and hits, in tokens."""
        return self.kv_cache_manager.prefix_cache_stats

    def queue_state(self) -> QueueState:
        """The queues in tokens still to compute, for admission control (O(running requests))."""
        by_prio: dict[int, tuple[int, int]] = {}
        batch_waiting = [0, 0]
        for (is_batch, prio), (n, tokens) in self.waiting.counts.items():
            if is_batch:
                batch_waiting[0] += n
                batch_waiting[1] += tokens
            else:
                by_prio[prio] = (n, tokens)
        pf = [0, 0]
        bpf = [0, 0]
        decoding = num_batch = 0
        remaining: list[int] = []
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens
            if left > 1:
                acc = bpf if r.batch else pf
                acc[0] += 1
                acc[1] += left
            else:
                decoding += 1
            num_batch += r.batch
            if r.max_tokens is not None:
                remaining.append(max(0, r.max_tokens - r.num_output_tokens))
        remaining.sort()
        # under the step-latency budget the last step's seat cap is the one requests meet
        plan = self.last_step_budget
        seats = min(self.max_num_seqs, plan.max_running) if plan is not None else self.max_num_seqs
        return QueueState(waiting_by_priority=by_prio, batch_waiting=(batch_waiting[0], batch_waiting[1]),
                          running_prefill=(pf[0], pf[1]), batch_running_prefill=(bpf[0], bpf[1]),
                          num_decoding=decoding, num_batch_running=num_batch,
                          remaining_output_tokens=remaining[:MAX_REMAINING_REPORTED],
                          max_num_seqs=seats, max_num_batched_tokens=self.max_num_batched_tokens)

    def has_unfinished_requests(self) -> bool:
        """True while requests wait or run, or outputs of finished ones are still to be returned."""
        return bool(self.requests) or bool(self._pending_outputs) or bool(self._kv_held)

    def reset_prefix_cache(self) -> int:
        """Forget all cached block hashes (see :meth:`KVCacheManager.reset_prefix_cache`)."""
        return self.kv_cache_manager.reset_prefix_cache()

    # -- admission -----------------------------------------------------------
    def _sort_key_arrival(self, req: Request) -> tuple[float, int]:
        return (req.arrival_time, self._seq_of[req.request_id])

    def check_invariants(self) -> list[str]:
        """Problems with the scheduler's and the KV cache's bookkeeping; empty when consistent.

        Every running/waiting request is known, running requests are not
        waiting, and the KV cache's accounting holds
        (:meth:`KVCacheManager.check_invariants`: no leaked blocks).
        """
        problems = []
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        remote = set(self.waiting_for_remote) | set(self.waiting_for_grammar)
        if running & waiting:
            problems.append(f"requests both running and waiting: {sorted(running & waiting)[:5]}")
        if remote & (running | waiting):
            problems.append(f"requests waiting for remote KV and queued: {sorted(remote & (running | waiting))[:5]}")
        unknown = (running | waiting | remote) - set(self.requests)
        if unknown:
            problems.append(f"queued requests the scheduler does not know: {sorted(unknown)[:5]}")
        problems.extend(self.kv_cache_manager.check_invariants(set(self.requests) | set(self._kv_held)))
        return problems

    def add_request(self, request: Request) -> None:
        """Validate, resolve ``request.max_tokens`` and queue the request.

        ``max_tokens`` becomes ``sampling_params.max_tokens`` (None: whatever
        the context leaves, ``max_model_len - num_prompt_tokens``). A request
        with ``max_tokens == 0`` is finished at once with 'length' (no block
        used, no token) and reported by the next :meth:`update_from_output`.

        Raises:
            RequestRejectedError: (the request is not queued; its status
                becomes FINISHED_ERROR and ``request.error`` holds the
                message) when the prompt is empty; when prompt +
                ``max_tokens`` exceeds ``max_model_len`` (with max_tokens
                None: when the prompt leaves no room for one token); when its
                K/V for prompt + max_tokens - 1 tokens needs more blocks than
                the whole pool; when chunked prefill is off and the prompt
                exceeds ``max_num_batched_tokens``; or when its id is already
                in use.
        """
        try:
            self._validate(request)
        except RequestRejectedError as e:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = str(e)
            raise
        self._seq_of[request.request_id] = next(self._seq_counter)
        self._queued_at[request.request_id] = self._clock()
        if request.max_tokens == 0:
            request.status = RequestStatus.FINISHED_LENGTH
            request.num_cached_tokens = 0
            request.finished_time = time.time()
            self._seq_of.pop(request.request_id)
            self._pending_outputs.append(self._make_output(request, []))
            return
        if self.cache_config.enable_prefix_caching:
            update_block_hashes(request, self.block_size)
        self.requests[request.request_id] = request
        if request.sampling_params.structured_outputs is not None:
            request.status = RequestStatus.WAITING_FOR_FSM      # joins the queue once its grammar compiled
            self.waiting_for_grammar[request.request_id] = request
            self.structured_output.add_request(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        self._num_waiting_tokens += request.num_prompt_tokens

    def _validate(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise RequestRejectedError(f"request id {rid!r} is already in use")
        if request.sampling_params.structured_outputs is not None and self.structured_output is None:
            raise RequestRejectedError(f"request {rid!r}: structured outputs are not available in this engine")
        n = request.num_prompt_tokens
        if n == 0:
            raise RequestRejectedError(f"request {rid!r}: the prompt is empty (at least 1 token is required)")
        sp_max = request.sampling_params.max_tokens
        if sp_max is None:
            if n >= self.max_model_len:
                raise RequestRejectedError(
                    f"request {rid!r}: the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                    f"and at least 1 token must be generated (prompt must be at most {self.max_model_len - 1} tokens)")
            max_tokens = self.max_model_len - n
        else:
            if n + sp_max > self.max_model_len:
                raise RequestRejectedError(
                    f"request {rid!r}: prompt ({n} tokens) + max_tokens ({sp_max}) = {n + sp_max} tokens "
                    f"exceeds max_model_len ({self.max_model_len})")
            max_tokens = sp_max
        # The last generated token is never fed back, so at most n + max_tokens - 1 tokens hold K/V.
        num_blocks = cdiv(n + max_tokens - 1, self.block_size) if max_tokens > 0 else 0
        pool = self.kv_cache_manager.num_blocks
        if num_blocks > pool:
            raise RequestRejectedError(
                f"request {rid!r}: prompt ({n} tokens) + max_tokens ({max_tokens}) needs {num_blocks} KV blocks "
                f"of {self.block_size} tokens, but the whole KV cache has only {pool} blocks "
                f"({pool * self.block_size} tokens); lower max_tokens or shorten the prompt")
        if not self.enable_chunked_prefill and max_tokens > 0 and n > self.max_num_batched_tokens:
            raise RequestRejectedError(
                f"request {rid!r}: the prompt has {n} tokens, more than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with chunked prefill disabled")
        request.max_tokens = max_tokens

    # -- scheduling ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build the next step: running requests first, then admissions.

        Side effects: advances ``num_computed_tokens`` of every scheduled
        request by its scheduled tokens; may preempt running requests; moves
        admitted requests to RUNNING.

        Returns:
            a :class:`SchedulerOutput` whose ``total_num_scheduled_tokens`` is
            at most ``max_num_batched_tokens`` and that holds at most
            ``max_num_seqs`` requests; ``finished_req_ids`` lists requests
            finished since the previous call.
        """
        if self.waiting_for_grammar:
            self._poll_grammars()
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        self._step_scheduled = {}
        self._spec_k = self.spec_config.num_tokens_for_batch(len(self.running)) if self.spec_config else 0
        self._forced_k_step = self._forced_k if len(self.running) <= self._forced_max_batch else 0
        # batch lane: while interactive requests wait, running batch prefills only get what is left
        defer = len(self.waiting.interactive) > 0
        self._plan_step_budget()
        budget = self._schedule_running(out, self.max_num_batched_tokens, defer_batch_prefill=defer)
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(out, budget)
        if defer:
            budget = self._schedule_running(out, budget, defer_batch_prefill=False)
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        if self.spec_config:
            out.num_spec_tokens = self.spec_config.num_tokens_for_batch(len(self.running))
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta()
        return out

    def _plan_step_budget(self) -> None:
        """Seat limit of the step being built from the step-latency target
        (:func:`~tokenmill.core.step_budget.plan_step`); ``max_num_seqs`` when it is off or nothing was measured."""
        plan = None
        if self.step_timing is not None and self.target_step_latency_ms > 0:
            plan = plan_step(self.step_timing(), self.target_step_latency_ms, self.max_num_seqs)
        self.last_step_budget = plan
        self._max_running = min(plan.max_running, self.max_num_seqs) if plan else self.max_num_seqs

    def _held_too_long(self, req: Request) -> bool:
        """True when the step budget's seat cap has held ``req`` back longer than :data:`MAX_HOLD_S` since it
        was added (a preempted request, admitted before, is never held: True)."""
        t = self._queued_at.get(req.request_id)
        return t is None or self._clock() - t > MAX_HOLD_S

    def _poll_grammars(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose compile failed."""
        for rid, req in list(self.waiting_for_grammar.items()):
            state = self.structured_output.poll(req)
            if state is None:
                continue
            del self.waiting_for_grammar[rid]
            if state == "ready":
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
                self._num_waiting_tokens += req.num_prompt_tokens
                continue
            req.status = RequestStatus.FINISHED_ERROR
            req.error = state
            self._finish(req, notify_connector=False)
            self._pending_outputs.append(self._make_output(req, []))

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """How many of ``req.spec_token_ids`` ride along with its ``n`` new tokens this step.

        Zero unless the step reaches the request's last token; otherwise cut
        by the dynamic draft length, the budget left after ``n``, and so that
        even with every draft accepted plus the target's token the request
        stays within ``max_tokens`` and ``max_model_len``.
        """
        if not req.spec_token_ids or req.num_computed_tokens + n != req.num_tokens:
            return 0
        k = min(len(req.spec_token_ids), self._forced_k_step if req.spec_forced else self._spec_k, budget - n,
                self.max_model_len - req.num_tokens - 1)
        if req.max_tokens is not None:
            k = min(k, req.max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _schedule_running(self, out: SchedulerOutput, budget: int, defer_batch_prefill: bool = False) -> int:
        """Give each running request its next token (plus drafts) or prompt chunk; preempt when the pool is full.

        Requests already scheduled in this step are skipped. With
        ``defer_batch_prefill``, batch-lane requests with more than one token
        to compute (a prompt chunk or a recompute) are skipped too; the
        second pass in :meth:`schedule` gives them the budget interactive
        admissions left.

        Returns:
            the budget left.
        """
        scheduled = self._step_scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if req.request_id in scheduled or (defer_batch_prefill and req.batch and left > 1):
                i += 1
                continue
            n = self._capped(min(left, budget))
            if n <= 0:
                i += 1
                continue
            k = self._num_drafts(req, n, budget)
            lookahead = self.num_lookahead_tokens if n == left else 0
            preempted_self = False
            while self.kv_cache_manager.allocate_slots(req, n + k + lookahead) is None:
                if k or lookahead:
                    k = lookahead = 0  # drafts are optional: drop them before preempting anyone
                    continue
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1  # an earlier request: the list shifts left
                budget += self._preempt(victim, out, scheduled)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break  # the request being scheduled was itself preempted
            sr = self._scheduled(req, n, new=False, num_drafts=k)
            scheduled[req.request_id] = sr
            out.scheduled.append(sr)
            budget -= n + k
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in policy order while budget, seats and blocks last.

        Interactive requests come first (:class:`~tokenmill.core.request_queue.LanedQueue`); when one finds
        no seat or no blocks, running batch-lane requests are preempted for it
        (latest first), so batch work only holds capacity interactive traffic
        does not need; under the ``priority`` policy, then running requests of
        lower priority (:meth:`_preempt_for`).

        Returns:
            the budget left.
        """
        skipped: list[Request] = []     # LoRA: requests whose adapter has no slot or is loading yet
        lora = _LoRAAdmission(self) if self.max_loras else None
        while len(self.waiting) and budget > 0:
            req = self.waiting.peek()
            if lora is not None and req.lora_request is not None:
                verdict = lora.admissible(req)
                if verdict is False and lora.no_slot and not req.batch:
                    # an interactive request takes an adapter slot held only by the batch lane
                    refund = self._preempt_batch_adapter(out, lora)
                    if refund is not None:
                        budget += refund
                        continue
                if verdict is not True:
                    self.waiting.pop()
                    if verdict is None:     # its adapter failed to load: fail it (400), never block the queue
                        self._num_waiting_tokens -= req.num_prompt_tokens
                        req.status = RequestStatus.FINISHED_ERROR
                        req.error = lora.error
                        req.finished_time = time.time()
                        self._finish(req, notify_connector=False)
                        self._decline_remote_kv(req)     # P/D consumer: the producer frees its copy now
                        self._pending_outputs.append(self._make_output(req, []))
                    else:
                        skipped.append(req)
                    continue
            if len(self.running) >= self._max_running and not (
                    len(self.running) < self.max_num_seqs and self._held_too_long(req)):
                # max_num_seqs, or fewer under the step budget (which holds a request back MAX_HOLD_S at most)
                refund = self._preempt_for(req, out)
                if refund is None:
                    break
                budget += refund
                continue
            holds_blocks = req.request_id in self.kv_cache_manager.req_to_blocks   # its K/V was loaded
            if holds_blocks:
                hit_blocks, num_hit = [], req.num_computed_tokens
            else:
                # cached positions have no logits: a request that still needs prompt logprobs computes its prompt
                hit_blocks, num_hit = (([], 0) if req.needs_prompt_logprobs
                                       else self.kv_cache_manager.get_computed_blocks(req))
                if self.kv_connector is not None and not req.kv_load_attempted:
                    started = self._start_remote_load(req, hit_blocks, num_hit)
                    if started is None:     # no blocks for the load: wait, as any admission would
                        refund = self._preempt_for(req, out)
                        if refund is None:
                            if self._release_loaded_waiting(req):
                                continue
                            break
                        budget += refund
                        continue
                    if started:
                        continue
            n = self._capped(req.num_tokens - num_hit)
            if n > budget:
                # Without chunked prefill, a request wider than the whole budget (only possible
                # after preemption, since add_request rejects such prompts) is chunked anyway.
                if not self.enable_chunked_prefill and n <= self.max_num_batched_tokens:
                    break
                n = budget
            # a draft model writes K/V for its first drafts right after the prompt's last chunk
            lookahead = self.num_lookahead_tokens if num_hit + n == req.num_tokens else 0
            alloc_hit = 0 if holds_blocks else num_hit
            if (self.kv_cache_manager.allocate_slots(req, n + lookahead, hit_blocks, alloc_hit) is None
                    and (not lookahead or self.kv_cache_manager.allocate_slots(req, n, hit_blocks, alloc_hit) is None)):
                refund = self._preempt_for(req, out)
                if refund is None:
                    if self._release_loaded_waiting(req):
                        continue
                    break
                budget += refund
                continue
            self.waiting.pop()
            self._num_waiting_tokens -= req.num_prompt_tokens
            self._queued_at.pop(req.request_id, None)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self.prompt_tokens_by_source["local_cache_hit"] += min(num_hit, req.num_prompt_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.num_computed_tokens = num_hit
            sr = self._scheduled(req, n, new=True)
            self._step_scheduled[req.request_id] = sr
            out.scheduled.append(sr)
            budget -= n
            if lora is not None:
                lora.admitted(req)
        for req in reversed(skipped):     # back in front, in their order: they keep their age
            self.waiting.add_front(req)
        return budget

    def _release_loaded_waiting(self, head: Request) -> bool:
        """Nothing runs and ``head``, first in the waiting queue, finds no blocks: free the blocks of the
        last waiting request whose K/V a connector loaded (the KV offloading tier, a P/D pull). Such a
        request holds its blocks while it queues, and a preemption puts its victims in front of it, so
        without this the victim at the head waits for blocks only the requests behind it hold, and the
        engine stops (seen with the tier: six requests, 8-token steps, a 24-block pool). The freed blocks
        stay in the prefix cache: the released request finds them again unless they are evicted first
        (then the tier, or a recompute). It counts as a preemption. True if one was released."""
        if self.running:
            return False          # running requests finish or preempt each other: blocks come back
        for req in reversed(list(self.waiting)):
            if req is not head and req.request_id in self.kv_cache_manager.req_to_blocks:
                # a preemption by recompute of a request that had not run yet (a P/D pull is not repeated:
                # the producer may have freed its copy; a tier lookup is, as for any preempted request)
                self.kv_cache_manager.free(req)
                req.status = RequestStatus.PREEMPTED
                req.num_computed_tokens = 0
                req.num_external_tokens = 0
                req.kv_load_attempted = False
                req.num_preemptions += 1
                self._num_preemptions_total += 1
                return True
        return False

    def _start_remote_load(self, req: Request, hit_blocks: list, num_hit: int) -> bool | None:
        """Ask the KV connector about ``req``; start an asynchronous load of its prompt when it can.

        Returns:
            True: the request left the waiting queue for ``WAITING_FOR_REMOTE_KVS``; False: nothing to
            load (admit it as usual); None: the pool has no blocks for the load now.
        """
        num_ext, load_async = self.kv_connector.get_num_new_matched_tokens(req, num_hit)
        if num_ext <= 0 or not load_async:
            return False
        if self.kv_cache_manager.allocate_slots(req, num_ext, hit_blocks, num_hit) is None:
            return None
        req.kv_load_attempted = True
        self.waiting.pop()
        self._num_waiting_tokens -= req.num_prompt_tokens
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:       # first admission (a preempted request keeps its figure)
            req.num_cached_tokens = num_hit
        self.prompt_tokens_by_source["local_cache_hit"] += num_hit
        req.num_external_tokens = num_ext
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[req.request_id] = req
        self.kv_connector.update_state_after_alloc(req, self.kv_cache_manager.get_block_ids(req.request_id), num_ext)
        return True

    def update_from_kv_connector(self, finished_sending: Iterable[str], finished_recving: Iterable[str],
                                 failed_recving: Iterable[str]) -> None:
        """Apply the connector's finished transfers (:meth:`KVConnectorBase.get_finished`).

        * sent (or expired): the held blocks of a finished request return to the pool;
        * loaded: ``num_computed_tokens`` jumps to the end of the loaded tokens (at most the prompt
          minus its last token, which is computed for its logits); the full blocks enter the
          prefix cache and the request goes back to the front of the waiting queue, where it is
          admitted holding its blocks;
        * failed: its blocks are freed and it recomputes its prompt from scratch (counted in the
          connector's ``num_recomputed``).

        An aborted request's blocks are freed whichever way its load ended.
        """
        for rid in finished_sending:
            req = self._kv_held.pop(rid, None)
            if req is not None:
                self.kv_cache_manager.free(req)
        for ok, ids in ((True, finished_recving), (False, failed_recving)):
            for rid in ids:
                held = self._kv_held.pop(rid, None)
                if held is not None:        # aborted while loading
                    self.kv_cache_manager.free(held)
                    continue
                req = self.waiting_for_remote.pop(rid, None)
                if req is None:
                    continue
                if ok:
                    n = min(req.num_computed_tokens + req.num_external_tokens, req.num_tokens - 1)
                    self.prompt_tokens_by_source["external_kv_transfer"] += max(0, n - req.num_computed_tokens)
                    if req.num_preemptions == 0:   # loaded tokens are cached tokens in usage (as vLLM counts them)
                        req.num_cached_tokens = max(req.num_cached_tokens, 0) + max(0, n - req.num_computed_tokens)
                    req.num_computed_tokens = n
                    self.kv_cache_manager.cache_blocks(req, n)
                else:
                    self.kv_cache_manager.free(req)
                    req.num_computed_tokens = 0
                    req.num_cached_tokens = -1
                    req.num_external_tokens = 0
                    stats = getattr(self.kv_connector, "stats", None)
                    if stats is not None:
                        stats.num_recomputed += 1
                req.status = RequestStatus.WAITING
                self.waiting.add_front(req)
                self._num_waiting_tokens += req.num_prompt_tokens

    def _preempt_for(self, req: Request, out: SchedulerOutput) -> int | None:
        """Preempt one running request to give the waiting ``req`` a seat or blocks; the budget it frees,
        None when no running request may yield to ``req``.

        An interactive ``req`` takes from the batch lane first (:meth:`_preempt_batch`). Under the
        ``priority`` policy it then takes from the lowest-priority running request of strictly lower
        priority (larger value; latest arrival first among equals; a batch-lane ``req`` only from the
        batch lane), preempted by recompute like any victim: its output so far is kept and it
        resumes when it is re-admitted. Without this a high-priority request at a full house waits
        for a seat to free (issue 30: 5 s, about the low-priority requests' whole run); vLLM v1
        preempts by priority only when blocks run out.
        """
        if not req.batch:
            refund = self._preempt_batch(out)
            if refund is not None:
                return refund
        if self.policy != "priority":
            return None
        victims = [r for r in self.running if r.priority > req.priority and (r.batch or not req.batch)]
        if not victims:
            return None
        victim = max(victims, key=lambda r: (r.batch, r.priority, *self._sort_key_arrival(r)))
        return self._preempt(victim, out, self._step_scheduled)

    def _preempt_batch(self, out: SchedulerOutput) -> int | None:
        """Preempt the lowest-priority, latest running batch-lane request; the budget it frees, None if none runs."""
        victims = [r for r in self.running if r.batch]
        if not victims:
            return None
        victim = max(victims, key=lambda r: (r.priority if self.policy == "priority" else 0,
                                             *self._sort_key_arrival(r)))
        return self._preempt(victim, out, self._step_scheduled)

    def _preempt_batch_adapter(self, out: SchedulerOutput, lora: "_LoRAAdmission") -> int | None:
        """Free an adapter slot for an interactive request: preempt every running request of the adapter
        whose running requests are all batch-lane (the one whose latest arrived last); the budget they
        free, None when every slot holder runs interactive work (the request waits and ages)."""
        holders: dict[int, list[Request]] = {}
        for r in self.running:
            if r.lora_request is not None:
                holders.setdefault(r.lora_int_id, []).append(r)
        cands = [lid for lid, rs in holders.items() if all(r.batch for r in rs)]
        if not cands:
            return None
        lid = max(cands, key=lambda k: max(self._sort_key_arrival(r) for r in holders[k]))
        refund = sum(self._preempt(r, out, self._step_scheduled) for r in holders[lid])
        lora.active.discard(lid)
        return refund

    def _capped(self, n: int) -> int:
        """``n`` new tokens limited to ``long_prefill_token_threshold`` (when set, with chunked prefill)."""
        return self.long_prefill_cap if 0 < self.long_prefill_cap < n else n

    def _scheduled(self, req: Request, n: int, new: bool, num_drafts: int = 0) -> ScheduledRequest:
        start = req.num_computed_tokens
        drafts = req.spec_token_ids[:num_drafts]
        req.spec_token_ids = []  # consumed (or dropped); the runner proposes afresh after this step
        sr = ScheduledRequest(
            req_id=req.request_id,
            token_ids=req.all_token_ids[start:start + n] + drafts,
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
            sample=start + n == req.num_tokens,
            sampling_params=req.sampling_params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            new=new,
            prompt_logprobs=req.sampling_params.prompt_logprobs
            if req.needs_prompt_logprobs and start < req.num_prompt_tokens - 1 else None,
            spec_token_ids=drafts,
            lora_request=req.lora_request,
        )
        req.num_computed_tokens = start + n + num_drafts
        if start < req.num_prompt_tokens:
            self.prompt_tokens_by_source["local_compute"] += min(start + n, req.num_prompt_tokens) - start
        return sr

    def _pick_victim(self) -> Request:
        """Batch lane first, then lowest priority (largest value; priority policy only), then latest arrival."""
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.batch, r.priority, *self._sort_key_arrival(r)))
        return max(self.running, key=lambda r: (r.batch, *self._sort_key_arrival(r)))

    def _preempt(self, victim: Request, out: SchedulerOutput,
                 scheduled: dict[str, ScheduledRequest]) -> int:
        """Preempt by recompute: free all blocks, back to the front of the waiting queue.

        Returns:
            budget refunded (tokens the victim had been given this step).
        """
        refund = 0
        sr = scheduled.pop(victim.request_id, None)
        if sr is not None:
            out.scheduled.remove(sr)
            refund = sr.num_scheduled_tokens
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.kv_load_attempted = False    # an offloading tier may hold what the victim's blocks held
        victim.spec_forced = False
        victim.num_preemptions += 1
        self._num_preemptions_total += 1
        self.waiting.add_front(victim)
        self._num_waiting_tokens += victim.num_prompt_tokens
        out.preempted_req_ids.append(victim.request_id)
        return refund

    # -- results -------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, register newly full blocks, apply stop rules, free finished requests.

        Stop rules, in order, after each appended token: EOS (unless
        ``ignore_eos``; ``request.eos_token_id`` may be an int or a list) and
        then ``stop_token_ids`` (``stop_reason`` = the id) finish as 'stop',
        both ignored while fewer than ``min_tokens`` tokens were generated;
        then ``max_tokens`` reached and ``num_tokens == max_model_len``
        finish as 'length' (these two apply regardless of ``min_tokens``,
        so a request never exceeds the context).

        With speculative decoding a request may get several tokens (its
        accepted drafts and the target's token): they are appended one at a
        time with the stop rules checked after each, exactly as without
        speculation, and a stop drops the rest. ``num_computed_tokens`` rolls
        back over the rejected drafts, the speculative-decoding counters are
        updated, and the next drafts are stored on the request.

        Returns:
            one :class:`EngineCoreOutput` per request that got a token or
            finished (including earlier ``max_tokens == 0`` finishes).
            Requests finished or aborted between :meth:`schedule` and this
            call are skipped.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        sampled = dict(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids))
        logprobs = dict(zip(model_runner_output.req_ids, model_runner_output.logprobs))
        prompt_lps = model_runner_output.prompt_logprobs
        verified = model_runner_output.verified_token_ids
        verified_lps = model_runner_output.verified_logprobs
        drafts = model_runner_output.draft_token_ids
        finished_any = False
        for sr in scheduler_output.scheduled:
            req = self.requests.get(sr.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            if sr.req_id in prompt_lps and req.prompt_logprobs is not None:
                first, entries = prompt_lps[sr.req_id]
                have = len(req.prompt_logprobs)          # entries for prompt tokens 1 .. have
                req.prompt_logprobs.extend(entries[max(0, have + 1 - first):])  # a recompute repeats some
            token = sampled.get(sr.req_id)
            if token is None:
                self.kv_cache_manager.cache_blocks(req)
                continue
            tokens = verified.get(sr.req_id) or [int(token)]
            lps = verified_lps.get(sr.req_id) or [logprobs.get(sr.req_id)]
            num_drafts = len(sr.spec_token_ids)
            if num_drafts:
                num_accepted = len(tokens) - 1
                if req.spec_forced:
                    self.structured_output.observe_forced(num_drafts, num_accepted)
                else:
                    self.spec_stats.observe(num_drafts, num_accepted)
                req.num_computed_tokens -= num_drafts - num_accepted  # roll back over the rejected drafts
            emitted: list[int] = []
            for t in tokens:
                req.append_output_token_ids(int(t))
                emitted.append(int(t))
                if self._check_stop(req):
                    break
            constrained = self.structured_output is not None and self.structured_output.has(req.request_id)
            if constrained and self.structured_output.accept(req, emitted) and not req.is_finished:
                req.status = RequestStatus.FINISHED_STOPPED   # the grammar is complete: nothing may follow
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.kv_cache_manager.cache_blocks(req)
            if req.first_token_time is None:
                req.first_token_time = time.time()
            if req.is_finished:
                self._finish(req)
                finished_any = True
            elif constrained:
                proposed = drafts.get(sr.req_id)
                max_forced = self._forced_k if len(self.running) <= self._forced_max_batch else 0
                if proposed or max_forced:
                    req.spec_token_ids, req.spec_forced = self.structured_output.drafts(
                        req, list(proposed or ()), max_forced)
                else:       # nothing to draft (what drafts() returns then), without a call per row
                    req.spec_token_ids, req.spec_forced = [], False
            else:
                req.spec_token_ids = list(drafts.get(sr.req_id, ()))
            outputs.append(self._make_output(req, emitted, list(lps[:len(emitted)])))
        if finished_any:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _check_stop(self, req: Request) -> bool:
        """Set status/stop_reason and return True when ``req`` must stop after its last token."""
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in _eos_ids(req.eos_token_id):
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in sp.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        if (req.max_tokens is not None and req.num_output_tokens >= req.max_tokens) \
                or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _decline_remote_kv(self, req: Request) -> None:
        """A decode server's request that ends before its KV load (its LoRA adapter failed to load): tell
        each connector able to (``decline``: the P/D pull connector) so the producer frees the KV it keeps."""
        if self.kv_connector is None:
            return
        for conn in getattr(self.kv_connector, "connectors", [self.kv_connector]):
            decline = getattr(conn, "decline", None)
            if decline is not None:
                decline(req)

    def _finish(self, req: Request, notify_connector: bool = True) -> None:
        """Free blocks and forget a request whose status is already a finished one.

        With a KV connector (and ``notify_connector``) the connector may keep the blocks for a consumer.
        """
        req.finished_time = time.time()
        delay_free = False
        if self.kv_connector is not None and notify_connector:
            delay_free, req.kv_transfer_params_out = self.kv_connector.request_finished(
                req, self.kv_cache_manager.get_block_ids(req.request_id))
        if delay_free:
            self._kv_held[req.request_id] = req     # freed when the connector reports it sent
        else:
            self.kv_cache_manager.free(req)
        if self.structured_output is not None:
            self.structured_output.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._seq_of.pop(req.request_id, None)
        self._queued_at.pop(req.request_id, None)
        self._finished_req_ids.add(req.request_id)

    def _make_output(self, req: Request, tokens: list[int], lps: list | None = None) -> EngineCoreOutput:
        prompt_lps = None
        if req.prompt_logprobs is not None and (tokens or req.is_finished) and not req.needs_prompt_logprobs:
            prompt_lps, req.prompt_logprobs = [None, *req.prompt_logprobs], None   # sent once, with the first token
        return EngineCoreOutput(
            prompt_logprobs=prompt_lps,
            req_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=lps if lps is not None else [None] * len(tokens),
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=req.error,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_preemptions=req.num_preemptions,
            kv_transfer_params=req.kv_transfer_params_out if req.is_finished else None,
        )

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, or stop on a stop string), waiting or running.

        All their blocks return to the pool; ids that are unknown or already
        finished are ignored. No output is emitted (the caller knows); the
        ids are reported to the runner in the next ``finished_req_ids``.

        Raises:
            ValueError: ``status`` is not a finished status.
        """
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        removed_running = False
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                removed_running = True
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # its load may still write into its blocks: hold them until the connector reports
                del self.waiting_for_remote[rid]
                self.kv_connector.request_aborted_while_loading(req)
                req.status = status
                req.finished_time = time.time()
                self._kv_held[rid] = req
                self.requests.pop(rid, None)
                self._seq_of.pop(rid, None)
                self._finished_req_ids.add(rid)
                continue
            elif req.status == RequestStatus.WAITING_FOR_FSM:
                del self.waiting_for_grammar[rid]
            else:
                self.waiting.remove(req)
                self._num_waiting_tokens -= req.num_prompt_tokens
            req.status = status
            self._finish(req, notify_connector=False)   # no output carries params now: keep nothing
        if removed_running:
            self.running = [r for r in self.running if not r.is_finished]


#: seconds a request may wait for an adapter slot before admissions of the adapters holding the slots
#: stop (base-model requests still run), so the slots drain and it gets one (no starvation)
LORA_AGING_S = 2.0


class _LoRAAdmission:
    """One admission pass's LoRA bookkeeping: at most ``max_loras`` distinct adapters in the step.

    The step holds every running request (they run first), so the adapters of running requests
    hold the slots. A waiting request whose adapter is among them, or that finds a free slot, may
    be admitted once the runner has its adapter resident (``lora_ready``: a load starts in the
    background and the request waits meanwhile); a failed load fails the request (400). A request
    that finds no slot waits; after :data:`LORA_AGING_S` it is *aged*: for the rest of the pass no
    request of an adapter that holds a slot is admitted, so those adapters' requests finish, a
    slot frees and the aged request (first in the queue) takes it. An interactive request that finds
    no slot takes one held only by batch-lane requests at once (they are preempted, as the batch lane
    yields seats and blocks: :meth:`Scheduler._preempt_batch_adapter`).
    """

    def __init__(self, sched: "Scheduler") -> None:
        self.sched = sched
        self.active = {r.lora_int_id for r in sched.running if r.lora_request is not None}
        self.drain = False
        self.now = time.time()
        self.error = ""
        self.no_slot = False    # the last admissible() found no free slot for the request's adapter

    def admissible(self, req: Request) -> bool | None:
        """True: admit it (if seats, budget and blocks allow); False: it waits; None: its adapter
        failed to load (:attr:`error` says why)."""
        lid = req.lora_int_id
        s = self.sched
        self.no_slot = False
        if lid not in self.active:
            if len(self.active) >= s.max_loras:
                self.no_slot = True
                if req.lora_wait_since is None:
                    req.lora_wait_since = self.now
                if self.now - req.lora_wait_since >= LORA_AGING_S:
                    self.drain = True
                return False
        elif self.drain:
            return False
        if s.lora_ready is None:
            return True
        ready, error = s.lora_ready(req)
        if error is not None:
            self.error = f"LoRA adapter {getattr(req.lora_request, 'lora_name', lid)!r} failed to load: {error}"
            return None
        if not ready and req.lora_wait_since is None:
            req.lora_wait_since = self.now
        return ready

    def admitted(self, req: Request) -> None:
        if req.lora_request is not None:
            self.active.add(req.lora_int_id)
            req.lora_wait_since = None


def _eos_ids(eos: int | Iterable[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(eos)
