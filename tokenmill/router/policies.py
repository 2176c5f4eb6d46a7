"""Routing policies: which backend of a pool gets a request.

* ``round_robin``: in turn.
* ``least_load``: fewest requests in flight from this router (ties in turn).
* ``prefix_aware``: SGLang's cache-aware rule over an approximate per-backend
  prefix tree of the text routed there (:class:`~tokenmill.router.prefix_tree.PrefixTree`).
* ``kv_aware``: Dynamo's KV router cost over the backends' real cache state,
  known from their KV events (:class:`~tokenmill.router.kv_index.KVIndex`).

Every policy returns a :class:`RouteDecision` with the reason it chose (a
metric label) and its estimate of the prompt share the backend has cached.
Policies see only :class:`~tokenmill.router.backends.Backend` objects, so they
are tested with fake backends and no model.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

from tokenmill.router.backends import Backend
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.placement import Placement
from tokenmill.router.prefix_tree import PrefixTree

logger = logging.getLogger(__name__)

@dataclass
class RouteInput:
    """What a policy may look at.

    Attributes:
        text: the prompt as text (completion prompt, or the chat messages' contents joined).
        block_hashes: the prompt's full-block hash chain, ``[num_tokens // block_size]``
            (kv_aware only; None otherwise).
        num_prompt_tokens: prompt length in tokens (kv_aware only; None otherwise).
        max_tokens: the request's ``max_tokens`` / ``max_completion_tokens`` (None: not given).
    """

    text: str = ""
    block_hashes: list[bytes] | None = None
    num_prompt_tokens: int | None = None
    max_tokens: int | None = None


@dataclass
class RouteDecision:
    """A policy's choice.

    Attributes:
        backend: where the request goes.
        reason: why (metric label): ``round_robin``, ``least_load``, ``prefix_match``,
            ``cache_capacity``, ``load_balance``, ``kv_overlap``, ``kv_tier`` (the prefix only in the backend's KV
            offloading tier), ``kv_load``, ``load_fallback``.
        matched, total: estimated cached part and size of the prompt, in ``unit``.
        unit: ``tokens`` (kv_aware), ``chars`` (prefix_aware) or ``""`` (no estimate).
        new_prefill_blocks, request_blocks: kv_aware's load bookkeeping (blocks).
        evicted_blocks: kv_aware's estimate of reused cached blocks the placement evicts.
        costs: kv_aware's cost per backend index (for logs and tests).
        placement: kv_aware's :class:`~tokenmill.router.placement.PlacementInfo` (handed back at the end).
        detail: kv_aware's decision record for ``--decision-log``: per candidate the overlap from
            events and from in-flight requests, each cost term, load; the best-overlap and cheapest
            backends (JSON-serialisable).
    """

    backend: Backend
    reason: str
    matched: int = 0
    total: int = 0
    unit: str = ""
    new_prefill_blocks: int = 0
    request_blocks: int = 0
    costs: dict[int, float] = field(default_factory=dict)
    block_hashes: list[bytes] | None = None
    started: float = 0.0
    evicted_blocks: int = 0
    detail: dict | None = None
    placement: object = None


class Policy(abc.ABC):
    """Base class. ``needs_tokens``: the router must tokenize and hash the prompt first."""

    name = "base"
    needs_tokens = False

    @abc.abstractmethod
    def select(self, candidates: Sequence[Backend], req: RouteInput) -> RouteDecision:
        """Choose one of ``candidates`` (non-empty, all healthy).

        Raises:
            ValueError: no candidates.
        """

    def hold(self, candidates: Sequence[Backend], req: RouteInput) -> tuple[str | None, Sequence[Backend]]:
        """Whether ``req`` should wait at the router before it is routed, and among which candidates.

        Returns:
            ``(reason, candidates)``: reason None routes now among the returned candidates (a subset of
            ``candidates``); otherwise the router waits for a change (a request ending, a KV event batch,
            a health change) and asks again, up to ``--router-queue-timeout``. The base policy never holds.
        """
        return None, candidates

    def on_backend_down(self, backend: Backend) -> None:
        """A backend left the rotation (it may come back empty)."""

    def on_finish(self, decision: RouteDecision) -> None:
        """The request routed by ``decision`` ended (answered, failed or abandoned)."""

    def recheck_in(self) -> float | None:
        """Seconds after which a held request should be asked about again even if nothing changed
        (a deadline inside the policy passes); None: only on a change. The base policy has none."""
        return None


def _check(candidates: Sequence[Backend]) -> None:
    if not candidates:
        raise ValueError("no backend to route to")


class RoundRobin(Policy):
    """Each request to the next backend in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Backend], req: RouteInput) -> RouteDecision:
        _check(candidates)
        b = candidates[self._next % len(candidates)]
        self._next += 1
        return RouteDecision(b, "round_robin")


