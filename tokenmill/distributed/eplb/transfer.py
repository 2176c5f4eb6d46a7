"""Moving expert weights for a new placement: which slots must receive which expert (:func:`plan_moves`) and the
point-to-point ``torch.distributed`` transfer between ranks (:func:`move_expert_weights`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tokenmill.distributed.eplb.placement import ExpertPlacement


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
