"""Expert-parallel load balancing (EPLB): where each MoE expert's replicas live.

Tokens do not spread evenly over a mixture-of-experts layer's experts: a few
"hot" experts get most of them, and under expert parallelism the rank that
holds them sets the step time while the others wait. EPLB gives every MoE
layer ``num_physical = num_logical + num_redundant`` expert *slots* (the
*physical* experts), ``num_physical / num_ranks`` per rank, and decides from
measured per-expert token counts which *logical* expert each slot holds: hot
experts get several replicas (their tokens are split among them) and the
replicas are packed onto ranks so that every rank gets about the same load.

The placement algorithm is the one DeepSeek published with DeepSeek-V3
(github.com/deepseek-ai/EPLB, "Expert Parallelism Load Balancer"; the
redundant-experts strategy of the DeepSeek-V3 technical report, arXiv
2412.19437, §3.4). Written here from its description, in our own words:

1. **Replicate** (:func:`replicate_experts`): start with one replica per
   logical expert; each redundant slot goes, one at a time, to the expert
   whose load per replica is currently the highest.
2. **Pack** (:func:`balanced_packing`): put items (expert groups, or expert
   replicas weighted by their share of the load) into packs that must each
   take the same number of items, heaviest item first, each into the
   currently lightest pack that still has room (greedy longest-processing-
   time with a cardinality limit).
3. **Hierarchical policy** (when the expert groups of group-limited routing
   divide evenly over the nodes): pack whole expert groups onto nodes first
   (so a group's experts stay on one node and tokens rarely cross nodes),
   then replicate inside each node, then pack the node's replicas onto its
   ranks. Otherwise the **global policy**: the same with one group and one
   node — replicate over all experts, pack the replicas onto all ranks.

Everything here runs rarely (every ``step_interval`` engine steps) on small
tensors; the loops run over items (at most ``num_physical`` iterations) and are
vectorised over layers.

The rest of the module: :class:`ExpertPlacement` (the maps, as vLLM names
them: ``physical_to_logical``, ``logical_to_physical``,
``logical_replica_count``), :class:`ExpertLoadWindow` (per-step per-expert
token counts over a sliding window), the imbalance measures
(:func:`rank_loads`, :func:`imbalance_ratio`, :func:`expert_imbalance_ratio`),
:func:`preserve_slots` (keep replicas where they already are, so a rebalance
moves as few weights as possible) and :func:`move_expert_weights` (the
transfer of expert weights between ranks with ``torch.distributed``
point-to-point operations).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tokenmill import envs
from tokenmill.metrics.stats import EPLB_MAX_LOAD_SERIES, EplbStats

logger = logging.getLogger(__name__)

__all__ = [
    "ExpertPlacement", "ExpertLoadWindow", "balanced_packing", "replicate_experts", "rebalance_experts",
    "rank_loads", "imbalance_ratio", "expert_imbalance_ratio", "preserve_slots", "plan_moves",
    "move_expert_weights", "MoveStats", "EplbController", "slot_imbalance_ratio",
]


# ---------------------------------------------------------------------------------------------------------------
# The maps


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
        _check_sizes(num_logical, num_physical, num_ranks)
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


def _check_sizes(num_logical: int, num_physical: int, num_ranks: int) -> None:
    if num_logical < 1 or num_ranks < 1:
        raise ValueError(f"need >= 1 logical expert and >= 1 rank, got {num_logical} and {num_ranks}")
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} logical experts")
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical expert slots do not divide over {num_ranks} ranks "
                         "(num_logical_experts + num_redundant_experts must be a multiple of the expert-parallel size)")


# ---------------------------------------------------------------------------------------------------------------
# The placement algorithm (DeepSeek EPLB)


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each,
    keeping the heaviest pack as light as the greedy rule allows.

    Items are taken heaviest first; each goes into the lightest pack that still
    has room (ties: the lowest pack index). Greedy longest-processing-time
    scheduling with a cardinality limit (DeepSeek EPLB's packing step).

    Args:
        weight: ``[X, n]`` item weights (any real dtype); the ``X`` rows are
            independent problems (layers, or layer x node).
        num_packs: packs per row; must divide ``n``.

    Returns:
        ``(pack_index, rank_in_pack)``, both ``[X, n]`` int64: the pack of each
        item and its position inside the pack (0 .. n/num_packs - 1).

    Raises:
        ValueError: ``num_packs`` does not divide ``n``.
    """
    num_rows, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    cap = n // num_packs
    w = weight.detach().to(torch.float64).cpu()
    rows = torch.arange(num_rows)
    if cap == 1:     # one item per pack: any assignment has the same heaviest pack
        pack_index = torch.arange(n).expand(num_rows, -1).clone()
        return pack_index, torch.zeros_like(pack_index)
    order = torch.sort(w, dim=-1, descending=True, stable=True).indices     # heaviest first
    pack_load = torch.zeros(num_rows, num_packs, dtype=torch.float64)
    pack_count = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    pack_index = torch.empty(num_rows, n, dtype=torch.int64)
    rank_in_pack = torch.empty(num_rows, n, dtype=torch.int64)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for j in range(n):
        item = order[:, j]
        p = torch.where(pack_count < cap, pack_load, inf).argmin(dim=-1)   # lightest pack with room
        pack_index[rows, item] = p
        rank_in_pack[rows, item] = pack_count[rows, p]
        pack_load[rows, p] += w[rows, item]
        pack_count[rows, p] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``num_physical - n`` extra replicas to the experts whose load per replica is highest.

    Slot ``i < n`` holds expert ``i``; each further slot goes to
    ``argmax(load / replicas)`` at that moment (ties: the lowest expert id),
    which minimises the largest per-replica load greedily (DeepSeek EPLB's
    replication step).

    Args:
        weight: ``[X, n]`` load of each logical expert (tokens).
        num_physical: slots per row, ``>= n``.

    Returns:
        ``(phy_to_log, replica_index, replica_count)``: ``[X, num_physical]``
        logical expert of each slot, ``[X, num_physical]`` which replica of its
        expert the slot is (0-based), ``[X, n]`` replicas per expert; all int64.

    Raises:
        ValueError: ``num_physical < n``.
    """
    num_rows, n = weight.shape
    if num_physical < n:
        raise ValueError(f"{num_physical} slots cannot hold {n} experts")
    w = weight.detach().to(torch.float64).cpu()
    rows = torch.arange(num_rows)
    phy_to_log = torch.arange(num_physical).remainder(n).expand(num_rows, -1).clone()
    replica_index = torch.zeros(num_rows, num_physical, dtype=torch.int64)
    count = torch.ones(num_rows, n, dtype=torch.int64)
    for i in range(n, num_physical):
        e = (w / count).argmax(dim=-1)
        phy_to_log[:, i] = e
        replica_index[:, i] = count[rows, e]
        count[rows, e] += 1
    return phy_to_log, replica_index, count


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of ``perm`` ``[X, n]``: ``inv[x, perm[x, i]] = i``."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).clone())
    return inv


def _rebalance_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                            num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups onto nodes, replicas inside nodes, replicas onto each node's ranks.

    Returns ``(phy_to_log [L, P], replica_index [L, P], replica_count [L, E])``.
    """
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    ranks_per_node = num_ranks // num_nodes
    phys_per_node = num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks
    log_per_node = num_logical // num_nodes

    # 1. whole groups onto nodes; "node-major" expert order: node 0's groups first, each group's experts in order
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)
    g_pack, g_rank = balanced_packing(group_load, num_nodes)                          # [L, G]
    new_group = g_pack * groups_per_node + g_rank                                     # position of each group
    node_major = (new_group.unsqueeze(-1) * group_size + torch.arange(group_size)).flatten(1)   # [L, E]: log -> nm
    nm_to_log = _inverse_permutation(node_major)

    # 2. replicas inside each node, from the load of the node's experts
    nm_load = weight.gather(-1, nm_to_log).view(num_layers * num_nodes, log_per_node)
    phy_to_nm, phy_replica, nm_count = replicate_experts(nm_load, phys_per_node)       # [L*N, P/N], [L*N, E/N]

    # 3. the node's replicas (each carrying load / replicas) onto its ranks, equal slots per rank
    replica_load = (nm_load / nm_count).gather(-1, phy_to_nm)
    r_pack, r_rank = balanced_packing(replica_load, ranks_per_node)
    slot_of_phy = r_pack * slots_per_rank + r_rank                                    # [L*N, P/N]
    phy_of_slot = _inverse_permutation(slot_of_phy)

    slot_nm = phy_to_nm.gather(-1, phy_of_slot)
    slot_nm = slot_nm + torch.arange(num_nodes).repeat(num_layers).unsqueeze(-1) * log_per_node
    slot_nm = slot_nm.view(num_layers, num_physical)
    phy_to_log = nm_to_log.gather(-1, slot_nm)
    replica_index = phy_replica.gather(-1, phy_of_slot).view(num_layers, num_physical)
    replica_count = nm_count.view(num_layers, num_logical).gather(-1, node_major)
    return phy_to_log, replica_index, replica_count


