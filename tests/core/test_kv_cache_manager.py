"""KVCacheManager: prefix hits, allocation, freeing order, stats (block_size 4, 12 blocks)."""

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_req(rid, tokens, salt=None):
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def run_prefill(m, r, n=None):
    """Admit ``r`` the way the scheduler does and mark its prompt computed."""
    hit, num_hit = m.get_computed_blocks(r)
    n = r.num_tokens - num_hit if n is None else n
    new = m.allocate_slots(r, n, hit, num_hit)
    assert new is not None
    r.num_computed_tokens = num_hit + n
    m.cache_blocks(r)
    return hit, num_hit, new


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_and_cache_full_blocks_only():
    m = KVCacheManager(12, BS)
    r = make_req("a", list(range(10)))
    hit, num_hit, new = run_prefill(m, r)
    assert (hit, num_hit) == ([], 0)
    assert ids(new) == [0, 1, 2]
    assert m.get_block_ids("a") == [0, 1, 2]
    blocks = m.block_pool.blocks
    assert blocks[0].block_hash == r.block_hashes[0]
    assert blocks[1].block_hash == r.block_hashes[1]
    assert blocks[2].block_hash is None  # only 2 of 4 slots filled
    assert m.num_free_blocks == 9 and m.usage == pytest.approx(3 / 12)
    # Decode fills block 2 (positions 8..11) and then needs block 3.
    r.append_output_token_ids([100])
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens = 11
    r.append_output_token_ids([101])
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens = 12
    m.cache_blocks(r)
    assert blocks[2].block_hash == r.block_hashes[2]
    r.append_output_token_ids([102])
    assert ids(m.allocate_slots(r, 1)) == [3]
    assert m.get_block_ids("a") == [0, 1, 2, 3]


def test_prefix_hit_shares_blocks_and_counts_tokens():
    m = KVCacheManager(12, BS)
    a = make_req("a", list(range(10)))
    run_prefill(m, a)
    b = make_req("b", list(range(10)))
    hit, num_hit, new = run_prefill(m, b)
    assert ids(hit) == [0, 1] and num_hit == 8
    assert ids(new) == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 20, 8)


def test_last_token_always_computed():
    m = KVCacheManager(12, BS)
    run_prefill(m, make_req("a", list(range(12))))
    # Prompt = exactly 2 cached full blocks: only the first may hit.
    b = make_req("b", list(range(8)))
    hit, num_hit = m.get_computed_blocks(b)
    assert ids(hit) == [0] and num_hit == 4
    # One token past the cached blocks: exactly 1 token is computed.
    c = make_req("c", list(range(9)))
    hit, num_hit = m.get_computed_blocks(c)
    assert ids(hit) == [0, 1] and num_hit == 8 and c.num_tokens - num_hit == 1


def test_salt_and_different_prefix_miss():
    m = KVCacheManager(12, BS)
    run_prefill(m, make_req("a", list(range(10))))
    assert m.get_computed_blocks(make_req("b", list(range(10)), salt="s")) == ([], 0)
    hit, n = m.get_computed_blocks(make_req("c", [0, 1, 2, 3, 9, 9, 9, 9, 8, 8]))
    assert ids(hit) == [0] and n == 4


def test_free_in_reverse_order_and_lazy_eviction():
    m = KVCacheManager(12, BS, contiguous=False)      # strict LRU: block runs would take block 2 for c below
    a = make_req("a", list(range(10)))
    b = make_req("b", list(range(10)))
    run_prefill(m, a)
    run_prefill(m, b)  # blocks [0, 1, 3]
    m.free(a)  # 2 -> queue; 1 and 0 still held by b
    assert ids(m.block_pool.free_queue) == [4, 5, 6, 7, 8, 9, 10, 11, 2]
    m.free(b)
    assert ids(m.block_pool.free_queue) == [4, 5, 6, 7, 8, 9, 10, 11, 2, 3, 1, 0]
    assert m.num_free_blocks == 12 and m.usage == 0.0
    assert m.get_block_ids("a") == []
    # Cached blocks stay findable while free.
    assert m.block_pool.blocks[0].block_hash is not None
    # A hit on free cached blocks takes them out of the free queue.
    c = make_req("c", list(range(10)))
    hit, num_hit, new = run_prefill(m, c)
    assert ids(hit) == [0, 1] and ids(new) == [4]
    assert m.num_free_blocks == 9
    assert ids(m.block_pool.free_queue) == [5, 6, 7, 8, 9, 10, 11, 2, 3]


