"""The engine core: one loop of schedule → execute → update.

It owns the scheduler, the KV cache and the model runner. The offline
:class:`tokenmill.LLM` runs it in-process; the API server runs it in its own
process (:mod:`tokenmill.engine.core_proc`) so that HTTP work never stalls a
step (docs/architecture.md, "Request path").

This module imports no torch: the model runner comes from
:func:`tokenmill.engine.executor.create_executor` (which loads the model) unless
the caller passes its own ``executor`` (tests pass model-free fakes).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import RequestRejectedError, Scheduler
from tokenmill.engine.executor import Executor, create_executor
from tokenmill.kv_transfer import create_connector
from tokenmill.kv_transfer.multi import MultiConnector
from tokenmill.lora.registry import startup_requests
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import EngineStats
from tokenmill.metrics.step_timing import StepTimeModel
from tokenmill.model.default_model import default_model_path
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreRequest:
    """A request as sent from the front end to the core (already tokenized).

    Attributes:
        request_id: unique id (a child id ``"{parent}-{i}"`` when n > 1).
        prompt_token_ids: ``[num_prompt_tokens]`` ids.
        sampling_params: validated parameters (``n`` already expanded).
        arrival_time: ``time.time()`` seconds when the HTTP request arrived.
        priority: lower runs sooner under ``--scheduling-policy priority``.
        cache_salt: isolates this request's prefix-cache entries.
        batch: a batch-lane request (scheduled after interactive ones, never refused).
        lora_request: the LoRA adapter (:class:`tokenmill.lora.request.LoRARequest`), None for the base.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    batch: bool = False
    lora_request: LoRARequest | None = None


