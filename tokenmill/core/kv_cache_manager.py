"""The scheduler's only memory API: prefix-cache lookup, slot allocation, freeing.

Follows PagedAttention's block manager (Kwon et al., arXiv 2309.06180, §4.2
and §4.4 for sharing) in the shape of vLLM v1's ``KVCacheManager``: each
request owns a block table (list of :class:`KVCacheBlock`); a prefix-cache hit
simply starts a request with more tokens computed; full blocks of computed
tokens are registered in the prefix cache so later requests can share them.
"""

from __future__ import annotations

from tokenmill import envs
from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.prefix_cache import PrefixCacheStats, update_block_hashes
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


class KVCacheManager:
    """Block tables of all running requests over one :class:`BlockPool`.

    Args:
        num_blocks: pool size in blocks (ids ``0 .. num_blocks - 1``, none reserved).
        block_size: tokens per block.
        enable_prefix_caching: look up and register block hashes; when False
            :meth:`get_computed_blocks` always misses, nothing is hashed or
            cached and the stats stay 0.
        contiguous: block runs in the pool (:class:`BlockPool`); None: ``TOKENMILL_KV_BLOCK_RUNS`` (default on).

    Raises:
        ValueError: ``num_blocks <= 0`` or ``block_size <= 0``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 contiguous: bool | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if contiguous is None:
            contiguous = envs.TOKENMILL_KV_BLOCK_RUNS
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, contiguous=contiguous)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        # Leading blocks of each request already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        # Told about every block registered in the prefix cache (``on_block_cached(request, index,
        # block_id)``) and, through the pool, about cached blocks evicted: a KV offloading tier.
        self.block_listeners = self.block_pool.block_listeners

    # -- queries -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (cached free blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in [0, 1]."""
        return self.block_pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative counters (the live object; copy it to take a snapshot)."""
        return self._stats

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (the live list; empty if it holds none)."""
        return self.req_to_block_ids.get(request_id, [])

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in order (the live list; empty if it holds none)."""
        return self.req_to_blocks.get(request_id, [])

    # -- prefix cache --------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks matching the request's prefix.

        The last token of the request is never a hit (it must be computed to
        get logits), so at most ``(num_tokens - 1) // block_size`` blocks
        match. Does not take references; pass the result to
        :meth:`allocate_slots` in the same scheduling pass.

        Returns:
            ``(blocks, num_computed_tokens)`` with ``num_computed_tokens =
            len(blocks) * block_size``; ``([], 0)`` when prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Register the request's blocks that are full of computed tokens.

        Args:
            num_computed_tokens: tokens with K/V written (default
                ``request.num_computed_tokens``); blocks ``< that //
                block_size`` are registered, each once.
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        n = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_full = min(n // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size)
        num_full = min(num_full, len(hashes))
        events = self.block_pool.kv_events
        run_start = -1
        for i in range(start, num_full):
            registered = self.block_pool.cache_block(blocks[i], hashes[i])
            if registered:
                for listener in self.block_listeners:
                    listener.on_block_cached(request, i, blocks[i].block_id)
            if events is not None:
                if registered and run_start < 0:
                    run_start = i
                if not registered and run_start >= 0:
                    self._stored_event(request, hashes, run_start, i)
                    run_start = -1
        if events is not None and run_start >= 0:
            self._stored_event(request, hashes, run_start, num_full)
        self.num_cached_blocks[rid] = max(start, num_full)

    def _stored_event(self, request: Request, hashes: list, first: int, end: int) -> None:
        """Record a ``BlockStored`` event for the request's newly registered blocks ``first .. end-1``."""
        from tokenmill.core.kv_events import BlockStored

        bs = self.block_size
        assert self.block_pool.kv_events is not None
        self.block_pool.kv_events.append(BlockStored(
            block_hashes=list(hashes[first:end]), parent_block_hash=hashes[first - 1] if first > 0 else None,
            token_ids=list(request.all_token_ids[first * bs:end * bs]), block_size=bs,
            lora_id=request.lora_int_id or None,
            lora_name=request.lora_request.lora_name if request.lora_request is not None else None))

    def reset_prefix_cache(self) -> int:
        """Drop every cached hash and zero the stats; returns the number of hashes dropped.

        Blocks in use stay allocated (their requests are unaffected) but can
        no longer be shared; later full blocks of running requests are still
        registered as they fill up.
        """
        self._stats = PrefixCacheStats()
        return self.block_pool.reset_prefix_cache()

    # -- allocation ----------------------------------------------------------
    def check_invariants(self, live_request_ids: set[str] | None = None) -> list[str]:
        """Problems with block accounting; empty when the pool is consistent.

        Checked: every block's ``ref_cnt`` equals the number of requests
        holding it; a block is in the free queue exactly when its ``ref_cnt``
        is 0; free + referenced = pool size; cached hashes point at blocks
        that carry them; with ``live_request_ids`` (the scheduler's
        requests), no other request holds blocks (a leak).
        O(pool + held blocks); meant for tests and soak runs, not every step.
        """
        problems: list[str] = []
        pool = self.block_pool
        held: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            if live_request_ids is not None and rid not in live_request_ids:
                problems.append(f"request {rid} is gone but still holds {len(blocks)} blocks")
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        in_free = {b.block_id for b in pool.free_queue}
        if len(in_free) != len(pool.free_queue):
            problems.append("a block appears twice in the free queue")
        for b in pool.blocks:
            want = held.get(b.block_id, 0)
            if b.ref_cnt != want:
                problems.append(f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {want} requests")
            if (b.ref_cnt == 0) != (b.block_id in in_free):
                problems.append(f"block {b.block_id}: ref_cnt {b.ref_cnt} but {'in' if b.block_id in in_free else 'not in'}"
                                " the free queue")
        for h, b in pool.cached_blocks.items():
            if getattr(b, "block_hash", h) != h:
                problems.append(f"block {b.block_id} is cached under a hash it does not carry")
        return problems

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        Total capacity after the call covers ``request.num_computed_tokens +
        num_new_computed_tokens + num_new_tokens`` tokens. ``new_computed_blocks``
        (from :meth:`get_computed_blocks`, for a request holding no blocks yet)
        are appended first with one more reference each (a free cached block
        leaves the free queue), then fresh blocks are popped from the free
        queue (evicting their old hashes).

        On a request's first allocation (no blocks held, never preempted) the
        prefix-cache stats count ``request.num_tokens`` queries and
        ``num_new_computed_tokens`` hits.

        Returns:
            the newly popped blocks (possibly empty), or None when the pool
            has too few free blocks; then nothing changed (no references
            taken, no leak).

        Raises:
            ValueError: ``num_new_tokens < 0``, or computed blocks given for a
                request that already holds blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        first_alloc = blocks is None
        if new_computed_blocks and not first_alloc and blocks:
            raise ValueError(f"request {rid} already holds blocks; prefix hits apply only on admission")

        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_held = len(blocks) if blocks else 0
        num_needed = max(0, cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks))
        # Hit blocks that are currently free stop being allocatable once touched.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_revived:
            return None

        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
            self.num_cached_blocks[rid] = 0
        ids = self.req_to_block_ids[rid]
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            ids.extend(b.block_id for b in new_computed_blocks)
            # Hit blocks are already registered.
            self.num_cached_blocks[rid] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed, after=blocks[-1] if blocks else None)
        blocks.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)

        if (first_alloc and self.enable_prefix_caching and request.num_preemptions == 0
                and request.num_computed_tokens == 0):
            self._stats.requests += 1
            self._stats.queries += request.num_tokens
            self._stats.hits += num_new_computed_tokens
        return new_blocks

    def free(self, request: Request) -> None:
        """Release all the request's blocks, tail first (so its tail blocks are evicted first).

        Full cached blocks keep their hash in the free queue (lazy eviction).
        A request holding no blocks is ignored.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
