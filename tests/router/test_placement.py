"""kv_aware's placement of prefix groups (tokenmill/router/placement.py), judged in the simulated fleet
(tokenmill/router/simulate.py: the real policy objects over block-pool replicas) and unit by unit."""

from __future__ import annotations

import copy

import pytest

from tokenmill.router.backends import Backend, BackendSpec
from tokenmill.router.kv_index import KVIndex
from tokenmill.router.placement import PrefixGroups
from tokenmill.router.policies import KVAware
from tokenmill.router.prompt import block_hash_chain
from tokenmill.router.simulate import SimFleet, SimReplica, SimRequest, _lru_replay, best_placement, make_workload


def _cached(policy: str, reqs, replicas: int, blocks: int, concurrency: int, **kw) -> tuple[int, list]:
    rs = copy.deepcopy(reqs)
    SimFleet(policy, replicas, blocks, policy_kwargs=kw).run(rs, concurrency)
    return sum(r.cached_tokens for r in rs), rs


def _issue_workload(seed: int):
    """Issue 30's finding: 3 groups of ~740-token system prompts, 8 questions each, interleaved, 4 output tokens."""
    return make_workload(3, [740] * 3, 24, 12, 4, seed=seed)


def test_best_placement_of_the_issue_workload_keeps_two_groups_on_one_replica():
    reqs = _issue_workload(0)
    best, parts = best_placement(reqs, 2, 112)
    # 21 requests hit their group's 46 full prefix blocks (the first of each group computes it)
    assert best == 21 * 46 * 16
    assert sorted(len(p) for p in parts) == [1, 2]
    # one pool of 112 blocks cannot keep three 46-block prefixes: interleaved, LRU thrashes
    assert best_placement(reqs, 1, 112)[0] < 0.7 * best


def test_lru_replay_follows_the_engines_pool():
    """Serial replay equals the simulated replica serving the same requests one at a time."""
    reqs = make_workload(4, [300, 420, 250, 500], 20, 10, 8, seed=3)
    for blocks in (40, 70, 200):
        rep = SimReplica(0, blocks)
        got = 0
        for r in copy.deepcopy(reqs):
            rep.add(r)
            while rep.has_work():
                rep.start_step(0.0)
                rep.finish_step()
            got += r.cached_tokens
        assert got == _lru_replay(reqs, blocks, 16), blocks


@pytest.mark.parametrize("seed", range(5))
def test_kv_aware_partitions_the_issue_workload(seed):
    """Three groups over two 112-block pools at two in flight: kv_aware keeps two groups on one replica
    and the third on the other (>= 90% of the best placement on every seed), far above round_robin."""
    reqs = _issue_workload(seed)
    best, _ = best_placement(reqs, 2, 112)
    kv, rs = _cached("kv_aware", reqs, 2, 112, 2)
    rr, _ = _cached("round_robin", reqs, 2, 112, 2)
    assert kv >= 0.9 * best, (kv, best)
    assert kv > rr
    homes = {}
    for r in rs:
        homes.setdefault(r.group, set()).add(r.backend)
    assert sum(len(h) for h in homes.values()) <= 4      # at most one group ever copied


def test_without_placement_the_cost_alone_splits_groups_on_the_issue_workload():
    """The ablation: the cost alone (before this layer) moves a group off its replica when the replica's
    queue holds another group's cold prefill (seed 0: 79% of best), the placement does not."""
    reqs = _issue_workload(0)
    best, _ = best_placement(reqs, 2, 112)
    off, _ = _cached("kv_aware", reqs, 2, 112, 2, placement=False)
    on, _ = _cached("kv_aware", reqs, 2, 112, 2)
    assert off < 0.85 * best < on


def test_groups_spread_over_replicas_while_they_fit_even_one_at_a_time():
    """Pools 4x the demand, one request in flight (no load signal at all): new groups still spread over
    the replicas (balanced by their committed load), and each stays where it started."""
    reqs = make_workload(4, [320] * 4, 32, 10, 4, seed=1)
    _, rs = _cached("kv_aware", reqs, 2, 4 * 4 * 20, 1)
    homes = {}
    for r in rs:
        homes.setdefault(r.group, set()).add(r.backend)
    assert all(len(h) == 1 for h in homes.values())
    per_replica = [sum(1 for h in homes.values() if i in h) for i in range(2)]
    assert per_replica == [2, 2]


def test_overflow_spills_to_one_replica_and_the_others_keep_their_groups():
    """Five 30-block groups, three replicas whose pools hold one group each (plus a working set): the
    groups that fit nowhere go to one replica, so the other two keep theirs resident."""
    reqs = make_workload(5, [480] * 5, 60, 10, 4, seed=2)
    best, parts = best_placement(reqs, 3, 40)
    kv, rs = _cached("kv_aware", reqs, 3, 40, 1)
    assert kv >= 0.8 * best, (kv, best, parts)
    by_replica = {}
    for r in rs:
        by_replica.setdefault(r.backend, set()).add(r.group)
    assert sorted(len(g) for g in by_replica.values())[:2] == [1, 1]


