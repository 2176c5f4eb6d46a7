"""The API process's handle on the engine core process.

:class:`AsyncEngine` starts the core (:func:`tokenmill.engine.core_proc.run_engine_core`)
in a ``spawn``-ed daemon process, sends it tokenized requests over ZMQ, and runs
one background asyncio task that receives output batches, turns token ids into
text with the :class:`~tokenmill.engine.output_processor.OutputProcessor`,
finishes stop-string matches in the core, and fans the per-request deltas out
to the coroutines awaiting them (:meth:`AsyncEngine.generate`).

If the core process dies, every pending request fails with
:class:`EngineDeadError` and :attr:`AsyncEngine.is_healthy` turns False.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCoreRequest
from tokenmill.metrics.stats import EngineStats
from tokenmill.engine import messages
from tokenmill.engine.core_proc import run_engine_core
from tokenmill.engine.messages import (AbortRequests, AddRequest, CheckInvariants, CoreInfo, Error, Invariants,
                                       LoadLoRA, LoRALoaded, Outputs, Ready, ReleaseKV, Shutdown, StopRequests,
                                       UnloadLoRA)
from tokenmill.engine.output_processor import OutputProcessor, child_params
from tokenmill.metrics.stats import FinishedRequestStats, IterationStats, StatLogger
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone (crashed, killed, or shut down)."""


@dataclass
class _Track:
    """Front-end bookkeeping of one live request, for metrics."""

    arrival_time: float
    num_prompt_tokens: int
    n: int
    max_tokens: int | None
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)
    num_generation_tokens: int = 0


