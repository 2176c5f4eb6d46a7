"""``TcpConnector``: KV blocks between machines over a TCP side channel.

The producer (a prefill server) runs a side-channel server thread on ``kv_ip:kv_port``. A consumer
(a decode server) connects, names the request and the blocks it wants, and receives them one layer
at a time (framing: :mod:`tokenmill.kv_transfer.framing`); it writes each layer into its own blocks
as soon as it arrives, so receiving layer ``l + 1`` overlaps with storing layer ``l``. The producer
reads its blocks straight from its KV pool (they are held, so nothing overwrites them) and frees
them after the pull, or after ``abort_timeout_s`` when nobody pulls. The same idea as vLLM's
NixlConnector (a pull by the decode side from blocks the prefill side keeps), over plain sockets.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from typing import Any

import torch

from tokenmill.config import KVTransferConfig
from tokenmill.kv_transfer.base import KVTransferError, LoadSpec, PullConnector
from tokenmill.kv_transfer.framing import encode_msg, raw_header, recv_msg, recv_raw_into

logger = logging.getLogger(__name__)

# How long a pull for a request not yet published waits for it (the producer publishes in the step
# that finished the request, so this only covers a consumer faster than that step's end), s.
PUBLISH_WAIT_S = 2.0
_SOCK_BUF = 4 << 20


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:  # one pull per connection
        self.server.connector._serve(self.request)  # type: ignore[attr-defined]


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class TcpConnector(PullConnector):
    """KV transfer over TCP (see the module docstring).

    Args:
        config: ``--kv-transfer-config`` (``kv_ip``/``kv_port``: where a producer listens and what it
            advertises; port 0 picks a free port).
        block_size: tokens per KV block.

    Raises:
        OSError: the producer's port cannot be bound (in use, or the address is not local).
    """

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        self._published: dict[str, list[int]] = {}
        self._pub_cv = threading.Condition(self._lock)
        self._server: _Server | None = None
        self.port = config.kv_port
        if config.is_producer:
            self._server = _Server((config.kv_ip, config.kv_port), _Handler)
            self._server.connector = self  # type: ignore[attr-defined]
            self.port = self._server.server_address[1]
            threading.Thread(target=self._server.serve_forever, name="kv-side-channel", daemon=True).start()
            logger.info("KV side channel (TcpConnector, engine %s) listening on %s:%d", self.engine_id,
                        config.kv_ip, self.port)

    def _remote_address(self, req_id: str) -> dict[str, Any]:
        return {"remote_host": self.config.kv_ip, "remote_port": self.port}

    # -- producer --------------------------------------------------------------
    def _publish(self, req_id: str, block_ids: list[int]) -> None:
        with self._pub_cv:
            self._published[req_id] = list(block_ids)
            self._pub_cv.notify_all()

    def _unpublish(self, req_id: str) -> None:
        with self._lock:
            self._published.pop(req_id, None)

    def _serve(self, sock: socket.socket) -> None:
        """Answer one pull (runs on a side-channel thread)."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        rid = None
        sent = 0
        serving = False     # set once the pull was accepted: only then does its end free the blocks
        try:
            req = recv_msg(sock, time.monotonic() + 10.0)
            rid = req.get("req") if isinstance(req, dict) else None
            if isinstance(req, dict) and req.get("op") == "release" and isinstance(rid, str):
                # a consumer ended the request before pulling (kv_transfer/notify.py): free it now
                released = self.release(rid, req.get("engine"))
                sock.sendall(encode_msg({"ok": True, "released": released}))
                return
            if not isinstance(req, dict) or req.get("op") != "pull" or not isinstance(rid, str):
                sock.sendall(encode_msg({"ok": False, "error": "expected {op: pull, req: ...}"}))
                return
            if req.get("engine") not in (None, self.engine_id):
                sock.sendall(encode_msg({"ok": False, "error": f"this is engine {self.engine_id}, "
                                                              f"not {req.get('engine')}"}))
                return
            wanted = req.get("block_ids")
            with self._pub_cv:
                self._pub_cv.wait_for(lambda: rid in self._published, timeout=PUBLISH_WAIT_S)
                published = self._published.get(rid)
                bad_ids = (published is not None
                           and (not isinstance(wanted, list) or not set(wanted) <= set(published)))
                # claimed under the lock: a release or the expiry cannot free the blocks while they are read
                serving = published is not None and not bad_ids and self._begin_transfer_locked(rid)
            if bad_ids:
                sock.sendall(encode_msg({"ok": False, "error": "block_ids are not the request's blocks"}))
                return
            if not serving:
                sock.sendall(encode_msg({"ok": False, "error": f"no KV held for request {rid!r} (finished "
                                                              "sending, released, expired, being sent, or "
                                                              "never produced)"}))
                return
            sock.sendall(encode_msg({"ok": True, "geometry": self.geometry(), "num_layers": len(self.kv_caches)}))
            idx = torch.tensor(wanted, dtype=torch.long, device=self.kv_caches[0].device)
            for kv in self.kv_caches:
                layer = kv.index_select(1, idx).cpu().contiguous()
                data = layer.view(torch.uint8).numpy()
                sock.sendall(raw_header(data.nbytes))
                sock.sendall(memoryview(data).cast("B"))
                sent += data.nbytes
            ack = recv_msg(sock, time.monotonic() + 30.0)
            if not (isinstance(ack, dict) and ack.get("ok")):
                logger.warning("consumer of request %s did not confirm the KV transfer: %r", rid, ack)
        except (OSError, ValueError) as e:
            logger.warning("KV side channel: serving request %s failed: %s", rid, e)
        finally:
            if serving:
                # pulled (or the pull broke half way, after which the consumer recomputes): free the blocks
                self._unpublish(rid)
                self._end_transfer(rid, sent)
            try:
                sock.close()
            except OSError:
                pass

    # -- consumer --------------------------------------------------------------
    def _load(self, spec: LoadSpec, cancel: threading.Event, deadline: float) -> int:
        p = spec.params
        host, port = p.get("remote_host"), p.get("remote_port")
        if not host or not port:
            raise KVTransferError("kv_transfer_params lack remote_host / remote_port")
        n = len(spec.local_block_ids)
        if n != len(spec.remote_block_ids) or n == 0:
            raise KVTransferError(f"{len(spec.remote_block_ids)} remote blocks for {n} local blocks")
        timeout = max(0.001, deadline - time.monotonic())
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
            sock.sendall(encode_msg({"op": "pull", "req": p["remote_request_id"], "engine": p.get("remote_engine_id"),
                                     "block_ids": spec.remote_block_ids}))
            head = recv_msg(sock, deadline)
            if not isinstance(head, dict) or not head.get("ok"):
                raise KVTransferError(f"producer refused: {head.get('error') if isinstance(head, dict) else head}")
            self.check_geometry(head.get("geometry") or {})
            kv0 = self.kv_caches[0]
            buf = torch.empty((2, n, *kv0.shape[2:]), dtype=kv0.dtype)
            view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
            idx = torch.tensor(spec.local_block_ids, dtype=torch.long, device=kv0.device)
            total = 0
            for kv in self.kv_caches:
                if cancel.is_set():
                    raise KVTransferError("cancelled")
                recv_raw_into(sock, view, deadline)
                kv.index_copy_(1, idx, buf.to(kv.device, non_blocking=False))
                total += len(view)
            sock.sendall(encode_msg({"ok": True}))
        return total

    def shutdown(self) -> None:
        super().shutdown()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
