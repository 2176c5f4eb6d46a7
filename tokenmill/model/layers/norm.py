"""Root-mean-square layer normalisation.

RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019
(arXiv 1910.07467, §3): ``y = x / sqrt(mean(x**2) + eps) * weight``, no mean
subtraction and no bias.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers import fused_cpu


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (arXiv 1910.07467 §3).

    The statistic is computed in float32 and the result cast back to the input
    dtype before the weight is applied (the order Llama/Qwen reference code uses,
    so bfloat16 outputs match theirs).

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` ``[..., hidden_size]``.

        If ``residual`` (same shape) is given, computes ``h = x + residual``
        first and returns ``(norm(h), h)`` (the pre-norm transformer's fused
        add-and-norm); otherwise returns ``norm(x)``. On CPU float32/bfloat16
        in eager mode this is one fused C loop (:mod:`tokenmill.model.layers.fused_cpu`)
        with the same roundings.
        """
        if fused_cpu.usable(x, self.weight) and (residual is None or residual.dtype == x.dtype):
            return fused_cpu.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
