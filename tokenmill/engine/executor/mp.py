"""The multi-process executor: one worker process per rank on this machine.

The engine process (rank 0's scheduler) starts ``tensor_parallel_size x
pipeline_parallel_size`` workers with :class:`subprocess.Popen` (the engine
core may itself be a daemon process, which ``multiprocessing`` forbids to have
children), each pinned to its own CPUs (:func:`~.base.plan_cpus`) with one
torch thread per CPU. Workers connect back over a Unix socket
(:mod:`multiprocessing.connection`, authenticated with a random key passed in
the environment), join the ``torch.distributed`` group (gloo on CPU, NCCL on
CUDA) and load their shards.

Every step the executor sends all workers the same pickled step description
(:mod:`.step_codec`) and waits for every reply; the output rank's reply holds
the sampled tokens. While waiting it watches the sockets: a worker that dies
closes its socket at once, and the executor raises :class:`WorkerDiedError`
(fatal for the engine: requests fail with 503, ``/health`` turns 503) after
killing the other workers; it never waits on a dead worker. Workers die with
the engine process too (``PR_SET_PDEATHSIG`` and the socket's end of file).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.executor.base import (WorkerDiedError, check_parallel_config, eplb_stats_of, load_frontend,
                                            log_layout, merge_step_replies, plan_cpus, plan_kv_blocks,
                                            resolve_max_model_len)
from tokenmill.engine.executor.step_codec import StepEncoder

logger = logging.getLogger(__name__)

_AUTHKEY_ENV = "TOKENMILL_WORKER_AUTHKEY"
# Seconds a worker may take to connect, join the group and load its shard.


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for the ``torch.distributed`` rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    """Runs the model on worker processes, one per rank (see the module docstring).

    Args:
        config: the engine config (``config.parallel`` gives the layout).
        with_tokenizer: as for :func:`~.base.load_frontend`.

    Attributes:
        num_kv_blocks: blocks of every rank's KV pool (the scheduler's pool).
        max_model_len, eos_token_ids: as the model runner's.
        loaded: :class:`~.base.FrontendInfo` (tokenizer, chat template).
        worker_infos: each rank's :class:`~.worker.WorkerInfo`.
        last_step_stats: each rank's :class:`~.worker.StepStats` of the last step.
        pids: the worker process ids.

    Raises:
        ValueError: a layout the model cannot be split into (before any
            process starts), or a worker's start-up error.
        WorkerDiedError: a worker died or timed out during start-up.
    """

    backend = "mp"

    def __init__(self, config: EngineConfig, with_tokenizer: bool | str = True, *, dp_rank: int = 0,
                 dp_size: int = 1, init_method: str | None = None) -> None:
        par = config.parallel
        arch, self.loaded = load_frontend(config.model.model, with_tokenizer)
        self.arch = arch
        check_parallel_config(config, arch, dp_size)
        # experts shared with the workers of other data-parallel engine cores (one world; the API process
        # picks its rendezvous): see tokenmill.engine.executor.dp_ep
        self.dp_rank, self.dp_size, self._init_method = dp_rank, dp_size, init_method
        self.world_size = par.world_size
        self.num_kv_blocks, _ = plan_kv_blocks(config, arch)
        self.max_model_len = resolve_max_model_len(config, arch)
        self.eos_token_ids = list(self.loaded.eos_token_ids)
        self.config = config.replace(num_kv_blocks=self.num_kv_blocks)
        self.encoder = StepEncoder()
        self.last_step_stats: list[Any] = []
        self.worker_infos: list[Any] = []
        self._dead: str | None = None
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-workers-")
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, self._conns, self._tmpdir)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        self.lora_manager = None    # --enable-lora: the core's proxy of the workers' adapters
        if config.model.enable_lora:
            from tokenmill.lora.tp import WorkerLoRAProxy

            m = config.model
            self.lora_manager = WorkerLoRAProxy(arch, m.max_lora_rank, max(m.max_cpu_loras or m.max_loras,
                                                                           m.max_loras), self.lora_control)

    def lora_control(self, op: tuple) -> None:
        """Send an adapter op (:mod:`tokenmill.lora.tp`) to every worker, ordered with the steps; no reply.

        Raises:
            WorkerDiedError: a worker is (or was already) gone.
        """
        if self._dead:
            raise WorkerDiedError(self._dead)
        payload = pickle.dumps(("lora", op), protocol=5)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as e:
            self._die(f"sending to a worker failed: {e}")

    # -- start-up ----------------------------------------------------------------
    def _start(self) -> None:
        cpus = plan_cpus(self.world_size)
        if cpus[0] is not None and len({c for cs in cpus for c in cs}) < self.world_size:
            logger.warning("%d workers on %d CPUs: workers share cores", self.world_size,
                           len({c for cs in cpus for c in cs}))
        authkey = secrets.token_bytes(32)
        address = os.path.join(self._tmpdir, "workers.sock")
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = dict(os.environ, **{envs.var(_AUTHKEY_ENV).name: authkey.hex()})
        init_method = self._init_method or f"tcp://127.0.0.1:{free_port()}"
        try:
            for rank in range(self.world_size):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tokenmill.engine.executor.mp", address, str(rank),
                     str(logging.getLogger().getEffectiveLevel())], env=env))
            by_rank: dict[int, Connection] = {}
            start_timeout_s = envs.TOKENMILL_WORKER_START_TIMEOUT
            deadline = time.monotonic() + start_timeout_s
            listener._listener._socket.settimeout(1.0)   # accept() wakes up to check the processes
            while len(by_rank) < self.world_size:
                self._check_procs("starting")
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"workers did not connect within {start_timeout_s:.0f} s")
                try:
                    conn = listener.accept()
                except (socket.timeout, TimeoutError):
                    continue
                kind, rank = conn.recv()
                by_rank[rank] = conn
        finally:
            listener.close()
        self._conns.extend(by_rank[r] for r in range(self.world_size))
        for rank, conn in enumerate(self._conns):
            conn.send(("init", self.config, init_method, cpus[rank], self.dp_rank, self.dp_size))
        replies = self._collect(timeout=envs.TOKENMILL_WORKER_START_TIMEOUT, what="loading")
        errors = [m for m in replies if m[0] == "error"]
        if errors:
            raise ValueError(f"worker start-up failed: {errors[0][1]}")
        self.worker_infos = [m[1] for m in replies]
        log_layout(self.worker_infos, self.backend)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- steps -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output rank's sampled tokens.

        Raises:
            WorkerDiedError: a worker is (or was already) gone.
            RuntimeError: a worker raised in this step (the step fails, the engine goes on).
        """
        if self._dead:
            raise WorkerDiedError(self._dead)
        if so.is_empty:
            return ModelRunnerOutput()
        payload = pickle.dumps(("step", self.encoder.encode(so)), protocol=5)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as e:
            self._die(f"sending to a worker failed: {e}")
        replies = self._collect(timeout=None, what="running a step")
        output, self.last_step_stats = merge_step_replies(replies)
        return output

    def execute_dummy(self) -> None:
        """Every worker runs a step with no tokens of this engine core's own (experts shared over
        data-parallel engine cores: :meth:`Worker.execute_dummy <tokenmill.engine.executor.worker.Worker.execute_dummy>`).

        Raises:
            WorkerDiedError: a worker is (or was already) gone.
            RuntimeError: a worker raised.
        """
        if self._dead:
            raise WorkerDiedError(self._dead)
        payload = pickle.dumps(("dummy",), protocol=5)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as e:
            self._die(f"sending to a worker failed: {e}")
        replies = self._collect(timeout=None, what="running a dummy step")
        errors = [m[1] for m in replies if m[0] == "error"]
        if errors:
            raise RuntimeError(f"worker dummy step failed: {errors[0]}")
        self.last_step_stats = [m[2] for m in replies]

    def kv_tier_call(self, msg: tuple) -> list[Any]:
        """One KV offloading tier message to every worker (:func:`tokenmill.kv_transfer.offloading.worker_tier_call`,
        between steps); the replies in rank order.

        Raises:
            WorkerDiedError: a worker is (or was already) gone.
            RuntimeError: a worker raised.
        """
        if self._dead:
            raise WorkerDiedError(self._dead)
        payload = pickle.dumps(("kv_tier", msg), protocol=5)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as e:
            self._die(f"sending to a worker failed: {e}")
        replies = self._collect(timeout=None, what="running a KV tier call")
        errors = [m[1] for m in replies if m[0] == "error"]
        if errors:
            raise RuntimeError(f"KV tier call failed: {errors[0]}")
        return [m[1] for m in replies]

    @property
    def eplb_stats(self):
        """The EPLB state of the last step (from the output rank; None without ``--enable-eplb``)."""
        return eplb_stats_of(self.last_step_stats)

    def check_health(self) -> None:
        """Raise :class:`WorkerDiedError` if a worker is gone (the idle engine core calls this about once a second)."""
        if self._dead:
            raise WorkerDiedError(self._dead)
        self._check_procs("idle")

    def _collect(self, timeout: float | None, what: str) -> list[tuple]:
        """One reply from every worker, in rank order; raises :class:`WorkerDiedError` when one dies."""
        replies: dict[int, tuple] = {}
        index = {id(c): r for r, c in enumerate(self._conns)}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world_size:
            pending = [c for r, c in enumerate(self._conns) if r not in replies]
            for conn in wait(pending, timeout=1.0):
                rank = index[id(conn)]
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[rank].poll()
                    self._die(f"worker rank {rank} (pid {self._procs[rank].pid}) died while {what}"
                              + (f" (exit code {code})" if code is not None else ""))
            self._check_procs(what)
            if deadline is not None and time.monotonic() > deadline:
                self._die(f"workers did not answer within {timeout:.0f} s while {what}")
        return [replies[r] for r in range(self.world_size)]

    def _check_procs(self, what: str) -> None:
        for rank, p in enumerate(self._procs):
            code = p.poll()
            if code is not None:
                self._die(f"worker rank {rank} (pid {p.pid}) died while {what} (exit code {code})")

    def _die(self, reason: str) -> None:
        logger.error("%s; stopping the other workers", reason)
        self._dead = reason
        self.shutdown()
        raise WorkerDiedError(reason)

    # -- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (a polite message, then SIGKILL after 5 s); idempotent."""
        self._finalizer()

    def __del__(self) -> None:  # the finalizer runs anyway; this only makes the order deterministic
        pass


