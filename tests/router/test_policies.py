"""Routing policies with fake backends (no model, no network)."""

from __future__ import annotations

import collections
import time

import pytest

from tokenmill.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tokenmill.router.backends import Backend, BackendSpec
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.policies import KVAware, LeastLoad, PrefixAware, RoundRobin, RouteInput, make_policy
from tokenmill.router.prefix_tree import PrefixTree
from tokenmill.router.prompt import block_hash_chain


def backends(n: int) -> list[Backend]:
    return [Backend(BackendSpec(f"http://b{i}:8000"), i, healthy=True) for i in range(n)]


def test_round_robin_cycles():
    bs = backends(3)
    p = RoundRobin()
    assert [p.select(bs, RouteInput()).backend.index for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_load_prefers_idle_and_rotates_ties():
    bs = backends(3)
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 5, 1, 1
    p = LeastLoad()
    got = [p.select(bs, RouteInput()).backend.index for _ in range(4)]
    assert set(got) == {1, 2} and got[0] != got[1]
    with pytest.raises(ValueError):
        p.select([], RouteInput())


# -- prefix tree ---------------------------------------------------------------
def test_prefix_tree_match_insert_split():
    t = PrefixTree()
    assert t.match("hello world") == 0
    t.insert("hello world")
    assert t.size == len("hello world")
    assert t.match("hello world") == 11
    assert t.match("hello there") == 6
    t.insert("hello there")          # splits the edge at "hello "
    assert t.size == len("hello world") + len("there")
    assert t.match("hello there, you") == 11
    assert t.match("help") == 3
    assert t.insert("hello world") == 0  # nothing new


def test_prefix_tree_evicts_least_recently_used_leaves():
    clock = iter(range(1000))
    t = PrefixTree(max_size=0, clock=lambda: float(next(clock)))
    t.insert("A" * 10 + "x" * 10)    # old
    t.insert("B" * 20)               # newer
    t.insert("A" * 10 + "y" * 10)    # newest, shares "A"*10 with the first
    t.match("B" * 20)                # touch B: now the first branch's "x" leaf is the oldest
    assert t.size == 50
    removed = t.evict(40)
    assert removed == 10
    assert t.match("A" * 10 + "x" * 10) == 10   # the x leaf went, the shared A edge stays
    assert t.match("B" * 20) == 20
    assert t.match("A" * 10 + "y" * 10) == 20
    t.evict(0)
    assert t.size == 0 and t.match("B" * 20) == 0


def test_prefix_tree_bounded_on_insert():
    t = PrefixTree(max_size=100)
    for i in range(50):
        t.insert(f"{i:04d}" + "z" * 20)
    assert t.size <= 100
    assert t.match("0049" + "z" * 20) == 24   # the latest survives


# -- prefix_aware ----------------------------------------------------------------
def test_prefix_aware_routes_repeated_prefix_to_the_same_backend():
    bs = backends(3)
    p = PrefixAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    sys_a, sys_b = "You are agent A. " * 20, "You are agent B. " * 20
    first_a = p.select(bs, RouteInput(sys_a + "question 1"))
    assert first_a.reason == "cache_capacity"
    first_b = p.select(bs, RouteInput(sys_b + "question 1"))
    assert first_b.reason == "cache_capacity" and first_b.backend is not first_a.backend  # smallest tree
    for q in range(2, 6):
        d = p.select(bs, RouteInput(sys_a + f"question {q}"))
        assert d.backend is first_a.backend and d.reason == "prefix_match"
        assert d.matched >= len(sys_a) and d.unit == "chars"
        d = p.select(bs, RouteInput(sys_b + f"question {q}"))
        assert d.backend is first_b.backend


def test_prefix_aware_balance_thresholds_need_both_abs_and_rel():
    bs = backends(2)
    p = PrefixAware(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=2.0)
    text = "shared system prompt " * 10
    home = p.select(bs, RouteInput(text)).backend
    other = bs[1 - home.index]
    # abs difference 5 > 4 but 6 > 1 * 2.0 holds too -> imbalanced -> least loaded
    home.in_flight, other.in_flight = 6, 1
    d = p.select(bs, RouteInput(text + "q"))
    assert d.backend is other and d.reason == "load_balance"
    p.tree(other).clear()  # (the load-balanced request taught `other` the prefix; forget it)
    # abs difference 5 > 4 but 15 > 10 * 2.0 is false -> balanced -> cache wins
    home.in_flight, other.in_flight = 15, 10
    d = p.select(bs, RouteInput(text + "q2"))
    assert d.backend is home and d.reason == "prefix_match"
    # relative rule holds (4 > 1*2) but abs difference 3 <= 4 -> balanced
    home.in_flight, other.in_flight = 4, 1
    assert p.select(bs, RouteInput(text + "q3")).backend is home


def test_prefix_aware_below_threshold_goes_to_smallest_tree_and_forgets_dead_backend():
    bs = backends(2)
    p = PrefixAware(cache_threshold=0.9, balance_abs_threshold=100)
    p.select(bs, RouteInput("x" * 100))           # to one backend (both empty)
    big = max(bs, key=lambda b: p.tree(b).size)
    d = p.select(bs, RouteInput("x" * 50 + "y" * 60))  # match 50/110 < 0.9
    assert d.reason == "cache_capacity" and d.backend is not big
    p.on_backend_down(big)
    assert p.tree(big).size == 0


# -- KV index and kv_aware -----------------------------------------------------------
def stored(hashes, parent=None, bs=4):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[0] * (bs * len(hashes)),
                       block_size=bs)


