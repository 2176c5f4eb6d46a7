"""Multi-LoRA linear layers: the base GEMM plus a per-row adapter delta, grouped by adapter.

A step's flattened batch ``x`` ``[n, in]`` mixes rows of several adapters (and of the base).
Each row ``i`` with adapter slot ``s(i)`` gets ``y_i += (x_i A_sᵀ) B_sᵀ`` on top of the base
layer's ``x Wᵀ`` (LoRA, arXiv 2106.09685 §4.1; the scale is folded into ``B``). Computing that
per request is one small GEMM pair per request per layer; Punica (Chen et al., arXiv
2310.18547, §4) batches it instead: "shrink" ``x·A`` and "expand" ``·B`` over segments of rows
that share an adapter (SGMV). Here, with torch ops on the CPU, two batched forms:

* ``stacked`` (decode-shaped steps): every slot's ``A`` sits side by side in one
  ``[in, S·k·R]`` matrix (``k`` fused sub-projections — q/k/v or gate/up —, ``R`` =
  ``--max-lora-rank``, smaller ranks zero-padded), so the shrink is ONE GEMM over all rows and
  all slots; a ``[n, S, 1]`` 0/1 mask keeps each row's own slot; the expand is one GEMM per
  sub-projection over the ``[S·R, out_j]`` stack of ``B``. A fixed 2 + k torch calls per layer
  however many adapters the step mixes, at ``S×`` the delta FLOPs (small next to the base GEMM
  at decode sizes, where the step is bound by reading weights).
* ``segmented`` (prefill-shaped steps): Punica's SGMV shape — for each run of consecutive
  rows with the same adapter, shrink and expand with that adapter's slice only (no FLOPs
  wasted on other slots, 1 + k calls per run).
* ``loop`` is the per-request baseline (one GEMM pair per request), kept for
  ``benchmarks/lora.py``.

``auto`` (default) picks per layer call from a cost model (FLOPs at a nominal rate plus a fixed
cost per torch call; :func:`pick_mode`). All three give the same result up to summation order.

Hooks stay additive: :class:`LoRALinear` wraps whatever the base layer is (``nn.Linear``,
:class:`~tokenmill.model.layers.linear.PackedLinear` on the oneDNN or low-bit GGUF path) and
calls it unchanged; the CPU step graph calls the base kernel and then
:meth:`LoRALinear.add_delta_` on its persistent buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

#: per-call cost model of :func:`pick_mode`: seconds per torch call and FLOP/s of a small GEMM
#: (2-core AVX-512 EPYC, bfloat16/float32, small decode-sized GEMMs; ``benchmarks/lora.py --op`` measures
#: the modes side by side). A first guess of 4e10 FLOP/s sent SmolLM2's gate/up at 16 decode rows to the
#: segmented form (48 calls instead of 4) and made 8 adapters ~4x slower than the base in
#: ``benchmarks/lora.py``; decode-sized calls are overhead-bound, so the rate only decides large steps.
CALL_COST_S = 1e-5
GEMM_RATE = 1e11


@dataclass
class LoRABatch:
    """The step's row -> adapter-slot mapping, shared by every :class:`LoRALinear` of a model.

    Built once per step by :meth:`tokenmill.lora.manager.LoRAManager.set_batch`.

    Attributes:
        active: some row uses an adapter (False: the layers add nothing).
        num_slots: ``S'``, one past the highest slot used this step (the stacked GEMMs read only
            slots ``< S'``).
        mask: ``[n_rows, S', 1]`` in the model dtype: 1 where the row's slot is ``s``, else 0
            (padding and base rows: all 0).
        runs: ``[(row_start, row_end, slot)]`` maximal runs of consecutive rows with one adapter.
        req_runs: the same per request (the ``loop`` baseline).
        mode: ``auto``, ``stacked``, ``segmented`` or ``loop``.
    """

    active: bool = False
    num_slots: int = 0
    mask: torch.Tensor | None = None
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    req_runs: list[tuple[int, int, int]] = field(default_factory=list)
    mode: str = "auto"


def pick_mode(n: int, num_slots: int, num_runs: int, k: int, rank: int, in_features: int,
              out_features: int) -> str:
    """``stacked`` or ``segmented`` for one layer call, whichever the cost model says is cheaper.

    stacked: ``2·n·S·R·(k·in + out)`` FLOPs in ``2 + k`` calls; segmented: ``2·n·R·(k·in + out)``
    FLOPs in ``runs·(1 + k)`` calls (``out`` = all sub-projections' widths together).
    """
    work = 2.0 * n * rank * (k * in_features + out_features)
    stacked = (2 + k) * CALL_COST_S + num_slots * work / GEMM_RATE
    segmented = num_runs * (1 + k) * CALL_COST_S + work / GEMM_RATE
    return "stacked" if stacked <= segmented else "segmented"


class LoRALinear(nn.Module):
    """A base linear layer plus the grouped multi-adapter delta.

    Args:
        base: the layer (``[..., in] -> [..., out]``), called unchanged.
        slices: ``[(name, out_offset, out_width)]``, the PEFT targets fused in it in output order
            (``q_proj, k_proj, v_proj`` for ``qkv_proj``; ``gate_proj, up_proj``; one for o/down).
        in_features: input width.
        max_loras: adapter slots ``S`` (``--max-loras``).
        max_rank: ``R`` (``--max-lora-rank``).
        dtype: the model dtype (the slot buffers' and the activations').

    Attributes:
        lora_a: ``[in, S·k·R]``, columns ``(slot, slice, rank)``: ``A_{s,j}ᵀ`` zero-padded to ``R``.
        lora_b: per slice ``j`` a ``[S·R, out_j]`` stack, rows ``(slot, rank)``: ``(scale·B_{s,j})ᵀ``.
        batch: the shared :class:`LoRABatch` (set by the manager).
    """

    def __init__(self, base: nn.Module, slices: list[tuple[str, int, int]], in_features: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.slices = list(slices)
        self.in_features = in_features
        self.out_features = sum(w for _, _, w in slices)
        self.k, self.max_loras, self.max_rank = len(slices), max_loras, max_rank
        S, k, R = max_loras, self.k, max_rank
        self.lora_a = torch.zeros(in_features, S * k * R, dtype=dtype)
        self.lora_b = [torch.zeros(S * R, w, dtype=dtype) for _, _, w in slices]
        self.batch: LoRABatch = LoRABatch()

    # -- slots ----------------------------------------------------------------
    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into ``slot`` (``name -> (A [r, in], scaled B [out, r])``; absent names: zero).

        Raises:
            ValueError: a shape that does not fit this layer.
        """
        k, R = self.k, self.max_rank
        a_cols = self.lora_a.view(self.in_features, self.max_loras, k, R)[:, slot]
        a_cols.zero_()
        for j, (name, _, width) in enumerate(self.slices):
            b_rows = self.lora_b[j].view(self.max_loras, R, width)[slot]
            b_rows.zero_()
            if name not in weights:
                continue
            a, b = weights[name]
            r = a.shape[0]
            if a.shape[1] != self.in_features or b.shape != (width, r) or r > R:
                raise ValueError(f"{name}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a layer "
                                 f"{self.in_features} -> {width} with rank <= {R}")
            a_cols[:, j, :r].copy_(a.t())
            b_rows[:r].copy_(b.t())

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot``."""
        self.set_slot(slot, {})

    # -- forward --------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, in]`` -> ``[n, out]``: the base layer's output plus each row's adapter delta."""
        y = self.base(x)
        if self.batch.active and x.dim() == 2:
            self.add_delta_(x, y)
        return y

    def add_delta_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += delta(x)`` in place for the rows of the current :class:`LoRABatch`.

        Args:
            x: ``[n, in]`` the layer input (row ``i`` is batch row ``i``).
            y: ``[n, out]`` the base output, updated in place (may be a view of a persistent buffer).
        """
        b = self.batch
        if not b.active:
            return
        mode = b.mode
        n = x.shape[0]
        if mode == "auto":
            mode = pick_mode(n, b.num_slots, len(b.runs), self.k, self.max_rank, self.in_features,
                             self.out_features)
        if mode == "stacked":
            self._stacked(x, y, n, b)
        else:
            self._segments(x, y, b.runs if mode == "segmented" else b.req_runs)

    def _stacked(self, x: torch.Tensor, y: torch.Tensor, n: int, b: LoRABatch) -> None:
        S, k, R = b.num_slots, self.k, self.max_rank
        z = torch.mm(x, self.lora_a[:, :S * k * R])                 # shrink: all rows x all used slots
        z = z.view(n, S, k * R).mul_(b.mask[:n])                     # keep each row's own slot
        if k == 1:
            y.addmm_(z.view(n, S * R), self.lora_b[0][:S * R])       # expand
            return
        z4 = z.view(n, S, k, R)
        for j, (_, off, width) in enumerate(self.slices):
            y[:, off:off + width].addmm_(z4[:, :, j].reshape(n, S * R), self.lora_b[j][:S * R])

    def _segments(self, x: torch.Tensor, y: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
        k, R = self.k, self.max_rank
        for start, end, slot in runs:
            z = torch.mm(x[start:end], self.lora_a[:, slot * k * R:(slot + 1) * k * R])   # shrink [rows, k*R]
            for j, (_, off, width) in enumerate(self.slices):
                y[start:end, off:off + width].addmm_(z[:, j * R:(j + 1) * R],
                                                     self.lora_b[j][slot * R:(slot + 1) * R])

    @property
    def nbytes(self) -> int:
        """Bytes of the slot buffers (A and B of every slot)."""
        return sum(t.numel() * t.element_size() for t in (self.lora_a, *self.lora_b))

    def extra_repr(self) -> str:
        return (f"slices={[s for s, _, _ in self.slices]}, in={self.in_features}, out={self.out_features}, "
                f"max_loras={self.max_loras}, max_rank={self.max_rank}")


def _lora_site(parent, name: str):
    """``(owner, attribute, module)`` where the adapter of ``parent.name`` goes: a wrapper naming an inner
    linear in ``lora_inner`` is descended (a row-parallel layer: the delta is a partial sum that must join
    the base's before its all-reduce; :mod:`tokenmill.lora.tp`)."""
    mod = getattr(parent, name, None)
    while mod is not None and getattr(mod, "lora_inner", None):
        parent, name = mod, mod.lora_inner
        mod = getattr(parent, name, None)
    return parent, name, mod


def lora_layers(model: nn.Module) -> list[tuple[int, str, LoRALinear]]:
    """``(layer index, fused name, LoRALinear)`` of every wrapped layer of a Llama-family ``model``."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for block, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                            ("mlp", "down_proj")):
            mod = _lora_site(getattr(layer, block, None), name)[2]
            if isinstance(mod, LoRALinear):
                out.append((i, name, mod))
    return out


def inject_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype) -> tuple[LoRABatch, int]:
    """Wrap q/k/v, o, gate/up and down of every decoder layer in :class:`LoRALinear`, in place.

    Call after the runner packed the linears and attached low-bit codes (they are found by
    module name). Layers without a module (e.g. a mixture-of-experts block has no ``gate_up_proj``)
    are left alone; adapters targeting them are refused at load time.

    Returns:
        the shared :class:`LoRABatch` and the bytes of all slot buffers.

    Raises:
        ValueError: the model has no Llama-style ``model.layers``.
    """
    cfg = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to attach LoRA adapters to")
    batch = LoRABatch()
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    plan = {"qkv_proj": ("self_attn", [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)], h),
            "o_proj": ("self_attn", [("o_proj", 0, h)], q),
            "gate_up_proj": ("mlp", [("gate_proj", 0, inter), ("up_proj", inter, inter)], h),
            "down_proj": ("mlp", [("down_proj", 0, h)], inter)}
    total = 0
    for layer in layers:
        for name, (block, slices, fan_in) in plan.items():
            parent, attr, base = _lora_site(getattr(layer, block, None), name)
            if base is None or isinstance(base, LoRALinear):
                continue
            wrapped = LoRALinear(base, slices, fan_in, max_loras, max_rank, dtype)
            wrapped.batch = batch
            setattr(parent, attr, wrapped)
            total += wrapped.nbytes
    return batch, total


def set_batch(layers: list[tuple[int, str, LoRALinear]], batch: LoRABatch) -> None:
    """Point every wrapped layer at ``batch`` (the manager keeps one object and refills it)."""
    for _, _, mod in layers:
        mod.batch = batch
