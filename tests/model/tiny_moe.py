"""Tiny random-weight Mixtral / Qwen3-MoE checkpoints, written with transformers' own classes."""

from __future__ import annotations

VOCAB = 97


def moe_config(family: str, **overrides):
    """A transformers config: 3 layers, hidden 64, 8 experts of width 32, top 2.

    ``qwen3_moe`` has layer 1 dense (``mlp_only_layers``, dense width 96) and ``norm_topk_prob`` False
    unless overridden; ``mixtral`` renormalises always.
    """
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, num_experts_per_tok=2)
    if family == "mixtral":
        kw = dict(common, intermediate_size=32, num_local_experts=8, sliding_window=None)
        kw.update(overrides)
        return transformers.MixtralConfig(**kw)
    kw = dict(common, head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
              norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def tiny_moe_model(family: str, seed: int = 0, **overrides):
    """The transformers model (float32, eval) with N(0, 0.08²) weights and norms 1 + N(0, 0.1²)."""
    import torch
    import transformers

    cfg = moe_config(family, **overrides)
    cls = transformers.MixtralForCausalLM if family == "mixtral" else transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model


def save_tiny_moe(folder, family: str, seed: int = 0, **kw) -> str:
    """Write the model of :func:`tiny_moe_model` and a word-level tokenizer (``w3`` ... ``w96``) to ``folder``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tiny_moe_model(family, seed, **kw)
    model.save_pretrained(folder)
    vocab_map = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(folder)
    return str(folder)
