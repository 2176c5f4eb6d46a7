"""Data-parallel serving: N engine core processes behind one API process (``--data-parallel-size N``).

Each core is an ordinary :class:`~tokenmill.engine.async_engine.AsyncEngine`
child with its own model copy, scheduler and KV pool, pinned to its share of
the CPUs this process may use (``len(cpus) // N`` each, contiguous; with
fewer CPUs than cores they share CPUs round-robin), so its torch intra-op
threads default to that share. A new request goes to the core with the
lowest ``4 × waiting + running`` (vLLM's internal data-parallel load
balancing rule), where ``waiting`` includes requests sent but not yet seen by
the core; ties go to the lowest rank. All choices of one request (n > 1) run
on the same core.

With ``--enable-expert-parallel`` the cores also share their experts
(pipeline size 1): they join one ``torch.distributed`` group at a
rendezvous this process picks (with ``-tp T`` > 1 their ``T`` workers each
join a second one, of all ``T * N`` workers), each holds ``1/N`` of every MoE layer's
experts (``1/(T*N)`` per worker), and tokens cross between cores by all-to-all inside each MoE layer
(:mod:`tokenmill.engine.executor.dp_ep`). Since every MoE layer is then a
collective, the cores step in lockstep waves (:func:`tokenmill.engine.core_proc._lockstep_core_loop`):
after sending a request to its core, this process sends every core a
numbered ``("wake", n)`` so that all of them join the wave.

Stats: stat loggers that implement ``record_engine(engine_index, stats,
iteration)`` (the Prometheus exporter: every series labelled
``engine="i"``) get each core's own stats; the others (log line, admission
control) get the sum over the cores.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator, Callable

from tokenmill.config import EngineConfig
from tokenmill.metrics.stats import EngineStats, IterationStats, StatLogger
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.engine.messages import CoreInfo, Wake
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.engine.executor.dp_ep import check_dp_expert_parallel, uses_dp_expert_parallel

logger = logging.getLogger(__name__)


def cpu_shares(cpus: list[int], n: int) -> list[list[int]]:
    """Split ``cpus`` into ``n`` pinning sets: contiguous equal shares, or one CPU each (shared) when too few.

    Raises:
        ValueError: ``n < 1`` or no CPUs.
    """
    if n < 1 or not cpus:
        raise ValueError(f"need n >= 1 and at least one CPU, got n={n}, cpus={cpus}")
    k = len(cpus) // n
    if k == 0:
        return [[cpus[i % len(cpus)]] for i in range(n)]
    return [cpus[i * k:(i + 1) * k] for i in range(n)]


class _EngineRelay:
    """The stat logger a child engine reports to; forwards to the DP engine's loggers."""

    def __init__(self, owner: "DPAsyncEngine", index: int) -> None:
        self.owner = owner
        self.index = index

    def record(self, stats: EngineStats | None, iteration: IterationStats | None) -> None:
        self.owner._record(self.index, stats, iteration)


