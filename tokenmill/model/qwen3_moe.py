"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm before RoPE, no q/k/v bias) with sparse MoE blocks.

Architecture: Qwen3 technical report (arXiv 2505.09388, §2): Qwen3-30B-A3B and
Qwen3-235B-A22B have 128 experts, 8 routed per token, no shared expert; the
router takes the softmax over all experts and keeps the top k, renormalised
when the config's ``norm_topk_prob`` is true. ``decoder_sparse_step`` and
``mlp_only_layers`` select which layers are sparse (layer ``i`` is sparse when
``i`` is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``;
the others keep a dense SwiGLU of width ``intermediate_size``), which
:func:`tokenmill.model.hf_loader.read_hf_config` turns into
``ModelArchConfig.moe_layer_mask``. Everything else is
:class:`~tokenmill.model.mixtral.MixtralForCausalLM`.
"""

from __future__ import annotations

from tokenmill.model.mixtral import MixtralForCausalLM


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """Qwen3-MoE causal LM; registered for ``Qwen3MoeForCausalLM``/``qwen3_moe`` (GGUF ``qwen3moe``).

    Same arguments as :class:`MixtralForCausalLM`; the config has ``qk_norm`` set and
    ``norm_topk_prob`` from the checkpoint.
    """
