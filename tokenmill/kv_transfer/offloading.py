"""A second KV cache tier: prefix blocks kept past the pool (host memory on GPUs, then disk), loaded
instead of recomputed, warm after a restart.

``--kv-offloading-backend native --kv-offloading-size GIB [--kv-offloading-dir DIR]
[--kv-offloading-host-size GIB]`` (vLLM's flag names, plus tokenmill's directory and host-memory
size). :class:`OffloadingConnector` is a KV connector (:mod:`tokenmill.kv_transfer.base`), the shape
of vLLM's ``OffloadingConnector``, so offload and prefill-decode disaggregation share one mechanism
in the scheduler (the ``WAITING_FOR_REMOTE_KVS`` wait, :class:`~.multi.MultiConnector` to run both).

Two halves:

* :class:`OffloadingConnector` is the *scheduler side* (engine core process): which blocks to save
  (policy), which prompt blocks the tier holds, which loads to start, and when a load is done.
* :class:`TierStore` is one *rank's* tier over that rank's KV pool: its own files (and, where the pool
  is on a GPU, its host-memory tier), writer and load threads. With one rank per engine the store is
  in the engine core (:class:`LocalTierRanks`); with tensor/pipeline parallelism every worker process
  keeps one store over its shard (TP: its K/V heads; PP: its layers), driven by the engine core
  through the executor (:class:`ExecutorTierRanks`, :func:`worker_tier_call`).

Behaviour:

* **Store.** Full blocks are written to the tier under their prefix-cache block hash
  (:func:`tokenmill.core.prefix_cache.hash_block_tokens`: chained, with the cache salt and whatever
  else the hash carries, so the tier follows it). Policy ``write_through`` (default) saves a block
  when it is registered in the prefix cache; ``evict`` when it leaves the pool (LRU reuse), plus the
  resident ones at shutdown. Either way each rank's step only copies the block out of the pool
  (before the next forward can overwrite it); one writer thread per rank writes the files.
* **Bound.** Each tier is LRU over whole blocks: the files at most ``--kv-offloading-size`` bytes
  (split over the ranks in proportion to their shard's bytes), the host memory at most
  ``--kv-offloading-host-size``; a hit refreshes a block.
* **Lookup.** A waiting request whose prompt misses the pool after ``k`` blocks continues into the
  tier: the run of consecutive tier blocks from ``k`` on (never the prompt's last token, which is
  computed for its logits). A block counts only when *every rank* holds its shard (in host memory or
  on disk). A run shorter than ``min_load_blocks`` is recomputed (loading would be slower; measured in
  ``benchmarks/kv_offload.py``). Otherwise the scheduler allocates fresh blocks and the request waits
  in ``WAITING_FOR_REMOTE_KVS`` while every rank's load thread reads, verifies and copies its shard
  into them; it is admitted on the step after the last rank finished, with those tokens computed and
  counted as cached (``usage.prompt_tokens_details.cached_tokens``). If any rank fails, the others
  are cancelled and, once all have stopped writing, the request recomputes its prompt.
* **Files.** One per block and rank, ``<dir>/<fingerprint>/dp<rank>/<hh>/<hash>.kvb``, where the
  fingerprint hashes the rank's identity (so ranks never share a directory): a header (JSON: format
  version, the configuration the bytes depend on — model files, model dtype, KV dtype, block size,
  layout, the rank's place ``tp``/``pp`` ``[rank, size]`` and its layers and K/V heads —, the block's
  hash, parent hash and token ids, the quantised cache's scales, a CRC-32 of the payload) and the
  rank's K/V ``[num_layers, 2, block_size, num_kv_heads, head_dim]``. Written to a temporary name and
  renamed (atomic). At start the directory is scanned (warm restart); a file whose header is unreadable
  or names another configuration is discarded with a warning; a payload whose checksum or scales
  disagree is discarded when loaded (the request then recomputes). A failed write (a full disk) pauses
  writes for ``write_retry_s``; serving goes on. Each data-parallel engine core has its own directory,
  locked with ``flock`` (a second process with the same configuration takes the next free one), so
  cores never write or delete each other's files.
* **Quantised KV.** The per-layer scales are in every header and in ``scales.json``. An engine whose
  scales are still to be calculated from its first batch (``--calculate-kv-scales``, int8 without
  checkpoint scales) takes the scales its tier was written with, so a restart with the same
  configuration is warm; with fixed scales (checkpoint, 1.0) that differ from the files', the files
  are discarded with a warning.
* **Host memory.** Where the pool is on a GPU, a host-memory LRU (a pinned slab of blocks) sits in
  front of the disk: saved blocks go to both (the disk is inclusive, so a restart is warm), loads read
  host memory first. Off by default on a CPU, whose pool already is host memory (the page cache keeps
  hot files in memory too).
* **Events.** With ``--kv-events-config`` the tier emits ``BlockStored`` / ``BlockRemoved`` with
  ``medium="DISK"`` or ``"CPU"`` (host memory; the pool's events carry no medium), once every rank
  holds / one rank lost a block, so a cache-aware router can score a tier hit below a pool hit.

The load path follows the KV connector design of vLLM v1 (``vllm/distributed/kv_transfer``,
``OffloadingConnector``); the tier as a whole is the idea of SGLang's HiCache and of
"CachedAttention" (Gao et al., USENIX ATC'24, arXiv 2403.19708, §3: KV of past turns kept in a
host-memory/disk hierarchy and loaded instead of recomputed).
"""

from __future__ import annotations

import contextlib
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
from typing import Any

import numpy as np
import torch

from tokenmill import envs
import tokenmill
from tokenmill.core.kv_offload_stats import KVOffloadStats
from tokenmill.core.kv_transfer_stats import KVTransferStats
from tokenmill.core.request import Request
from tokenmill.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from tokenmill.kv_transfer.files import unlink_quietly, write_atomically

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"TMKVTIER"
MEDIUM = "DISK"
HOST_MEDIUM = "CPU"           # vLLM's name of the host-memory medium in KV events
ANY = "ANY"                   # a rank holds the block in some tier (the lookup's key; no event)
SUFFIX = ".kvb"
STORE_POLICIES = ("write_through", "evict")
# Tier runs shorter than this many blocks are recomputed, not loaded. 1: loading won at every length
# measured (benchmarks/kv_offload.py --crossover; docs/guide/kv_offload.md).
DEFAULT_MIN_LOAD_BLOCKS = 1
_RECENT = 1024
# KVOffloadStats fields a rank counts in blocks (the connector reports the largest rank's figure: every
# rank holds a shard of every block) and in bytes / seconds (summed over the ranks).
_RANK_BLOCK_FIELDS = ("blocks_stored", "blocks_evicted", "blocks_discarded", "saves_dropped", "write_errors",
                      "host_blocks_loaded", "host_blocks_stored", "host_blocks_evicted")
