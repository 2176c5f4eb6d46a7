"""Gated feed-forward block (SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers import fused_cpu


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: Shazeer, "GLU Variants Improve Transformer" (arXiv 2002.05202, §2).

    ``gate`` and ``up`` are fused into one ``gate_up_proj`` GEMM of output
    width ``2 * intermediate_size`` (gate rows first, then up rows).

    Args:
        hidden_size: input/output width.
        intermediate_size: hidden width of the gated layer.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        gate_up = self.gate_up_proj(x)
        if fused_cpu.usable(gate_up):
            return self.down_proj(fused_cpu.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
