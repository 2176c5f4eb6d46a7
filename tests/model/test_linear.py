"""oneDNN-prepacked linear layers: same results as F.linear, packed by the runner, switchable off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers.linear import PackedLinear, pack_linear_weights, packed_linear_available
from tokenmill.model.loader import build_model_from_config

from .conftest import tiny_arch

pytestmark = pytest.mark.skipif(not packed_linear_available("cpu", torch.float32),
                                reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 32, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(rows, 24, generator=g)
    got = PackedLinear(w, b)(x)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_bfloat16():
    if not packed_linear_available("cpu", torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 on this CPU")
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(5, 32).bfloat16()
    torch.testing.assert_close(PackedLinear(w)(x).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


def test_packed_linear_rejects_bad_weights():
    with pytest.raises(ValueError, match="2-D CPU float32/bfloat16"):
        PackedLinear(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="2-D CPU float32/bfloat16"):
        PackedLinear(torch.randn(4, 4).half())


@pytest.mark.parametrize("tied", [True, False])
def test_pack_model_keeps_outputs(tied):
    from tokenmill.model.layers.attention import build_attention_metadata

    arch = tiny_arch("qwen2", tie_word_embeddings=tied)          # qkv bias exercises the packed bias
    model = build_model_from_config(arch, seed=1)
    ids = torch.arange(3, 12)
    caches = lambda: [torch.zeros(2, 8, 4, arch.num_key_value_heads, arch.head_dim)  # noqa: E731
                      for _ in range(arch.num_hidden_layers)]
    md, pos = build_attention_metadata([0], [len(ids)], [[0, 1, 2]], 4)
    with torch.inference_mode():
        want = model.compute_logits(model(ids, pos, caches(), md))
        n = pack_linear_weights(model)
        got = model.compute_logits(model(ids, pos, caches(), md))
    linears_per_layer = 4            # qkv, o, gate_up, down
    assert n == arch.num_hidden_layers * linears_per_layer + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_switch_off(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_PACKED_LINEAR", "0")
    model = build_model_from_config(tiny_arch("llama"), seed=1)
    assert pack_linear_weights(model) == 0
    assert any(type(m) is nn.Linear for m in model.modules())


def test_runner_packs_eager_model_and_only_the_head_when_compiled():
    from tokenmill.config import EngineConfig
    from tokenmill.model.runner import ModelRunner

    arch = tiny_arch("llama", max_position_embeddings=64)
    cfg = EngineConfig.from_kwargs(num_kv_blocks=8, block_size=4, max_model_len=64, max_num_seqs=2,
                                   max_num_batched_tokens=16)
    model = build_model_from_config(arch, seed=2)
    r = ModelRunner(model, arch, cfg, torch.device("cpu"), torch.float32, [2])
    assert r.num_packed_linear == arch.num_hidden_layers * 4 + 1
    model = build_model_from_config(arch, seed=2)
    r = ModelRunner(model, arch, cfg.replace(enforce_eager=False, compile_sizes=""), torch.device("cpu"),
                    torch.float32, [2])
    assert r.num_packed_linear == 1 and isinstance(model._logits_head, PackedLinear)


def q4_weight(n: int, k: int, seed: int = 0):
    from tokenmill.quantization.lowbit import LowBitWeight

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    zero = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1
    w = LowBitWeight.from_codes(codes, scale, zero, 4, fmt="Q4_1")
    return w, w.dequantize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_lowbit_path_matches_the_dense_layer_up_to_its_row_limit(bias, dtype):
    from tokenmill.quantization.lowbit import kernel_available

    if not packed_linear_available("cpu", dtype) or not kernel_available():
        pytest.skip("no oneDNN for this dtype or no low-bit kernel on this machine")
    w, dense = q4_weight(48, 64)
    b = torch.randn(48).to(dtype) if bias else None
    lin = PackedLinear(dense.to(dtype), b)
    plain = PackedLinear(dense.to(dtype), b)
    assert lin.attach_lowbit(w, max_rows=4) == w.nbytes and "Q4_1 codes for rows<=4" in repr(lin)
    for rows in (1, 4):
        x = torch.randn(rows, 64).to(dtype)
        want = F.linear(x.float(), dense, None if b is None else b.float())   # the exact codes, float32 sums
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(lin(x).float(), want, rtol=tol, atol=tol)
    x = torch.randn(5, 64).to(dtype)
    assert torch.equal(lin(x), plain(x))                  # above the limit: the dense oneDNN GEMM


def test_integer_lowbit_path_serves_rows_between_the_two_limits():
    """Rows above the float32 low-bit limit and up to i8_max_rows run the integer path (int8 activations,
    within its stated tolerance of the exact codes' product); larger inputs the dense oneDNN GEMM."""
    from tokenmill.quantization.lowbit import kernel_available

    if not packed_linear_available("cpu", torch.float32) or not kernel_available():
        pytest.skip("no oneDNN or no low-bit kernel on this machine")
    w, dense = q4_weight(48, 64)
    b = torch.randn(48)
    lin, plain = PackedLinear(dense, b), PackedLinear(dense, b)
    lin.attach_lowbit(w, max_rows=4, i8_max_rows=16)
    assert lin.lowbit_i8_max_rows == 16 and "int8 activations x Q4_1 codes for rows<=16" in repr(lin)
    for rows in (5, 16):
        x = torch.randn(rows, 64)
        want = F.linear(x, dense, b)
        got = lin(x)
        assert not torch.equal(got, plain(x))                 # not the dense GEMM
        assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()
    x = torch.randn(17, 64)
    assert torch.equal(lin(x), plain(x))                      # above both limits: the dense oneDNN GEMM
    lin.attach_lowbit(w, max_rows=4, i8_max_rows=0)           # 0: off
    assert lin.lowbit_i8_max_rows == 0 and torch.equal(lin(torch.randn(5, 64)) * 0, plain(torch.randn(5, 64)) * 0)


@pytest.mark.parametrize("bias", [False, True])
def test_plain_bfloat16_layer_runs_f_linear_and_the_codes(bias):
    """``onednn=False`` (a bfloat16 weight where oneDNN has no bfloat16): nothing is packed, the dense path is
    ``F.linear`` bit for bit, and attached codes serve every row count in batch-invariant mode with the same
    bits as a oneDNN-packed layer carrying the same codes (the codes' kernel does not depend on the wrapper)."""
    from tokenmill.quantization.lowbit import kernel_available

    if not kernel_available():
        pytest.skip("no low-bit kernel on this machine")
    w, dense = q4_weight(48, 64)
    b = torch.randn(48).bfloat16() if bias else None
    lin = PackedLinear(dense.bfloat16(), b, onednn=False)
    assert lin.packed_weight is None and "plain (no oneDNN bfloat16)" in repr(lin)
    with pytest.raises(RuntimeError, match="plain weight"):
        lin.ensure_packed()
    x = torch.randn(7, 64).bfloat16()
    assert torch.equal(lin(x), F.linear(x, dense.bfloat16(), b))
    lin.attach_lowbit(w, max_rows=8, invariant=True, invariant_kernel="int8")
    ref = PackedLinear(dense, None if b is None else b.float(), defer=True)   # float32 host, same codes
    ref.attach_lowbit(w, max_rows=8, invariant=True, invariant_kernel="int8")
    assert all(lin.lowbit_path(m) == "i8" for m in (1, 9, 600))
    from tokenmill.quantization.lowbit import lowbit_linear

    for rows in (1, 9, 40):
        x = torch.randn(rows, 64).bfloat16()
        got = lin(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, lowbit_linear(x, w, lin.bias, int8_act=True))
        # bfloat16 rows are widened exactly: the float32 host gives the same sums, rounded once to bfloat16
        assert torch.equal(got, ref(x.float()).bfloat16())
        assert (got.float() - F.linear(x.float(), dense, None if b is None else b.float())).abs().max() <= \
            3e-2 * max(1.0, got.float().abs().max().item())


def test_pack_linear_weights_wraps_bfloat16_plainly_where_onednn_has_none(monkeypatch):
    """Where oneDNN has no bfloat16 (simulated on a CPU that has it), a bfloat16 model's linears are wrapped
    with their plain weights (outputs bit-equal to the plain model), so the runner can attach low-bit codes."""
    from tokenmill.model.layers import linear
    from tokenmill.model.layers.attention import build_attention_metadata

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not packed_linear_available("cpu", torch.bfloat16) and linear.plain_bf16_wrap("cpu", torch.bfloat16)
    assert not linear.plain_bf16_wrap("cpu", torch.float32)
    arch = tiny_arch("llama", tie_word_embeddings=True)
    model = build_model_from_config(arch, seed=1).to(torch.bfloat16)
    ids = torch.arange(3, 12)
    caches = lambda: [torch.zeros(2, 8, 4, arch.num_key_value_heads, arch.head_dim, dtype=torch.bfloat16)  # noqa: E731
                      for _ in range(arch.num_hidden_layers)]
    md, pos = build_attention_metadata([0], [len(ids)], [[0, 1, 2]], 4)
    with torch.inference_mode():
        want = model.compute_logits(model(ids, pos, caches(), md))
        n = pack_linear_weights(model, background=True)
        got = model.compute_logits(model(ids, pos, caches(), md))
    assert n == arch.num_hidden_layers * 4 + 1
    wrapped = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(wrapped) == n and not any(m.onednn or m.packed_weight is not None for m in wrapped)
    assert torch.equal(got, want)
    monkeypatch.setenv("TOKENMILL_CPU_PACKED_LINEAR", "0")
    assert pack_linear_weights(build_model_from_config(arch, seed=1).to(torch.bfloat16)) == 0


def test_int8_act_limit_from_env(monkeypatch):
    from tokenmill.model.layers.cpu_build import cpu_isa
    from tokenmill.model.layers.linear import INT8_ACT_AUTO, int8_act_max_tokens

    monkeypatch.setenv("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "auto")
    assert int8_act_max_tokens(8) == INT8_ACT_AUTO[cpu_isa()]
    assert int8_act_max_tokens(0) == 0                        # the low-bit path off: the integer path too
    monkeypatch.setenv("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "64")
    assert int8_act_max_tokens(8) == 64
    monkeypatch.setenv("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "-3")
    with pytest.raises(ValueError, match="non-negative"):
        int8_act_max_tokens(8)


def test_lowbit_attach_rejects_mismatched_shapes_and_bad_limits(monkeypatch):
    from tokenmill.model.layers.linear import lowbit_max_tokens

    w, dense = q4_weight(16, 64)
    with pytest.raises(ValueError, match="does not fit"):
        PackedLinear(dense[:, :32].contiguous()).attach_lowbit(w, 8)
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "-1")
    with pytest.raises(ValueError, match="non-negative"):
        lowbit_max_tokens("cpu", torch.float32)
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "0")
    assert lowbit_max_tokens("cpu", torch.float32) == 0


def test_attach_lowbit_weights_serves_a_tied_head_and_counts_bytes_per_format():
    from tokenmill.model.layers.linear import attach_lowbit_weights

    model = nn.Module()
    w, dense = q4_weight(48, 64)
    head_w, head_dense = q4_weight(32, 64, seed=1)
    model.proj, model._logits_head = PackedLinear(dense), PackedLinear(head_dense)
    count, by_fmt = attach_lowbit_weights(model, {"proj": w, "model.embed_tokens": head_w, "absent": w}, 8)
    assert count == 2 and by_fmt == {"Q4_1": w.nbytes + head_w.nbytes}
    assert model._logits_head.lowbit is head_w and model.proj.lowbit_max_rows == 8


def test_background_packing_gives_the_synchronous_results():
    """Packing in the background thread, or on the spot when a layer is needed first, gives the same outputs
    as packing before the first step (the result never depends on the timing)."""
    import threading

    from tokenmill.model.layers import linear
    from tokenmill.model.layers.attention import build_attention_metadata
    from tokenmill.model.layers.linear import wait_for_packing

    arch = tiny_arch("qwen2")
    ids = torch.arange(3, 12)
    caches = lambda: [torch.zeros(2, 8, 4, arch.num_key_value_heads, arch.head_dim)  # noqa: E731
                      for _ in range(arch.num_hidden_layers)]
    md, pos = build_attention_metadata([0], [len(ids)], [[0, 1, 2]], 4)
    sync = build_model_from_config(arch, seed=1)
    pack_linear_weights(sync)
    with torch.inference_mode():
        want = sync.compute_logits(sync(ids, pos, caches(), md))
    # the step runs while the thread is held back: every layer is packed on the spot by the step itself
    held = build_model_from_config(arch, seed=1)
    with linear._PACK_LOCK:
        n = pack_linear_weights(held, background=True)
        assert any(m.packed_weight is None for m in held.modules() if isinstance(m, PackedLinear))
        results = []
        t = threading.Thread(target=lambda: results.append(held.compute_logits(held(ids, pos, caches(), md))))
        with torch.inference_mode():
            t.start()
            t.join(0.2)                   # blocked on the lock the packer needs too
    t.join(30)
    assert n == arch.num_hidden_layers * 4 + 1 and len(results) == 1
    assert torch.equal(results[0], want)
    assert wait_for_packing(held, 30)
    assert all(m.packed_weight is not None and m.weight_unpacked is None
               for m in held.modules() if isinstance(m, PackedLinear))
    with torch.inference_mode():
        assert torch.equal(held.compute_logits(held(ids, pos, caches(), md)), want)
