""":class:`MultiConnector`: several KV connectors behind the scheduler's one (vLLM's ``MultiConnector``).

Used when prefill-decode disaggregation (``--kv-transfer-config``) and the offloading tier
(``--kv-offloading-backend``) run together. The scheduler side asks the connectors in order; the
first that can load a request's tokens owns that request's load (the others never see it). Every
connector sees every finish (a producer may keep the blocks; the tier keeps nothing). The worker
side runs each connector on its own part of the step's metadata — connectors that copy blocks out of
the pool (``saves_from_pool``) first, since another connector's load may write into a block that was
evicted (and must be saved) in the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.request import Request
from tokenmill.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    """One metadata per connector, in the connectors' order."""

    parts: list[Any] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return all(p is None or p.is_empty for p in self.parts)


class MultiConnector(KVConnectorBase):
    """Route the connector interface to ``connectors`` (lookup order = list order).

    Args:
        connectors: at least one; e.g. ``[TcpConnector, OffloadingConnector]`` so that a request
            whose KV another engine computed pulls it from there, and other requests use the tier.

    Raises:
        ValueError: no connector given.
    """

    def __init__(self, connectors: list[KVConnectorBase]) -> None:
        if not connectors:
            raise ValueError("MultiConnector needs at least one connector")
        self.connectors = list(connectors)
        first = self.connectors[0]
        self.config = getattr(first, "config", None)
        self.block_size = first.block_size
        self.engine_id = first.engine_id
        self.stats = first.stats
        self._owner: dict[str, KVConnectorBase] = {}

    # -- scheduler side ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        for c in self.connectors:
            n, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n > 0:
                self._owner[request.request_id] = c
                return n, load_async
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        c = self._owner.get(request.request_id)
        if c is not None:
            c.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self) -> MultiConnectorMetadata:
        return MultiConnectorMetadata(parts=[c.build_connector_meta() for c in self.connectors])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._owner.pop(request.request_id, None)
        delay, params = False, None
        for c in self.connectors:
            d, p = c.request_finished(request, block_ids)
            delay = delay or d
            params = params if params is not None else p
        return delay, params

    def request_aborted_while_loading(self, request: Request) -> None:
        c = self._owner.pop(request.request_id, None)
        if c is not None:
            c.request_aborted_while_loading(request)

    def release(self, req_id: str, engine_id: str | None = None) -> bool:
        return any(c.release(req_id, engine_id) for c in self.connectors)

    # -- worker side ---------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, MultiConnectorMetadata):
            return
        pairs = list(zip(self.connectors, metadata.parts))
        pairs.sort(key=lambda cp: not getattr(cp[0], "saves_from_pool", False))   # stable: savers first
        for c, part in pairs:
            if part is not None:
                c.start_load_kv(part)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for c in self.connectors:
            o = c.get_finished()
            out.finished_sending |= o.finished_sending
            out.finished_recving |= o.finished_recving
            out.failed_recving |= o.failed_recving
        for rid in out.finished_recving | out.failed_recving:
            self._owner.pop(rid, None)
        return out

    def bind_kv_cache_manager(self, manager: Any) -> None:
        """Pass the scheduler's KV cache manager to the connectors that want it."""
        for c in self.connectors:
            bind = getattr(c, "bind_kv_cache_manager", None)
            if bind is not None:
                bind(manager)

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()
