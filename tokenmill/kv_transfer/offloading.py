"""A second KV cache tier on local disk: prefix blocks kept past the pool, loaded instead of recomputed.

``--kv-offloading-backend native --kv-offloading-size GIB [--kv-offloading-dir DIR]`` (vLLM's flag
names). :class:`OffloadingConnector` is a KV connector (:mod:`tokenmill.kv_transfer.base`), the
shape of vLLM's ``OffloadingConnector``, so offload and prefill-decode disaggregation share one
mechanism in the scheduler (the ``WAITING_FOR_REMOTE_KVS`` wait, :class:`~.multi.MultiConnector`
to run both):

* **Store.** Full blocks are written to the tier under their prefix-cache block hash
  (:func:`tokenmill.core.prefix_cache.hash_block_tokens`: chained, with the cache salt and whatever
  else the hash carries, so the tier follows it). Policy ``write_through`` (default) saves a block
  when it is registered in the prefix cache; ``evict`` when it leaves the pool (LRU reuse), plus the
  resident ones at shutdown. Either way the engine loop only copies the block out of the pool
  (before the next forward can overwrite it); one writer thread writes the files.
* **Bound.** The tier is LRU over whole files, at most ``--kv-offloading-size`` bytes; a hit
  refreshes a block.
* **Lookup.** A waiting request whose prompt misses the pool after ``k`` blocks continues into the
  tier: the run of consecutive tier blocks from ``k`` on (never the prompt's last token, which is
  computed for its logits). A run shorter than ``min_load_blocks`` is recomputed (loading would be
  slower; measured in ``benchmarks/kv_offload.py``). Otherwise the scheduler allocates fresh blocks
  and the request waits in ``WAITING_FOR_REMOTE_KVS`` while a load thread reads, verifies and copies
  the files into them; it is admitted on the step after, with those tokens computed and counted as
  cached (``usage.prompt_tokens_details.cached_tokens``).
* **Files.** One per block, ``<dir>/<fingerprint>/dp<rank>/<hh>/<hash>.kvb``: a header (JSON: format
  version, the configuration the bytes depend on — model files, model dtype, KV dtype, block size,
  layout, ranks —, the block's hash, parent hash and token ids, the quantised cache's scales, a
  CRC-32 of the payload) and the block's K/V ``[num_layers, 2, block_size, num_kv_heads,
  head_dim]``. Written to a temporary name and renamed (atomic). At start the directory is scanned
  (warm restart); a file whose header is unreadable or names another configuration is discarded
  with a warning; a payload whose checksum or scales disagree is discarded when loaded (the
  request then recomputes). A failed write (a full disk) pauses writes for ``write_retry_s``;
  serving goes on. Each data-parallel engine core has its own directory, locked with ``flock`` (a
  second process with the same configuration takes the next free one), so cores never write or
  delete each other's files.
* **Events.** With ``--kv-events-config`` the tier emits ``BlockStored`` / ``BlockRemoved`` with
  ``medium="DISK"`` (the pool's events carry no medium), so a cache-aware router can score a tier
  hit below a pool hit.

The load path follows the KV connector design of vLLM v1 (``vllm/distributed/kv_transfer``,
``OffloadingConnector``); the tier as a whole is the idea of SGLang's HiCache and of
"CachedAttention" (Gao et al., USENIX ATC'24, arXiv 2403.19708, §3: KV of past turns kept in a
host-memory/disk hierarchy and loaded instead of recomputed).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from tokenmill import envs
from tokenmill.core.kv_offload_stats import KVOffloadStats
from tokenmill.core.kv_transfer_stats import KVTransferStats
from tokenmill.core.request import Request
from tokenmill.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"TMKVTIER"
MEDIUM = "DISK"
SUFFIX = ".kvb"
STORE_POLICIES = ("write_through", "evict")
# Tier runs shorter than this many blocks are recomputed, not loaded. 1: loading won at every length
# measured (benchmarks/kv_offload.py --crossover; docs/guide/kv_offload.md).
DEFAULT_MIN_LOAD_BLOCKS = 1
_RECENT = 1024


class TierFileError(ValueError):
    """A tier file that must not be loaded: unreadable, corrupt, or written under another configuration."""


@dataclass(frozen=True)
class OffloadingConfig:
    """Settings of one engine's tier.

    Attributes:
        root: the tier's base directory (``--kv-offloading-dir``); this engine uses
            ``root/<fingerprint>/dp<rank>``.
        capacity_bytes: most bytes of files kept (``--kv-offloading-size`` GiB).
        data_parallel_rank: this engine core's rank (its own directory).
        store_policy: ``write_through`` or ``evict`` (see the module docstring).
        min_load_blocks: shortest tier run worth loading, in blocks.
        num_load_threads: threads reading files into the pool.
        max_pending_writes: blocks copied out and waiting for the writer; more are dropped.
        write_retry_s: seconds writes stay paused after a failed write.
    """

    root: str
    capacity_bytes: int
    data_parallel_rank: int = 0
    store_policy: str = "write_through"
    min_load_blocks: int = DEFAULT_MIN_LOAD_BLOCKS
    num_load_threads: int = 2
    max_pending_writes: int = 512
    write_retry_s: float = 60.0

    def __post_init__(self) -> None:
        if self.store_policy not in STORE_POLICIES:
            raise ValueError(f"kv offloading store_policy must be one of {STORE_POLICIES}, got {self.store_policy!r}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"--kv-offloading-size must be > 0, got {self.capacity_bytes} bytes")
        if self.min_load_blocks < 1 or self.num_load_threads < 1 or self.max_pending_writes < 1:
            raise ValueError("kv offloading: min_load_blocks, num_load_threads and max_pending_writes must be >= 1")


@dataclass
class TierLoadSpec:
    """One request's load: files (by block hash) into local blocks, same order and length."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """The scheduler side's orders for one step.

    Attributes:
        tier_loads: loads to start.
        to_save: ``[(block_id, block_hash, parent_hash, token_ids)]`` blocks to copy out of the pool
            and write, before this step's forward may overwrite them.
    """

    tier_loads: dict[str, TierLoadSpec] = field(default_factory=dict)
    to_save: list[tuple[int, bytes, bytes | None, list[int]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.tier_loads or self.to_save or self.reqs_to_cancel)


def encode_header(header: dict[str, Any]) -> bytes:
    """``MAGIC || u32 length || JSON`` of a file header."""
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(body)) + body


def decode_header(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """Parse a file's header.

    Returns:
        ``(header, payload offset in bytes)``.

    Raises:
        TierFileError: wrong magic, truncated, or not a JSON object.
    """
    if len(data) < 12 or bytes(data[:8]) != MAGIC:
        raise TierFileError("not a tokenmill KV tier file (bad magic)")
    (n,) = struct.unpack("<I", bytes(data[8:12]))
    if n > 1 << 20 or len(data) < 12 + n:
        raise TierFileError("truncated header")
    try:
        header = json.loads(bytes(data[12:12 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TierFileError(f"unreadable header ({e})") from None
    if not isinstance(header, dict):
        raise TierFileError("header is not an object")
    return header, 12 + n


def model_identity(model: str) -> list[list[Any]]:
    """``[[absolute path, size, mtime_ns], ...]`` of the checkpoint files (the weight cache's key).

    Raises:
        OSError: a file cannot be stat-ed.
    """
    from tokenmill.model.weight_cache import checkpoint_files

    kind = "gguf" if os.path.isfile(model) else "hf"
    out = []
    for f in checkpoint_files(kind, model):
        st = os.stat(f)
        out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return out


class _Index:
    """The tier's files: block hash -> file bytes in LRU order (oldest first), with pins.

    Thread-safe (one lock); a pinned hash (a load reading it) is never evicted.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.pins: dict[bytes, int] = {}
        self.total = 0
        self.lock = threading.Lock()

    def run_length(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, are in the tier (consecutively)."""
        n = 0
        with self.lock:
            for h in hashes:
                if h not in self.entries:
                    break
                n += 1
        return n

    def pin(self, hashes: list[bytes]) -> None:
        with self.lock:
            for h in hashes:
                self.pins[h] = self.pins.get(h, 0) + 1

    def unpin(self, hashes: list[bytes]) -> None:
        with self.lock:
            for h in hashes:
                c = self.pins.get(h, 0) - 1
                if c <= 0:
                    self.pins.pop(h, None)
                else:
                    self.pins[h] = c

    def touch(self, hashes: list[bytes]) -> None:
        with self.lock:
            for h in hashes:
                if h in self.entries:
                    self.entries.move_to_end(h)

    def add(self, h: bytes, nbytes: int) -> None:
        with self.lock:
            if h in self.entries:
                self.total -= self.entries[h]
            self.entries[h] = nbytes
            self.entries.move_to_end(h)
            self.total += nbytes

    def remove(self, h: bytes) -> bool:
        with self.lock:
            n = self.entries.pop(h, None)
            if n is None:
                return False
            self.total -= n
            return True

    def victims(self, need: int) -> list[bytes]:
        """Remove and return LRU unpinned hashes until ``need`` more bytes fit under the capacity."""
        out = []
        with self.lock:
            for h in list(self.entries):
                if self.total + need <= self.capacity:
                    break
                if h in self.pins:
                    continue
                self.total -= self.entries.pop(h)
                out.append(h)
        return out

    def __contains__(self, h: bytes) -> bool:
        with self.lock:
            return h in self.entries

    def __len__(self) -> int:
        return len(self.entries)


class OffloadingConnector(KVConnectorBase):
    """The disk tier as a KV connector (scheduler side and worker side in the engine core process).

    Args:
        config: the tier's settings.
        block_size: tokens per block.
        kv_caches: the pool, per layer ``[2, num_blocks + 1, block_size, num_kv_heads, head_dim]``
            (the engine core's own: uniproc executor).
        identity: what the bytes depend on (model files, model dtype, ranks...); the KV dtype,
            block size and layout are added from ``kv_caches``. Files of another identity are never loaded.
        scales_fn: a quantised cache's per-layer ``[(k_scale, v_scale)]``, ``"pending"`` while
            ``--calculate-kv-scales`` has not run yet, or None for a float cache.

    Raises:
        OSError: the directory cannot be created.
        ValueError: a bad setting.
    """

    #: copies blocks out of the pool in :meth:`start_load_kv`: a :class:`~.multi.MultiConnector` runs
    #: it before connectors that load into fresh (possibly just evicted) blocks.
    saves_from_pool = True

    def __init__(self, config: OffloadingConfig, block_size: int, kv_caches: list[torch.Tensor],
                 identity: dict[str, Any], scales_fn: Callable[[], Any] | None = None) -> None:
        self.tier_config = config
        self.block_size = block_size
        self.engine_id = f"offload-dp{config.data_parallel_rank}"
        self.stats = KVTransferStats()          # the P/D counters stay zero: tier figures are in tier_stats
        self.tier_stats = KVOffloadStats(capacity_bytes=config.capacity_bytes)
        self.kv_caches = list(kv_caches)
        kv = self.kv_caches[0]
        self.block_shape = (len(self.kv_caches), 2, block_size, int(kv.shape[3]), int(kv.shape[4]))
        self.kv_dtype = kv.dtype
        self.block_nbytes = torch.Size(self.block_shape).numel() * kv.element_size()
        self.byte_shape = (*self.block_shape[:-1], self.block_shape[-1] * kv.element_size())   # as uint8
        self.identity = {"format": FORMAT_VERSION, **identity, "kv_dtype": str(kv.dtype).replace("torch.", ""),
                         "block_size": block_size, "block_shape": list(self.block_shape),
                         "layout": "layer,kv,token,kv_head,head_dim"}
        self.fingerprint = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.scales_fn = scales_fn
        self._scales: list[list[float]] | None = None     # known scales of a quantised cache
        self._scales_ok = scales_fn is None
        self.index = _Index(config.capacity_bytes)
        self.dir, self._lock_fd = self._claim_dir()
        self._lock = threading.Lock()
        self._events: list[Any] = []             # KV events from the writer / load threads
        self._meta = OffloadingMetadata()
        self._pending_hashes: set[bytes] = set()      # copied out or queued, not yet written
        self._pool_meta: dict[int, tuple[bytes, bytes | None, list[int]]] = {}  # evict policy
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._cancel: dict[str, threading.Event] = {}
        self._paused_until = 0.0
        self._queued = 0                         # blocks handed to the writer and not yet written (or dropped)
        self._closed = False
        self.kv_cache_manager: Any = None
        self._scan()
        self._writes: queue.Queue = queue.Queue(maxsize=config.max_pending_writes)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._loads = ThreadPoolExecutor(max_workers=config.num_load_threads, thread_name_prefix="kv-tier-load")
        logger.info("KV offloading tier: %s, %d blocks (%.1f MiB) found, capacity %.2f GiB (%d blocks of %d B), "
                    "store policy %s, min load %d blocks", self.dir, len(self.index), self.index.total / 2**20,
                    config.capacity_bytes / 2**30, config.capacity_bytes // self.block_nbytes, self.block_nbytes,
                    config.store_policy, config.min_load_blocks)

    # -- directory -------------------------------------------------------------
    def _claim_dir(self) -> tuple[str, int]:
        """This engine's directory, locked (``flock``) so no other live process writes into it."""
        base = os.path.join(self.tier_config.root, self.fingerprint)
        os.makedirs(base, exist_ok=True)
        with open(os.path.join(base, "config.json.tmp"), "w") as f:
            json.dump(self.identity, f, indent=1, sort_keys=True)
        os.replace(os.path.join(base, "config.json.tmp"), os.path.join(base, "config.json"))
        rank = self.tier_config.data_parallel_rank
        for i in range(64):
            d = os.path.join(base, f"dp{rank}" + (f".{i}" if i else ""))
            os.makedirs(d, exist_ok=True)
            fd = os.open(os.path.join(d, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                logger.warning("KV tier directory %s is in use by another process; trying the next one", d)
                continue
            return d, fd
        raise OSError(f"no free KV tier directory under {base} (64 in use)")

    def path_of(self, h: bytes) -> str:
        """The file of block hash ``h``."""
        x = h.hex()
        return os.path.join(self.dir, x[:2], x + SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous run left (LRU order = modification time); discard the bad ones."""
        found = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                if not e.name.endswith(SUFFIX):
                    if ".tmp" in e.name:           # a write a crash interrupted
                        _unlink(e.path)
                    continue
                try:
                    with open(e.path, "rb") as f:      # the header only (the payload is checked when loaded)
                        head = f.read(12)
                        if len(head) == 12 and head[:8] == MAGIC:
                            head += f.read(min(struct.unpack("<I", head[8:12])[0], 1 << 20))
                    header, off = decode_header(head)
                    self._check_header(header, bytes.fromhex(e.name[:-len(SUFFIX)]))
                    size = e.stat().st_size
                    if size != off + int(header["nbytes"]):
                        raise TierFileError(f"size {size} != header + payload {off + int(header['nbytes'])}")
                except (OSError, ValueError, KeyError, TypeError) as err:
                    logger.warning("KV tier: discarding %s (%s)", e.path, err)
                    _unlink(e.path)
                    self.tier_stats.blocks_discarded += 1
                    continue
                found.append((e.stat().st_mtime_ns, bytes.fromhex(header["hash"]), size, header))
        found.sort(key=lambda x: x[0])
        for _, h, size, header in found:
            self.index.add(h, size)
            self._emit_stored(h, header.get("parent"), header.get("token_ids") or [])
        for h in self.index.victims(0):        # a smaller --kv-offloading-size than last time
            self._delete(h, evicted=True)

    def _check_header(self, header: dict[str, Any], h: bytes | None = None) -> None:
        """Raise :class:`TierFileError` unless the header is ours (version, configuration, hash)."""
        if header.get("identity") != self.identity:
            theirs = header.get("identity") or {}
            diff = sorted(k for k in set(theirs) | set(self.identity) if theirs.get(k) != self.identity.get(k))
            raise TierFileError(f"written under another configuration (differs in {', '.join(diff) or 'format'})")
        if h is not None and header.get("hash") != h.hex():
            raise TierFileError("the header names another block")
        if int(header.get("nbytes", -1)) != self.block_nbytes:
            raise TierFileError(f"payload of {header.get('nbytes')} bytes, expected {self.block_nbytes}")

    # -- wiring ------------------------------------------------------------------
    def bind_kv_cache_manager(self, manager: Any) -> None:
        """Hook into the scheduler's :class:`~tokenmill.core.kv_cache_manager.KVCacheManager`: blocks
        registered in (write-through) or evicted from (evict policy) the prefix cache are saved."""
        self.kv_cache_manager = manager
        manager.block_listeners.append(self)

    def on_block_cached(self, request: Request, index: int, block_id: int) -> None:
        """A full block of ``request`` (its ``index``-th) was registered in the prefix cache as ``block_id``."""
        hashes = request.block_hashes
        h = hashes[index]
        parent = hashes[index - 1] if index > 0 else None
        bs = self.block_size
        tokens = request.all_token_ids[index * bs:(index + 1) * bs]
        if self.tier_config.store_policy == "write_through":
            self._queue_save(block_id, h, parent, tokens)
        else:
            self._pool_meta[block_id] = (h, parent, list(tokens))

    def on_block_evicted(self, block_id: int, h: bytes) -> None:
        """Block ``block_id`` holding ``h`` is being reused (its K/V is intact until the next forward)."""
        meta = self._pool_meta.pop(block_id, None)
        if meta is not None and meta[0] == h and self.tier_config.store_policy == "evict":
            self._queue_save(block_id, *meta)

    def _queue_save(self, block_id: int, h: bytes, parent: bytes | None, tokens: list[int]) -> None:
        if h in self._pending_hashes or h in self.index or self._closed:
            return
        self._pending_hashes.add(h)
        self._meta.to_save.append((block_id, h, parent, list(tokens)))

    # -- scheduler side ----------------------------------------------------------
    def _scales_usable(self) -> bool:
        """For a quantised cache: the tier's files were written with today's scales (else purge them)."""
        if self._scales_ok:
            return True
        cur = self.scales_fn()
        if cur == "pending":
            return False
        self._scales = [[float(k), float(v)] for k, v in cur] if cur is not None else None
        path = os.path.join(self.dir, "scales.json")
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = None
        if old is not None and old != self._scales:
            n = len(self.index)
            logger.warning("KV tier: the KV cache scales differ from those of the tier's files (calculated from "
                           "another first batch); discarding %d files", n)
            for h in list(self.index.entries):
                if self.index.remove(h):
                    _unlink(self.path_of(h))
                    self.tier_stats.blocks_discarded += 1
                    self._emit_removed(h)
        if old != self._scales:
            tmp = path + f".tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self._scales, f)
            os.replace(tmp, path)
        self._scales_ok = True
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.sampling_params.prompt_logprobs is not None or not self._scales_usable():
            return 0, False
        bs = self.block_size
        first = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs        # the last token is always computed
        if not getattr(request, "_tier_queried", False) and request.num_preemptions == 0:
            request._tier_queried = True     # count each request once (vLLM: external_prefix_cache_queries)
            self.tier_stats.queries += request.num_tokens
        hashes = request.block_hashes[first:last]
        n = self.index.run_length(hashes)
        if n == 0:
            return 0, False
        if n < self.tier_config.min_load_blocks:
            self.tier_stats.num_skipped_short += 1
            return 0, False
        return n * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        bs = self.block_size
        first = request.num_computed_tokens // bs
        n = num_external_tokens // bs
        hashes = list(request.block_hashes[first:first + n])
        self.index.pin(hashes)
        self._meta.tier_loads[request.request_id] = TierLoadSpec(request.request_id, list(block_ids[first:first + n]),
                                                                 hashes)
        self._cancel[request.request_id] = threading.Event()

    def build_connector_meta(self) -> OffloadingMetadata:
        meta, self._meta = self._meta, OffloadingMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_aborted_while_loading(self, request: Request) -> None:
        spec = self._meta.tier_loads.pop(request.request_id, None)
        if spec is not None:            # never started
            self.index.unpin(spec.block_hashes)
            with self._lock:
                self._recv_failed.add(request.request_id)
            self._cancel.pop(request.request_id, None)
            return
        ev = self._cancel.get(request.request_id)
        if ev is not None:
            ev.set()

    # -- worker side -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self.kv_caches = list(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Copy this step's saves out of the pool (first: a load may reuse those blocks), then start loads."""
        if not isinstance(metadata, OffloadingMetadata):
            return
        if metadata.to_save:
            self._copy_out(metadata.to_save)
        for rid, spec in metadata.tier_loads.items():
            self._loads.submit(self._run_load, spec, self._cancel.setdefault(rid, threading.Event()))

    def _copy_out(self, items: list[tuple[int, bytes, bytes | None, list[int]]]) -> None:
        """Gather the blocks into one host tensor ``[n, num_layers, 2, block_size, kv_heads, head_dim]``
        and queue them for the writer (dropped, and counted, when the writer is behind or paused)."""
        t0 = time.perf_counter()
        if time.monotonic() < self._paused_until or not self._scales_usable():   # (scales: known after a forward)
            for _, h, _, _ in items:
                self._pending_hashes.discard(h)
            self.tier_stats.saves_dropped += len(items)
            return
        dev = self.kv_caches[0].device
        idx = torch.tensor([b for b, _, _, _ in items], dtype=torch.long, device=dev)
        # one gather per layer, as bytes (exact for every KV dtype; fp8 has no index_select) into
        # [L, 2, n, bs, H, D * element size]; the writer makes each block contiguous off the loop
        # (a permuted .contiguous() here cost ~50-100x more: docs/benchmarks/kv_offload_2026-12-01.md)
        buf = torch.empty((self.block_shape[0], 2, len(items), *self.byte_shape[2:]), dtype=torch.uint8, device=dev)
        for layer, kv in enumerate(self.kv_caches):
            torch.index_select(kv.view(torch.uint8), 1, idx, out=buf[layer])
        host = buf.cpu()
        for j, (_, h, parent, tokens) in enumerate(items):
            try:
                with self._lock:
                    self._queued += 1
                self._writes.put_nowait((h, parent, tokens, (host, j)))
            except queue.Full:
                with self._lock:
                    self._queued -= 1
                self._pending_hashes.discard(h)
                self.tier_stats.saves_dropped += 1
        self.tier_stats.copy_seconds += time.perf_counter() - t0

    def _run_load(self, spec: TierLoadSpec, cancel: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            blocks = []
            for h in spec.block_hashes:
                if cancel.is_set():
                    raise TierFileError("cancelled")
                blocks.append(self._read_block(h))
            dev = self.kv_caches[0].device
            pool = [kv.view(torch.uint8) for kv in self.kv_caches]   # as bytes: exact for every KV dtype
            # block by block, layer by layer (index_copy_ along the block dim was ~50x slower on CPU)
            for bid, blk in zip(spec.block_ids, blocks):
                blk = blk.to(dev)
                for layer, kv in enumerate(pool):
                    kv[:, bid].copy_(blk[layer])
        except Exception as e:  # noqa: BLE001 - any failure means: recompute the prompt
            if not cancel.is_set():
                logger.warning("KV tier load for request %s failed (%s: %s); it recomputes its prompt",
                               spec.req_id, type(e).__name__, e)
            with self._lock:
                self._recv_failed.add(spec.req_id)
                self.tier_stats.num_failed_loads += not cancel.is_set()
            self.index.unpin(spec.block_hashes)
            return
        dt = time.perf_counter() - t0
        self.index.touch(spec.block_hashes)
        for h in spec.block_hashes:         # the LRU order a restart reads back (file modification times)
            try:
                os.utime(self.path_of(h))
            except OSError:
                pass
        self.index.unpin(spec.block_hashes)
        with self._lock:
            self._recv_done.add(spec.req_id)
            st = self.tier_stats
            st.num_loads += 1
            st.hits += len(spec.block_hashes) * self.block_size
            st.blocks_loaded += len(spec.block_hashes)
            st.bytes_loaded += len(spec.block_hashes) * self.block_nbytes
            st.load_seconds += dt
            st.recent_load_times.append(dt)
            if len(st.recent_load_times) > _RECENT:
                del st.recent_load_times[: len(st.recent_load_times) - _RECENT]

    def _read_block(self, h: bytes) -> torch.Tensor:
        """Read and verify block ``h``'s file: its K/V as bytes ``[num_layers, 2, block_size, kv_heads,
        head_dim * element size]`` (uint8).

        Raises:
            TierFileError: missing, corrupt (checksum), another configuration, or other KV scales;
                a bad file is deleted (with a warning).
        """
        path = self.path_of(h)
        try:
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(buf)
        except FileNotFoundError:
            self.index.remove(h)
            raise TierFileError(f"block {h.hex()[:12]} is no longer in the tier") from None
        try:
            header, off = decode_header(buf)
            self._check_header(header, h)
            if n != len(buf) or len(buf) != off + self.block_nbytes:
                raise TierFileError("truncated payload")
            payload = memoryview(buf)[off:]
            if zlib.crc32(payload) != int(header.get("crc32", -1)):
                raise TierFileError("checksum mismatch")
            if header.get("scales") != self._scales:
                raise TierFileError("written with other KV cache scales")
        except (TierFileError, ValueError, TypeError) as e:
            logger.warning("KV tier: discarding %s (%s)", path, e)
            if self.index.remove(h):
                self._emit_removed(h)
            _unlink(path)
            with self._lock:
                self.tier_stats.blocks_discarded += 1
            raise TierFileError(str(e)) from None
        return torch.frombuffer(buf, dtype=torch.uint8, offset=off, count=self.block_nbytes).view(self.byte_shape)

    # -- writer --------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            h, parent, tokens, block = item
            try:
                if time.monotonic() < self._paused_until:
                    with self._lock:
                        self.tier_stats.saves_dropped += 1
                    continue
                self._write(h, parent, tokens, block)
            except Exception:  # noqa: BLE001 - the writer must outlive any one block
                logger.exception("KV tier: writing block %s failed", h.hex()[:12])
            finally:
                with self._lock:
                    self._pending_hashes.discard(h)
                    self._queued -= 1

    def _write(self, h: bytes, parent: bytes | None, tokens: list[int], block: tuple[torch.Tensor, int]) -> None:
        """Write one block's file atomically (temporary name, then rename), evicting LRU files to fit."""
        if h in self.index:
            return
        host, j = block
        payload = np.ascontiguousarray(host.numpy()[:, :, j]).reshape(-1)     # uint8 [L, 2, bs, H, D * el]
        header = {"version": FORMAT_VERSION, "identity": self.identity, "hash": h.hex(),
                  "parent": parent.hex() if parent is not None else None, "token_ids": [int(t) for t in tokens],
                  "nbytes": int(payload.nbytes), "crc32": zlib.crc32(payload), "scales": self._scales,
                  "written": time.time()}
        head = encode_header(header)
        size = len(head) + payload.nbytes
        if size > self.index.capacity:
            return
        for victim in self.index.victims(size):
            self._delete(victim, evicted=True)
        path = self.path_of(h)
        tmp = f"{path}.tmp.{os.getpid()}"
        t0 = time.perf_counter()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._write_file(tmp, head, memoryview(payload))
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self._paused_until = time.monotonic() + self.tier_config.write_retry_s
            with self._lock:
                self.tier_stats.write_errors += 1
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            logger.warning("KV tier: %s writing %s (%s); writes paused for %.0f s, serving continues",
                           "disk full" if full else "error", path, e, self.tier_config.write_retry_s)
            return
        self.index.add(h, size)
        with self._lock:
            st = self.tier_stats
            st.blocks_stored += 1
            st.bytes_stored += size
            st.store_seconds += time.perf_counter() - t0
        self._emit_stored(h, header["parent"], header["token_ids"])

    @staticmethod
    def _write_file(path: str, head: bytes, payload: memoryview) -> None:
        """Write header and payload to ``path`` (raises OSError, e.g. ENOSPC on a full disk)."""
        with open(path, "wb") as f:
            f.write(head)
            f.write(payload)

    def _delete(self, h: bytes, evicted: bool) -> None:
        self.index.remove(h)
        _unlink(self.path_of(h))
        with self._lock:
            if evicted:
                self.tier_stats.blocks_evicted += 1
        self._emit_removed(h)

    # -- events and results ----------------------------------------------------------
    def _emit_stored(self, h: bytes, parent_hex: str | None, tokens: list[int]) -> None:
        from tokenmill.core.kv_events import BlockStored

        with self._lock:
            self._events.append(BlockStored(block_hashes=[h], parent_block_hash=bytes.fromhex(parent_hex)
                                            if parent_hex else None, token_ids=list(tokens),
                                            block_size=self.block_size, medium=MEDIUM))

    def _emit_removed(self, h: bytes) -> None:
        from tokenmill.core.kv_events import BlockRemoved

        with self._lock:
            self._events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM))

    def wait_for_save(self) -> None:
        """Writes are asynchronous (the writer thread); nothing to wait for in the step."""

    def get_finished(self) -> KVConnectorOutput:
        """Loads that ended; also hands the tier's KV events to the pool's event list (engine thread)."""
        with self._lock:
            out = KVConnectorOutput(finished_recving=self._recv_done, failed_recving=self._recv_failed)
            self._recv_done, self._recv_failed = set(), set()
            events, self._events = self._events, []
        for rid in out.finished_recving | out.failed_recving:
            self._cancel.pop(rid, None)
        pool = self.kv_cache_manager.block_pool if self.kv_cache_manager is not None else None
        if events and pool is not None and pool.kv_events is not None:
            pool.kv_events.extend(events)
        return out

    def get_tier_stats(self) -> KVOffloadStats:
        """A snapshot of the tier's counters."""
        with self._lock:
            st = self.tier_stats.copy()
        st.resident_blocks = len(self.index)
        st.resident_bytes = self.index.total
        st.writes_paused = time.monotonic() < self._paused_until
        return st

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk (tests, benchmarks, shutdown). True if it drained."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued == 0:
                    return True
            time.sleep(0.005)
        return False

    def shutdown(self) -> None:
        """Save the pool's resident blocks (evict policy), finish the queued writes, stop the threads."""
        if self._closed:
            return
        if self.tier_config.store_policy == "evict" and self.kv_cache_manager is not None:
            pool = self.kv_cache_manager.block_pool
            for b in list(pool.cached_blocks.values()):
                meta = self._pool_meta.get(b.block_id)
                if meta is not None and meta[0] == b.block_hash:
                    self._queue_save(b.block_id, *meta)
            items, self._meta.to_save = self._meta.to_save, []
            for i in range(0, len(items), 64):
                self._copy_out(items[i:i + 64])
                self.flush(timeout=10.0)
        self._closed = True
        for ev in list(self._cancel.values()):
            ev.set()
        self._writes.put(None)
        self._writer.join(timeout=30.0)
        self._loads.shutdown(wait=True, cancel_futures=True)
        try:
            os.close(self._lock_fd)
        except OSError:
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def default_offloading_dir() -> str:
    """``$TOKENMILL_CACHE_DIR/kv_offload`` or ``~/.cache/tokenmill/kv_offload`` (beside the weight cache)."""
    root = envs.TOKENMILL_CACHE_DIR
    return os.path.join(root, "kv_offload")


def kv_scales_fn(runner: Any) -> Callable[[], Any] | None:
    """The scales of ``runner``'s quantised cache, as :class:`OffloadingConnector` wants them (None: float cache)."""
    from tokenmill.model.layers.kv_quant import KVScales, is_quantized

    if not is_quantized(runner.kv_caches[0].dtype):
        return None
    model = getattr(runner, "model", None)
    scales = [m.kv_scales for m in model.modules() if isinstance(getattr(m, "kv_scales", None), KVScales)] \
        if model is not None else []

    def fn() -> Any:
        if any(sc.calculate for sc in scales):
            return "pending"
        return [(sc.k, sc.v) for sc in scales]

    return fn


def create_offloading_connector(engine_config: Any, executor: Any, data_parallel_rank: int = 0,
                                **overrides: Any) -> OffloadingConnector:
    """The tier ``--kv-offloading-*`` asks for, over ``executor``'s KV pool.

    Args:
        engine_config: the :class:`~tokenmill.config.EngineConfig`.
        executor: the uniproc executor (a :class:`~tokenmill.model.runner.ModelRunner`).
        data_parallel_rank: this engine core's rank.
        overrides: :class:`OffloadingConfig` fields (``store_policy``, ``min_load_blocks``, ...).

    Raises:
        ValueError: the executor's KV pool is not in this process.
        OSError: the directory cannot be created or a checkpoint file stat-ed.
    """
    kv_caches = getattr(executor, "kv_caches", None)
    if kv_caches is None:
        raise ValueError("--kv-offloading-backend needs the KV pool in the engine core (one rank per engine)")
    cache = engine_config.cache
    model = engine_config.model.model
    if model is None:
        from tokenmill.model.default_model import default_model_path

        model = default_model_path()
    identity = {"tokenmill": _version(), "model": model_identity(model),
                "model_dtype": str(getattr(executor, "dtype", "")).replace("torch.", ""),
                "quantization": engine_config.model.quantization, "tp": [0, 1], "pp": [0, 1]}
    cfg = OffloadingConfig(root=cache.kv_offloading_dir or default_offloading_dir(),
                           capacity_bytes=int(cache.kv_offloading_size * 2**30),
                           data_parallel_rank=data_parallel_rank, **overrides)
    return OffloadingConnector(cfg, cache.block_size, kv_caches, identity, kv_scales_fn(executor))


def _version() -> str:
    import tokenmill

    return tokenmill.__version__
