"""The consumer's side of an early end: tell the producer that nobody will pull a request's KV.

A decode server (``kv_consumer``) that ends a ``do_remote_prefill`` request before pulling its KV —
it refused the request (unknown model, a validation error, ``--slo`` or queue admission, an engine
rejection), the client left, or the engine decided to recompute the prompt instead of loading it —
asks the producer named in the request's ``kv_transfer_params`` to free the blocks it keeps, at
once, instead of after its ``abort_timeout_s`` (issue 30: four refusals left the prefill server's KV
usage at 0.235). The router does the same from its side on a failed decode leg
(``POST /kv_transfer/release``); both are idempotent on the producer: a release of KV that is
already pulled, being pulled, expired or released frees nothing. This is the decode side's abort
notification of vLLM's NixlConnector (which otherwise waits ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).

Transports:

* :class:`~tokenmill.kv_transfer.tcp.TcpConnector` (``remote_host`` / ``remote_port``): one message on
  the producer's side channel, ``> M {"op": "release", "req": remote_request_id, "engine":
  remote_engine_id}``, answered ``< M {"ok": true, "released": bool}``;
* :class:`~tokenmill.kv_transfer.shared_memory.SharedMemoryConnector` (``remote_shm_path``): the
  producer freed its blocks when it wrote the file; the consumer deletes the file.

Torch-free: the API process calls it (:func:`release_remote`), as does the engine core.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from tokenmill.kv_transfer.framing import encode_msg, recv_msg
from tokenmill.kv_transfer.params import wants_remote_prefill

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0


def release_remote(params: dict[str, Any] | None, timeout: float = RELEASE_TIMEOUT_S) -> bool:
    """Ask the producer of ``params`` (a ``do_remote_prefill`` request's ``kv_transfer_params``) to free
    the KV it keeps; never raises (failures are logged: the producer's expiry frees it then).

    Args:
        params: the request's ``kv_transfer_params``; anything else (None, no ``do_remote_prefill``)
            is a no-op.
        timeout: seconds for the whole exchange.

    Returns:
        True when the producer freed something (TCP) or the file was deleted (shared memory).
    """
    if not wants_remote_prefill(params):
        return False
    assert params is not None
    rid = params.get("remote_request_id")
    path = params.get("remote_shm_path")
    if path:
        try:
            os.unlink(path)
            return True
        except OSError:
            return False
    host, port = params.get("remote_host"), params.get("remote_port")
    if not host or not port or not isinstance(rid, str):
        return False
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(encode_msg({"op": "release", "req": rid, "engine": params.get("remote_engine_id")}))
            reply = recv_msg(sock, deadline)
        return bool(isinstance(reply, dict) and reply.get("ok") and reply.get("released"))
    except (OSError, ValueError, TypeError) as e:
        logger.warning("could not ask the producer %s:%s to release the KV of %s (%s: %s); it frees it after "
                       "its abort_timeout_s", host, port, rid, type(e).__name__, e)
        return False
