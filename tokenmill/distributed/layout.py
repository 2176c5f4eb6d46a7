"""Which part of a Llama-family model each rank owns, and how checkpoint tensors are cut.

Tensor parallelism (Megatron-LM, arXiv 1909.08053, §3): rank ``t`` of ``T``
owns query heads ``[t*H/T, (t+1)*H/T)``, the matching K/V heads (``K/T`` of
them when ``T <= K``; when ``T > K`` each rank keeps the one K/V head its query
heads read, replicated over ``T/K`` ranks), FFN columns ``[t*I/T, (t+1)*I/T)``
and vocabulary rows ``[t*Vp/T, (t+1)*Vp/T)`` of the vocabulary padded to
``Vp`` (a multiple of ``T``). Fused q/k/v and gate/up are cut per part (each
rank's q rows, then its k rows, then its v rows), as vLLM's
``QKVParallelLinear``/``MergedColumnParallelLinear`` do, so one local GEMM
produces the rank's q, k and v.

Pipeline parallelism (GPipe, arXiv 1811.06965, §2): stage ``p`` of ``P`` owns
a contiguous layer range; the first ``L mod P`` stages get one layer more.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from tokenmill.model.arch_config import ModelArchConfig

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def check_parallel_arch(arch: ModelArchConfig, tp_size: int, pp_size: int,
                        enable_expert_parallel: bool = False, dp_size: int = 1) -> None:
    """Refuse a layout the model cannot be split into, with the reason.

    Mixture-of-experts models: with ``enable_expert_parallel`` the physical
    expert slots (experts + redundant) are shared out whole over the
    ``tp_size * dp_size`` ranks of the expert-parallel group (``dp_size``:
    data-parallel engine cores, ``--data-parallel-size``) and must divide
    evenly; without it every expert's columns are cut like a dense FFN
    (``moe_intermediate_size`` must divide).

    Raises:
        ValueError: ``tp_size`` does not divide the query heads or the FFN
            width, K/V heads and ``tp_size`` do not divide one another, there
            are fewer layers than pipeline stages, or the experts cannot be
            split as asked.
    """
    h, k, i = arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tensor/pipeline parallel sizes must be >= 1, got {tp_size} and {pp_size}")
    if h % tp_size:
        divisors = [d for d in range(1, h + 1) if h % d == 0]
        raise ValueError(f"--tensor-parallel-size {tp_size} does not divide the model's {h} query heads; "
                         f"use one of {divisors}")
    if (tp_size <= k and k % tp_size) or (tp_size > k and tp_size % k):
        raise ValueError(f"--tensor-parallel-size {tp_size} and the model's {k} KV heads must divide one another "
                         "(each rank holds whole KV heads, replicated when the group is larger)")
    has_dense_ffn = not arch.is_moe or arch.moe_layer_mask is not None
    if has_dense_ffn and i % tp_size:
        raise ValueError(f"--tensor-parallel-size {tp_size} does not divide the FFN width {i}")
    ep = tp_size * dp_size
    if arch.is_moe and enable_expert_parallel and arch.num_physical_experts % ep:
        raise ValueError(f"--enable-expert-parallel: {arch.num_physical_experts} experts (with "
                         f"{arch.num_redundant_experts} redundant) cannot be shared evenly by {ep} ranks "
                         f"(tensor-parallel {tp_size} x data-parallel {dp_size}); "
                         f"choose num_redundant_experts to make the total a multiple of {ep}")
    if arch.is_moe and not enable_expert_parallel and arch.moe_intermediate_size % tp_size:
        raise ValueError(f"--tensor-parallel-size {tp_size} does not divide the expert width "
                         f"{arch.moe_intermediate_size}; use --enable-expert-parallel or another size")
    if arch.num_hidden_layers < pp_size:
        raise ValueError(f"--pipeline-parallel-size {pp_size} exceeds the model's {arch.num_hidden_layers} layers")


@dataclass(frozen=True)
class RankLayout:
    """What one rank owns.

    Attributes:
        rank, tp_rank, tp_size, pp_rank, pp_size: its place.
        layers: ``(first, end)`` global layer indices of its stage (end exclusive).
        q_heads: ``(first, end)`` global query heads.
        kv_heads: ``(first, end)`` global K/V heads (replicated ones included).
        ffn: ``(first, end)`` FFN columns.
        vocab: ``(first, end)`` vocabulary rows in the padded vocabulary
            (rows at or above ``vocab_size`` are padding, zero weights).
        vocab_size: the real vocabulary size.
        head_dim: per-head width.
        moe_ffn: ``(first, end)`` columns of every expert (the whole width under expert parallelism).
        ep_size, ep_rank: expert-parallel group (with ``--enable-expert-parallel``
            the tensor-parallel group times the data-parallel engine cores,
            ``ep_rank = dp_rank * tp_size + tp_rank``; else 1 / 0).
        expert_slots: ``(first, end)`` physical expert slots held (all of them without expert parallelism).
        num_experts, num_redundant_experts: of the whole model (0 for a dense one).
    """

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layers: tuple[int, int]
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    vocab_size: int
    head_dim: int
    moe_ffn: tuple[int, int] = (0, 0)
    ep_size: int = 1
    ep_rank: int = 0
    expert_slots: tuple[int, int] = (0, 0)
    num_experts: int = 0
    num_redundant_experts: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"rank {self.rank} (tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}): "
                f"layers {self.layers[0]}-{self.layers[1] - 1}, q heads {self.q_heads[0]}-{self.q_heads[1] - 1}, "
                f"kv heads {self.kv_heads[0]}-{self.kv_heads[1] - 1}, ffn cols {self.ffn[0]}-{self.ffn[1] - 1}, "
                f"vocab rows {self.vocab[0]}-{self.vocab[1] - 1}{self.describe_experts()}")

    def describe_experts(self) -> str:
        """The experts part of :meth:`describe` (empty for a dense model)."""
        if not self.num_experts:
            return ""
        first, end = self.expert_slots
        how = (f"expert-parallel rank {self.ep_rank}/{self.ep_size}" if self.ep_size > 1
               else f"expert cols {self.moe_ffn[0]}-{self.moe_ffn[1] - 1}")
        return (f"; experts per rank {end - first} (physical slots {first}-{end - 1} of "
                f"{self.num_experts + self.num_redundant_experts}, {how}), redundant experts "
                f"{self.num_redundant_experts}")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """``(first, end)`` layers of stage ``pp_rank``: contiguous, the first ``num_layers % pp_size`` stages one more."""
    base, extra = divmod(num_layers, pp_size)
    first = pp_rank * base + min(pp_rank, extra)
    return first, first + base + (1 if pp_rank < extra else 0)


def rank_layout(arch: ModelArchConfig, tp_size: int, pp_size: int, rank: int,
                enable_expert_parallel: bool = False, dp_size: int = 1, dp_rank: int = 0) -> RankLayout:
    """The :class:`RankLayout` of global ``rank`` (``pp_rank * tp_size + tp_rank``) of data-parallel
    engine ``dp_rank`` of ``dp_size`` (only the expert slots depend on it: with
    ``enable_expert_parallel`` the experts are shared over ``tp_size * dp_size`` ranks).

    Raises:
        ValueError: from :func:`check_parallel_arch`, or a rank outside the world.
    """
    if not enable_expert_parallel:
        dp_size, dp_rank = 1, 0
    check_parallel_arch(arch, tp_size, pp_size, enable_expert_parallel, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} outside {dp_size}")
    if not 0 <= rank < tp_size * pp_size:
        raise ValueError(f"rank {rank} outside a world of {tp_size * pp_size}")
    t, p = rank % tp_size, rank // tp_size
    h, k, i = arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size
    hq = h // tp_size
    if tp_size <= k:
        hk = k // tp_size
        kv = (t * hk, (t + 1) * hk)
    else:
        first = t // (tp_size // k)
        kv = (first, first + 1)
    vp = -(-arch.vocab_size // tp_size)      # rows per rank of the padded vocabulary
    fi = i // tp_size
    moe: dict = {}
    if arch.is_moe:
        ep = tp_size * dp_size if enable_expert_parallel else 1
        er = dp_rank * tp_size + t if ep > 1 else 0
        per = arch.num_physical_experts // ep
        first = er * per
        mi = arch.moe_intermediate_size // (1 if ep > 1 else tp_size)
        mt = 0 if ep > 1 else t
        moe = dict(moe_ffn=(mt * mi, (mt + 1) * mi), ep_size=ep, ep_rank=er,
                   expert_slots=(first, first + per), num_experts=arch.num_experts,
                   num_redundant_experts=arch.num_redundant_experts)
    return RankLayout(rank=rank, tp_rank=t, tp_size=tp_size, pp_rank=p, pp_size=pp_size,
                      layers=stage_layers(arch.num_hidden_layers, pp_size, p), q_heads=(t * hq, (t + 1) * hq),
                      kv_heads=kv, ffn=(t * fi, (t + 1) * fi), vocab=(t * vp, (t + 1) * vp),
                      vocab_size=arch.vocab_size, head_dim=arch.head_dim, **moe)


def local_arch(arch: ModelArchConfig, lay: RankLayout) -> ModelArchConfig:
    """The architecture of one rank's shard: its layers, heads, FFN columns, vocabulary rows and, for a
    mixture of experts, its expert columns or (expert parallelism) its place in the expert group."""
    moe = {}
    if arch.is_moe:
        mask = arch.moe_layer_mask
        moe = dict(moe_intermediate_size=lay.moe_ffn[1] - lay.moe_ffn[0], ep_size=lay.ep_size, ep_rank=lay.ep_rank,
                   moe_layer_mask=None if mask is None else list(mask[lay.layers[0]:lay.layers[1]]))
    return dataclasses.replace(
        arch, num_hidden_layers=lay.num_layers, num_attention_heads=lay.q_heads[1] - lay.q_heads[0],
        num_key_value_heads=lay.kv_heads[1] - lay.kv_heads[0], intermediate_size=lay.ffn[1] - lay.ffn[0],
        vocab_size=lay.vocab[1] - lay.vocab[0], **moe)


def _rows(t: torch.Tensor, first: int, end: int) -> torch.Tensor:
    return t[first:end]


def _vocab_rows(t: torch.Tensor, lay: RankLayout) -> torch.Tensor:
    """Rows ``lay.vocab`` of a ``[vocab_size, hidden]`` table, zero-padded past the real vocabulary."""
    first, end = lay.vocab
    part = t[first:min(end, t.shape[0])]
    if part.shape[0] < end - first:
        pad = torch.zeros((end - first - part.shape[0], *t.shape[1:]), dtype=t.dtype)
        part = torch.cat([part, pad])
    return part


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], lay: RankLayout, *, tied: bool,
                  keep_embedding: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Cut full Hugging Face-named checkpoint tensors down to one rank's shard, renamed to its local layers.

    Args:
        weights: ``(name, full tensor)`` pairs (``model.layers.7.self_attn.q_proj.weight`` ...).
        lay: the rank's layout.
        tied: the LM head reuses the embedding (``lm_head.weight`` absent).
        keep_embedding: this rank holds ``model.embed_tokens`` (first stage,
            or last stage with a tied LM head).

    Yields:
        ``(local name, shard)``: q/k/v, gate/up rows and o_proj/down_proj
        columns of the rank's heads and FFN columns, vocabulary rows of the
        embedding / LM head; layers outside the stage, and the LM head off
        the last stage, are dropped. MoE checkpoints are first renamed per
        expert (:func:`~tokenmill.model.mixtral.canonical_moe_weights`);
        routers are replicated, experts are cut to the rank's expert columns,
        or passed whole under expert parallelism (the model keeps the experts
        its slots hold).
    """
    from tokenmill.model.mixtral import canonical_moe_weights

    d = lay.head_dim
    for name, t in canonical_moe_weights(weights):
        m = _LAYER_RE.match(name)
        if m is None:
            if name.startswith("model.embed_tokens."):
                if keep_embedding:
                    yield name, _vocab_rows(t, lay)
            elif name.startswith("lm_head."):
                if lay.is_last_stage and not tied:
                    yield name, _vocab_rows(t, lay)
            else:                       # final norm (and anything replicated)
                yield name, t
            continue
        idx, rest = int(m.group(1)), m.group(2)
        if not lay.layers[0] <= idx < lay.layers[1]:
            continue
        local = f"model.layers.{idx - lay.layers[0]}.{rest}"
        if rest.startswith("mlp.experts."):
            if lay.ep_size == 1:
                if rest.endswith((".gate_proj.weight", ".up_proj.weight")):
                    t = _rows(t, *lay.moe_ffn)
                elif rest.endswith(".down_proj.weight"):
                    t = t[:, lay.moe_ffn[0]:lay.moe_ffn[1]]
            yield local, t.contiguous()
            continue
        if ".q_proj." in rest:
            t = _rows(t, lay.q_heads[0] * d, lay.q_heads[1] * d)
        elif ".k_proj." in rest or ".v_proj." in rest:
            t = _rows(t, lay.kv_heads[0] * d, lay.kv_heads[1] * d)
        elif ".o_proj." in rest and rest.endswith("weight"):
            t = t[:, lay.q_heads[0] * d:lay.q_heads[1] * d]
        elif ".gate_proj." in rest or ".up_proj." in rest:
            t = _rows(t, *lay.ffn)
        elif ".down_proj." in rest and rest.endswith("weight"):
            t = t[:, lay.ffn[0]:lay.ffn[1]]
        yield local, t.contiguous()
