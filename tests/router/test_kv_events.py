"""KV cache events: what the KV cache manager records, the ZMQ publisher, and the router's subscriber."""

from __future__ import annotations

import asyncio
import socket
import time

import msgspec
import pytest
import zmq

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig,
                                      decode_batch, encode_batch, seq_from_bytes)
from tokenmill.core.request import Request
from tokenmill.engine.kv_events_publisher import ZmqEventPublisher
from tokenmill.router.kv_index import KVEventSubscriber, KVIndex
from tokenmill.router.prompt import block_hash_chain
from tokenmill.sampling_params import SamplingParams

BS = 4


def prefill(m: KVCacheManager, r: Request) -> None:
    hit, num_hit = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - num_hit, hit, num_hit) is not None
    r.num_computed_tokens = r.num_tokens
    m.cache_blocks(r)


def test_manager_records_stored_removed_cleared():
    m = KVCacheManager(4, BS)
    m.block_pool.enable_kv_events()
    a = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    prefill(m, a)
    evs = m.block_pool.take_kv_events()
    assert len(evs) == 1 and isinstance(evs[0], BlockStored)
    assert evs[0].block_hashes == block_hash_chain(list(range(10)), BS)  # 2 full blocks
    assert evs[0].parent_block_hash is None and evs[0].token_ids == list(range(8)) and evs[0].block_size == BS
    # decode fills block 2: stored with its parent
    for t in (100, 101):
        a.append_output_token_ids([t])
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    m.cache_blocks(a)
    (ev,) = m.block_pool.take_kv_events()
    assert ev.parent_block_hash == a.block_hashes[1] and ev.block_hashes == [a.block_hashes[2]]
    assert ev.token_ids == [8, 9, 100, 101]
    m.free(a)
    # a new request needing all 4 blocks evicts the 3 cached ones: one merged BlockRemoved
    b = Request("b", list(range(500, 516)), SamplingParams(max_tokens=1))
    prefill(m, b)
    evs = m.block_pool.take_kv_events()
    removed = [e for e in evs if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and sorted(removed[0].block_hashes) == sorted(a.block_hashes[:3])
    m.reset_prefix_cache()
    assert isinstance(m.block_pool.take_kv_events()[-1], AllBlocksCleared)
    # off by default: nothing is collected
    m2 = KVCacheManager(4, BS)
    prefill(m2, Request("c", list(range(10)), SamplingParams(max_tokens=1)))
    assert m2.block_pool.take_kv_events() == []


def test_wire_format_is_vllm_shaped_msgpack():
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2),
        BlockRemoved(block_hashes=[b"\x02" * 32]), AllBlocksCleared()])
    raw = msgspec.msgpack.decode(encode_batch(batch))
    # vLLM's BlockStored fields: ..., lora_id, medium, lora_name
    assert raw == [1.5, [["BlockStored", [b"\x01" * 32], None, [1, 2], 2, None, None, None],
                         ["BlockRemoved", [b"\x02" * 32], None], ["AllBlocksCleared"]], None]
    assert decode_batch(encode_batch(batch)) == batch


def test_kv_events_config_parsing():
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
                                 '"replay_endpoint": "tcp://*:6001"}')
    assert c.active and c.publisher == "zmq"
    assert c.for_rank(2).endpoint == "tcp://*:6002" and c.for_rank(2).replay_endpoint == "tcp://*:6003"
    assert not KVEventsConfig.from_json(None).active
    with pytest.raises(ValueError):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "bogus": 1}')
    with pytest.raises(ValueError):
        KVEventsConfig.from_json("[1]")
    from tokenmill.config import CacheConfig

    with pytest.raises(ValueError):
        CacheConfig(kv_events_config="{not json")


def _ports(n: int) -> list[int]:
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(s.getsockname()[1])
    return out


def _stored(i: int) -> list:
    return [BlockStored(block_hashes=[bytes([i]) * 32], parent_block_hash=None, token_ids=[i] * BS, block_size=BS)]


async def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


