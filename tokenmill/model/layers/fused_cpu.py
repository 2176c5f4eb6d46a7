"""Fused element-wise CPU kernels: add + RMSNorm, RoPE on q/k, SiLU-and-multiply.

In eager PyTorch each of these is a chain of 4-8 small ops (casts, pow,
mean, rsqrt, cat, neg, ...), each a pass over the activations plus dispatch
overhead; at decode sizes (a few dozen rows) the overhead dominates, and in
bfloat16 the float32 round trips add copies. One C loop per op does the same
arithmetic in one pass. Results equal the torch reference path: every
bfloat16 rounding the reference performs (after the residual add, after the
normalisation, after the weight multiply; after each RoPE product and the
sum; after SiLU and after the gate product) is performed at the same place,
so outputs agree to float32 summation order (checked in
``tests/model/test_fused_cpu.py``).

Used by :class:`~tokenmill.model.layers.norm.RMSNorm`,
:class:`~tokenmill.model.layers.mlp.SwiGLUMLP` and
:meth:`~tokenmill.model.llama.LlamaAttention.project_qkv` on CPU float32 /
bfloat16 tensors in eager mode (never while ``torch.compile`` traces: the
compiled step fuses these ops itself). Built on first use by
:mod:`tokenmill.model.layers.cpu_build`; ``TOKENMILL_CPU_FUSED_OPS=0`` keeps
the torch ops.

Algorithms: RMSNorm (Zhang & Sennrich, arXiv 1910.07467 §3), RoPE in the
rotate-half layout (Su et al., arXiv 2104.09864 §3.4), SwiGLU (Shazeer,
arXiv 2002.05202 §2).
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.model.layers.cpu_build import load_library

_SOURCE = r"""
/* R(v): the value after a store in T (identity for float, bf16 rounding for bf16) */
#define LD_F32(v) (v)
#define R_F32(v) (v)
#define ST_F32(v) (v)
#define LD_BF16(v) bf16_to_f32(v)
#define R_BF16(v) bf16_to_f32(f32_to_bf16(v))
#define ST_BF16(v) f32_to_bf16(v)
#define PAR_MIN 16384

/* x, residual (may be NULL), h_out (may be NULL when residual is NULL), out: [T, N]; w: [N].
   h = R(x + residual) (or x); out = R(R(h * rsqrt(mean(h^2) + eps)) * w); h_out = h. */
#define DEFINE_NORM(NAME, T, LD, R, ST)                                                             \
void NAME(const T* x, const T* residual, T* h_out, const T* w, T* out, int64_t rows, int64_t n,    \
          float eps, int num_threads) {                                                             \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * n >= PAR_MIN) schedule(static)")   \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        const T* xr = x + t * n;                                                                    \
        float h[n];                                                                                 \
        if (residual) {                                                                             \
            const T* rr = residual + t * n; T* hr = h_out + t * n;                                  \
            for (int64_t i = 0; i < n; i++) { float v = LD(xr[i]) + LD(rr[i]); hr[i] = ST(v); h[i] = R(v); } \
        } else {                                                                                    \
            for (int64_t i = 0; i < n; i++) h[i] = LD(xr[i]);                                       \
        }                                                                                           \
        float ss = 0.f;                                                                             \
        for (int64_t i = 0; i < n; i++) ss += h[i] * h[i];                                          \
        const float inv = 1.f / sqrtf(ss / (float)n + eps);                                         \
        T* o = out + t * n;                                                                         \
        for (int64_t i = 0; i < n; i++) o[i] = ST(R(h[i] * inv) * LD(w[i]));                        \
    }                                                                                               \
}

/* In place on `heads` consecutive heads of head_dim d per row (row stride `stride` elements):
   for i < rd/2: y[i] = R(R(x[i] c[i]) + R(-x[i+rd/2] s[i])); for rd/2 <= i < rd:
   y[i] = R(R(x[i] c[i]) + R(x[i-rd/2] s[i])); dims >= rd unchanged. cos/sin: [T, rd]. */
#define DEFINE_ROPE(NAME, T, LD, R, ST)                                                             \
void NAME(T* x, int64_t rows, int64_t stride, int64_t heads, int64_t d, int64_t rd, const T* cos_, \
          const T* sin_, int num_threads) {                                                         \
    const int64_t half = rd / 2;                                                                    \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * heads * d >= PAR_MIN) schedule(static)") \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        const T* c = cos_ + t * rd; const T* s = sin_ + t * rd;                                     \
        for (int64_t hh = 0; hh < heads; hh++) {                                                    \
            T* p = x + t * stride + hh * d;                                                         \
            float y[rd];                                                                            \
            for (int64_t i = 0; i < half; i++) {                                                    \
                const float a = LD(p[i]), b = LD(p[i + half]);                                      \
                y[i] = R(R(a * LD(c[i])) + R(-b * LD(s[i])));                                       \
                y[i + half] = R(R(b * LD(c[i + half])) + R(a * LD(s[i + half])));                   \
            }                                                                                       \
            for (int64_t i = 0; i < rd; i++) p[i] = ST(y[i]);                                       \
        }                                                                                           \
    }                                                                                               \
}

