"""The KV offloading tier beyond one rank and one medium: tensor/pipeline-parallel ranks (each keeps its
shard; a block is a hit only when every rank holds it; a rank's failed load fails the request only once
every rank stopped writing), the host-memory tier in front of the files, quantised caches across a
restart, and the tier on a prefill-decode producer."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from tests.kv_transfer.test_offloading import BS, PROMPTS, _cfg, _drive, _files, _greedy, _hashes, _one_by_one
from tests.kv_transfer.test_offloading import one_torch_thread, tiny  # noqa: F401 - the module fixtures
from tokenmill.core.kv_events import BlockRemoved, BlockStored
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.kv_transfer.offloading import (HostTier, LocalTierRanks, OffloadingConfig, OffloadingConnector,
                                              TierStore, decode_header, host_tier_bytes)
from tokenmill.sampling_params import SamplingParams


def _tokens(outs):
    return [t for t, _ in outs]


# -- tensor / pipeline parallel workers ---------------------------------------------------------
@pytest.mark.slow      # three engines of two spawned worker processes each: 26-36 s apiece at load ~4 here
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parallel_ranks_keep_their_shards_and_restart_warm(tiny, tmp_path, tp, pp):  # noqa: F811
    """mp workers: greedy tokens with the tier equal the same layout without it over two passes of a
    working set larger than the pool; every rank wrote its own shard (its K/V heads or layers) of the
    same blocks under its own directory, the header naming its place; a restart starts warm."""
    par = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    ref = EngineCore(_cfg(tiny, **par))
    try:
        want = _one_by_one(ref, PROMPTS, "a") + _one_by_one(ref, PROMPTS, "b")
    finally:
        ref.shutdown()
    tier = EngineCore(_cfg(tiny, tmp_path, **par))
    try:
        assert tier.kv_offload.stores == [] and tier.kv_offload.world_size == 2     # the stores are in the workers
        got = _one_by_one(tier, PROMPTS, "a")
        assert tier.kv_offload.flush()
        got += _one_by_one(tier, PROMPTS, "b")
        assert _tokens(got) == _tokens(want)
        assert [c for _, c in got[6:]] == [28] * 6 and sum(c for _, c in want[6:]) < 6 * 28
        st = tier.kv_offload.get_tier_stats()
        # (the first pass's last three share a document evicted from the pool by then: 6 blocks each)
        assert [c for _, c in got[3:6]] == [24] * 3
        assert st.num_loads == 9 and st.num_failed_loads == 0 and st.blocks_loaded == 3 * 6 + 6 * 7
        inv = tier.check_invariants()
        assert inv["problems"] == [] and inv["num_free_blocks"] == 16
    finally:
        tier.shutdown()
    by_rank: dict = {}
    for f in _files(tmp_path):
        header, _ = decode_header(open(f, "rb").read())
        ident = header["identity"]
        by_rank.setdefault((tuple(ident["tp"]), tuple(ident["pp"])), (set(), set(), tuple(ident["block_shape"])))
        by_rank[(tuple(ident["tp"]), tuple(ident["pp"]))][0].add(header["hash"])
        by_rank[(tuple(ident["tp"]), tuple(ident["pp"]))][1].add(os.path.dirname(os.path.dirname(f)))
    places = {((r, 2), (0, 1)) for r in range(2)} if tp == 2 else {((0, 1), (r, 2)) for r in range(2)}
    assert set(by_rank) == places
    (h0, d0, shape0), (h1, d1, shape1) = by_rank.values()
    assert h0 == h1 and len(h0) == st.resident_blocks and not d0 & d1
    # the tiny Llama: 4 layers, 2 K/V heads; TP 2 halves the heads, PP 2 the layers
    assert shape0 == shape1 == ((4, 2, BS, 1, 16) if tp == 2 else (2, 2, BS, 2, 16))
    again = EngineCore(_cfg(tiny, tmp_path, **par))
    try:
        assert again.kv_offload.get_tier_stats().resident_blocks == len(h0)
        got = _one_by_one(again, PROMPTS[:3], "c")
        assert _tokens(got) == _tokens(want[:3]) and [c for _, c in got] == [28] * 3
    finally:
        again.shutdown()


# -- the multi-rank bookkeeping, with two in-process stores --------------------------------------
def _two_ranks(tiny, tmp_path, **store_kw):  # noqa: F811
    """A core whose tier has two in-process ranks over the same pool (each a whole "shard"), directories
    apart (their identities name tp 0/2 and 1/2)."""
    core = EngineCore(_cfg(tiny))
    runner = core.executor
    cfg = OffloadingConfig(root=str(tmp_path), capacity_bytes=10 * 2**20, write_retry_s=0.0, **store_kw)
    base = {"model": "tiny", "tp": [0, 2], "pp": [0, 1]}
    stores = [TierStore(cfg, BS, runner.kv_caches, {**base, "tp": [r, 2]}) for r in range(2)]
    conn = OffloadingConnector(cfg, BS, LocalTierRanks(stores))
    core.kv_offload = core.kv_connector = core.scheduler.kv_connector = conn
    conn.bind_kv_cache_manager(core.scheduler.kv_cache_manager)
    return core, stores


def test_a_block_counts_only_when_every_rank_holds_it(tiny, tmp_path):  # noqa: F811
    core, (s0, s1) = _two_ranks(tiny, tmp_path)
    ref = EngineCore(_cfg(tiny))
    missing = _hashes(PROMPTS[0])[3].hex()
    real_write = s1._write_file

    def no_space_for_one(path, head, payload):
        if missing in path:
            raise OSError(28, "No space left on device")
        real_write(path, head, payload)

    s1._write_file = no_space_for_one
    try:
        want = _one_by_one(ref, PROMPTS[:3], "a") + _one_by_one(ref, PROMPTS[:1], "b")
        got = _one_by_one(core, PROMPTS[:3], "a")
        assert core.kv_offload.flush()
        assert s0.dir != s1.dir and s0.holds(bytes.fromhex(missing)) and not s1.holds(bytes.fromhex(missing))
        got += _one_by_one(core, PROMPTS[:1], "b")
        assert _tokens(got) == _tokens(want)
        assert got[3][1] == 3 * BS          # the run stops at the block rank 1 lacks
        st = core.kv_offload.get_tier_stats()
        assert st.resident_blocks == len(s1.index) == len(s0.index) - 1
        assert st.write_errors == 2            # the second pass recomputed the block: rank 1 was asked again
        assert core.check_invariants()["problems"] == []
    finally:
        core.shutdown()


def test_one_rank_failing_fails_the_load_once_every_rank_stopped(tiny, tmp_path):  # noqa: F811
    """Rank 1's file is corrupt, rank 0's load is held: the request stays waiting (rank 0 may still be
    writing its blocks) until rank 0 saw the cancel, then recomputes; nothing leaks."""
    core, (s0, s1) = _two_ranks(tiny, tmp_path)
    ref = EngineCore(_cfg(tiny))
    try:
        want = _one_by_one(ref, PROMPTS[:3], "a") + _one_by_one(ref, PROMPTS[:1], "b")
        got = _one_by_one(core, PROMPTS[:3], "a")
        assert core.kv_offload.flush()
        f = s1.path_of(_hashes(PROMPTS[0])[0])
        data = bytearray(open(f, "rb").read())
        data[-3] ^= 0xFF
        open(f, "wb").write(bytes(data))
        gate, run0 = threading.Event(), s0._run_load
        s0._run_load = lambda spec, cancel: (gate.wait(30), run0(spec, cancel))
        core.add_request(EngineCoreRequest("b0", list(PROMPTS[0]), _greedy()))
        deadline = time.monotonic() + 30
        while s1.get_stats().blocks_discarded == 0 and time.monotonic() < deadline:
            core.step()
            time.sleep(0.002)
        for _ in range(5):
            core.step()
            time.sleep(0.002)
        assert "b0" in core.scheduler.waiting_for_remote      # rank 0 has not stopped: the blocks stay held
        gate.set()
        out = []
        while True:
            assert time.monotonic() < deadline
            outs = [o for o in core.step() if o.req_id == "b0"]
            out += [t for o in outs for t in o.new_token_ids]
            if any(o.finish_reason for o in outs):
                cached = outs[-1].num_cached_tokens
                break
            time.sleep(0.002)
        assert _tokens(got) + [out] == _tokens(want) and cached == 0
        st = core.kv_offload.get_tier_stats()
        assert st.num_failed_loads == 1 and st.num_loads == 0
        inv = core.check_invariants()
        assert inv["problems"] == [] and inv["num_free_blocks"] == 16
        assert s0.index.pins == {} and s1.index.pins == {}
    finally:
        core.shutdown()


# -- the host-memory tier ---------------------------------------------------------------------------
def test_host_tier_lru_never_reuses_a_slot_being_read():
    shape = (1, 2, BS, 1, 8)
    t = HostTier(2 * 64, shape, pin=False)
    assert t.num_slots == 2 and t.capacity_bytes == 128
    blk = [torch.full(shape, i, dtype=torch.uint8) for i in range(4)]
    assert t.put(b"a", blk[0], None, [1])[0] and t.put(b"b", blk[1], b"a", [2])[0]
    slot = t.acquire(b"a")                        # a load is copying from "a"
    stored, evicted = t.put(b"c", blk[2], b"b", [3])
    assert stored and evicted == [b"b"] and b"a" in t and int(slot[0, 0, 0, 0, 0]) == 0
    stored, evicted = t.put(b"d", blk[3], None, [4])     # "a" still pinned, "c" goes
    assert stored and evicted == [b"c"]
    t.release(b"a")
    assert t.put(b"e", blk[0], None, [5]) == (True, [b"a"])


def test_host_tier_is_off_by_default_on_a_cpu_pool():
    assert host_tier_bytes(None, 4.0, "cpu") == 0
    assert host_tier_bytes(0, 4.0, "cuda") == 0
    assert host_tier_bytes(0.5, 4.0, "cpu") == 2**29          # asked for explicitly: used
    assert 0 < host_tier_bytes(None, 0.001, "cuda") <= int(0.001 * 2**30)


def test_host_tier_in_front_of_the_files(tiny, tmp_path):  # noqa: F811
    """Asked for on the CPU (the tests have no GPU): saved blocks go to host memory and to the files;
    loads read host memory first, then files for what it dropped (LRU); greedy equal; CPU events;
    a restart starts warm from the files alone."""
    ref = EngineCore(_cfg(tiny))
    probe = EngineCore(_cfg(tiny, tmp_path / "probe"))
    nbytes = probe.kv_offload.stores[0].block_nbytes
    probe.shutdown()
    core = EngineCore(_cfg(tiny, tmp_path, kv_offloading_host_size=12 * nbytes / 2**30))
    pool = core.scheduler.kv_cache_manager.block_pool
    pool.enable_kv_events()
    try:
        store = core.kv_offload.stores[0]
        assert store.host is not None and store.host.num_slots == 12 and not store.host.pinned_memory
        want = _one_by_one(ref, PROMPTS, "a") + _one_by_one(ref, PROMPTS, "b")
        got = _one_by_one(core, PROMPTS, "a")
        assert core.kv_offload.flush()
        got += _one_by_one(core, PROMPTS, "b")
        assert _tokens(got) == _tokens(want) and [c for _, c in got[6:]] == [28] * 6
        st = core.kv_offload.get_tier_stats()
        assert 0 < st.host_blocks_loaded < st.blocks_loaded == 3 * 6 + 6 * 7     # (as in the TP/PP test)
        assert st.host_blocks_evicted > 0 and st.host_resident_blocks == 12
        assert st.host_capacity_bytes == 12 * nbytes and st.host_resident_bytes == 12 * nbytes
        events = pool.take_kv_events()
        cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
        cpu_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        assert len(cpu) == st.host_blocks_stored and len(cpu_removed) == st.host_blocks_evicted
        from tokenmill.metrics.prometheus import PrometheusStatLogger

        exporter = PrometheusStatLogger("tiny", 256)
        exporter.record(core.get_stats(), None)
        text = exporter.render().decode()
        assert (f'tokenmill:kv_offload_host_blocks_total{{direction="load",engine="0",model_name="tiny"}} '
                f'{float(st.host_blocks_loaded)}') in text
        assert "tokenmill:kv_offload_host_resident_blocks" in text
    finally:
        core.shutdown()
    again = EngineCore(_cfg(tiny, tmp_path, kv_offloading_host_size=12 * nbytes / 2**30))
    try:
        got = _one_by_one(again, PROMPTS[:3], "c")
        st = again.kv_offload.get_tier_stats()
        assert _tokens(got) == _tokens(want[:3]) and [c for _, c in got] == [28] * 3
        assert st.host_blocks_loaded == 0 and st.blocks_loaded == 3 * 7
    finally:
        again.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory, a GPU pool)")
def test_host_tier_on_a_gpu_pool(tiny, tmp_path):  # noqa: F811
    ref = EngineCore(_cfg(tiny, device="cuda"))
    core = EngineCore(_cfg(tiny, tmp_path, device="cuda"))
    try:
        store = core.kv_offload.stores[0]
        assert store.device.type == "cuda" and store.host is not None and store.host.pinned_memory
        want = _one_by_one(ref, PROMPTS, "a") + _one_by_one(ref, PROMPTS, "b")
        got = _one_by_one(core, PROMPTS, "a")
        assert core.kv_offload.flush()
        got += _one_by_one(core, PROMPTS, "b")
        assert _tokens(got) == _tokens(want) and [c for _, c in got[6:]] == [28] * 6
        st = core.kv_offload.get_tier_stats()
        assert st.host_blocks_loaded == st.blocks_loaded == 3 * 6 + 6 * 7
    finally:
        core.shutdown()


# -- quantised caches across a restart --------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype,extra", [("int8", {}), ("fp8", {"calculate_kv_scales": True}),
                                            ("fp8", {})])
def test_quantised_cache_restarts_warm(tiny, tmp_path, kv_dtype, extra):  # noqa: F811
    """int8 (scales calculated from the first batch), fp8 with calculated scales, fp8 with 1.0: a
    restart with the same configuration is warm even though its first batch differs, and its tokens
    equal a run without the tier that had the first life's first batch (the scales the files carry)."""
    kw = dict(kv_cache_dtype=kv_dtype, **extra)
    ref = EngineCore(_cfg(tiny, **kw))
    tier = EngineCore(_cfg(tiny, tmp_path, **kw))
    try:
        want = _one_by_one(ref, PROMPTS[:3], "a") + _one_by_one(ref, [PROMPTS[4], PROMPTS[0]], "b")
        _one_by_one(tier, PROMPTS[:3], "a")
    finally:
        tier.shutdown()
    n = len(_files(tmp_path))
    again = EngineCore(_cfg(tiny, tmp_path, **kw))
    try:
        assert again.kv_offload.get_tier_stats().resident_blocks == n
        got = _one_by_one(again, [PROMPTS[4], PROMPTS[0]], "b")       # another first batch
        st = again.kv_offload.get_tier_stats()
        assert _tokens(got) == _tokens(want[3:])
        assert [c for _, c in got] == [24, 28] and st.blocks_discarded == 0 and st.num_failed_loads == 0
    finally:
        again.shutdown()