async def test_publisher_to_subscriber_and_replay_after_gap():
    pub_port, replay_port = _ports(2)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub_port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=100)
    pub = ZmqEventPublisher(cfg)
    idx = KVIndex()
    sub = KVEventSubscriber(0, cfg.endpoint, idx, cfg.replay_endpoint)
    try:
        sub.start()
        # PUB/SUB joins asynchronously: publish until the subscriber sees something
        n = 0
        while sub.num_batches == 0 and n < 200:
            pub.publish(_stored(n))
            n += 1
            await asyncio.sleep(0.02)
        await _wait(lambda: sub.last_seq == n - 1)
        # batches published before the subscription joined were replayed (seq 0 onwards)
        assert idx.num_blocks(0) == n
        # a gap: the subscriber misses seq n..n+2 (fed directly), then gets n+3 -> replays n..n+2
        await sub.stop()
        for i in range(n, n + 4):
            pub.publish(_stored(i))
        await _wait(lambda: pub.seq == n + 4)
        last = [p for s, p in pub._buffer if s == n + 3][0]
        await sub.handle(n + 3, last)
        assert sub.last_seq == n + 3 and sub.num_gaps == 1 and sub.num_replayed >= 3
        assert idx.num_blocks(0) == n + 4
        chain = [bytes([i]) * 32 for i in range(n + 4)]
        assert all(idx.match([h], [0])[0] == 1 for h in chain)
    finally:
        await sub.stop()
        pub.close()


async def test_gap_without_replay_drops_the_backend_and_restart_resets():
    idx = KVIndex()
    sub = KVEventSubscriber(3, "tcp://127.0.0.1:1", idx, replay_endpoint=None)
    for seq in range(3):
        await sub.handle(seq, encode_batch(KVEventBatch(ts=0.0, events=_stored(seq))))
    assert idx.num_blocks(3) == 3
    await sub.handle(5, encode_batch(KVEventBatch(ts=0.0, events=_stored(5))))   # 3, 4 lost for good
    assert idx.num_blocks(3) == 1 and sub.num_resets == 1 and sub.last_seq == 5
    await sub.handle(5, encode_batch(KVEventBatch(ts=0.0, events=_stored(9))))   # duplicate: ignored
    assert idx.num_blocks(3) == 1
    await sub.handle(0, encode_batch(KVEventBatch(ts=0.0, events=_stored(7))))   # publisher restarted
    assert idx.num_blocks(3) == 1 and sub.num_resets == 2 and sub.last_seq == 0
    assert idx.match([bytes([7]) * 32], [3]) == {3: 1}


def test_replay_socket_speaks_the_documented_protocol():
    pub_port, replay_port = _ports(2)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub_port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=3)
    pub = ZmqEventPublisher(cfg)
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    try:
        for i in range(5):
            pub.publish(_stored(i))
        deadline = time.monotonic() + 5
        while pub.seq < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        req.connect(cfg.replay_endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert req.poll(5000)
            frames = req.recv_multipart()
            s = seq_from_bytes(frames[1])
            if s == -1:
                assert frames[2] == b""
                break
            seqs.append(s)
            assert decode_batch(frames[2]).events[0].token_ids == [s] * BS
        assert seqs == [2, 3, 4]   # only buffer_steps batches are kept
    finally:
        req.close(linger=0)
        pub.close()


def test_replay_longer_than_zmqs_high_water_mark_arrives_whole():
    # a router started after a few thousand steps replays them all at once: nothing may be dropped
    pub_port, replay_port = _ports(2)
    n = 6000
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub_port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=n)
    pub = ZmqEventPublisher(cfg)
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVHWM, 0)   # as KVEventSubscriber's
    try:
        for i in range(n):
            pub.publish(_stored(i % 256))
        deadline = time.monotonic() + 30
        while pub.seq < n and time.monotonic() < deadline:
            time.sleep(0.01)
        req.connect(cfg.replay_endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.5)            # a reader busy elsewhere: the answer queues up meanwhile
        seqs = []
        while True:
            assert req.poll(10000), f"replay stopped after {len(seqs)} batches"
            frames = req.recv_multipart()
            s = seq_from_bytes(frames[1])
            if s == -1:
                break
            seqs.append(s)
        assert seqs == list(range(n))
    finally:
        req.close(linger=0)
        pub.close()
