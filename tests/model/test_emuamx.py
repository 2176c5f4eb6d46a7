"""The AMX-INT8 emulation (csrc/emuamx.h, the test-only ``amxemu`` kernel variant): every tile instruction it
emulates against the Intel SDM's pseudo-code written here in numpy (on every AVX2 CPU), and against the real
instructions bit for bit on a CPU with AMX (skipped elsewhere, with the reason). The cases are compiled from
tests/model/csrc/emuamx_selftest.c both ways."""

from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from tests.kernel_variants import AMX_EMU, cpu_has_amx
from tokenmill.model.layers import cpu_build

SELFTEST = os.path.join(os.path.dirname(__file__), "csrc", "emuamx_selftest.c")
_P, _I = ctypes.c_void_p, ctypes.c_int
FUNCS = {"tm_amx_selftest": [_I, _P, _P, _P, _I, _I, _I, _P], "tm_amx_selftest_ready": []}
OPS = {0: "tdpbssd", 1: "tdpbsud", 2: "tdpbusd", 3: "tdpbuud", 4: "tilezero", 5: "load/store", 6: "tdpbssd x2"}
TRIALS = 60
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    """variant -> run(op, a, b, c, m, k, n) -> the 16 x 64 output bytes, for the builds this CPU runs."""
    src = tmp_path_factory.mktemp("emuamx_csrc")
    shutil.copy(SELFTEST, src)
    for h in (cpu_build.EMU512_HEADER, cpu_build.EMUAMX_HEADER):     # in the cache key
        shutil.copy(h, src)
    built = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_build, "CSRC_DIR", str(src))
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("emuamx_cache")))
        for isa in ("avx512", AMX_EMU):
            if (isa == "avx512" and not cpu_has_amx()) or not cpu_build.isa_supported(isa):
                continue
            lib = cpu_build.load_library("emuamx_selftest", ["emuamx_selftest.c"], FUNCS, "TOKENMILL_TEST_PROBE",
                                         isa=isa)
            assert lib is not None, f"the {isa} AMX self-test did not build"
            lib.tm_amx_selftest_ready.restype = ctypes.c_int
            if not lib.tm_amx_selftest_ready():
                continue                                 # Linux refused the tile data permission

            def run(op, a, b, c, m, k, n, lib=lib):
                out = np.zeros((16, 64), np.uint8)
                lib.tm_amx_selftest(op, a.ctypes.data, b.ctypes.data, c.ctypes.data, m, k, n, out.ctypes.data)
                return out
            built[isa] = run
    return built


def _reference(op: int, a: np.ndarray, b: np.ndarray, c: np.ndarray, m: int, k: int, n: int) -> np.ndarray:
    """The SDM's pseudo-code: C[m][n] += sum over k, i < 4 of A.byte[m][4k+i] * B.byte[k][4n+i] (each signed or
    unsigned per the mnemonic), dwords wrapping mod 2^32; rows past m, bytes past n dwords: zero."""
    out = np.zeros((16, 64), np.uint8)
    acc = c[:m, :4 * n].copy().view(np.uint32).astype(np.int64)           # [m, n]
    if op == 4:
        acc[:] = 0
    elif op in (0, 1, 2, 3, 6):
        sa, sb = {0: (True, True), 1: (True, False), 2: (False, True), 3: (False, False), 6: (True, True)}[op]
        av = (a[:m, :4 * k].view(np.int8) if sa else a[:m, :4 * k]).astype(np.int64).reshape(m, k, 4)
        bv = (b[:k, :4 * n].view(np.int8) if sb else b[:k, :4 * n]).astype(np.int64).reshape(k, n, 4)
        prod = np.einsum("mki,kni->mn", av, bv)
        acc = acc + prod * (2 if op == 6 else 1)
    out[:m, :4 * n] = (acc % (1 << 32)).astype(np.uint32).view(np.uint8).reshape(m, 4 * n)
    return out


def _inputs(rng, t: int):
    """Random tiles (every byte value; extremes every few trials) and a shape, the full 16 x 16 x 16 often."""
    a, b, c = (rng.integers(0, 256, (16, 64), dtype=np.uint8) for _ in range(3))
    if t % 5 == 0:                                         # the extremes: -128 / 255 everywhere, big accumulators
        a[:] = 0x80 if t % 2 else 0xFF
        b[:] = 0x80 if t % 3 else 0xFF
        c[:] = 0xFF
    m, k, n = (16, 16, 16) if t % 3 == 0 else tuple(int(v) for v in rng.integers(1, 17, 3))
    return a, b, c, m, k, n


@needs_cc
def test_emulation_follows_the_pseudo_code(selftest):
    """Every emulated instruction (the four TDPB*D signednesses, TILEZERO, load/store, accumulation) equals the
    SDM's pseudo-code bit for bit on random tiles of random shapes, with the extremes (-128 x -128, 255 x 255
    sums, wrapping accumulators), and nothing outside the configured rows/columns is written."""
    if AMX_EMU not in selftest:
        pytest.skip("the emulated AMX variant needs AVX2, FMA and F16C")
    run = selftest[AMX_EMU]
    rng = np.random.default_rng(0)
    for op in OPS:
        for t in range(TRIALS):
            a, b, c, m, k, n = _inputs(rng, t)
            got, want = run(op, a, b, c, m, k, n), _reference(op, a, b, c, m, k, n)
            assert np.array_equal(got, want), (OPS[op], t, m, k, n)


def test_emulation_equals_the_real_instructions(selftest):
    """On a CPU with AMX-INT8 (and Linux's permission): the emulation and the instructions give the same bits."""
    if not cpu_has_amx():
        pytest.skip("this CPU has no AMX-TILE / AMX-INT8: the emulation is checked against the pseudo-code only")
    if "avx512" not in selftest:
        pytest.skip("Linux refused the AMX tile data permission (ARCH_REQ_XCOMP_PERM): the instructions cannot run")
    if AMX_EMU not in selftest:
        pytest.skip("the emulated AMX variant needs AVX2, FMA and F16C")
    real, emu = selftest["avx512"], selftest[AMX_EMU]
    rng = np.random.default_rng(1)
    for op in OPS:
        for t in range(TRIALS):
            a, b, c, m, k, n = _inputs(rng, t)
            assert np.array_equal(emu(op, a, b, c, m, k, n), real(op, a, b, c, m, k, n)), (OPS[op], t, m, k, n)


def test_emulated_amx_variant_is_test_only():
    """Never the process's variant: not among ISAS, refused by use_isa; runs the avx512 code paths."""
    assert AMX_EMU not in cpu_build.ISAS and AMX_EMU not in cpu_build.supported_isas()
    assert cpu_build.code_path(AMX_EMU) == "avx512"
    with pytest.raises(ValueError):
        cpu_build.use_isa(AMX_EMU)
    assert cpu_build.isa_supported(AMX_EMU) == cpu_build.isa_supported("avx2")
