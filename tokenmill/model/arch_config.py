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
        num_experts: routed experts per MoE layer (the checkpoint's, "logical"
            experts); 0 for a dense model.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: SwiGLU hidden width of one expert.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1
            (always for Mixtral; Qwen3-MoE's ``norm_topk_prob``).
        moe_layer_mask: per layer, True where the feed-forward block is a
            mixture of experts (Qwen3-MoE's ``decoder_sparse_step`` /
            ``mlp_only_layers``); None means every layer when ``num_experts > 0``.
        num_redundant_experts: extra physical expert slots holding replicas of
            logical experts (EPLB); physical slots = ``num_experts + num_redundant_experts``.
        ep_size, ep_rank: expert-parallel group size and this rank's place in
            it; rank ``r`` holds physical slots ``[r * S, (r + 1) * S)`` with
            ``S = (num_experts + num_redundant_experts) / ep_size``.
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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layer_mask: list[bool] | None = None
    num_redundant_experts: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                                 f"({self.num_experts})")
            if self.moe_layer_mask is not None and len(self.moe_layer_mask) != self.num_hidden_layers:
                raise ValueError(f"moe_layer_mask has {len(self.moe_layer_mask)} entries for "
                                 f"{self.num_hidden_layers} layers")
            if self.num_redundant_experts < 0:
                raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
            if self.num_physical_experts % self.ep_size:
                raise ValueError(f"{self.num_experts} experts + {self.num_redundant_experts} redundant = "
                                 f"{self.num_physical_experts} physical experts cannot be split evenly over "
                                 f"{self.ep_size} expert-parallel ranks; choose num_redundant_experts so that "
                                 f"the sum is a multiple of {self.ep_size}")

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """True when layer ``i`` (local index) has a mixture-of-experts feed-forward block."""
        if not self.num_experts:
            return False
        return True if self.moe_layer_mask is None else bool(self.moe_layer_mask[i])

    @property
    def num_physical_experts(self) -> int:
        """Physical expert slots over the whole expert-parallel group: logical + redundant."""
        return self.num_experts + self.num_redundant_experts

    @property
    def num_local_experts(self) -> int:
        """Physical expert slots on this rank."""
        return self.num_physical_experts // self.ep_size

    @property
    def eos_token_ids(self) -> list[int]:
        """``eos_token_id`` as a list (empty when unknown)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes per token: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
