"""The engine core in its own process, and the ZMQ transport to it.

The API process (:class:`tokenmill.engine.async_engine.AsyncEngine`) owns HTTP,
tokenization and detokenization; the engine core (scheduler, KV cache, model)
runs :func:`run_engine_core` in a child process started with the ``spawn``
context, so that JSON and SSE work never stalls a decode step (docs/architecture.md,
"Request path").

Transport: two ZMQ PUSH/PULL pairs over ``ipc://`` sockets in a private temp
directory (created 0700), both bound by the API process. Every message is a typed
msgspec struct of :mod:`tokenmill.engine.messages` (the list of kinds is there), as
MessagePack: the core decodes :data:`~tokenmill.engine.messages.CoreInput` (``AddRequest``,
``AbortRequests``, ``StopRequests``, ``ReleaseKV``, ``CheckInvariants``, ``LoadLoRA``,
``UnloadLoRA``, ``Wake``, ``Shutdown``) and sends :data:`~tokenmill.engine.messages.CoreOutput`
(``Ready`` once after the model loaded, ``Outputs`` after every step and after inputs that
change the state while idle, ``Invariants``, ``LoRALoaded``, and ``Error`` right before the
core exits because of an exception).

The core loop blocks on the input socket while it has nothing to do;
otherwise it drains inputs without blocking, runs one step and sends the
outputs. It exits when told to, when its parent process disappears (checked
about once a second), or on SIGTERM; SIGINT is ignored so that Ctrl-C in a
terminal is handled once, by the API process, which then shuts the core down.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable

import zmq

from tokenmill import envs
from tokenmill.engine import messages
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.executor import create_executor
from tokenmill.engine.messages import (AbortRequests, AddRequest, CheckInvariants, CoreInfo, Error, Invariants,
                                       LoadLoRA, LoRALoaded, Outputs, Ready, ReleaseKV, Shutdown, StopRequests,
                                       UnloadLoRA, Wake)
from tokenmill.metrics.memory import maybe_start_tracemalloc, top_allocation_sites
from tokenmill.engine.executor.dp_ep import make_dp_ep_executor
from tokenmill.engine.step_profile import calibrate
from tokenmill.engine.kv_events_publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)

# How long the idle core blocks on its input before checking that its parent lives (ms).
_PARENT_CHECK_MS = 1000
# While busy, stats are sent at least this often even when a step produced no output (s).
_STATS_INTERVAL_S = 0.25


def dumps(msg: Any) -> bytes:
    """Encode one transport message (:func:`tokenmill.engine.messages.encode`)."""
    return messages.encode(msg)


def torch_num_threads() -> int:
    """torch's intra-op thread count, 0 when torch is not loaded (a fake executor in tests)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 0


def _handle_request_message(core: EngineCore, out_sock: Any, msg: Any) -> None:
    """The messages both core loops (plain and expert-parallel lockstep) handle alike.

    ``AbortRequests``/``StopRequests``/``ReleaseKV`` act on request ids; ``CheckInvariants`` is answered at
    once, in order (tests and soak runs), with the top Python allocation sites when ``TOKENMILL_TRACEMALLOC``
    is on. ``AddRequest``, ``Wake`` and ``Shutdown`` differ between the loops and are theirs to handle.
    """
    if isinstance(msg, AbortRequests):
        core.abort_requests(msg.request_ids)
    elif isinstance(msg, StopRequests):
        core.stop_requests(msg.request_ids)
    elif isinstance(msg, ReleaseKV):
        core.release_kv([tuple(h) for h in msg.holds])
    elif isinstance(msg, LoadLoRA):        # answered with LoRALoaded(token, error | None) once it loaded
        core.load_lora(msg.token, msg.lora_request)
    elif isinstance(msg, UnloadLoRA):
        core.unload_lora(msg.lora_int_id)
    elif isinstance(msg, CheckInvariants):
        report = core.check_invariants()
        sites = top_allocation_sites()
        if sites:
            report["core_allocation_sites"] = sites
        out_sock.send(dumps(Invariants(msg.token, report)))
    else:  # pragma: no cover - protocol error
        logger.error("unexpected message %r", type(msg).__name__)


