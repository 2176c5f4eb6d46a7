"""Build one rank's shard of a Llama-family model from a checkpoint (or from random weights for tests).

The shard is an ordinary :class:`~tokenmill.model.llama.LlamaForCausalLM` of
the rank's local architecture (:func:`~tokenmill.distributed.layout.local_arch`:
its layers, heads, FFN columns and vocabulary rows), loaded from the full
checkpoint through :func:`~tokenmill.distributed.layout.shard_weights`, then
rewired: o_proj/down_proj become :class:`RowParallelLinear`, the embedding a
:class:`VocabParallelEmbedding`, the LM head a :class:`ParallelLMHead`, and the
model gets a :class:`PipelineStage` when there is more than one stage. Each
rank reads the checkpoint itself and keeps only its tensors (peak memory: its
shard plus one full tensor at a time).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.distributed.layers import (NoLMHead, ParallelLMHead, PipelineStage, RowParallelLinear,
                                          VocabParallelEmbedding)
from tokenmill.distributed.layout import RankLayout, local_arch, rank_layout, shard_weights
from tokenmill.distributed.parallel_state import ParallelContext
from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.distributed.expert_parallel import ExpertParallel
from tokenmill.model.checkpoint import resolve_checkpoint

logger = logging.getLogger(__name__)

PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
                          "Qwen3MoeForCausalLM")


def build_shard(arch: ModelArchConfig, ctx: ParallelContext, dtype: torch.dtype,
                weights: Iterable[tuple[str, torch.Tensor]], enable_expert_parallel: bool = False,
                ) -> tuple[nn.Module, ModelArchConfig, RankLayout]:
    """Instantiate and load the shard of ``ctx.rank``.

    Args:
        arch: the full model's architecture.
        ctx: the rank and its communicators.
        dtype: weight dtype.
        weights: the full checkpoint's ``(hf_name, tensor)`` pairs.
        enable_expert_parallel: MoE layers hold whole experts (a share of the
            slots per rank of the tensor-parallel group, or of the data-parallel engine cores when
            ``ctx.dp_size > 1``; all-to-all dispatch: :mod:`~tokenmill.distributed.expert_parallel`)
            instead of every expert's columns (all-reduce after the experts).

    Returns:
        ``(model, local arch, layout)``: the model on ``ctx.device``, in eval
        mode; its KV cache needs ``local_arch.num_hidden_layers`` layers of
        ``local_arch.num_key_value_heads`` heads.

    Raises:
        ValueError: an architecture outside the Llama/Qwen family, a layout
            the model cannot be split into (:func:`check_parallel_arch`), or
            checkpoint tensors that do not fit.
    """
    from tokenmill.model.layers.attention import get_attention_backend
    from tokenmill.model.registry import get_model_class, normalize_architecture

    if normalize_architecture(arch.architecture) not in PARALLEL_ARCHITECTURES:
        raise ValueError(f"tensor/pipeline parallelism supports {', '.join(PARALLEL_ARCHITECTURES)}, "
                         f"not {arch.architecture}")
    lay = rank_layout(arch, ctx.tp_size, ctx.pp_size, ctx.rank, enable_expert_parallel, ctx.dp_size, ctx.dp_rank)
    larch = local_arch(arch, lay)
    tied = arch.tie_word_embeddings
    keep_embedding = lay.is_first_stage or (lay.is_last_stage and tied)
    cls = get_model_class(larch.architecture)
    with torch.device("meta"):
        model = cls(larch, attn_backend=get_attention_backend(ctx.device))
    inner = model.model
    if not keep_embedding:
        inner.embed_tokens = None
    if not lay.is_last_stage and model.lm_head is not None:
        model.lm_head = None
    model = model.to_empty(device=ctx.device).to(dtype)
    model.load_weights(shard_weights(weights, lay, tied=tied, keep_embedding=keep_embedding))
    # communication wrappers (after loading: the checkpoint names match the dense modules)
    from tokenmill.model.layers.moe import FusedMoE

    for layer in inner.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, ctx.tp)
        if isinstance(layer.mlp, FusedMoE):
            if lay.ep_size > 1:   # over data-parallel cores each has its own tokens (ctx.tp: size 1)
                layer.mlp.ep = ExpertParallel(ctx.ep, None if ctx.dp_size == 1 else ctx.tp)
            elif ctx.tp_size > 1:
                layer.mlp.tp_comm = ctx.tp
        else:
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, ctx.tp)
    if lay.is_last_stage:
        if tied:
            head = nn.Linear(larch.hidden_size, larch.vocab_size, bias=False, device=ctx.device, dtype=dtype)
            head.weight = inner.embed_tokens.weight          # shares the embedding shard's storage
        else:
            head = model.lm_head
        model.lm_head = ParallelLMHead(head, ctx.tp, arch.vocab_size)
    else:
        model.lm_head = NoLMHead()
    if inner.embed_tokens is not None and lay.is_first_stage:
        inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens.weight.data, lay.vocab[0], ctx.tp)
    elif inner.embed_tokens is not None:          # last stage, tied: keep the rows only as the LM head
        inner.embed_tokens = None
    if ctx.pp_size > 1:
        model.pp_stage = PipelineStage(ctx.pp, lay.is_first_stage, lay.is_last_stage, ctx.prev_rank,
                                       ctx.next_rank, arch.hidden_size)
    model.eval()
    model.requires_grad_(False)
    return model, larch, lay


def checkpoint_weights(path: str | None, arch: ModelArchConfig) -> Iterable[tuple[str, torch.Tensor]]:
    """The full checkpoint's ``(hf_name, tensor)`` pairs (GGUF dequantized; HF safetensors as stored)."""
    kind, path = resolve_checkpoint(path)
    if kind == "gguf":
        from tokenmill.model.gguf_loader import iter_gguf_weights, open_gguf

        return iter_gguf_weights(open_gguf(path), arch)
    from tokenmill.model.hf_loader import iter_hf_weights

    return iter_hf_weights(path)


