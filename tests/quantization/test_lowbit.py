"""The low-bit GEMM kernel, every ISA variant explicitly, against the dequantised weight's float32 GEMM."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_variants import AMX_EMU, EMU, amx_emulated_param, emulated_param, real_param, variants
from tokenmill.model.layers.cpu_build import code_path, isa_supported
from tokenmill.quantization.lowbit import LowBitWeight, cpu_flags, load_kernel, lowbit_linear, set_bf16_dot, set_vnni

# Tolerances (relative to the output's largest magnitude): float32 activations differ from the dequantised
# reference only in summation order; bfloat16 outputs add one bfloat16 rounding (2^-8 relative).
TOL_F32, TOL_BF16_OUT = 2e-5, 8e-3


def _lib(isa: str):
    if not isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} variant of the kernel")
    lib = load_kernel(isa)
    if lib is None:
        pytest.skip("no C compiler: the low-bit kernel cannot be built here")
    assert lib.tm_lowbit_isa().decode() == code_path(isa)   # the variant has that ISA's path compiled in
    return lib


#: The integer path's variants: every ISA build, the avx512 one with its AVX-512BW multiply-adds and with
#: AVX512-VNNI (VPDPBUSD, chosen at run time where the CPU has it); on a CPU without AVX-512, the emulated
#: avx512 build both ways (tests/kernel_variants.py).
I8_REAL = ["avx512-vnni", "avx512", "avx2", "scalar"]
I8_VARIANTS = I8_REAL + [emulated_param(EMU + "-vnni", id="avx512-vnni-emulated"), emulated_param(EMU)]


def _i8_cases(cases, emulated):
    """``i8_lib, *case`` parameter sets: every real :data:`I8_REAL` variant with every case, and the emulated
    ones ({variant: cases}) with a few (the emulation runs the same paths; their every shape would cost
    minutes of test time)."""
    params = [pytest.param(v, *c, id="-".join(map(str, (*c, v)))) for v in I8_REAL for c in cases]
    names = {EMU: "avx512-emulated", EMU + "-vnni": "avx512-vnni-emulated", AMX_EMU: "amx-emulated"}
    make = {AMX_EMU: amx_emulated_param}
    return params + [make.get(v, emulated_param)(v, *c, id="-".join(map(str, (*c, names[v]))))
                     for v, cs in emulated.items() for c in cs]
#: The avx512 builds that carry the AVX512-BF16 / -VNNI run-time paths: the real one, and the emulated one on a
#: CPU without AVX-512.
AVX512_BUILDS = [real_param("avx512"), emulated_param(EMU)]


@pytest.fixture
def i8_lib(request):
    """The kernel library of an :data:`I8_VARIANTS` entry, its VNNI switch set (restored afterwards)."""
    variant = request.param
    lib = _lib(variant.removesuffix("-vnni"))
    vnni = variant.endswith("-vnni")
    if set_vnni(lib, vnni) != vnni:
        set_vnni(lib, True)
        pytest.skip(f"no AVX512-VNNI on this CPU ({variant} needs it)")
    yield lib
    set_vnni(lib, True)


def _weight(bits: int, n: int, k: int, group: int, with_min: bool, seed: int = 0) -> LowBitWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (n, k), generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.05
    mn = torch.randn(n, k // group, generator=g) * 0.1 if with_min else None
    return LowBitWeight.from_codes(codes, scale, mn, bits, fmt=f"test{bits}")


@pytest.mark.parametrize("isa", variants())
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


@pytest.mark.parametrize("isa", AVX512_BUILDS)
@pytest.mark.parametrize("bits,group,with_min", [(4, 32, True), (4, 4, False), (8, 32, False), (8, 96, True)])
def test_bf16_dot_path_matches_the_fma_path_and_the_reference(isa, bits, group, with_min):
    """avx512's AVX512-BF16 path (VDPBF16PS) for bfloat16 activations: same sums as the float32 FMA path."""
    lib = _lib(isa)
    if isa == "avx512" and "avx512_bf16" not in cpu_flags():
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


@pytest.mark.parametrize("isa", variants())
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


# ---------------------------------------------------------------------------------------------- integer path
# Stated tolerances of the integer path (int8 activations per block of 32 columns x the codes), relative to
# the output's largest magnitude: against the same quantisation done in float64 (only float32 summation order
# and a rare rounding tie differ) 1e-4; against the dequantised float32 GEMM (activation rounding, <= dx/2 per
# element) 2e-2 on these random weights.
TOL_I8_SAME, TOL_I8_DENSE = 1e-4, 2e-2


