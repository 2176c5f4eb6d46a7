"""Tiny random Llama checkpoints and random PEFT LoRA adapters (built with transformers + peft, nothing downloaded)."""

from __future__ import annotations

import json
import os

import pytest
import torch

VOCAB = 64


def save_base(folder, seed: int = 0, vocab_size: int = VOCAB, layers: int = 2, hidden: int = 64) -> str:
    """A random Llama (``layers`` layers, GQA 4/2 heads) with a word-level tokenizer, saved to ``folder``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=hidden // 4, max_position_embeddings=256, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    return str(folder)


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base: str, folder, r: int = 8, alpha: float = 16, targets=ALL_TARGETS, rslora: bool = False,
                 seed: int = 1, std: float = 0.1, **extra) -> str:
    """A PEFT LoRA adapter with random A and B (``init_lora_weights=False``) on the base folder, saved."""
    import peft
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                          init_lora_weights=False, lora_dropout=0.0, **extra)
    torch.manual_seed(seed)
    pm = peft.get_peft_model(hf, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn_like(p))
    pm.save_pretrained(folder)
    assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))
    return str(folder)


def peft_model(base: str, adapter: str | None):
    """transformers (+ peft) model of ``base`` with ``adapter`` applied (None: the base), float32, eval."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    if adapter is None:
        return hf
    import peft

    return peft.PeftModel.from_pretrained(hf, adapter).eval()


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 logits of one sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens (no EOS stop)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def edit_json(path, **changes) -> None:
    """Change keys of a JSON file in place."""
    with open(path) as f:
        d = json.load(f)
    d.update(changes)
    with open(path, "w") as f:
        json.dump(d, f)


@pytest.fixture(scope="session")
def lora_root(tmp_path_factory):
    """A base model and adapters of ranks 4, 8 and 16 (one rsLoRA, one attention-only)."""
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "base")
    adapters = {
        "r4": save_adapter(base, root / "r4", r=4, alpha=8, seed=11),
        "r8": save_adapter(base, root / "r8", r=8, alpha=32, seed=12, rslora=True),
        "r16attn": save_adapter(base, root / "r16attn", r=16, alpha=16, seed=13,
                                targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
    }
    return base, adapters


def save_random_adapter(folder, arch, r: int = 8, alpha: float = 16, targets=ALL_TARGETS, seed: int = 3,
                        std_b: float = 0.02) -> str:
    """A PEFT-format adapter for any base (``arch``: its ModelArchConfig) written directly with safetensors
    (no transformers model of the base is built): A ~ N(0, 1/in), B ~ N(0, std_b^2)."""
    from safetensors.torch import save_file

    from tokenmill.lora.adapter import block_of, module_shapes

    os.makedirs(folder, exist_ok=True)
    shapes = module_shapes(arch)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(arch.num_hidden_layers):
        for t in targets:
            fin, fout = shapes[t]
            key = f"base_model.model.model.layers.{i}.{block_of(t)}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fin, generator=g) / fin ** 0.5
            tensors[f"{key}.lora_B.weight"] = std_b * torch.randn(fout, r, generator=g)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "base_model_name_or_path": arch.architecture}, f)
    return str(folder)
