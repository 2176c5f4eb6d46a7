"""Mixtral: a Llama-family decoder whose feed-forward blocks are sparse mixtures of experts.

Architecture: Jiang et al., "Mixtral of Experts" (arXiv 2401.04088, §2): the
Mistral/Llama decoder (pre-norm, RMSNorm, RoPE, grouped-query attention) with
every SwiGLU block replaced by 8 SwiGLU experts and a router that sends each
token to its top 2, weighted by the softmax over the two chosen logits
(:class:`~tokenmill.model.layers.moe.FusedMoE`). Qwen3-MoE
(:mod:`tokenmill.model.qwen3_moe`) is the same decoder with q/k norms, its own
routing normalisation and optionally some dense layers; both are this class,
told apart by :class:`~tokenmill.model.arch_config.ModelArchConfig`.

Checkpoint names accepted for the MoE blocks (all mapped by
:func:`canonical_moe_weights` to ``model.layers.L.mlp.gate.weight`` and
``model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``):

* Mixtral on the Hub: ``block_sparse_moe.gate.weight``,
  ``block_sparse_moe.experts.E.w1/w3/w2.weight`` (gate / up / down);
* Qwen3-MoE on the Hub: ``mlp.gate.weight``, ``mlp.experts.E.gate_proj/up_proj/down_proj.weight``;
* stacked tensors (transformers 5's in-memory layout ``mlp.experts.gate_up_proj``
  ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``; GGUF's
  ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``,
  which :mod:`tokenmill.model.gguf_loader` names ``mlp.experts.gate_proj`` ...).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.model.layers.attention import AttentionBackend
from tokenmill.model.layers.moe import FusedMoE
from tokenmill.model.llama import LlamaForCausalLM

_MOE_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)$")
_EXPERT_RE = re.compile(r"^experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"^experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_CANON_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_moe_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename MoE checkpoint tensors to one scheme and split stacked expert tensors per expert (views).

    Yields:
        ``(name, tensor)``: routers as ``model.layers.L.mlp.gate.weight`` ``[E, H]``, experts as
        ``model.layers.L.mlp.experts.E.gate_proj.weight`` ``[I, H]`` (``up_proj`` ``[I, H]``,
        ``down_proj`` ``[H, I]``); every other tensor unchanged.
    """
    for name, t in weights:
        m = _MOE_RE.match(name)
        if m is None:
            yield name, t
            continue
        layer, rest = m.groups()
        prefix = f"model.layers.{layer}.mlp."
        if rest == "gate.weight":
            yield prefix + "gate.weight", t
            continue
        e = _EXPERT_RE.match(rest)
        if e is not None:
            yield f"{prefix}experts.{e.group(1)}.{_MIXTRAL_NAMES.get(e.group(2), e.group(2))}.weight", t
            continue
        s = _STACKED_RE.match(rest)
        if s is not None:
            kind = s.group(1)
            for i in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[i].chunk(2, dim=0)
                    yield f"{prefix}experts.{i}.gate_proj.weight", gate
                    yield f"{prefix}experts.{i}.up_proj.weight", up
                else:
                    yield f"{prefix}experts.{i}.{kind}.weight", t[i]
            continue
        yield name, t


class MixtralForCausalLM(LlamaForCausalLM):
    """Sparse-MoE Llama-family causal LM (Mixtral, arXiv 2401.04088 §2) over a flattened batch.

    Registered for ``MixtralForCausalLM``/``mixtral``; :class:`~tokenmill.model.qwen3_moe.Qwen3MoeForCausalLM`
    subclasses it. Layer ``i`` has a :class:`FusedMoE` where ``cfg.is_moe_layer(i)``, else the dense
    SwiGLU block of width ``cfg.intermediate_size``.

    Args:
        cfg: the architecture, with ``num_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``norm_topk_prob`` and the expert
            placement fields (``num_redundant_experts``, ``ep_size``, ``ep_rank``).
        attn_backend: as :class:`LlamaForCausalLM`.

    Raises:
        ValueError: ``cfg.num_experts`` is 0.
    """

    def __init__(self, cfg: ModelArchConfig, attn_backend: AttentionBackend | None = None) -> None:
        if not cfg.num_experts:
            raise ValueError(f"{cfg.architecture} needs num_experts > 0")
        super().__init__(cfg, attn_backend)
        for i, layer in enumerate(self.model.layers):
            if cfg.is_moe_layer(i):
                layer.mlp = FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                     cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_redundant_experts,
                                     cfg.ep_size, cfg.ep_rank)

    def moe_layers(self) -> list[FusedMoE]:
        """The MoE blocks in layer order (this rank's layers)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, FusedMoE)]

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """``[num_moe_layers, E + R]`` int64 assignments routed per physical slot (this rank's count);
        zeroes the counters with ``reset``."""
        layers = self.moe_layers()
        return torch.stack([m.take_expert_load(reset) for m in layers]) if layers else torch.zeros(0, 0, dtype=torch.int64)

    def to_empty(self, *, device, recurse: bool = True):
        """As ``nn.Module.to_empty``, then the MoE placement buffers get their default values."""
        out = super().to_empty(device=device, recurse=recurse)
        for m in self.moe_layers():
            m.reset_placement_buffers()
        return out

    def set_dense_fns(self, pre=None, post=None) -> None:
        """Only the part before attention is compiled: the MoE block after it has data-dependent shapes
        (rows per expert), so :func:`~tokenmill.model.llama.post_attention` stays eager."""
        super().set_dense_fns(pre, None)

    # ----------------------------------------------------------------- weights
    def _load_extra(self, name: str, tensor: torch.Tensor) -> bool:
        m = _CANON_RE.match(name)
        if m is None:
            return False
        layer, expert, which = int(m.group(1)), int(m.group(2)), m.group(3)
        mlp = self.model.layers[layer].mlp if layer < len(self.model.layers) else None
        if not isinstance(mlp, FusedMoE):
            raise ValueError(f"checkpoint tensor {name!r}: layer {layer} has no experts in {self.config.architecture}")
        mlp.load_expert_weight(expert, which, tensor)
        return True

    def _extra_params(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if n.endswith((".mlp.w13", ".mlp.w2"))}

    def _extra_missing(self) -> list[str]:
        return [f"model.layers.{i}.mlp {what}" for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, FusedMoE) for what in layer.mlp.missing_expert_weights()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`, with the MoE names of the module docstring.

        Each logical expert's tensors are copied into every local physical
        slot that holds it; experts held by no local slot (other
        expert-parallel ranks) are skipped.

        Raises:
            ValueError: unknown tensors, shape mismatches, an expert id out of
                range, or a local slot left without weights.
        """
        super().load_weights(canonical_moe_weights(weights))
