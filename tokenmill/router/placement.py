"""Prefix groups and their placement over the replicas' KV pools (``kv_aware``'s placement layer).

A cost per request (Dynamo's, :class:`~tokenmill.router.policies.KVAware`) prices where *this* request
waits least; it does not see what a move does to the requests that follow. Measured in the simulated
family of ``benchmarks/routing.py`` (2 replicas of 112 blocks, 3 groups of ~46-block prefixes, 2 in
flight): a group's request found its replica's queue holding another group's cold prefill (47 blocks)
and went to the other replica (cost 140 vs 143), which then held three groups' prefixes for a pool of
two; every group ended up on both replicas and evicted the others (79% of the best placement's cached
tokens on that seed, 55% for round_robin). The fix is a placement, in the spirit of cache-aware
load balancing over a partition of the prefixes (Preble, arXiv 2407.00023, §4: prefixes are assigned
to GPUs by their cache footprint and load, and re-balanced only when load demands it; SGLang's
router keeps one tree per worker for the same reason):

* **Groups.** A router-side index of the hash chains it routed (:class:`PrefixGroups`). A request whose
  chain shares at least ``member_ratio`` of a known group's shared prefix (and ``min_share_blocks``)
  belongs to that group; the group's size is the prefix its members share (blocks). A request that
  matches no group starts a provisional one (size: its whole chain, until a second member shows the
  shared part). No history is needed: the first request of a group is placed as a group.
* **Homes and capacity.** Each group has home replicas (where its requests were sent and its prefix
  still is: a home whose KV events show the group's first block gone, with no request computing it,
  is dropped). A replica's room is its pool (the size it reports in ``/metrics``, else learnt from
  its events) minus the sizes of the groups homed there minus the working set of its requests in
  flight (their unshared prompt blocks and output blocks) and this request's.
* **The rule** (:meth:`Placement.allowed`): a member may go to its live homes, or to a replica with
  room for its group (a move or a copy, which the cost then weighs: its recompute term charges the
  prefix); a new group goes to the replicas with room for it and the least committed load (recent
  requests of their groups), so groups spread over the replicas while they fit and are partitioned
  when their total exceeds a pool. When no replica has room: first the copies of replicated groups
  are given up, then the group spills to the replica already over its capacity (one replica thrashes,
  the others keep their groups; the best static placement does the same), or to the one whose groups
  are coldest. The cost then chooses among the allowed replicas by load.

Everything is per pool of one model; the policy owns one :class:`Placement`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.router.backends import Backend
from tokenmill.router.kv_index import KVIndex


@dataclass
class PrefixGroup:
    """A set of requests sharing a prefix.

    Attributes:
        gid: its id.
        chain: hash chain of the shared prefix, ``[size]`` blocks (provisional: the first request's chain).
        provisional: only one request seen so far.
        homes: replica index -> request sequence number when it was last sent there.
        heat: recent requests of the group (exponentially decayed per request routed, see ``half_life``).
        last: sequence number of its last request.
    """

    gid: int
    chain: list[bytes]
    provisional: bool = True
    homes: dict[int, int] = field(default_factory=dict)
    heat: float = 0.0
    last: int = 0

    @property
    def size(self) -> int:
        """Blocks of the shared prefix."""
        return len(self.chain)


@dataclass
class PlacementInfo:
    """What :meth:`Placement.allowed` decided for one request (passed back to :meth:`Placement.routed`).

    Attributes:
        kind: ``member`` (of a group with a live home), ``new`` (a new group, or one whose homes lost it,
            placed where it fits), ``spill`` (no replica has room for it), ``off`` (no placement: pool sizes
            unknown or no hashes).
        group: the group (None for a new one).
        shared: leading blocks the request shares with the group index.
        size: the group's size in blocks, as placed.
        tail: the request's working set beyond the group (unshared prompt and output blocks).
        room: each candidate's room before this request (blocks; None: unknown).
        homes: for a member, its live homes among the candidates (the others allowed are moves/copies).
    """

    kind: str
    group: PrefixGroup | None
    shared: int
    size: int
    tail: int
    room: dict[int, float | None] = field(default_factory=dict)
    homes: list[int] = field(default_factory=list)


class PrefixGroups:
    """The router's own index of the hash chains it routed: block hash -> group (bounded, LRU).

    Args:
        member_ratio: a request belongs to a group when it shares at least this share of the group's prefix.
        min_share_blocks: ... and at least this many blocks (a shared chat-template preamble is no group).
        max_groups: groups kept (least recently used dropped).
        max_nodes: block hashes kept.
        half_life: requests after which a group's heat halves.
    """

    def __init__(self, member_ratio: float = 0.5, min_share_blocks: int = 2, max_groups: int = 4096,
                 max_nodes: int = 1 << 18, half_life: float = 64.0) -> None:
        if not 0.0 < member_ratio <= 1.0:
            raise ValueError(f"member_ratio must be in (0, 1], got {member_ratio}")
        self.member_ratio = member_ratio
        self.min_share_blocks = max(1, min_share_blocks)
        self.max_groups = max_groups
        self.max_nodes = max_nodes
        self.half_life = half_life
        self.groups: OrderedDict[int, PrefixGroup] = OrderedDict()
        self._nodes: OrderedDict[bytes, int] = OrderedDict()
        self._next_gid = 0
        self.seq = 0     # requests routed

    def heat(self, g: PrefixGroup) -> float:
        """``g``'s heat now (decayed to the current request count)."""
        return g.heat * 0.5 ** ((self.seq - g.last) / self.half_life)

    def classify(self, hashes: Sequence[bytes]) -> tuple[PrefixGroup | None, int]:
        """``(group, shared blocks)`` of a chain: its group, or None when it starts a new one."""
        k = 0
        nodes = self._nodes
        while k < len(hashes) and hashes[k] in nodes:
            k += 1
        if k == 0:
            return None, 0
        g = self.groups.get(nodes[hashes[k - 1]])
        if g is None:
            return None, k
        need = max(self.min_share_blocks, math.ceil(self.member_ratio * g.size))
        return (g, k) if k >= need else (None, k)

    def routed(self, hashes: Sequence[bytes], replica: int, group: PrefixGroup | None, shared: int) -> PrefixGroup:
        """Record that a chain was sent to ``replica`` as a member of ``group`` (None: a new group)."""
        self.seq += 1
        if group is None or group.gid not in self.groups:
            group = PrefixGroup(self._next_gid, list(hashes))
            self._next_gid += 1
            self.groups[group.gid] = group
            while len(self.groups) > self.max_groups:
                self.groups.popitem(last=False)
        else:
            if group.provisional:
                group.chain = list(hashes[:shared])
                group.provisional = False
            elif shared > group.size:
                group.chain = list(hashes[:shared])
            self.groups.move_to_end(group.gid)
        group.heat = self.heat(group) + 1.0
        group.last = self.seq
        group.homes[replica] = self.seq
        nodes = self._nodes
        for h in hashes[:shared]:
            if h in nodes:
                nodes.move_to_end(h)
        for h in hashes[shared:]:
            nodes[h] = group.gid
            nodes.move_to_end(h)
        while len(nodes) > self.max_nodes:
            nodes.popitem(last=False)
        return group

    def drop_replica(self, replica: int) -> None:
        """``replica`` went down: it is no group's home any more."""
        for g in self.groups.values():
            g.homes.pop(replica, None)


class Placement:
    """Which replicas a request may go to so that prefix groups stay resident (module docstring).

    Args:
        index: the pool's KV index (pool sizes, which blocks each replica holds).
        expected: ``expected(replica, block_hash)``: a request routed there is computing that block, or
            its events are still due (the policy's pending and unconfirmed blocks).
        groups: the group index (a fresh :class:`PrefixGroups` by default).
        block_size: tokens per block (callable: learnt from events).
        provisional_window: requests during which a provisional group keeps its room reserved.
    """

    def __init__(self, index: KVIndex, expected: Callable[[int, bytes], bool], groups: PrefixGroups | None = None,
                 block_size: Callable[[], int] = lambda: 16, provisional_window: int = 64) -> None:
        self.index = index
        self.expected = expected
        self.groups = groups or PrefixGroups()
        self.block_size = block_size
        self.provisional_window = provisional_window
        self.inflight_tail: dict[int, int] = {}

    # -- state of a replica ----------------------------------------------------------------------------
    def _lost(self, replica: int, g: PrefixGroup) -> bool:
        """``replica`` no longer holds ``g``'s first block and nothing routed there is computing it."""
        if not g.chain or not self.index.expects_events(replica) or not self.index.has_events(replica):
            return False
        h = g.chain[0]
        return not self.index.holds(replica, h) and not self.expected(replica, h)

    def _counted(self, g: PrefixGroup) -> bool:
        return not g.provisional or self.groups.seq - g.last <= self.provisional_window

    def committed(self, replica: int, exclude: PrefixGroup | None = None) -> tuple[int, float]:
        """``(blocks, heat)`` of the groups homed at ``replica`` (homes found lost are dropped here)."""
        blocks, heat = 0, 0.0
        for g in self.groups.groups.values():
            if replica in g.homes and g is not exclude and self._counted(g):
                if self._lost(replica, g):
                    del g.homes[replica]
                    continue
                blocks += g.size
                heat += self.groups.heat(g)
        return blocks, heat

    def room(self, replica: int, tail: int, exclude: PrefixGroup | None = None) -> float | None:
        """Blocks of ``replica``'s pool free for one more group after its groups, its in-flight working
        set and a request with ``tail`` working blocks (None: pool size unknown)."""
        cap = self.index.pool_size(replica)
        if not cap:
            return None
        blocks, _ = self.committed(replica, exclude)
        return cap - blocks - self.inflight_tail.get(replica, 0) - tail

    # -- the rule -----------------------------------------------------------------------------------------
    def allowed(self, candidates: Sequence[Backend], hashes: Sequence[bytes], num_blocks: int,
                output_blocks: int = 1) -> tuple[list[Backend], PlacementInfo]:
        """The candidates ``hashes`` may go to (non-empty, a subset of ``candidates``) and why.

        Args:
            candidates: healthy backends of the pool (non-empty).
            hashes: the request's full-block chain.
            num_blocks: prompt blocks (full and partial).
            output_blocks: blocks its output will take (from ``max_tokens``).
        """
        if not hashes:
            return list(candidates), PlacementInfo("off", None, 0, 0, num_blocks + output_blocks)
        g, shared = self.groups.classify(hashes)
        if g is not None and g.provisional:
            size = shared
        elif g is not None:
            size = max(g.size, shared)
        else:
            size = len(hashes)
        tail = max(0, num_blocks - size) + output_blocks + 1
        rooms = {b.index: self.room(b.index, tail, exclude=g) for b in candidates}
        if all(r is None for r in rooms.values()):
            return list(candidates), PlacementInfo("off", g, shared, size, tail, rooms)
        fits = [b for b in candidates if rooms[b.index] is None or rooms[b.index] >= size]
        if g is not None:
            live = [b for b in candidates if b.index in g.homes and not self._lost(b.index, g)]
            for b in candidates:
                if b.index in g.homes and b not in live:
                    del g.homes[b.index]
            if live:
                extra = [b for b in fits if b not in live]
                return live + extra, PlacementInfo("member", g, shared, size, tail, rooms,
                                                   [b.index for b in live])
        if not fits:
            # give up the copies of replicated groups on the candidates, coldest first, until one has room
            for b in sorted(candidates, key=lambda b: -(rooms[b.index] or 0)):
                copies = sorted((x for x in self.groups.groups.values()
                                 if b.index in x.homes and len(x.homes) > 1 and x is not g),
                                key=self.groups.heat)
                for x in copies:
                    del x.homes[b.index]
                    rooms[b.index] = self.room(b.index, tail, exclude=g)
                    if rooms[b.index] is not None and rooms[b.index] >= size:
                        break
            fits = [b for b in candidates if rooms[b.index] is None or rooms[b.index] >= size]
        if fits:
            heats = {b.index: self.committed(b.index, g)[1] for b in fits}
            lo = min(heats.values())
            return [b for b in fits if heats[b.index] <= lo + 1.0], PlacementInfo("new", g, shared, size, tail, rooms)
        # no room anywhere: spill to the replica already over its capacity (it thrashes alone), else to the
        # one whose groups are coldest
        known = [b for b in candidates if rooms[b.index] is not None]
        over = [b for b in known if rooms[b.index] < 0]    # type: ignore[operator]
        if over:
            worst = min(rooms[b.index] for b in over)              # type: ignore[type-var]
            target = [b for b in over if rooms[b.index] == worst]
        else:
            heats = {b.index: self.committed(b.index, g)[1] for b in known}
            lo = min(heats.values())
            target = [b for b in known if heats[b.index] == lo]
        return target, PlacementInfo("spill", g, shared, size, tail, rooms)

    def routed(self, replica: int, hashes: Sequence[bytes], info: PlacementInfo) -> None:
        """The request went to ``replica``: update its group and the replica's working set."""
        if hashes:
            self.groups.routed(hashes, replica, info.group, info.shared)
        self.inflight_tail[replica] = self.inflight_tail.get(replica, 0) + info.tail

    def finished(self, replica: int, info: PlacementInfo) -> None:
        """The request ended: its working set is free again."""
        left = self.inflight_tail.get(replica, 0) - info.tail
        if left > 0:
            self.inflight_tail[replica] = left
        else:
            self.inflight_tail.pop(replica, None)

    def on_backend_down(self, replica: int) -> None:
        self.groups.drop_replica(replica)
        self.inflight_tail.pop(replica, None)
