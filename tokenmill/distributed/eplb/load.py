"""Measured expert load: the per-step sliding window of token counts and the imbalance measures (per rank,
per slot, per expert) the controller logs and exports."""

from __future__ import annotations

import torch

from tokenmill.distributed.eplb.placement import ExpertPlacement


def rank_loads(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Tokens each rank computes per layer when every expert's tokens split evenly over its replicas.

    Args:
        load: ``[num_layers, num_logical]`` tokens per logical expert.
        placement: the slots' experts.

    Returns:
        ``[num_layers, num_ranks]`` float64.
    """
    w = load.detach().to(torch.float64).cpu()
    p2l = placement.physical_to_logical
    per_slot = w.gather(1, p2l) / placement.logical_replica_count.gather(1, p2l).to(torch.float64)
    return per_slot.view(placement.num_layers, placement.num_ranks, placement.slots_per_rank).sum(-1)


def imbalance_ratio(per_rank: torch.Tensor) -> float:
    """Load imbalance of ``per_rank`` ``[num_layers, num_ranks]``: sum over layers of the busiest rank's
    load, divided by the sum over layers of the mean rank load (1.0 = perfectly balanced; 1.0 when idle).

    Each layer waits for its busiest rank, so this is the MoE compute time of a
    step relative to a perfectly balanced one. (vLLM logs its inverse,
    "balancedness" = mean / max.)
    """
    x = per_rank.detach().to(torch.float64).cpu()
    mean = float(x.mean(-1).sum())
    return float(x.max(-1).values.sum()) / mean if mean > 0 else 1.0


def slot_imbalance_ratio(load: torch.Tensor, placement: ExpertPlacement) -> float:
    """Busiest physical slot / mean slot (summed over layers), each expert's tokens split evenly over its
    replicas: how much replication evens out the per-slot GEMMs (the only effect of EPLB with one rank)."""
    w = load.detach().to(torch.float64).cpu()
    p2l = placement.physical_to_logical
    return imbalance_ratio(w.gather(1, p2l) / placement.logical_replica_count.gather(1, p2l).to(torch.float64))


def expert_imbalance_ratio(load: torch.Tensor) -> float:
    """Per-expert skew of ``load`` ``[num_layers, num_logical]``: sum over layers of the most-loaded
    expert's tokens / sum over layers of the mean expert's tokens (1.0 = uniform routing)."""
    return imbalance_ratio(load)


class ExpertLoadWindow:
    """Per-step token counts of every logical expert over the last ``window_size`` steps.

    A ring buffer ``[window_size, num_layers, num_logical]``: :meth:`record`
    overwrites the oldest step; :meth:`load` sums what the window holds.

    Args:
        num_layers: MoE layers.
        num_logical: logical experts per layer.
        window_size: steps kept (>= 1).

    Raises:
        ValueError: a size < 1.
    """

    def __init__(self, num_layers: int, num_logical: int, window_size: int) -> None:
        if min(num_layers, num_logical, window_size) < 1:
            raise ValueError(f"window sizes must be >= 1, got layers={num_layers} experts={num_logical} "
                             f"window={window_size}")
        self.window_size = window_size
        self._buf = torch.zeros(window_size, num_layers, num_logical, dtype=torch.int64)
        self._next = 0
        self.num_recorded = 0      # steps recorded since start (or reset)

    def record(self, counts: torch.Tensor) -> None:
        """Add one step's ``[num_layers, num_logical]`` token counts (integers; any device).

        Raises:
            ValueError: wrong shape.
        """
        if tuple(counts.shape) != tuple(self._buf.shape[1:]):
            raise ValueError(f"expected counts of shape {tuple(self._buf.shape[1:])}, got {tuple(counts.shape)}")
        self._buf[self._next].copy_(counts.detach().to(device="cpu", dtype=torch.int64))
        self._next = (self._next + 1) % self.window_size
        self.num_recorded += 1

    @property
    def num_steps(self) -> int:
        """Steps the window holds now (``min(num_recorded, window_size)``)."""
        return min(self.num_recorded, self.window_size)

    def load(self) -> torch.Tensor:
        """``[num_layers, num_logical]`` int64: tokens per expert summed over the window."""
        return self._buf.sum(0)

    def reset(self) -> None:
        """Forget every recorded step."""
        self._buf.zero_()
        self._next = 0
        self.num_recorded = 0


def logical_counts(physical_counts: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Fold per-slot counts ``[num_layers, num_physical]`` into per-expert counts ``[num_layers, num_logical]``
    (the replicas of one expert summed), on the CPU as int64."""
    c = physical_counts.detach().to(device="cpu", dtype=torch.int64)
    out = torch.zeros(placement.num_layers, placement.num_logical, dtype=torch.int64)
    return out.scatter_add_(1, placement.physical_to_logical, c)
