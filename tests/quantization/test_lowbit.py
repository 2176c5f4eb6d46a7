"""The low-bit GEMM kernel, every ISA variant explicitly, against the dequantised weight's float32 GEMM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.model.layers.cpu_build import ISAS, isa_supported
from tokenmill.quantization.lowbit import LowBitWeight, cpu_flags, load_kernel, lowbit_linear, set_bf16_dot

# Tolerances (relative to the output's largest magnitude): float32 activations differ from the dequantised
# reference only in summation order; bfloat16 outputs add one bfloat16 rounding (2^-8 relative).
TOL_F32, TOL_BF16_OUT = 2e-5, 8e-3


def _lib(isa: str):
    if not isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} variant of the kernel")
    lib = load_kernel(isa)
    if lib is None:
        pytest.skip("no C compiler: the low-bit kernel cannot be built here")
    assert lib.tm_lowbit_isa().decode() == isa          # the variant really has that ISA's path compiled in
    return lib


def _weight(bits: int, n: int, k: int, group: int, with_min: bool, seed: int = 0) -> LowBitWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (n, k), generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.05
    mn = torch.randn(n, k // group, generator=g) * 0.1 if with_min else None
    return LowBitWeight.from_codes(codes, scale, mn, bits, fmt=f"test{bits}")


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("bits,group,with_min", [(4, 32, True), (4, 128, True), (8, 32, False), (8, 16, True),
                                                 (8, 96, False)])
def test_kernel_matches_dequantised_reference(isa, bits, group, with_min):
    lib = _lib(isa)
    n, k = 40, 192                                   # 40 rows: two full tiles and a partial one
    w = _weight(bits, n, k, group, with_min)
    dense = w.dequantize()
    bias = torch.randn(n)
    for m in (1, 2, 3, 5, 8, 13):                    # every row-count specialisation and a second row pass
        x = torch.randn(m, k)
        want = x @ dense.t() + bias
        scale = want.abs().max().item()
        got = lowbit_linear(x, w, bias, lib=lib)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert (got - want).abs().max().item() <= TOL_F32 * scale, (m, isa)
        xb = x.bfloat16()                            # bfloat16 activations are widened exactly
        want_b = xb.float() @ dense.t() + bias
        got_b = lowbit_linear(xb, w, bias, lib=lib)
        assert got_b.dtype == torch.bfloat16
        assert (got_b.float() - want_b).abs().max().item() <= TOL_BF16_OUT * scale
        got_f = lowbit_linear(xb, w, bias, lib=lib, out_dtype=torch.float32)
        assert (got_f - want_b).abs().max().item() <= TOL_F32 * scale


@pytest.mark.parametrize("bits,group,with_min", [(4, 32, True), (4, 4, False), (8, 32, False), (8, 96, True)])
def test_bf16_dot_path_matches_the_fma_path_and_the_reference(bits, group, with_min):
    """avx512's AVX512-BF16 path (VDPBF16PS) for bfloat16 activations: same sums as the float32 FMA path."""
    lib = _lib("avx512")
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16: the dot-product path cannot run (the FMA path serves bfloat16)")
    n, k = 40, 192
    w = _weight(bits, n, k, group, with_min, seed=5)
    dense = w.dequantize()
    try:
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 11):           # every row-count specialisation and a second row pass
            xb = torch.randn(m, k).bfloat16()
            xb[0, :8] = 0                                 # zeros and an exact pair, as real activations have
            want = xb.float() @ dense.t()
            scale = want.abs().max().item()
            assert set_bf16_dot(lib, True)
            dot = lowbit_linear(xb, w, lib=lib, out_dtype=torch.float32)
            assert not set_bf16_dot(lib, False)
            fma = lowbit_linear(xb, w, lib=lib, out_dtype=torch.float32)
            assert (dot - want).abs().max().item() <= TOL_F32 * scale, m
            assert (dot - fma).abs().max().item() <= TOL_F32 * scale, m
            set_bf16_dot(lib, True)
            strided = torch.randn(m, k + 10).bfloat16()[:, 3:3 + k]     # rows ldx apart, not 4-byte aligned
            torch.testing.assert_close(lowbit_linear(strided, w, lib=lib, out_dtype=torch.float32),
                                       strided.float() @ dense.t(), rtol=0, atol=TOL_F32 * 50)
    finally:
        set_bf16_dot(lib, True)


def test_bf16_dot_is_never_on_without_its_instructions():
    for isa in ("avx2", "scalar"):
        if isa_supported(isa) and (lib := load_kernel(isa)) is not None:
            assert not set_bf16_dot(lib, True)


@pytest.mark.parametrize("isa", list(ISAS))
def test_kernel_reads_strided_rows_and_no_bias(isa):
    lib = _lib(isa)
    w = _weight(4, 16, 64, 32, True, seed=3)
    big = torch.randn(4, 100)
    x = big[:, 10:74]                                # row stride 100, not 64
    torch.testing.assert_close(lowbit_linear(x, w, lib=lib), x @ w.dequantize().t(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_round_trips_codes(bits):
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (37, 64))
    w = LowBitWeight.from_codes(codes, torch.rand(37, 2), None, bits)
    assert torch.equal(w.unpacked_codes(), codes.to(torch.int16))
    assert w.codes.shape == (3, 64 // (2 if bits == 4 else 1), 16)
    assert w.nbytes == w.codes.numel() + 4 * 3 * 16 * 2


def test_bad_codes_and_shapes_are_rejected():
    with pytest.raises(ValueError, match="out of range"):
        LowBitWeight.from_codes(torch.full((16, 32), 16), torch.ones(16, 1), None, 4)
    with pytest.raises(ValueError, match="do not fit"):
        LowBitWeight.from_codes(torch.zeros(16, 32), torch.ones(8, 1), None, 4)
    with pytest.raises(ValueError, match="multiples of 4"):
        LowBitWeight.from_codes(torch.zeros(16, 30), torch.ones(16, 5), None, 8)
    with pytest.raises(ValueError, match="bits must be"):
        LowBitWeight.from_codes(torch.zeros(16, 32), torch.ones(16, 1), None, 3)
    w = _weight(8, 16, 32, 32, False)
    with pytest.raises(ValueError, match="does not fit"):
        lowbit_linear(torch.randn(2, 48), w)


def test_non_cpu_fallback_dequantises():
    """Without the kernel (other devices, other dtypes) the layer dequantises per call: same result."""
    w = _weight(4, 24, 64, 32, True)
    x = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(lowbit_linear(x, w), x @ w.dequantize(torch.float64).t())