def test_block_runs_continue_after_a_prefix_hit_and_keep_young_cached_blocks():
    m = KVCacheManager(12, BS)
    a = make_req("a", list(range(10)))
    run_prefill(m, a)                                  # blocks [0, 1, 2]; 0 and 1 cached
    m.free(a)                                          # queue ... 2, 1, 0
    c = make_req("c", list(range(10)))
    hit, num_hit, new = run_prefill(m, c)
    assert ids(hit) == [0, 1] and ids(new) == [2]      # block 2 is uncached: the run goes on
    assert m.get_block_ids("c") == [0, 1, 2]
    # A request whose next block is cached and young (freed last) starts elsewhere: the young block keeps its hash.
    m2 = KVCacheManager(6, BS)
    x, y = make_req("x", list(range(8))), make_req("y", [7] * 4)
    run_prefill(m2, x)                                 # [0, 1], both cached
    run_prefill(m2, y)                                 # [2]
    m2.free(x)                                         # queue 3 4 5 1 0: block 0 and 1 are the youngest
    z = make_req("z", [9] * 4)
    run_prefill(m2, z)                                 # [3] (head)
    m2.free(y)                                         # queue 4 5 1 0 2
    w = make_req("w", [8] * 8)
    assert ids(run_prefill(m2, w)[2]) == [4, 5]
    assert m2.block_pool.blocks[0].block_hash is not None and m2.block_pool.blocks[1].block_hash is not None


def test_tail_blocks_evicted_first():
    m = KVCacheManager(4, BS)
    a = make_req("a", list(range(13)))  # 3 full cached blocks + 1 partial
    run_prefill(m, a)
    m.free(a)  # queue: 3, 2, 1, 0
    assert ids(m.block_pool.free_queue) == [3, 2, 1, 0]
    x = make_req("x", [50] * 5)
    assert sorted(ids(m.allocate_slots(x, 5))) == [2, 3]  # evicts a's tail block 2 (LRU: [3, 2]; runs: [2, 3])
    assert m.block_pool.blocks[2].block_hash is None
    hit, n = m.get_computed_blocks(make_req("b", list(range(13))))
    assert ids(hit) == [0, 1] and n == 8


def test_allocation_failure_leaks_nothing():
    m = KVCacheManager(4, BS)
    a = make_req("a", list(range(9)))
    run_prefill(m, a)  # blocks 0,1,2; 0 and 1 cached
    m.free(a)
    b = make_req("b", list(range(8)) + [7] * 12)  # 20 tokens -> 5 blocks > 4
    hit, num_hit = m.get_computed_blocks(b)
    assert ids(hit) == [0, 1]
    assert m.allocate_slots(b, b.num_tokens - num_hit, hit, num_hit) is None
    assert m.num_free_blocks == 4
    assert [blk.ref_cnt for blk in m.block_pool.blocks] == [0, 0, 0, 0]
    assert m.get_block_ids("b") == [] and "b" not in m.req_to_blocks
    assert m.prefix_cache_stats.queries == 9  # failed attempt is not counted
    # Hit blocks that are free do not count as allocatable: 2 hits + 3 new > 4.
    c = make_req("c", list(range(8)) + [7] * 9)  # 17 tokens -> 5 blocks
    hit, num_hit = m.get_computed_blocks(c)
    assert m.allocate_slots(c, c.num_tokens - num_hit, hit, num_hit) is None
    assert ids(m.block_pool.free_queue) == [3, 2, 1, 0]


def test_prefix_caching_disabled():
    m = KVCacheManager(12, BS, enable_prefix_caching=False)
    a = make_req("a", list(range(10)))
    run_prefill(m, a)
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert a.block_hashes == []
    b = make_req("b", list(range(10)))
    assert m.get_computed_blocks(b) == ([], 0)
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)


def test_no_stats_after_preemption():
    m = KVCacheManager(12, BS)
    a = make_req("a", list(range(10)))
    run_prefill(m, a)
    m.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    hit, num_hit, _ = run_prefill(m, a)
    assert num_hit == 8
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)


def test_reset_prefix_cache():
    m = KVCacheManager(12, BS)
    a = make_req("a", list(range(10)))
    run_prefill(m, a)
    assert m.reset_prefix_cache() == 2
    assert m.get_computed_blocks(make_req("b", list(range(10)))) == ([], 0)
    assert m.prefix_cache_stats.queries == 0
    assert m.get_block_ids("a") == [0, 1, 2]


def test_invalid_args():
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    m = KVCacheManager(4, BS)
    with pytest.raises(ValueError):
        m.allocate_slots(make_req("a", [1]), -1)


def test_invariant_check_passes_when_consistent_and_names_each_leak():
    m = KVCacheManager(12, BS)
    a, b = make_req("a", list(range(10))), make_req("b", list(range(10)))
    run_prefill(m, a)
    run_prefill(m, b)                              # shares a's two full blocks
    assert m.check_invariants({"a", "b"}) == []
    assert [blk.ref_cnt for blk in m.get_blocks("b")[:2]] == [2, 2]
    # a request the scheduler forgot but whose blocks were never freed: a leak
    assert m.check_invariants({"b"}) == ["request a is gone but still holds 3 blocks"]
    m.block_pool.blocks[0].ref_cnt += 1            # a ref count that no holder explains
    assert m.check_invariants({"a", "b"}) == ["block 0: ref_cnt 3 but held by 2 requests"]
    m.block_pool.blocks[0].ref_cnt -= 1
    m.free(a)
    m.free(b)
    assert m.check_invariants(set()) == [] and m.num_free_blocks == 12
    m.block_pool.free_queue.remove(m.block_pool.blocks[5])   # a free block lost from the queue
    assert m.check_invariants(set()) == ["block 5: ref_cnt 0 but not in the free queue"]
