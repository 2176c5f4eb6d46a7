"""Wire framing of the KV connectors (TCP side channel and shared-memory files).

A stream is a sequence of frames. Each frame is a 9-byte header — one kind byte and the payload
length as an unsigned 64-bit big-endian integer — followed by the payload:

* kind ``b"M"``: a msgpack map (encoded with msgspec) (requests, replies, geometry headers);
* kind ``b"R"``: raw bytes, one layer's K and V of the requested blocks, i.e. a C-contiguous tensor
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` of the pool's dtype in the host's byte order.

Conversation of :class:`~tokenmill.kv_transfer.tcp.TcpConnector` (consumer → producer, ``>``; back, ``<``)::

    > M {"op": "pull", "req": remote_request_id, "engine": remote_engine_id, "block_ids": [...]}
    < M {"ok": true, "geometry": {...}, "num_layers": L}      or  M {"ok": false, "error": "..."}
    < R layer 0   < R layer 1   ...   < R layer L-1
    > M {"ok": true}                                         (the consumer wrote every layer)

or, when the consumer ends the request without pulling (:mod:`tokenmill.kv_transfer.notify`)::

    > M {"op": "release", "req": remote_request_id, "engine": remote_engine_id}
    < M {"ok": true, "released": bool}

A :class:`~tokenmill.kv_transfer.shared_memory.SharedMemoryConnector` file is the same as the
producer's side of that conversation: ``M {"geometry": {...}, "block_ids": [...]}`` then one ``R``
frame per layer.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any, BinaryIO

import msgspec

HEADER = struct.Struct(">cQ")
KIND_MSG = b"M"
KIND_RAW = b"R"
MAX_MSG_BYTES = 64 << 20


class FramingError(ValueError):
    """A malformed or unexpected frame."""


def encode_msg(obj: Any) -> bytes:
    """One ``M`` frame (header + msgpack payload)."""
    payload = msgspec.msgpack.encode(obj)
    return HEADER.pack(KIND_MSG, len(payload)) + payload


def raw_header(nbytes: int) -> bytes:
    """The header of an ``R`` frame of ``nbytes`` bytes."""
    return HEADER.pack(KIND_RAW, nbytes)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got = 0
    n = len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("KV transfer timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def recv_header(sock: socket.socket, deadline: float | None = None) -> tuple[bytes, int]:
    """Read one frame header: ``(kind, payload length)``."""
    buf = bytearray(HEADER.size)
    _recv_exact(sock, memoryview(buf), deadline)
    kind, n = HEADER.unpack(buf)
    return kind, n


def recv_msg(sock: socket.socket, deadline: float | None = None) -> Any:
    """Read one ``M`` frame and decode it.

    Raises:
        FramingError: the next frame is not a message, or is larger than 64 MiB.
    """
    kind, n = recv_header(sock, deadline)
    if kind != KIND_MSG or n > MAX_MSG_BYTES:
        raise FramingError(f"expected a message frame, got kind {kind!r} of {n} bytes")
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf), deadline)
    return msgspec.msgpack.decode(bytes(buf))


def recv_raw_into(sock: socket.socket, out: memoryview, deadline: float | None = None) -> None:
    """Read one ``R`` frame straight into ``out`` (its length must match the frame's).

    Raises:
        FramingError: not a raw frame, or another length.
    """
    kind, n = recv_header(sock, deadline)
    if kind != KIND_RAW or n != len(out):
        raise FramingError(f"expected a raw frame of {len(out)} bytes, got kind {kind!r} of {n} bytes")
    _recv_exact(sock, out, deadline)


def read_msg(f: BinaryIO) -> Any:
    """Read one ``M`` frame from a file."""
    head = f.read(HEADER.size)
    if len(head) != HEADER.size:
        raise FramingError("truncated file")
    kind, n = HEADER.unpack(head)
    if kind != KIND_MSG or n > MAX_MSG_BYTES:
        raise FramingError(f"expected a message frame, got kind {kind!r} of {n} bytes")
    return msgspec.msgpack.decode(f.read(n))


def read_raw_into(f: BinaryIO, out: memoryview) -> None:
    """Read one ``R`` frame from a file into ``out``."""
    head = f.read(HEADER.size)
    if len(head) != HEADER.size:
        raise FramingError("truncated file")
    kind, n = HEADER.unpack(head)
    if kind != KIND_RAW or n != len(out):
        raise FramingError(f"expected a raw frame of {len(out)} bytes, got kind {kind!r} of {n} bytes")
    if f.readinto(out) != n:
        raise FramingError("truncated file")