class EngineCore:
    """Schedule → execute → update, one step at a time.

    Args:
        config: the engine configuration.
        executor: a model runner; built from ``config`` (loading the model)
            when None.

    Raises:
        ValueError / FileNotFoundError: from model loading (bad path,
            unsupported architecture).
    """

    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 data_parallel_rank: int | None = None, kv_offloading_options: dict | None = None) -> None:
        self.config = config
        kv_transfer = config.cache.kv_transfer   # (its cross-section checks are EngineConfig's)
        if executor is None:
            executor = create_executor(config)
        self.executor = executor
        self.max_model_len = executor.max_model_len
        self.kv_connector = None
        self.pd_connector = None        # --kv-transfer-config (prefill-decode disaggregation)
        self.kv_offload = None          # --kv-offloading-backend (tokenmill.kv_transfer.offloading)
        self._loads_ended = False       # the last _kv_connector_after_step handed ended KV loads to the scheduler
        self._lockstep = hasattr(executor, "step_sync")    # one step per wave of the data-parallel group
        if kv_transfer is not None:
            self.kv_connector = self.pd_connector = self._make_kv_connector(kv_transfer.for_rank(data_parallel_rank or 0))
        if config.cache.kv_offloading_backend is not None:
            from tokenmill.kv_transfer.offloading import create_offloading_connector

            # kv_offloading_options: OffloadingConfig fields (store_policy, min_load_blocks, ...) for benchmarks/tests
            self.kv_offload = create_offloading_connector(config, executor, data_parallel_rank or 0,
                                                          **(kv_offloading_options or {}))
            if self.kv_connector is None:
                self.kv_connector = self.kv_offload
            else:       # P/D first: a request whose KV another engine computed pulls it; the others use the tier
                self.kv_connector = MultiConnector([self.kv_connector, self.kv_offload])
        # LoRA: the runner's adapter manager (uniproc executor: the runner is the executor)
        self.lora_manager = getattr(executor, "lora_manager", None) if config.model.enable_lora else None
        self._lora_loads: list[tuple[Any, Any, Any]] = []     # (token, LoRARequest, future) of runtime loads
        self._lora_results: list[tuple[Any, str | None]] = []
        self._lora_unloading: set[int] = set()
        self._lora_requests_total: dict[str, int] = {}
        if self.lora_manager is not None and config.model.lora_modules:
            # --lora-modules: loaded (and validated) before the core is ready; a bad one names its file
            for lr in startup_requests(list(config.model.lora_module_list)):
                self.lora_manager.load_now(lr)
                logger.info("LoRA adapter %r (%d) loaded from %s", lr.lora_name, lr.lora_int_id, lr.lora_path)
        self.structured_output = self._make_structured_output_manager()
        self.scheduler = Scheduler(config.scheduler, config.cache, self.max_model_len, executor.num_kv_blocks,
                                   speculative_config=config.speculative, kv_connector=self.kv_connector,
                                   structured_output=self.structured_output,
                                   max_loras=config.model.max_loras if self.lora_manager is not None else 0,
                                   lora_ready=self._lora_ready if self.lora_manager is not None else None)
        bind = getattr(self.kv_connector, "bind_kv_cache_manager", None)
        if bind is not None:
            bind(self.scheduler.kv_cache_manager)
        self._pending: list[EngineCoreOutput] = []
        self._num_steps = 0
        self._last_step_time = 0.0
        self._last_schedule_time = 0.0
        self.step_time_model = StepTimeModel()
        # the scheduler's step-latency budget (--target-step-latency-ms) reads the model every step; not under
        # --slo, whose admission sizes the batch against the SLO's own TPOT and predicts the token-budget schedule
        if not getattr(config.scheduler, "slo", None):
            self.scheduler.step_timing = self.step_time_model.snapshot
        # (decode requests, prefill tokens, start, end) of the last step, timed when the next one starts
        # (decoding requests, prefill tokens, start, end, prefill context) of the last step
        self._last_step: tuple[int, int, float, float, int] | None = None

    def _make_kv_connector(self, kv_transfer: Any) -> Any:
        """Build the ``--kv-transfer-config`` connector over the executor's KV pool.

        Raises:
            ValueError: the executor exposes no KV pool in this process (``kv_caches``).
        """
        kv_caches = getattr(self.executor, "kv_caches", None)
        if kv_caches is None:
            raise ValueError("--kv-transfer-config needs the uniproc executor (its KV pool lives in the engine core)")
        connector = create_connector(kv_transfer, self.config.cache.block_size)
        connector.register_kv_caches(kv_caches)
        logger.info("KV connector %s (%s), engine id %s", kv_transfer.kv_connector, kv_transfer.kv_role,
                    connector.engine_id)
        return connector

    def _make_structured_output_manager(self) -> Any:
        """The structured-output manager (:mod:`tokenmill.structured_output`): nothing is loaded until the
        first constrained request (then the tokenizer and the grammar backend, on its compile thread)."""
        loaded = getattr(self.executor, "loaded", None)
        arch = getattr(self.executor, "arch", None) or getattr(loaded, "arch", None)
        tokenizer = getattr(loaded, "tokenizer", None)
        if tokenizer is None:
            model = self.config.model

            def tokenizer() -> Any:   # the server's core loads no tokenizer of its own: load it on first use
                return load_tokenizer(model.tokenizer or model.model or default_model_path())
        device = str(self.config.model.device)
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return StructuredOutputManager(self.config.model.structured_outputs, getattr(arch, "vocab_size", 0) or 0,
                                       list(self.executor.eos_token_ids or []), tokenizer,
                                       host_logits=device == "cpu")

    # -- requests ------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; one that can never fit finishes at once with an error output.

        The error (finish_reason 'error', with the message) is returned by the
        next :meth:`step`, so a bad request never blocks the queue.
        """
        eos = self.executor.eos_token_ids
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_id=(eos[0] if len(eos) == 1 else list(eos)) if eos else None,
            arrival_time=req.arrival_time, priority=req.priority, cache_salt=req.cache_salt,
            batch=req.batch, lora_request=req.lora_request,
        )
        if req.lora_request is not None:
            if self.lora_manager is None:
                self._pending.append(EngineCoreOutput(
                    req_id=req.request_id, finish_reason="error", arrival_time=request.arrival_time,
                    error=f"LoRA adapter {req.lora_request.lora_name!r} asked for, but LoRA is off (--enable-lora)",
                    finished_time=time.time(), num_prompt_tokens=request.num_prompt_tokens))
                return
            name = req.lora_request.lora_name
            self._lora_requests_total[name] = self._lora_requests_total.get(name, 0) + 1
        try:
            self.scheduler.add_request(request)
        except RequestRejectedError as e:
            self._pending.append(EngineCoreOutput(
                req_id=req.request_id, finish_reason="error", error=str(e),
                arrival_time=request.arrival_time, finished_time=time.time(),
                num_prompt_tokens=request.num_prompt_tokens))

    def abort_requests(self, req_ids: list[str]) -> None:
        """Abort requests anywhere in the engine; their blocks return to the pool."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def release_kv(self, items: list[tuple[str | None, str]]) -> int:
        """Free the KV a producer keeps for requests no consumer will pull (``(engine_id, request_id)``
        pairs, ``engine_id`` None: any); the blocks return to the pool at the end of the next step.

        Returns:
            how many holds were released (unknown, pulled or other engines' requests are skipped).
        """
        if self.kv_connector is None:
            return 0
        return sum(bool(self.kv_connector.release(rid, eid)) for eid, rid in items)

    def stop_requests(self, req_ids: list[str]) -> None:
        """Finish requests as 'stop' (the front end matched a stop string)."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return (bool(self._pending) or self.scheduler.has_unfinished_requests() or bool(self._lora_loads)
                or bool(self._lora_results))

    # -- LoRA adapters ---------------------------------------------------------
    def _lora_ready(self, request: Request) -> tuple[bool, str | None]:
        """The scheduler's hook: is the request's adapter resident (its load starts when not)?"""
        return self.lora_manager.ensure(request.lora_request)

    def load_lora(self, token: Any, lora_request: Any) -> None:
        """Start loading an adapter (``POST /v1/load_lora_adapter``) on the runner's loader thread; the
        result (None or the error message) comes out of :meth:`take_lora_results` with ``token``."""
        if self.lora_manager is None:
            self._lora_results.append((token, "LoRA is off (--enable-lora)"))
            return
        self._lora_unloading.discard(lora_request.lora_int_id)
        self._lora_loads.append((token, lora_request, self.lora_manager.load_async(lora_request)))

    def unload_lora(self, lora_int_id: int) -> None:
        """Forget an adapter once no queued or running request uses it (those finish with it)."""
        if self.lora_manager is not None:
            self._lora_unloading.add(lora_int_id)
            self._lora_housekeeping()

    def take_lora_results(self) -> list[tuple[Any, str | None]]:
        """Finished runtime loads since the last call: ``(token, None | error message)``."""
        if self.lora_manager is None:
            return []
        self._lora_housekeeping()
        out, self._lora_results = self._lora_results, []
        return out

    def _lora_housekeeping(self) -> None:
        mgr = self.lora_manager
        mgr.poll()
        for item in list(self._lora_loads):
            token, _, fut = item
            if fut.done():
                self._lora_loads.remove(item)
                err = fut.exception()
                self._lora_results.append((token, None if err is None else str(err)))
        in_use = {r.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}
        mgr.pinned = in_use
        for lid in list(self._lora_unloading):
            if lid not in in_use:
                mgr.remove(lid)
                self._lora_unloading.discard(lid)

    def lora_stats(self) -> dict | None:
        """Adapters of running and waiting requests, ``max_lora`` and requests per adapter (metrics)."""
        if self.lora_manager is None:
            return None
        s = self.scheduler
        running = sorted({r.lora_request.lora_name for r in s.running if r.lora_request is not None})
        waiting = sorted({r.lora_request.lora_name for r in s.waiting if r.lora_request is not None})
        return {"running": running, "waiting": waiting, "max_lora": self.config.model.max_loras,
                "requests_total": dict(self._lora_requests_total)}

    # -- the loop ------------------------------------------------------------
    def step(self, _tier_retry: bool = True) -> list[EngineCoreOutput]:
        """Run one iteration; return outputs for requests that got a token or finished."""
        outputs, self._pending = self._pending, []
        if self.lora_manager is not None:
            self._lora_housekeeping()
        t0 = time.perf_counter()
        self._time_last_step(t0)
        self._collect_tier_loads()           # loads that ended since the last step are admitted in this one
        scheduler_output = self.scheduler.schedule()
        if self.scheduler.structured_output is not None and not scheduler_output.is_empty:
            # filled on a worker thread while the forward runs; the runner waits for it before sampling
            scheduler_output.grammar_bitmask = self.scheduler.structured_output.grammar_bitmask(scheduler_output)
        t1 = time.perf_counter()
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(scheduler_output.kv_connector_metadata)
        if scheduler_output.is_empty:
            # Nothing to run, but requests may still finish (e.g. max_tokens == 0 at admission).
            release = getattr(self.executor, "release_requests", None)
            if release is not None and scheduler_output.finished_req_ids:
                release(scheduler_output.finished_req_ids)  # per-request state of the runner (spec decode)
            outputs += self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput())
            self._kv_connector_after_step()
            if not outputs and self.scheduler.waiting_for_grammar:
                self.structured_output.wait_for_compiles(0.005)   # nothing else to do: no busy loop
            if _tier_retry and not outputs and self.kv_offload is not None and not self._lockstep and (
                    self._loads_ended or (self.kv_offload.loads_in_flight() and self.kv_offload.wait_for_loads(0.005))):
                # nothing ran, but a load (from the KV offloading tier) ended in this step or within the
                # loop's idle wait: run the step that admits its request now, not after the caller's idle
                # poll (with it, one block loaded lost to one recomputed on the EPYC: 25 vs 20 ms TTFT).
                # Not for cores stepping in lockstep (expert-parallel data parallelism): one step per wave
                return outputs + self.step(_tier_retry=False)
            return outputs
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as e:  # noqa: BLE001 - one bad batch must not take the engine down
            if getattr(e, "fatal", False):   # e.g. a dead worker (WorkerDiedError): no later step can run
                raise
            logger.exception("model step failed; failing the %d requests of this step", len(scheduler_output.scheduled))
            return outputs + self._fail_step(scheduler_output, e)
        t2 = time.perf_counter()
        if scheduler_output.grammar_bitmask is not None:
            scheduler_output.grammar_bitmask.result()   # (done already if sampled) matchers are the update's now
        outputs.extend(self.scheduler.update_from_output(scheduler_output, runner_output))
        self._kv_connector_after_step()
        t3 = time.perf_counter()
        self._num_steps += 1
        self._last_step_time = t3 - t0
        self._last_schedule_time = (t1 - t0) + (t3 - t2)
        nd, npf, ctx = _step_shape(scheduler_output)
        self._last_step = (nd, npf, t0, t3, ctx)
        return outputs

    def _collect_tier_loads(self) -> None:
        """Hand the KV offloading tier's ended loads to the scheduler before it schedules (otherwise a
        load that ended between steps is seen after this step's schedule, and its request waits a step)."""
        tier = self.kv_offload
        if tier is None or not tier.loads_in_flight():
            return
        done = tier.get_finished()
        if not done.is_empty:
            self.scheduler.update_from_kv_connector(done.finished_sending, done.finished_recving,
                                                    done.failed_recving)

    def _kv_connector_after_step(self) -> None:
        """Worker side after the step: publish the KV of requests kept for a consumer (this step's
        finishes, before their outputs leave), finish saves, and hand finished transfers to the scheduler."""
        c = self.kv_connector
        if c is None:
            return
        c.start_load_kv(c.build_connector_meta())
        c.wait_for_save()
        done = c.get_finished()
        self._loads_ended = bool(done.finished_recving or done.failed_recving)
        if not done.is_empty:
            self.scheduler.update_from_kv_connector(done.finished_sending, done.finished_recving,
                                                    done.failed_recving)

    def _time_last_step(self, now: float) -> None:
        """Teach the step-time model the previous step's duration.

        Back to back (the loop went straight on), the step lasted from its
        start to this one's, including sending outputs and reading inputs —
        what a queued request really waits per step. After an idle gap only
        its own span counts.
        """
        last, self._last_step = self._last_step, None
        if last is None:
            return
        num_decode, num_prefill, start, end, context = last
        busy = now - end <= max(0.002, 0.25 * (end - start))
        self.step_time_model.observe(num_decode, num_prefill, (now if busy else end) - start, context)

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """Finish every request of a failed step with an error output; their blocks return to the pool."""
        ids = [s.req_id for s in scheduler_output.scheduled]
        reqs = [self.scheduler.requests.get(i) for i in ids]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        now = time.time()
        return [EngineCoreOutput(req_id=i, finish_reason="error", error=f"internal error in the model step: {error}", error_code=500,
                                 arrival_time=r.arrival_time if r else None, finished_time=now,
                                 num_prompt_tokens=r.num_prompt_tokens if r else 0)
                for i, r in zip(ids, reqs)]

    def check_health(self) -> None:
        """Raise the executor's fatal error (e.g. :class:`WorkerDiedError`) if a worker died; no-op otherwise."""
        check = getattr(self.executor, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Stop the executor's workers, if it has any (idempotent)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.structured_output is not None:
            self.structured_output.shutdown()
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()

    def check_invariants(self) -> dict[str, Any]:
        """The core's bookkeeping checked for tests and soak runs (see :meth:`Scheduler.check_invariants`).

        Returns:
            ``{"problems": [...], "core_pid", "num_requests", "num_running", "num_waiting",
            "num_free_blocks", "num_kv_blocks"}``; ``problems`` is empty when
            every block is accounted for (no leak).
        """
        s = self.scheduler
        return {"problems": s.check_invariants(), "core_pid": os.getpid(), "num_requests": len(s.requests),
                "num_running": s.num_running,
                "num_waiting": s.num_waiting, "num_free_blocks": s.kv_cache_manager.num_free_blocks,
                "num_kv_blocks": s.kv_cache_manager.num_blocks}

    @property
    def num_steps(self) -> int:
        """Steps executed so far (cheap; :meth:`get_stats` builds the whole snapshot)."""
        return self._num_steps

    def get_stats(self) -> EngineStats:
        """Snapshot for /metrics, logging and admission control."""
        s = self.scheduler
        stats: Any = s.prefix_cache_stats
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_waiting_tokens=s.num_waiting_tokens,
            kv_cache_usage=s.kv_cache_usage, num_preemptions_total=s.num_preemptions_total,
            prefix_cache_queries=_stat(stats, "queries"), prefix_cache_hits=_stat(stats, "hits"),
            num_steps=self._num_steps, last_step_time=self._last_step_time,
            last_schedule_time=self._last_schedule_time,
            num_kv_blocks=self.executor.num_kv_blocks, block_size=self.config.cache.block_size,
            queue=s.queue_state(), step_timing=self.step_time_model.snapshot(),
            spec_decoding=s.spec_stats.copy() if s.spec_config is not None else None,
            eplb=getattr(self.executor, "eplb_stats", None),
            kv_transfer=self.pd_connector.stats.copy() if self.pd_connector is not None else None,
            kv_offload=self.kv_offload.get_tier_stats() if self.kv_offload is not None else None,
            prompt_tokens_by_source=dict(s.prompt_tokens_by_source),
            expert_parallel=getattr(self.executor, "expert_parallel_stats", None),
            structured_outputs=self._structured_output_stats(),
            lora=self.lora_stats(),
        )

    def _structured_output_stats(self) -> Any:
        """The structured-output counters (None before the first constrained request)."""
        so = self.structured_output
        if so is None or not so.stats.requests_by_kind:
            return None
        stats = so.stats.copy()
        stats.num_waiting_for_grammar = len(self.scheduler.waiting_for_grammar)
        return stats


