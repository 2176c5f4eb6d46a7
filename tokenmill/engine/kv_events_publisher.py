"""Publishes the engine core's KV cache events over ZMQ (wire format: :mod:`tokenmill.core.kv_events`).

The engine core hands each step's events to :meth:`ZmqEventPublisher.publish`
(a queue put, no I/O on the step's path); a daemon thread encodes each batch
with msgpack, sends it on the PUB socket as ``[topic, seq, payload]``, keeps
the last ``buffer_steps`` batches, and answers replay requests on the ROUTER
socket, also while the engine is idle. Sending never blocks: past the
high-water mark ZMQ drops messages, and subscribers recover them by replay.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from tokenmill.core.kv_events import (REPLAY_END, KVEventBatch, KVEventsConfig, encode_batch, seq_from_bytes,
                                      seq_to_bytes)

logger = logging.getLogger(__name__)

_STOP = object()


class ZmqEventPublisher:
    """PUB socket + replay ROUTER socket, served by one thread.

    Args:
        config: the ``--kv-events-config`` (already shifted for this data-parallel rank).
        data_parallel_rank: stamped on every batch (None for a single engine).

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (e.g. the port is taken).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self._ctx = zmq.Context.instance()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self._topic = config.topic.encode("utf-8")
        self.seq = 0
        self.num_dropped = 0
        # bind here, so a bad endpoint fails start-up instead of a thread
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # a replay answers with up to buffer_steps messages at once: a ROUTER socket silently drops
            # what exceeds its high-water mark (default 1,000), which would cut the replay short and make
            # the subscriber drop its whole index; the buffer already bounds what is queued
            self._replay.setsockopt(zmq.SNDHWM, 0)
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-publisher")
        self._thread.start()
        logger.info("publishing KV cache events on %s (replay %s, topic %r)", config.endpoint,
                    config.replay_endpoint, config.topic)

    def publish(self, events: list) -> None:
        """Queue one step's events as a batch (nothing is sent for an empty list)."""
        if events:
            self._queue.put(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank))

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    return
                if item is not None:
                    self._send(item)
                self._serve_replay()
        except Exception:  # noqa: BLE001 - never take the engine down over events
            logger.exception("KV event publisher stopped")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self._topic, seq_to_bytes(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1

    def _serve_replay(self) -> None:
        sock = self._replay
        if sock is None:
            return
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) < 3:
                continue
            client, start = frames[0], seq_from_bytes(frames[-1])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    sock.send_multipart([client, b"", seq_to_bytes(seq), payload])
            sock.send_multipart([client, b"", seq_to_bytes(REPLAY_END), b""])

    def close(self, timeout: float = 2.0) -> None:
        """Flush queued batches and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)