def _cleanup(procs: list[subprocess.Popen], conns: list[Connection], tmpdir: str) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass
    shutil.rmtree(tmpdir, ignore_errors=True)


# -- the worker process -------------------------------------------------------------------
def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def worker_main(address: str, rank: int, log_level: int = logging.INFO) -> int:
    """Body of a worker process: connect, build the shard, run steps until told to stop or the engine is gone."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(envs.unset(_AUTHKEY_ENV)))
    conn.send(("hello", rank))
    worker = None
    try:
        _, config, init_method, cpus, *dp = conn.recv()       # dp: (dp_rank, dp_size) of shared experts
        from tokenmill.engine.executor.worker import Worker

        try:
            worker = Worker(config, rank, init_method, cpus, *dp)
        except Exception as e:  # noqa: BLE001 - reported to the engine, which stops everyone
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
            logger.error("start-up failed:\n%s", traceback.format_exc())
            return 1
        conn.send(("ready", worker.info))
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "shutdown":
                return 0
            if msg[0] == "lora":        # an adapter load/remove (tokenmill.lora.tp): no reply
                worker.lora_control(msg[1])
                continue
            try:
                if msg[0] == "kv_tier":
                    conn.send(("ok", worker.kv_tier(msg[1]), None))
                    continue
                out, stats = worker.execute_dummy() if msg[0] == "dummy" else worker.execute(msg[1])
                conn.send(("ok", out, stats))
            except Exception as e:  # noqa: BLE001 - one failed step is reported, the worker goes on
                logger.error("step failed:\n%s", traceback.format_exc())
                conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
    except (EOFError, OSError):
        return 0            # the engine went away
    finally:
        if worker is not None:
            worker.close()


if __name__ == "__main__":
    status = worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else logging.INFO)
    # Leave at once: the interpreter's own teardown (torch / gloo threads) took ~5 s after the group was
    # destroyed, and a worker holds nothing that needs it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
