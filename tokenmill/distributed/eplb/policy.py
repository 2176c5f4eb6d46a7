"""The placement policy: DeepSeek's EPLB (github.com/deepseek-ai/EPLB; DeepSeek-V3 technical report, arXiv
2412.19437, §3.4), written from its description: replicate the hottest experts, pack replicas onto ranks
(hierarchically over nodes when the expert groups divide evenly), and keep replicas where they already are."""

from __future__ import annotations

import torch

from tokenmill.distributed.eplb.placement import ExpertPlacement, check_sizes


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
    check_sizes(num_logical, num_physical, num_ranks)
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
