"""The Ray executor: one Ray actor per rank, so a model can span machines.

Start a cluster with ``ray start --head`` (and ``ray start --address HEAD:6379``
on the other machines), then run ``tokenmill serve ... -tp N
--distributed-executor-backend ray``: the engine connects to the cluster named
by ``RAY_ADDRESS`` (or the one started on this machine; with none, Ray starts
a local one), places one actor per rank (``TOKENMILL_RAY_WORKER_CPUS`` CPUs
each, default 1), and rank 0's actor hosts the ``torch.distributed``
rendezvous on its node's address. Every machine needs the same Python
environment (tokenmill, torch) and the checkpoint at the same path.

Steps go out as one Ray object (the pickled step description, put once) that
every actor reads; the executor waits for all actors' replies. An actor that
dies raises ``RayActorError`` on ``ray.get``, turned into
:class:`~.base.WorkerDiedError` (the engine stops; requests fail with 503).
Ray is an optional dependency: ``pip install tokenmill[ray]``.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.executor.base import (WorkerDiedError, check_parallel_config, eplb_stats_of, load_frontend,
                                            log_layout, merge_step_replies, plan_kv_blocks, resolve_max_model_len)
from tokenmill.engine.executor.step_codec import StepEncoder
from tokenmill.engine.executor.mp import free_port

logger = logging.getLogger(__name__)


class _RankActor:
    """The body of one rank's Ray actor (wrapped with ``ray.remote`` at run time)."""

    def __init__(self) -> None:
        self.worker = None

    def rendezvous_address(self) -> str:
        """``tcp://<this node's IP>:<free port>`` for ``torch.distributed`` (called on rank 0's actor)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port('0.0.0.0')}"

    def start(self, config: EngineConfig, rank: int, init_method: str, num_cpus: int) -> Any:
        from tokenmill.engine.executor.worker import Worker

        envs.setdefault("TOKENMILL_NUM_THREADS", num_cpus)
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s [ray rank {rank}] %(name)s: %(message)s")
        self.worker = Worker(config, rank, init_method, cpus=None)
        return self.worker.info

    def execute(self, payload: bytes) -> tuple:
        try:
            out, stats = self.worker.execute(pickle.loads(payload))
            return ("ok", out, stats)
        except Exception as e:  # noqa: BLE001 - one failed step is reported, the actor goes on
            logger.exception("step failed")
            return ("error", f"rank {self.worker.rank}: {type(e).__name__}: {e}", None)

    def lora_control(self, op: tuple) -> None:
        """An adapter load/remove (:meth:`Worker.lora_control <tokenmill.engine.executor.worker.Worker.lora_control>`)."""
        self.worker.lora_control(op)

    def kv_tier(self, msg: tuple) -> tuple:
        try:
            return ("ok", self.worker.kv_tier(msg), None)
        except Exception as e:  # noqa: BLE001 - reported to the engine core
            logger.exception("KV tier call failed")
            return ("error", f"rank {self.worker.rank}: {type(e).__name__}: {e}", None)

    def pid(self) -> int:
        return os.getpid()


class RayExecutor:
    """Runs the model on Ray actors, one per rank (see the module docstring).

    Attributes and errors as :class:`~.mp.MultiprocExecutor`; ``pids`` are
    the actors' process ids (on their nodes).

    Raises:
        ImportError: ray is not installed (``pip install tokenmill[ray]``).
    """

    backend = "ray"

    def __init__(self, config: EngineConfig, with_tokenizer: bool | str = True) -> None:
        try:
            import ray
        except ImportError as e:
            raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'") from e
        par = config.parallel
        arch, self.loaded = load_frontend(config.model.model, with_tokenizer)
        check_parallel_config(config, arch)
        self.arch = arch
        self.world_size = par.world_size
        self.num_kv_blocks, _ = plan_kv_blocks(config, arch)
        self.max_model_len = resolve_max_model_len(config, arch)
        self.eos_token_ids = list(self.loaded.eos_token_ids)
        self.config = config.replace(num_kv_blocks=self.num_kv_blocks)
        self.encoder = StepEncoder()
        self.last_step_stats: list[Any] = []
        self._dead: str | None = None
        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True,
                     configure_logging=False)
            self._owns_ray = True
        num_cpus = envs.TOKENMILL_RAY_WORKER_CPUS
        actor_cls = ray.remote(num_cpus=num_cpus, max_restarts=0)(_RankActor)
        self._actors = [actor_cls.remote() for _ in range(self.world_size)]
        try:
            init_method = ray.get(self._actors[0].rendezvous_address.remote())
            infos = self._get([a.start.remote(self.config, r, init_method, max(1, int(num_cpus)))
                               for r, a in enumerate(self._actors)], "loading")
            self.pids = ray.get([a.pid.remote() for a in self._actors])
        except BaseException:
            self.shutdown()
            raise
        self.worker_infos = infos
        log_layout(infos, self.backend)
        self.lora_manager = None    # --enable-lora: the core's proxy of the actors' adapters (tokenmill.lora.tp)
        if config.model.enable_lora:
            from tokenmill.lora.tp import WorkerLoRAProxy

            m = config.model
            self.lora_manager = WorkerLoRAProxy(arch, m.max_lora_rank, max(m.max_cpu_loras or m.max_loras,
                                                                           m.max_loras), self.lora_control)

    def lora_control(self, op: tuple) -> None:
        """Send an adapter op to every actor (Ray runs one caller's calls to an actor in order, so it is
        ordered with the steps); not awaited.

        Raises:
            WorkerDiedError: an actor is (or was already) gone.
        """
        if self._dead:
            raise WorkerDiedError(self._dead)
        for a in self._actors:
            a.lora_control.remote(op)

    def _get(self, refs: list, what: str) -> list:
        ray = self._ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            self._dead = f"a Ray worker actor died while {what}: {e}"
        except ray.exceptions.RayTaskError as e:      # an exception inside an actor (start-up)
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise ValueError(f"worker start-up failed: {type(cause).__name__}: {cause}") from None
        logger.error("%s; stopping the other actors", self._dead)
        self.shutdown()
        raise WorkerDiedError(self._dead)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every actor; the output rank's sampled tokens.

        Raises:
            WorkerDiedError: an actor is (or was already) gone.
            RuntimeError: an actor raised in this step.
        """
        if self._dead:
            raise WorkerDiedError(self._dead)
        if so.is_empty:
            return ModelRunnerOutput()
        payload = self._ray.put(pickle.dumps(self.encoder.encode(so), protocol=5))
        replies = self._get([a.execute.remote(payload) for a in self._actors], "running a step")
        output, self.last_step_stats = merge_step_replies(replies)
        return output

    def kv_tier_call(self, msg: tuple) -> list[Any]:
        """One KV offloading tier message to every rank (:func:`tokenmill.kv_transfer.offloading.worker_tier_call`);
        the replies in rank order.

        Raises:
            WorkerDiedError: an actor is (or was already) gone.
            RuntimeError: a rank raised.
        """
        if self._dead:
            raise WorkerDiedError(self._dead)
        replies = self._get([a.kv_tier.remote(msg) for a in self._actors], "running a KV tier call")
        errors = [m[1] for m in replies if m[0] == "error"]
        if errors:
            raise RuntimeError(f"KV tier call failed: {errors[0]}")
        return [m[1] for m in replies]

    @property
    def eplb_stats(self):
        """The EPLB state of the last step (from the output rank; None without ``--enable-eplb``)."""
        return eplb_stats_of(self.last_step_stats)

    def check_health(self) -> None:
        """Raise :class:`WorkerDiedError` if an actor is gone (a cheap ping of every actor)."""
        if self._dead:
            raise WorkerDiedError(self._dead)
        self._get([a.pid.remote() for a in self._actors], "idle")

    def shutdown(self) -> None:
        """Kill the actors (and disconnect from Ray if this executor connected); idempotent."""
        for a in getattr(self, "_actors", []):
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False
