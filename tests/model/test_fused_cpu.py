"""Fused CPU element-wise kernels, every ISA variant the CPU runs, against the torch reference path (same roundings).

One C source serves every variant: the compiler vectorises its loops for the
variant's ``-march`` (8-wide AVX2 / 16-wide AVX-512, expf from glibc's
vector math library), so each variant is built and run here explicitly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.layers import cpu_build, fused_cpu
from tokenmill.model.layers.mlp import SwiGLUMLP
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(fused_cpu.load() is None, reason="no C compiler for the fused CPU kernels")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, params=[
    pytest.param(i, id=i, marks=pytest.mark.skipif(not cpu_build.isa_supported(i),
                                                    reason=f"this CPU cannot run the {i} variant"))
    for i in cpu_build.ISAS])
def isa(request, monkeypatch):
    """Run each test on one kernel variant (avx512: -march=x86-64-v4, avx2: -march=x86-64-v3, scalar)."""
    orig = fused_cpu.load
    monkeypatch.setattr(fused_cpu, "load", lambda isa=None: orig(request.param))
    assert fused_cpu.load() is not None
    return request.param


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal to summation order; bfloat16: equal but for rare 1-ulp rounding flips."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
        assert (got != want).float().mean().item() < 0.01


@pytest.fixture
def torch_path(monkeypatch):
    """Call to get the reference: the same module with the fused kernels switched off."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(fused_cpu, "usable", lambda *a: False)
            return fn()
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 576), (300, 96)])   # 300 x 96 takes the OpenMP path
def test_rms_norm(dtype, rows, n, torch_path):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
    norm = norm.to(dtype)
    x = (3 * torch.randn(rows, n, generator=g)).to(dtype)
    r = torch.randn(rows, n, generator=g).to(dtype)
    with torch.inference_mode():
        assert fused_cpu.usable(x, norm.weight)
        close(norm(x), torch_path(lambda: norm(x)))
        (out, h), (want_out, want_h) = norm(x, r), torch_path(lambda: norm(x, r))
        close(out, want_out)
        assert torch.equal(h, want_h)                     # the residual sum rounds identically
        x3 = x.view(rows, 1, n)                           # leading dims (Qwen3's per-head q/k norm)
        close(norm(x3), torch_path(lambda: norm(x3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(9, 3, 64, 64), (4, 2, 32, 16)])
def test_rope_in_place_on_fused_qkv_rows(dtype, heads, kv_heads, head_dim, rotary_dim, torch_path):
    g = torch.Generator().manual_seed(head_dim)
    t = 13
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    rope = RotaryEmbedding(head_dim, 10000.0, rotary_dim=rotary_dim)
    cos, sin = rope.cos_sin(torch.arange(100, 100 + t), dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    want_q = RotaryEmbedding.apply(qkv[:, :q_size].reshape(t, heads, head_dim), cos, sin)
    want_k = RotaryEmbedding.apply(qkv[:, q_size:q_size + kv_size].reshape(t, kv_heads, head_dim), cos, sin)
    v_before = qkv[:, q_size + kv_size:].clone()
    fused_cpu.rope_(qkv, heads + kv_heads, head_dim, cos, sin)
    close(qkv[:, :q_size].reshape(t, heads, head_dim), want_q)
    close(qkv[:, q_size:q_size + kv_size].reshape(t, kv_heads, head_dim), want_k)
    assert torch.equal(qkv[:, q_size + kv_size:], v_before)          # v untouched


def test_rope_rejects_bad_layout():
    x = torch.randn(4, 64).t()                                        # last dim not contiguous
    cos = torch.ones(64, 1, 16)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused_cpu.rope_(x, 1, 16, cos, cos)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_mlp(dtype, rows, torch_path):
    g = torch.Generator().manual_seed(rows)
    mlp = SwiGLUMLP(48, 1000)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    mlp = mlp.to(dtype)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    with torch.inference_mode():
        gu = mlp.gate_up_proj(x)
        gate, up = gu.split(1000, dim=-1)
        close(fused_cpu.silu_mul(gu), F.silu(gate) * up)
        close(mlp(x), torch_path(lambda: mlp(x)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_saturates_for_large_gates(dtype):
    """Gates far below -88.7 (where expf(-g) overflows float32) give silu = -0, never NaN: under
    -ffast-math the compiler may divide by 1 + inf with a reciprocal approximation whose Newton step
    makes NaN (seen as NaN logits with a large LoRA adapter: gate rows near -190)."""
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.linspace(-400, 400, 801), torch.full((63,), -190.0)])
    up = torch.randn(gate.numel(), generator=g)
    gu = torch.cat([gate, up]).reshape(1, -1).to(dtype)
    with torch.inference_mode():
        got = fused_cpu.silu_mul(gu)
        gate_, up_ = gu.split(gate.numel(), dim=-1)
        want = F.silu(gate_) * up_
    assert torch.isfinite(got).all()
    close(got, want)


def test_not_used_under_autograd_or_for_other_dtypes():
    w = torch.ones(8, requires_grad=True)
    x = torch.randn(2, 8)
    assert not fused_cpu.usable(x, w)                                 # training-style call keeps torch ops
    assert not fused_cpu.usable(x.half(), w.detach().half())
    with torch.no_grad():
        assert fused_cpu.usable(x, w)


def _argmax_cases() -> list[torch.Tensor]:
    """Rows the sampler's argmax must answer as torch does: ties (the lowest index wins) inside a vector, across
    the 8-lane and 32-element blocks and in the scalar tail, -0.0 tied with +0.0, rows of only -inf, +inf
    maxima, NaN (first, last, several, a whole row), lengths around the vector widths, a real vocabulary."""
    g = torch.Generator().manual_seed(0)
    inf, nan = float("inf"), float("nan")
    out = []
    for rows, n in [(1, 1), (1, 5), (3, 8), (2, 16), (4, 17), (5, 31), (3, 32), (7, 33), (2, 95), (3, 1000),
                    (2, 49152)]:
        x = torch.randn(rows, n, generator=g)
        out += [x, x.round(), torch.randint(0, 3, (rows, n), generator=g).float(), torch.full((rows, n), 1.0),
                torch.full((rows, n), -inf), torch.full((rows, n), -1e30), torch.full((rows, n), nan)]
        z = torch.zeros(rows, n)
        z[:, n // 2:] = -0.0
        out += [z, -z.flip(1)]           # +0.0 then -0.0, and -0.0 then +0.0
        y = x.clone()
        y[:, -1] = y.max() + 1           # the maximum in the last element (the tail, when there is one)
        out.append(y)
        y = x.clone()
        y[:, n // 3] = inf
        y[:, -1] = inf
        out.append(y)
        y = x.clone()
        y[0, n // 2] = nan
        y[-1, 0] = nan
        y[-1, -1] = nan
        out.append(y)
        if n >= 40:                      # the same maximum in several lanes and blocks: the first one wins
            y = x.clone()
            for j in (n - 1, 37, 9, n // 2):
                y[:, j] = 7.5
            out.append(y)
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_equals_torch_argmax(threads):
    """ids == torch.argmax(dim=-1) and best == the values there, bit for bit, on every variant; row-strided
    input (a slice of wider rows) too."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in _argmax_cases():
            for t in (x, x[:, 1:]) if x.shape[1] > 1 else (x,):
                ids, best = fused_cpu.argmax_rows(t)
                want = t.argmax(dim=-1)
                assert torch.equal(ids, want), (t.shape, ids, want)
                want_v = t.gather(1, want.unsqueeze(1)).squeeze(1)
                assert torch.equal(best.view(torch.int32), want_v.view(torch.int32))
        big = torch.randn(70, 3000, generator=torch.Generator().manual_seed(1)).round()  # the OpenMP split
        assert torch.equal(fused_cpu.argmax_rows(big)[0], big.argmax(dim=-1))
    finally:
        torch.set_num_threads(old)


def test_argmax_rows_declines_what_it_cannot_serve():
    x = torch.randn(3, 40)
    assert fused_cpu.argmax_rows(x.to(torch.bfloat16)) is None
    assert fused_cpu.argmax_rows(x.t()) is None                 # strided last dimension
    assert fused_cpu.argmax_rows(x[0]) is None                  # not 2-D
    assert fused_cpu.argmax_rows(torch.empty(2, 0)) is None
    ids, best = fused_cpu.argmax_rows(torch.empty(0, 5))
    assert ids.shape == best.shape == (0,)
