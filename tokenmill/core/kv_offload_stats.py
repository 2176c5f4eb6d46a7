"""KV offloading tier counters (``--kv-offloading-backend``), cumulative since start; plain data for EngineStats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVOffloadStats:
    """What the second KV tier (blocks on disk) holds, stored, loaded, and refused.

    Token counts follow vLLM's ``external_prefix_cache_queries`` / ``external_prefix_cache_hits``:
    a request looked up in the tier counts its prompt tokens once as queries; the tokens loaded
    from the tier count as hits.

    Attributes:
        medium: the files' name in KV events (``"DISK"``; the host-memory tier's is ``"CPU"``).
        queries: prompt tokens of requests looked up in the tier (first admission only), in tokens.
        hits: of those, tokens whose K/V was loaded from the tier, in tokens.
        num_loads: completed loads (one per request).
        num_failed_loads: loads that failed (a file missing, corrupt or from another configuration);
            each request recomputed its prompt.
        num_skipped_short: lookups whose tier hit was shorter than ``min_load_blocks`` (recomputed:
            loading would be slower).
        blocks_stored, bytes_stored: blocks (files) written to the tier and their bytes.
        blocks_loaded, bytes_loaded: blocks read back into the pool and their bytes.
        store_seconds: time spent writing files (writer thread), s.
        load_seconds: time spent loading (load threads: read, verify, copy into the pool), s.
        copy_seconds: time the engine loop spent copying blocks out of the pool for the writer, s.
        blocks_evicted: files removed to stay within ``--kv-offloading-size`` (LRU).
        blocks_discarded: files dropped because they were corrupt or belonged to another configuration.
        saves_dropped: blocks not written (writer queue full, or writes paused).
        write_errors: writes that failed (e.g. a full disk); writes pause after one.
        writes_paused: writes are paused now (after a write error; retried later).
        resident_blocks, resident_bytes: what the tier holds now.
        capacity_bytes: ``--kv-offloading-size`` in bytes.
        host_blocks_stored, host_blocks_evicted: blocks put into / dropped from the host-memory tier
            (``--kv-offloading-host-size``; the files keep them).
        host_blocks_loaded: of ``blocks_loaded``, those read from host memory instead of a file.
        host_resident_blocks, host_resident_bytes, host_capacity_bytes: what the host-memory tier holds
            now, and its size (0 without one).

    With tensor/pipeline parallelism every rank keeps its shard of each block: request, token and load
    counts are the scheduler's; per-rank block counts (stored, evicted, discarded, dropped, write errors,
    host) are the largest rank's; bytes and seconds are summed over the ranks.
    """

    medium: str = "DISK"
    queries: int = 0
    hits: int = 0
    num_loads: int = 0
    num_failed_loads: int = 0
    num_skipped_short: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    copy_seconds: float = 0.0
    blocks_evicted: int = 0
    blocks_discarded: int = 0
    saves_dropped: int = 0
    write_errors: int = 0
    writes_paused: bool = False
    resident_blocks: int = 0
    resident_bytes: int = 0
    capacity_bytes: int = 0
    host_blocks_stored: int = 0
    host_blocks_evicted: int = 0
    host_blocks_loaded: int = 0
    host_resident_blocks: int = 0
    host_resident_bytes: int = 0
    host_capacity_bytes: int = 0
    recent_load_times: list[float] = field(default_factory=list)

    def copy(self) -> "KVOffloadStats":
        """A snapshot (the lists copied)."""
        import dataclasses

        out = dataclasses.replace(self)
        out.recent_load_times = list(self.recent_load_times)
        return out
