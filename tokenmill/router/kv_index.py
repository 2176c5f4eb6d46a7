"""Which backend holds which KV block: an index fed by the backends' KV events.

Each backend publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
batches (:mod:`tokenmill.core.kv_events`); :class:`KVEventSubscriber` receives
them over ZMQ SUB and applies them to :class:`KVIndex`, which answers "how many
leading blocks of this block-hash chain does each backend hold?". Because a
block hash chains its whole prefix (:func:`tokenmill.core.prefix_cache.hash_block_tokens`),
a backend holds the first ``k`` blocks of a request exactly when it holds
hashes ``0 .. k-1`` of the request's chain (the idea of Dynamo's KV indexer
and of vLLM's KV events).

Sequence gaps: a subscriber that sees batch ``seq`` after ``last`` with
``seq > last + 1`` asks the backend's replay socket for ``last + 1 ..``; if
the replay cannot fill the gap (no replay socket, or the batches are no longer
buffered), that backend's entries are dropped (missed ``BlockRemoved`` events
would otherwise make the router send requests to blocks that are gone) and
rebuilt from the following events. A sequence number going backwards means
the backend restarted: its entries are dropped too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import zmq
import zmq.asyncio

from tokenmill.core.kv_events import (REPLAY_END, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                      decode_batch, seq_from_bytes, seq_to_bytes)

logger = logging.getLogger(__name__)


class KVIndex:
    """Block hash → backends holding it, for the backends of one pool.

    Backends are identified by an int (their router index). Per backend it also
    keeps a model of the pool for kv_aware's eviction term: the blocks in
    estimated LRU order with how many requests used each, and the pool size.
    """

    REUSED_USES = 2   # a block used by this many requests holds a shared prefix (evicting it costs a recompute)

    def __init__(self) -> None:
        self._holders: dict[bytes, set[int]] = {}
        # per backend: its cached blocks in estimated LRU order (oldest first) -> how many requests routed
        # there used the block (see touch())
        self._held: dict[int, OrderedDict[bytes, int]] = {}
        self.block_size: int | None = None   # learnt from BlockStored events
        self.num_events: dict[int, int] = {}
        self.last_event_time: dict[int, float] = {}
        # most blocks a backend was ever seen to hold at once: its pool size, once the pool has filled
        # (the engine keeps a freed block's hash until the block is reused, so a full pool stays full)
        self.capacity: dict[int, int] = {}
        self._num_reused: dict[int, int] = {}
        # per backend: the last event batch's lag (s): router wall clock at apply minus the batch's ts
        # (publisher wall clock; both on one host in the benchmark), and the worst seen
        self.last_lag: dict[int, float] = {}
        self.max_lag: dict[int, float] = {}
        self._evicting: set[int] = set()     # backends seen removing a block (their pool was full)
        # pool sizes the backends report (their /metrics cache_config_info): preferred to the learnt ones,
        # which are too small while the pool still holds blocks stored before the router subscribed
        self.reported_capacity: dict[int, int] = {}
        self._subscribed: set[int] = set()   # backends whose events the router receives
        # per backend and lower tier (the events' medium: "CPU", "DISK"; the KV offloading tier): the block
        # hashes held there. Kept apart from the pool's: a tier hit costs a load, and kv_aware scores it
        # below a pool hit (KVAware's tier_weight)
        self._tiers: dict[int, dict[str, set[bytes]]] = {}

    def expect_events(self, backend: int) -> None:
        """The router subscribes to ``backend``'s KV events (so a block it computes will be announced)."""
        self._subscribed.add(backend)

    def expects_events(self, backend: int) -> bool:
        """True when the router subscribes to ``backend``'s KV events."""
        return backend in self._subscribed

    def set_pool_size(self, backend: int, blocks: int | None) -> None:
        """``backend`` reports a pool of ``blocks`` blocks (None: unknown again, e.g. it went down)."""
        if blocks:
            self.reported_capacity[backend] = int(blocks)
        else:
            self.reported_capacity.pop(backend, None)

    def pool_size(self, backend: int) -> int | None:
        """``backend``'s pool size in blocks: the size it reports (:meth:`set_pool_size`), else the most it
        was seen holding, once it evicted a block (the engine removes a hash only to reuse its block, so
        its pool was full); None before. The learnt size is too small while the pool still holds blocks
        stored before the router subscribed (their ``BlockRemoved`` arrive without a ``BlockStored``)."""
        reported = self.reported_capacity.get(backend)
        if reported:
            return reported
        return self.capacity.get(backend) if backend in self._evicting else None

    def has_events(self, backend: int) -> bool:
        """True once any event of ``backend`` was applied (the index knows something about it)."""
        return self.num_events.get(backend, 0) > 0

    def holds(self, backend: int, block_hash: bytes) -> bool:
        """True when ``backend``'s events say it holds ``block_hash``."""
        s = self._holders.get(block_hash)
        return s is not None and backend in s

    def num_blocks(self, backend: int) -> int:
        """Blocks the index believes ``backend`` holds."""
        return len(self._held.get(backend, ()))

    def apply(self, backend: int, batch: KVEventBatch) -> None:
        """Apply one batch of ``backend``'s events, in order."""
        for ev in batch.events:
            self.apply_event(backend, ev)
        self.last_event_time[backend] = time.monotonic()
        lag = time.time() - batch.ts
        self.last_lag[backend] = lag
        if lag > self.max_lag.get(backend, float("-inf")):
            self.max_lag[backend] = lag

    def apply_event(self, backend: int, ev: object) -> None:
        held = self._held.get(backend)
        if held is None:
            held = self._held[backend] = OrderedDict()
        if isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium is not None:
            # a lower tier's event (medium "DISK" / "CPU": the KV offloading tier), indexed apart from the
            # pool: a tier's BlockRemoved must not drop a hash the pool still holds, and a tier hit is not
            # scored like a pool hit (it costs a load; tier_match())
            tier = self._tiers.setdefault(backend, {}).setdefault(ev.medium, set())
            if isinstance(ev, BlockStored):
                tier.update(ev.block_hashes)
            else:
                tier.difference_update(ev.block_hashes)
            self.num_events[backend] = self.num_events.get(backend, 0) + 1
            return
        if isinstance(ev, BlockStored):
            if self.block_size is None:
                self.block_size = ev.block_size
            elif ev.block_size != self.block_size:
                logger.warning("backend %d publishes block_size %d, the pool uses %d: its blocks never match",
                               backend, ev.block_size, self.block_size)
                return
            for h in ev.block_hashes:
                if h in held:
                    held.move_to_end(h)
                else:
                    held[h] = 1   # the request that computed it
                self._holders.setdefault(h, set()).add(backend)
            if len(held) > self.capacity.get(backend, 0):
                self.capacity[backend] = len(held)
        elif isinstance(ev, BlockRemoved):
            self._evicting.add(backend)
            for h in ev.block_hashes:
                if held.pop(h, 0) >= self.REUSED_USES:
                    self._num_reused[backend] -= 1
                s = self._holders.get(h)
                if s is not None:
                    s.discard(backend)
                    if not s:
                        del self._holders[h]
        elif isinstance(ev, AllBlocksCleared):
            self.clear_backend(backend, keep_event_count=True, tiers=False)
        self.num_events[backend] = self.num_events.get(backend, 0) + 1

    def clear_backend(self, backend: int, keep_event_count: bool = False, tiers: bool = True) -> None:
        """Forget every block of ``backend`` (gap without replay, restart, removal); with ``tiers`` False
        (``AllBlocksCleared``: the engine reset its pool's prefix cache, the tier keeps its files) only
        the pool's."""
        if tiers:
            self._tiers.pop(backend, None)
        for h in self._held.pop(backend, {}):
            s = self._holders.get(h)
            if s is not None:
                s.discard(backend)
                if not s:
                    del self._holders[h]
        self._num_reused.pop(backend, None)
        if not keep_event_count:
            self.num_events.pop(backend, None)
            self.capacity.pop(backend, None)
            self._evicting.discard(backend)

    def touch(self, backend: int, block_hashes: Iterable[bytes]) -> None:
        """A request using ``block_hashes`` was routed to ``backend``: those it holds become the most
        recently used (the engine's LRU free queue sees the same order) and their use count grows."""
        held = self._held.get(backend)
        if not held:
            return
        for h in block_hashes:
            uses = held.get(h)
            if uses is not None:
                held[h] = uses + 1
                held.move_to_end(h)
                if uses + 1 == self.REUSED_USES:
                    self._num_reused[backend] = self._num_reused.get(backend, 0) + 1

    def num_reused(self, backend: int) -> int:
        """Cached blocks of ``backend`` used by at least :attr:`REUSED_USES` requests."""
        return self._num_reused.get(backend, 0)

    def reused_overflow(self, backend: int, new_blocks: int, keep: Iterable[bytes] = ()) -> int:
        """Reused cached blocks ``backend`` loses if it takes ``new_blocks`` more.

        A model of the engine's prefix cache (vLLM's, and tokenmill's ``BlockPool``): the pool holds
        ``capacity`` blocks; blocks in use (``keep``: those of requests in flight there, and the
        request's own prefix) stay; new blocks take free and stale cached blocks first and evict
        reused ones (used by at least :attr:`REUSED_USES` requests: shared prefixes) only once the
        reused and in-use blocks plus the new ones no longer fit. Those are the blocks that the next
        requests of their prefixes will have to prefill again, now or as soon as the stale blocks
        are gone.

        Returns:
            ``min(reused + in use + new - capacity, evictable reused)``, at least 0; 0 while the
            capacity is unknown (not reported and no events yet). The capacity: the reported pool size,
            else the most blocks seen held.
        """
        cap = self.reported_capacity.get(backend) or self.capacity.get(backend)
        held = self._held.get(backend)
        if not cap or not held or new_blocks <= 0:
            return 0
        reused = self._num_reused.get(backend, 0)
        kept_reused = kept_other = 0
        for h in keep if isinstance(keep, (set, dict, frozenset)) else set(keep):
            uses = held.get(h)
            if uses is None:
                continue
            if uses >= self.REUSED_USES:
                kept_reused += 1
            else:
                kept_other += 1
        overflow = reused + kept_other + new_blocks - cap
        return max(0, min(overflow, reused - kept_reused))

    def match(self, block_hashes: Sequence[bytes], backends: Sequence[int]) -> dict[int, int]:
        """Leading blocks of ``block_hashes`` held by each backend.

        Args:
            block_hashes: the request's chain, ``[num_full_blocks]``.
            backends: candidates.

        Returns:
            ``{backend: k}`` where blocks ``0 .. k-1`` are held (0 for none).
        """
        out = {b: 0 for b in backends}
        alive = set(backends)
        for i, h in enumerate(block_hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for b in alive:
                out[b] = i + 1
        return out


    def tier_holds(self, backend: int, block_hash: bytes) -> bool:
        """True when ``backend``'s events say a lower tier of it (any medium) holds ``block_hash``."""
        return any(block_hash in t for t in self._tiers.get(backend, {}).values())

    def tier_match(self, block_hashes: Sequence[bytes], start: dict[int, int], limit: int) -> dict[int, int]:
        """Blocks a backend would load from its lower tiers after its pool's (or in-flight) match.

        Args:
            block_hashes: the request's chain, ``[num_full_blocks]``.
            start: ``{backend: k}``, the leading blocks it holds in its pool (:meth:`match`) or computes now.
            limit: at most this many leading blocks in all (the engine computes a prompt's last token).

        Returns:
            ``{backend: t}``: blocks ``k .. k+t-1`` are each in the pool or a lower tier of ``backend``
            (the engine's lookup continues from the pool into the tier the same way: a consecutive run).
        """
        out = {}
        for b, k in start.items():
            tiers = self._tiers.get(b)
            t = 0
            if tiers:
                while k + t < min(limit, len(block_hashes)):
                    h = block_hashes[k + t]
                    if not (self.holds(b, h) or any(h in s for s in tiers.values())):
                        break
                    t += 1
            out[b] = t
        return out


class KVEventSubscriber:
    """Receives one backend's KV events and applies them to a :class:`KVIndex`.

    Args:
        backend: the backend's router index.
        endpoint: its PUB address (``tcp://host:5557``).
        index: the pool's index.
        replay_endpoint: its replay ROUTER address (None: gaps drop the backend's entries).
        topic: subscription topic (empty: everything).
        replay_timeout: seconds to wait for the next batch of a replay answer.
        ctx: a ``zmq.asyncio.Context`` (shared).
    """

    def __init__(self, backend: int, endpoint: str, index: KVIndex, replay_endpoint: str | None = None,
                 topic: str = "", replay_timeout: float = 2.0, ctx: zmq.asyncio.Context | None = None) -> None:
        self.backend = backend
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.topic = topic
        self.replay_timeout = replay_timeout
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.last_seq: int | None = None
        self.num_batches = 0
        self.num_gaps = 0
        self.num_replayed = 0
        self.num_resets = 0
        self._task: asyncio.Task | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self.on_batch = None   # callable() after each applied batch (the router wakes requests it holds)

    # -- message handling (also driven directly by tests) ---------------------
    async def handle(self, seq: int, payload: bytes) -> None:
        """Process batch ``seq``: skip duplicates, fill gaps by replay, apply."""
        if self.last_seq is not None and seq <= self.last_seq:
            if seq < self.last_seq or seq == 0:
                # the publisher restarted: everything we knew about it is stale
                logger.info("backend %d KV events restarted at seq %d (last %d): dropping its index",
                            self.backend, seq, self.last_seq)
                self.index.clear_backend(self.backend)
                self.num_resets += 1
                self.last_seq = None
            else:
                return  # already applied (replay overlap)
        want = 0 if self.last_seq is None else self.last_seq + 1
        if seq > want:
            self.num_gaps += self.last_seq is not None
            filled = await self._replay(want, seq)
            if not filled and self.last_seq is not None:
                logger.warning("backend %d missed KV event batches %d..%d and could not replay them: "
                               "dropping its index", self.backend, want, seq - 1)
                self.index.clear_backend(self.backend)
                self.num_resets += 1
        if self.last_seq is not None and seq <= self.last_seq:
            return  # the replay already covered it
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except Exception as e:  # noqa: BLE001 - a bad message must not kill the subscriber
            logger.warning("backend %d: undecodable KV event batch %d: %s", self.backend, seq, e)
            self.last_seq = seq
            return
        self.index.apply(self.backend, batch)
        self.last_seq = seq
        self.num_batches += 1
        if self.on_batch is not None:
            self.on_batch()

    async def _replay(self, start: int, until: int) -> bool:
        """Fetch batches ``start .. until-1`` from the replay socket and apply them.

        Returns:
            True when every batch of the range was replayed.
        """
        if self.replay_endpoint is None:
            return False
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)   # a replay may be buffer_steps (10,000) batches long
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", seq_to_bytes(start)])
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    logger.warning("backend %d: replay from %s timed out", self.backend, self.replay_endpoint)
                    break
                frames = await sock.recv_multipart()
                deadline = time.monotonic() + self.replay_timeout   # a timeout between batches, not for all
                if len(frames) < 3:
                    continue
                s = seq_from_bytes(frames[-2])
                if s == REPLAY_END:
                    break
                if s < until:
                    got.append((s, frames[-1]))
        except zmq.ZMQError as e:
            logger.warning("backend %d: replay failed: %s", self.backend, e)
        finally:
            sock.close(linger=0)
        got.sort()
        complete = bool(got) and got[0][0] <= start and all(b[0] == a[0] + 1 for a, b in zip(got, got[1:])) \
            and got[-1][0] == until - 1
        if not complete and self.last_seq is not None:
            return False  # caller drops the index; applying a holed range would not help
        for s, p in got:
            if self.last_seq is None or s > self.last_seq:
                self._apply(s, p)
                self.num_replayed += 1
        return complete

    # -- the socket loop ------------------------------------------------------
    async def _run(self) -> None:
        sub = self._sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                _, seq_b, payload = frames
                try:
                    await self.handle(seq_from_bytes(seq_b), payload)
                except Exception:  # noqa: BLE001 - keep listening
                    logger.exception("backend %d: KV event handling failed", self.backend)
        finally:
            sub.close(linger=0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.backend}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None