def test_prefix_groups_classify_members_provisional_sizes_and_shared_preambles():
    bs = 16
    preamble = list(range(1, 33))                   # 2 blocks every prompt shares (a chat template)
    a = preamble + list(range(1000, 1000 + 640))     # group A: 42-block prefix
    b = preamble + list(range(5000, 5000 + 640))     # group B: same preamble, another prompt
    groups = PrefixGroups()
    qa1 = block_hash_chain(a + [7] * 20, bs)
    g, shared = groups.classify(qa1)
    assert g is None and shared == 0
    ga = groups.routed(qa1, 0, None, 0)
    assert ga.provisional and ga.size == len(qa1)
    qa2 = block_hash_chain(a + [9] * 20, bs)
    g, shared = groups.classify(qa2)
    assert g is ga and shared == 42
    groups.routed(qa2, 0, g, shared)
    assert not ga.provisional and ga.size == 42 and ga.homes == {0: 2}
    # B shares only the 2-block preamble with A: a group of its own
    qb = block_hash_chain(b + [7] * 20, bs)
    g, shared = groups.classify(qb)
    assert g is None and shared == 2
    gb = groups.routed(qb, 1, None, shared)
    assert gb is not ga and groups.classify(block_hash_chain(b + [8] * 20, bs))[0] is gb
    # heat decays with the requests routed since
    assert groups.heat(ga) < 2.0 and groups.heat(gb) == 1.0


def _backends(n: int, pool: int, index: KVIndex) -> list[Backend]:
    out = []
    for i in range(n):
        b = Backend(BackendSpec(f"http://b{i}"), i, healthy=True, models=["m"])
        index.set_pool_size(i, pool)
        out.append(b)
    return out


def test_a_member_waits_for_its_busy_home_instead_of_moving():
    """Its home cannot take it next to the requests in flight (busy): the request is held, not sent to
    a replica that would compute the whole prefix again."""
    index = KVIndex()
    bs = [*_backends(2, 45, index)]
    pol = KVAware(index)
    prefix = list(range(100, 100 + 640))    # 40 blocks
    first = block_hash_chain(prefix + [1] * 20, 16)
    d1 = pol.select(bs, _rin(first, 660))
    bs[d1.backend.index].in_flight += 1
    d2 = pol.select(bs, _rin(block_hash_chain(prefix + [2] * 20, 16), 660))
    assert d2.backend is d1.backend                         # a member goes home
    bs[d2.backend.index].in_flight += 1
    reason, use = pol.hold(bs, _rin(block_hash_chain(prefix + [3] * 20, 16), 660))
    assert reason == "busy" and [b.index for b in use] == [d1.backend.index]


def _rin(hashes, ntok):
    from tokenmill.router.policies import RouteInput

    return RouteInput(text="", block_hashes=hashes, num_prompt_tokens=ntok, max_tokens=4)


def test_without_pool_sizes_placement_stays_out_of_the_way():
    """No backend reported its pool (and none evicted yet): the cost decides alone, as before."""
    index = KVIndex()
    bs = [Backend(BackendSpec(f"http://b{i}"), i, healthy=True) for i in range(2)]
    pol = KVAware(index)
    d = pol.select(bs, _rin(block_hash_chain(list(range(320)), 16), 320))
    assert d.placement is not None and d.placement.kind == "off"
    assert d.detail["allowed"] == [0, 1]


def test_make_policy_rejects_a_negative_move_margin():
    from tokenmill.router.policies import make_policy

    with pytest.raises(ValueError, match="move margin"):
        make_policy("kv_aware", move_margin=-1.0)


def test_simulated_requests_never_exceed_the_pool():
    with pytest.raises(ValueError, match="needs"):
        _lru_replay([SimRequest(0, 0, list(range(100)), "", 4, block_hash_chain(list(range(100)), 16))], 4, 16)


def test_prefix_aware_places_groups_from_the_text_and_the_reported_pools():
    """prefix_aware has no token ids and no KV events; its placement (--prefix-placement, off by default)
    works on chained hashes of text chunks and the pools the backends report: on the overflow workload it
    keeps >= 90% of the best."""
    reqs = make_workload(5, [480] * 5, 60, 10, 4, seed=2)
    best, _ = best_placement(reqs, 3, 40)
    on, rs = _cached("prefix_aware", reqs, 3, 40, 1, prefix_placement=True)
    off, _ = _cached("prefix_aware", reqs, 3, 40, 1)
    assert on >= 0.9 * best and on >= off, (on, off, best)
    by_replica = {}
    for r in rs:
        by_replica.setdefault(r.backend, set()).add(r.group)
    assert sorted(len(g) for g in by_replica.values())[:2] == [1, 1]