class DPAsyncEngine:
    """``AsyncEngine``'s interface over ``config.server.data_parallel_size`` engine cores.

    Args:
        config: the engine configuration (every core gets the same one; KV event
            ports are shifted by rank).
        tokenizer, executor_factory, start_timeout: as for :class:`AsyncEngine`.
        stat_loggers: see the module docstring.
        cpus: CPUs to share out (default: this process's affinity).
        num_engines: overrides ``config.server.data_parallel_size``.

    Raises:
        ValueError: fewer than 1 engine.
    """

    def __init__(self, config: EngineConfig, tokenizer: Any = None, *,
                 executor_factory: Callable[[Any], Any] | None = None,
                 stat_loggers: list[StatLogger] | None = None, start_timeout: float = 900.0,
                 cpus: list[int] | None = None, num_engines: int | None = None) -> None:
        n = num_engines or getattr(config.server, "data_parallel_size", 1)
        if n < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {n}")
        if cpus is None:
            try:
                cpus = sorted(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cpus = list(range(os.cpu_count() or 1))
        self.config = config
        self.tokenizer = tokenizer
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.shares = cpu_shares(cpus, n)

        self.expert_parallel = n > 1 and uses_dp_expert_parallel(config)
        init_method = worker_init_method = None
        if self.expert_parallel:
            check_dp_expert_parallel(config)       # before any process starts
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            if config.parallel.tensor_parallel_size > 1:   # the cores' workers join one world of their own
                port = _free_port()
                while f":{port}" == init_method[init_method.rindex(":"):]:
                    port = _free_port()
                worker_init_method = f"tcp://127.0.0.1:{port}"
        self.engines = [AsyncEngine(config, tokenizer, executor_factory=executor_factory,
                                    stat_loggers=[_EngineRelay(self, i)], start_timeout=start_timeout,
                                    data_parallel_rank=i, cpus=self.shares[i], dp_ep_init_method=init_method,
                                    dp_ep_worker_init_method=worker_init_method)
                        for i in range(n)]
        self.num_wakes = 0
        if self.expert_parallel:
            for e in self.engines:
                e.on_add = self._wake_all
        self._stats = [EngineStats() for _ in range(n)]
        self._owner: dict[str, int] = {}
        self.info: CoreInfo | None = None
        self.core_infos: list[CoreInfo] = []   # each core's own info (its KV pool), once ready
        self.num_routed = [0] * n
        for i, e in enumerate(self.engines):
            e.add_dead_callback(lambda reason, i=i: self._fail_the_other_cores(i, reason))

    def _fail_the_other_cores(self, dead: int, reason: str) -> None:
        """A core died: fail the requests running on the live cores too, with the same error.

        The server stops serving when any core is gone (``is_healthy`` turns false and the API process
        exits for a supervisor to restart it, as vLLM's data-parallel server does), so those requests
        would otherwise be cut off when it exits (a 500 or a stream without its error event); failing
        them now gives each its 503 / error event. Their cores free their KV blocks on the abort.
        """
        error = EngineDeadError(f"data-parallel engine {dead}: {reason}")
        for rid, owner in list(self._owner.items()):
            if owner != dead:
                self.engines[owner].abort_nowait(rid, error)

    def _wake_all(self) -> None:
        """After a request was sent to one core: tell every core (expert parallelism across the cores)."""
        self.num_wakes += 1
        for e in self.engines:
            try:
                e._send(Wake(self.num_wakes))
            except Exception:  # noqa: BLE001 - a dead core fails its own requests; the others still wake
                logger.debug("could not wake engine %s", e.data_parallel_rank)

    # -- life cycle --------------------------------------------------------------
    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        for e in self.engines:
            e.set_tokenizer(tokenizer)

    def launch(self) -> None:
        """Spawn every core (they load the model in parallel)."""
        for i, e in enumerate(self.engines):
            e.launch()
            logger.info("data-parallel engine %d pinned to CPUs %s", i, self.shares[i])

    def wait_ready(self) -> CoreInfo:
        """Wait for every core; the combined info has the smallest max_model_len and the summed KV pool.

        Raises:
            RuntimeError: a core failed to start (the others are shut down).
        """
        try:
            infos = [e.wait_ready() for e in self.engines]
        except BaseException:
            self.shutdown()
            raise
        self.core_infos = list(infos)
        for i in infos:
            if i.parallel:
                logger.info("%s", i.parallel)
        self.info = CoreInfo(max_model_len=min(i.max_model_len for i in infos),
                             num_kv_blocks=sum(i.num_kv_blocks for i in infos), block_size=infos[0].block_size,
                             eos_token_ids=list(infos[0].eos_token_ids), pid=infos[0].pid,
                             num_threads=sum(i.num_threads for i in infos), load_time=max(i.load_time for i in infos))
        self._stats = [i.stats if getattr(i, "stats", None) is not None else
                       EngineStats(num_kv_blocks=i.num_kv_blocks, block_size=i.block_size) for i in infos]
        return self.info

    def start(self) -> CoreInfo:
        self.launch()
        return self.wait_ready()

    async def start_background(self) -> None:
        for i, e in enumerate(self.engines):
            for sl in self.stat_loggers:  # every engine's series exist from the start (zeros)
                rec = getattr(sl, "record_engine", None)
                if rec is not None:
                    rec(i, None, None)
            await e.start_background()

    def shutdown(self, timeout: float = 5.0) -> None:
        for e in self.engines:
            e.shutdown(timeout)

    def shutdown_threadsafe(self) -> None:
        """:meth:`AsyncEngine.shutdown_threadsafe` for every core."""
        for e in self.engines:
            e.shutdown_threadsafe()

    def add_dead_callback(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` when any core exits unexpectedly (see :meth:`AsyncEngine.add_dead_callback`)."""
        for i, e in enumerate(self.engines):
            e.add_dead_callback(lambda reason, i=i: callback(f"data-parallel engine {i}: {reason}"))

    # -- state ---------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        """True while every core is alive (a dead core would fail the requests sent to it)."""
        return all(e.is_healthy for e in self.engines)

    @property
    def errored(self) -> bool:
        return not self.is_healthy

    @property
    def dead_reason(self) -> str | None:
        for i, e in enumerate(self.engines):
            if not e.is_healthy:
                return f"data-parallel engine {i}: {e.dead_reason}"
        return None

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "engine not started"
        return self.info.max_model_len

    @property
    def num_live_requests(self) -> int:
        return sum(e.num_live_requests for e in self.engines)

    def get_stats(self) -> EngineStats:
        """The sum over the cores (KV usage: over the summed pool)."""
        ss = self._stats
        blocks = sum(s.num_kv_blocks for s in ss)
        return EngineStats(
            num_running=sum(s.num_running for s in ss), num_waiting=sum(s.num_waiting for s in ss),
            num_waiting_tokens=sum(s.num_waiting_tokens for s in ss),
            kv_cache_usage=(sum(s.kv_cache_usage * s.num_kv_blocks for s in ss) / blocks) if blocks else 0.0,
            num_preemptions_total=sum(s.num_preemptions_total for s in ss),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in ss),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in ss), num_steps=sum(s.num_steps for s in ss),
            last_step_time=max(s.last_step_time for s in ss), last_schedule_time=max(s.last_schedule_time for s in ss),
            num_kv_blocks=blocks, block_size=ss[0].block_size, lora=_merge_lora([s.lora for s in ss]))

    @property
    def num_unfinished_requests(self) -> int:
        return sum(e.num_unfinished_requests for e in self.engines)

    @property
    def num_detokenizing_requests(self) -> int:
        """Requests whose detokenizer state the engines' output processors still hold (0 when idle)."""
        return sum(e.num_detokenizing_requests for e in self.engines)

    async def check_invariants(self, timeout: float = 10.0) -> dict[str, Any]:
        """Every core's :meth:`AsyncEngine.check_invariants`, summed; problems prefixed with the rank."""
        reports = [await e.check_invariants(timeout) for e in self.engines]
        out: dict[str, Any] = {"problems": [f"engine {i}: {p}" for i, r in enumerate(reports) for p in r["problems"]]}
        for k in ("num_requests", "num_running", "num_waiting", "num_free_blocks", "num_kv_blocks"):
            out[k] = sum(r[k] for r in reports)
        return out

    def waiting_load(self) -> tuple[int, int]:
        reqs = toks = 0
        for e in self.engines:
            r, t = e.waiting_load()
            reqs += r
            toks += t
        return reqs, toks

    def inflight_by_priority(self) -> dict[int, tuple[int, int]]:
        """Interactive requests sent to the cores that they have not reported yet, summed over the cores."""
        out: dict[int, tuple[int, int]] = {}
        for e in self.engines:
            for prio, (k, t) in e.inflight_by_priority().items():
                k0, t0 = out.get(prio, (0, 0))
                out[prio] = (k0 + k, t0 + t)
        return out

    def next_engine(self) -> int:
        """The core the next request goes to: the least ``4 × waiting + running`` (ties: the lowest index)."""
        scores = self.load_scores()
        return min(range(len(scores)), key=lambda k: (scores[k], k))

    def slo_view(self) -> tuple[EngineStats, dict[int, tuple[int, int]]]:
        """What ``--slo`` predicts a new request from: the snapshot (queue, step times) of the core it
        would run on, and that core's requests sent but not yet seen (``{priority: (requests, tokens)}``)."""
        i = self.next_engine()
        e = self.engines[i]
        return e.get_stats(), e.inflight_by_priority()

    def load_scores(self) -> list[int]:
        """``4 × waiting + running`` per core (adds the core has not seen yet count as running while
        it has free slots for them, as waiting beyond)."""
        return [4 * e.waiting_load()[0] + e.running_load() for e in self.engines]

    def _record(self, index: int, stats: EngineStats | None, iteration: IterationStats | None) -> None:
        if stats is not None:
            self._stats[index] = stats
        total = self.get_stats() if stats is not None else None
        for sl in self.stat_loggers:
            try:
                rec = getattr(sl, "record_engine", None)
                if rec is not None:
                    rec(index, stats, iteration)
                else:
                    sl.record(total, iteration)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("stat logger %r failed", sl)

    # -- requests ------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, batch: bool = False,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Run the request on the least loaded core (see :meth:`AsyncEngine.generate`; ``batch``: the batch lane;
        ``lora_request``: its LoRA adapter, which every core serves).

        Raises:
            EngineDeadError: a core is gone.
        """
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        i = self.next_engine()
        self._owner[request_id] = i
        self.num_routed[i] += 1
        try:
            async for out in self.engines[i].generate(request_id, prompt, prompt_token_ids, params, priority,
                                                      cache_salt, arrival_time, batch=batch,
                                                      lora_request=lora_request):
                yield out
        finally:
            self._owner.pop(request_id, None)

    def abort_nowait(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort on the core that runs it (see :meth:`AsyncEngine.abort_nowait`)."""
        i = self._owner.get(request_id)
        if i is not None:
            self.engines[i].abort_nowait(request_id, error)

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    async def load_lora(self, lora_request: Any, timeout: float = 300.0) -> str | None:
        """Load an adapter on every core (each has its own runner and adapter cache; see
        :meth:`AsyncEngine.load_lora`). None when all loaded it; else the first error, and the cores that
        did load it drop it again (the adapter is served everywhere or nowhere).

        Raises:
            EngineDeadError: a core is gone.
            TimeoutError: a core did not answer within ``timeout`` seconds.
        """
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        errors = await asyncio.gather(*(e.load_lora(lora_request, timeout) for e in self.engines))
        first = next((err for err in errors if err is not None), None)
        if first is not None:
            for e, err in zip(self.engines, errors):
                if err is None:
                    e.unload_lora(lora_request.lora_int_id)
        return first

    def unload_lora(self, lora_int_id: int) -> None:
        """:meth:`AsyncEngine.unload_lora` on every core (fire and forget).

        Raises:
            EngineDeadError: a core is gone.
        """
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        for e in self.engines:
            e.unload_lora(lora_int_id)

    def release_kv(self, request_id: str, engine_id: str | None = None) -> None:
        """:meth:`AsyncEngine.release_kv` on every core (the one whose connector has ``engine_id`` and
        keeps ``request_id`` frees it; the request finished, so no owner is tracked any more)."""
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        for e in self.engines:
            e.release_kv(request_id, engine_id)


def _merge_lora(parts: list[dict | None]) -> dict | None:
    """The cores' LoRA snapshots (:attr:`EngineStats.lora`) as one: adapters running or waiting on any core,
    requests per adapter summed; None without LoRA."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    totals: dict[str, int] = {}
    for p in parts:
        for name, n in p["requests_total"].items():
            totals[name] = totals.get(name, 0) + n
    return {"running": sorted({n for p in parts for n in p["running"]}),
            "waiting": sorted({n for p in parts for n in p["waiting"]}),
            "max_lora": parts[0]["max_lora"], "requests_total": totals}


def _free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the engine cores' ``torch.distributed`` rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_async_engine(config: EngineConfig, tokenizer: Any = None, **kw: Any) -> AsyncEngine | DPAsyncEngine:
    """An :class:`AsyncEngine`, or a :class:`DPAsyncEngine` when ``--data-parallel-size`` > 1."""
    n = getattr(config.server, "data_parallel_size", 1)
    if n > 1:
        return DPAsyncEngine(config, tokenizer, **kw)
    return AsyncEngine(config, tokenizer, **kw)
