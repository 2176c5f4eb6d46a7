"""The KV cache block pool: fixed-size blocks, reference counts, an O(1) LRU free queue.

PagedAttention (Kwon et al., arXiv 2309.06180, §4.2) stores each request's
K/V in fixed-size blocks of ``block_size`` tokens taken from one preallocated
pool; a request's *block table* lists its blocks in order. This module owns
the pool's bookkeeping only (no tensors): which block ids are free, who
references them, and which full blocks carry a prefix-cache hash.

Block ids: all ids ``0 .. num_blocks - 1`` are usable; no block is reserved as
a null/pad block. A model runner that needs a padding slot must use one
outside the pool (e.g. slot ``-1``) rather than block 0.

Prefix caching follows vLLM v1's design (``vllm/v1/core/block_pool.py``):

* a block whose ``ref_cnt`` drops to 0 goes to the *tail* of the free queue
  but keeps its hash, so a later request with the same prefix can still reuse
  it (lazy eviction);
* new blocks are popped from the *head* (least recently freed first); only
  then does a cached block lose its hash (eviction);
* a prefix-cache hit on a free block removes it from the middle of the queue
  in O(1) (doubly linked list).

Block runs (``contiguous=True``, the default; ``TOKENMILL_KV_BLOCK_RUNS``):
a request's next block is the one after its last block when that block is
free and old; otherwise the free queue's head, rewound to the lowest id of
the free old blocks just below it (a finished request's blocks joined the
queue in reverse). Block tables then hold ascending runs of consecutive ids
and decode attention reads longer stretches of the KV pool in address order
(hardware prefetchers stop at stream and page ends). "Old": uncached, or
freed in the oldest ``old_fraction`` (half) of the free queue's age span,
tracked by a counter stamped on each block as it is freed: a cached block
LRU would keep longest is never taken early. With strict LRU popping 97-99%
of a long-running server's neighbouring table entries are not adjacent; with
runs 62-76% are (mean run 2.5-3.7 blocks against 1.0-1.6), the prefix-cache
hit rate stays within about a point of LRU's, and decode attention at B=64
ran 1.12-1.17x faster on the AVX2 EPYC (``benchmarks/kv_block_alloc_sim.py``,
docs/benchmarks/2026-12-03-kv-block-runs-avx2.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from tokenmill.core.prefix_cache import BlockHash


class KVCacheBlock:
    """Metadata of one KV cache block (the K/V tensors live in the model runner).

    Attributes:
        block_id: index into the pool, ``0 .. num_blocks - 1``.
        ref_cnt: number of requests whose block table holds this block.
        block_hash: prefix-cache hash once the block is full of computed
            tokens and registered; None otherwise (also after eviction).
        prev_free, next_free: links of the free queue (None when not queued).
        free_seq: the free queue's counter when the block last joined it
            (increases from head to tail; orders blocks by the time they were freed).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "free_seq")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.free_seq = 0

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in LRU order; every operation is O(1).

    The head holds the least recently freed block (evicted first by
    :meth:`popleft`), the tail the most recently freed one. Unlike
    ``collections.deque`` it supports O(1) removal from the middle
    (:meth:`remove`), needed when a prefix-cache hit revives a free block.
    Two sentinel nodes (ids -1 and -2) avoid edge cases at the ends.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self._seq = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (most recently freed).

        Raises:
            ValueError: the block is already queued.
        """
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1
        self._seq += 1
        block.free_seq = self._seq

    def is_old(self, block: KVCacheBlock, fraction: float) -> bool:
        """Whether a queued ``block`` was freed in the oldest ``fraction`` of the queue's age span (head side).

        The span runs from the head's ``free_seq`` to the tail's. O(1). Only meaningful for a queued block.
        """
        first, last = self._head.next_free, self._tail.prev_free
        assert first is not None and last is not None
        return block.free_seq - first.free_seq <= fraction * (last.free_seq - first.free_seq)

    def first(self) -> KVCacheBlock:
        """The head (least recently freed) block, still queued.

        Raises:
            IndexError: the queue is empty.
        """
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("the free block queue is empty")
        return first

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block.

        Raises:
            IndexError: the queue is empty.
        """
        first = self.first()
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue.

        Raises:
            ValueError: the block is not queued.
        """
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All KV cache blocks of one pool, with ref counts and the prefix-cache index.

    Args:
        num_blocks: pool size in blocks (> 0); ids ``0 .. num_blocks - 1``.
        enable_caching: keep a ``hash -> block`` index for prefix caching.
        contiguous: block runs (see the module docstring and :meth:`get_new_blocks`); False: strict LRU
            popping (vLLM's order).
        old_fraction: the age guard of block runs, in [0, 1]: a free cached block may be taken out of LRU
            order only when freed in this oldest fraction of the free queue's age span (0.5 kept the
            prefix-cache hit rate within about a point of LRU's in ``benchmarks/kv_block_alloc_sim.py``;
            0.25 within noise but with half the adjacency gain; 1.0 lost up to 4 points).

    Raises:
        ValueError: ``num_blocks <= 0`` or ``old_fraction`` outside [0, 1].
    """

    _MAX_REWIND = 32          # blocks a fallback looks below the queue's head for the start of a free run

    def __init__(self, num_blocks: int, enable_caching: bool = True, contiguous: bool = True,
                 old_fraction: float = 0.5) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if not 0.0 <= old_fraction <= 1.0:
            raise ValueError(f"old_fraction must be in [0, 1], got {old_fraction}")
        self.old_fraction = old_fraction
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.contiguous = contiguous
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per hash: a second block computed with the same content
        # (two requests prefilling the same prefix at once) is simply not
        # registered and is reused like any uncached block.
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # KV cache events (tokenmill.core.kv_events) for a cache-aware router; None: not collected.
        self.kv_events: list | None = None
        # Objects told about cached blocks leaving the pool (``on_block_evicted(block_id, block_hash)``,
        # called before the block is reused, while its K/V is still intact): a KV offloading tier.
        self.block_listeners: list = []

    # -- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or not); all can be allocated."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under ``block_hash`` (referenced or free), or None."""
        return self.cached_blocks.get(block_hash)

    # -- allocation ----------------------------------------------------------
    def get_new_blocks(self, num_blocks: int, after: KVCacheBlock | None = None) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, ``ref_cnt = 1``, in block-table order.

        With ``contiguous`` off, the free queue's head each time (least recently freed). With it on, each
        block is the one after the previous block (``after`` for the first: the request's last block, or
        None) when that block is free and old (uncached, or in the oldest ``old_fraction`` of the free
        queue's age span); otherwise the queue's head, rewound to the start of the free old run below it
        (:meth:`_run_start`). A taken block that still carries a hash is evicted from the prefix cache here
        (lazy eviction).

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks (nothing taken).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free")
        out = []
        prev = after if self.contiguous else None
        for _ in range(num_blocks):
            block = self._next_free_after(prev) if prev is not None else None
            if block is None:
                block = self._run_start(self.free_queue.first()) if self.contiguous else self.free_queue.first()
            self.free_queue.remove(block)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
            if self.contiguous:
                prev = block
        return out

    def _run_start(self, head: KVCacheBlock) -> KVCacheBlock:
        """The lowest id of the free, old blocks just below ``head`` (at most ``_MAX_REWIND`` back), else ``head``.

        A finished request's blocks join the queue in reverse, so popping the head alone would hand out its
        blocks in descending order; starting from the lowest and continuing upwards keeps them ascending.
        """
        block = head
        for _ in range(self._MAX_REWIND):
            i = block.block_id - 1
            if i < 0:
                break
            prev = self.blocks[i]
            if prev.ref_cnt != 0 or not self._old(prev):
                break
            block = prev
        return block

    def _next_free_after(self, block: KVCacheBlock) -> KVCacheBlock | None:
        """The block with the next id when it is free and old (see :meth:`get_new_blocks`), else None."""
        i = block.block_id + 1
        if i >= self.num_blocks:
            return None
        nxt = self.blocks[i]
        if nxt.ref_cnt != 0 or not self._old(nxt):
            return None
        return nxt

    def _old(self, block: KVCacheBlock) -> bool:
        """A free block that may be taken out of LRU order: uncached, or freed in the oldest ``old_fraction``."""
        return block.block_hash is None or self.free_queue.is_old(block, self.old_fraction)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (prefix-cache hit); a free block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue tail in the given order.

        Callers pass a request's blocks in *reverse* order so that its tail
        blocks (least likely to be shared) are evicted first.

        Raises:
            ValueError: a block's ref count is already 0.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    # -- prefix cache --------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under ``block_hash``.

        Returns:
            True if registered; False when caching is disabled, the block
            already has a hash, or another block already holds this hash.
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                for listener in self.block_listeners:
                    listener.on_block_evicted(block.block_id, block.block_hash)
                if self.kv_events is not None:
                    from tokenmill.core.kv_events import BlockRemoved

                    self.kv_events.append(BlockRemoved(block_hashes=[block.block_hash]))
            block.block_hash = None

    def enable_kv_events(self) -> None:
        """Start collecting :mod:`tokenmill.core.kv_events` events (drain them with :meth:`take_kv_events`)."""
        if self.kv_events is None:
            self.kv_events = []

    def take_kv_events(self) -> list:
        """The events since the last call, in order, consecutive removals merged into one event.

        Returns:
            a list of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (empty when not collecting).
        """
        if not self.kv_events:
            return []
        from tokenmill.core.kv_events import BlockRemoved

        out: list = []
        for ev in self.kv_events:
            if isinstance(ev, BlockRemoved) and out and isinstance(out[-1], BlockRemoved):
                out[-1].block_hashes.extend(ev.block_hashes)
            else:
                out.append(ev)
        self.kv_events = []
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (referenced blocks stay allocated, just unshareable).

        Returns:
            the number of hashes dropped.
        """
        n = len(self.cached_blocks)
        for block in list(self.cached_blocks.values()):
            block.block_hash = None
        self.cached_blocks.clear()
        if self.kv_events is not None:
            from tokenmill.core.kv_events import AllBlocksCleared

            self.kv_events.append(AllBlocksCleared())
        return n
