"""The AVX-512 emulation (csrc/emu512.h, the test-only ``avx512emu`` kernel variant): every intrinsic it
emulates against the Intel SDM's pseudo-code written here in numpy / exact rationals (on every AVX2 CPU), and
against the real instructions bit for bit on a CPU with AVX-512 (skipped elsewhere, with the reason). The
cases are compiled from tests/model/csrc/emu512_selftest.c both ways."""

from __future__ import annotations

import ctypes
import os
import shutil
from fractions import Fraction

import numpy as np
import pytest

from tokenmill.model.layers import cpu_build
from tokenmill.quantization.lowbit import cpu_flags

EMU = "avx512emu"
SELFTEST = os.path.join(os.path.dirname(__file__), "csrc", "emu512_selftest.c")
FUNCS = {"tm_selftest": [ctypes.c_void_p] * 0 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                   ctypes.c_uint64, ctypes.c_void_p],
         "tm_selftest_count": [], "tm_selftest_name": [ctypes.c_int]}
TRIALS = 200
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    """isa -> (run(op, a, b, c, k) -> 64 output bytes, op names), for the builds this CPU runs."""
    src = tmp_path_factory.mktemp("emu512_csrc")
    shutil.copy(SELFTEST, src)
    shutil.copy(cpu_build.EMU512_HEADER, src)         # in the cache key
    built = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_build, "CSRC_DIR", str(src))
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("emu512_cache")))
        for isa in ("avx512", EMU):
            if not cpu_build.isa_supported(isa):
                continue
            lib = cpu_build.load_library("emu512_selftest", ["emu512_selftest.c"], FUNCS, "TOKENMILL_TEST_PROBE",
                                         isa=isa)
            assert lib is not None, f"the {isa} self-test did not build"
            lib.tm_selftest_count.restype = ctypes.c_int
            lib.tm_selftest_name.restype = ctypes.c_char_p
            names = [lib.tm_selftest_name(i).decode() for i in range(lib.tm_selftest_count())]

            def run(op, a, b, c, k, lib=lib):
                out = np.zeros(64, np.uint8)
                lib.tm_selftest(op, a.ctypes.data, b.ctypes.data, c.ctypes.data, int(k), out.ctypes.data)
                return out
            built[isa] = (run, names)
    return built


# ---------------------------------------------------------------- inputs
def _floats(rng, n=16) -> np.ndarray:
    """Finite float32 values of many scales, zeros and subnormals (no NaN: the kernels are built with
    -ffast-math, under which neither build keeps NaN or +-0 operand order defined)."""
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    kind = rng.integers(0, 10, n)
    x[kind == 0] = np.float32(0)
    sub = (rng.integers(1, 1 << 23, n).astype(np.uint32) | (rng.integers(0, 2, n).astype(np.uint32) << 31))
    x[kind == 1] = sub.view(np.float32)[kind == 1]
    return x


def _bf16_pairs(rng) -> np.ndarray:
    """32 finite bfloat16 values (as 64 bytes): many scales, zeros, subnormals."""
    f = (rng.standard_normal(32) * np.exp2(rng.integers(-70, 40, 32))).astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    kind = rng.integers(0, 8, 32)
    bits[kind == 0] = 0
    bits[kind == 1] = rng.integers(1, 0x80, 32).astype(np.uint16)[kind == 1] | 0x8000 * (rng.integers(0, 2) == 1)
    return bits.view(np.uint8)


