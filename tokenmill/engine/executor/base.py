"""What the distributed executors share: planning the KV pool, front-end info, the step protocol."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.model.checkpoint import load_arch_config, resolve_checkpoint

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process or actor is gone: the engine cannot run another step.

    ``fatal`` tells :class:`EngineCore` not to treat it as one failed batch:
    the engine core exits, the front end fails every request with 503 and
    ``/health`` reports 503.
    """

    fatal = True


@dataclass
class FrontendInfo:
    """What the offline ``LLM`` and the engine core need from the checkpoint besides the weights.

    Attributes mirror :class:`tokenmill.model.loader.LoadedModel`.
    """

    tokenizer: Any
    chat_template: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    name: str
    path: str


def merge_step_replies(replies: list[tuple]) -> tuple[Any, list[Any]]:
    """Combine the workers' replies to one step into (the step's output, per-rank step stats).

    Each reply is ``(status, output_or_error, stats)``: the last pipeline stage's rank 0 returns the
    :class:`ModelRunnerOutput`, the others ``None``.

    Raises:
        RuntimeError: a worker reported an error (the first one is named), or no worker returned an output.
    """
    errors = [m[1] for m in replies if m[0] == "error"]
    if errors:
        raise RuntimeError(f"worker step failed: {errors[0]}")
    stats = [m[2] for m in replies]
    for m in replies:
        if m[1] is not None:
            return m[1], stats
    raise RuntimeError("no worker returned the step's output")


def eplb_stats_of(step_stats: list[Any]) -> Any:
    """The EPLB state carried by one step's per-rank stats (the output rank's), or None without EPLB."""
    for st in step_stats:
        e = getattr(st, "eplb", None)
        if e is not None:
            return e
    return None


def load_frontend(path: str | None, with_tokenizer: bool | str = True) -> tuple[Any, FrontendInfo]:
    """``(arch, FrontendInfo)`` of a checkpoint without loading its weights.

    Raises:
        FileNotFoundError, ValueError: from the loader.
    """
    from tokenmill.model.loader import resolve_tokenizer

    kind, full = resolve_checkpoint(path)
    arch = load_arch_config(full)
    template = None
    if kind == "gguf":
        from tokenmill.model.gguf_loader import chat_template, open_gguf

        template = chat_template(open_gguf(full))
        name = os.path.splitext(os.path.basename(full))[0]
    else:
        name = os.path.basename(os.path.normpath(full))
    tokenizer, template, eos = resolve_tokenizer(full, arch, template, with_tokenizer)
    return arch, FrontendInfo(tokenizer=tokenizer, chat_template=template, eos_token_ids=list(eos),
                              bos_token_id=arch.bos_token_id, name=name, path=full)


def check_parallel_config(config: EngineConfig, arch: Any, dp_size: int = 1) -> None:
    """Refuse, before any worker starts, what the tensor/pipeline-parallel path cannot do yet (``dp_size``:
    data-parallel engine cores sharing the experts with ``--enable-expert-parallel``).

    Raises:
        ValueError: ``--quantization`` with more than one rank, a layout the
            model cannot be split into (:func:`~tokenmill.distributed.layout.check_parallel_arch`), or
            ``--enable-eplb`` where it cannot run (:func:`~tokenmill.distributed.eplb.check_eplb_startup`).
    """
    from tokenmill.distributed.layout import check_parallel_arch

    from tokenmill.distributed.eplb import check_eplb_startup

    par = config.parallel
    check_eplb_startup(par, arch, dp_size)
    if config.model.quantization is not None and par.world_size > 1:
        raise ValueError(f"--quantization {config.model.quantization} is not supported with tensor/pipeline "
                         "parallelism yet (the shards are loaded dense)")
    from tokenmill.model.loader import with_redundant_experts

    if getattr(arch, "is_moe", False):
        arch = with_redundant_experts(arch, par.eplb.num_redundant_experts)
    check_parallel_arch(arch, par.tensor_parallel_size, par.pipeline_parallel_size, par.enable_expert_parallel,
                        dp_size)


