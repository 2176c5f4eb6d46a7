"""Routing policies with fake backends (no model, no network)."""

from __future__ import annotations

import collections

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
    # cost = 1 * prefill + decode: 2 -> 4 + 16 = 20, others 16 + 16 = 32
    assert d.costs == {0: 32.0, 1: 32.0, 2: 20.0}


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
    dyn = _kv_policy(idx, eviction_weight=0.0).select(bs, rin)
    assert dyn.backend.index == 1 and dyn.costs == {0: 25.0, 1: 20.0} and dyn.evicted_blocks == 0
    # with the eviction term: 1 would evict 8 reused blocks of B (its pool holds 8): 20 + 8 = 28 > 25
    p = _kv_policy(idx)
    d = p.select(bs, rin)
    assert d.backend.index == 0 and d.reason == "kv_overlap"
    assert d.costs == {0: 25.0, 1: 28.0}
    # weight 0.5: half a prefill block per eviction -> 24 < 25, A moves
    assert _kv_policy(idx, eviction_weight=0.5).select(bs, rin).backend.index == 1


def test_kv_aware_eviction_term_ignores_blocks_nobody_reused():
    bs, idx, a, b = _two_replicas_one_busy()              # B stored on 1 but never reused
    d = _kv_policy(idx).select(bs, RouteInput(block_hashes=a, num_prompt_tokens=40))
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
