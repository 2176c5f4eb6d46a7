"""The architecture description every loader produces and every model consumes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelArchConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Attributes:
        architecture: Hugging Face architecture name (``LlamaForCausalLM``,
            ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``); see
            :mod:`tokenmill.model.registry`.
        num_hidden_layers: decoder layers.
        hidden_size: residual stream width.
        intermediate_size: SwiGLU hidden width.
        num_attention_heads: query heads.
        num_key_value_heads: K/V heads (GQA groups; equal to query heads for MHA).
        head_dim: per-head width (may differ from hidden_size / heads, e.g. Qwen3).
        vocab_size: embedding rows / logits width.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: Hugging Face style scaling dict (``{"rope_type": "llama3", ...}``) or None.
        max_position_embeddings: context length the checkpoint supports, in tokens.
        tie_word_embeddings: the LM head reuses the token embedding.
        attention_bias: q/k/v projections have a bias (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        bos_token_id: beginning-of-sequence id or None.
        eos_token_id: end-of-sequence id, a list of ids, or None.
        rope_freq_factors: optional per-frequency divisors ``[head_dim // 2]``
            (a GGUF ``rope_freqs.weight``), as a python list.
    """

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    rope_freq_factors: list[float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def eos_token_ids(self) -> list[int]:
        """``eos_token_id`` as a list (empty when unknown)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes per token: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