def plan_kv_blocks(config: EngineConfig, arch: Any) -> tuple[int, list[int]]:
    """One KV pool size (blocks) for every rank: the smallest any rank's budget allows.

    ``--kv-cache-memory`` is each rank's budget (as vLLM's memory fraction is
    per GPU); a rank's bytes per token count only its layers and K/V heads,
    so tensor parallelism multiplies the pool (when the K/V heads split) and
    pipeline parallelism divides the layers each rank stores.

    Returns:
        ``(num_kv_blocks, bytes_per_token per rank)``.

    Raises:
        ValueError: from :func:`~tokenmill.distributed.layout.check_parallel_arch`.
    """
    import torch

    from tokenmill.distributed.layout import rank_layout
    from tokenmill.model.cpu_facts import engine_plan
    from tokenmill.model.loader import resolve_dtype
    from tokenmill.model.runner import kv_bytes_per_token, resolve_device

    from tokenmill.model.layers.kv_quant import resolve_kv_cache_dtype

    par = config.parallel
    device = resolve_device(config.model.device)
    # tensor-parallel shards load dense weights (worker.py builds their ModelRunner without the GGUF's low-bit
    # codes), so the kernel plan's --kv-cache-dtype auto is the model's dtype there, even for a float32 model on
    # the CPU, where one process keeps a bfloat16 cache (kv_quant.auto_kv_bf16); pipeline stages keep the codes
    # and so one process's cache dtype. tokenmill plan applies the same rule.
    from tokenmill.distributed.model_loader import pipeline_keeps_lowbit

    plan = engine_plan(config, device, checkpoint_lowbit=pipeline_keeps_lowbit(config))
    dtype = resolve_kv_cache_dtype(plan.kv_cache_dtype, resolve_dtype(plan.dtype, device), device)
    per_rank = []
    for rank in range(par.world_size):
        lay = rank_layout(arch, par.tensor_parallel_size, par.pipeline_parallel_size, rank, par.enable_expert_parallel)
        per_rank.append(kv_bytes_per_token(lay.num_layers, lay.kv_heads[1] - lay.kv_heads[0], arch.head_dim, dtype))
    if config.cache.num_kv_blocks is not None:
        return int(config.cache.num_kv_blocks), per_rank
    bs = config.cache.block_size
    return max(1, min(config.cache.kv_cache_memory_bytes // (b * bs) for b in per_rank)), per_rank


def plan_cpus(world_size: int, cpus: list[int] | None = None) -> list[list[int] | None]:
    """Disjoint CPU sets for ``world_size`` workers on this machine.

    The CPUs this process may use are dealt out in contiguous runs, the
    first ranks getting one more when they do not divide evenly. With fewer
    CPUs than workers every worker gets one CPU, shared round-robin (the
    caller logs it: workers then compete for cores). ``TOKENMILL_WORKER_CPUS=0``
    turns pinning off (None for every rank).
    """
    if not envs.TOKENMILL_WORKER_CPUS:
        return [None] * world_size
    if cpus is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return [None] * world_size
    if len(cpus) < world_size:
        return [[cpus[r % len(cpus)]] for r in range(world_size)]
    base, extra = divmod(len(cpus), world_size)
    out, i = [], 0
    for r in range(world_size):
        n = base + (1 if r < extra else 0)
        out.append(cpus[i:i + n])
        i += n
    return out


def log_layout(infos: list[Any], backend: str) -> None:
    """The start-up summary: one line per rank (layout, weight bytes, KV blocks, CPUs)."""
    for i in infos:
        logger.info("[%s] %s; weights %.1f MiB; KV %d blocks x %d bytes/token; %d threads on CPUs %s; "
                    "pid %d; loaded in %.1f s", backend, i.layout, i.weight_bytes / 2**20, i.num_kv_blocks,
                    i.kv_bytes_per_token, i.num_threads, i.cpus or "any", i.pid, i.load_seconds)


def resolve_max_model_len(config: EngineConfig, arch: Any) -> int:
    """The context limit the runner would use (``--max-model-len`` or the model's)."""
    return int(config.model.max_model_len or arch.max_position_embeddings)
