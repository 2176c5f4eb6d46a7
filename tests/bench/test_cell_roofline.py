"""benchmarks/cell_roofline.py: the chunked-prefill replay of a benchmark cell and its bound."""

from __future__ import annotations

import pytest

from tests.bench.benchmark_module import load_benchmark

cr = load_benchmark("cell_roofline")


@pytest.mark.parametrize("n,ilen,olen,conc,budget", [(64, 256, 128, 64, 2048), (4, 256, 128, 1, 2048),
                                                     (10, 100, 7, 4, 64), (3, 5, 1, 3, 3)])
def test_schedule_conserves_tokens_and_respects_budget(n, ilen, olen, conc, budget):
    steps = cr.schedule_cell(n, ilen, olen, conc, budget)
    assert sum(sum(ql) for ql, _, _ in steps) == n * ilen + n * (olen - 1)   # prompts + decodes after the first
    assert sum(rows for _, _, rows in steps) == n * olen                       # one sampled row per output token
    for ql, ctx, rows in steps:
        assert sum(ql) <= budget and len(ql) <= conc and rows <= len(ql)
        assert all(c >= 0 for c in ctx)


def test_schedule_shape_of_the_quick_c64_cell():
    steps = cr.schedule_cell(64, 256, 128, 64, 2048)
    mixed = [s for s in steps if any(q > 1 for q in s[0])]
    # 16,384 prompt tokens at 2,048 a step, less the decodes riding along: 9 prefill-carrying steps
    assert len(mixed) == 9
    assert steps[0][0] == [256] * 8 and steps[0][2] == 8
    assert steps[-1][0] == [1] * len(steps[-1][0])
    # a decode's context is the prompt plus the tokens before it
    assert max(c for ql, ctx, _ in steps for q, c in zip(ql, ctx) if q == 1) == 256 + 128 - 2


def test_cell_bound_scales_with_the_rates():
    from tokenmill.model.checkpoint import load_arch_config
    from tokenmill.model.default_model import default_model_path

    arch = load_arch_config(default_model_path())
    slow = cr.cell_bound(arch, cr.Rates(20.0, 300.0, 150.0), 8, 64, 8, 8, 256)
    fast = cr.cell_bound(arch, cr.Rates(20.0, 600.0, 150.0), 8, 64, 8, 8, 256)
    assert fast["wall_s"] < slow["wall_s"]
    assert slow["output_tok_s"] == pytest.approx(8 * 8 / slow["wall_s"])
    assert slow["mixed_s"] + slow["decode_s"] == pytest.approx(slow["wall_s"])
    with pytest.raises(ValueError):
        cr.schedule_cell(4, 16, 4, 8, 4)


def test_kv_bytes_follow_the_cache_not_the_model_dtype():
    """A float32 model's default cache on the CPU low-bit path is bfloat16: the bounds must charge 2 bytes per
    K/V element, not the model's 4 (the bound was half as strict on the attention's reads before)."""
    from tokenmill.model.checkpoint import load_arch_config
    from tokenmill.model.default_model import default_model_path

    rl = load_benchmark("roofline")
    arch = load_arch_config(default_model_path())
    ql, ctx = [1] * 64, [256] * 64
    f32 = rl.step_cost_parts(arch, 4, ql, ctx, sample_rows=64, int4_linear=True)
    bf16 = rl.step_cost_parts(arch, 4, ql, ctx, sample_rows=64, int4_linear=True, kv_bytes=2)
    kv_tok = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    assert f32["attention"][0] == 2 * bf16["attention"][0] == 4 * kv_tok * (64 * 257 + 64)
    assert f32["linear"] == bf16["linear"] and f32["attention"][1] == bf16["attention"][1]
    # B=1 is bandwidth-bound: the smaller cache lowers the cell's bound time
    rates = cr.Rates(20.0, 300.0, 150.0)
    assert cr.cell_bound(arch, rates, 2, 256, 16, 1, 2048, kv_bytes=2)["wall_s"] < \
        cr.cell_bound(arch, rates, 2, 256, 16, 1, 2048)["wall_s"]
