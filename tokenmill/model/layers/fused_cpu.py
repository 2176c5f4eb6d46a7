"""Fused element-wise CPU kernels: add + RMSNorm, RoPE on q/k, SiLU-and-multiply; and the greedy
sampler's row-wise argmax (:func:`argmax_rows`).

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
compiled step fuses these ops itself). Source: ``tokenmill/model/csrc/fused_ops.c``, built on first use by
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


_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_FUNCTIONS = {}
for _t in ("f32", "bf16"):
    _FUNCTIONS[f"rms_norm_{_t}"] = [_P, _P, _P, _P, _P, _I, _I, _F, _N]
    _FUNCTIONS[f"rope_{_t}"] = [_P, _I, _I, _I, _I, _I, _P, _P, _N]
    _FUNCTIONS[f"silu_mul_{_t}"] = [_P, _P, _I, _I, _N]
_FUNCTIONS["argmax_rows_f32"] = [_P, _I, _I, _I, _P, _P, _N]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled library (``csrc/fused_ops.c``) for variant ``isa`` (None: this CPU's best), built
    on first use; None when unavailable or disabled."""
    return load_library("fused_ops", ["fused_ops.c"], _FUNCTIONS, "TOKENMILL_CPU_FUSED_OPS", isa)


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


def argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Row-wise ``torch.argmax`` of ``x`` and the values there (the greedy sampler's argmax).

    Args:
        x: ``[R, V]`` float32 CPU tensor (``V >= 1``) with a contiguous last dimension.

    Returns:
        ``(ids, best)``: ``[R]`` int64, ``[R]`` float32, equal to ``x.argmax(dim=-1)`` and
        ``x.gather(1, ids[:, None])[:, 0]`` bit for bit: the first index of a row's maximum (ties: the lowest
        index; ``-0.0`` equals ``+0.0``), and where the row holds a NaN the index of its first NaN and that NaN
        (torch ranks NaN above every number). None where the kernel cannot serve ``x`` (another dtype or
        device, a strided last dimension, an empty dimension, autograd, the library off or unavailable):
        the caller then runs the torch ops.

    Why: ``torch.argmax`` over ``[64, 49152]`` float32 logits took 4.0 ms on 2 AVX2 cores (0.12 ms for one
    row), ``numpy.argmax`` 1.6 ms; the sampler with this kernel took 1.1-1.2 ms at 64 rows
    (``benchmarks/sampling_ab.py``). Algorithm (``csrc/fused_ops.c`` ``argmax_rows_f32``), per row: pass 1 the
    maximum (4 x 8 lanes of ``vmaxps``) and the largest ``|bits|`` (a NaN is above ``0x7f800000``), pass 2 the
    first index equal to that maximum (the row is in L2 by then); rows split over the threads.
    """
    if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0
            or x.stride(1) != 1 or x.requires_grad or torch.compiler.is_compiling()):
        return None
    lib = load()
    if lib is None:
        return None
    rows = x.shape[0]
    ids = torch.empty(rows, dtype=torch.int64)
    best = torch.empty(rows, dtype=torch.float32)
    if rows:
        lib.argmax_rows_f32(x.data_ptr(), rows, x.shape[1], x.stride(0), ids.data_ptr(), best.data_ptr(),
                            torch.get_num_threads())
    return ids, best