def test_an_unusable_scales_file_discards_the_quantised_files(tiny, tmp_path, caplog):  # noqa: F811
    core = EngineCore(_cfg(tiny, tmp_path, kv_cache_dtype="int8"))
    try:
        _one_by_one(core, PROMPTS[:1], "a")
        path = os.path.join(core.kv_offload.dir, "scales.json")
    finally:
        core.shutdown()
    n = len(_files(tmp_path))
    with open(path, "w") as f:
        json.dump([[1.0, 1.0]], f)                     # one layer's scales for a 4-layer model
    ref = EngineCore(_cfg(tiny, kv_cache_dtype="int8"))
    again = EngineCore(_cfg(tiny, tmp_path, kv_cache_dtype="int8"))
    try:
        st = again.kv_offload.get_tier_stats()
        assert n > 0 and st.resident_blocks == 0 and st.blocks_discarded == n and _files(tmp_path) == []
        assert any("scales" in r.getMessage() for r in caplog.records)
        got = _one_by_one(again, PROMPTS[:1], "b")
        assert _tokens(got) == _tokens(_one_by_one(ref, PROMPTS[:1], "b")) and got[0][1] == 0
    finally:
        again.shutdown()


# -- prefill-decode disaggregation with the tier ---------------------------------------------------
def test_tier_on_a_prefill_producer_and_a_decode_consumer(tiny, tmp_path):  # noqa: F811
    """Both ends have the tier beside the P/D connector. Two passes over a working set larger than the
    pool: every request is prefilled on the producer (its second pass from the producer's tier), its KV
    pulled by the consumer; greedy tokens equal one engine's, and no block is left held on either side."""
    shm = tmp_path / "shm"
    shm.mkdir()

    def pd(role):
        return json.dumps({"kv_connector": "SharedMemoryConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shm_dir": str(shm)}})

    ref = EngineCore(_cfg(tiny))
    prod = EngineCore(_cfg(tiny, tmp_path / "ptier", kv_transfer_config=pd("kv_producer")))
    cons = EngineCore(_cfg(tiny, tmp_path / "ctier", kv_transfer_config=pd("kv_consumer")))
    try:
        want = _one_by_one(ref, PROMPTS, "a") + _one_by_one(ref, PROMPTS, "b")
        got, prod_cached = [], []
        for tag in ("a", "b"):
            for i, p in enumerate(PROMPTS):
                sp = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
                out = _drive_params(prod, f"p{tag}{i}", p, sp)
                prod_cached.append(out[1])
                sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, kv_transfer_params=out[2])
                got.append(_drive(cons, [(f"d{tag}{i}", p, sp, None)])[f"d{tag}{i}"])
            assert prod.kv_offload.flush() and cons.kv_offload.flush()
        assert _tokens(got) == _tokens(want)
        assert prod_cached[3:] == [24] * 3 + [28] * 6 and prod.kv_offload.get_tier_stats().num_loads == 9
        assert cons.get_stats().kv_transfer.num_transfers == 12
        deadline = time.monotonic() + 30
        while prod.scheduler._kv_held and time.monotonic() < deadline:     # pulled: the producer frees them
            prod.step()
            time.sleep(0.002)
        for c in (prod, cons):
            inv = c.check_invariants()
            assert inv["problems"] == [] and inv["num_free_blocks"] == 16, inv
    finally:
        for c in (prod, cons):
            c.shutdown()


def _drive_params(core, rid, prompt, sp, timeout=120.0):
    """Run one producer request; ``(tokens, cached tokens, kv_transfer_params)``."""
    core.add_request(EngineCoreRequest(rid, list(prompt), sp))
    toks, deadline = [], time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline
        for o in core.step():
            if o.req_id == rid:
                toks += o.new_token_ids
                if o.finish_reason:
                    return toks, o.num_cached_tokens, o.kv_transfer_params
        time.sleep(0.001)
