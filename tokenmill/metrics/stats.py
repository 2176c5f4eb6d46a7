"""Front-end statistics: what the API process measures per batch of core outputs.

The engine core reports its own state (:class:`EngineStats`:
queue lengths, KV usage, prefix-cache counters); the front end adds what only
it sees — tokens streamed, time to first token, inter-token latency and
per-request phase times — as one :class:`IterationStats` per output batch. Stat
loggers (the Prometheus exporter, the periodic log line, admission control)
implement :class:`StatLogger` and receive both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.core.scheduler import QueueState
from tokenmill.metrics.step_timing import StepTimingSnapshot
from tokenmill.core.spec_decode_stats import SpecDecodingStats
from tokenmill.core.kv_transfer_stats import KVTransferStats
from tokenmill.core.kv_offload_stats import KVOffloadStats
from tokenmill.structured_output.manager import StructuredOutputStats


@dataclass
class EplbStats:
    """Expert-parallel load balancing (``--enable-eplb``) as the engine reports it.

    Loads count (token, expert) assignments — each token adds ``top_k``.

    Attributes:
        num_ranks: expert-parallel ranks.
        num_moe_layers: MoE layers.
        num_logical_experts, num_physical_experts: per layer (physical =
            logical + redundant slots).
        window_steps: engine steps the load window holds now.
        load_layers: the ``layer`` label of each row of ``expert_load``: the
            layer index, or ``"all"`` (every layer summed) when layers x
            experts would exceed :data:`EPLB_MAX_LOAD_SERIES` series.
        expert_load: ``[len(load_layers)][num_logical_experts]`` assignments
            routed to each logical expert over the window.
        imbalance_ratio: measured since the last rebalance: sum over layers of
            the busiest rank's assignments / sum over layers of the mean rank's
            (1.0 = balanced; always 1.0 with one rank). Until a step has run
            after a rebalance it stays the value measured before it.
        rank_load_total: ``[num_moe_layers][num_ranks]`` assignments each rank
            computed since start (measured; differences between two snapshots
            give the imbalance over any range of steps).
        expert_imbalance_ratio: the same over logical experts (routing skew).
        imbalance_before: measured ``imbalance_ratio`` just before the last
            rebalance (None before the first).
        imbalance_after: predicted for the placement chosen then, on the same
            window (None before the first).
        num_rebalances: rebalances computed (including those that kept the placement).
        num_placement_changes: rebalances that changed the placement.
        num_experts_moved: expert replicas copied into a slot (all ranks) since start.
        rebalance_seconds_total: wall seconds in rebalancing (placement + weight moves).
        last_rebalance_seconds: of the last one.
    """

    num_ranks: int = 1
    num_moe_layers: int = 0
    num_logical_experts: int = 0
    num_physical_experts: int = 0
    window_steps: int = 0
    load_layers: list[str] = field(default_factory=list)
    expert_load: list[list[int]] = field(default_factory=list)
    imbalance_ratio: float = 1.0
    rank_load_total: list[list[int]] = field(default_factory=list)
    expert_imbalance_ratio: float = 1.0
    imbalance_before: float | None = None
    imbalance_after: float | None = None
    num_rebalances: int = 0
    num_placement_changes: int = 0
    num_experts_moved: int = 0
    rebalance_seconds_total: float = 0.0
    last_rebalance_seconds: float = 0.0


# Most (layer, expert) series of ``tokenmill:eplb_expert_load``; beyond it the layers are summed (layer="all").
EPLB_MAX_LOAD_SERIES = 512


@dataclass
class EngineStats:
    """A snapshot of the core for metrics and admission control.

    Attributes:
        num_running: requests in the running set.
        num_waiting: requests queued (including preempted ones).
        num_waiting_tokens: prompt tokens of waiting requests.
        kv_cache_usage: fraction of KV blocks referenced, in [0, 1].
        num_preemptions_total: preemptions since start.
        prefix_cache_queries: prompt tokens looked up in the prefix cache since start.
        prefix_cache_hits: of those, tokens found.
        num_steps: engine steps executed since start.
        last_step_time: seconds of the most recent step (schedule + execute + update).
        last_schedule_time: seconds spent in schedule() + update in that step.
        num_kv_blocks, block_size: pool geometry.
        queue: the scheduler's queues in tokens still to compute, by lane and
            priority, for admission control (None from an engine that does not report it).
        step_timing: the smoothed step-time model: decode step time vs batch
            size and the prefill rate (None likewise).
        spec_decoding: cumulative speculative-decoding counters (None when
            speculative decoding is off).
        eplb: expert load balancing state (None without ``--enable-eplb``).
        kv_transfer: cumulative KV-connector counters (None without ``--kv-transfer-config``).
        kv_offload: the KV offloading tier's counters and occupancy (None without ``--kv-offloading-backend``).
        prompt_tokens_by_source: cumulative prompt tokens by where their K/V came from:
            ``local_compute``, ``local_cache_hit``, ``external_kv_transfer`` (None: not reported).
        structured_outputs: cumulative structured-output counters
            (:class:`tokenmill.structured_output.manager.StructuredOutputStats`; None before the first
            constrained request).
        expert_parallel: with experts shared across data-parallel engine cores, this core's cumulative
            ``steps``, ``dummy_steps`` (no tokens of its own), ``step_seconds`` (its forwards, dummy ones
            included), ``all_to_all_seconds`` (inside the MoE dispatch/combine collectives, waiting for
            the peers included) and ``sync_seconds`` (the per-step agreement); None otherwise.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    last_step_time: float = 0.0
    last_schedule_time: float = 0.0
    num_kv_blocks: int = 0
    block_size: int = 0
    queue: QueueState | None = None
    step_timing: StepTimingSnapshot | None = None
    spec_decoding: SpecDecodingStats | None = None
    eplb: EplbStats | None = None
    kv_transfer: KVTransferStats | None = None
    kv_offload: KVOffloadStats | None = None
    prompt_tokens_by_source: dict[str, int] | None = None
    expert_parallel: dict[str, float] | None = None
    structured_outputs: StructuredOutputStats | None = None
    # LoRA (--enable-lora): {"running": [adapter names], "waiting": [...], "max_lora": n,
    # "requests_total": {adapter name: requests added}}; None without LoRA
    lora: dict | None = None


