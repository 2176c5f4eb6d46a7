"""Where each MoE expert's replicas live: :class:`ExpertPlacement` (vLLM's ``physical_to_logical``,
``logical_to_physical`` and ``logical_replica_count`` maps) and the size rules every placement obeys."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot of each MoE layer holds.

    Physical slot ``p`` lives on rank ``p // slots_per_rank`` (ranks own
    contiguous runs of slots).

    Attributes:
        physical_to_logical: ``[num_layers, num_physical]`` int64, the logical
            expert held by each slot.
        logical_to_physical: ``[num_layers, num_logical, max_replicas]`` int64,
            the slots holding each logical expert, ascending, padded with -1
            (``max_replicas = num_physical - num_logical + 1``).
        logical_replica_count: ``[num_layers, num_logical]`` int64, replicas of
            each logical expert (>= 1).
        num_ranks: expert-parallel ranks the slots are spread over.
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    logical_replica_count: torch.Tensor
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return int(self.physical_to_logical.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logical_replica_count.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @classmethod
    def from_physical_to_logical(cls, physical_to_logical: torch.Tensor, num_logical: int,
                                 num_ranks: int) -> "ExpertPlacement":
        """Build the inverse maps from ``physical_to_logical`` ``[num_layers, num_physical]``.

        Raises:
            ValueError: the slots do not divide over the ranks, a slot names an
                expert outside ``[0, num_logical)``, or an expert has no replica.
        """
        p2l = physical_to_logical.to(torch.int64).cpu()
        if p2l.dim() != 2:
            raise ValueError(f"physical_to_logical must be [num_layers, num_physical], got {tuple(p2l.shape)}")
        num_layers, num_physical = p2l.shape
        check_sizes(num_logical, num_physical, num_ranks)
        if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_logical):
            raise ValueError(f"physical_to_logical holds expert ids outside [0, {num_logical})")
        count = torch.zeros(num_layers, num_logical, dtype=torch.int64)
        count.scatter_add_(1, p2l, torch.ones_like(p2l))
        if num_layers and int(count.min()) < 1:
            layer, expert = (count < 1).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} of layer {layer} has no physical slot")
        max_replicas = num_physical - num_logical + 1
        # replica index of each slot: how many earlier slots of the same layer hold the same expert
        onehot = torch.nn.functional.one_hot(p2l, num_logical)               # [L, P, E]
        replica = (onehot.cumsum(1) - 1).gather(2, p2l.unsqueeze(2)).squeeze(2)   # [L, P]
        l2p = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
        l2p.scatter_(1, p2l * max_replicas + replica, torch.arange(num_physical).expand(num_layers, -1).clone())
        return cls(p2l, l2p.view(num_layers, num_logical, max_replicas), count, num_ranks)

    @classmethod
    def default(cls, num_layers: int, num_logical: int, num_physical: int, num_ranks: int) -> "ExpertPlacement":
        """The start-up placement: slot ``p`` holds expert ``p mod num_logical`` (the redundant slots
        replicate experts 0, 1, ...; with no redundancy rank ``r`` holds a contiguous run of experts)."""
        p2l = (torch.arange(num_physical) % num_logical).expand(num_layers, -1).clone()
        return cls.from_physical_to_logical(p2l, num_logical, num_ranks)

    def slot_ranks(self) -> torch.Tensor:
        """``[num_physical]`` int64: the rank of each slot."""
        return torch.arange(self.num_physical) // self.slots_per_rank

    def experts_per_rank(self, layer: int = 0) -> list[list[int]]:
        """The logical experts each rank holds in ``layer`` (slot order)."""
        s = self.slots_per_rank
        row = self.physical_to_logical[layer].tolist()
        return [row[r * s:(r + 1) * s] for r in range(self.num_ranks)]

    def check(self) -> None:
        """Raise ValueError if the three maps disagree (used by tests and after every rebalance)."""
        again = ExpertPlacement.from_physical_to_logical(self.physical_to_logical, self.num_logical, self.num_ranks)
        if not (torch.equal(again.logical_to_physical, self.logical_to_physical)
                and torch.equal(again.logical_replica_count, self.logical_replica_count)):
            raise ValueError("logical_to_physical / logical_replica_count disagree with physical_to_logical")


def check_sizes(num_logical: int, num_physical: int, num_ranks: int) -> None:
    """Check a layout: at least one logical expert and one rank, no fewer slots than experts, slots dividing
    evenly over the ranks.

    Raises:
        ValueError: a rule broken (the message says which, and for the last one what to change).
    """
    if num_logical < 1 or num_ranks < 1:
        raise ValueError(f"need >= 1 logical expert and >= 1 rank, got {num_logical} and {num_ranks}")
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} logical experts")
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical expert slots do not divide over {num_ranks} ranks "
                         "(num_logical_experts + num_redundant_experts must be a multiple of the expert-parallel size)")
