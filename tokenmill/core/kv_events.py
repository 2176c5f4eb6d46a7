"""KV cache events: what the engine tells a cache-aware router about its prefix cache.

Wire format (the same shape as vLLM's ``vllm/distributed/kv_events.py``, so a
router written for vLLM's events can read ours):

* Transport: a ZMQ ``PUB`` socket (``endpoint``, default ``tcp://*:5557``).
  Every message is three frames: ``[topic, seq, payload]`` where ``topic`` is
  the configured topic as UTF-8 bytes (default empty), ``seq`` the batch
  sequence number as an 8-byte big-endian signed integer (0, 1, 2, ... per
  publisher; a subscriber that sees a jump knows it missed batches), and
  ``payload`` one msgpack-encoded :class:`KVEventBatch`.
* Replay: a ZMQ ``ROUTER`` socket (``replay_endpoint``) keeps the last
  ``buffer_steps`` batches. A client (``DEALER``, or ``REQ`` for a single
  reply) sends ``[b"", start_seq]`` (8-byte big-endian); the publisher answers
  ``[b"", seq, payload]`` for every buffered batch with ``seq >= start_seq``
  in order, then the end marker ``[b"", -1 (8 bytes, signed), b""]``.
* Payload: msgpack arrays (msgspec ``array_like`` structs). A batch is
  ``[ts, [event, ...], data_parallel_rank]`` (``ts``: publisher wall-clock
  seconds, float; the rank is nil for a single engine). Each event is a
  tagged array whose first element is its type name:

  - ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium, lora_name]`` (trailing nil fields omitted): full blocks just
    registered in the prefix cache, in chain order. ``block_hashes`` are
    32-byte SHA-256 digests (:func:`tokenmill.core.prefix_cache.hash_block_tokens`),
    ``parent_block_hash`` is the hash of the block before the first one (nil
    for a chain that starts at the prompt's first token), ``token_ids`` the
    ``len(block_hashes) * block_size`` token ids of those blocks.
  - ``["BlockRemoved", block_hashes, medium]``: blocks evicted from the prefix cache
    (their hash is gone; a new request cannot hit them any more).
  - ``["AllBlocksCleared"]``: every hash was dropped (prefix-cache reset).

An event describes the prefix *index*, not block occupancy: a block freed by
its last request but still cached (lazy eviction) stays "stored" until a
``BlockRemoved`` says otherwise. This module is pure Python (msgspec only) so
both the engine core and the router import it.
"""

from __future__ import annotations

from typing import Union

import msgspec

from tokenmill.config import KVEventsConfig  # noqa: F401 - re-export (the config lives with the others)


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Full blocks registered in the prefix cache, in chain order.

    Attributes:
        block_hashes: ``[num_blocks]`` 32-byte hashes.
        parent_block_hash: hash of the block before ``block_hashes[0]``; None
            when ``block_hashes[0]`` is the first block of a sequence.
        token_ids: ``[num_blocks * block_size]`` token ids of these blocks.
        block_size: tokens per block.
        lora_id: the LoRA adapter's ``lora_int_id`` (None: the base model), as vLLM's field (the id is
            this server's own: another server may number the same adapter differently).
        medium: storage tier (None means the device pool).
        lora_name: the adapter's served name (None: the base model), as vLLM's later field; the adapter's
            key (name and content hash) is part of the hashes (block 0's extra keys).
    """

    block_hashes: list[bytes]
    parent_block_hash: Union[bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Blocks evicted from the prefix cache (``[num_blocks]`` 32-byte hashes)."""

    block_hashes: list[bytes]
    medium: Union[str, None] = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Every cached hash was dropped."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step.

    Attributes:
        ts: wall-clock time of publication, seconds since the epoch.
        events: the step's events in the order they happened.
        data_parallel_rank: the engine's rank under ``--data-parallel-size`` (None: single engine).
    """

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: Union[int, None] = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of one batch (the ``payload`` frame)."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse a ``payload`` frame.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: not a valid batch.
    """
    return _DECODER.decode(payload)


def seq_to_bytes(seq: int) -> bytes:
    """The 8-byte big-endian signed encoding of a sequence number (the ``seq`` frame)."""
    return int(seq).to_bytes(8, "big", signed=True)


def seq_from_bytes(data: bytes) -> int:
    """Inverse of :func:`seq_to_bytes`."""
    return int.from_bytes(data, "big", signed=True)


REPLAY_END = -1
"""Sequence number of the replay socket's end marker."""
