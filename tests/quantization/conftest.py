"""Tiny Hugging Face checkpoints for the quantisation tests (random weights, written here)."""

from __future__ import annotations

import json

import pytest
import torch

H, FFN, HEADS, KV, HD, VOCAB, LAYERS = 64, 128, 4, 2, 16, 96, 2


def hf_tensors(seed: int = 0, bias: bool = False) -> dict[str, torch.Tensor]:
    """Random HF-named float32 weights of a 2-layer llama (qwen2-style q/k/v biases when ``bias``)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.1: torch.randn(*s, generator=g) * std
    out = {"model.embed_tokens.weight": r(VOCAB, H, std=0.5), "model.norm.weight": 1 + r(H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
                    p + "self_attn.q_proj.weight": r(HEADS * HD, H), p + "self_attn.k_proj.weight": r(KV * HD, H),
                    p + "self_attn.v_proj.weight": r(KV * HD, H), p + "self_attn.o_proj.weight": r(H, HEADS * HD),
                    p + "mlp.gate_proj.weight": r(FFN, H), p + "mlp.up_proj.weight": r(FFN, H),
                    p + "mlp.down_proj.weight": r(H, FFN)})
        if bias:
            for n, rows in (("q", HEADS), ("k", KV), ("v", KV)):
                out[p + f"self_attn.{n}_proj.bias"] = r(rows * HD, std=0.05)
    return out


def write_checkpoint(folder, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None,
                     arch: str = "LlamaForCausalLM") -> str:
    """config.json (+ quantization_config) and model.safetensors in ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [arch], "hidden_size": H, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "vocab_size": VOCAB,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    if quantization_config:
        cfg["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    return lambda name="dense", tensors=None, qcfg=None, arch="LlamaForCausalLM": write_checkpoint(
        tmp_path / name, tensors if tensors is not None else hf_tensors(), qcfg, arch)