def pipeline_keeps_lowbit(config) -> bool:
    """Whether the ranks of ``config`` (an :class:`~tokenmill.config.EngineConfig`) run the GGUF's low-bit codes
    (:func:`shard_lowbit_weights`): a GGUF checkpoint, no tensor parallelism (pipeline stages only), no
    ``--quantization``; the same rule as the planner's (:func:`tokenmill.kernel_plan.resolve_kernel_plan`)."""
    par = config.parallel
    if par.tensor_parallel_size != 1 or config.model.quantization is not None:
        return False
    return resolve_checkpoint(config.model.model)[0] == "gguf"


def shard_lowbit_weights(path: str | None, arch: ModelArchConfig, lay: RankLayout, model: nn.Module) -> dict | None:
    """The GGUF's low-bit codes of a pipeline stage's linears, keyed by the shard's local module names.

    A stage of a pipeline without tensor parallelism holds whole layers, so it can run exactly the kernels one
    process runs (the low-bit codes, :meth:`~tokenmill.model.layers.linear.PackedLinear.attach_lowbit`): with
    them ``--pipeline-parallel-size N`` gives one process's bits (batch invariance over the pipeline split,
    docs/guide/batch_invariance.md). Tensor-parallel shards split rows and reductions; they keep the dense
    weights (None).

    Args:
        path: the checkpoint (only a GGUF file has codes).
        arch: the full model's architecture.
        lay: this rank's layout.
        model: the built shard (for the wrapped modules' names: ``...o_proj.linear``, ``lm_head.linear``).

    Returns:
        local module name -> :class:`~tokenmill.quantization.lowbit.LowBitWeight`, or None (no codes:
        another checkpoint kind, a tensor- or expert-parallel layout, or a GGUF without low-bit linears).
    """
    if lay.tp_size != 1 or lay.ep_size != 1:
        return None
    kind, path = resolve_checkpoint(path)
    if kind != "gguf":
        return None
    from tokenmill.model.gguf_loader import open_gguf
    from tokenmill.quantization.gguf import gguf_lowbit_weights

    full = gguf_lowbit_weights(open_gguf(path), arch, getattr(model, "_STACKED", {})) or {}
    out = {}
    for name, w in full.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if m is not None:
            idx = int(m.group(1))
            if lay.layers[0] <= idx < lay.layers[1]:
                local = f"model.layers.{idx - lay.layers[0]}.{m.group(2)}"
                try:
                    mod = model.get_submodule(local)
                except AttributeError:
                    continue
                # o_proj / down_proj are wrapped (RowParallelLinear: the all-reduce, a no-op on one rank)
                out[local + ".linear" if isinstance(mod, RowParallelLinear) else local] = w
        elif lay.is_last_stage and isinstance(getattr(model, "lm_head", None), ParallelLMHead):
            tied = name == "model.embed_tokens" and arch.tie_word_embeddings
            if (tied or name == "lm_head") and w.out_features == lay.vocab[1] - lay.vocab[0]:
                out["lm_head.linear"] = w
    return out or None


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (shared storage counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def describe_shard(lay: RankLayout, weight_bytes: int, kv_blocks: int, kv_bytes_per_token: int) -> str:
    """The start-up log line of one rank: layout, weight bytes, KV blocks."""
    return (f"{lay.describe()}; weights {weight_bytes / 2**20:.1f} MiB; KV cache {kv_blocks} blocks, "
            f"{kv_bytes_per_token} bytes/token on this rank (pid {os.getpid()})")
