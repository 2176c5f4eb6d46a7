"""Multi-LoRA linear layers: the base GEMM plus a per-row adapter delta, grouped by adapter.

A step's flattened batch ``x`` ``[n, in]`` mixes rows of several adapters (and of the base).
Each row ``i`` with adapter slot ``s(i)`` gets ``y_i += (x_i A_sᵀ) B_sᵀ`` on top of the base
layer's ``x Wᵀ`` (LoRA, arXiv 2106.09685 §4.1; the scale is folded into ``B``). Computing that
per request is one small GEMM pair per request per layer; Punica (Chen et al., arXiv
2310.18547, §4) batches it instead: "shrink" ``x·A`` and "expand" ``·B`` over segments of rows
that share an adapter (SGMV). The forms here:

* ``kernel`` (CPU, float32/bfloat16; the default wherever it builds): SGMV as one C call per layer
  (``csrc/lora_delta.c``). :meth:`LoRABatch.fill` sorts the step's adapter rows by slot once per step
  (the segment index in :attr:`LoRABatch.meta`); every layer reuses it. Per segment the kernel reads only
  its adapter's real rank of A (all fused targets of the layer — q/k/v or gate/up — stacked along the
  output dimension, one shrink for all) and of B, so a step reads each adapter it uses once and wastes
  no FLOPs on other slots. Each row's delta is computed in a fixed order whatever its neighbours
  (row-independent: batch invariance holds with adapters). Threads: torch's OpenMP pool.
* ``stacked`` (torch ops, decode-shaped steps): every slot's ``A`` side by side in one
  ``[in, S·k·R]`` matrix (``k`` fused sub-projections, ``R`` = ``--max-lora-rank``, smaller ranks
  zero-padded), so the shrink is ONE GEMM over all rows and all slots; a ``[n, S, 1]`` 0/1 mask
  keeps each row's own slot; the expand is one GEMM per sub-projection over the ``[S·R, out_j]``
  stack of ``B``. 2 + k torch calls per layer, at ``S×`` the delta FLOPs.
* ``segmented`` (torch ops, prefill-shaped steps): for each run of consecutive rows with the same
  adapter, shrink and expand with that adapter's slice only (1 + k calls per run).
* ``loop`` is the per-request baseline (one GEMM pair per request), kept for ``benchmarks/lora.py``.

``auto`` (default) takes ``kernel`` where it can serve the tensors, else picks ``stacked`` or
``segmented`` per layer call from a cost model (FLOPs at a nominal rate plus a fixed cost per torch
call; :func:`pick_mode`); ``torch`` is ``auto`` without the kernel (an ablation). All forms give the
same result up to summation order; only ``kernel`` is row-independent (the torch GEMMs' order may
depend on the row count).

Hooks stay additive: :class:`LoRALinear` wraps whatever the base layer is (``nn.Linear``,
:class:`~tokenmill.model.layers.linear.PackedLinear` on the oneDNN or low-bit GGUF path) and
calls it unchanged; the CPU step graph calls the base kernel and then the prepared
:meth:`LoRALinear.kernel_call` (or :meth:`LoRALinear.add_delta_` for the torch forms) on its
persistent buffers; steps without adapter rows run the base calls alone.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

#: per-call cost model of :func:`pick_mode`: seconds per torch call and FLOP/s of a small GEMM
#: (2-core AVX-512 EPYC, bfloat16/float32, small decode-sized GEMMs; ``benchmarks/lora.py --op`` measures
#: the modes side by side). A first guess of 4e10 FLOP/s sent SmolLM2's gate/up at 16 decode rows to the
#: segmented form (48 calls instead of 4) and made 8 adapters ~4x slower than the base in
#: ``benchmarks/lora.py``; decode-sized calls are overhead-bound, so the rate only decides large steps.
CALL_COST_S = 1e-5
GEMM_RATE = 1e11


_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL_ARGS = [_P, _I, _P, _I, _I, _I, _P, _P, _N, _P, _I, _P, _P, _N]
_KERNEL_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def load_kernel(isa: str | None = None) -> ctypes.CDLL | None:
    """The grouped-delta C kernel (``csrc/lora_delta.c``) for variant ``isa`` (None: this CPU's best), built on
    first use; None when unavailable or disabled (``TOKENMILL_CPU_LORA_KERNEL=0``)."""
    from tokenmill.model.layers.cpu_build import load_library

    return load_library("lora_delta", ["lora_delta.c"],
                        {f"tm_lora_delta_{t}": _KERNEL_ARGS for t in _KERNEL_SUFFIX.values()},
                        "TOKENMILL_CPU_LORA_KERNEL", isa)


@dataclass
class LoRABatch:
    """The step's row -> adapter-slot mapping, shared by every :class:`LoRALinear` of a model.

    Built once per step by :meth:`fill` (called by :meth:`tokenmill.lora.manager.LoRAManager.set_batch`);
    every layer of the step reads the same segment index.

    Attributes:
        active: some row uses an adapter (False: the layers add nothing).
        num_slots: ``S'``, one past the highest slot used this step (the stacked GEMMs read only
            slots ``< S'``).
        runs: ``[(row_start, row_end, slot)]`` maximal runs of consecutive rows with one adapter.
        req_runs: the same per request (the ``loop`` baseline).
        row_slot: ``[n_rows]`` int64, each row's slot (-1: base row or padding).
        meta: int32 segment index for the C kernel (a persistent buffer, grown geometrically):
            ``[nseg, seg_slot[nseg], seg_off[nseg + 1], rows[...]]`` — the adapter rows sorted by slot
            (stable), one segment per slot used.
        mode: ``auto``, ``kernel``, ``stacked``, ``segmented``, ``loop``, or ``torch`` (``auto`` without the
            kernel: the batched torch forms only).
        invariant: the engine promises batch invariance (informational: ``auto`` takes the row-independent
            ``kernel`` form wherever it is available, invariance or not — it measured faster than the torch
            forms at every size, ``benchmarks/lora.py --op``; the torch forms are not row-independent).
        dtype, device: of the layers (the mask's).
    """

    active: bool = False
    num_slots: int = 0
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    req_runs: list[tuple[int, int, int]] = field(default_factory=list)
    row_slot: np.ndarray | None = None
    meta: torch.Tensor = field(default_factory=lambda: torch.zeros(64, dtype=torch.int32))
    mode: str = "auto"
    invariant: bool = False
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _mask: torch.Tensor | None = None

    def fill(self, req_slots: np.ndarray, query_lens: np.ndarray, num_rows: int) -> None:
        """Set the step's rows: request ``i`` has ``query_lens[i]`` consecutive rows of slot ``req_slots[i]``.

        Args:
            req_slots: ``[num_reqs]`` int64 slot per request in batch order (-1: the base model).
            query_lens: ``[num_reqs]`` rows per request.
            num_rows: rows of the (padded) batch; rows past the requests' are padding (no adapter).
        """
        self._mask = None
        if not (req_slots >= 0).any():
            self.active = False
            return
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        self.req_runs = [(int(a), int(e), int(sl)) for a, e, sl in zip(starts, ends, req_slots) if sl >= 0 and e > a]
        runs: list[tuple[int, int, int]] = []
        for a, e, sl in self.req_runs:
            if runs and runs[-1][1] == a and runs[-1][2] == sl:
                runs[-1] = (runs[-1][0], e, sl)
            else:
                runs.append((a, e, sl))
        self.runs = runs
        self.num_slots = int(req_slots.max()) + 1
        row_slot = np.full(num_rows, -1, dtype=np.int64)
        row_slot[:int(ends[-1])] = np.repeat(req_slots, query_lens)
        self.row_slot = row_slot
        rows = np.flatnonzero(row_slot >= 0)
        rows = rows[np.argsort(row_slot[rows], kind="stable")]
        slots_sorted = row_slot[rows]
        first = np.flatnonzero(np.r_[True, slots_sorted[1:] != slots_sorted[:-1]])
        nseg = len(first)
        need = 1 + nseg + nseg + 1 + len(rows)
        if self.meta.numel() < need:
            self.meta = torch.zeros(max(need, 2 * self.meta.numel()), dtype=torch.int32)
        m = self.meta.numpy()
        m[0] = nseg
        m[1:1 + nseg] = slots_sorted[first]
        m[1 + nseg:1 + 2 * nseg] = first
        m[1 + 2 * nseg] = len(rows)
        m[2 + 2 * nseg:need] = rows
        self.active = True

    @property
    def mask(self) -> torch.Tensor:
        """``[n_rows, S', 1]`` in the layers' dtype: 1 where the row's slot is ``s``, else 0 (the stacked form)."""
        if self._mask is None:
            mask = self.row_slot[:, None] == np.arange(self.num_slots)[None, :]
            self._mask = torch.from_numpy(mask).to(self.dtype).unsqueeze(-1).to(self.device)
        return self._mask


def pick_mode(n: int, num_slots: int, num_runs: int, k: int, rank: int, in_features: int,
              out_features: int) -> str:
    """``stacked`` or ``segmented`` for one layer call (the torch forms), whichever the cost model says is cheaper.

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
        a_rows: ``[S·k·R, in]`` contiguous, rows ``(slot, slice, rank)``: ``A_{s,j}`` (PEFT's ``lora_A``
            rows), zero-padded to ``R`` rows.
        lora_a: ``a_rows.t()``, the ``[in, S·k·R]`` view the torch forms multiply by.
        b_all: ``[S·R, out]`` contiguous, rows ``(slot, rank)``; slice ``j``'s column block holds
            ``(scale·B_{s,j})ᵀ``.
        lora_b: per slice ``j`` the ``[S·R, out_j]`` column view of ``b_all``.
        ranks: ``[S, k]`` int32, the real rank of each (slot, slice) (0: not targeted); the kernel reads
            only those rows of A and B, so a slot's bytes per step follow its adapter's rank, not ``R``.
        col_off: ``[k + 1]`` int64 column offsets of the slices.
        batch: the shared :class:`LoRABatch` (set by the manager).
    """

    def __init__(self, base: nn.Module, slices: list[tuple[str, int, int]], in_features: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.base = base
        self.slices = list(slices)
        self.in_features = in_features
        self.out_features = sum(w for _, _, w in slices)
        self.k, self.max_loras, self.max_rank = len(slices), max_loras, max_rank
        S, k, R = max_loras, self.k, max_rank
        # A rows (slot, slice, rank) x in; B rows (slot, rank) x out, slice j in its column block
        self.a_rows = torch.zeros(S * k * R, in_features, dtype=dtype, device=device)
        self.lora_a = self.a_rows.t()
        self.b_all = torch.zeros(S * R, self.out_features, dtype=dtype, device=device)
        self.lora_b = [self.b_all[:, off:off + w] for _, off, w in slices]
        self.ranks = torch.zeros(S, k, dtype=torch.int32)     # real rank of (slot, slice); 0: not targeted
        self.col_off = torch.tensor([off for _, off, _ in slices] + [self.out_features], dtype=torch.int64)
        self.batch: LoRABatch = LoRABatch()

    # -- slots ----------------------------------------------------------------
    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into ``slot`` (``name -> (A [r, in], scaled B [out, r])``; absent names: zero).

        Raises:
            ValueError: a shape that does not fit this layer.
        """
        k, R = self.k, self.max_rank
        for name, (a, b) in weights.items():
            width = next((w for n, _, w in self.slices if n == name), None)
            r = a.shape[0]
            if width is None or a.shape[1] != self.in_features or b.shape != (width, r) or r > R:
                raise ValueError(f"{name}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a layer "
                                 f"{self.in_features} -> {width} with rank <= {R}")
        a_rows = self.a_rows.view(self.max_loras, k, R, self.in_features)[slot]
        b_rows = self.b_all.view(self.max_loras, R, self.out_features)[slot]
        a_rows.zero_()
        b_rows.zero_()
        self.ranks[slot] = 0
        for j, (name, off, width) in enumerate(self.slices):
            if name not in weights:
                continue
            a, b = weights[name]
            r = a.shape[0]
            a_rows[j, :r].copy_(a)
            b_rows[:r, off:off + width].copy_(b.t())
            self.ranks[slot, j] = r

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
        if mode == "auto" and self.kernel_usable(x, y):
            mode = "kernel"
        elif mode in ("auto", "torch"):
            mode = pick_mode(n, b.num_slots, len(b.runs), self.k, self.max_rank, self.in_features,
                             self.out_features)
        if mode == "kernel":
            if not self.kernel_usable(x, y):
                raise RuntimeError("LoRA delta mode 'kernel': the C kernel cannot serve these tensors "
                                   f"({x.dtype} on {x.device}, strides {x.stride()} / {y.stride()})")
            fn, args = self.kernel_call(x, y, torch.get_num_threads())
            fn(*args)
        elif mode == "stacked":
            self._stacked(x, y, n, b)
        else:
            self._segments(x, y, b.runs if mode == "segmented" else b.req_runs)

    def kernel_usable(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """The C kernel can compute this call: CPU, float32/bfloat16 like the slots, unit column stride,
        library built (``TOKENMILL_CPU_LORA_KERNEL`` not 0), not under ``torch.compile`` tracing."""
        dt = self.a_rows.dtype
        return (x.device.type == "cpu" and x.dtype == dt and y.dtype == dt and dt in _KERNEL_SUFFIX
                and x.dim() == 2 and x.shape[1] == self.in_features and y.shape == (x.shape[0], self.out_features)
                and x.stride(-1) == 1 and y.stride(-1) == 1 and not torch.compiler.is_compiling()
                and load_kernel() is not None)

    def kernel_call(self, x: torch.Tensor, y: torch.Tensor, threads: int, isa: str | None = None) -> tuple:
        """``(fn, args)``: the C kernel call adding the current batch's delta of ``x`` into ``y``.

        Every argument is an address or a size, so the CPU step graph prepares it once per step shape; the
        step's rows are read from :attr:`LoRABatch.meta` (its address is part of the graph's key).
        """
        fn = getattr(load_kernel(isa), f"tm_lora_delta_{_KERNEL_SUFFIX[self.a_rows.dtype]}")
        return fn, (x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), self.in_features, self.out_features,
                    self.a_rows.data_ptr(), self.b_all.data_ptr(), self.k, self.col_off.data_ptr(), self.max_rank,
                    self.ranks.data_ptr(), self.batch.meta.data_ptr(), threads)

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
        return sum(t.numel() * t.element_size() for t in (self.a_rows, self.b_all))

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


def inject_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                invariant: bool = False) -> tuple[LoRABatch, int]:
    """Wrap q/k/v, o, gate/up and down of every decoder layer in :class:`LoRALinear`, in place.

    Call after the runner packed the linears and attached low-bit codes (they are found by
    module name). Layers without a module (e.g. a mixture-of-experts block has no ``gate_up_proj``)
    are left alone; adapters targeting them are refused at load time.

    Args:
        invariant: the engine promises batch invariance (recorded on the :class:`LoRABatch`; ``auto``
            takes the row-independent kernel wherever it can, invariance or not).

    Returns:
        the shared :class:`LoRABatch` and the bytes of all slot buffers.

    Raises:
        ValueError: the model has no Llama-style ``model.layers``.
    """
    cfg = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to attach LoRA adapters to")
    device = next(model.parameters()).device
    batch = LoRABatch(invariant=invariant, dtype=dtype, device=device)
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
            wrapped = LoRALinear(base, slices, fan_in, max_loras, max_rank, dtype, device)
            wrapped.batch = batch
            setattr(parent, attr, wrapped)
            total += wrapped.nbytes
    return batch, total


def set_batch(layers: list[tuple[int, str, LoRALinear]], batch: LoRABatch) -> None:
    """Point every wrapped layer at ``batch`` (the manager keeps one object and refills it)."""
    for _, _, mod in layers:
        mod.batch = batch