def test_kv_index_match_and_removal():
    idx = KVIndex()
    chain = block_hash_chain(list(range(16)), 4)
    assert len(chain) == 4
    idx.apply(0, KVEventBatch(ts=0.0, events=[stored(chain[:3])]))
    idx.apply(1, KVEventBatch(ts=0.0, events=[stored(chain[:1])]))
    assert idx.match(chain, [0, 1, 2]) == {0: 3, 1: 1, 2: 0}
    idx.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[chain[1]])]))
    assert idx.match(chain, [0, 1]) == {0: 1, 1: 1}   # a hole ends the prefix
    idx.apply(1, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert idx.match(chain, [0, 1]) == {0: 1, 1: 0}
    assert idx.block_size == 4 and idx.has_events(1)


def test_kv_index_keeps_a_lower_tiers_events_apart():
    """The KV offloading tier publishes BlockStored/BlockRemoved with medium="DISK" (or "CPU"): a block
    leaving the tier must not drop it from the pool's index, nor a block stored in the tier count as
    pool-resident; the tier's blocks are indexed on their own (tier_match), per medium, and survive a
    prefix-cache reset of the pool (AllBlocksCleared) but not a lost event stream (clear_backend)."""
    idx = KVIndex()
    chain = block_hash_chain(list(range(24)), 4)
    idx.apply(0, KVEventBatch(ts=0.0, events=[stored(chain[:3])]))
    idx.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[chain[1]], medium="DISK")]))
    assert idx.match(chain, [0]) == {0: 3}
    disk = stored(chain[:4])
    disk.medium = "DISK"
    idx.apply(1, KVEventBatch(ts=0.0, events=[disk]))
    assert idx.match(chain, [0, 1]) == {0: 3, 1: 0}
    assert idx.tier_match(chain, {0: 3, 1: 0}, 5) == {0: 0, 1: 4}
    assert idx.tier_match(chain, {1: 0}, 2) == {1: 2}                      # the limit (last token) holds
    host = stored(chain[4:5], parent=chain[3])
    host.medium = "CPU"
    idx.apply(1, KVEventBatch(ts=0.0, events=[host]))
    assert idx.tier_match(chain, {1: 0}, 6) == {1: 5}                     # DISK then CPU: one run
    # a pool block in the middle continues the run as the engine's lookup does (pool, then tier)
    idx.apply(1, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[chain[2]], medium="DISK"),
                                              stored(chain[:3])]))
    assert idx.match(chain, [1]) == {1: 3} and idx.tier_match(chain, {1: 3}, 6) == {1: 2}
    idx.apply(1, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[chain[3]], medium="DISK")]))
    assert idx.tier_match(chain, {1: 3}, 6) == {1: 0}                     # a hole ends it
    assert idx.tier_holds(1, chain[4]) and not idx.tier_holds(1, chain[3]) and not idx.tier_holds(0, chain[0])
    idx.apply(1, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))       # the pool's reset: files stay
    assert idx.match(chain, [1]) == {1: 0} and idx.tier_match(chain, {1: 0}, 6) == {1: 2}
    idx.clear_backend(1)
    assert idx.tier_match(chain, {1: 0}, 6) == {1: 0}
    idx.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[chain[1]])]))
    assert idx.match(chain, [0]) == {0: 1}


def test_kv_aware_scores_a_tier_hit_below_a_pool_hit_and_above_a_miss():
    """Three idle backends, a 16-block prompt: 0 holds 12 blocks in its pool, 1 the same 12 only in its
    KV offloading tier, 2 nothing. Costs (prefill + recomputed + decode): 0: 4 + 0 + 16; 1: 4 + w x 12
    + 0 + 16; 2: 16 + 12 + 16. With the pool's copy gone, the tier's holder wins (reason kv_tier)."""
    bs = backends(3)
    idx = KVIndex()
    chain = block_hash_chain(list(range(64)), 4)
    idx.apply(0, KVEventBatch(ts=0.0, events=[stored(chain[:12])]))
    disk = stored(chain[:12])
    disk.medium = "DISK"
    idx.apply(1, KVEventBatch(ts=0.0, events=[disk]))
    p = _kv_policy(idx, tier_weight=0.25)
    d = p.select(bs, RouteInput(block_hashes=chain, num_prompt_tokens=64))
    assert d.backend.index == 0 and d.costs == {0: 20.0, 1: 23.0, 2: 44.0}
    assert d.detail["candidates"][1]["ov_tier"] == 12 and d.detail["candidates"][1]["recomputed"] == 0
    idx.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=chain[:12])]))
    p = _kv_policy(idx, tier_weight=0.25, placement=False)
    d = p.select(bs, RouteInput(block_hashes=chain, num_prompt_tokens=64))
    assert d.backend.index == 1 and d.reason == "kv_tier" and d.costs == {0: 32.0, 1: 23.0, 2: 32.0}
    # tier_weight 1: a tier block costs a computed one (the old behaviour: tier events count for nothing)
    d = _kv_policy(idx, tier_weight=1.0, placement=False).select(bs, RouteInput(block_hashes=chain,
                                                                                num_prompt_tokens=64))
    assert d.costs == {0: 32.0, 1: 32.0, 2: 32.0}
    with pytest.raises(ValueError, match="tier weight"):
        _kv_policy(idx, tier_weight=1.5)


