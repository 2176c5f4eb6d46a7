"""One rank of a tensor/pipeline-parallel model: its shard, its share of the KV cache, its runner.

Used by both distributed executors: :mod:`~tokenmill.engine.executor.mp`
runs :func:`worker_main` in a child process; :mod:`~tokenmill.engine.executor.ray`
wraps :class:`Worker` in a Ray actor.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.distributed.eplb import build_controller
from tokenmill.distributed.expert_parallel import dummy_forward, moe_layers
from tokenmill.distributed.model_loader import build_shard, checkpoint_weights, describe_shard, model_weight_bytes, \
    pipeline_keeps_lowbit, shard_lowbit_weights
from tokenmill.distributed.parallel_state import destroy_distributed, init_distributed
from tokenmill.engine.executor.step_codec import StepDecoder
from tokenmill.model.cpu_facts import engine_plan
from tokenmill.model.layers import fused_cpu, paged_attention_cpu

logger = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    """What a worker reports once its shard is loaded (the start-up log line).

    Attributes:
        rank: global rank.
        pid: its process id.
        layout: its :meth:`RankLayout.describe` line (layers, heads, vocabulary rows).
        weight_bytes: bytes of its weights.
        num_kv_blocks: blocks in its KV pool (every rank has the same count).
        kv_bytes_per_token: KV bytes one token takes on this rank.
        num_threads: its torch intra-op threads.
        cpus: the CPUs it is pinned to (empty: not pinned).
        load_seconds: shard build time.
        experts: its :meth:`RankLayout.describe_experts` part (empty for a dense model).
    """

    rank: int
    pid: int
    layout: str
    weight_bytes: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    num_threads: int
    cpus: list[int]
    load_seconds: float
    experts: str = ""


@dataclass
class StepStats:
    """One worker's timings for one step, in seconds (and, from the output rank with ``--enable-eplb``,
    the EPLB state: :class:`~tokenmill.metrics.stats.EplbStats`).

    Attributes:
        forward: the step's wall time on this rank.
        comm: of which inside ``torch.distributed`` calls (all groups).
        ep_comm: of which inside the expert-parallel all-to-all exchanges (``ParallelContext.ep``).
    """

    forward: float = 0.0
    comm: float = 0.0
    eplb: Any = None
    ep_comm: float = 0.0


def pin_process(cpus: list[int] | None) -> int:
    """Pin this process to ``cpus`` and give torch one intra-op thread per CPU; returns the thread count.

    ``TOKENMILL_NUM_THREADS`` overrides the count. Without ``cpus`` the
    process keeps its affinity and gets one thread per CPU of it.
    """
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as e:          # not Linux, or CPUs not available
            logger.warning("could not pin to CPUs %s: %s", cpus, e)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    n = envs.TOKENMILL_NUM_THREADS or usable
    torch.set_num_threads(n)
    return n


def rank_device(device: str, rank: int, tp_size: int, pp_size: int) -> torch.device:
    """The device of ``rank``: CPU, or GPU ``rank mod visible GPUs`` for ``cuda``/``auto`` with GPUs."""
    from tokenmill.model.runner import resolve_device

    d = resolve_device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return d


class Worker:
    """Builds rank ``rank``'s shard and runs steps on it.

    Args:
        config: the engine config; ``cache.num_kv_blocks`` must be set (the
            executor plans one pool size for all ranks).
        rank: global rank.
        init_method: ``torch.distributed`` rendezvous (``tcp://host:port``).
        cpus: CPUs to pin to (None: keep the affinity).
        dp_rank, dp_size: with ``--data-parallel-size N --enable-expert-parallel``, this worker's engine
            core and the cores whose workers share the experts (one world of ``tp * N`` ranks:
            :func:`~tokenmill.distributed.parallel_state.init_distributed`).

    Raises:
        ValueError: from the layout check or the checkpoint.
        RuntimeError: rendezvous failed.
    """

    def __init__(self, config: EngineConfig, rank: int, init_method: str, cpus: list[int] | None = None,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        from tokenmill.model.loader import load_arch_config, resolve_dtype, with_redundant_experts
        from tokenmill.model.runner import ModelRunner, configure_allocator

        t0 = time.perf_counter()
        par = config.parallel
        if not config.model.enforce_eager and par.world_size > 1:
            # the compiled dense step would trace the all-reduce inside o_proj/down_proj; not supported yet
            logger.warning("--no-enforce-eager is not supported with tensor/pipeline parallelism; running eagerly")
            config = config.replace(enforce_eager=True)
        self.rank = rank
        self.num_threads = pin_process(cpus)
        device = rank_device(config.model.device, rank, par.tensor_parallel_size, par.pipeline_parallel_size)
        configure_allocator(device)
        if device.type == "cpu":
            # Build/load the C kernels now: a first use inside a step compiles them (tens of seconds on a busy
            # machine) while the other ranks wait in a collective, which then timed out (seen in the benchmark).

            fused_cpu.load()
            paged_attention_cpu.load()
        self.ctx = init_distributed(rank, par.tensor_parallel_size, par.pipeline_parallel_size, init_method, device,
                                    dp_size=dp_size, dp_rank=dp_rank)
        arch = with_redundant_experts(load_arch_config(config.model.model), par.eplb.num_redundant_experts)
        dtype = resolve_dtype(config.model.dtype, device, config.cpu_kernels.native_bf16)
        model, larch, self.layout = build_shard(arch, self.ctx, dtype, checkpoint_weights(config.model.model, arch),
                                                enable_expert_parallel=par.enable_expert_parallel)
        wb = model_weight_bytes(model)      # before the runner packs the linears (opaque oneDNN tensors)
        # a pipeline stage (no tensor parallelism) runs the GGUF's low-bit codes as one process does, so the
        # pipeline split does not change a token's bits (docs/guide/batch_invariance.md)
        lowbit = None
        if device.type == "cpu" and pipeline_keeps_lowbit(config) and engine_plan(config, device).lowbit_max_tokens:
            lowbit = shard_lowbit_weights(config.model.model, arch, self.layout, model)
        self.runner = ModelRunner(model, larch, config, device, dtype, arch.eos_token_ids, lowbit_weights=lowbit,
                                  lora_shard=(arch, self.layout) if config.model.enable_lora else None)
        if par.enable_eplb:
            ep, ctx = self.layout.ep_size, self.ctx
            # the group's global ranks (weight moves are point-to-point): the stage's tensor-parallel ranks, or
            # the whole world when the experts are shared over data-parallel engine cores
            glob = (list(range(ep)) if dp_size > 1 else [ctx.pp_rank * ctx.tp_size + i for i in range(ctx.tp_size)])
            self.runner.eplb = build_controller(config, model, ep_rank=self.layout.ep_rank, ep_size=ep,
                                                group=ctx.ep.group, global_ranks=glob)
        self._moe = moe_layers(model) if dp_size > 1 else []
        self._hidden, self._dtype, self._device = arch.hidden_size, dtype, device
        self.decoder = StepDecoder()
        self.is_output_rank = self.layout.is_last_stage and self.layout.tp_rank == 0
        self.info = WorkerInfo(rank=rank, pid=os.getpid(), layout=self.layout.describe(), weight_bytes=wb,
                               num_kv_blocks=self.runner.num_kv_blocks,
                               kv_bytes_per_token=self.runner.bytes_per_token, num_threads=self.num_threads,
                               cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
                               load_seconds=time.perf_counter() - t0, experts=self.layout.describe_experts())
        logger.info("%s", describe_shard(self.layout, wb, self.runner.num_kv_blocks, self.runner.bytes_per_token))

    def execute(self, desc):
        """Run one step (a :class:`~tokenmill.engine.executor.step_codec.StepDescription`).

        Returns:
            ``(ModelRunnerOutput or None, StepStats)``: the output only on the
            output rank (last stage, tensor-parallel rank 0).
        """
        so = self.decoder.decode(desc)
        c0, e0, t0 = self.ctx.comm_seconds(), self.ctx.ep.seconds, time.perf_counter()
        out = self.runner.execute_model(so)
        return (out if self.is_output_rank else None), self._stats(t0, c0, e0)

    def lora_control(self, op: tuple) -> None:
        """An adapter load or remove from the engine core's :class:`~tokenmill.lora.tp.WorkerLoRAProxy`
        (``("load", LoRARequest)`` starts a load on the runner's loader thread; ``("remove", id)``).
        Never raises: a failed load is reported by the step that needs the adapter."""
        from tokenmill.lora.tp import apply_worker_op

        if self.runner.lora_manager is None:
            logger.warning("LoRA op %s ignored: this worker has no adapters (--enable-lora)", op[0])
            return
        try:
            apply_worker_op(self.runner.lora_manager, op)
        except Exception:  # noqa: BLE001 - the step that needs the adapter fails instead
            logger.exception("LoRA op %s failed", op[0])

    def execute_dummy(self):
        """A step with no tokens of this engine core's own, with experts shared over data-parallel cores:
        every MoE layer's exchange (:func:`~tokenmill.distributed.expert_parallel.dummy_forward`, serving the
        other cores' tokens routed to this rank's experts), and the step counted for EPLB.

        Returns:
            ``(None, StepStats)``.
        """
        c0, e0, t0 = self.ctx.comm_seconds(), self.ctx.ep.seconds, time.perf_counter()
        dummy_forward(self._moe, self._hidden, self._dtype, self._device)
        if self.runner.eplb is not None:
            self.runner.eplb.after_step()
        return None, self._stats(t0, c0, e0)

    def _stats(self, t0: float, c0: float, e0: float) -> StepStats:
        return StepStats(forward=time.perf_counter() - t0, comm=self.ctx.comm_seconds() - c0,
                         eplb=self.runner.eplb_stats if self.is_output_rank else None,
                         ep_comm=self.ctx.ep.seconds - e0)

    def kv_tier(self, msg: tuple) -> Any:
        """One message of the engine core's KV offloading tier for this rank's store (this rank's shard of
        every block: :func:`tokenmill.kv_transfer.offloading.worker_tier_call`)."""
        from tokenmill.kv_transfer.offloading import worker_tier_call

        self._kv_tier, reply = worker_tier_call(getattr(self, "_kv_tier", None), self.runner, self.layout, msg)
        return reply

    def close(self) -> None:
        store = getattr(self, "_kv_tier", None)
        if store is not None:
            store.shutdown()
        destroy_distributed()