def set_process_name(name: str) -> None:
    """Name this process ``name`` for the kernel (Linux ``/proc/self/comm``, at most 15 bytes): what ``top``,
    ``ps -e``, ``pgrep NAME`` and ``killall`` show and match. The engine core is started by ``spawn``, so its
    command line is ``python -c "from multiprocessing.spawn import ..."`` and names no tokenmill; vLLM sets
    ``VLLM::EngineCore`` with the setproctitle package, which also rewrites the command line; the kernel name
    needs no dependency. Best effort: nothing happens where ``/proc`` cannot be written."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def run_engine_core(config: Any, input_addr: str, output_addr: str, parent_pid: int,
                    executor_factory: Callable[[Any], Any] | None = None,
                    log_level: int = logging.INFO, data_parallel_rank: int | None = None,
                    cpu_affinity: list[int] | None = None, dp_ep_init_method: str | None = None,
                    dp_ep_worker_init_method: str | None = None) -> None:
    """Entry point of the engine core process.

    Args:
        config: the :class:`tokenmill.config.EngineConfig`.
        input_addr: ZMQ address to PULL requests from.
        output_addr: ZMQ address to PUSH outputs to.
        parent_pid: the API process; the core exits when it goes away.
        executor_factory: builds the executor from the config (tests pass a
            fake one; must be picklable, i.e. a module-level function). None:
            the real model runner.
        log_level: logging level for this process.
        data_parallel_rank: this core's rank under ``--data-parallel-size`` (None: the only core);
            shifts its KV event ports and stamps its event batches.
        cpu_affinity: CPUs to pin this process to before torch starts (its intra-op threads
            then default to that many); None: inherit.
        dp_ep_init_method: with ``--data-parallel-size N --enable-expert-parallel``, the
            ``torch.distributed`` rendezvous of the N cores, which then share their experts
            (:class:`~tokenmill.engine.executor.dp_ep.DataParallelEPExecutor`) and step in lockstep
            (:func:`_lockstep_core_loop`).
        dp_ep_worker_init_method: with that and ``-tp`` above 1, the rendezvous of all cores'
            tensor-parallel workers (:class:`~tokenmill.engine.executor.dp_ep.DataParallelEPMultiprocExecutor`).

    Exits with status 0 after a ``shutdown`` message or when the parent died,
    1 after an exception (reported on the output socket first).
    """
    tag = "core" if data_parallel_rank is None else f"core{data_parallel_rank}"
    set_process_name("tokenmill-core" if data_parallel_rank is None else f"tokenmill-dp{data_parallel_rank}")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s")
    if cpu_affinity:
        try:
            os.sched_setaffinity(0, cpu_affinity)
        except (AttributeError, OSError) as e:  # not Linux, or CPUs not allowed
            logger.warning("could not pin the engine core to CPUs %s: %s", cpu_affinity, e)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    maybe_start_tracemalloc()   # TOKENMILL_TRACEMALLOC=1: soak diagnostics (tokenmill/metrics/memory.py)
    ctx = zmq.Context(1)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.connect(output_addr)
    code = 0
    executor = None
    core = None
    try:
        t0 = time.perf_counter()
        if executor_factory is not None:
            executor = executor_factory(config)
        elif dp_ep_init_method is not None:
            executor = make_dp_ep_executor(config, data_parallel_rank or 0, dp_ep_init_method,
                                           dp_ep_worker_init_method, with_tokenizer="eos")
        else:   # the API process loads its own tokenizer; here it is only the EOS fallback
            executor = create_executor(config, with_tokenizer="eos")
        core = EngineCore(config, executor=executor, data_parallel_rank=data_parallel_rank)
        # the model runner set the intra-op threads (tokenmill.model.process_tuning.configure_threads)
        num_threads = torch_num_threads()
        profile = _calibrate_for_slo(core, config, executor)
        info = CoreInfo(max_model_len=core.max_model_len, num_kv_blocks=core.executor.num_kv_blocks,
                        block_size=config.cache.block_size,
                        eos_token_ids=list(core.executor.eos_token_ids or []), pid=os.getpid(),
                        num_threads=num_threads, load_time=time.perf_counter() - t0,
                        parallel=executor.describe() if hasattr(executor, "describe") else "",
                        stats=core.get_stats(), profile_time=profile.seconds if profile is not None else 0.0)
        logger.info("engine core ready in %.1fs: pid %d, torch threads %d, %d KV blocks of %d tokens, "
                    "max_model_len %d", info.load_time, info.pid, num_threads, info.num_kv_blocks,
                    info.block_size, info.max_model_len)
        on_step = _kv_event_hook(core, config, data_parallel_rank)
        out_sock.send(dumps(Ready(info)))
        if hasattr(executor, "step_sync"):
            _lockstep_core_loop(core, in_sock, out_sock, parent_pid, on_step)
        else:
            _core_loop(core, in_sock, out_sock, parent_pid, on_step)
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001 - report anything, then exit
        code = 1
        msg = f"engine core failed: {type(e).__name__}: {e}"
        logger.error("%s\n%s", msg, traceback.format_exc())
        try:
            out_sock.send(dumps(Error(msg)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    finally:
        if core is not None and getattr(core, "kv_connector", None) is not None:
            core.kv_connector.shutdown()     # side channel, load threads, shared-memory files
        _stop_executor(executor)
        in_sock.close()
        out_sock.close()
        ctx.term()
    if code:
        sys.exit(code)


def _calibrate_for_slo(core: Any, config: Any, executor: Any) -> Any:
    """With ``--slo``: seed the step-time model from a start-up profile (``--slo-calibration``;
    :mod:`tokenmill.engine.step_profile`) before "ready", so the first burst is judged. Skipped for
    cores stepping in lockstep with others (expert-parallel data parallelism) and with a KV connector
    (a prefill or decode server of a disaggregated pair). Returns the profile, or None."""
    sched = getattr(config, "scheduler", None)
    mode = getattr(sched, "slo_calibration", "off") if sched is not None and sched.slo else "off"
    if mode == "off" or hasattr(executor, "step_sync") or getattr(core, "kv_connector", None) is not None:
        return None

    return calibrate(core, mode, getattr(executor, "vocab_size", None))


def _kv_event_hook(core: Any, config: Any, data_parallel_rank: int | None = None) -> Callable[[], None] | None:
    """With ``--kv-events-config`` enabled: start the publisher and return the per-step flush, else None."""
    cache = getattr(config, "cache", None)
    kv_cfg = cache.kv_events if cache is not None and hasattr(cache, "kv_events") else None
    if kv_cfg is None or not kv_cfg.active:
        return None

    pool = core.scheduler.kv_cache_manager.block_pool
    pool.enable_kv_events()
    rank = data_parallel_rank or 0
    publisher = ZmqEventPublisher(kv_cfg.for_rank(rank), data_parallel_rank)

    def flush() -> None:
        publisher.publish(pool.take_kv_events())

    return flush


def _stop_executor(executor: Any) -> None:
    """Stop a distributed executor's workers (no stray processes after the core exits)."""
    stop = getattr(executor, "shutdown", None)
    if stop is not None:
        try:
            stop()
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.exception("stopping the workers failed")


