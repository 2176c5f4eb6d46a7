"""Quantised KV cache (``--kv-cache-dtype``): dtypes, per-layer K/V scales, quantise / dequantise.

vLLM's values of ``--kv-cache-dtype``: ``auto`` (the model's dtype; bfloat16
for a float32 model on the CPU low-bit path, see :func:`auto_kv_bf16`),
``bfloat16``, ``float32`` (ours: the float dtype outright), ``fp8``
(= ``fp8_e4m3``, torch ``float8_e4m3fn``: 4 exponent bits, 3 mantissa bits,
largest value 448), ``fp8_e5m2`` (``float8_e5m2``: 5/2 bits, largest 57344)
and ``int8`` (ours; symmetric, -127..127). A quantised cache stores
``x / scale`` with one float scale per layer for K and one for V
(per-tensor scaling as in vLLM); readers compute ``scale * stored``.

Scales come from, in order: the checkpoint (``self_attn.k_scale`` /
``self_attn.v_scale`` tensors, vLLM's names), ``--calculate-kv-scales``
(computed from the first batch that writes the layer's cache, vLLM's rule:
``k_scale = amax(|k|) / 200``, ``v_scale = amax(|v|) / 100`` for fp8, which
leaves ~2.2x / 4.5x headroom below e4m3's 448; for int8 ``amax / 100`` for
both, ~27% headroom below 127), or 1.0. An int8 cache with a scale of 1.0
would round K/V to integers, so ``int8`` without checkpoint scales always
computes them (logged at start-up). Values beyond the format's range
saturate (clamped) instead of becoming inf/NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernel_plan import CpuKernelSwitches, kv_cache_dtype_name

#: ``--kv-cache-dtype`` value -> cache dtype (None: the model's dtype, see :func:`resolve_kv_cache_dtype`).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
#: largest magnitude each quantised dtype stores (int8 symmetric)
_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: calculate-kv-scales divisors (K, V): amax / divisor is the scale
_CALC_DIVISOR = {torch.int8: (100.0, 100.0), torch.float8_e4m3fn: (200.0, 100.0), torch.float8_e5m2: (200.0, 100.0)}


#: ``0`` makes ``auto`` keep the model's dtype for a float32 model on the CPU low-bit path (default ``1``:
#: bfloat16 there, see :func:`auto_kv_bf16`).
CPU_KV_BF16_ENV = "TOKENMILL_CPU_KV_BF16"


def auto_kv_bf16(model_dtype: torch.dtype, device: torch.device | str, lowbit: bool,
                 switches: CpuKernelSwitches | None = None) -> bool:
    """Whether ``--kv-cache-dtype auto`` stores a bfloat16 cache for a float32 model.

    True for a float32 model on the CPU whose small steps run the GGUF's
    low-bit codes (``lowbit``: the serving path of AVX2 CPUs, where float32
    is the model dtype), unless ``TOKENMILL_CPU_KV_BF16=0``. **A deviation
    from vLLM**, whose ``auto`` is always the model's dtype: the runner logs
    it at start-up, and ``--kv-cache-dtype float32`` is the explicit way
    back. Why: decode attention reads every cached K/V element once per
    step, so at 32-64 requests it is bandwidth bound; bfloat16 halves the
    bytes (and doubles the tokens a pool holds). Measured on the 2-core EPYC,
    AVX2 variant, 30 layers, B = 32, ctx 256: 19.5 ms of attention per step
    against 28.0 ms in float32; end to end (``compare_engines.py``, c=64,
    interleaved arms, 2026-12-01) +14% output tok/s on the random workload
    (cold servers; +34% in ``--quick``) and +4% on MT-bench. Elements are widened to float32 on load
    and accumulation stays float32; the rounding of K/V to bfloat16 (8
    mantissa bits) is the only difference. Parity runs (float32, low-bit
    off), bfloat16 models, GPUs and tensor/pipeline-parallel shards (which
    do not attach the low-bit codes) keep the model's dtype. The rule is
    :func:`tokenmill.kernel_plan.kv_cache_dtype_name` (the engine's kernel plan applies it); ``switches``
    None: the environment's ``TOKENMILL_CPU_KV_BF16``.
    """
    sw = switches if switches is not None else CpuKernelSwitches.from_env()
    name = str(model_dtype).removeprefix("torch.")
    return kv_cache_dtype_name("auto", name, torch.device(device).type, lowbit, sw) != name


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device | str = "cpu",
                           lowbit: bool = False, switches: CpuKernelSwitches | None = None) -> torch.dtype:
    """The cache dtype for a ``--kv-cache-dtype`` value.

    ``auto`` is the model's dtype, except bfloat16 where :func:`auto_kv_bf16`
    says so (a float32 model on the CPU low-bit path); ``float32`` and
    ``bfloat16`` name the dtype outright.

    Args:
        name: the ``--kv-cache-dtype`` value.
        model_dtype: the model's (activation) dtype.
        device: where the model runs.
        lowbit: the model's small steps run the checkpoint's low-bit codes.
        switches: the config's kernel switches (None: the environment's).

    Raises:
        ValueError: an unknown value.
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto" and auto_kv_bf16(model_dtype, device, lowbit, switches):
        return torch.bfloat16
    return KV_CACHE_DTYPES[name] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the quantised cache dtypes (int8, fp8 e4m3fn, fp8 e5m2)."""
    return dtype in QUANTIZED


@dataclass
class KVScales:
    """One layer's dequantisation scales (``x ≈ scale * stored``).

    Attributes:
        k, v: the K and V scales (1.0 for a float cache).
        calculate: compute them from the next batch written to the cache
            (``--calculate-kv-scales``), then clear the flag.
        source: where the values came from (``default``, ``checkpoint``, ``calculated``), for the log.
    """

    k: float = 1.0
    v: float = 1.0
    calculate: bool = False
    source: str = "default"

    def maybe_calculate(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
        """With ``calculate`` set and a quantised ``dtype``, set the scales from ``k``/``v`` (any shape)."""
        if not self.calculate or not is_quantized(dtype) or k.numel() == 0:
            return
        dk, dv = _CALC_DIVISOR[dtype]
        self.k = max(float(k.detach().abs().amax()) / dk, 1e-8)
        self.v = max(float(v.detach().abs().amax()) / dv, 1e-8)
        self.calculate = False
        self.source = "calculated"


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``dtype``: round to nearest (even), saturating at the format's largest value."""
    lim = _MAX[dtype]
    y = (x.float() * (1.0 / scale)).clamp_(-lim, lim)
    if dtype == torch.int8:
        return y.round_().to(torch.int8)
    return y.to(dtype)


def dequantize(xq: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale * xq`` in ``dtype`` (float32 arithmetic, one rounding to ``dtype``)."""
    return (xq.float() * scale).to(dtype)


def round_trip_bound(dtype: torch.dtype, scale: float, amax: float) -> float:
    """Largest absolute error of :func:`quantize` then :func:`dequantize` for ``|x| <= amax`` within range.

    int8: half a step (``scale / 2``). fp8 with ``m`` mantissa bits: half an
    ulp at the top binade, ``2^(floor(log2(amax/scale)) - m - 1) * scale``,
    and at least half the smallest subnormal step.
    """
    if dtype == torch.int8:
        return 0.5 * scale
    import math
    m, min_exp = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
    top = max(math.floor(math.log2(max(amax / scale, 2.0 ** min_exp))), min_exp)
    return 2.0 ** (top - m - 1) * scale
