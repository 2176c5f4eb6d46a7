"""The KV connector interface, and the shared machinery of tokenmill's pull-based connectors.

A KV connector moves a request's KV blocks between engines, so that one pool of servers computes
prompts (prefill) and another generates (decode): DistServe (Zhong et al., arXiv 2401.09670, §3) and
Splitwise (Patel et al., arXiv 2311.18677, §4). The interface has the shape of vLLM's
``KVConnectorBase_V1``: a *scheduler side*, called by :class:`tokenmill.core.scheduler.Scheduler`
while it plans a step, and a *worker side*, called around the model step where the KV tensors live.
In tokenmill one connector object plays both sides inside the engine core process (the core owns the
scheduler and, with the uniproc executor, the model runner's KV pool).

Scheduler side:

* :meth:`KVConnectorBase.get_num_new_matched_tokens` — how many of a waiting request's tokens,
  after its local prefix-cache hit, can be loaded from elsewhere, and whether the load is
  asynchronous (the request then waits in ``WAITING_FOR_REMOTE_KVS`` and does not hold the step).
* :meth:`KVConnectorBase.update_state_after_alloc` — the local blocks the load must fill.
* :meth:`KVConnectorBase.build_connector_meta` — this step's orders for the worker side
  (:class:`KVConnectorMetadata`: loads to start, KV to keep for consumers, loads to cancel).
* :meth:`KVConnectorBase.request_finished` — a request ended: keep (delay freeing) its blocks for a
  consumer? and the ``kv_transfer_params`` to return to the client.

Worker side:

* :meth:`KVConnectorBase.register_kv_caches` — the per-layer KV tensors.
* :meth:`KVConnectorBase.start_load_kv` — act on the step's metadata (start loads, publish KV).
* :meth:`KVConnectorBase.wait_for_layer_load` / :meth:`KVConnectorBase.save_kv_layer` — per-layer
  hooks for connectors that load or save inside the forward pass. Both connectors here load
  asynchronously (whole requests, layer by layer, outside the step) and publish KV that is already in
  the pool, so for them these are no-ops and the runner does not call them.
* :meth:`KVConnectorBase.wait_for_save` — finish this step's saves.
* :meth:`KVConnectorBase.get_finished` — requests whose KV finished sending (their blocks may be
  freed) and whose loads finished or failed.

:class:`PullConnector` implements everything but the transport: a consumer's loads run on a thread
pool (the step loop never waits for one), a producer keeps a finished request's blocks until the
consumer has pulled them or ``abort_timeout_s`` passed. Subclasses provide ``_publish`` (make a
request's blocks available), ``_load`` (fetch them into local blocks) and their clean-up.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import KVTransferConfig
from tokenmill.core.kv_transfer_stats import KVTransferStats
from tokenmill.core.request import Request
from tokenmill.kv_transfer.params import wants_remote_decode, wants_remote_prefill

logger = logging.getLogger(__name__)

DEFAULT_ABORT_TIMEOUT_S = 120.0      # a producer keeps unclaimed KV this long (vLLM's NIXL default is 480 s)
DEFAULT_TRANSFER_TIMEOUT_S = 30.0    # a consumer gives up on one load after this long (then recomputes)


class KVTransferError(RuntimeError):
    """A load failed: the peer is gone, refused the request, timed out, or its KV has another geometry."""


@dataclass
class LoadSpec:
    """One load a consumer must do.

    Attributes:
        req_id: the local request id.
        local_block_ids: local blocks to fill, in order (they hold the prompt tokens after the local hit).
        remote_block_ids: the producer's blocks holding the same tokens, same order and length.
        params: the request's ``kv_transfer_params`` (where the KV is).
        num_tokens: tokens of K/V the load brings.
    """

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    params: dict[str, Any]
    num_tokens: int


@dataclass
class KVConnectorMetadata:
    """The scheduler side's orders for one step (plain data).

    Attributes:
        reqs_to_load: loads to start.
        reqs_to_send: finished requests whose blocks (ids, ``[num_blocks]``) must be published.
        reqs_to_cancel: requests whose running loads must stop (aborted).
    """

    reqs_to_load: dict[str, LoadSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)
    reqs_to_cancel: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.reqs_to_load or self.reqs_to_send or self.reqs_to_cancel)


@dataclass
class KVConnectorOutput:
    """What finished since the last :meth:`KVConnectorBase.get_finished` call.

    Attributes:
        finished_sending: requests whose held blocks may now be freed (pulled, or expired).
        finished_recving: requests whose loads completed (their K/V is in place).
        failed_recving: requests whose loads failed or were cancelled (their blocks hold garbage).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class KVConnectorBase(ABC):
    """A KV transport between engines (see the module docstring for who calls what, and when).

    Args:
        config: the parsed ``--kv-transfer-config``.
        block_size: tokens per KV block of this engine.
    """

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.engine_id = config.engine_id or uuid.uuid4().hex[:16]
        self.stats = KVTransferStats()

    # -- scheduler side ------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of ``request`` beyond ``num_computed_tokens`` (its local hit) whose K/V can be loaded.

        Returns:
            ``(num_tokens, load_async)``; ``(0, False)`` when nothing is to be loaded.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The scheduler allocated ``block_ids`` (the request's whole block table) for the load."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's orders for the worker side; resets the scheduler side's per-step state."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished holding ``block_ids``.

        Returns:
            ``(delay_free, kv_transfer_params)``: with ``delay_free`` the scheduler keeps the blocks
            until :meth:`get_finished` lists the request in ``finished_sending``; the params go back
            to the client.
        """

    def request_aborted_while_loading(self, request: Request) -> None:
        """A request in ``WAITING_FOR_REMOTE_KVS`` was aborted: stop its load (reported as failed)."""

    def release(self, req_id: str, engine_id: str | None = None) -> bool:
        """No consumer will take ``req_id``'s kept KV (producer side): free it now, not at the timeout.

        Called on ``POST /kv_transfer/release`` (the router's decode leg failed: refused, unreachable,
        or the client left). A no-op (False) when ``engine_id`` names another engine, the request's
        KV is not held (already pulled, expired, never kept) or a pull is copying it right now (that
        pull's end frees it).
        """
        return False

    # -- worker side ---------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The engine's KV pool: per layer a tensor ``[2, num_blocks + 1, block_size, num_kv_heads, head_dim]``."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Act on the step's metadata before the forward (start loads, publish KV, cancel)."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s K/V of this step's synchronous loads is in place (none here)."""

    def save_kv_layer(self, layer_idx: int, kv_layer: Any, attn_metadata: Any) -> None:
        """Save layer ``layer_idx``'s K/V during the forward (none here: KV is published from the pool)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Finish the saves of this step (called after the step)."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers that ended since the last call."""

    def shutdown(self) -> None:
        """Stop threads and release transport resources (idempotent)."""


class PullConnector(KVConnectorBase):
    """Consumer pulls, producer holds: the shared logic of :class:`TcpConnector` and :class:`SharedMemoryConnector`.

    Producer: a finished ``do_remote_decode`` request keeps its prompt blocks; :meth:`_publish` makes
    them available; :meth:`_mark_sent` (after a pull) or the ``abort_timeout_s`` deadline lists it in
    ``finished_sending``. Consumer: a ``do_remote_prefill`` request's prompt after the local hit is
    loaded by :meth:`_load` on a worker thread; done or failed, it is listed in :meth:`get_finished`.

    Extra config (``kv_connector_extra_config``): ``abort_timeout_s`` (default 120),
    ``transfer_timeout_s`` (default 30), ``num_load_threads`` (default 2).
    """

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        extra = config.kv_connector_extra_config
        self.abort_timeout_s = float(extra.get("abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S))
        self.transfer_timeout_s = float(extra.get("transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S))
        self.kv_caches: list[Any] = []
        self._lock = threading.Lock()
        # scheduler side, this step
        self._meta = KVConnectorMetadata()
        # producer: req id -> deadline (monotonic s) of the blocks held for a consumer
        self._held: dict[str, float] = {}
        self._sent: set[str] = set()
        self._in_transfer: set[str] = set()   # held KV a transport is copying out now: never freed under it
        # consumer
        self._pool = ThreadPoolExecutor(max_workers=int(extra.get("num_load_threads", 2)),
                                        thread_name_prefix="kv-load")
        self._cancel: dict[str, threading.Event] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._closed = False

    # -- geometry ------------------------------------------------------------
    def geometry(self) -> dict[str, Any]:
        """What must match between producer and consumer: block size, layers, KV heads, head dim, dtype."""
        kv = self.kv_caches[0]
        return {"block_size": self.block_size, "num_layers": len(self.kv_caches),
                "num_kv_heads": int(kv.shape[3]), "head_dim": int(kv.shape[4]), "dtype": str(kv.dtype)}

    def check_geometry(self, remote: dict[str, Any]) -> None:
        """Raise :class:`KVTransferError` when the peer's KV layout differs from ours."""
        mine = self.geometry()
        diff = {k: (remote.get(k), v) for k, v in mine.items() if remote.get(k) != v}
        if diff:
            raise KVTransferError(f"KV geometry differs from the producer's (theirs, ours): {diff}")

    def layer_nbytes(self, num_blocks: int) -> int:
        """Bytes of one layer's K and V for ``num_blocks`` blocks."""
        kv = self.kv_caches[0]
        return 2 * num_blocks * kv[0, 0].numel() * kv.element_size()

    # -- scheduler side ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.sampling_params.kv_transfer_params
        if not self.config.is_consumer or not wants_remote_prefill(params):
            return 0, False
        if request.num_preemptions or request.sampling_params.prompt_logprobs is not None:
            # prompt logprobs need the prompt computed; a preempted request recomputes
            self._decline(request)
            return 0, False
        num_remote = min(int(params.get("remote_num_tokens") or request.num_prompt_tokens),
                         len(params["remote_block_ids"]) * self.block_size, request.num_prompt_tokens)
        if int(params.get("remote_block_size") or self.block_size) != self.block_size:
            logger.warning("request %s: remote block size %s != ours %d; recomputing the prompt",
                           request.request_id, params.get("remote_block_size"), self.block_size)
            self._decline(request)
            return 0, False
        n = num_remote - num_computed_tokens
        if n <= 0:
            self._decline(request)       # the local prefix cache has it all
        return (n, True) if n > 0 else (0, False)

    def decline(self, request: Request) -> None:
        """The consumer ends ``request`` before any load (e.g. its LoRA adapter failed to load): the
        producer frees its KV now (a no-op for a request that is not a consumer's remote prefill)."""
        if self.config.is_consumer and wants_remote_prefill(request.sampling_params.kv_transfer_params):
            self._decline(request)

    def _decline(self, request: Request) -> None:
        """The consumer will not pull ``request``'s KV: ask the producer to free it now, in the background
        and once per request (:func:`tokenmill.kv_transfer.notify.release_remote`)."""
        if request.kv_load_attempted or self._closed:
            return
        request.kv_load_attempted = True     # never loaded now; also marks the release as sent
        from tokenmill.kv_transfer.notify import release_remote

        self._pool.submit(release_remote, dict(request.sampling_params.kv_transfer_params or {}))

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.sampling_params.kv_transfer_params or {}
        # the scheduler set num_computed_tokens to the local prefix-cache hit (whole blocks)
        first = request.num_computed_tokens // self.block_size
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._meta.reqs_to_load[request.request_id] = LoadSpec(
            req_id=request.request_id, local_block_ids=list(block_ids[first:end]),
            remote_block_ids=list(params["remote_block_ids"][first:end]), params=dict(params),
            num_tokens=num_external_tokens)
        self._cancel[request.request_id] = threading.Event()

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.sampling_params.kv_transfer_params
        if (not self.config.is_producer or not wants_remote_decode(params)
                or request.status.finish_reason not in ("stop", "length") or not block_ids):
            return False, None
        num_tokens = request.num_prompt_tokens
        ids = list(block_ids[: -(-num_tokens // self.block_size)])
        self._meta.reqs_to_send[request.request_id] = ids
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
               "remote_block_ids": ids, "remote_request_id": request.request_id,
               "remote_num_tokens": num_tokens, "remote_block_size": self.block_size,
               "kv_connector": type(self).__name__, "tp_size": 1}
        out.update(self._remote_address(request.request_id))
        return True, out

    def request_aborted_while_loading(self, request: Request) -> None:
        spec = self._meta.reqs_to_load.pop(request.request_id, None)
        if spec is not None:        # never started: fail it at once
            with self._lock:
                self._recv_failed.add(request.request_id)
            self._cancel.pop(request.request_id, None)
            return
        ev = self._cancel.get(request.request_id)
        if ev is not None:
            ev.set()
        self._meta.reqs_to_cancel.add(request.request_id)

    # -- worker side ---------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        self.kv_caches = list(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for rid in metadata.reqs_to_cancel:
            ev = self._cancel.get(rid)
            if ev is not None:
                ev.set()
        if metadata.reqs_to_send:
            deadline = time.monotonic() + self.abort_timeout_s
            with self._lock:
                for rid in metadata.reqs_to_send:
                    self._held[rid] = deadline
            for rid, ids in metadata.reqs_to_send.items():
                self._publish(rid, ids)
        for rid, spec in metadata.reqs_to_load.items():
            self._pool.submit(self._run_load, spec, self._cancel.setdefault(rid, threading.Event()))

    def _run_load(self, spec: LoadSpec, cancel: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._load(spec, cancel, time.monotonic() + self.transfer_timeout_s)
            if cancel.is_set():
                raise KVTransferError("cancelled")
        except Exception as e:  # noqa: BLE001 - any failure means: recompute the prompt
            if not cancel.is_set():
                logger.warning("KV load for request %s failed (%s: %s); it will recompute its prompt",
                               spec.req_id, type(e).__name__, e)
            with self._lock:
                self._recv_failed.add(spec.req_id)
                self.stats.num_failed += not cancel.is_set()
            return
        with self._lock:
            self._recv_done.add(spec.req_id)
            self.stats.observe_transfer(time.perf_counter() - t0, nbytes)

    def wait_for_save(self) -> None:
        """Nothing to wait for by default (publishing happens in :meth:`start_load_kv`)."""

    def get_finished(self) -> KVConnectorOutput:
        now = time.monotonic()
        with self._lock:
            out = KVConnectorOutput(finished_sending=self._sent, finished_recving=self._recv_done,
                                    failed_recving=self._recv_failed)
            self._sent, self._recv_done, self._recv_failed = set(), set(), set()
            for rid in out.finished_sending:
                self._held.pop(rid, None)
            expired = [rid for rid, d in self._held.items() if d <= now and rid not in self._in_transfer]
            for rid in expired:
                del self._held[rid]
                self.stats.num_expired += 1
        for rid in expired:
            logger.warning("request %s: no consumer pulled its KV within %.0f s; freeing its blocks",
                           rid, self.abort_timeout_s)
            self._unpublish(rid)
        out.finished_sending |= set(expired)
        for rid in out.finished_recving | out.failed_recving:
            self._cancel.pop(rid, None)
        return out

    def _mark_sent(self, req_id: str, nbytes: int) -> bool:
        """A consumer took ``req_id``'s KV (``nbytes`` bytes): its blocks may be freed. False if not held."""
        with self._lock:
            if req_id not in self._held or req_id in self._sent:
                return False
            self._sent.add(req_id)
            self.stats.bytes_sent += nbytes
            return True

    def is_held(self, req_id: str) -> bool:
        """The producer still holds ``req_id``'s blocks for a consumer."""
        with self._lock:
            return self._is_held_locked(req_id)

    def _is_held_locked(self, req_id: str) -> bool:
        return req_id in self._held and req_id not in self._sent

    def _begin_transfer_locked(self, req_id: str) -> bool:
        """Claim ``req_id``'s held KV for one copy-out (caller holds ``self._lock``); False when it is not
        held or another copy-out has it. End the claim with :meth:`_end_transfer`."""
        if not self._is_held_locked(req_id) or req_id in self._in_transfer:
            return False
        self._in_transfer.add(req_id)
        return True

    def _end_transfer(self, req_id: str, nbytes: int) -> None:
        """The copy-out of ``req_id`` ended (``nbytes`` bytes out): its blocks may be freed."""
        with self._lock:
            self._in_transfer.discard(req_id)
        self._mark_sent(req_id, nbytes)

    def release(self, req_id: str, engine_id: str | None = None) -> bool:
        if engine_id is not None and engine_id != self.engine_id:
            return False
        with self._lock:
            if not self._is_held_locked(req_id) or req_id in self._in_transfer:
                return False
            self._sent.add(req_id)
            self.stats.num_released += 1
        logger.info("request %s: KV released (no consumer will pull it); freeing its blocks", req_id)
        self._unpublish(req_id)
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ev in list(self._cancel.values()):
            ev.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- transport -------------------------------------------------------------
    def _remote_address(self, req_id: str) -> dict[str, Any]:
        """Transport-specific keys of the returned ``kv_transfer_params``."""
        return {}

    @abstractmethod
    def _publish(self, req_id: str, block_ids: list[int]) -> None:
        """Make ``req_id``'s blocks available to a consumer (producer side)."""

    def _unpublish(self, req_id: str) -> None:
        """Withdraw an expired publication (producer side)."""

    @abstractmethod
    def _load(self, spec: LoadSpec, cancel: threading.Event, deadline: float) -> int:
        """Fetch ``spec``'s remote blocks into its local blocks; return the bytes loaded.

        Raises:
            KVTransferError / OSError: the load failed (the request recomputes its prompt).
        """