class AsyncEngine:
    """Client of the engine core process, for the asyncio API server.

    Args:
        config: the engine configuration (sent to the core process).
        tokenizer: Hugging Face-style tokenizer for detokenization (may be
            given later with :meth:`set_tokenizer`, e.g. loaded while the core
            loads the model).
        executor_factory: picklable ``f(config) -> executor`` run in the core
            process instead of loading the model (tests).
        stat_loggers: receive engine and iteration stats after each batch.
        start_timeout: seconds to wait for the core to load the model.
        data_parallel_rank: the core's rank under ``--data-parallel-size`` (None: single core).
        cpus: CPUs the core process pins itself to (None: inherit this process's).
        dp_ep_init_method: the ``torch.distributed`` rendezvous of data-parallel cores that share
            their experts (set by :class:`~tokenmill.engine.dp_engine.DPAsyncEngine`; None otherwise).
        dp_ep_worker_init_method: with those and ``-tp`` above 1, the rendezvous of all cores' workers.

    Attributes:
        on_add: called after each request (child) is sent to the core (the data-parallel engine
            wakes the other cores with it); None by default.

    Call :meth:`start` (blocking; or :meth:`launch` then :meth:`wait_ready`)
    before serving, and :meth:`shutdown` at exit.
    """

    def __init__(self, config: EngineConfig, tokenizer: Any = None, *,
                 executor_factory: Callable[[Any], Any] | None = None,
                 stat_loggers: list[StatLogger] | None = None, start_timeout: float = 900.0,
                 data_parallel_rank: int | None = None, cpus: list[int] | None = None,
                 dp_ep_init_method: str | None = None, dp_ep_worker_init_method: str | None = None) -> None:
        self.config = config
        self.dp_ep_init_method = dp_ep_init_method
        self.dp_ep_worker_init_method = dp_ep_worker_init_method
        self.on_add: Callable[[], None] | None = None
        self.data_parallel_rank = data_parallel_rank
        self.cpus = cpus
        self.tokenizer = tokenizer
        self.processor: OutputProcessor = OutputProcessor(tokenizer) if tokenizer is not None else None  # type: ignore[assignment]
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.executor_factory = executor_factory
        self.start_timeout = start_timeout
        self.info: CoreInfo | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tmpdir: str | None = None
        self._ctx: zmq.Context | None = None
        self._in_sock: zmq.Socket | None = None
        self._out_sock: zmq.Socket | None = None
        self._aout_sock: zmq.asyncio.Socket | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._tracks: dict[str, _Track] = {}
        self._stats = EngineStats()
        self._dead: str | None = None
        self._closed = False
        # Admission bookkeeping: adds sent but not yet seen by the core.
        self._num_adds_sent = 0
        self._num_adds_seen = 0
        # (add sequence number, prompt tokens, priority, batch lane)
        self._inflight: deque[tuple[int, int, int, bool]] = deque()
        self._dead_callbacks: list[Callable[[str], None]] = []
        self._invariant_waiters: dict[int, asyncio.Future] = {}
        self._invariant_token = 0

    # -- life cycle ----------------------------------------------------------
    def set_tokenizer(self, tokenizer: Any) -> None:
        """Set the tokenizer used for detokenization (before the first request)."""
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)

    def start(self) -> CoreInfo:
        """Start the core process and wait until it has loaded the model.

        Returns:
            the core's :class:`CoreInfo` (max_model_len, KV pool geometry, ...).

        Raises:
            RuntimeError: the core exited or reported an error during start-up,
                or did not get ready within ``start_timeout`` seconds.
        """
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Bind the sockets and spawn the core process (returns at once)."""
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        os.chmod(self._tmpdir, 0o700)
        in_addr = f"ipc://{self._tmpdir}/input"
        out_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.Context(1)
        self._in_sock = self._ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.setsockopt(zmq.SNDHWM, 0)
        self._in_sock.bind(in_addr)
        self._out_sock = self._ctx.socket(zmq.PULL)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        self._out_sock.setsockopt(zmq.RCVHWM, 0)
        self._out_sock.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=run_engine_core, name="tokenmill-engine-core", daemon=True,
            args=(self.config, in_addr, out_addr, os.getpid(), self.executor_factory,
                  logging.getLogger().getEffectiveLevel()),
            kwargs={"data_parallel_rank": self.data_parallel_rank, "cpu_affinity": self.cpus,
                    "dp_ep_init_method": self.dp_ep_init_method,
                    "dp_ep_worker_init_method": self.dp_ep_worker_init_method})
        self._proc.start()
        logger.info("started engine core process pid %d", self._proc.pid)

    def wait_ready(self) -> CoreInfo:
        """Block until the core launched by :meth:`launch` is ready; raises like :meth:`start`."""
        assert self._proc is not None and self._out_sock is not None, "launch() first"
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._out_sock.poll(100):
                msg = messages.decode_output(self._out_sock.recv())
                if isinstance(msg, Ready):
                    self.info = msg.info
                    break
                if isinstance(msg, Error):
                    self._kill_proc()
                    raise RuntimeError(msg.message)
            elif not self._proc.is_alive():
                raise RuntimeError(f"engine core process exited during start-up (exit code {self._proc.exitcode})")
            elif time.monotonic() > deadline:
                self._kill_proc()
                raise RuntimeError(f"engine core did not get ready within {self.start_timeout:.0f}s")
        self._stats = self.info.stats if self.info.stats is not None else \
            EngineStats(num_kv_blocks=self.info.num_kv_blocks, block_size=self.info.block_size)
        logger.info("engine core ready (pid %d): max_model_len %d, %d KV blocks x %d tokens, %d torch threads, "
                    "loaded in %.1fs", self.info.pid, self.info.max_model_len, self.info.num_kv_blocks,
                    self.info.block_size, self.info.num_threads, self.info.load_time)
        return self.info

    async def start_background(self) -> None:
        """Start the output task on the running event loop (idempotent)."""
        if self._loop_task is not None:
            return
        if self.info is None:
            raise RuntimeError("AsyncEngine.start() must be called first")
        self._loop = asyncio.get_running_loop()
        self._aout_sock = zmq.asyncio.Socket.from_socket(self._out_sock)
        self._loop_task = asyncio.create_task(self._output_loop(), name="tokenmill-output-loop")
        try:
            self._loop.add_reader(self._proc.sentinel, self._on_core_exit)
        except (NotImplementedError, ValueError):  # pragma: no cover - non-Unix loops
            pass

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core process (politely, then by force) and fail pending requests.

        Safe to call more than once and from signal handlers' context.
        """
        if self._closed:
            return
        self._closed = True
        self._mark_dead("server is shutting down")
        if self._in_sock is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._in_sock.send(messages.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._proc.join(timeout)
        self._kill_proc()
        if self._loop is not None and self._proc is not None:
            try:
                self._loop.remove_reader(self._proc.sentinel)
            except Exception:  # noqa: BLE001 - loop may be closed
                pass
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self._aout_sock is not None:
            # Closing the asyncio shadow removes its reader from the event loop; a stale
            # registration would capture a later socket that reuses the file descriptor.
            try:
                self._aout_sock.close(linger=0)
            except Exception:  # noqa: BLE001 - loop already closed
                pass
        for s in (self._in_sock, self._out_sock):
            if s is not None:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def shutdown_threadsafe(self) -> None:
        """:meth:`shutdown` from any thread or a signal handler.

        Runs it on the engine's event loop when that loop is running (so the
        output task and socket readers are torn down where they live), else
        directly.
        """
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            loop.call_soon_threadsafe(self.shutdown)
        else:
            self.shutdown()

    def add_dead_callback(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` on the event loop when the core process exits unexpectedly.

        Not called for :meth:`shutdown`. By then every pending request has
        already failed with :class:`EngineDeadError` and :attr:`is_healthy` is False.
        """
        self._dead_callbacks.append(callback)

    def _kill_proc(self) -> None:
        p = self._proc
        if p is None or p.exitcode is not None:
            return
        p.terminate()
        p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join(2.0)

    # -- state ---------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        """True while the core process is alive and has not reported an error."""
        return self._dead is None and self._proc is not None and self._proc.is_alive()

    @property
    def errored(self) -> bool:
        return not self.is_healthy

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is unusable (None while healthy)."""
        if self._dead is None and self._proc is not None and not self._proc.is_alive():
            return f"engine core process exited (exit code {self._proc.exitcode})"
        return self._dead

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "engine not started"
        return self.info.max_model_len

    def get_stats(self) -> EngineStats:
        """The core's latest :class:`EngineStats` snapshot."""
        return self._stats

    def waiting_load(self) -> tuple[int, int]:
        """(requests, prompt tokens) of interactive requests waiting: the core's queue plus adds not
        yet received by it, less those of them that will start at once. Batch-lane requests are left
        out: they wait behind interactive ones.

        An add the core has not received yet takes a free running slot (``max_num_seqs`` less the
        running and queued requests of the core's last report) when one is left, first come first
        served, so a burst onto an idle engine counts as waiting only beyond its free slots.
        """
        waiting, waiting_tokens, sent, free = self._queue_view()
        queued = sent[free:]
        return waiting + len(queued), waiting_tokens + sum(queued)

    def running_load(self) -> int:
        """Requests running, plus adds not yet received by the core that will start at once (see
        :meth:`waiting_load`): the ``running`` of the data-parallel balancing rule."""
        _, _, sent, free = self._queue_view()
        return self._stats.num_running + min(free, len(sent))

    def _queue_view(self) -> tuple[int, int, list[int], int]:
        """(core's waiting requests, their prompt tokens, prompt tokens of each interactive add not yet
        received, running slots free for them)."""
        sent = [t for _, t, _, b in self._inflight if not b]
        q = self._stats.queue
        if q is None:
            waiting, waiting_tokens = self._stats.num_waiting, self._stats.num_waiting_tokens
        else:
            waiting = sum(k for k, _ in q.waiting_by_priority.values())
            waiting_tokens = sum(t for _, t in q.waiting_by_priority.values())
        free = max(0, self.config.scheduler.max_num_seqs - self._stats.num_running - waiting)
        return waiting, waiting_tokens, sent, free

    def inflight_by_priority(self) -> dict[int, tuple[int, int]]:
        """Interactive requests sent to the core that it has not reported yet: ``{priority: (requests, tokens)}``."""
        out: dict[int, tuple[int, int]] = {}
        for _, tokens, prio, batch in self._inflight:
            if not batch:
                k, t = out.get(prio, (0, 0))
                out[prio] = (k + 1, t + tokens)
        return out

    @property
    def num_live_requests(self) -> int:
        return len(self._queues)

    # -- requests ------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, batch: bool = False,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Run one request; yield a :class:`RequestOutput` *delta* per batch of new tokens.

        ``batch`` puts it in the batch lane (scheduled with the capacity
        interactive requests leave, preempted first). ``lora_request``
        (:class:`tokenmill.lora.request.LoRARequest`) runs it with that adapter.

        Each delta's choices carry only new text/token ids/logprobs; the last
        one has ``finished=True`` (and ``error`` set if the core rejected the
        request). Cancelling the consumer (client disconnect) aborts the
        request in the core, freeing its KV blocks within one step.

        Raises:
            EngineDeadError: the core process is gone (before or during the request).
            ValueError: the request id is already live.
        """
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        await self.start_background()
        arrival_time = time.time() if arrival_time is None else arrival_time
        child_ids = self.processor.add_request(request_id, prompt, prompt_token_ids, params, arrival_time)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._tracks[request_id] = _Track(arrival_time, len(prompt_token_ids), params.n, params.max_tokens)
        finished = False
        try:
            for i, cid in enumerate(child_ids):
                self._send(AddRequest(EngineCoreRequest(cid, list(prompt_token_ids), child_params(params, i),
                                                        arrival_time, priority, cache_salt, batch,
                                                        lora_request)))
                self._num_adds_sent += 1
                self._inflight.append((self._num_adds_sent, len(prompt_token_ids), priority, batch))
                if self.on_add is not None:
                    self.on_add()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort_nowait(request_id)
            self._tracks.pop(request_id, None)

    def abort_nowait(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request (all its choices) without awaiting; no-op when unknown or finished.

        With ``error``, the request's consumer (:meth:`generate`) raises it
        (e.g. admission control answering 429 on a displaced request's pending
        response); without, it is cancelled.
        """
        ids = self.processor.child_ids(request_id)
        if not ids:
            return
        self.processor.remove_request(request_id)
        if not self.errored:
            try:
                self._send(AbortRequests(list(ids)))
            except zmq.ZMQError:  # pragma: no cover - socket closed during shutdown
                pass
        tr = self._tracks.pop(request_id, None)
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(error if error is not None else asyncio.CancelledError())
        if tr is not None:
            now = time.time()
            self._emit(None, IterationStats(timestamp=now, finished=[FinishedRequestStats(
                "abort", request_id=request_id, e2e_latency=now - tr.arrival_time, num_prompt_tokens=tr.num_prompt_tokens,
                num_generation_tokens=tr.num_generation_tokens, max_tokens_param=tr.max_tokens)]))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests this process still tracks (sent and not finished/aborted); 0 when idle."""
        return len(self._queues)

    @property
    def num_detokenizing_requests(self) -> int:
        """Requests whose detokenizer state the output processor still holds; 0 when idle (a leak otherwise)."""
        return self.processor.num_requests

    async def check_invariants(self, timeout: float = 10.0) -> dict[str, Any]:
        """Ask the core to check its bookkeeping (:meth:`EngineCore.check_invariants`): for tests and soaks.

        Raises:
            EngineDeadError: the core is not running.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        self._invariant_token += 1
        token = self._invariant_token
        fut = asyncio.get_running_loop().create_future()
        self._invariant_waiters[token] = fut
        self._send(CheckInvariants(token))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._invariant_waiters.pop(token, None)

    async def load_lora(self, lora_request: Any, timeout: float = 300.0) -> str | None:
        """Have the core load and validate an adapter (off its step loop); None when it loaded, else
        the error message (the adapter is then not usable).

        Raises:
            EngineDeadError: the core is not running.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        self._invariant_token += 1
        token = self._invariant_token
        fut = asyncio.get_running_loop().create_future()
        self._invariant_waiters[("lora", token)] = fut
        self._send(LoadLoRA(token, lora_request))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._invariant_waiters.pop(("lora", token), None)

    def unload_lora(self, lora_int_id: int) -> None:
        """Tell the core to drop an adapter once its queued and running requests finished (fire and forget).

        Raises:
            EngineDeadError: the core is not running.
        """
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        self._send(UnloadLoRA(lora_int_id))

    def release_kv(self, request_id: str, engine_id: str | None = None) -> None:
        """Tell the core to free the KV it keeps for a consumer of ``request_id`` (the core's request id
        from ``kv_transfer_params.remote_request_id``); fire and forget, a no-op where nothing is held.

        Raises:
            EngineDeadError: the core is not running.
        """
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "engine is not running")
        self._send(ReleaseKV([(engine_id, request_id)]))

    async def abort(self, request_id: str) -> None:
        """Abort a request and all its child ids in the core."""
        self.abort_nowait(request_id)

    def _send(self, msg: messages.CoreInput) -> None:
        """Send one message to the core without blocking.

        Raises:
            EngineDeadError: the engine is closed, or no core is connected to the input socket (the core
                died and the monitor has not noticed yet: the PUSH socket, with no send limit, refuses a
                message only when it has no peer).
        """
        if self._in_sock is None or self._closed:
            raise EngineDeadError("engine is not running")
        try:
            self._in_sock.send(messages.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError(self.dead_reason or "engine core is not connected (it exited)") from None

    # -- the output task -----------------------------------------------------
    async def _output_loop(self) -> None:
        assert self._aout_sock is not None
        try:
            while True:
                msg = messages.decode_output(await self._aout_sock.recv())
                if isinstance(msg, Outputs):
                    self._handle_outputs(msg.outputs, msg.stats, msg.num_adds)
                elif isinstance(msg, (Invariants, LoRALoaded)):
                    key = msg.token if isinstance(msg, Invariants) else ("lora", msg.token)
                    fut = self._invariant_waiters.pop(key, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.report if isinstance(msg, Invariants) else msg.error)
                elif isinstance(msg, Error):
                    logger.error("%s", msg.message)
                    self._mark_dead(msg.message)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not hang requests
            logger.exception("output loop failed")
            self._mark_dead(f"output processing failed: {type(e).__name__}: {e}")

    def _handle_outputs(self, outputs: list, stats: EngineStats, num_adds_seen: int) -> None:
        self._stats = stats
        self._num_adds_seen = num_adds_seen
        while self._inflight and self._inflight[0][0] <= num_adds_seen:
            self._inflight.popleft()
        it = IterationStats(timestamp=time.time())
        if outputs:
            deltas, stop_ids = self.processor.process_outputs(outputs)
            if stop_ids:
                self._send(StopRequests(list(stop_ids)))
            now = it.timestamp
            for d in deltas:
                tr = self._tracks.get(d.request_id)
                if tr is not None:
                    self._account(tr, d, now, it)
                q = self._queues.get(d.request_id)
                if q is not None:
                    q.put_nowait(d)
                if d.finished:
                    self._tracks.pop(d.request_id, None)
                    self.processor.remove_request(d.request_id)   # its last delta is out: forget its state
        self._emit(stats, it)

    def _account(self, tr: _Track, d: RequestOutput, now: float, it: IterationStats) -> None:
        for c in d.outputs:
            k = len(c.token_ids)
            if k == 0:
                continue
            it.num_generation_tokens += k
            tr.num_generation_tokens += k
            last = tr.last_token_time.get(c.index)
            if last is None:
                it.num_prompt_tokens += tr.num_prompt_tokens
                if tr.first_token_time is None:
                    tr.first_token_time = now
                    it.time_to_first_tokens.append(now - tr.arrival_time)
                    it.first_tokens.append((d.request_id, now - tr.arrival_time))
            else:
                it.inter_token_latencies.append(now - last)
            tr.last_token_time[c.index] = now
        if d.finished:
            reasons = [c.finish_reason for c in d.outputs if c.finish_reason]
            reason = "error" if d.error else (reasons[-1] if reasons else "stop")
            m = d.metrics
            sched = m.first_scheduled_time
            first = tr.first_token_time
            it.finished.append(FinishedRequestStats(
                reason, request_id=d.request_id, e2e_latency=now - tr.arrival_time,
                queued_time=max(0.0, (sched - tr.arrival_time)) if sched else 0.0,
                prefill_time=max(0.0, first - sched) if (first and sched) else 0.0,
                decode_time=max(0.0, now - first) if first else 0.0,
                num_prompt_tokens=tr.num_prompt_tokens, num_generation_tokens=tr.num_generation_tokens,
                max_tokens_param=tr.max_tokens, num_choices=max(1, tr.n)))

    def _emit(self, stats: EngineStats | None, it: IterationStats | None) -> None:
        for sl in self.stat_loggers:
            try:
                sl.record(stats, it)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("stat logger %r failed", sl)

    def _on_core_exit(self) -> None:
        if self._loop is not None and self._proc is not None:
            try:
                self._loop.remove_reader(self._proc.sentinel)
            except Exception:  # noqa: BLE001
                pass
        if not self._closed:
            if self._proc is not None:
                self._proc.join(0.5)  # reap it, so the exit code is known
            code = self._proc.exitcode if self._proc is not None else None
            logger.error("engine core process exited unexpectedly (exit code %s)", code)
            self._mark_dead(self._dead or f"engine core process exited unexpectedly (exit code {code})")
            for cb in self._dead_callbacks:
                try:
                    cb(self._dead or "engine core exited")
                except Exception:  # noqa: BLE001 - a callback must not keep the others from running
                    logger.exception("engine-dead callback failed")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        for rid, q in list(self._queues.items()):
            q.put_nowait(EngineDeadError(self._dead))