def test_block_hash_chain_matches_the_engine_and_salt_changes_it():
    from tokenmill.core.prefix_cache import update_block_hashes
    from tokenmill.core.request import Request
    from tokenmill.sampling_params import SamplingParams

    toks = list(range(100, 140))
    req = Request("r", toks, SamplingParams(max_tokens=1), cache_salt="s1")
    assert update_block_hashes(req, 16) == block_hash_chain(toks, 16, "s1")
    assert block_hash_chain(toks, 16, "s1")[0] != block_hash_chain(toks, 16)[0]


def _kv_policy(idx, **kw):
    return KVAware(idx, block_size=4, **kw)


def test_kv_aware_prefers_the_backend_holding_the_prefix():
    bs = backends(3)
    idx = KVIndex()
    toks = list(range(64))
    chain = block_hash_chain(toks, 4)
    idx.apply(2, KVEventBatch(ts=0.0, events=[stored(chain[:12])]))
    p = _kv_policy(idx)
    d = p.select(bs, RouteInput(block_hashes=chain, num_prompt_tokens=64))
    assert d.backend.index == 2 and d.reason == "kv_overlap"
    assert d.matched == 48 and d.total == 64 and d.new_prefill_blocks == 4 and d.request_blocks == 16
    # cost = 1 * (prefill + recomputed) + decode: 2 -> (4 + 0) + 16 = 20, others (16 + 12) + 16 = 44
    assert d.costs == {0: 44.0, 1: 44.0, 2: 20.0}
    assert d.detail["candidates"][0]["recomputed"] == 12 and d.detail["best_overlap"] == [2]
    # Dynamo's cost alone: others 16 + 16 = 32
    dyn = _kv_policy(idx, eviction_weight=0.0, recompute_weight=0.0).select(bs, RouteInput(block_hashes=chain,
                                                                                          num_prompt_tokens=64))
    assert dyn.costs == {0: 32.0, 1: 32.0, 2: 20.0}


def test_kv_aware_load_outweighs_a_small_overlap():
    bs = backends(2)
    idx = KVIndex()
    chain = block_hash_chain(list(range(64)), 4)
    idx.apply(0, KVEventBatch(ts=0.0, events=[stored(chain[:2])]))
    bs[0].in_flight, bs[0].prefill_blocks = 20, 10   # cost 0: (10 + 14) + (20 + 16) = 60 > 32
    d = _kv_policy(idx).select(bs, RouteInput(block_hashes=chain, num_prompt_tokens=64))
    assert d.backend.index == 1 and d.reason == "kv_load"


def test_kv_aware_last_token_is_never_a_hit():
    bs = backends(2)
    idx = KVIndex()
    chain = block_hash_chain(list(range(16)), 4)     # exactly 4 full blocks
    idx.apply(0, KVEventBatch(ts=0.0, events=[stored(chain)]))
    d = _kv_policy(idx).select(bs, RouteInput(block_hashes=chain, num_prompt_tokens=16))
    assert d.backend.index == 0 and d.matched == 12 and d.new_prefill_blocks == 1


def test_kv_aware_falls_back_to_load_without_events():
    bs = backends(2)
    bs[0].in_flight = 3
    p = _kv_policy(KVIndex())
    d = p.select(bs, RouteInput(block_hashes=block_hash_chain(list(range(32)), 4), num_prompt_tokens=32))
    assert d.backend.index == 1 and d.reason == "load_fallback"


def test_kv_aware_temperature_spreads_choices():
    bs = backends(2)
    idx = KVIndex()
    chain = block_hash_chain(list(range(32)), 4)
    idx.apply(0, KVEventBatch(ts=0.0, events=[stored(chain[:2])]))
    rin = RouteInput(block_hashes=chain, num_prompt_tokens=32)
    def pick(p):
        d = p.select(bs, rin)
        p.on_finish(d)
        return d.backend.index

    det = _kv_policy(idx)
    assert {pick(det) for _ in range(20)} == {0}
    hot = _kv_policy(idx, temperature=1.0, seed=1)
    counts = collections.Counter(pick(hot) for _ in range(400))
    # normalised costs 0 and 1: p(0) = 1 / (1 + e^-1) ~ 0.73
    assert 0.63 < counts[0] / 400 < 0.83