_RANK_SUM_FIELDS = ("bytes_stored", "bytes_loaded", "store_seconds", "copy_seconds", "resident_bytes",
                    "host_resident_bytes", "host_capacity_bytes", "capacity_bytes")


class TierFileError(ValueError):
    """A tier file that must not be loaded: unreadable, corrupt, or written under another configuration."""


@dataclass(frozen=True)
class OffloadingConfig:
    """Settings of one rank's tier.

    Attributes:
        root: the tier's base directory (``--kv-offloading-dir``); this rank uses
            ``root/<fingerprint>/dp<rank>``.
        capacity_bytes: most bytes of files kept (this rank's share of ``--kv-offloading-size``).
        data_parallel_rank: this engine core's rank (its own directory).
        store_policy: ``write_through`` or ``evict`` (see the module docstring).
        min_load_blocks: shortest tier run worth loading, in blocks.
        num_load_threads: threads reading files into the pool.
        max_pending_writes: blocks copied out and waiting for the writer; more are dropped.
        write_retry_s: seconds writes stay paused after a failed write.
        host_capacity_bytes: bytes of the host-memory tier in front of the disk (0: none).
    """

    root: str
    capacity_bytes: int
    data_parallel_rank: int = 0
    store_policy: str = "write_through"
    min_load_blocks: int = DEFAULT_MIN_LOAD_BLOCKS
    num_load_threads: int = 2
    max_pending_writes: int = 512
    write_retry_s: float = 60.0
    host_capacity_bytes: int = 0

    def __post_init__(self) -> None:
        if self.store_policy not in STORE_POLICIES:
            raise ValueError(f"kv offloading store_policy must be one of {STORE_POLICIES}, got {self.store_policy!r}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"--kv-offloading-size must be > 0, got {self.capacity_bytes} bytes")
        if self.host_capacity_bytes < 0:
            raise ValueError(f"--kv-offloading-host-size must be >= 0, got {self.host_capacity_bytes} bytes")
        if self.min_load_blocks < 1 or self.num_load_threads < 1 or self.max_pending_writes < 1:
            raise ValueError("kv offloading: min_load_blocks, num_load_threads and max_pending_writes must be >= 1")


@dataclass
class TierLoadSpec:
    """One request's load: tier blocks (by block hash) into local blocks, same order and length."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """The scheduler side's orders for one step (the same for every rank).

    Attributes:
        tier_loads: loads to start.
        to_save: ``[(block_id, block_hash, parent_hash, token_ids)]`` blocks to copy out of the pool
            and write, before this step's forward may overwrite them.
        reqs_to_cancel: loads to stop (aborted, or another rank's part failed).
    """

    tier_loads: dict[str, TierLoadSpec] = field(default_factory=dict)
    to_save: list[tuple[int, bytes, bytes | None, list[int]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.tier_loads or self.to_save or self.reqs_to_cancel)


@dataclass
class TierReport:
    """What one rank's :class:`TierStore` did since its last report (plain data: crosses processes).

    Attributes:
        changes: ``[(medium, hash, +1 | -1, parent hash, token ids)]``: the rank gained or lost a block
            in host memory (``"CPU"``), on disk (``"DISK"``) or in any of them (``"ANY"``); parent and
            tokens are set on gains.
        finished: loads done, request id -> seconds the load took on this rank.
        failed: loads that failed or were cancelled (this rank no longer writes their blocks).
        stats: the rank's cumulative counters.
        busy: writes are queued (the scheduler side keeps polling).
        block_nbytes: bytes of this rank's shard of one block.
    """

    changes: list[tuple[str, bytes, int, bytes | None, list[int] | None]] = field(default_factory=list)
    finished: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    stats: KVOffloadStats | None = None
    busy: bool = False
    block_nbytes: int = 0


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


class HostTier:
    """An LRU of KV blocks in host memory: a slab of ``capacity // block bytes`` slots, pinned when asked
    (page-locked memory lets a host-to-GPU copy run asynchronously; SGLang's HiCache and vLLM's CPU
    offloading keep the same kind of pinned buffer).

    Args:
        capacity_bytes: most bytes of blocks kept.
        byte_shape: one block as bytes, ``[num_layers, 2, block_size, num_kv_heads, head_dim * element size]``.
        pin: allocate the slab in page-locked memory (needs CUDA).

    Thread-safe (one lock). A pinned slot (a load copying from it) is never reused.
    """

    def __init__(self, capacity_bytes: int, byte_shape: tuple[int, ...], pin: bool = False) -> None:
        self.block_nbytes = int(np.prod(byte_shape))
        self.num_slots = max(0, capacity_bytes // self.block_nbytes)
        self.slab = torch.empty((self.num_slots, *byte_shape), dtype=torch.uint8, pin_memory=pin) \
            if self.num_slots else None
        self.pinned_memory = pin
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.meta: dict[bytes, tuple[bytes | None, list[int]]] = {}
        self.pins: dict[bytes, int] = {}
        self.lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_nbytes

    def put(self, h: bytes, src: torch.Tensor, parent: bytes | None, tokens: list[int]) -> tuple[bool, list[bytes]]:
        """Copy block ``src`` (``byte_shape`` uint8, on the host) in under ``h``, evicting LRU unpinned blocks.

        Returns:
            ``(stored, evicted hashes)``; not stored when every slot is pinned (or there is none).
        """
        evicted = []
        with self.lock:
            if h in self.entries:
                self.entries.move_to_end(h)
                return False, evicted
            if not self.free:
                for old in list(self.entries):
                    if old not in self.pins:
                        self.free.append(self.entries.pop(old))
                        self.meta.pop(old, None)
                        evicted.append(old)
                        break
            if not self.free:
                return False, evicted
            slot = self.free.pop()
            self.slab[slot].copy_(src)
            self.entries[h] = slot
            self.meta[h] = (parent, list(tokens))
        return True, evicted

    def acquire(self, h: bytes) -> torch.Tensor | None:
        """Block ``h``'s slot, pinned until :meth:`release` (None if absent); refreshes its LRU place."""
        with self.lock:
            slot = self.entries.get(h)
            if slot is None:
                return None
            self.entries.move_to_end(h)
            self.pins[h] = self.pins.get(h, 0) + 1
            return self.slab[slot]

    def release(self, h: bytes) -> None:
        with self.lock:
            c = self.pins.get(h, 0) - 1
            if c <= 0:
                self.pins.pop(h, None)
            else:
                self.pins[h] = c

    def __contains__(self, h: bytes) -> bool:
        with self.lock:
            return h in self.entries

    def __len__(self) -> int:
        return len(self.entries)


class KVScalesAccess:
    """Read and install a quantised KV cache's per-layer scales (:class:`~tokenmill.model.layers.kv_quant.KVScales`).

    Args:
        scales: the model's ``KVScales``, one per attention layer, in layer order.
    """

    def __init__(self, scales: list[Any]) -> None:
        self.scales = list(scales)

    def get(self) -> list[list[float]] | str:
        """``[[k, v], ...]``, or ``"pending"`` while any is still to be calculated from the first batch."""
        if any(sc.calculate for sc in self.scales):
            return "pending"
        return [[float(sc.k), float(sc.v)] for sc in self.scales]

    def install(self, values: list[list[float]]) -> None:
        """Use ``values`` instead of calculating them (the tier's files were written with them).

        Raises:
            ValueError: not one ``[k, v]`` pair per layer.
        """
        if len(values) != len(self.scales) or any(len(p) != 2 for p in values):
            raise ValueError(f"{len(values)} scale pairs for {len(self.scales)} layers")
        for sc, (k, v) in zip(self.scales, values):
            sc.k, sc.v, sc.calculate, sc.source = float(k), float(v), False, "kv offloading tier"


def kv_scales_of(runner: Any) -> KVScalesAccess | None:
    """The scales of ``runner``'s quantised cache (None: a float cache)."""
    from tokenmill.model.layers.kv_quant import KVScales, is_quantized

    if not is_quantized(runner.kv_caches[0].dtype):
        return None
    model = getattr(runner, "model", None)
    scales = [m.kv_scales for m in model.modules() if isinstance(getattr(m, "kv_scales", None), KVScales)] \
        if model is not None else []
    return KVScalesAccess(scales)


class TierStore:
    """One rank's tier over its KV pool: files by block hash (and a host-memory LRU in front).

    Args:
        config: the rank's settings (``capacity_bytes`` is this rank's share).
        block_size: tokens per block.
        kv_caches: the rank's pool, per layer ``[2, num_blocks + 1, block_size, num_kv_heads, head_dim]``.
        identity: what the bytes depend on (model files, model dtype, the rank's place...); the KV
            dtype, block size and layout are added from ``kv_caches``. Files of another identity are
            never loaded.
        scales: a quantised cache's scales (:class:`KVScalesAccess`), None for a float cache.
        pin_host_memory: allocate the host tier page-locked (default: when ``kv_caches`` are on CUDA).

    Raises:
        OSError: the directory cannot be created.
        ValueError: a bad setting.
    """

    def __init__(self, config: OffloadingConfig, block_size: int, kv_caches: list[torch.Tensor],
                 identity: dict[str, Any], scales: KVScalesAccess | None = None,
                 pin_host_memory: bool | None = None) -> None:
        self.tier_config = config
        self.block_size = block_size
        self.kv_caches = list(kv_caches)
        kv = self.kv_caches[0]
        self.device = kv.device
        self.block_shape = (len(self.kv_caches), 2, block_size, int(kv.shape[3]), int(kv.shape[4]))
        self.kv_dtype = kv.dtype
        self.block_nbytes = torch.Size(self.block_shape).numel() * kv.element_size()
        self.byte_shape = (*self.block_shape[:-1], self.block_shape[-1] * kv.element_size())   # as uint8
        self.identity = {"format": FORMAT_VERSION, **identity, "kv_dtype": str(kv.dtype).replace("torch.", ""),
                         "block_size": block_size, "block_shape": list(self.block_shape),
                         "layout": "layer,kv,token,kv_head,head_dim"}
        self.fingerprint = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.stats = KVOffloadStats(capacity_bytes=config.capacity_bytes)
        self.index = _Index(config.capacity_bytes)
        if pin_host_memory is None:
            pin_host_memory = self.device.type == "cuda"
        self.host = HostTier(config.host_capacity_bytes, self.byte_shape, pin_host_memory) \
            if config.host_capacity_bytes else None
        self.stats.host_capacity_bytes = self.host.capacity_bytes if self.host is not None else 0
        self.dir, self._lock_fd = self._claim_dir()
        self._lock = threading.Lock()
        self._changes: list[tuple[str, bytes, int, bytes | None, list[int] | None]] = []
        self._present: set[bytes] = set()        # in host memory or on disk (the ANY key)
        self._pending_hashes: set[bytes] = set()      # copied out or queued, not yet written
        self._recv_done: dict[str, float] = {}
        self._recv_failed: set[str] = set()
        self._load_ended = threading.Event()     # set (under _lock) when a load adds to _recv_done/_recv_failed
        self._cancel: dict[str, threading.Event] = {}
        self._paused_until = 0.0
        self._queued = 0                         # blocks handed to the writer and not yet written (or dropped)
        self._closed = False
        self.scales = scales
        self._scales: list[list[float]] | None = None     # the scales every file of this store carries
        self._scales_ok = scales is None
        self._scan()
        if scales is not None:
            self._init_scales()
        self._writes: queue.Queue = queue.Queue(maxsize=config.max_pending_writes)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._loads = ThreadPoolExecutor(max_workers=config.num_load_threads, thread_name_prefix="kv-tier-load")
        host = (f", host memory {self.host.capacity_bytes / 2**30:.2f} GiB ({self.host.num_slots} blocks, "
                f"{'pinned' if pin_host_memory else 'pageable'})") if self.host is not None else ""
        logger.info("KV offloading tier: %s, %d blocks (%.1f MiB) found, capacity %.2f GiB (%d blocks of %d B)%s, "
                    "store policy %s", self.dir, len(self.index), self.index.total / 2**20,
                    config.capacity_bytes / 2**30, config.capacity_bytes // self.block_nbytes, self.block_nbytes,
                    host, config.store_policy)

    # -- directory -------------------------------------------------------------
    def _claim_dir(self) -> tuple[str, int]:
        """This rank's directory, locked (``flock``) so no other live process writes into it."""
        base = os.path.join(self.tier_config.root, self.fingerprint)
        os.makedirs(base, exist_ok=True)

        def write_identity(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump(self.identity, f, indent=1, sort_keys=True)

        write_atomically(os.path.join(base, "config.json"), write_identity)
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
                        unlink_quietly(e.path)
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
                    unlink_quietly(e.path)
                    self.stats.blocks_discarded += 1
                    continue
                found.append((e.stat().st_mtime_ns, bytes.fromhex(header["hash"]), size, header))
        found.sort(key=lambda x: x[0])
        for _, h, size, header in found:
            self.index.add(h, size)
            parent = bytes.fromhex(header["parent"]) if header.get("parent") else None
            self._gained(MEDIUM, h, parent, header.get("token_ids") or [])
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

    # -- quantised KV scales -------------------------------------------------------
    def _scales_path(self) -> str:
        return os.path.join(self.dir, "scales.json")

    def _read_scales(self) -> list[list[float]] | None:
        try:
            with open(self._scales_path()) as f:
                old = json.load(f)
        except (OSError, ValueError):
            return None
        ok = isinstance(old, list) and all(isinstance(p, list) and len(p) == 2 for p in old)
        return [[float(k), float(v)] for k, v in old] if ok else None

    def _init_scales(self) -> None:
        """At start: scales still to be calculated take the tier's (a warm restart); fixed scales that
        differ from the tier's purge its files."""
        old = self._read_scales()
        cur = self.scales.get()
        if cur == "pending":
            if old is not None and len(self.index):
                try:
                    self.scales.install(old)
                except ValueError as e:
                    logger.warning("KV tier: %s holds unusable KV cache scales (%s)", self._scales_path(), e)
                else:
                    logger.info("KV cache scales (%d layers): from the KV offloading tier %s (the scales its files "
                                "were written with, instead of calculating them from the first batch)",
                                len(old), self.dir)
                    self._scales, self._scales_ok = old, True
                    return
            if len(self.index):       # files with no usable scales file: they cannot be checked
                self._purge("the tier has no usable scales file for its quantised blocks")
            return
        self._adopt_scales(cur, old)

    def _adopt_scales(self, cur: list[list[float]], old: list[list[float]] | None) -> None:
        if old is not None and old != cur and len(self.index):
            self._purge("the KV cache scales differ from those of the tier's files")
        if old != cur:
            def write_scales(tmp: str) -> None:
                with open(tmp, "w") as f:
                    json.dump(cur, f)

            write_atomically(self._scales_path(), write_scales)
        self._scales, self._scales_ok = cur, True

    def _purge(self, why: str) -> None:
        n = len(self.index)
        logger.warning("KV tier: %s; discarding %d files", why, n)
        for h in list(self.index.entries):
            if self.index.remove(h):
                unlink_quietly(self.path_of(h))
                self.stats.blocks_discarded += 1
                self._lost(MEDIUM, h)

    def _scales_usable(self) -> bool:
        """For a quantised cache: the scales are known (after the first forward when calculated)."""
        if self._scales_ok:
            return True
        cur = self.scales.get()
        if cur == "pending":
            return False
        self._adopt_scales(cur, self._read_scales())
        return True

    # -- presence (what the scheduler side is told) ---------------------------------
    def _gained(self, medium: str, h: bytes, parent: bytes | None, tokens: list[int]) -> None:
        with self._lock:
            self._changes.append((medium, h, 1, parent, list(tokens)))
            if h not in self._present:
                self._present.add(h)
                self._changes.append((ANY, h, 1, parent, list(tokens)))

    def _lost(self, medium: str, h: bytes) -> None:
        with self._lock:
            self._changes.append((medium, h, -1, None, None))
            if h in self._present and h not in self.index and (self.host is None or h not in self.host):
                self._present.discard(h)
                self._changes.append((ANY, h, -1, None, None))

    def holds(self, h: bytes) -> bool:
        """This rank has block ``h`` in host memory or on disk."""
        return h in self.index or (self.host is not None and h in self.host)

    # -- orders from the scheduler side ---------------------------------------------
    def submit(self, meta: OffloadingMetadata) -> None:
        """Act on one step's orders: cancel, copy the saves out of the pool (first: a load may reuse
        those blocks), then start the loads."""
        for rid in meta.reqs_to_cancel:
            ev = self._cancel.get(rid)
            if ev is not None:
                ev.set()
        if meta.to_save:
            todo = [it for it in meta.to_save if it[1] not in self._pending_hashes and not self._saved(it[1])]
            for it in todo:
                self._pending_hashes.add(it[1])
            if todo:
                self._copy_out(todo)
        for rid, spec in meta.tier_loads.items():
            if rid in meta.reqs_to_cancel:
                with self._lock:
                    self._recv_failed.add(rid)
                continue
            ev = self._cancel.setdefault(rid, threading.Event())
            self.index.pin(spec.block_hashes)
            self._loads.submit(self._run_load, spec, ev)

    def _saved(self, h: bytes) -> bool:
        return h in self.index and (self.host is None or h in self.host)

    def poll(self) -> TierReport:
        """What changed since the last call (see :class:`TierReport`)."""
        with self._lock:
            rep = TierReport(changes=self._changes, finished=self._recv_done, failed=self._recv_failed,
                             busy=self._queued > 0, block_nbytes=self.block_nbytes)
            self._changes, self._recv_done, self._recv_failed = [], {}, set()
        for rid in list(rep.finished) + list(rep.failed):
            self._cancel.pop(rid, None)
        rep.stats = self.get_stats()
        return rep

    def get_stats(self) -> KVOffloadStats:
        """A snapshot of this rank's counters."""
        with self._lock:
            st = self.stats.copy()
        st.resident_blocks = len(self.index)
        st.resident_bytes = self.index.total
        st.writes_paused = time.monotonic() < self._paused_until
        if self.host is not None:
            st.host_resident_blocks = len(self.host)
            st.host_resident_bytes = len(self.host) * self.host.block_nbytes
        return st

    # -- saving ----------------------------------------------------------------
    def _copy_out(self, items: list[tuple[int, bytes, bytes | None, list[int]]]) -> None:
        """Gather the blocks into one host tensor ``[num_layers, 2, n, block_size, kv_heads, head_dim * el]``,
        put them in host memory and queue them for the writer (dropped, and counted, when the writer is
        behind or paused)."""
        t0 = time.perf_counter()
        if not self._scales_usable():          # (calculated scales: known after the first forward)
            for _, h, _, _ in items:
                self._pending_hashes.discard(h)
            self.stats.saves_dropped += len(items)
            return
        dev = self.device
        idx = torch.tensor([b for b, _, _, _ in items], dtype=torch.long, device=dev)
        # one gather per layer, as bytes (exact for every KV dtype; fp8 has no index_select) into
        # [L, 2, n, bs, H, D * element size]; the writer makes each block contiguous off the loop
        # (a permuted .contiguous() here cost ~50-100x more: docs/benchmarks/kv_offload_2026-12-01.md)
        buf = torch.empty((self.block_shape[0], 2, len(items), *self.byte_shape[2:]), dtype=torch.uint8, device=dev)
        for layer, kv in enumerate(self.kv_caches):
            torch.index_select(kv.view(torch.uint8), 1, idx, out=buf[layer])
        host = buf.cpu()
        if self.host is not None:
            for j, (_, h, parent, tokens) in enumerate(items):
                stored, evicted = self.host.put(h, host[:, :, j], parent, tokens)
                for old in evicted:
                    with self._lock:
                        self.stats.host_blocks_evicted += 1
                    self._lost(HOST_MEDIUM, old)
                if stored:
                    with self._lock:
                        self.stats.host_blocks_stored += 1
                    self._gained(HOST_MEDIUM, h, parent, tokens)
        paused = time.monotonic() < self._paused_until
        for j, (_, h, parent, tokens) in enumerate(items):
            if paused or h in self.index:
                self._pending_hashes.discard(h)
                self.stats.saves_dropped += paused
                continue
            try:
                with self._lock:
                    self._queued += 1
                self._writes.put_nowait((h, parent, tokens, (host, j)))
            except queue.Full:
                with self._lock:
                    self._queued -= 1
                self._pending_hashes.discard(h)
                self.stats.saves_dropped += 1
        self.stats.copy_seconds += time.perf_counter() - t0

    # -- loading ---------------------------------------------------------------
    def _run_load(self, spec: TierLoadSpec, cancel: threading.Event) -> None:
        t0 = time.perf_counter()
        held: list[bytes] = []            # host-memory slots this load copies from
        from_host = 0
        try:
            blocks = []
            for h in spec.block_hashes:
                if cancel.is_set():
                    raise TierFileError("cancelled")
                slot = self.host.acquire(h) if self.host is not None else None
                if slot is not None:
                    held.append(h)
                    blocks.append(slot)
                    from_host += 1
                else:
                    blocks.append(self._read_block(h))
            dev = self.device
            pool = [kv.view(torch.uint8) for kv in self.kv_caches]   # as bytes: exact for every KV dtype
            stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                # block by block, layer by layer (index_copy_ along the block dim was ~50x slower on CPU)
                for bid, blk in zip(spec.block_ids, blocks):
                    blk = blk.to(dev, non_blocking=True)
                    for layer, kv in enumerate(pool):
                        kv[:, bid].copy_(blk[layer], non_blocking=True)
            if stream is not None:
                stream.synchronize()          # the K/V is in place before the request is admitted
            if cancel.is_set():
                raise TierFileError("cancelled")
        except Exception as e:  # noqa: BLE001 - any failure means: recompute the prompt
            if not cancel.is_set():
                logger.warning("KV tier load for request %s failed (%s: %s); it recomputes its prompt",
                               spec.req_id, type(e).__name__, e)
            self.index.unpin(spec.block_hashes)
            for h in held:
                self.host.release(h)
            with self._lock:
                self._recv_failed.add(spec.req_id)
                self.stats.num_failed_loads += not cancel.is_set()
                self._load_ended.set()
            return
        for h in held:
            self.host.release(h)
        dt = time.perf_counter() - t0
        self.index.touch(spec.block_hashes)
        for h in spec.block_hashes:         # the LRU order a restart reads back (file modification times)
            if h in self.index:
                try:
                    os.utime(self.path_of(h))
                except OSError:
                    pass
        self.index.unpin(spec.block_hashes)
        with self._lock:
            self._recv_done[spec.req_id] = dt
            st = self.stats
            st.bytes_loaded += len(spec.block_hashes) * self.block_nbytes
            st.host_blocks_loaded += from_host
            self._load_ended.set()

    def wait_for_load(self, timeout: float) -> bool:
        """Block until a load has ended (done or failed) and is not yet polled, at most ``timeout`` s.
        True if one has."""
        with self._lock:
            if self._recv_done or self._recv_failed:
                return True
            self._load_ended.clear()
        return self._load_ended.wait(timeout)

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
            if self.index.remove(h):
                self._lost(MEDIUM, h)
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
                self._lost(MEDIUM, h)
            unlink_quietly(path)
            with self._lock:
                self.stats.blocks_discarded += 1
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
                        self.stats.saves_dropped += 1
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
        t0 = time.perf_counter()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_atomically(path, lambda tmp: self._write_file(tmp, head, memoryview(payload)))
        except OSError as e:       # the partial file is gone already
            self._paused_until = time.monotonic() + self.tier_config.write_retry_s
            with self._lock:
                self.stats.write_errors += 1
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            logger.warning("KV tier: %s writing %s (%s); writes paused for %.0f s, serving continues",
                           "disk full" if full else "error", path, e, self.tier_config.write_retry_s)
            return
        self.index.add(h, size)
        with self._lock:
            st = self.stats
            st.blocks_stored += 1
            st.bytes_stored += size
            st.store_seconds += time.perf_counter() - t0
        self._gained(MEDIUM, h, parent, tokens)

    @staticmethod
    def _write_file(path: str, head: bytes, payload: memoryview) -> None:
        """Write header and payload to ``path`` (raises OSError, e.g. ENOSPC on a full disk)."""
        with open(path, "wb") as f:
            f.write(head)
            f.write(payload)

    def _delete(self, h: bytes, evicted: bool) -> None:
        self.index.remove(h)
        unlink_quietly(self.path_of(h))
        with self._lock:
            if evicted:
                self.stats.blocks_evicted += 1
        self._lost(MEDIUM, h)

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
        """Finish the queued writes, stop the threads, unlock the directory (idempotent)."""
        if self._closed:
            return
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


# -- the ranks the scheduler side drives -------------------------------------------------------
class LocalTierRanks:
    """The tier's ranks as :class:`TierStore` objects in this process (one rank per engine; tests may
    pass several stores to exercise the multi-rank bookkeeping without processes)."""

    def __init__(self, stores: list[TierStore]) -> None:
        self.stores = list(stores)
        self.world_size = len(self.stores)
        self.local = True

    def call(self, meta: OffloadingMetadata | None) -> list[TierReport]:
        """Hand every rank ``meta`` (when given) and return their reports."""
        if meta is not None:
            for s in self.stores:
                s.submit(meta)
        return [s.poll() for s in self.stores]

    def flush(self, timeout: float) -> bool:
        return all(s.flush(timeout) for s in self.stores)

    def close(self) -> None:
        for s in self.stores:
            s.shutdown()


class ExecutorTierRanks:
    """The tier's ranks in the workers of a tensor/pipeline-parallel executor (``mp`` or ``ray``): every
    call is one round trip to all workers (:meth:`kv_tier_call` of the executor, answered by
    :func:`worker_tier_call` on each rank).

    Args:
        executor: an executor with ``kv_tier_call(message) -> [reply per rank]`` and ``world_size``.
        config: the tier's settings; ``capacity_bytes`` (and ``host_capacity_bytes``) is the total, split
            over the ranks in proportion to the bytes of their shard of a block.
        block_size: tokens per block.
        identity: the configuration (each rank adds its place and shard).

    Raises:
        ValueError: the executor cannot drive a tier (no ``kv_tier_call``).
        RuntimeError / OSError: a rank failed to open its directory.
    """

    def __init__(self, executor: Any, config: OffloadingConfig, block_size: int, identity: dict[str, Any]) -> None:
        call = getattr(executor, "kv_tier_call", None)
        if call is None:
            raise ValueError(f"--kv-offloading-backend is not supported with the {type(executor).__name__} executor")
        self._call = call
        self.world_size = int(executor.world_size)
        self.local = False
        sizes = [int(n) for n in self._call(("geometry", block_size))]
        total = sum(sizes)
        self.initial: list[TierReport] = []
        configs = []
        for n in sizes:
            share = n / total
            configs.append({**config.__dict__, "capacity_bytes": max(1, int(config.capacity_bytes * share)),
                            "host_capacity_bytes": int(config.host_capacity_bytes * share)})
        self.initial = self._call(("init", configs, block_size, identity))
        self.stores: list[TierStore] = []

    def call(self, meta: OffloadingMetadata | None) -> list[TierReport]:
        return self._call(("call", meta))

    def flush(self, timeout: float) -> bool:
        return all(self._call(("flush", timeout)))

    def close(self) -> None:
        try:
            self._call(("close",))
        except Exception as e:  # noqa: BLE001 - a dead worker: nothing left to close
            logger.warning("KV tier: closing the ranks' tiers failed (%s)", e)


def worker_tier_call(store: TierStore | None, runner: Any, layout: Any, msg: tuple) -> tuple[TierStore | None, Any]:
    """One :class:`ExecutorTierRanks` message on a worker rank (runs in the worker's step thread).

    Args:
        store: the rank's store (None before ``init``).
        runner: the rank's :class:`~tokenmill.model.runner.ModelRunner` (its ``kv_caches``).
        layout: the rank's :class:`~tokenmill.distributed.layout.RankLayout`.
        msg: ``("geometry", block_size)`` → bytes of the rank's shard of a block;
            ``("init", [config dict per rank], block_size, identity)`` → the new store's first report;
            ``("call", metadata or None)`` → its report; ``("flush", timeout)`` → bool; ``("close",)`` → None.

    Returns:
        ``(store, reply)``.

    Raises:
        ValueError: an unknown message, or one before ``init``.
    """
    kind = msg[0]
    if kind == "geometry":
        kv = runner.kv_caches[0]
        return store, len(runner.kv_caches) * 2 * msg[1] * int(kv.shape[3]) * int(kv.shape[4]) * kv.element_size()
    if kind == "init":
        _, configs, block_size, identity = msg
        if store is not None:
            store.shutdown()
        rank_identity = {**identity, "tp": [layout.tp_rank, layout.tp_size], "pp": [layout.pp_rank, layout.pp_size],
                         "layers": list(layout.layers), "kv_heads": list(layout.kv_heads)}
        store = TierStore(OffloadingConfig(**configs[layout.rank]), block_size, runner.kv_caches, rank_identity,
                          kv_scales_of(runner))
        return store, store.poll()
    if store is None:
        raise ValueError(f"KV tier message {kind!r} before init")
    if kind == "call":
        if msg[1] is not None:
            store.submit(msg[1])
        return store, store.poll()
    if kind == "flush":
        return store, store.flush(msg[1])
    if kind == "close":
        store.shutdown()
        return None, None
    raise ValueError(f"unknown KV tier message {kind!r}")


# -- the scheduler side -----------------------------------------------------------------------
class OffloadingConnector(KVConnectorBase):
    """The tier as a KV connector: the scheduler side in the engine core, over one or more ranks' stores.

    Args:
        config: the tier's settings (``capacity_bytes``: the whole tier's).
        block_size: tokens per block.
        ranks: :class:`LocalTierRanks` or :class:`ExecutorTierRanks`.
        data_parallel_rank: this engine core's rank (the engine id).

    Attributes:
        stores: the in-process stores (empty when the ranks are worker processes).
        dir: the first in-process store's directory (None otherwise).
    """

    #: copies blocks out of the pool in :meth:`start_load_kv`: a :class:`~.multi.MultiConnector` runs
    #: it before connectors that load into fresh (possibly just evicted) blocks.
    saves_from_pool = True

    def __init__(self, config: OffloadingConfig, block_size: int, ranks: Any, data_parallel_rank: int = 0) -> None:
        self.tier_config = config
        self.block_size = block_size
        self.engine_id = f"offload-dp{data_parallel_rank}"
        self.stats = KVTransferStats()          # the P/D counters stay zero: tier figures are in get_tier_stats
        self.tier_stats = KVOffloadStats(capacity_bytes=config.capacity_bytes)   # the scheduler side's counters
        self.ranks = ranks
        self.world_size = ranks.world_size
        self.stores = list(getattr(ranks, "stores", []))
        self.dir = self.stores[0].dir if self.stores else None
        self._counts: dict[str, dict[bytes, int]] = {ANY: {}, MEDIUM: {}, HOST_MEDIUM: {}}
        self._rank_stats: list[KVOffloadStats | None] = [None] * self.world_size
        self._busy = False
        self._events: list[Any] = []
        self._meta = OffloadingMetadata()
        self._inflight: dict[str, dict[str, Any]] = {}    # req id -> {"pending": ranks, "failed", "n", "secs"}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._step_saves: set[bytes] = set()             # saves ordered in this step's metadata
        self._pool_meta: dict[int, tuple[bytes, bytes | None, list[int]]] = {}  # evict policy
        self._closed = False
        self.kv_cache_manager: Any = None
        initial = getattr(ranks, "initial", None)
        self._absorb(initial if initial is not None else ranks.call(None))

    @property
    def index(self) -> _Index:
        """The single in-process store's file index (one rank; tests)."""
        return self.stores[0].index

    # -- rank reports ------------------------------------------------------------
    def _absorb(self, reports: list[TierReport]) -> None:
        """Fold the ranks' reports into the presence counts, the loads' state and the events."""
        from tokenmill.core.kv_events import BlockRemoved, BlockStored

        if not reports:
            return
        w = self.world_size
        self._busy = False
        for r, rep in enumerate(reports):
            self._busy |= rep.busy
            if rep.stats is not None:
                self._rank_stats[r] = rep.stats
            for medium, h, d, parent, tokens in rep.changes:
                counts = self._counts[medium]
                before = counts.get(h, 0)
                after = before + d
                if after <= 0:
                    counts.pop(h, None)
                else:
                    counts[h] = after
                if medium == ANY:
                    continue
                if before < w <= after:
                    self._events.append(BlockStored(block_hashes=[h], parent_block_hash=parent,
                                                    token_ids=list(tokens or []), block_size=self.block_size,
                                                    medium=medium))
                elif after < w <= before:
                    self._events.append(BlockRemoved(block_hashes=[h], medium=medium))
            for rid, secs in rep.finished.items():
                self._rank_done(rid, r, ok=True, secs=secs)
            for rid in rep.failed:
                self._rank_done(rid, r, ok=False, secs=0.0)

    def _rank_done(self, rid: str, rank: int, ok: bool, secs: float) -> None:
        st = self._inflight.get(rid)
        if st is None or rank not in st["pending"]:
            return
        st["pending"].discard(rank)
        st["secs"] = max(st["secs"], secs)
        if not ok and not st["failed"]:
            st["failed"] = True
            if st["pending"]:                 # stop the other ranks' parts; wait until they stopped writing
                self._meta.reqs_to_cancel.add(rid)
        if st["pending"]:
            return
        del self._inflight[rid]
        if st["failed"]:
            self._recv_failed.add(rid)
            self.tier_stats.num_failed_loads += not st["aborted"]
            return
        self._recv_done.add(rid)
        t = self.tier_stats
        t.num_loads += 1
        t.hits += st["n"] * self.block_size
        t.blocks_loaded += st["n"]
        t.load_seconds += st["secs"]
        t.recent_load_times.append(st["secs"])
        if len(t.recent_load_times) > _RECENT:
            del t.recent_load_times[: len(t.recent_load_times) - _RECENT]

    def _poll(self) -> None:
        self._absorb(self.ranks.call(None))

    def _run_length(self, hashes: list[bytes]) -> int:
        counts, w, n = self._counts[ANY], self.world_size, 0
        for h in hashes:
            if counts.get(h, 0) < w:
                break
            n += 1
        return n

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
        # (each rank skips a block it holds or is writing already: a rank that dropped it saves it again)
        if self._closed or h in self._step_saves or self._counts[ANY].get(h, 0) >= self.world_size:
            return
        self._step_saves.add(h)
        self._meta.to_save.append((block_id, h, parent, list(tokens)))

    # -- scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.sampling_params.prompt_logprobs is not None:
            return 0, False
        if self.ranks.local:
            self._poll()              # in-process: cheap, and the writer may have finished blocks since
        bs = self.block_size
        first = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs        # the last token is always computed
        if not getattr(request, "_tier_queried", False) and request.num_preemptions == 0:
            request._tier_queried = True     # count each request once (vLLM: external_prefix_cache_queries)
            self.tier_stats.queries += request.num_tokens
        n = self._run_length(request.block_hashes[first:last])
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
        rid = request.request_id
        self._meta.tier_loads[rid] = TierLoadSpec(rid, list(block_ids[first:first + n]), hashes)
        self._inflight[rid] = {"pending": set(range(self.world_size)), "failed": False, "aborted": False,
                               "n": n, "secs": 0.0}

    def build_connector_meta(self) -> OffloadingMetadata:
        meta, self._meta = self._meta, OffloadingMetadata()
        self._step_saves = set()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_aborted_while_loading(self, request: Request) -> None:
        rid = request.request_id
        st = self._inflight.get(rid)
        if st is None:
            return
        st["aborted"] = True
        if self._meta.tier_loads.pop(rid, None) is not None:      # never sent to the ranks
            del self._inflight[rid]
            self._recv_failed.add(rid)
            return
        st["failed"] = True
        self._meta.reqs_to_cancel.add(rid)

    # -- worker side -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The ranks' stores hold their own pools (given when they were built)."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Hand this step's orders to every rank (each copies its saves out first, then starts its loads)."""
        if not isinstance(metadata, OffloadingMetadata) or metadata.is_empty:
            return
        self._absorb(self.ranks.call(metadata))

    def wait_for_save(self) -> None:
        """Writes are asynchronous (the writer threads); nothing to wait for in the step."""

    def loads_in_flight(self) -> bool:
        """True while a request waits for its tier load."""
        return bool(self._inflight)

    def wait_for_loads(self, timeout: float) -> bool:
        """With the ranks in this process: block until a rank's load ended, at most ``timeout`` s (the
        engine calls it on a step with nothing else to run, so a loaded request is admitted on the next
        step instead of after the loop's idle wait). True if one ended; False at once with worker ranks
        (their reports come with the next call) or nothing in flight."""
        if not self.ranks.local or not self._inflight:
            return False
        return any(s.wait_for_load(timeout) for s in self.ranks.stores)

    def get_finished(self) -> KVConnectorOutput:
        """Loads that ended on every rank; also hands the tier's KV events to the pool's event list."""
        if self.ranks.local or self._inflight or self._busy:
            self._poll()
        out = KVConnectorOutput(finished_recving=self._recv_done, failed_recving=self._recv_failed)
        self._recv_done, self._recv_failed = set(), set()
        events, self._events = self._events, []
        pool = self.kv_cache_manager.block_pool if self.kv_cache_manager is not None else None
        if events and pool is not None and pool.kv_events is not None:
            pool.kv_events.extend(events)
        return out

    def get_tier_stats(self) -> KVOffloadStats:
        """The tier's counters: requests, tokens and loads as the scheduler saw them; per-rank block counts
        as the largest rank's (every rank holds a shard of each block), bytes and seconds summed."""
        if self.ranks.local:
            self._poll()
        st = self.tier_stats.copy()
        ranks = [s for s in self._rank_stats if s is not None]
        for name in _RANK_BLOCK_FIELDS:
            setattr(st, name, max((getattr(s, name) for s in ranks), default=0))
        for name in _RANK_SUM_FIELDS:
            setattr(st, name, sum(getattr(s, name) for s in ranks))
        if not ranks:
            st.capacity_bytes = self.tier_config.capacity_bytes
        st.num_failed_loads = self.tier_stats.num_failed_loads
        st.writes_paused = any(s.writes_paused for s in ranks)
        w = self.world_size
        st.resident_blocks = sum(1 for c in self._counts[MEDIUM].values() if c >= w)
        st.host_resident_blocks = sum(1 for c in self._counts[HOST_MEDIUM].values() if c >= w)
        return st

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every rank's queued writes are on disk, then take their reports (tests, benchmarks,
        shutdown). True if they drained."""
        ok = self.ranks.flush(timeout)
        self._poll()
        return ok

    def shutdown(self) -> None:
        """Save the pool's resident blocks (evict policy), finish the queued writes, stop the ranks' threads."""
        if self._closed:
            return
        try:
            if self.tier_config.store_policy == "evict" and self.kv_cache_manager is not None:
                pool = self.kv_cache_manager.block_pool
                for b in list(pool.cached_blocks.values()):
                    meta = self._pool_meta.get(b.block_id)
                    if meta is not None and meta[0] == b.block_hash:
                        self._queue_save(b.block_id, *meta)
                items, self._meta.to_save = self._meta.to_save, []
                for i in range(0, len(items), 64):
                    self._absorb(self.ranks.call(OffloadingMetadata(to_save=items[i:i + 64])))
                    self.ranks.flush(10.0)
        finally:
            self._closed = True
            self.ranks.close()


def default_offloading_dir() -> str:
    """``$TOKENMILL_CACHE_DIR/kv_offload`` or ``~/.cache/tokenmill/kv_offload`` (beside the weight cache)."""
    root = envs.TOKENMILL_CACHE_DIR
    return os.path.join(root, "kv_offload")


def host_tier_bytes(requested_gib: float | None, total_gib: float, kv_device: str) -> int:
    """Bytes of the host-memory tier: ``--kv-offloading-host-size`` when given; else, with the pool on a GPU,
    ``--kv-offloading-size`` (vLLM's meaning of that flag: the CPU buffer) capped at half the memory the
    host has available now; on a CPU none (the pool is host memory already)."""
    if requested_gib is not None:
        return int(requested_gib * 2**30)
    if kv_device != "cuda":
        return 0
    want = int(total_gib * 2**30)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return want
    if want > avail // 2:
        logger.warning("KV offloading: host-memory tier capped at %.1f GiB (half the available memory), not %.1f",
                       avail / 2 / 2**30, total_gib)
    return min(want, avail // 2)


def create_offloading_connector(engine_config: Any, executor: Any, data_parallel_rank: int = 0,
                                **overrides: Any) -> OffloadingConnector:
    """The tier ``--kv-offloading-*`` asks for, over ``executor``'s KV pool (in this process: the uniproc
    executor) or its ranks' pools (the ``mp`` / ``ray`` executors: one store per worker).

    Args:
        engine_config: the :class:`~tokenmill.config.EngineConfig`.
        executor: the model runner, or a distributed executor with ``kv_tier_call``.
        data_parallel_rank: this engine core's rank.
        overrides: :class:`OffloadingConfig` fields (``store_policy``, ``min_load_blocks``, ...).

    Raises:
        ValueError: the executor can drive no tier.
        OSError: the directory cannot be created or a checkpoint file stat-ed.
    """
    cache = engine_config.cache
    if envs.TOKENMILL_KV_OFFLOAD_MIN_LOAD_BLOCKS is not None:
        overrides.setdefault("min_load_blocks", envs.TOKENMILL_KV_OFFLOAD_MIN_LOAD_BLOCKS)
    model = engine_config.model.model
    if model is None:
        from tokenmill.model.default_model import default_model_path

        model = default_model_path()
    identity = {"tokenmill": _version(), "model": model_identity(model),
                "model_dtype": str(getattr(executor, "dtype", "") or engine_config.model.dtype).replace("torch.", ""),
                "quantization": engine_config.model.quantization, "tp": [0, 1], "pp": [0, 1]}
    kv_caches = getattr(executor, "kv_caches", None)
    kv_device = kv_caches[0].device.type if kv_caches is not None else _executor_device(engine_config)
    host = host_tier_bytes(getattr(cache, "kv_offloading_host_size", None), cache.kv_offloading_size, kv_device)
    cfg = OffloadingConfig(root=cache.kv_offloading_dir or default_offloading_dir(),
                           capacity_bytes=int(cache.kv_offloading_size * 2**30),
                           data_parallel_rank=data_parallel_rank, host_capacity_bytes=host, **overrides)
    if kv_caches is not None:
        ranks: Any = LocalTierRanks([TierStore(cfg, cache.block_size, kv_caches, identity,
                                                  kv_scales_of(getattr(executor, "runner", executor)))])
    else:
        # the workers' model dtype: their shards load dense weights in the configured dtype
        identity["model_dtype"] = str(engine_config.model.dtype)
        ranks = ExecutorTierRanks(executor, cfg, cache.block_size, identity)
    return OffloadingConnector(cfg, cache.block_size, ranks, data_parallel_rank)


def _executor_device(engine_config: Any) -> str:
    from tokenmill.model.runner import resolve_device

    return resolve_device(engine_config.model.device).type


def _version() -> str:
    return tokenmill.__version__
