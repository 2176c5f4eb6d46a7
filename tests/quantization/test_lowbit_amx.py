"""The integer low-bit path's AMX-INT8 many-row passes (csrc/lowbit_gemm.c, the avx512 variant): on tiles
emulated by csrc/emuamx.h (the ``amxemu`` variant, any AVX2 CPU) and, where the CPU has AMX, on the real ones.

AMX computes each 32-column block's int32 sums exactly (TDPBSSD), as VPMADDUBSW / VPDPBUSD do, and folds them in
with the same float epilogue in the same order, so its outputs must equal the avx2 variant's bit for bit (and
the avx512 variant's with AMX off); the gate's self-check must catch a tile result that is wrong."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.kernel_variants import AMX_EMU, amx_emulated_param, cpu_has_amx
from tests.quantization.test_lowbit import TOL_BF16_OUT, TOL_I8_SAME, _i8_reference, _lib, _no_ties, _weight
from tokenmill.model.layers import cpu_build
from tokenmill.quantization.lowbit import AMX_STATUS, LowBitWeight, amx_status, load_kernel, lowbit_linear, set_amx

#: Row counts: below the AMX threshold (8), one partial 16-row pass, exactly 16, full + partial passes, a whole
#: 64-row chunk, two chunks (the second above / below the threshold), many chunks.
ROWS = (1, 7, 8, 9, 16, 17, 37, 64, 70, 77, 129)


def _real_amx_lib():
    """The avx512 build with its AMX passes on, or a skip saying why they cannot run here."""
    if not cpu_has_amx():
        pytest.skip("this CPU has no AMX-TILE / AMX-INT8 (amx_tile, amx_int8 not in /proc/cpuinfo): the AMX "
                    "passes are tested on emulated tiles (amxemu) here")
    lib = _lib("avx512")
    if not set_amx(lib, True):
        pytest.skip(f"the AMX passes cannot run here: {amx_status(lib)}")
    return lib


@pytest.fixture
def amx_lib(request):
    """An AMX build with its passes on (emulated or real), and the avx2 build to compare with."""
    lib = _lib(AMX_EMU) if request.param == AMX_EMU else _real_amx_lib()
    assert set_amx(lib, True), amx_status(lib)
    yield lib, _lib("avx2")
    lib.tm_lowbit_amx_test_corrupt(0)
    set_amx(lib, True)


AMX_BUILDS = [amx_emulated_param(AMX_EMU), pytest.param("avx512", id="amx")]


@pytest.mark.parametrize("amx_lib", AMX_BUILDS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits,with_min,n,k", [(4, True, 40, 576), (4, False, 264, 256), (8, False, 72, 128),
                                               (8, True, 40, 96)])
def test_amx_passes_match_the_reference_and_the_avx2_bits(amx_lib, threads, bits, with_min, n, k):
    """4-bit codes with and without mins and 8-bit codes (-128 and 127 included), even and odd block counts,
    partial output tiles, thread-private (264 outputs: 17 tiles) and shared quantisation: every row count gives
    the float64 reference within the stated tolerance and the avx2 variant's bits exactly, in float32 and in
    bfloat16."""
    lib, avx2 = amx_lib
    w = _weight(bits, n, k, 32, with_min, seed=29)
    if bits == 8:
        q = w.unpacked_codes()
        q[0, :40], q[1, :40] = -128, 127
        w = LowBitWeight.from_codes(q, w._rows(w.scale), None if w.min is None else w._rows(w.min), 8)
    assert w.prepare_i8(lib)
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(bits * 100 + n)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in ROWS:
            x = _no_ties(torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k), w.i8_block)
            x[0, 32:64] = 0                                   # an all-zero block
            got = lowbit_linear(x, w, bias, lib=lib, int8_act=True)
            ref = _i8_reference(x, w) + bias.double()
            assert (got.double() - ref).abs().max().item() <= TOL_I8_SAME * ref.abs().max().item(), m
            assert torch.equal(got, lowbit_linear(x, w, bias, lib=avx2, int8_act=True)), m
            xb = x.bfloat16()
            got_b = lowbit_linear(xb, w, bias, lib=lib, int8_act=True)
            assert got_b.dtype == torch.bfloat16
            assert (got_b.double() - (_i8_reference(xb.float(), w) + bias.double())).abs().max().item() \
                <= TOL_BF16_OUT * ref.abs().max().item(), m
            assert torch.equal(got_b, lowbit_linear(xb, w, bias, lib=avx2, int8_act=True)), m
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("amx_lib", AMX_BUILDS, indirect=True)
def test_amx_switch_changes_no_bit_and_the_passes_really_run(amx_lib):
    """AMX on and off give the same bits. The test hook spoils the tile sums without re-running the gate:
    outputs of chunks of >= 8 rows then change (the AMX passes ran) and those of fewer rows do not (they never
    take them), so the equality above is not the other passes compared with themselves."""
    lib, _ = amx_lib
    w = _weight(4, 40, 256, 32, True, seed=31)
    assert w.prepare_i8(lib)
    x = torch.randn(70, 256)                                  # chunks of 64 and 6 rows
    on = lowbit_linear(x, w, lib=lib, int8_act=True)
    assert not set_amx(lib, False) and amx_status(lib) == AMX_STATUS[1]
    off = lowbit_linear(x, w, lib=lib, int8_act=True)
    assert torch.equal(on, off)
    assert set_amx(lib, True)
    lib.tm_lowbit_amx_test_corrupt(1)
    spoiled = lowbit_linear(x, w, lib=lib, int8_act=True)
    few = lowbit_linear(x[:7], w, lib=lib, int8_act=True)
    lib.tm_lowbit_amx_test_corrupt(0)
    assert not torch.equal(spoiled[:64], on[:64])             # the 64-row chunk ran on the tiles
    assert torch.equal(spoiled[64:], on[64:])                 # the 6-row chunk did not
    assert torch.equal(few, on[:7])


@pytest.mark.parametrize("amx_lib", AMX_BUILDS, indirect=True)
def test_amx_self_check_catches_a_wrong_tile_result(amx_lib, caplog):
    """A wrong integer sum from the tiles (the test hook adds an error to the stored tiles) fails the gate's
    self-check: set_amx reports off with the reason, logs a warning, and the kernel keeps the other passes,
    whose outputs are right; a healthy tile unit passes again."""
    lib, avx2 = amx_lib
    w = _weight(8, 40, 128, 32, False, seed=37)
    assert w.prepare_i8(lib)
    x = torch.randn(33, 128)
    lib.tm_lowbit_amx_test_corrupt(1)
    with caplog.at_level(logging.WARNING, logger="tokenmill.quantization.lowbit"):
        assert not set_amx(lib, True)
    assert amx_status(lib) == AMX_STATUS[4]
    assert any("self-check" in r.getMessage() for r in caplog.records)
    assert torch.equal(lowbit_linear(x, w, lib=lib, int8_act=True), lowbit_linear(x, w, lib=avx2, int8_act=True))
    lib.tm_lowbit_amx_test_corrupt(0)
    assert set_amx(lib, True) and amx_status(lib) == AMX_STATUS[5]


@pytest.mark.parametrize("isa", ["avx2", "scalar", pytest.param("avx512emu", id="avx512-emulated")])
def test_builds_without_amx_never_turn_it_on(isa):
    """Only the avx512 variant (and its emulation with emuamx.h) carries the AMX passes."""
    if not cpu_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} variant")
    lib = _lib(isa)
    assert not set_amx(lib, True) and amx_status(lib) == AMX_STATUS[0]


def test_amx_switch_is_read_when_the_kernel_loads(monkeypatch):
    """TOKENMILL_CPU_AMX=0 keeps the passes off in a library loaded under it (the gate runs at load)."""
    if not cpu_build.isa_supported(AMX_EMU):
        pytest.skip("the emulated AMX variant needs AVX2, FMA and F16C")
    lib = _lib(AMX_EMU)
    monkeypatch.delitem(cpu_build._libs, ("lowbit_gemm", AMX_EMU))   # a fresh load of the same build
    monkeypatch.setenv("TOKENMILL_CPU_AMX", "0")
    try:
        again = load_kernel(AMX_EMU)
        assert again is not lib and amx_status(again) == AMX_STATUS[1]
    finally:
        assert set_amx(lib, True)                              # the same C library state: back on