def _inputs(name: str, rng):
    rb = lambda: rng.integers(0, 256, 64, dtype=np.uint8)  # noqa: E731
    a, b, c, k = rb(), rb(), rb(), int(rng.integers(0, 1 << 63)) * 2 + int(rng.integers(0, 2))
    if name in ("add_ps", "sub_ps", "mul_ps", "fmadd_ps", "max_ps", "reduce_add_ps", "reduce_max_ps", "set1_ps",
                "loadu_storeu_ps") or name.startswith("shuffle"):
        a, b, c = (_floats(rng).view(np.uint8) for _ in range(3))
        if name == "max_ps":                             # no +-0 pairs (see _floats)
            fa, fb = a.view(np.float32), b.view(np.float32)
            fb[(fa == 0) & (fb == 0)] = 1
        if name == "fmadd_ps" and rng.integers(0, 2):    # cancellations: c = -round(a * b)
            fa, fb, fc = a.view(np.float32), b.view(np.float32), c.view(np.float32)
            fc[::2] = -(fa[::2] * fb[::2])
    elif name == "cvtph_ps":                             # halves, no NaN
        h = rng.integers(0, 1 << 16, 32).astype(np.uint16)
        nan = ((h >> 10) & 0x1F) == 0x1F
        h[nan] &= 0xFC00
        a = np.concatenate([h.view(np.uint8), np.zeros(0, np.uint8)])
        a = np.concatenate([a, rb()[:0]])
        a = np.pad(a, (0, 64 - a.size))
    elif name == "dpbf16_ps":
        a, b = _bf16_pairs(rng), _bf16_pairs(rng)
        c = _floats(rng).view(np.uint8)
        fa, fb, fc = (x.view(np.uint16) for x in (a, b, c))
        # lane 0: odd pair cancels the accumulator, even product tiny (2^-130: flushed); lane 1: denormal acc
        fa[1], fb[1], fa[0], fb[0] = 0x3F80, 0x3F80, 0x1F00, 0x1F00    # 1 * 1, 2^-65 * 2^-65
        fcf = c.view(np.float32)
        fcf[0] = -1.0
        fcf[1] = np.uint32(5).view(np.float32)
    elif name in ("permutexvar_ps",):
        b = _floats(rng).view(np.uint8)
    return a, b, c, k


# ---------------------------------------------------------------- the SDM's pseudo-code
def _round_f32(x: Fraction, unbounded: bool = False) -> float:
    """x rounded to float32, to nearest even (subnormals: gradual, unless unbounded; overflow: inf)."""
    if x == 0:
        return 0.0
    s, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    if not unbounded:
        e = max(e, -126)
    q = Fraction(2) ** (e - 23)
    v = round(x / q) * q                                 # round(): half to even
    return s * (float("inf") if v >= 2 ** 128 else float(v))


def _fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if x == 0:                                           # IEEE: +0 unless both terms are -0
        return np.float32(a * b) + c if (a * b == 0 and c == 0) else np.float32(0)
    return np.float32(_round_f32(x))


def _flush(x: np.float32) -> np.float32:
    u = np.array([x], np.float32).view(np.uint32)[0]
    return np.array([u & 0x80000000], np.uint32).view(np.float32)[0] if (u & 0x7F800000) == 0 else x


def _bf16_fma(a, b, acc) -> np.float32:
    """One step of VDPBF16PS: DAZ inputs, FTZ output (tininess after rounding), round to nearest even."""
    a, b, acc = _flush(a), _flush(b), _flush(acc)
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(acc))
    if x == 0:
        return _fma(a, b, acc)
    if abs(_round_f32(x, unbounded=True)) < 2.0 ** -126:
        return np.float32(-0.0 if x < 0 else 0.0)
    return np.float32(_round_f32(x))


def _mx(x, y):
    return np.where(x > y, x, y)