def _i8_reference(x: torch.Tensor, w: LowBitWeight) -> torch.Tensor:
    """The integer path's arithmetic in float64: x quantised per row and block of w.i8_block columns."""
    sb, k = w.i8_block, w.in_features
    xf = x.double().reshape(x.shape[0], k // sb, sb)
    amax = xf.abs().amax(-1, keepdim=True)
    xq = torch.where(amax > 0, torch.round(xf.float() * (127.0 / amax.float())).double(), torch.zeros_like(xf))
    xd = (xq * (amax / 127.0)).reshape(x.shape[0], k)            # dequantised activations
    wd = w.dequantize().double()
    y = xd @ wd.t()
    if w.min is not None:                                        # the min term uses the float activations
        mn = w._rows(w.min).double().repeat_interleave(w.group, dim=1)
        y = y - xd @ mn.t() + x.double() @ mn.t()
    return y


def _no_ties(x: torch.Tensor, sb: int) -> torch.Tensor:
    """x (float32 or bfloat16) with every element moved off a rounding tie of its int8 code (x * 127 / block
    max within 1e-2 of k + 1/2, where the C and torch roundings may legitimately differ) by one ulp steps."""
    for _ in range(64):
        xb = x.float().reshape(x.shape[0], -1, sb)
        amax = xb.abs().amax(-1, keepdim=True)
        v = xb * (127.0 / amax.clamp_min(1e-30))
        near = (((v - v.floor() - 0.5).abs() < 1e-2) & (xb.abs() < amax)).reshape(x.shape)
        if not near.any():
            return x
        bits = x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)
        step = 1 if x.dtype == torch.bfloat16 else 1 << 12
        x = torch.where(near, bits + step, bits).view(x.dtype)
    return x


@pytest.mark.parametrize("i8_lib,bits,group,with_min", _i8_cases(
    [(4, 32, True), (4, 32, False), (4, 128, True), (4, 16, False), (8, 32, False), (8, 32, True), (8, 16, True),
     (8, 64, True)],
    {EMU + "-vnni": [(4, 32, True), (8, 32, False)], EMU: [(4, 32, False), (8, 16, True), (4, 128, True)]}),
    indirect=["i8_lib"])
def test_int8_activation_path_matches_its_reference(i8_lib, bits, group, with_min):
    """Every variant's integer path (AVX2 VPMADDUBSW, AVX-512BW, AVX512-VNNI, scalar C) against the same
    quantisation in float64, and within the stated tolerance of the dequantised float32 GEMM."""
    lib, isa = i8_lib, i8_lib.tm_lowbit_isa().decode()
    n, k = 40, 256                                   # two full tiles and a partial one
    w = _weight(bits, n, k, group, with_min, seed=7)
    assert w.prepare_i8(lib) and w.codes_i8 is not None and w.codes_i8.shape == w.codes.shape
    dense = w.dequantize()
    bias = torch.randn(n)
    for m in (1, 3, 4, 5, 8, 9, 17, 33, 70):         # every row-count specialisation, row passes, 2 row chunks
        x = torch.randn(m, k)
        x[0, :40] = 0                                # an all-zero block (scale 0) and a partial one
        if m > 1:
            x[1, 5] = 30.0                           # an outlier dominating its block
        x = _no_ties(x, w.i8_block)
        got = lowbit_linear(x, w, bias, lib=lib, int8_act=True)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        ref = _i8_reference(x, w) + bias.double()
        scale = ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= TOL_I8_SAME * scale, (m, isa)
        dense_ref = x @ dense.t() + bias
        plain = [r for r in range(m) if r != 1]      # the outlier's block is rounded coarsely by design
        assert (got[plain] - dense_ref[plain]).abs().max().item() <= TOL_I8_DENSE * scale, (m, isa)
        xb = _no_ties(x.bfloat16(), w.i8_block)     # bfloat16 in and out
        got_b = lowbit_linear(xb, w, bias, lib=lib, int8_act=True)
        ref_b = _i8_reference(xb.float(), w) + bias.double()
        assert got_b.dtype == torch.bfloat16
        assert (got_b.double() - ref_b).abs().max().item() <= TOL_BF16_OUT * scale