/* gate_up: [T, 2I] (gate then up); out: [T, I] = R(R(silu(gate)) * up) */
#define DEFINE_SILU(NAME, T, LD, R, ST)                                                             \
void NAME(const T* gu, T* out, int64_t rows, int64_t inter, int num_threads) {                      \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * inter >= PAR_MIN) schedule(static)") \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        const T* g = gu + t * 2 * inter; const T* u = g + inter; T* o = out + t * inter;            \
        for (int64_t i = 0; i < inter; i++) {                                                       \
            const float gv = LD(g[i]);                                                              \
            o[i] = ST(R(gv / (1.f + expf(-gv))) * LD(u[i]));                                        \
        }                                                                                           \
    }                                                                                               \
}

DEFINE_NORM(rms_norm_f32, float, LD_F32, R_F32, ST_F32)
DEFINE_NORM(rms_norm_bf16, uint16_t, LD_BF16, R_BF16, ST_BF16)
DEFINE_ROPE(rope_f32, float, LD_F32, R_F32, ST_F32)
DEFINE_ROPE(rope_bf16, uint16_t, LD_BF16, R_BF16, ST_BF16)
DEFINE_SILU(silu_mul_f32, float, LD_F32, R_F32, ST_F32)
DEFINE_SILU(silu_mul_bf16, uint16_t, LD_BF16, R_BF16, ST_BF16)
"""

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_FUNCTIONS = {}
for _t in ("f32", "bf16"):
    _FUNCTIONS[f"rms_norm_{_t}"] = [_P, _P, _P, _P, _P, _I, _I, _F, _N]
    _FUNCTIONS[f"rope_{_t}"] = [_P, _I, _I, _I, _I, _I, _P, _P, _N]
    _FUNCTIONS[f"silu_mul_{_t}"] = [_P, _P, _I, _I, _N]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def load() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None when unavailable or disabled."""
    return load_library("fused_ops", _SOURCE, _FUNCTIONS, "TOKENMILL_CPU_FUSED_OPS")


def usable(*tensors: torch.Tensor) -> bool:
    """True when the fused kernels can serve these tensors: CPU, one dtype (float32 or
    bfloat16), no autograd, not inside ``torch.compile`` tracing, library loaded."""
    t0 = tensors[0]
    dt = t0.dtype
    if dt not in _SUFFIX or t0.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    for t in tensors[1:]:       # a plain loop: this runs several times per layer per step
        if t.dtype != dt or t.device.type != "cpu":
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused (add and) RMSNorm over the last dimension.

    Args:
        x: ``[..., N]``.
        weight: ``[N]``.
        eps: added to the mean square.
        residual: ``[..., N]`` or None.

    Returns:
        ``norm(x)``; or, with ``residual``, ``(norm(h), h)`` with ``h = x + residual``
        (new tensors; the inputs are not modified).
    """
    lib = load()
    n = x.shape[-1]
    xc = x.contiguous()
    rows = xc.numel() // n
    out = torch.empty_like(xc)
    fn = getattr(lib, f"rms_norm_{_SUFFIX[x.dtype]}")
    w = weight.contiguous()
    if residual is None:
        fn(xc.data_ptr(), None, None, w.data_ptr(), out.data_ptr(), rows, n, float(eps), torch.get_num_threads())
        return out
    rc = residual.contiguous()
    h = torch.empty_like(xc)
    fn(xc.data_ptr(), rc.data_ptr(), h.data_ptr(), w.data_ptr(), out.data_ptr(), rows, n, float(eps),
       torch.get_num_threads())
    return out, h


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first ``num_heads`` heads of every row of ``x`` (rotate-half layout).

    Args:
        x: ``[num_tokens, >= num_heads * head_dim]`` with a contiguous last
            dimension (e.g. the fused q/k/v projection output: q heads then k
            heads are consecutive, so one call rotates both).
        num_heads: heads to rotate per row.
        head_dim: elements per head.
        cos, sin: ``[num_tokens, 1, rotary_dim]`` (or ``[num_tokens, rotary_dim]``),
            ``rotary_dim`` even and ``<= head_dim``; dims past it are left as they are.

    Raises:
        ValueError: a non-contiguous last dimension or mismatched shapes.
    """
    rd = cos.shape[-1]
    if x.stride(-1) != 1 or x.shape[-1] < num_heads * head_dim or rd > head_dim or rd % 2:
        raise ValueError("rope_: x needs a contiguous last dim holding the heads, and an even rotary_dim <= head_dim")
    c = cos.reshape(x.shape[0], rd).contiguous()
    s = sin.reshape(x.shape[0], rd).contiguous()
    getattr(load(), f"rope_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.shape[0], x.stride(0), num_heads, head_dim, rd,
                                                c.data_ptr(), s.data_ptr(), torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` ``[num_tokens, 2 * I]`` (gate columns first) -> ``silu(gate) * up`` ``[num_tokens, I]``."""
    gu = gate_up.contiguous()
    inter = gu.shape[-1] // 2
    out = gu.new_empty(gu.shape[:-1] + (inter,))
    getattr(load(), f"silu_mul_{_SUFFIX[gu.dtype]}")(gu.data_ptr(), out.data_ptr(), gu.numel() // (2 * inter),
                                                    inter, torch.get_num_threads())
    return out
