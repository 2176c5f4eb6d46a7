"""A simulated fleet for judging routing policies fast: the router's real policy objects over simulated
replicas whose prefix caches behave like tokenmill's (and vLLM's) block pool.

Used by ``benchmarks/routing.py`` (its simulated family) and by the router's placement tests. Nothing
here is a model of *quality*: it is a model of *which blocks are cached where*, exact at block level,
plus a coarse step-time model so that load, queueing and concurrency shape the arrival of requests at
the router as they do on real servers.

* :class:`SimReplica`: one ``tokenmill serve``. A pool of ``num_blocks`` KV blocks with the engine's
  rules (:mod:`tokenmill.core.block_pool`): full blocks of a computed prompt are registered under their
  chained hash; a freed block goes to the tail of the free queue, a request's blocks in reverse order
  (its tail evicted first); a new block is taken from the head and loses its hash then (lazy LRU
  eviction); a request hits the longest cached prefix of its hash chain, at most ``(n - 1) // bs``
  blocks (the last prompt token is always computed). Continuous batching: FCFS admission while
  ``max_num_seqs`` and free blocks allow (no preemption: a request is admitted only when all its
  blocks, prompt and output, fit), chunked prefill under ``max_num_batched_tokens`` with decodes
  first, one token per running request per step. Step time ``step_s + prefill_token_s x prefill
  tokens + decode_seq_s x decoding requests``. Each step's ``BlockStored`` / ``BlockRemoved`` events go
  to the router's :class:`~tokenmill.router.kv_index.KVIndex` at the end of the step.
* :class:`SimFleet`: the router's bookkeeping (:meth:`tokenmill.router.router.Router.begin` /
  ``first_byte`` / ``end``: in flight, queued prefill blocks), its holds (``policy.hold``, rechecked on
  every change, ``router_queue_timeout``), a closed-loop client with ``concurrency`` requests in flight,
  and the pool sizes the replicas report (as the health checks read ``cache_config_info``).
* :func:`best_placement`: the offline best *static* placement (each group's requests on one replica):
  for every set of groups, its requests replayed one at a time, in arrival order, through one LRU pool;
  the best partition of the groups over the replicas (a DP over subsets). It bounds what a placement
  can cache (a request served concurrently cannot hit blocks still being computed, so a live run
  caches at most about as much), which ``benchmarks/routing.py`` reports every policy against.

Time is virtual: the policies get the simulated clock (:class:`~tokenmill.router.policies.KVAware`'s
``clock``), so their grace periods and the router's hold timeout run in simulated seconds.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

from tokenmill.core.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tokenmill.router.backends import Backend, BackendSpec
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.policies import Policy, RouteDecision, RouteInput, make_policy
from tokenmill.router.prompt import block_hash_chain


@dataclass
class SimRequest:
    """One request of a simulated workload.

    Attributes:
        rid: its position in the workload.
        group: the prefix group it belongs to (-1: none).
        tokens: prompt token ids.
        text: the prompt as text (for ``prefix_aware``; shares a prefix exactly where ``tokens`` do).
        output_len: tokens to generate.
        hashes: the prompt's full-block hash chain (set by :func:`make_workload`).
    """

    rid: int
    group: int
    tokens: list[int]
    text: str
    output_len: int
    hashes: list[bytes] = field(default_factory=list)
    # filled in by the simulation
    arrived: float = 0.0
    routed: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    cached_tokens: int = 0
    backend: int = -1


@dataclass
class StepCost:
    """Step-time model of a replica, seconds: ``step_s + prefill_token_s * prefill tokens + decode_seq_s *
    decoding requests`` (defaults: SmolLM2-135M on one busy CPU core, measured roughly)."""

    step_s: float = 0.015
    prefill_token_s: float = 0.0012
    decode_seq_s: float = 0.004


class _Block:
    __slots__ = ("hash", "ref")

    def __init__(self) -> None:
        self.hash: bytes | None = None
        self.ref = 0


class _Running:
    __slots__ = ("req", "blocks", "computed", "generated", "registered", "ntok")

    def __init__(self, req: SimRequest, blocks: list[int], computed: int) -> None:
        self.req = req
        self.blocks = blocks
        self.computed = computed      # prompt tokens whose KV exists
        self.generated = 0
        self.registered = computed    # prompt tokens of full blocks registered in the cache (hits included)
        self.ntok = len(req.tokens)


class SimReplica:
    """One simulated ``tokenmill serve`` (see the module docstring).

    Args:
        index: the replica's router index.
        num_blocks: KV pool size in blocks (``--num-kv-blocks``).
        block_size: tokens per block.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: tokens per step (decodes first, then prefill chunks).
        cost: the step-time model.
    """

    def __init__(self, index: int, num_blocks: int, block_size: int = 16, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 2048, cost: StepCost | None = None) -> None:
        self.index = index
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost = cost or StepCost()
        self.blocks = [_Block() for _ in range(num_blocks)]
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.waiting: deque[SimRequest] = deque()
        self.running: list[_Running] = []
        self.busy_until: float | None = None
        self._events: list = []
        self._step: list[tuple[_Running, int]] = []   # (request, prompt tokens computed this step)
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _hits(self, req: SimRequest) -> int:
        max_hit = max(0, (len(req.tokens) - 1) // self.block_size)
        k = 0
        while k < min(max_hit, len(req.hashes)) and req.hashes[k] in self.cached:
            k += 1
        return k

    def _admit(self) -> None:
        bs = self.block_size
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self._hits(req)
            need = -(-(len(req.tokens) + req.output_len) // bs)
            hit_ids = [self.cached[h] for h in req.hashes[:hits]]
            free_hits = sum(1 for b in hit_ids if self.blocks[b].ref == 0)
            if len(self.free) - free_hits < need - hits:
                if not self.running and need > self.num_blocks:
                    raise ValueError(f"request {req.rid} needs {need} blocks, the pool has {self.num_blocks}")
                return
            self.waiting.popleft()
            for b in hit_ids:
                blk = self.blocks[b]
                if blk.ref == 0:
                    self.free.pop(b, None)
                blk.ref += 1
            new = []
            removed = []
            for _ in range(need - hits):
                b, _ = self.free.popitem(last=False)
                blk = self.blocks[b]
                if blk.hash is not None:
                    del self.cached[blk.hash]
                    removed.append(blk.hash)
                    blk.hash = None
                blk.ref = 1
                new.append(b)
            if removed:
                self._events.append(BlockRemoved(block_hashes=removed))
            req.cached_tokens = hits * bs
            self.prompt_tokens += len(req.tokens)
            self.hit_tokens += hits * bs
            self.running.append(_Running(req, hit_ids + new, hits * bs))

    def start_step(self, now: float) -> float:
        """Schedule one step at ``now``; returns its duration (s)."""
        self._admit()
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if r.computed >= r.ntok]
        budget -= len(decoding)
        self._step = [(r, 0) for r in decoding]
        prefill_tokens = 0
        for r in self.running:
            if r.computed < r.ntok and budget > 0:
                n = min(budget, r.ntok - r.computed)
                budget -= n
                prefill_tokens += n
                self._step.append((r, n))
        c = self.cost
        return c.step_s + c.prefill_token_s * prefill_tokens + c.decode_seq_s * len(decoding)

    def finish_step(self) -> tuple[list[SimRequest], list[SimRequest], KVEventBatch | None]:
        """Apply the scheduled step: ``(first tokens, finished, the step's KV events or None)``."""
        bs = self.block_size
        firsts, done = [], []
        stored: list[bytes] = []
        for r, n in self._step:
            if n:
                r.computed += n
                full = min(r.computed // bs, len(r.req.hashes))
                for i in range(r.registered // bs, full):
                    h = r.req.hashes[i]
                    if h not in self.cached:
                        blk = self.blocks[r.blocks[i]]
                        if blk.hash is None:
                            blk.hash = h
                            self.cached[h] = r.blocks[i]
                            stored.append(h)
                r.registered = full * bs
                if r.computed >= r.ntok:       # the step that ends the prompt samples the first token
                    r.generated = 1
                    firsts.append(r.req)
            else:
                r.generated += 1
            if r.computed >= r.ntok and r.generated >= r.req.output_len:
                done.append(r)
        for r in done:
            self.running.remove(r)
            for b in reversed(r.blocks):
                blk = self.blocks[b]
                blk.ref -= 1
                if blk.ref == 0:
                    self.free[b] = None
            done_req = r.req
            done_req.backend = self.index
        if stored:
            self._events.append(BlockStored(block_hashes=stored, parent_block_hash=None, token_ids=[],
                                            block_size=bs, lora_id=None, medium=None))
        batch = KVEventBatch(ts=time.time(), events=self._events) if self._events else None
        self._events = []
        self._step = []
        return firsts, [r.req for r in done], batch


class SimFleet:
    """Replicas, a router running ``policy`` over them, and a closed-loop client (see the module docstring).

    Args:
        policy: a policy name for :func:`~tokenmill.router.policies.make_policy` (``"kv_aware"``...), or a
            ready :class:`~tokenmill.router.policies.Policy` built over :attr:`index` with :attr:`now` as its
            clock (see :meth:`build`).
        num_replicas, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, cost: the replicas.
        router_queue_timeout: longest hold at the router (simulated s).
        report_pool_size: give the index the replicas' pool sizes (as their ``/metrics`` do).
        policy_kwargs: extra keyword arguments for ``make_policy``.
    """

    def __init__(self, policy: str | Policy, num_replicas: int, num_blocks: int, block_size: int = 16,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, cost: StepCost | None = None,
                 router_queue_timeout: float = 30.0, report_pool_size: bool = True,
                 policy_kwargs: dict | None = None) -> None:
        self.now = 0.0
        self.index = KVIndex()
        self.replicas = [SimReplica(i, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, cost)
                         for i in range(num_replicas)]
        self.backends = [Backend(BackendSpec(f"http://sim-{i}"), i, healthy=True, models=["sim"])
                         for i in range(num_replicas)]
        for b in self.backends:
            self.index.expect_events(b.index)
            if report_pool_size:
                self.index.set_pool_size(b.index, num_blocks)
                b.pool_blocks = num_blocks
        if isinstance(policy, str):
            kw = dict(policy_kwargs or {})
            if policy == "kv_aware":
                kw.setdefault("clock", self.clock)
            policy = make_policy(policy, index=self.index, block_size=block_size, **kw)
        self.policy = policy
        self.block_size = block_size
        self.router_queue_timeout = router_queue_timeout
        self._decisions: dict[int, RouteDecision] = {}

    def clock(self) -> float:
        """The simulated time (s), the policies' clock."""
        return self.now

    def _route_input(self, req: SimRequest) -> RouteInput:
        if self.policy.needs_tokens:
            return RouteInput(text=req.text, block_hashes=list(req.hashes), num_prompt_tokens=len(req.tokens))
        return RouteInput(text=req.text)

    def _route(self, req: SimRequest, rin: RouteInput, held_since: float | None) -> bool:
        cands: Sequence[Backend] = [b for b in self.backends if b.healthy]
        if self.router_queue_timeout > 0:
            reason, use = self.policy.hold(cands, rin)
            if reason is not None and (held_since is None or self.now - held_since < self.router_queue_timeout):
                return False
            cands = list(use)
        d = self.policy.select(cands, rin)
        b = d.backend
        b.in_flight += 1
        b.active_blocks += d.request_blocks
        b.prefill_blocks += d.new_prefill_blocks
        self._decisions[req.rid] = d
        req.routed = self.now
        self.replicas[b.index].add(req)
        return True

    def _first_byte(self, req: SimRequest) -> None:
        d = self._decisions[req.rid]
        d.backend.prefill_blocks -= d.new_prefill_blocks
        d.new_prefill_blocks = 0

    def _end(self, req: SimRequest) -> None:
        d = self._decisions.pop(req.rid)
        self.policy.on_finish(d)
        d.backend.prefill_blocks -= d.new_prefill_blocks     # the router's end(): first byte bookkeeping
        d.new_prefill_blocks = 0
        d.backend.in_flight -= 1
        d.backend.active_blocks -= d.request_blocks
        d.request_blocks = 0

    def run(self, requests: Sequence[SimRequest], concurrency: int, max_sim_s: float = 1e7) -> list[SimRequest]:
        """Send ``requests`` in order with ``concurrency`` in flight; returns them, finished (in place).

        Raises:
            RuntimeError: nothing can make progress (a bug) or ``max_sim_s`` passed.
        """
        todo = deque(requests)
        held: list[tuple[SimRequest, RouteInput, float]] = []
        in_client = 0
        steps: list[tuple[float, int]] = []   # (end time, replica)
        done = 0
        total = len(requests)

        def release() -> None:
            nonlocal in_client
            while todo and in_client < concurrency:
                req = todo.popleft()
                req.arrived = self.now
                in_client += 1
                held.append((req, self._route_input(req), -1.0))
            still = []
            for req, rin, since in held:
                if not self._route(req, rin, None if since < 0 else since):
                    still.append((req, rin, self.now if since < 0 else since))
            held[:] = still

        def kick() -> None:
            for r in self.replicas:
                if r.busy_until is None and r.has_work():
                    dur = r.start_step(self.now)
                    if not r.running:       # nothing admitted (blocks in use): wait for a finish elsewhere
                        r._step = []
                        continue
                    r.busy_until = self.now + dur
                    heapq.heappush(steps, (r.busy_until, r.index))

        release()
        kick()
        while done < total:
            if not steps:
                # only held requests: wait for the policy's next deadline or the hold timeout
                waits = [since + self.router_queue_timeout for _, _, since in held if since >= 0]
                rc = getattr(self.policy, "recheck_in", lambda: None)()
                if rc is not None:
                    waits.append(self.now + rc + 1e-6)
                if not waits:
                    raise RuntimeError("simulation stuck: nothing running and nothing held")
                self.now = max(self.now, min(waits))
                release()
                kick()
                continue
            t, i = heapq.heappop(steps)
            self.now = t
            r = self.replicas[i]
            r.busy_until = None
            firsts, finished, batch = r.finish_step()
            if batch is not None:
                self.index.apply(i, batch)
            for req in firsts:
                req.first_token = self.now
                self._first_byte(req)
            for req in finished:
                req.finished = self.now
                self._end(req)
                in_client -= 1
                done += 1
            release()
            kick()
            if self.now > max_sim_s:
                raise RuntimeError("simulation ran past max_sim_s")
        return list(requests)


# -- workloads ------------------------------------------------------------------------------------------

def _syllable(token: int) -> str:
    """A token's text: 3 letters and a space (4 characters per token, about English BPE's average)."""
    a = "bcdfghjklmnprstvwz"
    v = "aeiou"
    return a[token % 18] + v[(token // 18) % 5] + a[(token // 90) % 18] + " "


def make_workload(groups: int, prefix_tokens: Sequence[int], requests: int, question_tokens: int,
                  output_len: int, seed: int, zipf_s: float = 0.0, block_size: int = 16,
                  salt: str = "") -> list[SimRequest]:
    """A shared-prefix workload: ``groups`` system prompts (``prefix_tokens[g]`` tokens each), ``requests``
    short questions (``question_tokens`` each) spread over the groups uniformly (``zipf_s == 0``: as
    evenly as possible) or with probability ``1 / rank ** zipf_s``, in a seeded random order.

    Token ids are random per group (a group's prompts share exactly its prefix); the text mirrors them
    (:func:`_syllable`: 4 characters per token), so ``prefix_aware`` sees the same sharing.
    """
    rng = random.Random(seed)
    prefixes = []
    for g in range(groups):
        grng = random.Random(f"{seed}-{salt}-prefix-{g}")
        prefixes.append([grng.randrange(1000, 30000) for _ in range(prefix_tokens[g])])
    if zipf_s > 0:
        weights = [1.0 / (g + 1) ** zipf_s for g in range(groups)]
        order = rng.choices(range(groups), weights=weights, k=requests)
    else:
        order = [i % groups for i in range(requests)]
        rng.shuffle(order)
    out = []
    for i, g in enumerate(order):
        q = [rng.randrange(1000, 30000) for _ in range(question_tokens)]
        toks = prefixes[g] + q
        text = "".join(_syllable(t) for t in toks)
        req = SimRequest(i, g, toks, text, output_len)
        req.hashes = block_hash_chain(toks, block_size, salt or None)
        out.append(req)
    return out


# -- the offline best placement -----------------------------------------------------------------------

def _lru_replay(reqs: Sequence[SimRequest], num_blocks: int, block_size: int) -> int:
    """Cached prompt tokens of ``reqs`` served one at a time, in order, by one pool of ``num_blocks``
    (the block pool rules of :class:`SimReplica`, without concurrency)."""
    free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
    bhash: list[bytes | None] = [None] * num_blocks
    cached: dict[bytes, int] = {}
    total = 0
    for r in reqs:
        max_hit = min(max(0, (len(r.tokens) - 1) // block_size), len(r.hashes))
        k = 0
        while k < max_hit and r.hashes[k] in cached:
            k += 1
        total += k * block_size
        need = -(-(len(r.tokens) + r.output_len) // block_size)
        if need > num_blocks:
            raise ValueError(f"request {r.rid} needs {need} blocks, the pool has {num_blocks}")
        blocks = [cached[h] for h in r.hashes[:k]]
        for b in blocks:
            free.pop(b)
        for _ in range(need - k):
            b, _ = free.popitem(last=False)
            if bhash[b] is not None:
                del cached[bhash[b]]
                bhash[b] = None
            blocks.append(b)
        for i in range(k, len(r.hashes)):
            h = r.hashes[i]
            if h not in cached:
                bhash[blocks[i]] = h
                cached[h] = blocks[i]
        for b in reversed(blocks):
            free[b] = None
    return total


def best_placement(requests: Sequence[SimRequest], num_replicas: int, num_blocks: int,
                   block_size: int = 16) -> tuple[int, list[list[int]]]:
    """The best static placement of the groups over ``num_replicas`` pools of ``num_blocks``.

    Returns:
        ``(cached prompt tokens, groups per replica)``: the most any partition of the groups caches when
        each replica serves its groups' requests one at a time in arrival order (:func:`_lru_replay`),
        found exactly by a DP over subsets (``3 ** groups`` steps; groups <= 12).

    Raises:
        ValueError: more than 12 groups.
    """
    groups = sorted({r.group for r in requests})
    gi = {g: i for i, g in enumerate(groups)}
    n = len(groups)
    if n > 12:
        raise ValueError(f"best_placement enumerates subsets: at most 12 groups, got {n}")
    full = (1 << n) - 1
    value = [0] * (full + 1)
    for mask in range(1, full + 1):
        sub = [r for r in requests if mask >> gi[r.group] & 1]
        value[mask] = _lru_replay(sub, num_blocks, block_size)
    # f[k][mask]: best over partitions of mask into at most k parts
    f = value[:]
    choice: list[list[int]] = [[mask] for mask in range(full + 1)]
    for _ in range(1, num_replicas):
        g = f[:]
        gc = [c[:] for c in choice]
        for mask in range(1, full + 1):
            low = mask & -mask      # the part holding the lowest group: no partition counted twice
            sub = mask
            while sub:
                if sub & low and sub != mask:
                    v = value[sub] + f[mask ^ sub]
                    if v > g[mask]:
                        g[mask] = v
                        gc[mask] = [sub] + choice[mask ^ sub]
                sub = (sub - 1) & mask
        f, choice = g, gc
    parts = [[groups[i] for i in range(n) if m >> i & 1] for m in choice[full]]
    return f[full], parts

