"""The executor of one data-parallel engine core whose experts are shared with the other cores.

``--data-parallel-size N --enable-expert-parallel`` (pipeline parallel size
1): each of the N engine cores keeps its own scheduler, KV pool and attention
(data-parallel), but holds only ``1/N`` of every MoE layer's experts; tokens
reach their experts on the other cores by all-to-all
(:mod:`tokenmill.distributed.expert_parallel`).

* Tensor parallel size 1 (:class:`DataParallelEPExecutor`): the cores form one
  ``torch.distributed`` group (gloo on CPU, NCCL on CUDA) that the API process
  names (``init_method``); the model runs in the engine core process, as with
  the ``uniproc`` executor.
* Tensor parallel size ``T`` > 1 (:class:`DataParallelEPMultiprocExecutor`):
  each core runs ``T`` ``mp`` workers; the workers of all cores join one world
  of ``T * N`` ranks (a second rendezvous the API process names), each core's
  workers its tensor-parallel group, the experts shared over all ``T * N``
  ranks (world rank ``dp_rank * T + tp_rank`` holds slots ``[r*S, (r+1)*S)``):
  vLLM's "EP over the TP x DP group". Within a core the ``T`` workers split
  the core's tokens, route their slice, exchange rows with every rank of the
  world, and all-gather the slices back (attention stays tensor-parallel).
  The cores themselves (no model) join a small gloo group of their own for
  the per-step agreement.

Because every MoE layer is a collective over all cores, every core runs the
same number of forwards: the core loop (:func:`tokenmill.engine.core_proc.run_engine_core`)
calls :meth:`step_sync` before each step, then either :meth:`execute_model`
or, with nothing of its own to run, :meth:`execute_dummy`. A failure inside a
forward leaves the peers inside a collective, so it is fatal here
(:class:`LockstepStepError`): the core exits, its requests fail, and the peers'
next collective fails (connection closed) or times out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.executor.base import load_frontend, resolve_max_model_len
from tokenmill.engine.executor.mp import MultiprocExecutor

logger = logging.getLogger(__name__)


class LockstepStepError(RuntimeError):
    """A forward failed on an engine core that shares its experts: the peers are left in a collective,
    so the engine cannot go on (``fatal``: the core exits and its requests fail)."""

    fatal = True


def check_dp_expert_parallel(config: EngineConfig) -> None:
    """Refuse what expert parallelism across data-parallel engine cores cannot do yet.

    Raises:
        ValueError: pipeline parallel size above 1, tensor parallel size above 1 on a backend other
            than ``mp``, or a KV connector.
    """
    par = config.parallel
    dp = config.server.data_parallel_size
    if par.pipeline_parallel_size != 1:
        raise ValueError(f"--enable-expert-parallel with --data-parallel-size {dp} needs --pipeline-parallel-size 1 "
                         f"(got {par.pipeline_parallel_size}): each stage would need its own expert group")
    if par.tensor_parallel_size > 1 and par.executor_backend != "mp":
        raise ValueError(f"--enable-expert-parallel with --data-parallel-size {dp} and --tensor-parallel-size "
                         f"{par.tensor_parallel_size} runs the workers with --distributed-executor-backend mp "
                         f"(got {par.executor_backend}): the workers of all engine cores join one group")
    if config.cache.kv_transfer is not None:
        raise ValueError("--kv-transfer-config is not supported with expert parallelism across data-parallel "
                         "engine cores")


def uses_dp_expert_parallel(config: EngineConfig) -> bool:
    """True when the engine cores share their experts (``--data-parallel-size`` > 1 with ``--enable-expert-parallel``)."""
    return bool(config.parallel.enable_expert_parallel) and config.server.data_parallel_size > 1


class DataParallelEPExecutor:
    """One engine core's runner, holding its share of the experts (see the module docstring).

    Args:
        config: the engine config (``server.data_parallel_size`` cores).
        dp_rank: this core's index.
        init_method: the cores' ``torch.distributed`` rendezvous (``tcp://127.0.0.1:PORT``).
        with_tokenizer: as for :func:`~.base.load_frontend`.

    Attributes:
        runner: the :class:`~tokenmill.model.runner.ModelRunner` on this core's shard.
        num_kv_blocks, max_model_len, eos_token_ids, kv_caches: as the runner's.
        num_forwards, num_dummy_steps: real and dummy steps run.
        layout: this core's :class:`~tokenmill.distributed.layout.RankLayout` (its expert slots).
        last_step_stats: ``{"forward": s, "comm": s}`` of the last step (dummy ones included).

    Raises:
        ValueError: from :func:`check_dp_expert_parallel`, the layout (experts not divisible over the
            cores), EPLB's start-up check, or the checkpoint.
        RuntimeError: the rendezvous failed or timed out.
    """

    backend = "dp-ep"

    def __init__(self, config: EngineConfig, dp_rank: int, init_method: str,
                 with_tokenizer: bool | str = True) -> None:
        import torch

        from tokenmill.distributed.eplb import build_controller, check_eplb_startup
        from tokenmill.distributed.expert_parallel import StepSync, moe_layers
        from tokenmill.distributed.layout import check_parallel_arch
        from tokenmill.distributed.model_loader import build_shard, checkpoint_weights, describe_shard
        from tokenmill.distributed.parallel_state import init_data_parallel_ep
        from tokenmill.model.loader import resolve_dtype, with_redundant_experts
        from tokenmill.model.process_tuning import configure_allocator, configure_threads
        from tokenmill.model.runner import ModelRunner, resolve_device

        t0 = time.perf_counter()
        check_dp_expert_parallel(config)
        par, dp = config.parallel, config.server.data_parallel_size
        if par.tensor_parallel_size != 1:
            raise ValueError("DataParallelEPExecutor runs tensor-parallel size 1; use make_dp_ep_executor")
        arch, self.loaded = load_frontend(config.model.model, with_tokenizer)
        check_eplb_startup(par, arch, dp)
        if getattr(arch, "is_moe", False):
            arch = with_redundant_experts(arch, par.eplb.num_redundant_experts)
            check_parallel_arch(arch, 1, 1, True, dp)
        if not config.model.enforce_eager:
            logger.warning("--no-enforce-eager is not supported with expert parallelism across engine cores; "
                           "running eagerly")
            config = config.replace(enforce_eager=True)
        if config.model.quantization is not None:
            raise ValueError(f"--quantization {config.model.quantization} is not supported with expert parallelism "
                             "across data-parallel engine cores yet (the shards are loaded dense)")
        device = resolve_device(config.model.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", dp_rank % max(1, torch.cuda.device_count()))
        configure_threads(device)
        configure_allocator(device)
        if device.type == "cpu":
            # compile/load the C kernels before the first step (a first use inside a collective stalls the peers)
            from tokenmill.model.layers import fused_cpu, paged_attention_cpu

            fused_cpu.load()
            paged_attention_cpu.load()
        self.ctx = init_data_parallel_ep(dp_rank, dp, init_method, device)
        dtype = resolve_dtype(config.model.dtype, device, config.cpu_kernels.native_bf16)
        model, larch, self.layout = build_shard(arch, self.ctx, dtype, checkpoint_weights(config.model.model, arch),
                                                enable_expert_parallel=True)
        self.runner = ModelRunner(model, larch, config, device, dtype, self.loaded.eos_token_ids)
        self.runner.eplb = build_controller(config, model, ep_rank=dp_rank, ep_size=dp, group=self.ctx.ep.group,
                                            global_ranks=list(range(dp)))
        self.sync = StepSync(self.ctx.dp)
        self._moe = moe_layers(model)
        self._hidden, self._dtype, self._device = arch.hidden_size, dtype, device
        self.dp_rank, self.dp_size = dp_rank, dp
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.max_model_len = resolve_max_model_len(config, arch)
        self.eos_token_ids = list(self.loaded.eos_token_ids)
        self.kv_caches = self.runner.kv_caches
        self.num_forwards = 0
        self.num_dummy_steps = 0
        self.last_step_stats: dict[str, float] = {}
        self._step_seconds = 0.0
        logger.info("data-parallel engine %d/%d, expert parallel: %s (loaded in %.1f s)", dp_rank, dp,
                    describe_shard(self.layout, 0, self.num_kv_blocks, self.runner.bytes_per_token),
                    time.perf_counter() - t0)

    def describe(self) -> str:
        """One line for the start-up log: this core's experts."""
        return f"data-parallel engine {self.dp_rank}/{self.dp_size}{self.layout.describe_experts()}"

    # -- steps ---------------------------------------------------------------------------
    def step_sync(self, has_work: bool, wakes_seen: int, stop: bool = False) -> tuple[bool, bool, int]:
        """:meth:`StepSync.sync <tokenmill.distributed.expert_parallel.StepSync.sync>` over the cores."""
        return self.sync.sync(has_work, wakes_seen, stop)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step of this core's own requests (its MoE layers exchange tokens with the other cores).

        Raises:
            LockstepStepError: the forward failed (fatal, see the module docstring).
        """
        c0, t0 = self.ctx.comm_seconds(), time.perf_counter()
        try:
            out = self.runner.execute_model(so)
        except Exception as e:  # noqa: BLE001 - a half-done collective cannot be resumed
            raise LockstepStepError(f"data-parallel engine {self.dp_rank}: step failed: {type(e).__name__}: {e}") from e
        self.num_forwards += 1
        self._record(t0, c0)
        return out

    def execute_dummy(self) -> None:
        """A step with no tokens of this core's own: serve the other cores' tokens routed to this core's
        experts (:func:`~tokenmill.distributed.expert_parallel.dummy_forward`), and count the step for EPLB.

        Raises:
            LockstepStepError: a collective failed (a peer died or timed out).
        """
        from tokenmill.distributed.expert_parallel import dummy_forward

        c0, t0 = self.ctx.comm_seconds(), time.perf_counter()
        try:
            dummy_forward(self._moe, self._hidden, self._dtype, self._device)
            if self.runner.eplb is not None:
                self.runner.eplb.after_step()
        except Exception as e:  # noqa: BLE001
            raise LockstepStepError(f"data-parallel engine {self.dp_rank}: dummy step failed: "
                                    f"{type(e).__name__}: {e}") from e
        self.num_dummy_steps += 1
        self._record(t0, c0)

    def _record(self, t0: float, c0: float) -> None:
        dt = time.perf_counter() - t0
        self._step_seconds += dt
        self.last_step_stats = {"forward": dt, "comm": self.ctx.comm_seconds() - c0}

    def release_requests(self, req_ids) -> None:
        self.runner.release_requests(req_ids)

    @property
    def eplb_stats(self) -> Any:
        """This core's EPLB state (the placement and loads are the whole group's; None without EPLB)."""
        return self.runner.eplb_stats

    @property
    def expert_parallel_stats(self) -> dict[str, float]:
        """Cumulative figures for :attr:`EngineStats.expert_parallel <tokenmill.metrics.stats.EngineStats>`:
        steps, dummy steps, seconds in steps, in the all-to-all exchanges and in the per-step sync."""
        return {"steps": self.num_forwards + self.num_dummy_steps, "dummy_steps": self.num_dummy_steps,
                "step_seconds": self._step_seconds, "all_to_all_seconds": self.ctx.ep.seconds,
                "sync_seconds": self.ctx.dp.seconds}

    def shutdown(self) -> None:
        """Leave the process group (idempotent)."""
        from tokenmill.distributed.parallel_state import destroy_distributed

        destroy_distributed()


def make_dp_ep_executor(config: EngineConfig, dp_rank: int, init_method: str, worker_init_method: str | None = None,
                        with_tokenizer: bool | str = True) -> Any:
    """The executor of data-parallel engine core ``dp_rank`` sharing its experts: in-process with tensor
    parallel size 1, else ``mp`` workers in one world with the other cores' workers.

    Raises:
        ValueError: as the executors; ``worker_init_method`` missing with tensor parallel size above 1.
    """
    if config.parallel.tensor_parallel_size == 1:
        return DataParallelEPExecutor(config, dp_rank, init_method, with_tokenizer)
    if worker_init_method is None:
        raise ValueError("expert parallelism across data-parallel engine cores with tensor parallelism needs the "
                         "workers' rendezvous (worker_init_method)")
    return DataParallelEPMultiprocExecutor(config, dp_rank, init_method, worker_init_method, with_tokenizer)


class DataParallelEPMultiprocExecutor:
    """One engine core's ``mp`` workers (tensor parallel size ``T`` > 1) holding their share of the experts of
    the ``T * N`` ranks of all cores (see the module docstring).

    The core process runs no model: its workers do (:class:`~tokenmill.engine.executor.mp.MultiprocExecutor`
    with the world's rendezvous), and it joins a gloo group of the ``N`` cores (CPU: it holds no device) for
    :meth:`step_sync`. Same step interface as :class:`DataParallelEPExecutor`.

    Args:
        config: the engine config (``server.data_parallel_size`` cores, ``-tp`` workers each).
        dp_rank: this core's index.
        init_method: the cores' rendezvous (the per-step agreement).
        worker_init_method: the rendezvous of the ``T * N`` workers (the expert-parallel world).
        with_tokenizer: as for :func:`~.base.load_frontend`.

    Attributes:
        num_kv_blocks, max_model_len, eos_token_ids, worker_infos, last_step_stats, pids: as
            :class:`~tokenmill.engine.executor.mp.MultiprocExecutor`'s.
        num_forwards, num_dummy_steps: real and dummy steps run.

    Raises:
        ValueError: from :func:`check_dp_expert_parallel`, the layout, EPLB's check or a worker's start-up.
        WorkerDiedError: a worker died during start-up.
        RuntimeError: the cores' rendezvous failed.
    """

    backend = "dp-ep-mp"

    def __init__(self, config: EngineConfig, dp_rank: int, init_method: str, worker_init_method: str,
                 with_tokenizer: bool | str = True) -> None:
        from tokenmill.distributed.expert_parallel import StepSync
        from tokenmill.distributed.parallel_state import destroy_distributed, init_data_parallel_ep

        t0 = time.perf_counter()
        check_dp_expert_parallel(config)
        dp = config.server.data_parallel_size
        self.dp_rank, self.dp_size = dp_rank, dp
        self.mp = MultiprocExecutor(config, with_tokenizer, dp_rank=dp_rank, dp_size=dp,
                                    init_method=worker_init_method)
        try:
            self.ctx = init_data_parallel_ep(dp_rank, dp, init_method, "cpu")
        except BaseException:
            self.mp.shutdown()
            destroy_distributed()
            raise
        self.sync = StepSync(self.ctx.dp)
        self.loaded = self.mp.loaded
        self.num_kv_blocks = self.mp.num_kv_blocks
        self.max_model_len = self.mp.max_model_len
        self.eos_token_ids = self.mp.eos_token_ids
        self.num_forwards = 0
        self.num_dummy_steps = 0
        self._step_seconds = 0.0
        self._ep_seconds = 0.0
        logger.info("%s (started in %.1f s)", self.describe(), time.perf_counter() - t0)

    @property
    def worker_infos(self) -> list[Any]:
        return self.mp.worker_infos

    @property
    def last_step_stats(self) -> list[Any]:
        return self.mp.last_step_stats

    @property
    def pids(self) -> list[int]:
        return self.mp.pids

    def describe(self) -> str:
        """One line for the start-up log: the experts of each of this core's workers."""
        ranks = "; ".join(f"rank {i.rank}{i.experts}" for i in self.mp.worker_infos)
        return (f"data-parallel engine {self.dp_rank}/{self.dp_size}, tensor-parallel "
                f"{len(self.mp.worker_infos)} workers: {ranks}")

    def step_sync(self, has_work: bool, wakes_seen: int, stop: bool = False) -> tuple[bool, bool, int]:
        """:meth:`StepSync.sync <tokenmill.distributed.expert_parallel.StepSync.sync>` over the cores."""
        return self.sync.sync(has_work, wakes_seen, stop)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step of this core's own requests on its workers.

        Raises:
            LockstepStepError: a worker died or its step failed (fatal: the peers are left in a collective).
        """
        t0 = time.perf_counter()
        try:
            out = self.mp.execute_model(so)
        except Exception as e:  # noqa: BLE001 - a half-done collective cannot be resumed
            raise LockstepStepError(f"data-parallel engine {self.dp_rank}: step failed: {type(e).__name__}: {e}") from e
        if not so.is_empty:
            self.num_forwards += 1
            self._record(t0)
        return out

    def execute_dummy(self) -> None:
        """Every worker takes part in the step's MoE exchanges with no tokens of this core's own.

        Raises:
            LockstepStepError: a worker died or a collective failed.
        """
        t0 = time.perf_counter()
        try:
            self.mp.execute_dummy()
        except Exception as e:  # noqa: BLE001
            raise LockstepStepError(f"data-parallel engine {self.dp_rank}: dummy step failed: "
                                    f"{type(e).__name__}: {e}") from e
        self.num_dummy_steps += 1
        self._record(t0)

    def _record(self, t0: float) -> None:
        self._step_seconds += time.perf_counter() - t0
        stats = self.mp.last_step_stats
        if stats:       # the slowest worker's exchange time (they wait for one another)
            self._ep_seconds += max(getattr(s, "ep_comm", 0.0) for s in stats)

    def check_health(self) -> None:
        """Raise :class:`~tokenmill.engine.executor.base.WorkerDiedError` if a worker is gone (idle cores call it)."""
        self.mp.check_health()

    @property
    def eplb_stats(self) -> Any:
        """This core's EPLB state (from its output worker; the placement and loads are the whole world's)."""
        return self.mp.eplb_stats

    @property
    def expert_parallel_stats(self) -> dict[str, float]:
        """As :attr:`DataParallelEPExecutor.expert_parallel_stats` (all-to-all seconds: per step, the
        slowest of this core's workers)."""
        return {"steps": self.num_forwards + self.num_dummy_steps, "dummy_steps": self.num_dummy_steps,
                "step_seconds": self._step_seconds, "all_to_all_seconds": self._ep_seconds,
                "sync_seconds": self.ctx.dp.seconds}

    def shutdown(self) -> None:
        """Stop the workers and leave the cores' group (idempotent)."""
        from tokenmill.distributed.parallel_state import destroy_distributed

        try:
            self.mp.shutdown()
        finally:
            destroy_distributed()