def test_make_policy_rejects_unknown_and_bad_parameters():
    with pytest.raises(ValueError):
        make_policy("random_walk")
    with pytest.raises(ValueError):
        make_policy("kv_aware", temperature=-1)
    with pytest.raises(ValueError):
        make_policy("prefix_aware", cache_threshold=2.0)


def test_kv_aware_counts_in_flight_blocks_before_events_arrive():
    bs = backends(2)
    p = _kv_policy(KVIndex())
    a = block_hash_chain(list(range(64)), 4)
    b = block_hash_chain(list(range(1000, 1064)), 4)
    rin_a, rin_b = RouteInput(block_hashes=a, num_prompt_tokens=64), RouteInput(block_hashes=b, num_prompt_tokens=64)

    def begin(d):  # what the proxy does when it forwards a request
        d.backend.in_flight += 1
        d.backend.active_blocks += d.request_blocks
        d.backend.prefill_blocks += d.new_prefill_blocks

    d1 = p.select(bs, rin_a)
    begin(d1)
    d2 = p.select(bs, rin_b)          # equal prefill work elsewhere is cheaper: the other backend
    begin(d2)
    assert d2.backend is not d1.backend and d2.reason == "load_fallback"
    d3 = p.select(bs, rin_a)          # same prefix as d1, no events yet: follows d1's in-flight blocks
    assert d3.backend is d1.backend and d3.reason == "kv_overlap" and d3.matched == 60
    p.on_finish(d1)
    p.on_finish(d3)
    assert p.pending[d1.backend.index] == {}


def test_least_load_from_backend_metrics():
    from tokenmill.router.backends import parse_load

    text = ('# HELP x\ntokenmill:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'tokenmill:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'tokenmill:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
            'tokenmill:num_requests_running_other 100\nvllm:num_requests_waiting{model_name="m"} 1\n')
    assert parse_load(text) == 10
    bs = backends(2)
    bs[0].reported_load, bs[1].reported_load = 5, 1
    bs[0].in_flight = 0            # what this router alone sees would pick backend 0
    p = LeastLoad("metrics")
    got = [p.select(bs, RouteInput()).backend.index for _ in range(6)]
    # 1 (load 1 -> 2), 1 (-> 3), 1 (-> 4), then ties at 5 alternate
    assert got[:3] == [1, 1, 1] and sorted(got[3:5]) == [0, 1]
    with pytest.raises(ValueError):
        LeastLoad("vibes")


# -- kv_aware's eviction term -------------------------------------------------------
def _fill(idx, backend, chain, uses=1):
    """``backend`` stores ``chain``; ``uses - 1`` more requests routed there use it."""
    idx.apply(backend, KVEventBatch(ts=0.0, events=[stored(chain)]))
    for _ in range(uses - 1):
        idx.touch(backend, chain)


def test_kv_index_learns_capacity_and_counts_reused_blocks_a_placement_evicts():
    idx = KVIndex()
    a = block_hash_chain(list(range(16)), 4)            # 4 blocks
    b = block_hash_chain(list(range(100, 116)), 4)      # 4 blocks
    _fill(idx, 0, a)
    _fill(idx, 0, b)
    assert idx.capacity[0] == 8 and idx.num_reused(0) == 0
    # stale (never reused) blocks go first: nothing reused is lost
    assert idx.reused_overflow(0, 6) == 0 and idx.reused_overflow(1, 6) == 0   # (1: pool unknown)
    idx.touch(0, a)                                     # a second request used a: reused now
    assert idx.num_reused(0) == 4
    assert idx.reused_overflow(0, 3) == 0               # 4 reused + 3 new fit in 8
    assert idx.reused_overflow(0, 6) == 2               # 4 + 6 - 8
    assert idx.reused_overflow(0, 20) == 4              # at most the reused blocks there are
    # blocks in use are never evicted: in-use reused blocks are not counted, in-use others take room
    assert idx.reused_overflow(0, 6, keep=set(a[:3])) == 1
    assert idx.reused_overflow(0, 3, keep=set(b)) == 3  # 4 reused + 4 in use + 3 new - 8
    # removed blocks free room (the pool size stays learnt); a reused one leaves the count
    idx.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[a[0], b[0]])]))
    assert idx.capacity[0] == 8 and idx.num_reused(0) == 3
    assert idx.reused_overflow(0, 6) == 1
    idx.clear_backend(0)
    assert 0 not in idx.capacity and idx.num_reused(0) == 0


def _two_replicas_one_busy():
    """Backend 0 holds prefix A (reused) with a cold prefill queued; backend 1's pool is full of prefix B."""
    bs = backends(2)
    idx = KVIndex()
    a = block_hash_chain(list(range(40)), 4)             # 10 blocks
    b = block_hash_chain(list(range(500, 540)), 4)       # 10 blocks
    _fill(idx, 0, a, uses=3)
    _fill(idx, 1, b[:8], uses=1)                         # learns 1's pool size (8), then decides uses below
    bs[0].prefill_blocks = 14                            # a cold prefill queued on 0
    return bs, idx, a, b


