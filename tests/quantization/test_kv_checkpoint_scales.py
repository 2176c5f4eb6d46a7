"""KV-cache scales from a checkpoint (vLLM's ``self_attn.k_scale`` / ``v_scale``, the older ``kv_scale``) are
used as they are: not recalculated from the first batch, also for int8 (which otherwise always calculates)."""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.model.runner import ModelRunner
from tests.quantization.conftest import LAYERS, hf_tensors, write_checkpoint


def test_checkpoint_kv_scales_are_loaded_and_kept(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE", "0")
    t = hf_tensors()
    t["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    t["model.layers.0.self_attn.v_scale"] = torch.tensor(0.02)
    t["model.layers.1.self_attn.kv_scale"] = torch.tensor([0.03])
    path = write_checkpoint(tmp_path / "scaled", t)
    cfg = EngineConfig.from_kwargs(model=path, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=8,
                                   block_size=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    with caplog.at_level("INFO"):
        runner = ModelRunner.from_config(cfg, with_tokenizer=False)
    assert "KV cache scales (%d layers): from the checkpoint (K 0.03-0.05, V 0.02-0.03)" % LAYERS in caplog.text
    scales = [layer.self_attn.kv_scales for layer in runner.model.model.layers]
    want = [(0.05, 0.02), (0.03, 0.03)]
    assert [(round(s.k, 6), round(s.v, 6), s.source, s.calculate) for s in scales] == \
        [(k, v, "checkpoint", False) for k, v in want]
    from tokenmill.model.layers.attention import build_attention_metadata

    md, pos = build_attention_metadata([0], [5], [[0]], 16)
    with torch.inference_mode():
        runner.model(torch.tensor([3, 9, 4, 11, 50]), pos, runner.kv_caches, md)
    assert [(round(s.k, 6), round(s.v, 6)) for s in scales] == want         # the first batch changed nothing
    assert runner.kv_caches[0].dtype == torch.int8
