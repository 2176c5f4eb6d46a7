"""KV-transfer counters (prefill-decode disaggregation), cumulative since start; plain data for EngineStats."""

from __future__ import annotations

from dataclasses import dataclass, field

# Most recent transfer durations kept for the exporter's histogram.
MAX_RECENT_TRANSFERS = 1024


@dataclass
class KVTransferStats:
    """What the KV connector moved, and what it cost.

    Attributes:
        bytes_sent: KV bytes a producer served to consumers.
        bytes_received: KV bytes a consumer loaded.
        num_transfers: completed loads (consumer side).
        num_failed: loads that failed or timed out (each falls back to recomputing the prompt).
        num_recomputed: requests whose prompt was recomputed because their remote KV could not be loaded.
        num_expired: producer-side holds that ended by timeout (no consumer pulled the KV).
        num_released: producer-side holds ended early by a release (``POST /kv_transfer/release``: the
            router saw the decode leg fail, so no consumer will pull the KV).
        recent_times: durations of the last :data:`MAX_RECENT_TRANSFERS` completed loads (s), oldest first;
            the ``len(recent_times)`` most recent of ``num_transfers``.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    num_transfers: int = 0
    num_failed: int = 0
    num_recomputed: int = 0
    num_expired: int = 0
    num_released: int = 0
    recent_times: list[float] = field(default_factory=list)

    def observe_transfer(self, seconds: float, nbytes: int) -> None:
        """Record one completed load of ``nbytes`` bytes that took ``seconds``."""
        self.num_transfers += 1
        self.bytes_received += nbytes
        self.recent_times.append(seconds)
        if len(self.recent_times) > MAX_RECENT_TRANSFERS:
            del self.recent_times[: len(self.recent_times) - MAX_RECENT_TRANSFERS]

    def copy(self) -> "KVTransferStats":
        return KVTransferStats(self.bytes_sent, self.bytes_received, self.num_transfers, self.num_failed,
                               self.num_recomputed, self.num_expired, self.num_released, list(self.recent_times))