def test_kv_aware_eviction_term_keeps_a_prefix_off_a_pool_full_of_reused_blocks():
    bs, idx, a, b = _two_replicas_one_busy()
    for blk in b[:8]:
        idx.touch(1, [blk])                              # B was reused on 1: evicting it costs a recompute
    rin = RouteInput(block_hashes=a, num_prompt_tokens=40)
    # Dynamo's cost (eviction weight 0): 0 -> (14 + 1) + 10 = 25, 1 -> 10 + 10 = 20: A moves to 1
    dyn = _kv_policy(idx, eviction_weight=0.0, recompute_weight=0.0).select(bs, rin)
    assert dyn.backend.index == 1 and dyn.costs == {0: 25.0, 1: 20.0} and dyn.evicted_blocks == 0
    # with the eviction term: 1 would evict 8 reused blocks of B (its pool holds 8): 20 + 8 = 28 > 25
    p = _kv_policy(idx, recompute_weight=0.0)       # (the eviction term alone)
    d = p.select(bs, rin)
    assert d.backend.index == 0 and d.reason == "kv_overlap"
    assert d.costs == {0: 25.0, 1: 28.0}
    # weight 0.5: half a prefill block per eviction -> 24 < 25, A moves
    assert _kv_policy(idx, eviction_weight=0.5, recompute_weight=0.0).select(bs, rin).backend.index == 1


def test_kv_aware_eviction_term_ignores_blocks_nobody_reused():
    bs, idx, a, b = _two_replicas_one_busy()              # B stored on 1 but never reused
    d = _kv_policy(idx, recompute_weight=0.0).select(bs, RouteInput(block_hashes=a, num_prompt_tokens=40))
    assert d.backend.index == 1 and d.costs == {0: 25.0, 1: 20.0} and d.evicted_blocks == 0


def test_kv_aware_eviction_term_spares_blocks_of_requests_in_flight():
    bs, idx, a, b = _two_replicas_one_busy()
    for blk in b[:8]:
        idx.touch(1, [blk])
    p = _kv_policy(idx)
    # a request using B's first 6 blocks is in flight on 1: those cannot be evicted, the other 2 can
    p.pending[1] = {h: 1 for h in b[:6]}
    assert p.evicted_reused(1, 10, a, p.pending[1]) == 2


def test_kv_aware_routing_touches_the_chosen_backends_blocks():
    bs = backends(2)
    idx = KVIndex()
    a = block_hash_chain(list(range(16)), 4)
    _fill(idx, 0, a)
    p = _kv_policy(idx)
    d = p.select(bs, RouteInput(block_hashes=a, num_prompt_tokens=16))
    assert d.backend.index == 0
    assert idx.num_reused(0) == 4 and idx.num_reused(1) == 0    # stored (1 use) + this request (1 use)


def test_make_policy_rejects_negative_eviction_weight():
    with pytest.raises(ValueError):
        make_policy("kv_aware", eviction_weight=-1)


def _begin(d):  # what the proxy does when it forwards a request
    d.backend.in_flight += 1
    d.backend.active_blocks += d.request_blocks
    d.backend.prefill_blocks += d.new_prefill_blocks


def test_kv_aware_recompute_term_keeps_a_new_prefix_group_together():
    """The burst measured in benchmarks/routing.py: three new prefixes A, B, C (10 blocks each) arrive at
    once; a second request of A comes while 0 still has A and C to prefill. Dynamo's cost sends it to 1
    (its queue is shorter by C's prefill), which then computes A a second time and keeps a copy of it;
    with the recompute term A stays on 0."""
    a = block_hash_chain(list(range(40)) + [7000], 4)       # 10 full blocks + a partial one
    b = block_hash_chain(list(range(500, 540)) + [7001], 4)
    c = block_hash_chain(list(range(900, 940)) + [7002], 4)
    a2 = block_hash_chain(list(range(40)) + [7003], 4)      # a second question of A
    rin = lambda chain: RouteInput(block_hashes=chain, num_prompt_tokens=41)  # noqa: E731

    def burst(**kw):
        bs = backends(2)
        p = _kv_policy(KVIndex(), **kw)
        for chain in (a, b, c):
            _begin(p.select(bs, rin(chain)))
        assert [bk.prefill_blocks for bk in bs] == [22, 11]   # A and C on 0, B on 1 (11 blocks each)
        return p.select(bs, rin(a2))

    dyn = burst(eviction_weight=0.0, recompute_weight=0.0)
    # 0: prefill 22 + 1, decode 20 distinct + 2 in flight + 1 = 46; 1: prefill 11 + 11, decode 10 + 1 + 11 = 44
    assert dyn.backend.index == 1 and dyn.costs == {0: 46.0, 1: 44.0} and dyn.new_prefill_blocks == 11
    d = burst()
    # 1 would recompute A's 10 blocks that 0 is computing: 44 + 10 = 54 > 46
    assert d.backend.index == 0 and d.reason == "kv_overlap" and d.costs == {0: 46.0, 1: 54.0}
    assert d.new_prefill_blocks == 1 and d.detail["candidates"][1]["recomputed"] == 10


