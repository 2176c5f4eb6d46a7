"""Tiny random-weight Llama/Qwen2/Qwen3 models: paged forward vs transformers' dense forward."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tokenmill.model.loader import build_model_from_config, load_model, resolve_dtype
from tokenmill.model.registry import get_model_class, supported_architectures

transformers = pytest.importorskip("transformers")


def hf_model_for(arch, seed=0):
    """A transformers model with the same architecture and random weights (norms randomised too)."""
    kw = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
              num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
              num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
              max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=arch.tie_word_embeddings,
              bos_token_id=arch.bos_token_id, eos_token_id=arch.eos_token_id,
              rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta, **(arch.rope_scaling or {})})
    cls = {"LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "Qwen3ForCausalLM": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch.architecture]
    if arch.architecture == "LlamaForCausalLM":
        kw["attention_bias"] = arch.attention_bias
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model


def ours_from_hf(hf, arch):
    model = build_model_from_config(arch, "float32", "cpu")
    model.load_weights(hf.state_dict().items())
    return model


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_chunked_mixed_batch_matches_transformers(variant, make_tiny_arch, paged_runner):
    arch = make_tiny_arch(variant)
    hf = hf_model_for(arch)
    ours = ours_from_hf(hf, arch)
    g = torch.Generator().manual_seed(3)
    prompts = {r: torch.randint(0, arch.vocab_size, (n,), generator=g).tolist()
               for r, n in {"a": 23, "b": 9, "c": 14}.items()}
    want = {r: hf_logits(hf, ids) for r, ids in prompts.items()}
    run = paged_runner(ours, arch, num_blocks=48, block_size=4, seed=5)
    # step 1: a's first chunk + b's whole prompt; step 2: a's 2nd chunk, b decodes... (b "decodes" its own tokens)
    schedule = [[("a", 0, 7), ("b", 0, 8)],
                [("b", 8, 9), ("a", 7, 16), ("c", 0, 5)],
                [("a", 16, 17), ("c", 5, 14)],
                [("a", 17, 18)], [("a", 18, 19)], [("a", 19, 23)]]
    for step in schedule:
        logits = run.step([(r, prompts[r][s:e]) for r, s, e in step])
        row = 0
        for r, s, e in step:
            torch.testing.assert_close(logits[row:row + e - s], want[r][s:e], atol=2e-4, rtol=1e-4,
                                       msg=f"{variant} request {r} tokens {s}:{e}")
            row += e - s


def test_llama3_rope_scaling_matches_transformers(make_tiny_arch, paged_runner):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    arch = make_tiny_arch("llama", rope_scaling=scaling, rope_theta=500000.0)
    hf = hf_model_for(arch)
    ours = ours_from_hf(hf, arch)
    ids = torch.randint(0, arch.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    run = paged_runner(ours, arch)
    got = torch.cat([run.step([("x", ids[:30])]), run.step([("x", ids[30:])])])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


def test_bfloat16_greedy_tracks_float32(make_tiny_arch, paged_runner):
    arch = make_tiny_arch("llama")
    m32 = build_model_from_config(arch, "float32", seed=1)
    m16 = build_model_from_config(arch, "bfloat16", seed=1)
    assert m16.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = list(range(3, 30))
    l32 = paged_runner(m32, arch).step([("x", ids)])
    l16 = paged_runner(m16, arch, dtype=torch.bfloat16).step([("x", ids)])
    assert l16.dtype == torch.float32
    torch.testing.assert_close(l16, l32, atol=0.05, rtol=0.05)


def test_build_model_is_deterministic_and_frozen(make_tiny_arch):
    arch = make_tiny_arch("qwen2")
    a, b = build_model_from_config(arch, seed=7), build_model_from_config(arch, seed=7)
    assert not a.training and all(not p.requires_grad for p in a.parameters())
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert a.lm_head is not None and b.model.layers[0].self_attn.qkv_proj.bias is not None


def test_load_weights_rejects_missing_and_unknown(make_tiny_arch):
    arch = make_tiny_arch("llama")
    hf = hf_model_for(arch)
    model = build_model_from_config(arch)
    sd = dict(hf.state_dict())
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="missing"):
        model.load_weights(sd.items())
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([("model.layers.0.self_attn.rel_bias", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_unknown_architecture_is_a_clear_error(make_tiny_arch, tmp_path):
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        build_model_from_config(make_tiny_arch("llama", architecture="MambaForCausalLM"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "hidden_size": 8,
                                                      "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="unsupported model architecture 'FalconForCausalLM'"):
        load_model(str(tmp_path))
    assert {"llama", "qwen2", "qwen3", "LlamaForCausalLM"} <= set(supported_architectures())


def test_resolve_dtype(monkeypatch):
    from tokenmill.model.loader import cpu_has_native_bf16

    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    monkeypatch.setenv("TOKENMILL_CPU_BF16", "0")
    assert not cpu_has_native_bf16()
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.delenv("TOKENMILL_CPU_BF16")
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match="unsupported model dtype"):
        resolve_dtype("int8", "cpu")


def _save_tiny_tokenizer(folder, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_hf_folder_roundtrip(variant, make_tiny_arch, paged_runner, tmp_path):
    arch = make_tiny_arch(variant)
    hf = hf_model_for(arch)
    hf.save_pretrained(tmp_path)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [2, 5]}, f)
    _save_tiny_tokenizer(tmp_path, arch.vocab_size)
    assert any(n.endswith(".safetensors") for n in os.listdir(tmp_path))
    lm = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert lm.arch.architecture == arch.architecture and lm.arch.head_dim == arch.head_dim
    assert lm.arch.qk_norm == (variant == "qwen3") and lm.arch.tie_word_embeddings
    assert lm.eos_token_ids == [2, 5] and lm.bos_token_id == 1
    assert lm.name == tmp_path.name and lm.chat_template.startswith("{% for m in messages %}")
    assert lm.tokenizer("w3 w7").input_ids[-2:] == [3, 7]
    ids = [3, 9, 4, 11, 50, 60, 7, 8, 1, 2, 30]
    got = paged_runner(lm.model, lm.arch).step([("x", ids)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=2e-4, rtol=1e-4)
