"""``--quantization`` methods: weight formats applied to a model's linear layers at load time.

=========  =====================================================  ==========================================
method     weights                                                 compute
=========  =====================================================  ==========================================
int8       int8, one float32 scale per output channel (symmetric)  CPU: our low-bit kernel (widen in registers)
w8a8       int8 per channel + int8 activations, one scale per      ``torch._int_mm`` (oneDNN VNNI on CPU,
           token computed each step (dynamic, symmetric)           cuBLASLt on CUDA), float rescale after
int4       4-bit codes, float32 scale and minimum per group of     CPU: our low-bit kernel
           32 inputs (``TOKENMILL_INT4_GROUP_SIZE`` sets a larger
           group; a layer it does not divide takes the largest
           of 128/64/32 below it that does)
awq, gptq  a checkpoint's own 4-bit AutoAWQ / GPTQ tensors         CPU: our low-bit kernel
           (``quantization_config`` in config.json), kept as codes
=========  =====================================================  ==========================================

Rounding: round to nearest (``torch.round``); int8 codes are in -127..127
(scale = max |w| / 127), int4 codes in 0..15 with ``scale = (max - min) / 15``
and the group minimum as offset, so the worst-case weight error is ``scale / 2``
per element (tested). The dynamic activation quantisation of w8a8 follows
LLM.int8()/SmoothQuant's per-token absmax scheme (arXiv 2208.07339 §3.1,
arXiv 2211.10438 §2) without outlier handling.

Every block linear and the logits head are quantised (int4 uses int8 codes
for the logits head, as llama.cpp keeps its output layer at >= 6 bits); the
embedding table stays dense (a lookup reads one row per token). On devices
other than CPU, int8/int4/awq/gptq weights are dequantised per call (correct,
not fast); w8a8 runs ``torch._int_mm`` there too.

Why groups of 32 by default (vLLM/torchao users may expect 128): accuracy
decides. On SmolLM2-135M, groups of 64/128 leave 8.0-10.1% relative weight
error per layer (``benchmarks/int4_group_error.py``) and cost top-1 agreement
66.7%, perplexity +31% (docs/benchmarks/quant_accuracy.md); groups of 32 follow
the grid of a Q4_0/Q4_1 GGUF exactly, and on float weights cut the rounding
error (the step is ``(max - min) / 15`` of a smaller group). The price is
bytes: float32 scale and minimum per 32 weights are 2 bits per weight (6 bits
in all) where groups of 128 take 4.5.

The methods are registered in :mod:`tokenmill.quantization.registry`; the start-up check of a method
against a checkpoint is :func:`tokenmill.model.checkpoint.check_quantization`.

Errors (raised at start-up, one line): an unknown method, ``w8a8`` on a CPU
without VNNI (AVX512-VNNI, AVX-VNNI or AMX-INT8), a group size that does not
divide a layer's inputs, a pre-quantised checkpoint with other than 4 bits.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill import envs
from tokenmill.quantization.lowbit import LowBitWeight, cpu_flags, lowbit_linear
from tokenmill.quantization.registry import METHODS  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

GROUP_ENV = "TOKENMILL_INT4_GROUP_SIZE"
DEFAULT_INT4_GROUP = envs.var(GROUP_ENV).default
DENSE_ABOVE_ROWS = 64  # larger steps dequantise the layer once and run one dense GEMM
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def int4_group_size() -> int:
    """The int4 group size: ``TOKENMILL_INT4_GROUP_SIZE`` (a multiple of 4 from 32 to 128), default
    :data:`DEFAULT_INT4_GROUP` (32). It is the largest group a layer takes (:func:`int4_group_for`).

    Raises:
        ValueError: not an integer in 32..128 divisible by 4.
    """
    return envs.get(GROUP_ENV)


def int4_group_for(in_features: int, group: int | None = None) -> int:
    """The int4 group size of a layer with ``in_features`` inputs: :func:`int4_group_size`, or where that does
    not divide ``in_features`` the largest of 128, 64, 32 below it that does (SmolLM2's 576-input layers take
    64 under ``TOKENMILL_INT4_GROUP_SIZE=128``). ``group``: the engine config's
    ``cpu_kernels.int4_group_size``; None: the environment's.

    Raises:
        ValueError: none of those groups divides ``in_features``.
    """
    g = int4_group_size() if group is None else group
    for c in (g, *(c for c in (128, 64, 32) if c < g)):
        if in_features % c == 0:
            return c
    raise ValueError(f"--quantization int4 needs layers whose inputs are a multiple of 32 (groups of {g}"
                     + (" or 128/64/32 below it" if g > 32 else "") + f"); this model has a layer with {in_features}")


def check_method(method: str | None, device: torch.device | str) -> None:
    """Fail fast (start-up) on a method this build or machine cannot run.

    Raises:
        ValueError: unknown method, or ``w8a8`` on a CPU without VNNI int8 dot products.
    """
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if method == "w8a8" and torch.device(device).type == "cpu" and not any(f in cpu_flags() for f in VNNI_FLAGS):
        raise ValueError("--quantization w8a8 needs int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or "
                         "AMX-INT8) that this CPU lacks; use --quantization int8 (weight-only) instead")
    if method == "int4":
        int4_group_size()


def quantize_int8(w: torch.Tensor) -> LowBitWeight:
    """Symmetric per-output-channel int8: ``q = round(w / s)``, ``s = max|w| / 127`` (one group = the whole row).

    Args:
        w: ``[N, K]`` float weight (K a multiple of 4).
    """
    w = w.detach().float().cpu()
    s = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
    q = torch.round(w / s).clamp_(-127, 127).to(torch.int8)
    return LowBitWeight.from_codes(q, s, None, 8, fmt="int8", check=False)


def quantize_int4(w: torch.Tensor, group: int) -> LowBitWeight:
    """Asymmetric group-wise 4-bit: ``q = round((w - min) / s)`` in 0..15, ``s = (max - min) / 15`` per group.

    Args:
        w: ``[N, K]`` float weight.
        group: inputs per scale (divides K).

    Raises:
        ValueError: ``group`` does not divide K.
    """
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 group size {group} does not divide a layer's {k} inputs; set {GROUP_ENV}")
    g = w.detach().float().cpu().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / s[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return LowBitWeight.from_codes(q, s, lo, 4, fmt=f"int4-g{group}", check=False)


class QuantizedLinear(nn.Module):
    """A linear layer that holds only low-bit codes (no dense weight): ``y = x · dequant(W)ᵀ + b``.

    CPU: steps of at most :data:`DENSE_ABOVE_ROWS` rows run our low-bit
    kernel; larger ones dequantise the layer once (``tm_lowbit_dequant``) and
    run one dense GEMM in the activation dtype. Other devices dequantise per call.

    Args:
        weight: the codes (:class:`LowBitWeight`), ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.
        input_perm: ``[in_features]`` column order of the codes (GPTQ act-order), or None.
    """

    def __init__(self, weight: LowBitWeight, bias: torch.Tensor | None = None,
                 input_perm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_codes = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)
        self.register_buffer("input_perm", input_perm, persistent=False)

    @property
    def nbytes(self) -> int:
        return self.weight_codes.nbytes + (0 if self.bias is None else self.bias.numel() * 4)

    def _apply(self, fn, recurse=True):  # .to(device) moves the codes too
        super()._apply(fn, recurse)
        probe = fn(torch.empty(0))
        if probe.device != self.weight_codes.codes.device:
            self.weight_codes = self.weight_codes.to(probe.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> ``[..., out_features]`` in ``x``'s dtype."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            x2 = x2.index_select(1, self.input_perm)
        if x2.shape[0] > DENSE_ABOVE_ROWS and x.device.type == "cpu":
            w = self.weight_codes.dequantize(x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32)
            y = torch.nn.functional.linear(x2.to(w.dtype), w, None if self.bias is None else self.bias.to(w.dtype))
            y = y.to(x.dtype)
        else:
            y = lowbit_linear(x2, self.weight_codes, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.weight_codes.fmt}, bits={self.weight_codes.bits}, group={self.weight_codes.group}")


class Int8DynamicLinear(nn.Module):
    """w8a8: int8 weights (per output channel) times int8 activations (per token, quantised each call).

    ``y = (q_x · q_wᵀ) * s_x * s_w + b`` with the int32 product from
    ``torch._int_mm`` (oneDNN with VNNI on CPU). ``s_x = max|x_row| / 127``.

    Args:
        weight: ``[N, K]`` float weight, quantised here (symmetric, per channel).
        bias: ``[N]`` or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        s = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
        self.out_features, self.in_features = w.shape
        self.register_buffer("qweight_t", q.t(), persistent=False)     # [K, N] view, column-major (oneDNN's B)
        self.register_buffer("weight_scale", s, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)

    @property
    def nbytes(self) -> int:
        return self.qweight_t.numel() + 4 * self.weight_scale.numel() + (0 if self.bias is None else 4 * self.bias.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> ``[..., N]`` in ``x``'s dtype."""
        shape = x.shape
        xf = x.reshape(-1, self.in_features).float()
        m = xf.shape[0]
        sx = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
        qx = torch.round(xf / sx).to(torch.int8)
        pad = 17 - m if x.device.type == "cuda" and m <= 16 else 0     # cuBLASLt's int8 GEMM needs M > 16
        if pad:
            qx = torch.cat([qx, qx.new_zeros(pad, self.in_features)])
        acc = torch._int_mm(qx, self.qweight_t)[:m]
        y = acc.float() * sx * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format=w8a8"


def _quantized_module(method: str, weight: torch.Tensor, bias: torch.Tensor | None, head: bool,
                      int4_group: int | None = None) -> nn.Module:
    if method == "w8a8" and not head:
        return Int8DynamicLinear(weight, bias)
    if method == "int4" and not head:
        lw = quantize_int4(weight, int4_group_for(weight.shape[1], int4_group))
    else:
        lw = quantize_int8(weight)
    qm = QuantizedLinear(lw, bias)
    return qm.to(weight.device)


def quantize_model(model: nn.Module, method: str, int4_group: int | None = None) -> dict[str, int]:
    """Replace every ``nn.Linear`` (and a tied logits head) of ``model`` by its ``method`` version, in place.

    ``int4_group``: the largest int4 group (the config's ``cpu_kernels.int4_group_size``; None: the
    environment's ``TOKENMILL_INT4_GROUP_SIZE``), see :func:`int4_group_for`.

    The logits head is weight-only int8 for every method (w8a8 included:
    its activations feed the sampler directly).

    Returns:
        bytes per weight format of the replaced layers.

    Raises:
        ValueError: see :func:`check_method`, :func:`quantize_int4`.
    """
    by_fmt: dict[str, int] = {}

    def count(m: nn.Module) -> None:
        fmt = "w8a8" if isinstance(m, Int8DynamicLinear) else m.weight_codes.fmt
        by_fmt[fmt] = by_fmt.get(fmt, 0) + m.nbytes

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                head = child is getattr(model, "lm_head", None)
                q = _quantized_module(method, child.weight, child.bias, head, int4_group)
                setattr(parent, name, q)
                count(q)
    tied = getattr(model, "tied_logits_weight", None)
    weight = tied() if tied is not None else None
    if weight is not None and hasattr(model, "set_logits_head"):
        q = _quantized_module(method, weight, None, head=True)
        model.set_logits_head(q)
        count(q)
    return by_fmt


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Bytes of weights the model holds, per format (low-bit formats, w8a8, and dense dtypes).

    Counts parameters and the codes of quantised layers; the low-bit copies
    that GGUF small steps use (:meth:`PackedLinear.attach_lowbit`) count under
    their format, oneDNN-packed dense weights under their dtype.
    """
    out: dict[str, int] = {}
    add = lambda k, v: out.__setitem__(k, out.get(k, 0) + int(v))
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            add(mod.weight_codes.fmt, mod.weight_codes.nbytes)
        elif isinstance(mod, Int8DynamicLinear):
            add("w8a8", mod.nbytes)
        else:
            low = getattr(mod, "lowbit", None)
            if isinstance(low, LowBitWeight) and id(low) not in seen:
                seen.add(id(low))
                add(f"{low.fmt} (small steps)", low.nbytes)
            packed = getattr(mod, "packed_weight", None)
            if isinstance(packed, torch.Tensor) or isinstance(getattr(mod, "weight_unpacked", None), torch.Tensor):
                add(str(getattr(mod, "dtype", None) or packed.dtype).removeprefix("torch."),
                    mod.in_features * mod.out_features * torch.empty((), dtype=mod.dtype).element_size())
        for p in mod.parameters(recurse=False):
            add(str(p.dtype).removeprefix("torch."), p.numel() * p.element_size())
    return out


def format_bytes(by_fmt: dict[str, int]) -> str:
    """``"Q4_1 75.9 MiB, float32 113.2 MiB"`` (largest first)."""
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_fmt.items(), key=lambda kv: -kv[1]))