def test_kv_aware_recompute_term_is_a_threshold_not_a_lock():
    """A group still moves when its replica's cost exceeds the other's by more than the recomputed prefix."""
    bs = backends(2)
    idx = KVIndex()
    a = block_hash_chain(list(range(40)) + [7000], 4)       # 10 full blocks
    idx.apply(0, KVEventBatch(ts=0.0, events=[stored(a[:10])]))
    idx.apply(1, KVEventBatch(ts=0.0, events=[stored(block_hash_chain(list(range(300, 304)), 4))]))
    rin = RouteInput(block_hashes=a, num_prompt_tokens=41)
    p = _kv_policy(idx)
    bs[0].prefill_blocks = 15                    # 0: (15 + 1) + 11 = 27; 1: (11 + 10) + 11 = 32
    assert p.select(bs, rin).backend.index == 0
    bs[0].prefill_blocks = 25                    # 0: 37 > 32: a queue this long moves the request
    d = p.select(bs, rin)
    assert d.backend.index == 1 and d.reason == "kv_load" and d.costs == {0: 37.0, 1: 32.0}
    # a 12-block queue: Dynamo's cost moves the group for a 2-block gap (0 at 13 + 11 = 24, 1 at 11 + 11 = 22)
    bs[0].prefill_blocks = 12
    assert _kv_policy(idx, recompute_weight=0.0).select(bs, rin).backend.index == 1   # 24 > 22
    assert _kv_policy(idx).select(bs, rin).backend.index == 0                         # 24 < 32


def test_make_policy_rejects_negative_recompute_weight():
    with pytest.raises(ValueError):
        make_policy("kv_aware", recompute_weight=-0.5)