class LeastLoad(Policy):
    """The least loaded backend; ties go in turn.

    Args:
        source: ``"inflight"``: requests in flight from this router (exact for a
            single router); ``"metrics"``: running + waiting requests from the
            backend's ``/metrics`` at the last health check plus what this router
            sent since (sees other routers' and direct clients' load too).
    """

    name = "least_load"

    def __init__(self, source: str = "inflight") -> None:
        if source not in ("inflight", "metrics"):
            raise ValueError(f"load source must be 'inflight' or 'metrics', got {source!r}")
        self.source = source
        self._next = 0

    def load(self, b: Backend) -> int:
        if self.source == "metrics" and b.reported_load is not None:
            return b.reported_load + b.routed_since_scrape
        return b.in_flight

    def select(self, candidates: Sequence[Backend], req: RouteInput) -> RouteDecision:
        _check(candidates)
        low = min(self.load(b) for b in candidates)
        ties = [b for b in candidates if self.load(b) == low]
        b = ties[self._next % len(ties)]
        self._next += 1
        b.routed_since_scrape += 1
        return RouteDecision(b, "least_load")


class PrefixAware(Policy):
    """SGLang's cache-aware routing over approximate per-backend prefix trees.

    Rule (SGLang router, ``cache_aware`` policy): if the load is imbalanced,
    i.e. ``max_load - min_load > balance_abs_threshold`` **and** ``max_load >
    min_load * balance_rel_threshold`` (load = requests in flight), route to
    the least loaded backend. Otherwise find the backend whose tree matches
    the longest prefix of the request's text; if that match covers more than
    ``cache_threshold`` of the text, route there, else to the backend with the
    smallest tree (the most free cache, by this estimate). The text is then
    inserted into the chosen backend's tree.

    Args:
        cache_threshold: match ratio in [0, 1] above which the best match wins.
        balance_abs_threshold: requests.
        balance_rel_threshold: ratio (>= 1).
        max_tree_size: characters kept per backend tree (LRU eviction beyond).
        placement: keep prefix groups resident as kv_aware does (:mod:`tokenmill.router.placement`), as far
            as text allows: groups from chained hashes of ``block_size * chars_per_token``-character chunks,
            pool sizes from the backends' ``/metrics``, no KV events (a home is never found lost).
            The rule above then chooses among the replicas the placement allows. Off by default
            (``--prefix-placement``): on ``benchmarks/routing.py``'s family it did not raise prefix_aware's
            cached tokens (tuning half 75.1% of best with it, 76.0% without; held-out 86.2% both), whose
            losses come from concurrent first requests of a group that it cannot hold back (it sees
            neither KV events nor first bytes).
        chars_per_token: characters per token assumed to size groups in blocks (English BPE: about 4).
        block_size: the backends' KV block size in tokens.
    """

    name = "prefix_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 2**26, placement: bool = False,
                 chars_per_token: float = 4.0, block_size: int = 16) -> None:
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be > 0, got {chars_per_token}")
        self.chunk_chars = max(1, int(round(block_size * chars_per_token)))
        self._pools = _ReportedPools()
        self.placement = Placement(self._pools, lambda replica, h: False) if placement else None  # type: ignore[arg-type]
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.trees: dict[int, PrefixTree] = {}

    def tree(self, b: Backend) -> PrefixTree:
        t = self.trees.get(b.index)
        if t is None:
            t = self.trees[b.index] = PrefixTree(self.max_tree_size)
        return t

    def imbalanced(self, candidates: Sequence[Backend]) -> bool:
        loads = [b.in_flight for b in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def text_chain(self, text: str) -> list[bytes]:
        """Chained hashes of ``text``'s full chunks of ``chunk_chars`` characters (a block's worth of text
        at ``chars_per_token``): the placement's stand-in for the block hashes prefix_aware cannot compute."""
        out, prev = [], b""
        c = self.chunk_chars
        for i in range(len(text) // c):
            prev = hashlib.blake2b(prev + text[i * c:(i + 1) * c].encode("utf-8", "surrogatepass"),
                                   digest_size=16).digest()
            out.append(prev)
        return out

    def select(self, candidates: Sequence[Backend], req: RouteInput) -> RouteDecision:
        _check(candidates)
        text = req.text
        n = len(text)
        info = None
        chain: list[bytes] = []
        if self.placement is not None:
            self._pools.sizes = {b.index: b.pool_blocks for b in candidates}
            chain = self.text_chain(text)
            out_blocks = -(-(req.max_tokens if req.max_tokens is not None else 16) * 4 // self.chunk_chars)
            candidates, info = self.placement.allowed(candidates, chain, -(-n // self.chunk_chars), out_blocks)
        matches = {b.index: self.tree(b).match(text, touch=False) for b in candidates}
        if len(candidates) > 1 and self.imbalanced(candidates):
            b = min(candidates, key=lambda c: (c.in_flight, c.index))
            reason = "load_balance"
        else:
            best = max(candidates, key=lambda c: (matches[c.index], -c.in_flight, -c.index))
            if n and matches[best.index] / n > self.cache_threshold:
                b, reason = best, "prefix_match"
            else:
                b = min(candidates, key=lambda c: (self.tree(c).size, c.in_flight, c.index))
                reason = "cache_capacity"
        self.tree(b).insert(text)
        if info is not None:
            self.placement.routed(b.index, chain, info)  # type: ignore[union-attr]
        return RouteDecision(b, reason, matched=matches[b.index], total=n, unit="chars", placement=info)

    def on_finish(self, decision: RouteDecision) -> None:
        if self.placement is not None and decision.placement is not None:
            self.placement.finished(decision.backend.index, decision.placement)  # type: ignore[arg-type]
            decision.placement = None

    def on_backend_down(self, backend: Backend) -> None:
        self.trees.pop(backend.index, None)
        if self.placement is not None:
            self.placement.on_backend_down(backend.index)


class _ReportedPools:
    """What :class:`~tokenmill.router.placement.Placement` asks a KV index, for prefix_aware: only the pool
    sizes the backends report in their ``/metrics`` (no KV events: homes are never found lost). An LRU
    estimate of each pool in place of the events was tried and lost cached tokens (a resident group's
    home dropped while the backend still held it): 78% of the best placement vs 93% without, on
    ``test_prefix_aware_places_groups_from_the_text_and_the_reported_pools``'s workload."""

    def __init__(self) -> None:
        self.sizes: dict[int, int | None] = {}

    def pool_size(self, backend: int) -> int | None:
        return self.sizes.get(backend)

    def expects_events(self, backend: int) -> bool:
        return False

    def has_events(self, backend: int) -> bool:
        return False

    def holds(self, backend: int, block_hash: bytes) -> bool:
        return False


# Cost of a block loaded from a backend's KV offloading tier relative to one prefilled: how much a lone
# request's TTFT grows per block loaded over how much it grows per block recomputed, measured with
# benchmarks/kv_offload.py --crossover (AMD EPYC, bfloat16, SmolLM2-135M, CPU to itself, 2026-12-02:
# 0.88 / 6.40 ms per 16-token block = 0.14; Intel Xeon, float32 weights + bfloat16 KV: ~0 / 43 ms), the
# larger ratio rounded up. Not measured on a GPU (where prefill is faster per block and the ratio higher):
# --kv-tier-weight sets it.
TIER_WEIGHT = 0.15


class KVAware(Policy):
    """Dynamo's KV-aware routing: lowest ``overlap_weight × prefill_blocks + decode_blocks``, plus two terms.

    For candidate ``w`` and a request of ``n`` blocks of which ``overlap(w)``
    leading blocks are in ``w``'s prefix cache (from its KV events):

    * ``prefill_blocks(w) = w.prefill_blocks + n - overlap(w) - tier(w) + tier_weight × tier(w)``
      (blocks it would still have to prefill, its queued prefills included); ``tier(w)``: the blocks
      after ``overlap(w)`` that ``w``'s KV offloading tier holds (its events with a ``medium``: DISK,
      CPU; :meth:`KVIndex.tier_match`), which it would load instead of computing, each costing
      ``tier_weight`` of a computed block (:data:`TIER_WEIGHT`): a tier hit scores below a pool hit
      and above a miss;
    * ``decode_blocks(w) = distinct(w) + w.in_flight + new(w)``: the distinct
      full blocks its in-flight requests hold (requests sharing a prefix
      share its blocks, as Dynamo's active-sequence tracking counts them),
      one partial tail block per in-flight request, and the request's
      blocks ``w`` does not already hold for an in-flight request; i.e. the
      KV memory its decode steps would read;
    * ``evicted(w)``: the *reused* cached blocks (used by at least two
      requests: shared prefixes) that placing the request on ``w`` pushes out
      of ``w``'s pool, now or once its stale blocks are gone
      (:meth:`KVIndex.reused_overflow`: reused + in-use + new blocks beyond
      the pool size, which the backend reports (else learnt from the events); use counts come from
      the events and the requests routed there). Each will have to be
      prefilled again by the next request of its prefix, so it costs like a
      prefill block, scaled by ``eviction_weight``. Dynamo's cost has no such
      term (``eviction_weight = 0`` is Dynamo's rule); without it a move to a
      replica whose pool is full of other live prefixes looks as cheap as its
      own prefill, and the next requests of the evicted prefixes miss too;
    * ``recomputed(w) = max(0, max_v overlap(v) - overlap(w) - tier(w))``: blocks of the request
      that another candidate already holds or is computing (for a request in
      flight there) and that ``w`` would prefill again. Dynamo's cost has no
      such term (``recompute_weight = 0``). Its prefill term prices a
      placement by this request's wait only: a replica whose queue holds
      other cold prefills looks as dear as a second replica computing the
      whole prefix again, so a group of requests sharing a prefix is split
      over replicas (measured in ``benchmarks/routing.py``: in a burst of 8
      requests of 4 new 24-block prefixes, the second request of the first
      prefix went to the other replica at cost 100 vs 102, and the group
      then lived on both, evicting a third prefix). Splitting does the
      prefix's prefill twice and keeps two copies, which the next requests
      of every prefix on the new replica pay for. With the term, a group
      leaves the replica that holds it only when that replica's cost exceeds
      the other's by more than the prefix it would recompute (a minimum
      cost gap, like SGLang's balance thresholds but in blocks of work);
      a load imbalance of that size still moves it;
    * ``cost(w) = overlap_weight * (prefill_blocks(w) + eviction_weight * evicted(w)
      + recompute_weight * recomputed(w)) + decode_blocks(w)``.

    ``overlap(w)`` is the longer of two matches: the blocks ``w``'s KV events
    say it holds, and the blocks of requests this router sent to ``w`` that
    are still in flight (their prefill is writing those blocks right now; the
    events follow within a step). Without the second, a burst of requests
    sharing a new prefix would be scattered before the first one's events
    arrive.

    Holding at the router (:meth:`hold`; the router waits for a change and asks again, up to
    ``--router-queue-timeout``):

    * ``busy_threshold`` (``--active-decode-blocks-threshold``, Dynamo's name): a backend is busy when
      its in-flight requests' KV plus this request's (the decode term, plus the request's own tail
      block) exceeds that share of its pool; busy backends are left out (Dynamo's busy-worker filter),
      and when every backend is busy the request waits (Dynamo rejects it). At 1.0 a request waits
      only when it cannot fit next to what is in flight, i.e. exactly when the engine would queue it
      too: in the engine it would sit at the head of a FCFS queue, block requests behind it that do
      fit, and, once admitted, evict the cached prefixes that queued requests were routed there for
      (measured in ``benchmarks/routing.py`` at 3x cache demand: 60-64 of 200 requests found
      less of their prefix than counted; with the hold 3-9);
    * ``prefill_wait`` (``--kv-prefill-wait``): the backend this request would go to holds part of
      its prefix only as blocks of a request still being prefilled there (in ``pending``, not yet in
      its KV events); the engine shares computed blocks only, so the request waits for the events.
      A request that ended keeps its blocks expected on its backend (``unconfirmed``) for
      :attr:`EVENT_GRACE_S` (or twice the backend's worst event lag seen, at most
      :attr:`MAX_EVENT_GRACE_S`) until its ``BlockStored`` events arrive: its answer can reach the
      router before the event batch of the step that computed its prompt (a replay of missed batches
      or a loaded machine delays the batch), and a follower released at that moment would find no
      overlap anywhere and prefill the prefix on another backend.

    With ``temperature == 0`` the cheapest backend wins (ties in turn);
    otherwise costs are normalised to [0, 1] and a backend is drawn with
    probability ``softmax(-cost / temperature)`` (Dynamo's ``--router-temperature``),
    which spreads load when costs are close. With no events from any candidate
    every overlap is 0 and the rule is pure load balancing (reason
    ``load_fallback``).

    Args:
        index: the pool's :class:`KVIndex`.
        overlap_weight: weight of prefill blocks (Dynamo's ``--kv-overlap-score-weight``, default 1).
        eviction_weight: weight of evicted reused blocks relative to prefill blocks
            (``--kv-eviction-weight``; 0 and ``recompute_weight`` 0: Dynamo's cost).
        recompute_weight: weight of recomputed blocks (held or being computed by another
            candidate) relative to prefill blocks (``--kv-recompute-weight``).
        tier_weight: cost of a block loaded from the backend's KV offloading tier relative to a
            prefill block, in [0, 1] (``--kv-tier-weight``; default :data:`TIER_WEIGHT`).
        prefill_wait: hold a request whose prefix is still being computed on its backend.
        busy_threshold: fraction of a backend's pool beyond which it is busy (None or 0: never).
        temperature: softmax temperature (0: deterministic).
        block_size: tokens per block when the index has not learnt it from events.
        seed: RNG seed for the softmax draw.
        clock: seconds, monotonic (the grace periods; a simulation passes its own).
        placement: keep prefix groups resident (:mod:`tokenmill.router.placement`; ``--no-kv-placement``:
            the cost alone, as before).
    """

    name = "kv_aware"
    needs_tokens = True
    EVENT_GRACE_S = 1.0       # an ended request's blocks stay expected this long without their events
    MAX_EVENT_GRACE_S = 5.0

    def __init__(self, index: KVIndex, overlap_weight: float = 1.0, temperature: float = 0.0,
                 block_size: int = 16, seed: int | None = None, eviction_weight: float = 1.0,
                 recompute_weight: float = 1.0, prefill_wait: bool = True,
                 busy_threshold: float | None = 1.0, clock=time.monotonic, placement: bool = True,
                 move_margin: float = 4.0, tier_weight: float = TIER_WEIGHT) -> None:
        if not 0 <= tier_weight <= 1:
            raise ValueError(f"KV tier weight must be in [0, 1], got {tier_weight}")
        self.tier_weight = tier_weight
        if move_margin < 0:
            raise ValueError(f"move margin must be >= 0, got {move_margin}")
        self.move_margin = move_margin
        if temperature < 0:
            raise ValueError(f"router temperature must be >= 0, got {temperature}")
        if overlap_weight < 0:
            raise ValueError(f"overlap weight must be >= 0, got {overlap_weight}")
        if eviction_weight < 0:
            raise ValueError(f"eviction weight must be >= 0, got {eviction_weight}")
        if recompute_weight < 0:
            raise ValueError(f"recompute weight must be >= 0, got {recompute_weight}")
        if busy_threshold is not None and busy_threshold < 0:
            raise ValueError(f"active decode blocks threshold must be >= 0 (0: off), got {busy_threshold}")
        busy_threshold = busy_threshold or None
        self.recompute_weight = recompute_weight
        self.prefill_wait = prefill_wait
        self.busy_threshold = busy_threshold
        self.index = index
        self.overlap_weight = overlap_weight
        self.eviction_weight = eviction_weight
        self.temperature = temperature
        self.default_block_size = block_size
        self._rng = random.Random(seed)
        self._next = 0
        self._clock = clock
        self.placement = Placement(index, self._expected, block_size=lambda: self.block_size) if placement else None
        # blocks of in-flight requests per backend: hash -> number of requests
        self.pending: dict[int, dict[bytes, int]] = {}
        # blocks of ended requests whose BlockStored events have not arrived yet: hash -> deadline
        # (time.monotonic()); they count like pending blocks for the overlap until then
        self.unconfirmed: dict[int, dict[bytes, float]] = {}

    @property
    def block_size(self) -> int:
        """Tokens per block: learnt from the events, else the configured default."""
        return self.index.block_size or self.default_block_size

    def _evaluate(self, candidates: Sequence[Backend], req: RouteInput) -> dict:
        """Every candidate's overlaps and cost terms for ``req`` (no state changes)."""
        bs = self.block_size
        ntok = req.num_prompt_tokens or 0
        n = -(-ntok // bs)
        hashes = req.block_hashes or []
        have_events = any(self.index.has_events(b.index) for b in candidates)
        ev_overlaps = self.index.match(hashes, [b.index for b in candidates]) if have_events else {}
        overlaps = dict(ev_overlaps)
        pend_overlaps: dict[int, int] = {}
        for b in candidates:
            pend = self.pending.get(b.index)
            unconf = self._unconfirmed(b.index)
            if pend or unconf:
                pend, unconf = pend or {}, unconf or {}
                k = 0
                while k < len(hashes) and (hashes[k] in pend or hashes[k] in unconf):
                    k += 1
                pend_overlaps[b.index] = k
                if k > overlaps.get(b.index, 0):
                    overlaps[b.index] = k
        # the engine always computes a prompt's last token, so at most (ntok - 1) // bs blocks hit
        max_hit = max(0, (ntok - 1) // bs)
        costs: dict[int, float] = {}
        evicted: dict[int, int] = {}
        cands: dict[int, dict] = {}
        best_ov = max((min(overlaps.get(b.index, 0), max_hit) for b in candidates), default=0)
        # blocks each backend would load from its KV offloading tier (its DISK/CPU events) after its pool
        tier_ovs = (self.index.tier_match(hashes, {b.index: min(overlaps.get(b.index, 0), max_hit)
                                                   for b in candidates}, max_hit) if have_events else {})
        for b in candidates:
            ov = min(overlaps.get(b.index, 0), max_hit)
            tier_ov = tier_ovs.get(b.index, 0)
            recomputed = max(0, best_ov - ov - tier_ov)
            prefill = b.prefill_blocks + (n - ov - tier_ov) + self.tier_weight * tier_ov
            pend = self.pending.get(b.index) or {}
            shared = sum(1 for h in hashes if h in pend)
            decode = len(pend) + b.in_flight + (n - shared)
            evicted[b.index] = self.evicted_reused(b.index, n - ov, hashes, pend) if self.eviction_weight else 0
            costs[b.index] = self.overlap_weight * (prefill + self.eviction_weight * evicted[b.index]
                                                    + self.recompute_weight * recomputed) + decode
            cands[b.index] = {"ov_events": ev_overlaps.get(b.index, 0), "ov_pending": pend_overlaps.get(b.index, 0),
                              "ov": ov, "ov_tier": tier_ov, "queued_prefill": b.prefill_blocks, "prefill": prefill, "decode": decode,
                              "distinct": len(pend), "in_flight": b.in_flight, "evicted": evicted[b.index],
                              "recomputed": recomputed,
                              "cost": costs[b.index]}
        return {"bs": bs, "ntok": ntok, "n": n, "hashes": hashes, "have_events": have_events, "max_hit": max_hit,
                "overlaps": overlaps, "costs": costs, "evicted": evicted, "cands": cands, "best_ov": best_ov}

    def select(self, candidates: Sequence[Backend], req: RouteInput) -> RouteDecision:
        _check(candidates)
        e = self._evaluate(candidates, req)
        bs, ntok, n, hashes, costs, cands, best_ov = (e["bs"], e["ntok"], e["n"], e["hashes"], e["costs"],
                                                      e["cands"], e["best_ov"])
        allowed, info = self._allowed(candidates, req, e)
        allowed = self._worth_moving(allowed, info, costs)
        chosen = self._pick(allowed, costs)
        ov = min(e["overlaps"].get(chosen.index, 0), e["max_hit"])
        if ov > 0:
            reason = "kv_overlap"
        elif cands[chosen.index]["ov_tier"] > 0:
            reason = "kv_tier"
        elif not e["have_events"]:
            reason = "load_fallback"
        else:
            reason = "kv_load"
        lo = min(costs.values())
        detail = {"prefix": hashes[0].hex()[:12] if hashes else "", "blocks": n, "chosen": chosen.index,
                  "reason": reason, "best_overlap": [i for i, c in cands.items() if c["ov"] == best_ov] if best_ov else [],
                  "cheapest": [i for i, c in costs.items() if c == lo], "candidates": cands}
        if info is not None:
            detail.update(placement=info.kind, group_blocks=info.size, allowed=[b.index for b in allowed],
                          room={i: r for i, r in info.room.items()})
            self.placement.routed(chosen.index, hashes, info)  # type: ignore[union-attr]
        pend = self.pending.setdefault(chosen.index, {})
        for h in hashes:
            pend[h] = pend.get(h, 0) + 1
        self.index.touch(chosen.index, hashes)
        return RouteDecision(chosen, reason, matched=ov * bs, total=ntok, unit="tokens",
                             new_prefill_blocks=n - ov, request_blocks=n, costs=costs, block_hashes=list(hashes),
                             evicted_blocks=e["evicted"].get(chosen.index, 0), detail=detail, placement=info)

    def _allowed(self, candidates: Sequence[Backend], req: RouteInput, e: dict):
        """The placement's subset of ``candidates`` for ``req`` and its record (None: placement off)."""
        if self.placement is None:
            return list(candidates), None
        out_blocks = -(-(req.max_tokens if req.max_tokens is not None else 16) // e["bs"])
        return self.placement.allowed(candidates, e["hashes"], e["n"], out_blocks)

    def _worth_moving(self, allowed: list[Backend], info, costs: dict[int, float]) -> list[Backend]:
        """Of a member's allowed replicas, its homes and the others cheaper than its cheapest home by more
        than ``move_margin`` x its group's prefix (on top of the recompute term): a transient queue at the
        home does not move (or copy) a group; a sustained overload does."""
        if info is None or info.kind != "member" or not info.homes:
            return allowed
        home_cost = min(costs[i] for i in info.homes)
        margin = self.move_margin * info.size * self.overlap_weight
        return [b for b in allowed if b.index in info.homes or costs[b.index] + margin < home_cost]

    def _expected(self, backend: int, block_hash: bytes) -> bool:
        """A request routed to ``backend`` is computing ``block_hash`` or its events are due."""
        pend = self.pending.get(backend)
        if pend and block_hash in pend:
            return True
        unconf = self._unconfirmed(backend)
        return bool(unconf) and block_hash in unconf

    def busy(self, b: Backend, req: RouteInput) -> bool:
        """True when ``b``'s in-flight requests plus ``req`` would hold more than ``busy_threshold`` of its pool.

        Held blocks: the decode term (distinct full blocks of its in-flight requests, a tail block each,
        and ``req``'s blocks not among them, plus ``req``'s own tail block). The pool size is the one the
        backend reports in its ``/metrics`` (:meth:`KVIndex.pool_size`), else the most blocks its KV
        events ever showed it holding, trusted once it evicted a block (a pool that evicts is full). A backend with nothing in flight, or whose pool size is not known yet, is never
        busy: a request alone always goes.
        """
        if self.busy_threshold is None or b.in_flight == 0:
            return False
        cap = self.index.pool_size(b.index)
        if not cap:
            return False
        hashes = req.block_hashes or []
        n = -(-(req.num_prompt_tokens or 0) // self.block_size)
        pend = self.pending.get(b.index) or {}
        shared = sum(1 for h in hashes if h in pend)
        return len(pend) + b.in_flight + (n - shared) + 1 > self.busy_threshold * cap

    def hold(self, candidates: Sequence[Backend], req: RouteInput) -> tuple[str | None, Sequence[Backend]]:
        """Two reasons to wait at the router (see the class docstring):

        * ``busy``: every candidate is :meth:`busy` (``busy_threshold`` set); otherwise only the candidates
          that are not busy are returned (Dynamo's busy-worker filter; Dynamo rejects where this waits);
        * ``prefill``: the backend this request would go to holds part of its prefix only as blocks a
          request routed there is still computing (in flight, not yet confirmed by a ``BlockStored``
          event). The engine shares only computed blocks, so sent now it would prefill them again next to
          the first request (twice the work and two copies in the pool); it waits until the events
          confirm them, the grace after the first request ended passes (``unconfirmed``), or the
          timeout. Only for backends whose events the router receives.
        """
        _check(candidates)
        avail = list(candidates)
        if self.placement is not None and req.block_hashes:
            # placement first: a group whose homes are busy waits for them rather than moving, unless a
            # replica with room is cheaper by the move margin (see _worth_moving)
            e = self._evaluate(candidates, req)
            allowed, info = self._allowed(candidates, req, e)
            allowed = self._worth_moving(allowed, info, e["costs"])
            if self.busy_threshold is not None:
                if not any(not self.busy(b, req) for b in allowed):
                    return "busy", allowed
                # select applies the placement again; it sees every free candidate (for the decision log)
                avail = [b for b in candidates if not self.busy(b, req)]
        elif self.busy_threshold is not None:
            avail = [b for b in candidates if not self.busy(b, req)]
            if not avail:
                return "busy", candidates
        if self.prefill_wait and req.block_hashes:
            e = self._evaluate(avail, req)
            allowed, info = self._allowed(avail, req, e)
            allowed = self._worth_moving(allowed, info, e["costs"])
            lo = min(e["costs"][b.index] for b in allowed)
            ties = [b for b in allowed if e["costs"][b.index] == lo]
            b = ties[self._next % len(ties)] if self.temperature <= 0 else ties[0]
            c = e["cands"][b.index]
            mh = e["max_hit"]
            if self.index.expects_events(b.index) and min(c["ov_pending"], mh) > min(c["ov_events"], mh):
                return "prefill", avail
        return None, avail

    def evicted_reused(self, backend: int, new_blocks: int, hashes: Sequence[bytes], pending: dict) -> int:
        """Reused cached blocks ``backend`` would evict to take a request with ``new_blocks`` uncached blocks.

        Blocks of requests in flight there and the request's own blocks are never evicted.
        """
        if new_blocks <= 0:
            return 0
        keep = set(pending)
        keep.update(hashes)
        return self.index.reused_overflow(backend, new_blocks, keep)

    def on_finish(self, decision: RouteDecision) -> None:
        b = decision.backend.index
        if self.placement is not None and decision.placement is not None:
            self.placement.finished(b, decision.placement)   # type: ignore[arg-type]
            decision.placement = None
        pend = self.pending.get(b)
        if pend is None or not decision.block_hashes:
            return
        expect = self.prefill_wait and self.index.expects_events(b) and decision.backend.healthy
        deadline = self._clock() + min(self.MAX_EVENT_GRACE_S,
                                          max(self.EVENT_GRACE_S, 2 * self.index.max_lag.get(b, 0.0)))
        held = self.index.match(decision.block_hashes, [b])[b] if expect else 0
        for i, h in enumerate(decision.block_hashes):
            c = pend.get(h, 0) - 1
            if c > 0:
                pend[h] = c
            else:
                pend.pop(h, None)
                if expect and i >= held:   # computed there (or about to be), not confirmed yet
                    self.unconfirmed.setdefault(b, {})[h] = deadline
        decision.block_hashes = None

    def _unconfirmed(self, backend: int) -> dict[bytes, float] | None:
        """``backend``'s ended requests' blocks still expected (expired ones dropped)."""
        unconf = self.unconfirmed.get(backend)
        if unconf:
            now = self._clock()
            for h in [h for h, t in unconf.items() if t <= now]:
                del unconf[h]
        return unconf or None

    def recheck_in(self) -> float | None:
        """Seconds until the earliest ``unconfirmed`` block expires (a held request is asked again then)."""
        soonest = min((t for u in self.unconfirmed.values() for t in u.values()), default=None)
        return None if soonest is None else max(0.0, soonest - self._clock())

    def _pick(self, candidates: Sequence[Backend], costs: dict[int, float]) -> Backend:
        costs = {b.index: costs[b.index] for b in candidates}
        lo = min(costs.values())
        if self.temperature <= 0:
            ties = [b for b in candidates if costs[b.index] == lo]
            b = ties[self._next % len(ties)]
            self._next += 1
            return b
        hi = max(costs.values())
        span = hi - lo or 1.0
        weights = [math.exp(-((costs[b.index] - lo) / span) / self.temperature) for b in candidates]
        return self._rng.choices(list(candidates), weights=weights, k=1)[0]

    def on_backend_down(self, backend: Backend) -> None:
        # its events resume (or restart at seq 0) when it returns; keep the index until then
        if self.placement is not None:
            self.placement.on_backend_down(backend.index)
        self.pending.pop(backend.index, None)
        self.unconfirmed.pop(backend.index, None)


POLICIES = ("round_robin", "least_load", "prefix_aware", "kv_aware")


def make_policy(name: str, *, index: KVIndex | None = None, cache_threshold: float = 0.3,
                balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                max_tree_size: int = 2**26, overlap_weight: float = 1.0, temperature: float = 0.0,
                block_size: int = 16, seed: int | None = None, load_source: str = "inflight",
                eviction_weight: float = 1.0, recompute_weight: float = 1.0, prefill_wait: bool = True,
                busy_threshold: float | None = 1.0, clock=time.monotonic, placement: bool = True,
                move_margin: float = 4.0, prefix_placement: bool = False,
                tier_weight: float | None = None) -> Policy:
    """Build a policy by name.

    Raises:
        ValueError: unknown name or bad parameter.
    """
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad(load_source)
    if name == "prefix_aware":
        return PrefixAware(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size,
                           placement=prefix_placement, block_size=block_size)
    if name == "kv_aware":
        return KVAware(index or KVIndex(), overlap_weight, temperature, block_size, seed, eviction_weight,
                       recompute_weight, prefill_wait, busy_threshold, clock, placement, move_margin,
                       TIER_WEIGHT if tier_weight is None else tier_weight)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
