"""PEFT adapter loading and validation, and the grouped delta against transformers + peft (float32)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.lora.conftest import edit_json, peft_model, reference_logits, save_adapter, save_base
from tests.model.conftest import PagedRunner
from tokenmill.lora.adapter import LoRAAdapterError, load_adapter
from tokenmill.lora.manager import LoRAManager
from tokenmill.lora.request import LoRARequest, parse_lora_modules
from tokenmill.model.layers.lora import pick_mode
from tokenmill.model.loader import load_model


@pytest.fixture(scope="module")
def base_model(lora_root):
    base, _ = lora_root
    return load_model(base, dtype="float32", device="cpu")


def test_scale_and_rank(lora_root, base_model):
    _, ads = lora_root
    a = load_adapter(ads["r8"], base_model.arch, max_rank=16)   # rsLoRA: alpha / sqrt(r)
    assert a.rank == 8 and len(a.modules) == 2 * 7
    w = a.modules[(0, "q_proj")]
    assert w.scale == pytest.approx(32 / 8 ** 0.5)
    a4 = load_adapter(ads["r4"], base_model.arch, max_rank=16)
    assert a4.modules[(1, "down_proj")].scale == pytest.approx(8 / 4)
    attn = load_adapter(ads["r16attn"], base_model.arch, max_rank=16)
    assert {m for _, m in attn.modules} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_bad_adapters_are_refused_by_name(lora_root, base_model, tmp_path):
    base, ads = lora_root
    arch = base_model.arch
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        load_adapter(str(tmp_path / "nope"), arch, 16)
    with pytest.raises(LoRAAdapterError, match="rank 16, above --max-lora-rank 8"):
        load_adapter(ads["r16attn"], arch, 8)
    # missing weights file
    d = _copy(ads["r4"], tmp_path / "nofile")
    os.remove(os.path.join(d, "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"nofile/adapter_model.safetensors: missing"):
        load_adapter(d, arch, 16)
    # corrupt weights file
    d = _copy(ads["r4"], tmp_path / "corrupt")
    with open(os.path.join(d, "adapter_model.safetensors"), "r+b") as f:
        f.write(b"garbage!" * 4)
    with pytest.raises(LoRAAdapterError, match="corrupt/adapter_model.safetensors: not a readable safetensors"):
        load_adapter(d, arch, 16)
    # corrupt / missing config
    d = _copy(ads["r4"], tmp_path / "badcfg")
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(LoRAAdapterError, match="badcfg/adapter_config.json: not a readable JSON"):
        load_adapter(d, arch, 16)
    # DoRA, biases, modules_to_save, embedding / lm_head targets
    for key, value, msg in [("use_dora", True, "DoRA"), ("bias", "all", "trained biases"),
                            ("modules_to_save", ["lm_head"], "modules_to_save"),
                            ("target_modules", ["q_proj", "embed_tokens"], r"\['embed_tokens'\] are not supported"),
                            ("target_modules", ["lm_head"], "embeddings / LM head"),
                            ("peft_type", "IA3", "peft_type IA3")]:
        d = _copy(ads["r4"], tmp_path / f"cfg_{key}_{value}".replace("[", "").replace("]", "").replace("'", ""))
        edit_json(os.path.join(d, "adapter_config.json"), **{key: value})
        with pytest.raises(LoRAAdapterError, match=msg):
            load_adapter(d, arch, 16)
    # an adapter for another base: other hidden size (shape mismatch), more layers (a layer the base lacks)
    other = save_base(tmp_path / "other_base", hidden=32)
    d = save_adapter(other, tmp_path / "other_adapter", r=4)
    with pytest.raises(LoRAAdapterError, match="trained for another base model"):
        load_adapter(d, arch, 16)
    deep = save_base(tmp_path / "deep_base", layers=3)
    d = save_adapter(deep, tmp_path / "deep_adapter", r=4)
    with pytest.raises(LoRAAdapterError, match="layer 2 does not exist in the base model"):
        load_adapter(d, arch, 16)


def test_embedding_and_lm_head_tensors_refused(lora_root, base_model, tmp_path):
    from safetensors.torch import load_file, save_file

    _, ads = lora_root
    for extra, msg in [("base_model.model.model.embed_tokens.lora_embedding_A", "embedding adapters"),
                       ("base_model.model.lm_head.lora_A.weight", "LM head adapters"),
                       ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
                       ("base_model.model.model.layers.0.input_layernorm.weight", "not a LoRA A/B weight")]:
        d = _copy(ads["r4"], tmp_path / msg.replace(" ", "_").replace("/", "_"))
        p = os.path.join(d, "adapter_model.safetensors")
        t = load_file(p)
        t[extra] = torch.zeros(4, 64)
        save_file(t, p)
        with pytest.raises(LoRAAdapterError, match=msg):
            load_adapter(d, base_model.arch, 16)


def test_target_the_base_lacks(lora_root, base_model, tmp_path):
    """A model whose layers have no gate/up/down linears (as in an MoE block) refuses an MLP adapter."""
    import copy

    _, ads = lora_root
    model = copy.deepcopy(base_model.model)
    for layer in model.model.layers:
        del layer.mlp.gate_up_proj, layer.mlp.down_proj
    mgr = LoRAManager(model, base_model.arch, 1, 16, 1, torch.float32)
    with pytest.raises(LoRAAdapterError, match=r"targets \['down_proj', 'gate_proj', 'up_proj'\] do not exist"):
        mgr.load_now(LoRARequest("x", 1, ads["r4"]))
    mgr.load_now(LoRARequest("y", 2, ads["r16attn"]))   # attention-only adapters still fit


@pytest.mark.parametrize("mode", ["kernel", "stacked", "segmented", "loop", "auto"])
def test_mixed_batch_matches_peft(lora_root, mode):
    """Rows of three adapters (ranks 4 / 8 rsLoRA / 16 attention-only) and of the base in one flattened
    step equal transformers + peft run on each sequence alone (float32; summation order differs: 1e-4)."""
    base, ads = lora_root
    lm = load_model(base, dtype="float32", device="cpu")
    mgr = LoRAManager(lm.model, lm.arch, 3, 16, 3, torch.float32)
    mgr.mode = mode
    reqs = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(ads.items()))}
    seqs = [("r4", [3, 9, 4, 11, 50, 60, 7]), (None, [5, 6, 7, 8]), ("r8", [10, 11, 12]),
            ("r16attn", [40, 41, 42, 43, 44]), ("r4", [20, 21])]
    runner = PagedRunner(lm.model, lm.arch)
    lens = np.array([len(s) for _, s in seqs])
    mgr.set_batch([reqs[a] if a else None for a, _ in seqs], lens, int(lens.sum()))
    got = runner.step([(f"q{i}", s) for i, (_, s) in enumerate(seqs)])
    row = 0
    for name, ids in seqs:
        ref = reference_logits(peft_model(base, ads[name] if name else None), ids)
        torch.testing.assert_close(got[row:row + len(ids)], ref, atol=1e-4, rtol=1e-4)
        row += len(ids)
    # decode steps: one row each, slots kept
    mgr.set_batch([reqs[a] if a else None for a, _ in seqs], np.ones(len(seqs), dtype=np.int64), len(seqs))
    nxt = [7, 8, 9, 10, 11]
    got = runner.step([(f"q{i}", [t]) for i, t in enumerate(nxt)])
    for i, ((name, ids), t) in enumerate(zip(seqs, nxt)):
        ref = reference_logits(peft_model(base, ads[name] if name else None), ids + [t])[-1]
        torch.testing.assert_close(got[i], ref, atol=1e-4, rtol=1e-4)


def test_slots_lru_and_cpu_cache(lora_root, base_model):
    import copy

    _, ads = lora_root
    model = copy.deepcopy(base_model.model)
    mgr = LoRAManager(model, base_model.arch, max_loras=2, max_rank=16, max_cpu_loras=2, dtype=torch.float32)
    r = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(sorted(ads.items()))]
    one = np.ones(1, dtype=np.int64)
    for req in r:
        ready, err = mgr.ensure(req)
        while not ready and err is None:
            mgr._loading[req.lora_int_id].result()
            ready, err = mgr.ensure(req)
        assert ready and err is None
    assert len(mgr.cpu) == 2 and 1 not in mgr.cpu       # LRU beyond --max-cpu-loras
    mgr.set_batch([r[1]], one, 1)
    mgr.set_batch([r[2]], one, 1)
    assert sorted(s for s in mgr.slots if s) == [2, 3]
    mgr.set_batch([r[0]], one, 1)                         # evicted from CPU memory: reloaded on the step's path
    assert mgr.slots.count(1) == 1 and mgr.slots.count(3) == 1   # slot of adapter 2 (least recent) reused
    bad = LoRARequest("bad", 9, "/nonexistent/adapter")
    ready, err = mgr.ensure(bad)
    assert not ready and err is None
    mgr._loading[9].exception()
    ready, err = mgr.ensure(bad)
    assert not ready and "does not exist" in err


def test_pick_mode():
    assert pick_mode(16, 8, 16, 3, 16, 576, 960) == "stacked"       # decode: few calls win
    assert pick_mode(2048, 8, 2, 3, 16, 576, 960) == "segmented"    # prefill: FLOPs win


def test_parse_lora_modules():
    mods = parse_lora_modules('a=/x/a b=/x/b\n{"name": "c", "path": "/x/c", "base_model_name": "m"}')
    assert [(m.name, m.path, m.base_model_name) for m in mods] == [("a", "/x/a", None), ("b", "/x/b", None),
                                                                  ("c", "/x/c", "m")]
    for bad, msg in [("a", "expected name=path"), ("a=/x a=/y", "given twice"), ('{"name": "a"}', "need"),
                     ('{"name": "a", "path": "p", "x": 1}', "unknown keys")]:
        with pytest.raises(ValueError, match=msg):
            parse_lora_modules(bad)


def test_bfloat16_model_with_adapters(lora_root):
    """bfloat16 weights, activations and adapter slots: within bfloat16 rounding of the float32 reference
    (8 bits of mantissa over 2 layers: 0.1 absolute on logits of magnitude ~1), while the adapters move
    the logits by far more than that."""
    base, ads = lora_root
    lm = load_model(base, dtype="bfloat16", device="cpu")
    mgr = LoRAManager(lm.model, lm.arch, 2, 16, 2, torch.bfloat16)
    reqs = [LoRARequest("r4", 1, ads["r4"]), None, LoRARequest("r16attn", 2, ads["r16attn"])]
    ids = [3, 9, 4, 11, 50, 60, 7]
    runner = PagedRunner(lm.model, lm.arch, dtype=torch.bfloat16)
    mgr.set_batch(reqs, np.array([len(ids)] * 3), 3 * len(ids))
    got = runner.step([(f"q{i}", ids) for i in range(3)]).float()
    plain = reference_logits(peft_model(base, None), ids)
    for i, r in enumerate(reqs):
        ref = reference_logits(peft_model(base, ads[r.lora_name] if r else None), ids)
        torch.testing.assert_close(got[i * len(ids):(i + 1) * len(ids)], ref, atol=0.1, rtol=0.05)
        if r is not None:
            assert (ref - plain).abs().max() > 0.3
