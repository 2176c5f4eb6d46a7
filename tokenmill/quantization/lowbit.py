"""Group-wise low-bit weights and our CPU GEMM/GEMV over them (``tokenmill/model/csrc/lowbit_gemm.c``).

A :class:`LowBitWeight` holds a ``[out, in]`` weight as integer codes with a
float32 scale and (optionally) minimum per group of ``group`` input columns:
``w[n, k] = scale[n, k // group] * q[n, k] + min[n, k // group]``. Every
format we run maps onto it without loss: GGUF's Q4_0/Q4_1/Q4_K (4-bit),
Q8_0/Q6_K/Q5_* (8-bit container), and the ``--quantization`` int4/int8
weights (:mod:`tokenmill.quantization.methods`).

Why a kernel of ours: torch's CPU low-bit kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``, which torchao's CPU layouts call) are scalar
for float32 activations on AVX2 CPUs: 4-28x slower than float32 ``linear`` on
SmolLM2's shapes at 1-32 rows on a 2-core AVX2 EPYC (2026-11-30);
``benchmarks/lowbit_gemm.py`` measures them against ours side by side). Ours widens each code to float32 in
registers with the output rows in the vector lanes, so one code is decoded
once for all activation rows and no horizontal sums are needed; results equal
the dequantised GEMM up to float32 summation order.

One C source is compiled per ISA variant by
:mod:`tokenmill.model.layers.cpu_build` (``avx512`` = x86-64-v4, ``avx2`` =
x86-64-v3, ``scalar``); the process uses the best one the CPU runs
(``TOKENMILL_CPU_ISA`` forces a lower one); ``TOKENMILL_CPU_LOWBIT_KERNEL=0``
turns the kernel off (low-bit layers then dequantise per call with torch ops).
The ``avx512`` variant also carries a bfloat16 dot-product path
(``VDPBF16PS``, used for bfloat16 activations where the CPU has AVX512-BF16,
checked at run time; :func:`set_bf16_dot`), and AMX-INT8 tile passes for the
integer path's many-row steps (behind a run-time gate with a self-check; same
bits as its VNNI / AVX-512BW passes; :func:`set_amx`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from tokenmill.model.layers.cpu_build import _cpu_flags, load_library, switch

logger = logging.getLogger(__name__)

TILE = 16  # output rows per packed tile (the C kernel's NT)

ENV_SWITCH = "TOKENMILL_CPU_LOWBIT_KERNEL"
#: ``0`` keeps bfloat16 activations on the float32 FMA path even where AVX512-BF16 dot products exist.
BF16_DOT_SWITCH = "TOKENMILL_CPU_LOWBIT_BF16_DOT"
#: ``0`` keeps the integer path on AVX-512BW multiply-adds even where AVX512-VNNI exists (same bits).
VNNI_SWITCH = "TOKENMILL_CPU_LOWBIT_VNNI"
#: ``0`` keeps the integer path's many-row passes off AMX-INT8 tiles even where the CPU has them (same bits).
AMX_SWITCH = "TOKENMILL_CPU_AMX"
#: ``tm_lowbit_amx_status()`` codes -> why the AMX passes are on or off.
AMX_STATUS = {0: "not in this kernel build (only the avx512 variant carries the AMX-INT8 passes)",
              1: "switched off (TOKENMILL_CPU_AMX=0)",
              2: "this CPU has no AMX-TILE / AMX-INT8",
              3: "Linux refused the AMX tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM; kernel < 5.16?)",
              4: "the AMX self-check gave other bits than the VNNI / AVX-512BW passes",
              5: "on"}

_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_int64
_FUNCTIONS = {"tm_lowbit_gemm": (_P, _I, _L, _L, _L, _L, _I, _P, _L, _P, _P, _P, _P, _I, _L),
              "tm_lowbit_pack": (_P, _L, _L, _I, _P),
              "tm_lowbit_dequant": (_P, _I, _L, _L, _L, _P, _P, _P, _I),
              "tm_lowbit_gemm_i8": (_P, _I, _L, _L, _L, _L, _I, _P, _L, _P, _P, _P, _P, _I, _L),
              "tm_lowbit_gemm_i8_h": (_P, _I, _L, _L, _L, _L, _I, _P, _L, _P, _P, _P, _P, _I, _L),
              "tm_lowbit_pack_i8": (_P, _L, _L, _I, _P)}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where unreadable)."""
    return _cpu_flags()


