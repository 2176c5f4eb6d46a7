"""Tiny random-weight Llama checkpoints for the tensor/pipeline-parallel tests."""

from __future__ import annotations

import pytest


def save_tiny_llama(folder, *, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 128, vocab: int = 101, tied: bool = True, seed: int = 0,
                    arch: str = "llama", word_width: int = 0) -> str:
    """Write a random-weight Llama (or Qwen2 with ``arch='qwen2'``) HF folder with a word-level tokenizer.

    ``vocab`` defaults to an odd size so the vocabulary-parallel padding is exercised. The words are ``w3`` ..
    ``w{vocab-1}``; with ``word_width`` their numbers are zero-padded (``w003``), so no word is a prefix of
    another: a grammar over them never lets a token start a word no token can finish (with ``w4`` and ``w42``
    both words, xgrammar allows ``w4`` where ``w42`` is expected, and nothing can follow it).
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=512,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, rope_theta=10000.0)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():   # larger than HF's default init so greedy tokens depend on every layer
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i:0{word_width}d}": i for i in range(3, vocab)}}
    tk = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """4 layers, 4 query / 2 KV heads, FFN 128, vocabulary 101, tied embeddings."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """Qwen2 (q/k/v bias), untied LM head, 2 KV heads."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", tied=False, seed=1)