def test_decision_log_summary_counts_moves_and_estimates(tmp_path):
    import importlib.util
    import json
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "routing_bench", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "routing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cand = lambda ov, dec, q=0, ev=0: {"ov": ov, "decode": dec, "queued_prefill": q, "evicted": ev}  # noqa: E731
    recs = [
        {"t": 0.0, "prefix": "a", "chosen": 0, "best_overlap": [], "cheapest": [0, 1],
         "candidates": {"0": cand(0, 5), "1": cand(0, 5)}, "est_cached_tokens": 0, "cached_tokens": 0,
         "event_lag_s": 0.001},
        {"t": 1.0, "prefix": "a", "chosen": 1, "best_overlap": [0], "cheapest": [1],        # off its best: decode
         "candidates": {"0": cand(10, 40), "1": cand(0, 20)}, "est_cached_tokens": 0, "cached_tokens": 0,
         "event_lag_s": 0.003},
        {"t": 2.0, "prefix": "a", "chosen": 0, "best_overlap": [0, 1], "cheapest": [1],     # temperature
         "candidates": {"0": cand(10, 20), "1": cand(10, 10)}, "est_cached_tokens": 160, "cached_tokens": 64,
         "event_lag_s": 0.002},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = mod.summarize_decisions(path, block_size=16)
    assert s["decisions"] == 3 and s["off_best"] == 1 and s["off_best_by"]["decode"] == 1
    assert s["off_cheapest"] == 1 and s["overestimated"] == 1 and s["underestimated"] == 0
    assert s["group_switches"] == 2 and s["lag_p50_ms"] == 2.0 and s["lag_max_ms"] == 3.0


# -- holding requests at the router ---------------------------------------------
def test_kv_aware_holds_a_follower_until_its_prefix_is_computed():
    """A second request of a prefix that is still being prefilled on its backend waits for the
    BlockStored events (the engine shares computed blocks only): sent at once it would compute the
    prefix a second time next to the first."""
    bs = backends(2)
    idx = KVIndex()
    for b in bs:
        idx.expect_events(b.index)
    a = block_hash_chain(list(range(40)) + [7000], 4)         # 10 full blocks + a partial one
    a2 = block_hash_chain(list(range(40)) + [7001], 4)
    rin = lambda chain: RouteInput(block_hashes=chain, num_prompt_tokens=41)  # noqa: E731
    p = _kv_policy(idx)
    assert p.hold(bs, rin(a)) == (None, bs)                   # nothing in flight: route now
    d1 = p.select(bs, rin(a))
    _begin(d1)
    reason, use = p.hold(bs, rin(a2))
    assert reason == "prefill" and list(use) == bs
    # part of the prefix confirmed is not enough; all of it is
    idx.apply(d1.backend.index, KVEventBatch(ts=0.0, events=[stored(a[:6])]))
    assert p.hold(bs, rin(a2))[0] == "prefill"
    idx.apply(d1.backend.index, KVEventBatch(ts=0.0, events=[stored(a[6:10], parent=a[5])]))
    assert p.hold(bs, rin(a2)) == (None, bs)
    d2 = p.select(bs, rin(a2))
    assert d2.backend is d1.backend and d2.matched == 40
    # the first request ending without its events: held for the grace (its answer can overtake the event
    # batch of the step that computed it), then released
    p2 = _kv_policy(KVIndex())
    p2.index.expect_events(0)
    p2.index.expect_events(1)
    assert p2.recheck_in() is None
    d = p2.select(bs, rin(a))
    assert p2.hold(bs, rin(a2))[0] == "prefill"
    p2.on_finish(d)
    assert p2.hold(bs, rin(a2))[0] == "prefill"
    assert 0 < p2.recheck_in() <= p2.EVENT_GRACE_S
    for u in p2.unconfirmed.values():                          # the grace passes
        for h in u:
            u[h] = time.monotonic() - 1
    assert p2.hold(bs, rin(a2))[0] is None and p2.recheck_in() is None
    # off, or for a backend without an event subscription, nothing is held
    p3 = _kv_policy(KVIndex(), prefill_wait=False)
    p3.select(bs, rin(a))
    assert p3.hold(bs, rin(a2))[0] is None
    p4 = _kv_policy(KVIndex())
    p4.select(bs, rin(a))
    assert p4.hold(bs, rin(a2))[0] is None


def test_kv_aware_busy_backends_are_skipped_and_all_busy_holds():
    bs = backends(2)
    idx = KVIndex()
    p = _kv_policy(idx, busy_threshold=1.0, prefill_wait=False, placement=False)  # the filter itself
    x = block_hash_chain(list(range(1000, 1040)) + [1], 4)   # 10 full blocks
    y = block_hash_chain(list(range(2000, 2040)) + [2], 4)
    z = block_hash_chain(list(range(3000, 3040)) + [3], 4)
    rin = lambda chain: RouteInput(block_hashes=chain, num_prompt_tokens=41)  # noqa: E731
    # pool size unknown (no eviction seen yet): never busy
    for chain in (x, y):
        _begin(p.select(bs, rin(chain)))
    assert [b.in_flight for b in bs] == [1, 1]
    assert p.hold(bs, rin(z)) == (None, bs)
    # both pools evicted once at 24 blocks held: 24 is their size
    for b in (0, 1):
        idx.apply(b, KVEventBatch(ts=0.0, events=[stored(block_hash_chain(list(range(5000 + 100 * b, 5096 + 100 * b)), 4))]))
        idx.apply(b, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[block_hash_chain(list(range(5000 + 100 * b, 5004 + 100 * b)), 4)[0]])]))
    assert idx.pool_size(0) == 24 and idx.pool_size(1) == 24
    # each backend: 10 distinct + 1 tail in flight; z needs 11 + 1 more: 23 <= 24 fits
    assert p.hold(bs, rin(z)) == (None, bs)
    _begin(p.select(bs, rin(z)))
    # one of them now holds 22 + 2 tails; a fourth prefix fits only on the other
    w = block_hash_chain(list(range(4000, 4040)) + [4], 4)
    reason, use = p.hold(bs, rin(w))
    assert reason is None and len(use) == 1 and use[0].in_flight == 1
    _begin(p.select(use, rin(w)))
    reason, use = p.hold(bs, rin(block_hash_chain(list(range(6000, 6040)) + [5], 4)))
    assert reason == "busy" and list(use) == bs
    # a request of a prefix in flight there needs only its own blocks: not busy
    assert p.hold(bs, rin(block_hash_chain(list(range(1000, 1040)) + [9], 4)))[0] is None
    # a backend with nothing in flight is never busy
    assert not p.busy(Backend(BackendSpec("http://b9:8000"), 0, healthy=True), rin(z))
    with pytest.raises(ValueError):
        make_policy("kv_aware", busy_threshold=-0.5)
    assert make_policy("kv_aware", busy_threshold=0.0).busy_threshold is None     # 0: off
    assert make_policy("kv_aware").busy_threshold == 1.0


# -- pool size reported by the backend ------------------------------------------
def test_reported_pool_size_wins_over_the_learnt_one():
    """A router that subscribes to a pool already holding blocks sees BlockRemoved of blocks it never saw
    stored and learns a pool size below the real one; the size the backend reports is used instead."""
    idx = KVIndex()
    a = block_hash_chain(list(range(16)), 4)
    old = block_hash_chain(list(range(900, 916)), 4)     # stored before the router subscribed
    _fill(idx, 0, a)
    idx.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=old[:2])]))
    assert idx.pool_size(0) == 4                         # learnt: far below the real 64
    idx.touch(0, a)                                      # a is reused
    assert idx.reused_overflow(0, 4) == 4                # the learnt size says a would be evicted
    idx.set_pool_size(0, 64)
    assert idx.pool_size(0) == 64 and idx.reused_overflow(0, 4) == 0
    assert idx.pool_size(1) is None
    idx.set_pool_size(1, 32)                             # known before any event
    assert idx.pool_size(1) == 32
    idx.set_pool_size(0, None)                           # unknown again (the backend went down)
    assert idx.pool_size(0) == 4