@pytest.mark.parametrize("i8_lib", I8_VARIANTS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits,group,with_min", [(4, 32, True), (8, 32, False), (4, 128, True)])
def test_int8_activation_path_thread_private_quantisation(i8_lib, threads, bits, group, with_min):
    """Weights of at least 16 tiles per thread quantise the activations in every thread (17 tiles: with one
    thread that path, with two the shared one); both against the float64 reference, rows in two chunks."""
    lib, isa = i8_lib, i8_lib.tm_lowbit_isa().decode()
    n, k = 264, 128                                  # 16 full tiles and a partial one
    w = _weight(bits, n, k, group, with_min, seed=11)
    assert w.prepare_i8(lib)
    bias = torch.randn(n)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 6, 70):
            x = _no_ties(torch.randn(m, k), w.i8_block)
            got = lowbit_linear(x, w, bias, lib=lib, int8_act=True)
            ref = _i8_reference(x, w) + bias.double()
            assert (got.double() - ref).abs().max().item() <= TOL_I8_SAME * ref.abs().max().item(), (m, isa)
            again = lowbit_linear(x, w, bias, lib=lib, int8_act=True)      # the thread's buffer reused
            assert torch.equal(got, again)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("isa", AVX512_BUILDS)
@pytest.mark.parametrize("bits,with_min", [(4, True), (4, False), (8, False), (8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_integer_path_is_bit_identical_to_avx512bw(isa, bits, with_min, dtype):
    """VPDPBUSD and VPMADDUBSW + VPMADDWD give the same exact integer sums and share the float epilogue, so
    the VNNI switch changes no bit (8-bit codes of -128 and extreme activations included)."""
    lib = _lib(isa)
    if not set_vnni(lib, True):
        pytest.skip("no AVX512-VNNI on this CPU: the VNNI path cannot run here")
    try:
        w = _weight(bits, 72, 576, 32, with_min, seed=3)
        if bits == 8:                                    # the extreme codes
            q = w.unpacked_codes()
            q[0, :8] = -128
            q[1, :8] = 127
            w = LowBitWeight.from_codes(q, w._rows(w.scale), None if w.min is None else w._rows(w.min), 8)
        assert w.prepare_i8(lib)
        x = (torch.randn(37, 576) * torch.logspace(-3, 3, 576)).to(dtype)   # blocks of very different scales
        x[3, 64:96] = 0
        vnni = lowbit_linear(x, w, lib=lib, int8_act=True)
        set_vnni(lib, False)
        bw = lowbit_linear(x, w, lib=lib, int8_act=True)
        assert torch.equal(vnni, bw)
    finally:
        set_vnni(lib, True)


def test_int8_activation_path_needs_blocks_that_fit():
    """Groups that do not split into blocks of the integer path's steps keep the float32 path."""
    w = _weight(4, 16, 96, 12, False)               # group 12: not a multiple of 8 columns
    assert w.i8_block == 0 and not w.prepare_i8() and w.codes_i8 is None
    w = _weight(4, 16, 96, 48, False)               # group 48 > 32 and not a multiple of 32
    assert w.i8_block == 0
    x = torch.randn(9, 96)                          # int8_act without i8 codes: the float32 path
    torch.testing.assert_close(lowbit_linear(x, w, int8_act=True), lowbit_linear(x, w))
    w = _weight(8, 16, 64, 4, True)
    assert w.i8_block == 4
    if w.prepare_i8():
        assert w.nbytes == 2 * w.codes.numel() + 4 * w.scale.numel() * 2


@pytest.mark.parametrize("i8_lib", I8_VARIANTS, indirect=True)
@pytest.mark.parametrize("bits,group,with_min", [(4, 32, True), (8, 32, False), (4, 128, True), (8, 16, True)])
def test_int8_activation_path_bfloat16_rows_quantise_as_their_float32_widening(i8_lib, bits, group, with_min):
    """bfloat16 activations are widened exactly and then quantised by the float32 rows' own code (the vector
    path on AVX2/AVX-512), so a bfloat16 input gives the same bits as its float32 widening on every variant
    and at every row count: the two dtypes' integer paths cannot drift apart."""
    lib = i8_lib
    n, k = 264, 256                                  # enough tiles for the thread-private quantisation too
    w = _weight(bits, n, k, group, with_min, seed=5)
    assert w.prepare_i8(lib)
    for m in (1, 5, 64, 70):
        xb = (torch.randn(m, k) * torch.logspace(-2, 2, k)).bfloat16()
        got = lowbit_linear(xb, w, lib=lib, int8_act=True, out_dtype=torch.float32)
        want = lowbit_linear(xb.float(), w, lib=lib, int8_act=True)
        assert torch.equal(got, want), m


@pytest.mark.parametrize("i8_lib,threads,bits,group,with_min,n,k", _i8_cases(
    [(t, *c) for t in (1, 2) for c in [(4, 32, True, 40, 576), (8, 32, False, 264, 576), (4, 32, True, 600, 1536),
                                       (4, 128, True, 40, 256), (8, 16, True, 40, 128)]],
    {EMU + "-vnni": [(2, 4, 32, True, 40, 576), (2, 8, 32, False, 264, 576)],
     EMU: [(1, 8, 16, True, 40, 128), (2, 4, 128, True, 40, 256)],
     AMX_EMU: [(2, 4, 32, True, 40, 576), (1, 8, 32, False, 264, 576)]}),
    indirect=["i8_lib"])
def test_int8_activation_path_rows_are_batch_invariant(i8_lib, threads, bits, group, with_min, n, k):
    """A row's bits on the integer path do not depend on how many rows share the call or where it sits: the
    kernel runs rows in passes of different sizes (one row, the AVX2 two-halves tile for passes of <= 2 rows;
    up to 4 or 8 rows otherwise; chunks of 64 rows; thread-private or shared quantisation by tile count), and
    every one must give each row the bits it gets alone. Also each call against the float64 reference."""
    lib, isa = i8_lib, i8_lib.tm_lowbit_isa().decode()
    w = _weight(bits, n, k, group, with_min, seed=13)
    assert w.prepare_i8(lib)
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(17)
    xs = _no_ties(torch.randn(140, k, generator=g) * torch.rand(140, 1, generator=g) * 4, w.i8_block)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([lowbit_linear(xs[i:i + 1], w, bias, lib=lib, int8_act=True) for i in range(len(xs))])
        ref = _i8_reference(xs, w) + bias.double()
        assert (alone.double() - ref).abs().max().item() <= TOL_I8_SAME * ref.abs().max().item(), isa
        for m in list(range(2, 19)) + [31, 64, 65, 70, 129, 140]:
            start = (7 * m) % (len(xs) - m + 1)         # different rows at different positions per m
            got = lowbit_linear(xs[start:start + m], w, bias, lib=lib, int8_act=True)
            assert torch.equal(got, alone[start:start + m]), (isa, m)
        xb = xs[:70].bfloat16()                         # bfloat16 in and out: the same per-row rule
        alone_b = torch.cat([lowbit_linear(xb[i:i + 1], w, bias, lib=lib, int8_act=True) for i in range(70)])
        for m in (3, 9, 70):
            assert torch.equal(lowbit_linear(xb[:m], w, bias, lib=lib, int8_act=True), alone_b[:m]), (isa, m)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("i8_lib", I8_VARIANTS, indirect=True)
@pytest.mark.parametrize("bits,group,with_min", [(4, 32, True), (8, 32, False), (4, 128, True), (8, 16, True)])
def test_int8_activation_path_float16_scales_give_the_float32_bits(i8_lib, bits, group, with_min):
    """Scales and mins that are float16 numbers (GGUF's) get float16 copies for the integer path, widened
    exactly in the kernel: every row count gives the bits of the float32 arrays (subnormal and zero scales
    included). Values float16 cannot hold keep the float32 arrays only."""
    lib = i8_lib
    n, k = 264, 256
    g = torch.Generator().manual_seed(23)
    codes = torch.randint(0, 16, (n, k), generator=g) if bits == 4 else torch.randint(-128, 128, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.05).half()
    scale[0, 0], scale[1, 0], scale[2, 0] = 6e-8, 0.0, 3e-6             # subnormal, zero, subnormal
    mn = (torch.randn(n, k // group, generator=g) * 0.1).half() if with_min else None
    w = LowBitWeight.from_codes(codes, scale.float(), None if mn is None else mn.float(), bits)
    assert w.prepare_i8(lib)
    assert w.scale_h is not None and w.scale_h.dtype == torch.float16 and (w.min_h is not None) == with_min
    assert w.i8_stream_bytes < w.codes_i8.numel() + 4 * w.scale.numel() * (2 if with_min else 1)
    plain = LowBitWeight(w.out_features, w.in_features, w.bits, w.group, w.codes, w.scale, w.min, w.fmt,
                         w.codes_i8)                       # the same weight without the float16 copies
    bias = torch.randn(n)
    for m in (1, 2, 3, 5, 64, 70):
        x = torch.randn(m, k) * torch.logspace(-2, 2, k)
        assert torch.equal(lowbit_linear(x, w, bias, lib=lib, int8_act=True),
                           lowbit_linear(x, plain, bias, lib=lib, int8_act=True)), m
        xb = x.bfloat16()
        assert torch.equal(lowbit_linear(xb, w, lib=lib, int8_act=True),
                           lowbit_linear(xb, plain, lib=lib, int8_act=True)), m
    inexact = _weight(bits, n, k, group, with_min, seed=2)   # float32 random scales: not float16 numbers
    assert inexact.prepare_i8(lib) and inexact.scale_h is None and inexact.min_h is None
