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
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    zero = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1
    dense = ((codes.float() - 8).view(n, -1, 32) * scale[..., None] + zero[..., None]).view(n, k)
    return codes, scale, zero, dense


@pytest.mark.parametrize("bias", [False, True])
def test_int4_path_matches_the_dense_layer_up_to_its_row_limit(bias):
    if not packed_linear_available("cpu", torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 on this CPU")
    codes, scale, zero, dense = q4_weight(48, 64)
    b = torch.randn(48).bfloat16() if bias else None
    lin = PackedLinear(dense.bfloat16(), b)
    plain = PackedLinear(dense.bfloat16(), b)
    nbytes = lin.attach_int4(codes, scale, zero, 32, max_rows=4)
    assert nbytes == 48 * 64 // 2 + 2 * 2 * 48 * 64 // 32 and "int4 rows<=4" in repr(lin)
    for rows in (1, 4):
        x = torch.randn(rows, 64).bfloat16()
        want = F.linear(x.float(), dense, None if b is None else b.float())
        torch.testing.assert_close(lin(x).float(), want, rtol=3e-2, atol=3e-2)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(lin(x), plain(x))                  # above the limit: the dense oneDNN GEMM


def test_int4_attach_rejects_float32_and_mismatched_codes(monkeypatch):
    from tokenmill.model.layers.linear import int4_max_tokens

    codes, scale, zero, dense = q4_weight(16, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        PackedLinear(dense).attach_int4(codes, scale, zero, 32, 8)
    if packed_linear_available("cpu", torch.bfloat16):
        with pytest.raises(ValueError, match="do not fit"):
            PackedLinear(dense.bfloat16()).attach_int4(codes[:8], scale, zero, 32, 8)
    assert int4_max_tokens("cpu", torch.float32) == 0
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "-1")
    with pytest.raises(ValueError, match="non-negative"):
        int4_max_tokens("cpu", torch.bfloat16)
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "0")
    assert int4_max_tokens("cpu", torch.bfloat16) == 0


def test_int4_is_skipped_for_output_sizes_the_packing_cannot_take():
    """torch's int4 CPU packing needs out_features % 16 == 0 (an untied head over a 32001 vocabulary is not)."""
    from tokenmill.model.layers.linear import attach_int4_weights

    if not packed_linear_available("cpu", torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 on this CPU")
    model = nn.Module()
    _, _, _, dense_ok = q4_weight(48, 64)
    codes, scale, zero, dense_odd = q4_weight(40, 64)
    model.ok, model.odd = PackedLinear(dense_ok.bfloat16()), PackedLinear(dense_odd.bfloat16())
    with pytest.raises(ValueError, match="divisible by 16"):
        PackedLinear(dense_odd.bfloat16()).attach_int4(codes, scale, zero, 32, 8)
    count, _ = attach_int4_weights(model, {"ok": q4_weight(48, 64)[:3], "odd": (codes, scale, zero)}, 32, 8)
    assert count == 1 and model.ok.int4_max_rows == 8 and model.odd.int4_max_rows == 0