def test_busy_hold_uses_the_reported_pool_size():
    bs = backends(1)
    idx = KVIndex()
    _fill(idx, 0, block_hash_chain(list(range(16)), 4))
    idx.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[b"x" * 8])]))  # learnt 4
    p = KVAware(index=idx, block_size=4, busy_threshold=1.0)
    bs[0].in_flight = 1
    req = RouteInput(num_prompt_tokens=12, block_hashes=block_hash_chain(list(range(200, 212)), 4))
    assert p.busy(bs[0], req)                            # 1 in flight + 3 new + 1 tail > 4
    idx.set_pool_size(0, 64)
    assert not p.busy(bs[0], req)


def test_parse_pool_blocks_reads_cache_config_info():
    from tokenmill.router.backends import parse_pool_blocks

    text = ('# HELP tokenmill:cache_config_info Information of the KV cache configuration.\n'
            '# TYPE tokenmill:cache_config_info gauge\n'
            'tokenmill:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
            'engine="0",model_name="m",num_gpu_blocks="120"} 1.0\n'
            'tokenmill:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
            'engine="1",model_name="m",num_gpu_blocks="100"} 1.0\n'
            'tokenmill:num_requests_running{engine="0",model_name="m"} 3.0\n')
    assert parse_pool_blocks(text) == 100                # the smallest core's pool (data parallel)
    vllm = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096",num_cpu_blocks="None"} 1.0\n')
    assert parse_pool_blocks(vllm) == 4096
    assert parse_pool_blocks('tokenmill:num_requests_running{engine="0"} 3.0\n') is None
    assert parse_pool_blocks('vllm:cache_config_info{num_gpu_blocks="None"} 1.0\n') is None
    assert parse_pool_blocks('this is { not prometheus') is None


def test_prometheus_exports_cache_config_info():
    from tokenmill.metrics.prometheus import PrometheusStatLogger
    from tokenmill.router.backends import parse_pool_blocks

    prom = PrometheusStatLogger("m", 2048)
    prom.set_cache_config(0, 4321, 16, "auto", True)
    text = prom.render().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("tokenmill:cache_config_info{"))
    assert 'num_gpu_blocks="4321"' in line and 'block_size="16"' in line and line.endswith(" 1.0")
    assert parse_pool_blocks(text) == 4321


def test_health_checker_reads_the_pool_size_until_known_and_again_after_a_restart():
    import asyncio

    import httpx

    from tokenmill.router.backends import HealthChecker

    state = {"blocks": 77, "metrics_calls": 0, "up": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not state["up"]:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/metrics":
            state["metrics_calls"] += 1
            return httpx.Response(200, text=f'tokenmill:cache_config_info{{engine="0",num_gpu_blocks='
                                            f'"{state["blocks"]}"}} 1.0\n')
        return httpx.Response(404)

    async def run() -> None:
        bs = backends(1)
        bs[0].healthy = False
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            hc = HealthChecker(bs, client, unhealthy_after=1, read_pool_size=True)
            assert await hc.check(bs[0]) and bs[0].pool_blocks == 77
            await hc.check(bs[0])
            assert state["metrics_calls"] == 1           # known: not read again
            state["up"] = False
            assert not await hc.check(bs[0]) and bs[0].pool_blocks is None
            state["up"], state["blocks"] = True, 55       # restarted with another pool
            assert await hc.check(bs[0]) and bs[0].pool_blocks == 55
            off = HealthChecker(backends(1), client)       # not kv_aware: /metrics is not read
            calls = state["metrics_calls"]
            assert await off.check(off.backends[0]) and off.backends[0].pool_blocks is None
            assert state["metrics_calls"] == calls

    asyncio.run(run())


def test_kv_aware_follower_released_by_the_first_ending_still_finds_its_prefix():
    """The first request's answer reached the router before the BlockStored batch of the step that computed
    its prompt (a replay of missed batches, or a loaded machine, delays it): the follower stays held until
    the events arrive and then goes where the prefix is, instead of to a backend with no overlap."""
    bs = backends(2)
    idx = KVIndex()
    for b in bs:
        idx.expect_events(b.index)
    a = block_hash_chain(list(range(40)) + [7000], 4)
    a2 = block_hash_chain(list(range(40)) + [7001], 4)
    rin = lambda chain: RouteInput(block_hashes=chain, num_prompt_tokens=41)  # noqa: E731
    p = _kv_policy(idx)
    d1 = p.select(bs, rin(a))
    _begin(d1)
    assert p.hold(bs, rin(a2))[0] == "prefill"
    p.on_finish(d1)                                           # answered; no events yet
    assert p.hold(bs, rin(a2))[0] == "prefill"
    idx.apply(d1.backend.index, KVEventBatch(ts=0.0, events=[stored(a[:10])]))
    assert p.hold(bs, rin(a2))[0] is None
    d2 = p.select(bs, rin(a2))
    assert d2.backend is d1.backend and d2.matched == 40
    # blocks already confirmed when the request ends are not kept waiting for
    p.unconfirmed.clear()
    d3 = p.select(bs, rin(a))
    p.on_finish(d3)
    assert not p.unconfirmed.get(d3.backend.index, {}).keys() & set(a[:10])
