"""Rotary position embedding (RoPE) with the checkpoint's base and scaling.

RoPE: Su et al., "RoFormer: Enhanced Transformer with Rotary Position
Embedding" (arXiv 2104.09864, §3.4). Layout: the Hugging Face "rotate_half"
layout, where dimension ``i`` is paired with ``i + rotary_dim / 2`` (GGUF
llama checkpoints are stored in the interleaved layout and are un-permuted
at load time, see :mod:`tokenmill.model.gguf_loader`).

Supported scalings (``rope_scaling["rope_type"]``):

* ``default`` / none: ``inv_freq[i] = theta ** (-2i / d)``.
* ``linear`` (position interpolation, Chen et al., arXiv 2306.15595 §2.2):
  frequencies divided by ``factor``.
* ``llama3``: the wavelength-dependent interpolation of Llama 3.1 (Meta,
  "The Llama 3 Herd of Models", arXiv 2407.21783 §3.3 and the reference
  code): wavelengths longer than ``original_max_position_embeddings /
  low_freq_factor`` are divided by ``factor``, shorter than ``... /
  high_freq_factor`` are kept, and the band in between is blended linearly.
* explicit per-frequency divisors (``freq_factors``), as stored in a GGUF
  ``rope_freqs.weight`` tensor by llama.cpp's converter for Llama 3.1+.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(rotary_dim: int, theta: float, rope_scaling: dict | None = None,
                     freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` float32 (radians per position).

    Args:
        rotary_dim: number of rotated dimensions (even).
        theta: RoPE base (``rope_theta``).
        rope_scaling: Hugging Face style dict with ``rope_type`` (or ``type``)
            and its parameters, or None.
        freq_factors: optional ``[rotary_dim // 2]`` divisors applied after
            scaling (GGUF ``rope_freqs.weight``).

    Raises:
        ValueError: unknown ``rope_type`` or odd ``rotary_dim``.
    """
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim))
    rtype = None
    if rope_scaling:
        rtype = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rtype in (None, "default"):
        pass
    elif rtype == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rtype == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_ctx = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / factor,
                               torch.where(wavelen < high_wavelen, inv_freq, blended))
    else:
        raise ValueError(f"unsupported rope scaling type {rtype!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to("cpu", torch.float64).flatten()
    return inv_freq.to(torch.float32)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for a batch of positions and rotates q/k (arXiv 2104.09864 §3.4).

    The inverse frequencies are float32; cos/sin are computed on the
    fly from ``positions`` (no ``[max_position, dim]`` table, so 128k-context
    checkpoints cost nothing extra) in float32 and cast to the activation dtype.
    """

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict | None = None,
                 freq_factors: torch.Tensor | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` and meta-device
        # construction must not touch it; it follows ``positions`` to its device.
        self.inv_freq = compute_inv_freq(self.rotary_dim, theta, rope_scaling, freq_factors)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[num_tokens]`` int -> ``(cos, sin)`` each ``[num_tokens, 1, rotary_dim]`` in ``dtype``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` (rotate_half layout) by ``cos``/``sin`` ``[num_tokens, 1, rotary_dim]``."""
        rd = cos.shape[-1]
        if rd == x.shape[-1]:
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        xr, xp = x[..., :rd], x[..., rd:]
        x1, x2 = xr.chunk(2, dim=-1)
        return torch.cat((xr * cos + torch.cat((-x2, x1), dim=-1) * sin, xp), dim=-1)
