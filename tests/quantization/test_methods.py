"""--quantization int8 / w8a8 / int4 on a tiny random checkpoint: round-trip bounds, logits vs the float reference."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.model.loader import load_model
from tokenmill.quantization.lowbit import cpu_flags
from tokenmill.quantization.methods import (VNNI_FLAGS, Int8DynamicLinear, QuantizedLinear, check_method,
                                            quantize_int4, quantize_int8, weight_bytes_by_format)
from tests.model.conftest import PagedRunner, tiny_arch
from tests.quantization.conftest import hf_tensors

HAS_VNNI = any(f in cpu_flags() for f in VNNI_FLAGS)


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(40, 96) * 0.3
    lw = quantize_int8(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((lw.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert lw.bits == 8 and lw.group == 96 and lw.min is None


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group):
    w = torch.randn(40, 256) * 0.3
    lw = quantize_int4(w, group)
    g = w.reshape(40, -1, group)
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(group, 1)
    assert ((lw.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert lw.fmt == f"int4-g{group}" and int(lw.unpacked_codes().max()) <= 15
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(torch.randn(16, 96), 64)


def test_w8a8_product_within_the_bound_of_both_roundings():
    """w8a8's result against the float product: each weight is off by at most half its channel's step
    (max|w_n| / 254) and each activation by half its token's step (max|x_m| / 254), so
    |y - x·wᵀ| <= sum_k |x_k| dw/2 + |w_k| dx/2 + dx dw / 4 per output (float32 rescale error aside)."""
    if not HAS_VNNI:
        pytest.skip("this CPU has no VNNI: w8a8 is refused at start-up")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = torch.randn(7, 256, generator=g) * torch.tensor([1.0, 3.0, 0.1, 10.0, 1.0, 1.0, 0.5])[:, None]
    lin = Int8DynamicLinear(w)
    got = lin(x)
    dw = (w.abs().amax(1) / 127)[None, :]                       # [1, N] per output channel
    dx = (x.abs().amax(1) / 127)[:, None]                       # [M, 1] per token
    bound = x.abs().sum(1, keepdim=True) * dw / 2 + dx / 2 * w.abs().sum(1)[None, :] + dx * dw / 4 * 256
    err = (got - x @ w.t()).abs()
    assert (err <= bound * 1.001 + 1e-5).all(), float((err / bound).max())
    assert err.max() > 0                                        # really quantised


def _logits(lm, ids):
    return PagedRunner(lm.model, lm.arch).step([("r", ids)])


# Tolerance of a quantised model's logits against the float32 reference, as a share of the reference logits'
# largest magnitude (the tiny model's weights are N(0, 0.1²), so these bound the whole-model error):
LOGIT_TOL = {"int8": 0.02, "w8a8": 0.05, "int4": 0.15}


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantised_model_logits_stay_near_the_float_reference(method, dtype, tiny_checkpoint, monkeypatch):
    if method == "w8a8" and not HAS_VNNI:
        pytest.skip("this CPU has no VNNI: w8a8 is refused at start-up (tested below)")
    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", "32")
    path = tiny_checkpoint()
    ref = load_model(path, dtype="float32", with_tokenizer=False)
    q = load_model(path, dtype=dtype, with_tokenizer=False, quantization=method)
    assert q.quantization == method
    kinds = {type(m) for m in q.model.modules()}
    assert torch.nn.Linear not in kinds
    assert (Int8DynamicLinear if method == "w8a8" else QuantizedLinear) in kinds
    assert isinstance(q.model._logits_head, QuantizedLinear) and q.model._logits_head.weight_codes.fmt == "int8"
    ids = [3, 9, 4, 11, 50, 60, 7, 8, 1, 2, 30, 77, 5]
    want = _logits(ref, ids)
    got = _logits(q, ids).float()
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= LOGIT_TOL[method] + (0.02 if dtype == "bfloat16" else 0), err
    assert err > 0                                          # really quantised
    fm = weight_bytes_by_format(q.model)
    dense_linear = sum(v.numel() for k, v in hf_tensors().items() if "proj" in k) * 4
    low = sum(v for k, v in fm.items() if k.startswith(("int", "w8")))
    assert low < dense_linear / (2.5 if method != "int4" else 4)


def test_large_steps_use_the_dense_fallback_with_the_same_result():
    from tokenmill.quantization.methods import DENSE_ABOVE_ROWS

    lw = quantize_int4(torch.randn(48, 128), 32)
    lin = QuantizedLinear(lw, torch.randn(48))
    x = torch.randn(DENSE_ABOVE_ROWS + 5, 128)
    small = torch.cat([lin(x[i:i + 8]) for i in range(0, x.shape[0], 8)])
    torch.testing.assert_close(lin(x), small, rtol=1e-4, atol=1e-4)


def test_bad_combinations_fail_at_start_up(tiny_checkpoint, monkeypatch):
    with pytest.raises(ValueError, match="unknown quantization 'fp3'"):
        check_method("fp3", "cpu")
    path = tiny_checkpoint()
    with pytest.raises(ValueError, match="needs a checkpoint with a awq quantization_config"):
        load_model(path, with_tokenizer=False, quantization="awq")
    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", "30")
    with pytest.raises(ValueError, match="multiple of 4 from 32 to 128"):
        load_model(path, with_tokenizer=False, quantization="int4")
    monkeypatch.delenv("TOKENMILL_INT4_GROUP_SIZE")
    import tokenmill.quantization.methods as methods

    monkeypatch.setattr(methods, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with pytest.raises(ValueError, match="w8a8 needs int8 dot-product instructions"):
        load_model(path, with_tokenizer=False, quantization="w8a8")
    check_method("w8a8", "cuda")                            # CUDA has int8 GEMMs


def test_cli_refuses_w8a8_without_vnni_in_one_line(monkeypatch, capsys):
    import tokenmill.quantization.methods as methods
    from tokenmill import cli

    monkeypatch.setattr(methods, "cpu_flags", lambda: frozenset({"avx2"}))
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--quantization", "w8a8", "--device", "cpu"])
    assert cli._config_or_exit(args, "generate") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "w8a8 needs int8 dot-product instructions" in err[0]


def test_cli_refuses_model_mismatches_in_one_line(tmp_path, capsys):
    """int4 on a model whose layers no group divides, awq on a dense checkpoint, int8 on an AWQ checkpoint, a
    missing path: one line from the CLI before any process starts (the config is read, never the weights)."""
    import tests.quantization.conftest as c
    from tokenmill import cli

    dense = c.write_checkpoint(tmp_path / "dense", c.hf_tensors())
    awq = c.write_checkpoint(tmp_path / "awq", c.hf_tensors(),
                             {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"})
    (tmp_path / "odd").mkdir()
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    cfg.update(hidden_size=48, head_dim=12)                 # 48 inputs: no int4 group of 32..128 divides them
    (tmp_path / "odd" / "config.json").write_text(json.dumps(cfg))
    cases = [(str(tmp_path / "odd"), "int4", "int4 needs layers whose inputs are a multiple of 32"),
             (dense, "awq", "needs a checkpoint with a awq quantization_config"),
             (awq, "int8", "is a awq checkpoint; --quantization int8 cannot apply"),
             (awq, "gptq", "has a awq one"),
             (str(tmp_path / "missing"), "int4", "does not exist")]
    parser = cli.build_parser()
    for path, method, msg in cases:
        args = parser.parse_args(["serve", path, "--quantization", method, "--device", "cpu"])
        assert cli._config_or_exit(args, "serve") is None, (path, method)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (method, err)
    ok = parser.parse_args(["serve", awq, "--quantization", "awq", "--device", "cpu"])
    assert cli._config_or_exit(ok, "serve") is not None


def test_int4_default_group_is_32_and_a_larger_one_falls_back_where_it_does_not_divide(monkeypatch):
    from tokenmill.quantization.methods import int4_group_for

    monkeypatch.delenv("TOKENMILL_INT4_GROUP_SIZE", raising=False)
    assert (int4_group_for(1536), int4_group_for(576), int4_group_for(96)) == (32, 32, 32)
    with pytest.raises(ValueError, match="needs layers whose inputs are a multiple of 32"):
        int4_group_for(100)
    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", "128")
    assert (int4_group_for(1536), int4_group_for(576), int4_group_for(96)) == (128, 64, 32)
    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", "96")
    assert (int4_group_for(1536), int4_group_for(576), int4_group_for(64), int4_group_for(160)) == (96, 96, 64, 32)
    with pytest.raises(ValueError, match="needs layers whose inputs are a multiple of 32"):
        int4_group_for(100)


# SmolLM2-135M's layer shapes (inputs 576 and 1536) at every group the default or TOKENMILL_INT4_GROUP_SIZE
# gives them, through the C kernel (each row-count specialisation, and the dense path above 64 rows): a scale
# or minimum read from the wrong group, or a group-128 layout that differs from group 64's, fails here.
@pytest.mark.parametrize("k,group", [(576, 32), (576, 64), (1536, 32), (1536, 64), (1536, 128)])
def test_int4_round_trip_and_kernel_at_the_real_shapes(k, group):
    from tokenmill.quantization.methods import DENSE_ABOVE_ROWS

    g = torch.Generator().manual_seed(k + group)
    w = torch.randn(40, k, generator=g) * 0.05 + torch.randn(40, 1, generator=g) * 0.02   # per-row offsets
    lw = quantize_int4(w, group)
    assert lw.group == group
    d = lw.dequantize()
    gw = w.reshape(40, -1, group)
    step = ((gw.amax(-1) - gw.amin(-1)) / 15).repeat_interleave(group, 1)
    assert ((d - w).abs() <= step / 2 + 1e-6).all()
    # each group's own minimum and maximum are on the grid (the zero point is the group's minimum)
    assert torch.allclose(d.reshape(40, -1, group).amin(-1), gw.amin(-1), atol=1e-6)
    assert torch.allclose(d.reshape(40, -1, group).amax(-1), gw.amax(-1), atol=1e-5)
    # RMS error of round-to-nearest with a uniform step: about step / sqrt(12), never far above it
    rms = (d - w).pow(2).mean().sqrt()
    assert rms <= 1.2 * (step.pow(2).mean() / 12).sqrt()
    lin = QuantizedLinear(lw, torch.randn(40, generator=g))
    for m in (1, 3, 8, 9, DENSE_ABOVE_ROWS + 3):
        x = torch.randn(m, k, generator=g)
        want = x @ d.t() + lin.bias
        torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


# Relative error ||logits - ref|| / ||ref|| of the 2-layer, 128-wide random model (N(0, 0.1²) weights: every
# layer's rounding error is ~8-10% of its weight, compounded over 14 matmuls; measured 2026-12-01 on seeds 3/4:
# groups 32 0.24/0.23, 64 0.26/0.29, 128 0.32/0.32, int8 0.02). A scale or minimum read from the wrong group
# gives errors of 1 and more.
INT4_GROUP_TOL = {"32": 0.30, "64": 0.35, "128": 0.40}


@pytest.mark.parametrize("group", ["32", "64", "128"])
def test_int4_logits_within_tolerance_for_each_group(group, tmp_path, monkeypatch):
    from tests.quantization.conftest import write_checkpoint

    # a wider tiny model than the fixture's, so that every layer takes the group asked for (inputs 128 / 256)
    import tests.quantization.conftest as c

    monkeypatch.setattr(c, "H", 128)
    monkeypatch.setattr(c, "FFN", 256)
    monkeypatch.setattr(c, "HD", 32)
    path = write_checkpoint(tmp_path / "wide", c.hf_tensors(seed=3))
    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", group)
    ref = load_model(path, dtype="float32", with_tokenizer=False)
    q = load_model(path, dtype="float32", with_tokenizer=False, quantization="int4")
    groups = {m.weight_codes.group for m in q.model.modules()
              if isinstance(m, QuantizedLinear) and m.weight_codes.fmt.startswith("int4")}
    assert groups == {int(group)}
    ids = [3, 9, 4, 11, 50, 60, 7, 8, 1, 2, 30, 77, 5]
    want = _logits(ref, ids)
    err = ((_logits(q, ids).float() - want).norm() / want.norm()).item()
    assert 0 < err <= INT4_GROUP_TOL[group], err


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_start_up_compute_paths_line_counts_the_quantised_layers(method, tiny_checkpoint, monkeypatch, caplog):
    from tokenmill.model.runner import log_compute_paths

    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", "32")
    q = load_model(tiny_checkpoint(), dtype="float32", with_tokenizer=False, quantization=method)
    n = sum(1 for m in q.model.modules() if isinstance(m, QuantizedLinear) and m is not q.model._logits_head)
    with caplog.at_level("INFO", logger="tokenmill.model.runner"):
        log_compute_paths(q.model, torch.device("cpu"), torch.float32, torch.float32, 0)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("compute paths"))
    fmt = "int4-g32" if method == "int4" else "int8"
    want = f"{n + 1} int8 low-bit kernel" if method == "int8" else f"{n} int4-g32 low-bit kernel, 1 int8 low-bit kernel"
    assert want in line, line
    assert fmt in line


@pytest.mark.parametrize("method", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_weight_bytes_equal_the_engines(method, dtype, tiny_checkpoint, monkeypatch):
    """``tokenmill plan``'s weight bytes are what the engine holds (tied embedding: the int8 logits head of a
    quantised model is a copy beside the dense table)."""
    from tokenmill.playbook.plan import PlanOptions, load_shape, weight_bytes

    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", "32")
    path = tiny_checkpoint()
    lm = load_model(path, dtype=dtype, with_tokenizer=False, quantization=method)
    engine = sum(weight_bytes_by_format(lm.model).values())
    planned = weight_bytes(load_shape(path), PlanOptions(dtype=dtype, quantization=method))[0]
    assert planned == engine, (planned, weight_bytes_by_format(lm.model))
