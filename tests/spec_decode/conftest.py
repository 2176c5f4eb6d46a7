"""Tiny random-weight checkpoints (saved with transformers) for engine-level speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch


def save_tiny_llama(folder, seed: int, vocab_size: int = 16, scale: float = 1.0) -> str:
    """A 2-layer Llama with random weights and a word-level tokenizer of ``vocab_size`` ids, saved to ``folder``.

    ``scale`` multiplies the embedding (tied LM head), sharpening the next-token distributions.
    """
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                                   eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        model.model.embed_tokens.weight.mul_(scale / model.model.embed_tokens.weight.std())
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(target folder, draft folder): two tiny Llamas sharing a 16-token vocabulary."""
    root = tmp_path_factory.mktemp("spec_models")
    return (save_tiny_llama(root / "target", seed=0, scale=0.1), save_tiny_llama(root / "draft", seed=1, scale=0.1))