class StepTrace:
    """``TOKENMILL_STEP_TRACE``: one JSON line per engine-core step, for finding where a serving run's wall
    time goes (``benchmarks/serve_c64_profile.py``).

    Each line: ``loop`` (s, ``time.monotonic`` when the loop iteration began: input draining and the idle
    wait come before ``start``), ``start`` / ``end`` (around :meth:`EngineCore.step`), ``sent`` (after the
    outputs and stats went to the API process; equal to ``end`` when nothing was sent), ``schedule`` (s,
    scheduling + output update inside the step), the runner's ``prepare`` / ``forward`` / ``sample`` (s,
    where the executor reports them), ``decode`` (requests decoding), ``prefill`` (prompt tokens),
    ``outputs`` (outputs sent), ``running``, ``waiting``, ``preemptions`` (cumulative). Lines are buffered
    and flushed every 64 steps and when the loop ends; the file is opened for appending.
    """

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1 << 16)
        self._n = 0

    @staticmethod
    def from_env() -> "StepTrace | None":
        path = envs.TOKENMILL_STEP_TRACE
        return StepTrace(path) if path else None

    def record(self, core: Any, loop: float, start: float, end: float, sent: float, num_outputs: int) -> None:
        last = getattr(core, "_last_step", None) or (0, 0, 0.0, 0.0, 0)
        timings = getattr(core.executor, "last_timings", None) or {}
        s = core.scheduler
        row = {"loop": loop, "start": start, "end": end, "sent": sent,
               "schedule": getattr(core, "_last_schedule_time", None),
               "decode": last[0], "prefill": last[1], "outputs": num_outputs,
               "running": s.num_running, "waiting": s.num_waiting, "preemptions": s.num_preemptions_total}
        for k in ("prepare", "forward", "sample"):
            if k in timings:
                row[k] = timings[k]
        self._f.write(json.dumps(row) + "\n")
        self._n += 1
        if self._n % 64 == 0:
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def _core_loop(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int,
               on_step: Callable[[], None] | None = None) -> None:
    """Schedule → execute → update until shutdown (see module docstring).

    ``on_step`` runs after every step (the KV event flush).
    """
    trace = StepTrace.from_env()
    try:
        _core_loop_body(core, in_sock, out_sock, parent_pid, on_step, trace)
    finally:
        if trace is not None:
            trace.close()