def load_kernel(isa: str | None = None) -> ctypes.CDLL | None:
    """Build (once) and load the ``isa`` variant of the kernel (default: :func:`~tokenmill.model.layers.cpu_build.cpu_isa`).

    Returns:
        The library, or None (no compiler, a CPU that cannot run ``isa``,
        or ``TOKENMILL_CPU_LOWBIT_KERNEL=0``).
    """
    lib = load_library("lowbit_gemm", ["lowbit_gemm.c"], _FUNCTIONS, ENV_SWITCH, isa)
    if lib is not None:
        lib.tm_lowbit_isa.restype = ctypes.c_char_p
        lib.tm_lowbit_isa.argtypes = []
        lib.tm_lowbit_set_bf16_dot.restype = ctypes.c_int
        lib.tm_lowbit_set_bf16_dot.argtypes = [ctypes.c_int]
        set_bf16_dot(lib, switch(BF16_DOT_SWITCH))
        lib.tm_lowbit_set_vnni.restype = ctypes.c_int
        lib.tm_lowbit_set_vnni.argtypes = [ctypes.c_int]
        set_vnni(lib, switch(VNNI_SWITCH))
        lib.tm_lowbit_set_amx.restype = ctypes.c_int
        lib.tm_lowbit_set_amx.argtypes = [ctypes.c_int]
        lib.tm_lowbit_amx_status.restype = ctypes.c_int
        lib.tm_lowbit_amx_status.argtypes = []
        lib.tm_lowbit_amx_test_corrupt.restype = None
        lib.tm_lowbit_amx_test_corrupt.argtypes = [ctypes.c_int]
        if not getattr(lib, "_tm_amx_gated", False):      # the gate (its self-check) once per loaded library
            lib._tm_amx_gated = True
            set_amx(lib, switch(AMX_SWITCH))
    return lib


def set_vnni(lib: ctypes.CDLL, on: bool) -> bool:
    """Switch the integer path's AVX512-VNNI dot products (``VPDPBUSD``) on or off in ``lib``.

    One ``VPDPBUSD`` does the four byte multiply-adds per 32-bit lane that the AVX-512BW path builds from
    ``VPMADDUBSW`` + ``VPMADDWD`` + ``VPADDD``; the integer sums are exact on both, so results are
    bit-identical and only the speed changes (blocks of 32 columns, i.e. GGUF's Q4_0/Q4_1/Q4_K/Q8_0).
    ``TOKENMILL_CPU_LOWBIT_VNNI=0`` keeps it off.

    Returns:
        whether it is on now (never on the avx2/scalar variants or a CPU without AVX512-VNNI).
    """
    return bool(lib.tm_lowbit_set_vnni(int(on)))


def set_amx(lib: ctypes.CDLL, on: bool) -> bool:
    """Switch the integer path's AMX-INT8 many-row passes on or off in ``lib`` (the avx512 variant).

    A row chunk of at least 8 rows (prefill chunks, batched decode) with blocks of 32 columns (GGUF's Q4_0 /
    Q4_1 / Q4_K / Q8_0) then computes each block's exact int32 sums with one ``TDPBSSD`` per 16 rows x 16
    outputs, stores them (``TILESTORED``) and folds them into the float accumulators by the same epilogue, in
    the same order, as the VNNI / AVX-512BW passes: the bits are the same, only the speed changes. Turning it on
    runs the gate in ``csrc/lowbit_gemm.c``: the CPU must have AMX-TILE and AMX-INT8, Linux must grant the tile
    data permission (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``), and a self-check on small random
    problems must give the other passes' bits; where it does not, the passes stay off and a warning names why
    (:func:`amx_status`). ``TOKENMILL_CPU_AMX=0`` keeps them off.

    Returns:
        whether they are on now (never on the avx2/scalar variants or a CPU without AMX).
    """
    now = bool(lib.tm_lowbit_set_amx(int(on)))
    code = int(lib.tm_lowbit_amx_status())
    if on and code in (3, 4):
        logger.warning("low-bit GEMM kernel: %s; the integer path keeps the VNNI / AVX-512BW passes",
                       AMX_STATUS[code])
    return now


def amx_status(lib: ctypes.CDLL) -> str:
    """Why ``lib``'s AMX-INT8 passes are on or off (:data:`AMX_STATUS`; as the last :func:`set_amx` found)."""
    return AMX_STATUS.get(int(lib.tm_lowbit_amx_status()), "unknown")


