"""--quantization int8 / w8a8 / int4 on a tiny random checkpoint: round-trip bounds, logits vs the float reference."""

from __future__ import annotations

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


def test_int4_default_group_is_the_largest_that_divides(monkeypatch):
    from tokenmill.quantization.methods import int4_group_for

    monkeypatch.delenv("TOKENMILL_INT4_GROUP_SIZE", raising=False)
    assert (int4_group_for(1536), int4_group_for(576), int4_group_for(96)) == (128, 64, 32)
    with pytest.raises(ValueError, match="no int4 group size"):
        int4_group_for(100)
    monkeypatch.setenv("TOKENMILL_INT4_GROUP_SIZE", "64")
    assert int4_group_for(1536) == 64
    with pytest.raises(ValueError, match="does not divide"):
        int4_group_for(96)