def _core_loop_body(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int,
                    on_step: Callable[[], None] | None, trace: StepTrace | None) -> None:
    num_adds = 0
    last_parent_check = time.monotonic()
    last_send = 0.0

    def parent_alive() -> bool:
        return os.getppid() == parent_pid

    while True:
        t_loop = time.monotonic()
        if not core.has_unfinished_requests():
            # Idle: block on the input, waking up now and then to check the parent.
            while not in_sock.poll(_PARENT_CHECK_MS):
                if not parent_alive():
                    logger.warning("API process %d is gone; engine core exits", parent_pid)
                    return
                core.check_health()     # a dead worker ends the core now, not at the next request
        elif time.monotonic() - last_parent_check > _PARENT_CHECK_MS / 1000:
            last_parent_check = time.monotonic()
            if not parent_alive():
                logger.warning("API process %d is gone; engine core exits", parent_pid)
                return
        handled = 0
        while True:
            try:
                msg = messages.decode_input(in_sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            handled += 1
            if isinstance(msg, AddRequest):
                num_adds += 1
                core.add_request(msg.request)
            elif isinstance(msg, Shutdown):
                logger.info("engine core shutting down")
                return
            else:
                _handle_request_message(core, out_sock, msg)
        for token, error in (core.take_lora_results() if hasattr(core, "take_lora_results") else ()):
            out_sock.send(dumps(LoRALoaded(token, error)))
        outputs: list = []
        steps_before = core.num_steps if handled == 0 else -1   # (not get_stats(): a full snapshot a step)
        went_idle = False
        stepped = core.has_unfinished_requests()
        t_start = time.monotonic()
        if stepped:
            outputs = core.step()
            if on_step is not None:
                on_step()
            # the last step before idling (e.g. one that freed KV kept for a consumer) reports its stats:
            # an idle core sends nothing until its next input
            went_idle = not core.has_unfinished_requests()
        now = time.monotonic()
        if outputs or handled or went_idle or now - last_send > _STATS_INTERVAL_S:
            # Stats ride along with every batch, and at least every _STATS_INTERVAL_S
            # while busy (e.g. during a long chunked prefill that samples nothing).
            out_sock.send(dumps(Outputs(outputs, core.get_stats(), num_adds)))
            last_send = now
        if trace is not None and stepped:
            trace.record(core, t_loop, t_start, now, time.monotonic(), len(outputs))
        elif steps_before >= 0 and core.num_steps == steps_before:
            # Nothing could be scheduled and nothing arrived: wait briefly for input
            # instead of spinning.
            in_sock.poll(5)


def _lockstep_core_loop(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int,
                        on_step: Callable[[], None] | None = None) -> None:
    """The core loop of data-parallel engine cores that share their experts (``core.executor.step_sync``).

    Every MoE layer is a collective over all cores, so they run their steps together, in "waves"
    (vLLM's data-parallel waves): before each step every core in a wave calls
    ``executor.step_sync(has_work, wakes_seen, stop)`` (one all-reduce,
    :class:`~tokenmill.distributed.expert_parallel.StepSync`); if any core has work (or the wake-ups
    seen differ: a request is still on its way), each runs one step: its own batch
    (:meth:`EngineCore.step`), or, with nothing it could schedule, ``executor.execute_dummy()``. When
    no core has work the wave ends and each core blocks on its input again. The API process sends
    every core a numbered ``Wake(n)`` after each request it adds, so every core joins the next
    wave. A core leaving (shutdown, parent gone) says so in the sync and every core leaves with it
    (the group cannot run without it; a server shutdown stops them all anyway). A dead or stuck peer makes the sync or a step raise (connection
    closed, or the group's timeout): the exception ends this core too (its requests fail).
    """
    ex = core.executor
    check_health = getattr(ex, "check_health", None)      # workers of a tensor-parallel core
    num_adds = 0
    wakes_seen = 0          # the highest wake-up number received
    wave_end = 0            # wakes seen by every core when the last wave ended
    in_wave = False
    last_parent_check = time.monotonic()
    last_send = 0.0

    def parent_alive() -> bool:
        return os.getppid() == parent_pid

    while True:
        stop = False
        if not in_wave and wakes_seen == wave_end and not core.has_unfinished_requests():
            while not in_sock.poll(_PARENT_CHECK_MS):
                if not parent_alive():
                    logger.warning("API process %d is gone; engine core exits", parent_pid)
                    return
                if check_health is not None:
                    check_health()      # a dead worker ends the core now, not at the next request
        elif time.monotonic() - last_parent_check > _PARENT_CHECK_MS / 1000:
            last_parent_check = time.monotonic()
            if not parent_alive():
                logger.warning("API process %d is gone; engine core exits", parent_pid)
                stop = True
        handled = 0
        while True:
            try:
                msg = messages.decode_input(in_sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            handled += 1
            if isinstance(msg, AddRequest):
                num_adds += 1
                core.add_request(msg.request)
            elif isinstance(msg, Wake):
                wakes_seen = max(wakes_seen, msg.n)
            elif isinstance(msg, Shutdown):
                logger.info("engine core shutting down")
                stop = True
            else:
                _handle_request_message(core, out_sock, msg)
        has_work = core.has_unfinished_requests()
        outputs: list = []
        if in_wave or wakes_seen != wave_end or has_work:
            run, stop_any, hi = ex.step_sync(has_work, wakes_seen, stop)
            if stop_any:        # this core or a peer is leaving: the group ends, every core leaves with it
                logger.info("engine core leaves the expert-parallel group (%s)",
                            "shutdown" if stop else "a peer engine core is shutting down")
                return
            in_wave = run
            if run:
                before = ex.num_forwards
                if has_work:
                    outputs = core.step()
                    if on_step is not None:
                        on_step()
                if ex.num_forwards == before:       # nothing of its own ran: serve the peers' tokens
                    ex.execute_dummy()
            else:
                wave_end = hi
                handled += 1            # the wave ended: report the final stats once
        elif stop:
            return
        now = time.monotonic()
        if outputs or handled or (has_work and now - last_send > _STATS_INTERVAL_S):
            out_sock.send(dumps(Outputs(outputs, core.get_stats(), num_adds)))
            last_send = now