def set_bf16_dot(lib: ctypes.CDLL, on: bool) -> bool:
    """Switch the kernel's bfloat16 dot-product path (AVX512-BF16 ``VDPBF16PS``) on or off in ``lib``.

    With bfloat16 activations that path multiplies pairs of bfloat16 values
    per instruction (32 multiply-adds where a float32 FMA does 16): steps of
    a few rows (speculative decoding's verify steps), which the float32 path
    makes compute-bound, cost about half. Products of a bfloat16 activation
    and a code are exact in float32, so results equal the float32 path's up
    to summation order. ``TOKENMILL_CPU_LOWBIT_BF16_DOT=0`` keeps it off.

    Returns:
        whether it is on now (never on the avx2/scalar variants or a CPU without AVX512-BF16).
    """
    return bool(lib.tm_lowbit_set_bf16_dot(int(on)))


@dataclass
class LowBitWeight:
    """A ``[out_features, in_features]`` weight in group-wise integer codes, packed for the C kernel.

    Attributes:
        out_features, in_features: the logical weight shape ``[N, K]``.
        bits: 4 (two codes per byte, values 0..15) or 8 (int8, -128..127).
        group: input columns per scale/min (divides ``K``; a multiple of 4).
        codes: packed, ``[ceil(N/16), K/2, 16]`` uint8 (4-bit) or ``[ceil(N/16), K, 16]`` int8.
        scale: ``[ceil(N/16), K/group, 16]`` float32.
        min: like ``scale`` or None (all zero).
        fmt: the source format's name (``Q4_1``, ``int8``...), for logs.
        codes_i8: the codes again in the integer path's layout (:meth:`prepare_i8`), or None.
        scale_h, min_h: float16 copies of ``scale`` / ``min`` for the integer path, set by :meth:`prepare_i8`
            where every value is a float16 number (GGUF's Q4_0/Q4_1/Q8_0 store them as float16), else None.
            The kernel widens them exactly, so they give the same bits as the float32 arrays with a sixth
            fewer bytes to stream per 4-bit weight with a min (0.625 instead of 0.75 byte).
    """

    out_features: int
    in_features: int
    bits: int
    group: int
    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    fmt: str = ""
    codes_i8: torch.Tensor | None = None
    scale_h: torch.Tensor | None = None
    min_h: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (codes + scales + mins, and the integer path's copies), padding rows included."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min, self.codes_i8,
                                                          self.scale_h, self.min_h) if t is not None)

    @property
    def i8_stream_bytes(self) -> int:
        """Bytes one integer-path call reads of this weight (codes, and the scales/mins it uses)."""
        if self.scale_h is not None:
            tabs = (self.scale_h, self.min_h)
        else:
            tabs = (self.scale, self.min)
        return sum(t.numel() * t.element_size() for t in (self.codes, *tabs) if t is not None)

    @property
    def i8_block(self) -> int:
        """Input columns per activation scale on the integer path (``min(group, 32)``), 0 where it cannot run.

        The integer path needs blocks that are whole multiples of its 8 (4-bit) or 4 (8-bit) column steps,
        and groups above 32 that split into blocks of 32 (4-bit sums of a block must fit 16 bits)."""
        sb = min(self.group, 32)
        if self.group > 32 and self.group % 32:
            return 0
        return sb if sb % (8 if self.bits == 4 else 4) == 0 else 0

    def prepare_i8(self, lib: ctypes.CDLL | None = None) -> bool:
        """Also pack the codes in the integer path's layout (``codes_i8``, the same bytes again).

        Returns:
            whether the integer path can serve this weight (kernel loaded, CPU tensors, blocks that fit).
        """
        if self.codes_i8 is not None:
            return True
        lib = lib if lib is not None else _default_kernel()
        if lib is None or self.codes.device.type != "cpu" or not self.i8_block:
            return False
        q = self.unpacked_codes()
        q = (q.to(torch.uint8) if self.bits == 4 else q.to(torch.int8)).contiguous()
        out = torch.empty_like(self.codes)
        lib.tm_lowbit_pack_i8(q.data_ptr(), self.out_features, self.in_features, self.bits, out.data_ptr())
        self.codes_i8 = out
        self.scale_h, self.min_h = _as_float16_exactly(self.scale, self.min)
        return True

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None, bits: int,
                   fmt: str = "", check: bool = True) -> "LowBitWeight":
        """Pack row-major codes.

        Args:
            codes: ``[N, K]`` integers (0..15 for ``bits=4``; -128..127 for ``bits=8``).
            scale, min: ``[N, K / group]`` (min may be None); group is inferred.
            bits: 4 or 8.
            check: verify the codes' range (False for codes already known to be in range).

        Raises:
            ValueError: shapes that do not fit, codes out of range, or a group that is not a multiple of 4.
        """
        n, k = codes.shape
        if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
            raise ValueError(f"scales {tuple(scale.shape)} do not fit codes {tuple(codes.shape)}")
        group = k // scale.shape[1]
        if min is not None and tuple(min.shape) != tuple(scale.shape):
            raise ValueError(f"mins {tuple(min.shape)} != scales {tuple(scale.shape)}")
        lo, hi = (0, 15) if bits == 4 else (-128, 127) if bits == 8 else (None, None)
        if lo is None:
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if group % 4:
            raise ValueError(f"groups must be multiples of 4 input columns, got {group}")
        c = codes.to(torch.uint8 if bits == 4 else torch.int8) if check or codes.dtype not in (
            torch.uint8, torch.int8) else codes
        if check and codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ValueError(f"{bits}-bit codes out of range [{lo}, {hi}]")
        tiles = -(-n // TILE)
        pad = tiles * TILE - n
        def tile_rows(t: torch.Tensor) -> torch.Tensor:  # [N, C] -> [tiles, C, 16]
            t = t.float()
            if pad:
                t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
            return t.reshape(tiles, TILE, -1).transpose(1, 2).contiguous()
        c = c.contiguous()
        lib = _default_kernel()
        if lib is not None:
            packed = torch.empty((tiles, k // 2 if bits == 4 else k, TILE), dtype=c.dtype)
            lib.tm_lowbit_pack(c.data_ptr(), n, k, bits, packed.data_ptr())
        else:
            if pad:
                c = torch.cat([c, c.new_zeros(pad, k)])
            c = c.reshape(tiles, TILE, k).transpose(1, 2)                      # [tiles, K, 16]
            packed = (c[:, 0::2, :] | (c[:, 1::2, :] << 4)).contiguous() if bits == 4 else c.contiguous()
        return cls(n, k, bits, group, packed, tile_rows(scale), None if min is None else tile_rows(min), fmt)

    def unpacked_codes(self) -> torch.Tensor:
        """``[N, K]`` int16 codes (the inverse of the packing)."""
        c = self.codes
        if self.bits == 4:
            c16 = c.to(torch.int16)
            c = torch.stack([c16 & 0xF, c16 >> 4], dim=2).reshape(c.shape[0], -1, TILE)
        c = c.to(torch.int16).transpose(1, 2).reshape(-1, self.in_features)
        return c[: self.out_features]

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: self.out_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` weight: ``scale * q + min`` per group (float32 arithmetic, then ``dtype``)."""
        lib = _default_kernel() if self.codes.device.type == "cpu" else None
        if lib is not None and dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(self.out_features, self.in_features, dtype=dtype)
            lib.tm_lowbit_dequant(self.codes.data_ptr(), self.bits, self.out_features, self.in_features, self.group,
                                  self.scale.data_ptr(), None if self.min is None else self.min.data_ptr(),
                                  out.data_ptr(), int(dtype == torch.bfloat16))
            return out
        q = self.unpacked_codes().float().reshape(self.out_features, -1, self.group)
        w = q * self._rows(self.scale).unsqueeze(-1)
        if self.min is not None:
            w = w + self._rows(self.min).unsqueeze(-1)
        return w.reshape(self.out_features, self.in_features).to(dtype)

    def to(self, device: torch.device | str) -> "LowBitWeight":
        """A copy with every tensor on ``device``."""
        mv = lambda t: None if t is None else t.to(device)
        return LowBitWeight(self.out_features, self.in_features, self.bits, self.group, mv(self.codes),
                            mv(self.scale), mv(self.min), self.fmt, mv(self.codes_i8), mv(self.scale_h),
                            mv(self.min_h))


def _as_float16_exactly(scale: torch.Tensor, mn: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """float16 copies of ``scale`` and ``mn`` (any shape) when every value of both converts to float16 and
    back unchanged (NaN never does), else ``(None, None)``: the integer path then keeps the float32 arrays."""
    if scale.dtype != torch.float32 or (mn is not None and mn.dtype != torch.float32):
        return None, None
    out = []
    for t in (scale, mn):
        if t is None:
            out.append(None)
            continue
        h = t.to(torch.float16)
        if not torch.equal(h.to(torch.float32), t):
            return None, None
        out.append(h.contiguous())
    return out[0], out[1]


def lowbit_linear(x: torch.Tensor, w: LowBitWeight, bias: torch.Tensor | None = None,
                  lib: ctypes.CDLL | None = None, out_dtype: torch.dtype | None = None,
                  int8_act: bool = False) -> torch.Tensor:
    """``y = x · dequant(w)ᵀ + bias`` on the C kernel (CPU), or by dequantising per call elsewhere.

    Args:
        x: ``[M, K]`` float32 or bfloat16 (any M; made contiguous in its last dimension).
        w: the packed weight.
        bias: ``[N]`` or None (float32 or the activation dtype).
        lib: a kernel library from :func:`load_kernel` (default: the best variant).
        out_dtype: result dtype (default ``x.dtype``).
        int8_act: run the integer path (activations quantised to int8 per row and block of
            :attr:`LowBitWeight.i8_block` columns, 8-bit integer dot products with the codes; needs
            :meth:`LowBitWeight.prepare_i8`), else the float32 path (exact up to summation order).

    Returns:
        ``[M, N]`` in ``out_dtype``.

    Raises:
        ValueError: ``x`` has the wrong width or dtype.
    """
    out_dtype = out_dtype or x.dtype
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"input {tuple(x.shape)} does not fit a [{w.out_features}, {w.in_features}] weight")
    lib = lib if lib is not None else (_default_kernel() if x.device.type == "cpu" else None)
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or \
            out_dtype not in (torch.float32, torch.bfloat16):
        y = torch.nn.functional.linear(x, w.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
        return y.to(out_dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=out_dtype)
    b = None
    if bias is not None:
        b = bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()
    if int8_act and w.codes_i8 is not None:
        fn_h = getattr(lib, "tm_lowbit_gemm_i8_h", None) if w.scale_h is not None else None
        if fn_h is not None and fn_h.argtypes:     # float16 scales/mins (a library built before them: float32)
            fn_h(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), m, w.in_features, w.out_features,
                 w.bits, w.codes_i8.data_ptr(), w.group, w.scale_h.data_ptr(),
                 None if w.min_h is None else w.min_h.data_ptr(), None if b is None else b.data_ptr(),
                 y.data_ptr(), int(out_dtype == torch.bfloat16), w.out_features)
            return y
        lib.tm_lowbit_gemm_i8(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), m, w.in_features,
                              w.out_features, w.bits, w.codes_i8.data_ptr(), w.group, w.scale.data_ptr(),
                              None if w.min is None else w.min.data_ptr(), None if b is None else b.data_ptr(),
                              y.data_ptr(), int(out_dtype == torch.bfloat16), w.out_features)
        return y
    lib.tm_lowbit_gemm(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), m, w.in_features,
                       w.out_features, w.bits, w.codes.data_ptr(), w.group, w.scale.data_ptr(),
                       None if w.min is None else w.min.data_ptr(), None if b is None else b.data_ptr(),
                       y.data_ptr(), int(out_dtype == torch.bfloat16), w.out_features)
    return y


@functools.lru_cache(maxsize=1)
def _default_kernel() -> ctypes.CDLL | None:
    lib = load_kernel()
    if lib is not None:
        dot = bool(lib.tm_lowbit_set_bf16_dot(int(switch(BF16_DOT_SWITCH))))
        vnni = set_vnni(lib, switch(VNNI_SWITCH))
        amx = amx_status(lib) == AMX_STATUS[5]
        logger.info("low-bit GEMM kernel: %s path%s%s%s", lib.tm_lowbit_isa().decode(),
                    ", bfloat16 activations on AVX512-BF16 dot products" if dot else "",
                    ", integer path on AVX512-VNNI" if vnni else "",
                    ", many-row integer passes on AMX-INT8 tiles" if amx else "")
    return lib


def kernel_available() -> bool:
    """True when the low-bit C kernel (best ISA variant) builds and loads on this machine."""
    return _default_kernel() is not None
