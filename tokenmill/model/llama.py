"""Llama-family decoder: Llama 2/3.x, SmolLM2, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Architecture: Touvron et al., "LLaMA" (arXiv 2302.13971, §2.2): pre-norm
decoder with RMSNorm, SwiGLU feed-forward and rotary embeddings; grouped-query
attention (Ainslie et al., arXiv 2305.13245). Qwen2 adds a bias to the q/k/v
projections (Qwen2 technical report, arXiv 2407.10671, §2.2.1); Qwen3 drops
it and RMS-normalises each query/key head before RoPE (Qwen3 technical report,
arXiv 2505.09388, §2).

The model works on a flattened batch: all scheduled requests' new tokens are
one ``[num_tokens]`` sequence, and the paged attention backend keeps requests
apart through :class:`~tokenmill.model.layers.attention.AttentionMetadata`.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.model.layers import fused_cpu
from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from tokenmill.model.layers.kv_quant import KVScales
from tokenmill.model.layers.mlp import SwiGLUMLP
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection, RoPE and a paged KV cache.

    Args:
        cfg: the architecture.
        backend: the paged attention implementation.
    """

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.backend = backend
        self.kv_scales = KVScales()   # K/V scales of a quantised cache (--kv-cache-dtype int8 / fp8)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``; writes this step's K/V to ``kv_cache``."""
        q, k, v = self.project_qkv(x, cos, sin)
        o = self.backend.forward(q, k, v, kv_cache, md, self.scale, self.kv_scales)
        return self.o_proj(o.reshape(x.shape[0], self.q_size))

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """QKV projection, optional q/k RMSNorm (Qwen3) and RoPE.

        ``x`` ``[num_tokens, hidden_size]`` -> q ``[num_tokens, num_heads, head_dim]``,
        k and v ``[num_tokens, num_kv_heads, head_dim]``.
        """
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        fused_rope = not self.qk_norm and fused_cpu.usable(qkv, cos, sin)
        if fused_rope:  # q heads then k heads are consecutive in each row: one in-place pass rotates both
            fused_cpu.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if fused_rope:
            return q, k, v
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin), v


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` (arXiv 2302.13971 §2.2)."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp_out, residual)``, each ``[num_tokens, hidden_size]``; their sum is the block output."""
        q, k, v, residual = pre_attention(self, x, residual, cos, sin)
        o = self.self_attn.backend.forward(q, k, v, kv_cache, md, self.self_attn.scale, self.self_attn.kv_scales)
        return post_attention(self, o, residual)


def pre_attention(layer: LlamaDecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense part of a block before attention: (add and) norm, fused q/k/v GEMM, q/k norm, RoPE.

    A plain function of the layer (not a method) so that one ``torch.compile``
    of it serves every layer: the layer's weights are graph inputs, not
    constants, and all layers share one graph per input shape.

    Args:
        layer: the decoder block.
        x: ``[num_tokens, hidden_size]`` the previous block's MLP output (or the embeddings).
        residual: ``[num_tokens, hidden_size]`` the residual stream, None for the first block.
        cos, sin: ``[num_tokens, 1, rotary_dim]`` from :meth:`RotaryEmbedding.cos_sin`.

    Returns:
        ``q`` ``[num_tokens, num_heads, head_dim]``, ``k``/``v``
        ``[num_tokens, num_kv_heads, head_dim]`` and the updated residual.
    """
    if residual is None:
        residual = x
        h = layer.input_layernorm(x)
    else:
        h, residual = layer.input_layernorm(x, residual)
    q, k, v = layer.self_attn.project_qkv(h, cos, sin)
    return q, k, v, residual


def post_attention(layer: LlamaDecoderLayer, o: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense part after attention: o_proj, residual add and norm, SwiGLU MLP.

    Args:
        o: ``[num_tokens, num_heads, head_dim]`` attention output.
        residual: ``[num_tokens, hidden_size]``.

    Returns:
        ``(mlp_out, residual)`` each ``[num_tokens, hidden_size]``.
    """
    a = layer.self_attn
    h = a.o_proj(o.reshape(o.shape[0], a.q_size))
    h, residual = layer.post_attention_layernorm(h, residual)
    return layer.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flattened batch with a paged KV cache.

    Registered for ``LlamaForCausalLM``/``llama``, ``Qwen2ForCausalLM``/``qwen2``
    and ``Qwen3ForCausalLM``/``qwen3`` (see :mod:`tokenmill.model.registry`).

    Args:
        cfg: architecture; ``attention_bias`` and ``qk_norm`` select the Qwen
            variants, ``tie_word_embeddings`` shares the LM head with the
            embedding.
        attn_backend: paged attention implementation (default:
            :func:`get_attention_backend` for CPU; pass one for other devices
            if a fused kernel exists).
    """

    def __init__(self, cfg: ModelArchConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.attn_backend = attn_backend or get_attention_backend("cpu")
        self.model = LlamaModel(cfg, self.attn_backend)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
            torch.tensor(cfg.rope_freq_factors, device="cpu") if cfg.rope_freq_factors is not None else None)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._pre_attention, self._post_attention = pre_attention, post_attention
        self._logits_head: nn.Module | None = None
        # Pipeline parallelism: a tokenmill.distributed.layers.PipelineStage, None for a single stage.
        self.pp_stage = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Run the decoder on one flattened batch.

        Args:
            input_ids: ``[num_tokens]`` int64, every scheduled request's new tokens concatenated.
            positions: ``[num_tokens]`` int64, each token's position in its sequence.
            kv_caches: one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.
            attn_metadata: where the tokens' K/V go and what each attends to.

        Returns:
            ``[num_tokens, hidden_size]`` final-norm hidden states in the model dtype;
            None on a pipeline stage that is not the last (``pp_stage``: it
            received its input from the previous stage instead of embedding
            ``input_ids``, and sent its output to the next).

        Raises:
            ValueError: ``kv_caches`` has the wrong number of layers.
        """
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV cache tensors, got {len(kv_caches)}")
        stage = self.pp_stage
        if stage is None or stage.is_first:
            x, residual = self.model.embed_tokens(input_ids), None
        else:   # a later pipeline stage continues the previous stage's residual stream
            x, residual = stage.recv(input_ids.shape[0], self.model.norm.weight.dtype)
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        pre, post = self._pre_attention, self._post_attention
        for layer, kv_cache in zip(layers, kv_caches):
            q, k, v, residual = pre(layer, x, residual, cos, sin)
            o = layer.self_attn.backend.forward(q, k, v, kv_cache, attn_metadata, layer.self_attn.scale,
                                                   layer.self_attn.kv_scales)
            x, residual = post(layer, o, residual)
        if stage is not None and not stage.is_last:
            stage.send(x, residual)
            return None
        x, _ = self.model.norm(x, residual)
        return x

    def set_dense_fns(self, pre=None, post=None) -> None:
        """Replace the per-layer dense parts (default :func:`pre_attention` / :func:`post_attention`).

        The model runner passes ``torch.compile``-d versions of the two
        functions (each one graph shared by all layers); the paged
        attention between them stays eager, so per-request Python in the
        attention backend causes no graph breaks. ``None`` restores the
        eager function.
        """
        self._pre_attention = pre or pre_attention
        self._post_attention = post or post_attention

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, hidden_size]`` -> logits ``[n, vocab_size]`` float32."""
        if self._logits_head is not None:
            return self._logits_head(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()

    def tied_logits_weight(self) -> torch.Tensor | None:
        """The ``[vocab_size, hidden_size]`` embedding table when the LM head is tied to it, else None."""
        return self.model.embed_tokens.weight if self.lm_head is None else None

    def set_logits_head(self, head: nn.Module | None) -> None:
        """Compute logits with ``head`` (``[n, hidden]`` -> ``[n, vocab]``), e.g. a packed copy of the
        tied embedding (:func:`tokenmill.model.layers.linear.pack_linear_weights`); None restores the default."""
        self._logits_head = head

    # ----------------------------------------------------------------- weights
    _STACKED = {  # checkpoint name part -> (fused param part, shard index)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def _shard_range(self, fused: str, shard: int) -> tuple[int, int]:
        c = self.config
        if fused.endswith("qkv_proj"):
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        i = c.intermediate_size
        return [(0, i), (i, 2 * i)][shard]

    def stack_row_shards(self, items: Iterable[tuple[str, tuple[torch.Tensor, ...]]]
                         ) -> dict[str, tuple[torch.Tensor, ...]]:
        """Assemble per-checkpoint-tensor side data (e.g. int4 codes and scales) for the fused layers.

        Args:
            items: ``(hf_weight_name, tensors)`` where every tensor has the
                weight's output rows as its first dimension (``q_proj``,
                ``k_proj`` ... as in :meth:`load_weights`).

        Returns:
            module name (``model.layers.0.self_attn.qkv_proj``) -> the
            tensors, q/k/v and gate/up shards concatenated along rows in the
            fused layer's order. Modules with a shard missing are left out.
        """
        shards: dict[str, dict[int, tuple[torch.Tensor, ...]]] = {}
        for name, tensors in items:
            if not name.endswith(".weight"):
                continue
            target, shard = name[: -len(".weight")], 0
            for part, (fused, idx) in self._STACKED.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused)[: -len(".weight")], idx
                    break
            shards.setdefault(target, {})[shard] = tensors
        out = {}
        for target, parts in shards.items():
            n = 3 if target.endswith("qkv_proj") else 2 if target.endswith("gate_up_proj") else 1
            if len(parts) == n:
                out[target] = tuple(torch.cat([parts[i][j] for i in range(n)]) if n > 1 else parts[0][j]
                                    for j in range(len(parts[0])))
        return out

    _KV_SCALE_NAMES = {"self_attn.k_scale": "k", "self_attn.v_scale": "v", "self_attn.kv_scale": "kv",
                       "self_attn.k_proj.output_scale": "k", "self_attn.v_proj.output_scale": "v"}

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Take a checkpoint's KV-cache scale (vLLM's ``model.layers.N.self_attn.k_scale`` / ``v_scale``,
        the older single ``kv_scale``, or compressed-tensors' ``k_proj.output_scale``) into the layer's
        :class:`KVScales`; True when ``name`` was one."""
        if not name.startswith("model.layers."):
            return False
        idx, _, rest = name[len("model.layers."):].partition(".")
        which = self._KV_SCALE_NAMES.get(rest)
        if which is None or not idx.isdigit():
            return False
        sc = self.model.layers[int(idx)].self_attn.kv_scales
        value = float(tensor.float().reshape(-1)[0])
        if which in ("k", "kv"):
            sc.k = value
        if which in ("v", "kv"):
            sc.v = value
        sc.source = "checkpoint"
        return True

    def _load_extra(self, name: str, tensor: torch.Tensor) -> bool:
        """Subclass hook: take a checkpoint tensor this class does not know (MoE experts); True when taken."""
        return False

    def _extra_params(self) -> set[str]:
        """Subclass hook: parameter names filled by :meth:`_load_extra` (left out of the missing check)."""
        return set()

    def _extra_missing(self) -> list[str]:
        """Subclass hook: what :meth:`_load_extra` still lacks after loading."""
        return []

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...) into the model.

        q/k/v and gate/up shards are copied into the fused projections;
        dtype and device are converted. ``lm_head.weight`` is ignored when the
        embeddings are tied, and rotary ``inv_freq`` buffers are ignored.
        KV-cache scales (``self_attn.k_scale`` / ``v_scale``) go to each
        layer's ``self_attn.kv_scales`` (used with a quantised cache).

        Raises:
            ValueError: an unknown tensor name, a shape mismatch, or a
                parameter the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if self._load_kv_scale(name, tensor) or self._load_extra(name, tensor):
                continue
            target, rows = name, None
            for part, (fused, shard) in self._STACKED.items():
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    rows = self._shard_range(fused, shard)
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            p = params[target]
            dst = p.data if rows is None else p.data[rows[0]:rows[1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dtype=dst.dtype))
            loaded[target] = loaded.get(target, 0) + (rows[1] - rows[0] if rows else p.shape[0])
        extra = self._extra_params()
        missing = [n for n, p in params.items() if n not in extra and loaded.get(n, 0) != p.shape[0]]
        missing += self._extra_missing()
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