def _reference(name: str, a: np.ndarray, b: np.ndarray, c: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros(64, np.uint8)
    f32, u32, i32 = (lambda v, t=t: v.view(t) for t in (np.float32, np.uint32, np.int32))
    u16, i16, i8 = (lambda v, t=t: v.view(t) for t in (np.uint16, np.int16, np.int8))
    k16 = np.array([(k >> i) & 1 for i in range(16)], bool)
    k64 = np.array([(k >> i) & 1 for i in range(64)], bool)

    def put(v):
        raw = np.ascontiguousarray(v).view(np.uint8).ravel()
        out[:raw.size] = raw
        return out

    def bits(m):
        return put(np.array([sum(1 << i for i, x in enumerate(m) if x)], np.uint64))

    base, _, imm = name.rpartition("_")
    if name in ("loadu_storeu_ps", "loadu_si512", "castps_si512", "castsi512_ps", "set_epi16", "setr_epi32"):
        return put(a)
    ops = {
        "abs_epi8": lambda: np.abs(i8(a).astype(np.int16)).astype(np.uint8),
        "add_epi16": lambda: u16(a) + u16(b), "add_epi32": lambda: u32(a) + u32(b),
        "add_ps": lambda: f32(a) + f32(b), "sub_ps": lambda: f32(a) - f32(b), "mul_ps": lambda: f32(a) * f32(b),
        "and_si512": lambda: a & b, "or_si512": lambda: a | b,
        "cvtepi32_epi16": lambda: (u32(a) & 0xFFFF).astype(np.uint16),
        "cvtepi32_ps": lambda: i32(a).astype(np.float32),
        "cvtepi8_epi32": lambda: i8(a[:16]).astype(np.int32), "cvtepu8_epi32": lambda: a[:16].astype(np.uint32),
        "cvtepu16_epi32": lambda: u16(a[:32]).astype(np.uint32),
        "cvtph_ps": lambda: a[:32].view(np.float16).astype(np.float32),
        "fmadd_ps": lambda: np.array([_fma(x, y, z) for x, y, z in zip(f32(a), f32(b), f32(c))], np.float32),
        "dpbf16_ps": lambda: np.array([_bf16_fma(np.float32(a2[0]), np.float32(b2[0]),
                                                 _bf16_fma(np.float32(a2[1]), np.float32(b2[1]), acc))
                                       for a2, b2, acc in zip((u16(a).astype(np.uint32) << 16).view(np.float32)
                                                              .reshape(16, 2),
                                                              (u16(b).astype(np.uint32) << 16).view(np.float32)
                                                              .reshape(16, 2), f32(c))], np.float32),
        "dpbusd_epi32": lambda: (i32(c).astype(np.int64) + (a.astype(np.int64) * i8(b)).reshape(16, 4).sum(1))
        .astype(np.uint64).astype(np.uint32),
        "madd_epi16": lambda: (i16(a).astype(np.int64) * i16(b)).reshape(16, 2).sum(1).astype(np.uint64)
        .astype(np.uint32),
        "maddubs_epi16": lambda: np.clip((a.astype(np.int32) * i8(b)).reshape(32, 2).sum(1), -32768, 32767)
        .astype(np.int16),
        "mask_mov_epi32": lambda: np.where(k16, u32(a), u32(c)),
        "mask_or_epi32": lambda: np.where(k16, u32(a) | u32(b), u32(c)),
        "mask_sub_epi8": lambda: np.where(k64, a - b, c),
        "max_ps": lambda: _mx(f32(a), f32(b)),
        "permutexvar_epi16": lambda: u16(b)[u16(a) & 31], "permutexvar_ps": lambda: u32(b)[u32(a) & 15],
        "set1_epi16": lambda: np.full(32, i16(a)[0]), "set1_epi32": lambda: np.full(16, i32(a)[0]),
        "set1_epi8": lambda: np.full(64, a[0]), "set1_ps": lambda: np.full(16, f32(a)[0]),
        "setzero_ps": lambda: np.zeros(16, np.float32), "setzero_si512": lambda: np.zeros(64, np.uint8),
    }
    if name in ops:
        return put(ops[name]())
    if name in ("cmpeq_epi32_mask", "test_epi32_mask"):
        return bits(u32(a) == u32(b) if name == "cmpeq_epi32_mask" else (u32(a) & u32(b)) != 0)
    if name == "movepi8_mask":
        return bits(a >> 7)
    if name == "reduce_add_ps":
        x = f32(a)
        t3 = x[8:] + x[:8]
        t6 = t3[4:] + t3[:4]
        t8 = t6 + t6[[2, 3, 0, 1]]
        return put(np.array([t8[0] + t8[1]], np.float32))
    if name == "reduce_max_ps":
        x = f32(a)
        t3 = _mx(x[8:], x[:8])
        t6 = _mx(t3[4:], t3[:4])
        t8 = _mx(t6, t6[[2, 3, 0, 1]])
        return put(np.array([_mx(t8, t8[[1, 0, 1, 0]])[0]], np.float32))
    n = int(imm, 16) if base.startswith(("shuffle", "ternarylogic")) else int(imm)
    if base == "shuffle_f32x4":
        qa, qb = f32(a).reshape(4, 4), f32(b).reshape(4, 4)
        return put(np.stack([qa[n & 3], qa[(n >> 2) & 3], qb[(n >> 4) & 3], qb[(n >> 6) & 3]]))
    if base == "shuffle_ps":
        qa, qb = f32(a).reshape(4, 4), f32(b).reshape(4, 4)
        return put(np.stack([qa[:, n & 3], qa[:, (n >> 2) & 3], qb[:, (n >> 4) & 3], qb[:, (n >> 6) & 3]], 1))
    if base == "slli_epi32":
        return put(np.zeros(16, np.uint32) if n > 31 else u32(a) << np.uint32(n))
    if base == "srli_epi32":
        return put(np.zeros(16, np.uint32) if n > 31 else u32(a) >> np.uint32(n))
    if base == "srli_epi16":
        return put(np.zeros(32, np.uint16) if n > 15 else u16(a) >> np.uint16(n))
    if base == "ternarylogic_epi32":
        x, y, z = u32(a), u32(b), u32(c)
        r = np.zeros(16, np.uint32)
        for idx in range(8):
            if (n >> idx) & 1:
                r |= (x if idx & 4 else ~x) & (y if idx & 2 else ~y) & (z if idx & 1 else ~z)
        return put(r)
    raise AssertionError(f"no reference for {name}")


# ---------------------------------------------------------------- the tests
@needs_cc
def test_emulation_follows_the_pseudo_code(selftest):
    """Every emulated intrinsic (each immediate the self-test builds) equals the SDM's pseudo-code bit for bit
    on random inputs with the edge cases (saturation, -128, shifts past the width, subnormals, VDPBF16PS's
    flushing, cancellations)."""
    if EMU not in selftest:
        pytest.skip("the emulated variant needs AVX2, FMA and F16C")
    run, names = selftest[EMU]
    rng = np.random.default_rng(0)
    assert len(names) == 70
    for op, name in enumerate(names):
        for t in range(TRIALS if name not in ("dpbf16_ps", "fmadd_ps") else TRIALS // 4):
            a, b, c, k = _inputs(name, rng)
            got, want = run(op, a, b, c, k), _reference(name, a, b, c, k)
            assert np.array_equal(got, want), (name, t, a, b, c, k, got, want)


def test_emulation_equals_the_real_instructions(selftest):
    """On a CPU with AVX-512: the emulation and the real instructions give the same bits on the same inputs
    (BF16 and VNNI where the CPU has them). This checks emu512.h itself on such machines."""
    if "avx512" not in selftest:
        pytest.skip("this CPU has no AVX-512: the emulation is checked against the pseudo-code only here")
    if EMU not in selftest:
        pytest.skip("the emulated variant needs AVX2, FMA and F16C")
    (real, names), (emu, _) = selftest["avx512"], selftest[EMU]
    flags = cpu_flags()
    rng = np.random.default_rng(1)
    for op, name in enumerate(names):
        if (name == "dpbf16_ps" and "avx512_bf16" not in flags) or (name == "dpbusd_epi32"
                                                                     and "avx512_vnni" not in flags):
            continue
        for t in range(TRIALS):
            a, b, c, k = _inputs(name, rng)
            got, want = emu(op, a, b, c, k), real(op, a, b, c, k)
            assert np.array_equal(got, want), (name, t, a, b, c, k, got, want)


def test_emulated_variant_is_test_only():
    """Never the process's variant: not among ISAS, refused by use_isa / TOKENMILL_CPU_ISA; runs the avx512
    code paths where the CPU has AVX2."""
    assert EMU not in cpu_build.ISAS and EMU not in cpu_build.supported_isas()
    assert cpu_build.code_path(EMU) == "avx512" and cpu_build.code_path("avx2") == "avx2"
    with pytest.raises(ValueError):
        cpu_build.use_isa(EMU)
    assert cpu_build.isa_supported(EMU) == cpu_build.isa_supported("avx2")
