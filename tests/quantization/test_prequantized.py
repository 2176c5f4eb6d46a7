"""AWQ / GPTQ 4-bit safetensors checkpoints (quantised here from a tiny random model) load as codes and give
the logits of the same model with the dequantised weights."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.loader import load_model
from tokenmill.quantization.methods import QuantizedLinear
from tests.model.conftest import PagedRunner
from tests.quantization.conftest import hf_tensors

G = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   # AutoAWQ's packer: nibble i of each word holds column 8c + AWQ_ORDER[i]


def quantise(w: torch.Tensor, group: int = G):
    """[N, K] -> codes [N, K] in 0..15, scale [N, K/G] (float16), zero [N, K/G] integer in 0..15."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-6).half()
    z = torch.round(-lo / s.float()).clamp(0, 15)
    q = torch.round(g / s.float()[..., None] + z[..., None]).clamp(0, 15).reshape(n, k).int()
    return q, s, z.int()


def pack_words(vals: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[R, C] 0..15 -> [R, C/8] int32, column 8c + order[i] into nibble i."""
    r, c = vals.shape
    v = vals.reshape(r, c // 8, 8).long()
    out = torch.zeros(r, c // 8, dtype=torch.long)
    for i, col in enumerate(order):
        out |= v[..., col] << (4 * i)
    return out.to(torch.int64).to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31) * 2**32).to(torch.int32)


def to_awq(w):
    q, s, z = quantise(w)
    return {"qweight": pack_words(q.t(), AWQ_ORDER), "qzeros": pack_words(z.t(), AWQ_ORDER),
            "scales": s.t().contiguous()}, ((q - z.repeat_interleave(G, 1)) * s.float().repeat_interleave(G, 1))


def to_gptq(w, perm=None, v2=False):
    n, k = w.shape
    wp = w if perm is None else w[:, perm]                  # act-order: quantise columns in permuted order
    q, s, z = quantise(wp)
    rows = q.t().reshape(k // 8, 8, n).long()               # [K, N]: 8 consecutive input rows per word
    qweight = torch.zeros(k // 8, n, dtype=torch.long)
    for j in range(8):
        qweight |= rows[:, j] << (4 * j)
    qweight = (qweight - (qweight >= 2**31) * 2**32).to(torch.int32)
    g_idx = torch.arange(k, dtype=torch.int32) // G
    deq = (q - z.repeat_interleave(G, 1)) * s.float().repeat_interleave(G, 1)
    if perm is not None:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // G
        unperm = torch.empty_like(deq)
        unperm[:, perm] = deq
        deq = unperm
        qw = torch.zeros(k // 8, n, dtype=torch.long)        # rows stored in original input order
        orig = torch.empty_like(q)
        orig[:, perm] = q
        rows = orig.t().reshape(k // 8, 8, n).long()
        for j in range(8):
            qw |= rows[:, j] << (4 * j)
        qweight = (qw - (qw >= 2**31) * 2**32).to(torch.int32)
    return {"qweight": qweight, "qzeros": pack_words(z.t() - (0 if v2 else 1)),
            "scales": s.t().contiguous(), "g_idx": g_idx}, deq


@pytest.mark.parametrize("method,variant", [("awq", ""), ("gptq", ""), ("gptq", "act_order"), ("gptq", "v2")])
def test_prequantised_checkpoint_matches_its_dequantised_weights(method, variant, tiny_checkpoint):
    dense = hf_tensors(bias=True)
    qt, ref = {}, {}
    perms = {}
    for name, w in dense.items():
        if not name.endswith("proj.weight"):
            qt[name] = ref[name] = w
            continue
        mod = name[: -len(".weight")]
        if method == "awq":
            parts, deq = to_awq(w)
        else:
            perm = None
            if variant == "act_order":                        # one permutation per input (shared by q/k/v...)
                key = (mod.rsplit(".", 1)[0], "o" if "o_proj" in mod else "d" if "down" in mod else "in")
                perm = perms.setdefault(key, torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(len(perms))))
            parts, deq = to_gptq(w, perm, v2=variant == "v2")
        for k, v in parts.items():
            qt[f"{mod}.{k}"] = v
        ref[name] = deq.float()
    qcfg = {"quant_method": method, "bits": 4, "group_size": G}
    if method == "awq":
        qcfg.update(zero_point=True, version="gemm")
    else:
        qcfg.update(desc_act=variant == "act_order", sym=False,
                    checkpoint_format="gptq_v2" if variant == "v2" else "gptq")
    arch = "Qwen2ForCausalLM"                                # q/k/v biases ride along with the codes
    q_path = tiny_checkpoint(f"{method}{variant}", qt, qcfg, arch=arch)
    ref_path = tiny_checkpoint("ref", ref, arch=arch)
    lm = load_model(q_path, dtype="float32", with_tokenizer=False)
    assert lm.quantization == method
    layers = [m for m in lm.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 and all(m.weight_codes.bits == 4 and m.weight_codes.group == G for m in layers)
    assert (layers[0].input_perm is not None) == (variant == "act_order")
    assert not any(p.numel() >= 64 * 64 and "proj" in n for n, p in lm.model.named_parameters())  # no dense copies
    want_lm = load_model(ref_path, dtype="float32", with_tokenizer=False)
    ids = [3, 9, 4, 11, 50, 60, 7, 8, 1, 2, 30]
    want = PagedRunner(want_lm.model, want_lm.arch).step([("r", ids)])
    got = PagedRunner(lm.model, lm.arch).step([("r", ids)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_unsupported_prequantised_checkpoints_are_clear_errors(tiny_checkpoint):
    path = tiny_checkpoint("awq8", hf_tensors(), {"quant_method": "awq", "bits": 8, "group_size": 32})
    with pytest.raises(ValueError, match="8-bit weights is not supported"):
        load_model(path, with_tokenizer=False)
    path = tiny_checkpoint("fp8", hf_tensors(), {"quant_method": "fp8"})
    with pytest.raises(ValueError, match="method 'fp8' is not supported"):
        load_model(path, with_tokenizer=False)
    path = tiny_checkpoint("awq", hf_tensors(), {"quant_method": "awq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="awq checkpoint; --quantization int8 cannot apply"):
        load_model(path, with_tokenizer=False, quantization="int8")