@dataclass
class FinishedRequestStats:
    """Timings of one finished request (all seconds; 0 when a phase was never reached).

    Attributes:
        finish_reason: 'stop', 'length', 'abort' or 'error'.
        e2e_latency: arrival → finish.
        queued_time: arrival → first scheduled.
        prefill_time: first scheduled → first token.
        decode_time: first token → finish.
        num_prompt_tokens: prompt length in tokens.
        num_generation_tokens: tokens generated over all choices.
        max_tokens_param: the request's max_tokens (None: unbounded).
        request_id: the front end's request id ("" when unknown).
        num_choices: the request's ``n`` (choices decoded side by side; ``num_generation_tokens``
            over ``num_choices`` is the mean per choice, which TPOT divides the decode time by).
    """

    finish_reason: str
    e2e_latency: float = 0.0
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    request_id: str = ""
    num_choices: int = 1


@dataclass
class IterationStats:
    """What one batch of core outputs did, as seen by the front end.

    Attributes:
        num_prompt_tokens: prompt tokens of requests that produced their first token.
        num_generation_tokens: tokens generated in this batch.
        time_to_first_tokens: seconds, arrival → first token, one per request.
        inter_token_latencies: seconds between consecutive token batches of a request.
        finished: requests that finished.
        timestamp: ``time.time()`` when the batch was processed.
        first_tokens: ``(request id, seconds arrival → first token)`` of the
            requests that produced their first token (same values as
            ``time_to_first_tokens``, with ids, e.g. to score TTFT predictions).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    timestamp: float = 0.0
    first_tokens: list[tuple[str, float]] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives the core's snapshot and the front end's iteration stats."""

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Called from the event loop after each output batch; must not block."""
        ...
