"""Block pool: exact ids, ref counts, LRU free queue, lazy eviction."""

import pytest

from tokenmill.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_append_popleft_remove_are_lru():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # middle
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.append(blocks[2])
    assert ids(q) == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])  # tail
    q.remove(blocks[1])  # head
    assert ids(q) == [3, 4]
    assert q.popleft().block_id == 3 and q.popleft().block_id == 4
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[3])
    q.append(blocks[3])
    with pytest.raises(ValueError):
        q.append(blocks[3])


def test_all_ids_usable_and_allocated_from_head():
    pool = BlockPool(10)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 7
    assert pool.usage == pytest.approx(0.3)
    b = pool.get_new_blocks(7)
    assert ids(b) == [3, 4, 5, 6, 7, 8, 9]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_failed_allocation_pops_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 4
    assert ids(pool.free_queue) == [0, 1, 2, 3]


def test_freed_blocks_go_to_tail_in_given_order():
    pool = BlockPool(6, contiguous=False)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))
    assert ids(pool.free_queue) == [3, 4, 5, 2, 1, 0]
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    # Block runs: the head (3) rewinds to the start of the free uncached run below it (0), then goes up.
    pool = BlockPool(6)
    pool.free_blocks(reversed(pool.get_new_blocks(3)))
    assert ids(pool.get_new_blocks(4)) == [0, 1, 2, 3]


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 3  # still referenced
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blk])


@pytest.mark.parametrize("contiguous, first_two", [(False, [2, 1]), (True, [1, 2])])
def test_lazy_eviction_keeps_hash_until_reuse(contiguous, first_two):
    pool = BlockPool(3, contiguous=contiguous)
    blocks = pool.get_new_blocks(3)
    h = b"h" * 32
    assert pool.cache_block(blocks[0], h)
    pool.free_blocks(reversed(blocks))  # queue: 2, 1, 0
    # Free but still cached.
    assert blocks[0].ref_cnt == 0 and blocks[0].block_hash == h
    assert pool.get_cached_block(h) is blocks[0]
    # Block runs rewind from the head (2) to 1, not to 0: a cached block freed last is young.
    assert ids(pool.get_new_blocks(2)) == first_two
    assert pool.get_cached_block(h) is blocks[0]
    # Popping block 0 for reuse evicts its hash.
    assert ids(pool.get_new_blocks(1)) == [0]
    assert blocks[0].block_hash is None
    assert pool.get_cached_block(h) is None


def test_touch_on_free_cached_block_removes_it_from_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[1], b"x" * 32)
    pool.free_blocks(blocks)  # queue: 0, 1, 2, 3
    hit = pool.get_cached_block(b"x" * 32)
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert ids(pool.free_queue) == [0, 2, 3]
    assert pool.num_free_blocks == 3
    assert hit.block_hash == b"x" * 32  # not evicted by a hit


def test_cache_block_one_block_per_hash_and_disabled():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"1" * 32)
    assert not pool.cache_block(b, b"1" * 32)  # duplicate content: not registered
    assert b.block_hash is None
    assert not pool.cache_block(a, b"2" * 32)  # already has a hash
    off = BlockPool(2, enable_caching=False)
    (c,) = off.get_new_blocks(1)
    assert not off.cache_block(c, b"1" * 32)
    assert off.get_cached_block(b"1" * 32) is None


def test_reset_prefix_cache_drops_hashes():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_block(a, b"a" * 32)
    pool.cache_block(b, b"b" * 32)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 2
    assert a.block_hash is None and b.block_hash is None
    assert pool.get_cached_block(b"a" * 32) is None
    assert b.ref_cnt == 1  # still allocated


def test_block_runs_take_the_next_block_when_free_and_old():
    pool = BlockPool(8)
    a = pool.get_new_blocks(2)                          # [0, 1] from the head
    b = pool.get_new_blocks(1)                          # [2]
    pool.free_blocks([b[0]])                            # queue 3..7, 2
    assert ids(pool.get_new_blocks(2, after=a[1])) == [2, 3]   # uncached block 2 continues a's run, then 3
    pool.free_blocks(pool.get_new_blocks(1, after=pool.blocks[7]))  # no block after the last: the head (4)
    # Cached blocks: taken only from the older half of the free queue's age span (the pool's old_fraction).
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(8)
    for blk in blocks:
        pool.cache_block(blk, bytes([blk.block_id]))
    pool.free_blocks([blocks[i] for i in (5, 1, 2, 3, 6, 7)])  # free order = age: 5 oldest, 7 youngest
    old = pool.old_fraction
    assert old == 0.5
    assert pool.free_queue.is_old(blocks[5], old) and pool.free_queue.is_old(blocks[2], old)
    assert not pool.free_queue.is_old(blocks[3], old) and not pool.free_queue.is_old(blocks[7], old)
    assert pool.free_queue.is_old(blocks[7], 1.0) and not pool.free_queue.is_old(blocks[2], 0.0)
    assert ids(pool.get_new_blocks(1, after=blocks[0])) == [1]     # old: taken, its hash evicted
    assert blocks[1].block_hash is None
    assert ids(pool.get_new_blocks(1, after=blocks[4])) == [5]     # oldest
    # The span is the queue's now (2 3 6 7): block 7 is young, so the head (2) instead.
    assert not pool.free_queue.is_old(blocks[7], old)
    taken = pool.get_new_blocks(1, after=blocks[6])
    assert ids(taken) == [2] and blocks[7].block_hash == bytes([7])
    # Off: strict LRU whatever ``after`` is.
    pool = BlockPool(4, contiguous=False)
    first = pool.get_new_blocks(1)
    pool.free_blocks(first)                             # queue 1 2 3 0
    assert ids(pool.get_new_blocks(2, after=pool.blocks[0])) == [1, 2]


def test_invalid_pool_size():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError, match="old_fraction"):
        BlockPool(4, old_fraction=1.5)