def rebalance_experts(load: torch.Tensor, num_physical: int, num_groups: int = 1, num_nodes: int = 1,
                      num_ranks: int = 1) -> ExpertPlacement:
    """The placement of DeepSeek EPLB for the measured ``load``.

    Hierarchical policy when ``num_groups`` (expert groups of group-limited
    routing; 1 for models without it) divide evenly over ``num_nodes`` and
    the ranks over the nodes; otherwise the global policy (one group, one
    node: replicate over all experts, pack the replicas onto all ranks). See
    the module docstring.

    Args:
        load: ``[num_layers, num_logical]`` tokens routed to each logical
            expert (any real dtype; a sliding-window sum).
        num_physical: slots per layer (``num_logical + num_redundant_experts``),
            a multiple of ``num_ranks``.
        num_groups: expert groups (must divide ``num_logical``).
        num_nodes: machines the expert-parallel ranks span.
        num_ranks: expert-parallel ranks.

    Returns:
        The :class:`ExpertPlacement`; each rank gets ``num_physical / num_ranks``
        slots and every logical expert at least one.

    Raises:
        ValueError: sizes that do not fit (``num_physical < num_logical``, slots
            not a multiple of the ranks, groups not dividing the experts).
    """
    if load.dim() != 2:
        raise ValueError(f"load must be [num_layers, num_logical_experts], got {tuple(load.shape)}")
    num_layers, num_logical = load.shape
    _check_sizes(num_logical, num_physical, num_ranks)
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"{num_groups} expert groups do not divide {num_logical} experts")
    w = load.detach().to(torch.float64).cpu().clamp_min(0)
    hierarchical = (num_nodes >= 1 and num_groups % num_nodes == 0 and num_ranks % num_nodes == 0
                    and (num_physical // num_nodes) % (num_ranks // num_nodes) == 0)
    if not hierarchical:
        num_groups = num_nodes = 1
    phy_to_log, _, _ = _rebalance_hierarchical(w, num_physical, num_groups, num_nodes, num_ranks)
    return ExpertPlacement.from_physical_to_logical(phy_to_log, num_logical, num_ranks)


def preserve_slots(new: ExpertPlacement, old: ExpertPlacement) -> ExpertPlacement:
    """``new`` with each rank's slots reordered so that a slot keeps its expert when it can.

    A rebalance decides which experts a rank holds, not in which of its slots;
    keeping a replica in the slot it already occupies means its weights need
    not be copied at all. Per layer and rank, slots whose old expert is still
    wanted on that rank keep it; the other wanted experts fill the remaining
    slots in order.

    Raises:
        ValueError: the placements' shapes or rank counts differ.
    """
    if (new.physical_to_logical.shape != old.physical_to_logical.shape or new.num_ranks != old.num_ranks
            or new.num_logical != old.num_logical):
        raise ValueError("placements of different shapes")
    s, out = new.slots_per_rank, new.physical_to_logical.clone()
    old_rows, new_rows = old.physical_to_logical.tolist(), new.physical_to_logical.tolist()
    for layer in range(new.num_layers):
        for r in range(new.num_ranks):
            want = new_rows[layer][r * s:(r + 1) * s]
            have = old_rows[layer][r * s:(r + 1) * s]
            remaining: dict[int, int] = {}
            for e in want:
                remaining[e] = remaining.get(e, 0) + 1
            slot: list[int | None] = [None] * s
            for i, e in enumerate(have):
                if remaining.get(e, 0) > 0:
                    slot[i] = e
                    remaining[e] -= 1
            rest = iter(e for e, c in remaining.items() for _ in range(c))
            out[layer, r * s:(r + 1) * s] = torch.tensor([e if e is not None else next(rest) for e in slot])
    return ExpertPlacement.from_physical_to_logical(out, new.num_logical, new.num_ranks)


# ---------------------------------------------------------------------------------------------------------------
# Load measures


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


# ---------------------------------------------------------------------------------------------------------------
# Sliding window of measured loads


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


# ---------------------------------------------------------------------------------------------------------------
# Moving weights


@dataclass(frozen=True)
class Move:
    """One slot of one layer that must receive an expert's weights.

    Attributes:
        layer: MoE layer index.
        dst_slot: global physical slot to fill (on rank ``dst_slot // slots_per_rank``).
        src_slot: global physical slot that holds the expert in the old placement.
        expert: the logical expert.
    """

    layer: int
    dst_slot: int
    src_slot: int
    expert: int


def plan_moves(old: ExpertPlacement, new: ExpertPlacement) -> list[Move]:
    """Every slot whose expert changes, with the old slot to copy it from.

    The source is an old slot on the destination's own rank when there is one
    (a local copy); otherwise the old replicas take turns (round robin over the
    receivers of that expert), spreading the sending. Every rank computes the
    same plan from the same two placements, so senders and receivers agree
    without talking.

    Raises:
        ValueError: the placements' shapes differ.
    """
    if old.physical_to_logical.shape != new.physical_to_logical.shape or old.num_ranks != new.num_ranks:
        raise ValueError("placements of different shapes")
    s = new.slots_per_rank
    moves: list[Move] = []
    old_rows, new_rows = old.physical_to_logical.tolist(), new.physical_to_logical.tolist()
    old_l2p = old.logical_to_physical.tolist()
    for layer in range(new.num_layers):
        turn: dict[int, int] = {}
        for p, e in enumerate(new_rows[layer]):
            if old_rows[layer][p] == e:
                continue
            holders = [q for q in old_l2p[layer][e] if q >= 0]
            local = [q for q in holders if q // s == p // s]
            if local:
                src = local[0]
            else:
                k = turn.get(e, 0)
                turn[e] = k + 1
                src = holders[k % len(holders)]
            moves.append(Move(layer, p, src, e))
    return moves


@dataclass
class MoveStats:
    """What :func:`move_expert_weights` did on this rank.

    Attributes:
        num_moves: slots (all ranks) whose expert changed.
        sent, received, copied: expert replicas this rank sent, received from
            another rank, copied between its own slots.
        bytes_sent, bytes_received: payload bytes on this rank.
        seconds: wall time on this rank.
    """

    num_moves: int = 0
    sent: int = 0
    received: int = 0
    copied: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


def move_expert_weights(weights: Sequence[Sequence[torch.Tensor]], old: ExpertPlacement, new: ExpertPlacement,
                        rank: int, group=None, global_ranks: Sequence[int] | None = None) -> MoveStats:
    """Rewrite this rank's expert slots from ``old`` to ``new``, fetching what it lacks from the other ranks.

    Collective over the expert-parallel group: every rank of it calls this
    with the same ``old``/``new``. Per layer, every rank posts its sends (old
    slots another rank needs) and receives (into fresh buffers) as one
    ``torch.distributed.batch_isend_irecv`` (gloo on CPU, NCCL on CUDA), waits,
    and only then writes the received and locally copied replicas into its
    slots — so a slot that is sent and overwritten in the same rebalance sends
    its old weights. Called between engine steps, nothing reads the weights
    meanwhile; the caller switches the maps after it returns.

    Args:
        weights: per MoE layer, the tensors holding that layer's local slots,
            each ``[slots_per_rank, ...]`` (e.g. the fused gate/up and the down
            projection, plus scales of a quantised format).
        old, new: the placements before and after (same shapes).
        rank: this rank's index in the expert-parallel group.
        group: the ``torch.distributed`` group of the expert-parallel ranks
            (None: the default group; unused with one rank).
        global_ranks: global rank of each group rank (default: the identity).

    Returns:
        :class:`MoveStats`.

    Raises:
        ValueError: ``weights`` do not match the placements' layers / slots.
        RuntimeError: from ``torch.distributed`` (a peer died or timed out).
    """
    t0 = time.perf_counter()
    s = new.slots_per_rank
    if len(weights) != new.num_layers:
        raise ValueError(f"weights for {len(weights)} layers, placement has {new.num_layers}")
    for layer_w in weights:
        for w in layer_w:
            if w.shape[0] != s:
                raise ValueError(f"expert weight of shape {tuple(w.shape)}: expected {s} local slots first")
    glob = list(global_ranks) if global_ranks is not None else list(range(new.num_ranks))
    moves = plan_moves(old, new)
    stats = MoveStats(num_moves=len(moves))
    by_layer: dict[int, list[Move]] = {}
    for m in moves:
        by_layer.setdefault(m.layer, []).append(m)
    lo = rank * s
    for layer, layer_moves in by_layer.items():
        tensors = weights[layer]
        ops: list[dist.P2POp] = []
        staged: list[tuple[int, list[torch.Tensor]]] = []     # (local dst slot, new contents per tensor)
        n_t = len(tensors)
        for k, m in enumerate(layer_moves):     # tag k * n_t + t: the same on both sides (same plan)
            src_rank, dst_rank = m.src_slot // s, m.dst_slot // s
            if dst_rank == rank and src_rank == rank:
                staged.append((m.dst_slot - lo, [w[m.src_slot - lo].clone() for w in tensors]))
                stats.copied += 1
            elif dst_rank == rank:
                bufs = [torch.empty_like(w[0]) for w in tensors]
                ops += [dist.P2POp(dist.irecv, b, glob[src_rank], group=group, tag=k * n_t + t)
                        for t, b in enumerate(bufs)]
                staged.append((m.dst_slot - lo, bufs))
                stats.received += 1
                stats.bytes_received += sum(b.numel() * b.element_size() for b in bufs)
            elif src_rank == rank:
                outs = [w[m.src_slot - lo].contiguous() for w in tensors]
                ops += [dist.P2POp(dist.isend, o, glob[dst_rank], group=group, tag=k * n_t + t)
                        for t, o in enumerate(outs)]
                stats.sent += 1
                stats.bytes_sent += sum(o.numel() * o.element_size() for o in outs)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for slot, bufs in staged:
            for w, b in zip(tensors, bufs):
                w[slot].copy_(b)
    stats.seconds = time.perf_counter() - t0
    return stats


# ---------------------------------------------------------------------------------------------------------------
# The per-rank driver


class EplbController:
    """Expert-parallel load balancing on one rank: counts every step, rebalances every ``step_interval``.

    Drives the model's MoE layers (:class:`tokenmill.model.layers.moe.FusedMoE`
    or anything with the same attributes: ``num_experts``,
    ``num_physical_experts``, ``physical_to_logical`` ``[P]``, ``w13`` / ``w2``
    ``[slots_per_rank, ...]``, ``take_expert_load()`` -> ``[P]`` int64 and
    ``set_placement(physical_to_logical)``). After every engine step
    (:meth:`after_step`) it folds the layers' per-slot counters into the
    sliding window of logical-expert loads; every ``step_interval`` steps it
    all-reduces the window over the expert-parallel group (every rank counted
    the tokens it routed), computes the DeepSeek EPLB placement, keeps
    replicas in the slots they already occupy (:func:`preserve_slots`), and —
    if the predicted imbalance improves — moves the weights
    (:func:`move_expert_weights`) and switches every layer's maps. All of it
    runs between two engine steps on every rank at the same step count (the
    ranks step in lockstep), so no forward ever sees half-moved weights or a
    map that disagrees with them: service pauses for the rebalance's duration
    (``eplb_rebalance_seconds_total``), it never stops.

    With one expert-parallel rank every slot is local: a rebalance only
    changes the maps (which replica a token uses) and the metrics; the rank's
    load — all of it — cannot change.

    Args:
        layers: the MoE layers of this rank's model, in layer order.
        config: :class:`tokenmill.config.EplbConfig`.
        ep_rank, ep_size: this rank's place in the expert-parallel group.
        group: the group's ``torch.distributed`` process group (None: the
            default group; unused when ``ep_size == 1``).
        global_ranks: global rank of each group rank (default: the identity).
        num_groups, num_nodes: for the hierarchical policy (expert groups of
            group-limited routing, machines); 1 and 1 use the global policy.

    Raises:
        ValueError: no layers, layers of different sizes, or slots that do not
            divide over ``ep_size``.
    """

    # refresh the metrics snapshot (two small all-reduces) this often, in steps: TOKENMILL_EPLB_STATS_STEPS,
    # read when the state is built (``__init__``)
    STATS_EVERY = 32

    def __init__(self, layers: Sequence, config, ep_rank: int = 0, ep_size: int = 1, group=None,
                 global_ranks: Sequence[int] | None = None, num_groups: int = 1, num_nodes: int = 1) -> None:
        if not layers:
            raise ValueError("EPLB needs a mixture-of-experts model (no MoE layer found)")
        first = layers[0]
        num_logical, num_physical = int(first.num_experts), int(first.num_physical_experts)
        for layer in layers:
            if (int(layer.num_experts), int(layer.num_physical_experts)) != (num_logical, num_physical):
                raise ValueError("MoE layers with different expert counts")
        self.layers = list(layers)
        self.config = config
        self.STATS_EVERY = envs.TOKENMILL_EPLB_STATS_STEPS
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.group, self.global_ranks = group, global_ranks
        self.num_groups, self.num_nodes = num_groups, num_nodes
        p2l = torch.stack([layer.physical_to_logical.detach().to("cpu", torch.int64) for layer in self.layers])
        self.placement = ExpertPlacement.from_physical_to_logical(p2l, num_logical, ep_size)
        self.window = ExpertLoadWindow(len(self.layers), num_logical, config.window_size)
        self._total = torch.zeros(len(self.layers), num_physical, dtype=torch.int64)   # this rank's counts
        self._total_at_rebalance = torch.zeros_like(self._total)      # the group's totals at the last rebalance
        self.num_steps = 0
        self.num_rebalances = 0
        self.num_placement_changes = 0
        self.num_experts_moved = 0
        self.rebalance_seconds_total = 0.0
        self.last_rebalance_seconds = 0.0
        self.imbalance_before: float | None = None
        self.imbalance_after: float | None = None
        self.last_move: MoveStats | None = None
        self._stats = None

    # -- counting ------------------------------------------------------------------------------------------------
    def after_step(self) -> bool:
        """Record this step's counters; rebalance when the interval is reached.

        Collective over the expert-parallel group every ``STATS_EVERY``,
        ``log_balancedness_interval`` (with ``log_balancedness``) and
        ``step_interval`` steps: every rank must call it once per engine step.

        Returns:
            True when this call rebalanced.
        """
        counts = torch.stack([layer.take_expert_load().detach().to("cpu", torch.int64) for layer in self.layers])
        self.window.record(logical_counts(counts, self.placement))
        self._total += counts
        self.num_steps += 1
        cfg = self.config
        if cfg.log_balancedness and self.num_steps % cfg.log_balancedness_interval == 0:
            self._log_balancedness(counts)
        if self.num_steps % cfg.step_interval == 0:
            self.rebalance()
            return True
        if self.num_steps % self.STATS_EVERY == 0 or self._stats is None:
            self._stats = self._snapshot(self._all_reduce(self._total), self._all_reduce(self.window.load()))
        return False

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return t.clone()
        out = t.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _rank_loads_measured(self, physical_counts: torch.Tensor) -> torch.Tensor:
        """``[L, ep_size]`` assignments each rank's slots computed (measured, not predicted)."""
        return physical_counts.to(torch.float64).view(len(self.layers), self.ep_size, -1).sum(-1)

    def _log_balancedness(self, counts: torch.Tensor) -> None:
        per_rank = self._rank_loads_measured(self._all_reduce(counts))
        ratio = imbalance_ratio(per_rank)
        if self.ep_rank == 0:
            logger.info(
                "EPLB step %d: balancedness %.4f (mean / max tokens per rank; imbalance ratio %.3f)",
                self.num_steps, 1.0 / ratio, ratio)

    # -- rebalancing ---------------------------------------------------------------------------------------------
    def rebalance(self) -> bool:
        """Compute a placement from the window and switch to it if it predicts a lower imbalance.

        Collective over the expert-parallel group.

        Returns:
            True when the placement changed (weights moved / maps switched).

        Raises:
            RuntimeError: from ``torch.distributed`` (a peer died or timed out).
        """
        t0 = time.perf_counter()
        load = self._all_reduce(self.window.load())                      # [L, E] over the group
        total = self._all_reduce(self._total)
        self.imbalance_before = imbalance_ratio(self._rank_loads_measured(total - self._total_at_rebalance))
        self._total_at_rebalance = total
        old = self.placement
        new = preserve_slots(rebalance_experts(load, old.num_physical, self.num_groups, self.num_nodes,
                                               self.ep_size), old)
        predicted_old = imbalance_ratio(rank_loads(load, old))
        predicted_new = imbalance_ratio(rank_loads(load, new))
        # switch when the rank imbalance drops; on a tie (always with one rank) when the busiest replica's share does
        key_old = (round(predicted_old, 9), round(slot_imbalance_ratio(load, old), 9))
        key_new = (round(predicted_new, 9), round(slot_imbalance_ratio(load, new), 9))
        changed = key_new < key_old and not torch.equal(new.physical_to_logical, old.physical_to_logical)
        if changed:
            self.last_move = move_expert_weights([[layer.w13.data, layer.w2.data] for layer in self.layers],
                                                 old, new, self.ep_rank, self.group, self.global_ranks)
            for i, layer in enumerate(self.layers):
                layer.set_placement(new.physical_to_logical[i])
            self.placement = new
            self.num_placement_changes += 1
            self.num_experts_moved += self.last_move.num_moves
        self.imbalance_after = predicted_new if changed else predicted_old
        self.num_rebalances += 1
        self.last_rebalance_seconds = time.perf_counter() - t0
        self.rebalance_seconds_total += self.last_rebalance_seconds
        self._stats = self._snapshot(total, load)
        if self.ep_rank == 0:
            logger.info(
                "EPLB rebalance %d at step %d: imbalance %.3f measured -> %.3f predicted (%s; %d replicas moved, "
                "%.1f ms)", self.num_rebalances, self.num_steps, self.imbalance_before, self.imbalance_after,
                "placement changed" if changed else "placement kept: no gain",
                self.last_move.num_moves if changed and self.last_move else 0, 1e3 * self.last_rebalance_seconds)
        return changed

    # -- reporting -----------------------------------------------------------------------------------------------
    def _snapshot(self, total: torch.Tensor, load: torch.Tensor) -> EplbStats:
        """Stats from the group's cumulative per-slot counts ``total`` ``[L, P]`` and the window ``load`` ``[L, E]``.

        The measured imbalance covers the steps since the last rebalance; right
        after one (no step yet) it stays the value measured before it.
        """
        since = total - self._total_at_rebalance
        if int(since.sum()) > 0 or self.imbalance_before is None:
            measured_ratio = imbalance_ratio(self._rank_loads_measured(since))
        else:
            measured_ratio = self.imbalance_before
        num_layers, num_logical = load.shape
        if num_layers * num_logical <= EPLB_MAX_LOAD_SERIES:
            labels, rows = [str(i) for i in range(num_layers)], load.tolist()
        else:
            labels, rows = ["all"], [load.sum(0).tolist()]
        return EplbStats(
            num_ranks=self.ep_size, num_moe_layers=num_layers, num_logical_experts=num_logical,
            num_physical_experts=self.placement.num_physical, window_steps=self.window.num_steps,
            load_layers=labels, expert_load=rows,
            imbalance_ratio=measured_ratio,
            rank_load_total=self._rank_loads_measured(total).to(torch.int64).tolist(),
            expert_imbalance_ratio=expert_imbalance_ratio(load),
            imbalance_before=self.imbalance_before, imbalance_after=self.imbalance_after,
            num_rebalances=self.num_rebalances, num_placement_changes=self.num_placement_changes,
            num_experts_moved=self.num_experts_moved, rebalance_seconds_total=self.rebalance_seconds_total,
            last_rebalance_seconds=self.last_rebalance_seconds)

    def stats(self) -> EplbStats:
        """The latest :class:`~tokenmill.metrics.stats.EplbStats` (refreshed every ``STATS_EVERY`` steps
        and at each rebalance; local, no communication)."""
        if self._stats is None:
            z = torch.zeros(len(self.layers), self.placement.num_logical, dtype=torch.int64)
            self._stats = self._snapshot(self._total.clone(), z)
        return self._stats

    def describe(self) -> str:
        """The start-up line: expert slots per rank, redundant experts, the first MoE layer's placement."""
        pl = self.placement
        ranks = "; ".join(f"rank {r}: {row}" for r, row in enumerate(pl.experts_per_rank(0)))
        return (f"EPLB on: {len(self.layers)} MoE layers x {pl.num_logical} experts, {pl.num_redundant} redundant "
                f"-> {pl.num_physical} slots, {pl.slots_per_rank} per rank over {pl.num_ranks} expert-parallel "
                f"rank(s); window {self.config.window_size} steps, rebalance every {self.config.step_interval} "
                f"steps; layer 0 experts per rank: {ranks}"
                + (" (one rank: a rebalance changes only the replica maps and metrics)" if pl.num_ranks == 1 else ""))


# ---------------------------------------------------------------------------------------------------------------
# Start-up


def expert_parallel_size(parallel_config, data_parallel_size: int = 1) -> int:
    """Ranks the experts are spread over with ``--enable-expert-parallel``: the tensor-parallel group of a
    pipeline stage times the data-parallel engine cores; else 1 (every rank holds every expert)."""
    if not parallel_config.enable_expert_parallel:
        return 1
    return parallel_config.tensor_parallel_size * data_parallel_size


def check_eplb_startup(parallel_config, arch, data_parallel_size: int = 1) -> None:
    """Refuse at start-up what ``--enable-eplb`` cannot do (before any weight or worker is loaded).

    Args:
        parallel_config: :class:`tokenmill.config.ParallelConfig`.
        arch: the checkpoint's :class:`~tokenmill.model.arch_config.ModelArchConfig`.

    Raises:
        ValueError: EPLB on a dense model, without ``--enable-expert-parallel``
            (vLLM's rule), or with ``num_experts + num_redundant_experts`` not a
            multiple of the expert-parallel size (the message says which
            ``num_redundant_experts`` values fit).
    """
    if not parallel_config.enable_eplb:
        return
    num_experts = arch.num_experts
    if not arch.is_moe:
        raise ValueError(f"--enable-eplb needs a mixture-of-experts model; {arch.architecture} has no experts")
    if not parallel_config.enable_expert_parallel:
        raise ValueError("--enable-eplb needs --enable-expert-parallel (experts placed over the ranks)")
    ep = expert_parallel_size(parallel_config, data_parallel_size)
    r = parallel_config.eplb.num_redundant_experts
    if (num_experts + r) % ep:
        fits = [k for k in range(r, r + 2 * ep) if (num_experts + k) % ep == 0][:2]
        raise ValueError(f"--eplb-config num_redundant_experts {r}: {num_experts} experts + {r} redundant slots do "
                         f"not divide over {ep} expert-parallel ranks; use e.g. {fits}")


def build_controller(config, model, ep_rank: int = 0, ep_size: int = 1, group=None,
                     global_ranks: Sequence[int] | None = None) -> "EplbController | None":
    """The rank's :class:`EplbController` for ``model`` (None without ``--enable-eplb``); logs its start-up line.

    ``model.moe_layers()`` lists the MoE layers (the MoE models' helper).

    Raises:
        ValueError: ``--enable-eplb`` on a model with no MoE layer.
    """
    par = config.parallel
    if not par.enable_eplb:
        return None
    moe_layers = getattr(model, "moe_layers", None)
    ctl = EplbController(moe_layers() if moe_layers is not None else [], par.eplb, ep_rank=ep_rank, ep_size=ep_size,
                         group=group, global_ranks=global_ranks)
    if ep_rank == 0:
        logger.info("%s", ctl.describe())
    return ctl