def _step_shape(so: SchedulerOutput) -> tuple[int, int, int]:
    """(decoding requests, prefill tokens, prefill context) of a step: a request computing the tokens
    after its prompt one step at a time decodes; prompt chunks and recomputes are prefill. The prefill
    context is the sum over the prefill rows of the tokens before each (a chunk of ``n`` rows from
    position ``c``: ``n c + n (n − 1) / 2``), the attention work the step-time model's context term
    charges."""
    num_decode = num_prefill = context = 0
    for sr in so.scheduled:
        n = sr.num_scheduled_tokens
        if sr.num_computed_tokens >= len(sr.prompt_token_ids) and sr.sample and n <= 1 + _num_draft(sr):
            num_decode += 1
        else:
            num_prefill += n
            context += n * sr.num_computed_tokens + n * (n - 1) // 2
    return num_decode, num_prefill, context


def _num_draft(sr: Any) -> int:
    """Speculative tokens verified with a decode (0 without speculative decoding)."""
    return len(getattr(sr, "spec_token_ids", None) or ())


def _stat(stats: Any, name: str) -> int:
    if isinstance(stats, dict):
        return int(stats.get(name, 0))
    if isinstance(stats, tuple):
        return int(stats[0 if name == "queries" else 1])
    return int(getattr(stats, name, 0))
