"""The KV offloading tier (``--kv-offloading-backend native``) on a tiny random Llama: parity, reload,
warm restart, bad files, a full disk, data-parallel directories, events, and disaggregation beside it."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest

from tests.distributed.conftest import save_tiny_llama
from tokenmill.config import EngineConfig
from tokenmill.core.kv_events import BlockRemoved, BlockStored
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.kv_transfer.offloading import SUFFIX, decode_header, encode_header
from tokenmill.sampling_params import SamplingParams

BS = 4
DOCS = [list(range(10 + 30 * d, 10 + 30 * d + 24)) for d in range(3)]      # 3 shared prefixes, 6 blocks each
PROMPTS = [DOCS[i % 3] + [5 + i, 6 + i, 7 + i, 8 + i, 9 + i, 3] for i in range(6)]   # 30 tokens each


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_tier"))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The engines here (and their mp workers, through the environment) run one torch thread: a step of
    the tiny model is microseconds of work, and two OpenMP threads on cores shared with other jobs wait
    for each other at every op (this module took 260 s with two threads at load 5-8 on the 2-core EPYC,
    its in-process tests 10-20x longer than with one). Nothing here depends on the thread count: every
    comparison is between engines built alike. The process's thread count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_NUM_THREADS", "1")
        yield
    torch.set_num_threads(before)


def _cfg(model, tier_dir=None, size_gib=0.01, **kw):
    base = dict(model=model, dtype="float32", block_size=BS, num_kv_blocks=16, max_model_len=256)
    if tier_dir is not None:
        base.update(kv_offloading_backend="native", kv_offloading_size=size_gib, kv_offloading_dir=str(tier_dir))
    base.update(kw)
    return EngineConfig.from_kwargs(**base)


def _drive(core, reqs, timeout=120.0):
    """Submit ``[(rid, prompt, sampling params, salt)]`` at once; step until all finish.

    Returns ``{rid: (tokens, num_cached_tokens)}``."""
    for rid, prompt, sp, salt in reqs:
        core.add_request(EngineCoreRequest(rid, list(prompt), sp, cache_salt=salt))
    toks = {r[0]: [] for r in reqs}
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(reqs):
        if time.monotonic() >= deadline:      # (say where they are: a load never reported, or just a slow machine)
            tier = getattr(core, "kv_offload", None)
            raise AssertionError(f"requests did not finish in {timeout:.0f} s: {set(toks) - set(out)}; waiting for "
                                 f"tier/remote KV: {sorted(core.scheduler.waiting_for_remote)}, tier loads in flight: "
                                 f"{sorted(getattr(tier, '_inflight', {}))}, steps {core.num_steps}")
        for o in core.step():
            if o.req_id in toks:
                toks[o.req_id] += o.new_token_ids
                if o.finish_reason:
                    assert o.finish_reason == "length", o.error
                    out[o.req_id] = (toks[o.req_id], o.num_cached_tokens)
        time.sleep(0.001)
    return out


def _greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _one_by_one(core, prompts, tag, salt=None, n=6):
    out = {}
    for i, p in enumerate(prompts):
        out.update(_drive(core, [(f"{tag}{i}", p, _greedy(n), salt)]))
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def _hashes(prompt):
    from tokenmill.core.prefix_cache import hash_block_tokens

    out, parent = [], None
    for i in range(len(prompt) // BS):
        parent = hash_block_tokens(parent, prompt[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


def _files(root):
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(SUFFIX))


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8")])
def test_greedy_equal_with_and_without_the_tier(tiny, tmp_path, dtype, kv_dtype):
    """Two passes over a working set larger than the pool: the tier serves the second pass's prefixes
    (exact bytes of the first pass's K/V), and the greedy tokens equal a run without the tier."""
    ref = EngineCore(_cfg(tiny, dtype=dtype, kv_cache_dtype=kv_dtype))
    tier = EngineCore(_cfg(tiny, tmp_path, dtype=dtype, kv_cache_dtype=kv_dtype))
    try:
        want = _one_by_one(ref, PROMPTS, "a") + _one_by_one(ref, PROMPTS, "b")
        got1 = _one_by_one(tier, PROMPTS, "a")
        assert tier.kv_offload.flush()
        got2 = _one_by_one(tier, PROMPTS, "b")
        assert [t for t, _ in got1 + got2] == [t for t, _ in want]
        st = tier.kv_offload.get_tier_stats()
        assert st.num_failed_loads == 0 and st.blocks_loaded > 0 and st.hits == st.blocks_loaded * BS
        # the pool (16 blocks) cannot hold 3 documents: the reference recomputes, the tier run loads
        ref_cached = sum(c for _, c in want[6:])
        tier_cached = sum(c for _, c in got2)
        assert tier_cached == 6 * 28 and tier_cached > ref_cached     # everything but the last, partial block
        src = tier.get_stats().prompt_tokens_by_source
        assert src["external_kv_transfer"] == st.hits
        assert tier.check_invariants()["problems"] == []
    finally:
        tier.shutdown()


def test_eviction_into_the_tier_and_reload(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        (first, c0), = _one_by_one(core, [PROMPTS[0]], "x")
        assert c0 == 0
        assert core.kv_offload.flush()
        # write-through: the prompt's 7 full blocks and the output's (30 + 6 - 1 = 35 tokens: 8 full) are files
        assert len(_files(tmp_path)) == 8
        _one_by_one(core, PROMPTS[1:3], "fill")          # other documents evict PROMPTS[0]'s blocks from the pool
        pool = core.scheduler.kv_cache_manager.block_pool
        assert not any(pool.get_cached_block(h) for h in _hashes(PROMPTS[0]))
        (again, c1), = _one_by_one(core, [PROMPTS[0]], "y")
        assert again == first and c1 == 28
        st = core.kv_offload.get_tier_stats()
        assert st.num_loads == 1 and st.blocks_loaded == 7 and st.queries == 3 * 30 + 30
        assert st.hits == 28 and st.resident_blocks == len(_files(tmp_path))
    finally:
        core.shutdown()


def test_short_tier_runs_are_recomputed(tiny, tmp_path):
    """min_load_blocks: a tier run shorter than the crossover is recomputed, not loaded."""
    core = EngineCore(_cfg(tiny, tmp_path), kv_offloading_options={"min_load_blocks": 8})
    try:
        (first, _), = _one_by_one(core, [PROMPTS[0]], "x")
        assert core.kv_offload.flush()
        _one_by_one(core, PROMPTS[1:3], "fill")
        (again, cached), = _one_by_one(core, [PROMPTS[0]], "y")
        st = core.kv_offload.get_tier_stats()
        assert again == first and st.num_loads == 0 and st.num_skipped_short == 1
        assert cached < 28
    finally:
        core.shutdown()


def test_min_load_blocks_from_the_environment(tiny, tmp_path, monkeypatch):
    """TOKENMILL_KV_OFFLOAD_MIN_LOAD_BLOCKS sets the crossover a served engine uses; the options win."""
    monkeypatch.setenv("TOKENMILL_KV_OFFLOAD_MIN_LOAD_BLOCKS", "8")
    core = EngineCore(_cfg(tiny, tmp_path))
    other = EngineCore(_cfg(tiny, tmp_path / "b"), kv_offloading_options={"min_load_blocks": 2})
    try:
        assert core.kv_offload.tier_config.min_load_blocks == 8
        assert other.kv_offload.tier_config.min_load_blocks == 2
    finally:
        core.shutdown()
        other.shutdown()
    monkeypatch.setenv("TOKENMILL_KV_OFFLOAD_MIN_LOAD_BLOCKS", "0")
    with pytest.raises(ValueError, match="MIN_LOAD_BLOCKS"):
        EngineCore(_cfg(tiny, tmp_path / "c"))


def test_restart_starts_warm(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        want = _one_by_one(core, PROMPTS[:3], "a")
    finally:
        core.shutdown()                  # drains the writer
    n_files = len(_files(tmp_path))
    assert n_files == 3 * 8
    again = EngineCore(_cfg(tiny, tmp_path))
    try:
        assert again.kv_offload.get_tier_stats().resident_blocks == n_files
        got = _one_by_one(again, PROMPTS[:3], "b")
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [c for _, c in got] == [28, 28, 28]
        assert again.kv_offload.get_tier_stats().num_loads == 3
    finally:
        again.shutdown()


def _rewrite_header(path, **changes):
    data = open(path, "rb").read()
    header, off = decode_header(data)
    header.update(changes)
    with open(path, "wb") as f:
        f.write(encode_header(header) + data[off:])


def test_corrupt_and_mismatched_files_are_discarded(tiny, tmp_path, caplog):
    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        want = _one_by_one(core, PROMPTS[:3], "a")
    finally:
        core.shutdown()
    files = _files(tmp_path)
    by_prompt = {}
    for f in files:
        header, _ = decode_header(open(f, "rb").read())
        by_prompt.setdefault(header["token_ids"][0], []).append((f, header))
    # prompt 0: a flipped payload byte (found by the checksum, at load time)
    f0 = min(by_prompt[PROMPTS[0][0]], key=lambda fh: fh[1]["parent"] is not None)[0]   # its first block
    data = bytearray(open(f0, "rb").read())
    data[-5] ^= 0xFF
    open(f0, "wb").write(bytes(data))
    # prompt 1: a block's header says another model dtype (found when the directory is scanned)
    f1, h1 = min(by_prompt[PROMPTS[1][0]], key=lambda fh: fh[1]["parent"] is not None)
    _rewrite_header(f1, identity={**h1["identity"], "model_dtype": "bfloat16"})
    # and an unreadable file
    garbage = os.path.join(os.path.dirname(f1), "ab" * 32 + SUFFIX)
    open(garbage, "wb").write(b"not a tier file")
    again = EngineCore(_cfg(tiny, tmp_path))
    try:
        st = again.kv_offload.get_tier_stats()
        assert st.blocks_discarded == 2 and not os.path.exists(f1) and not os.path.exists(garbage)
        got = _one_by_one(again, PROMPTS[:3], "b")
        assert [t for t, _ in got] == [t for t, _ in want]      # nothing bad was ever loaded
        st = again.kv_offload.get_tier_stats()
        assert st.num_failed_loads == 1 and st.blocks_discarded == 3
        assert again.kv_offload.flush() and open(f0, "rb").read() != bytes(data)   # rewritten by the recompute
        # prompt 0 recomputed (its load failed), prompt 1's first block is gone (no tier run), prompt 2 loaded
        assert [c for _, c in got] == [0, 0, 28]
        assert any("checksum mismatch" in r.getMessage() for r in caplog.records)
        assert any("another configuration" in r.getMessage() for r in caplog.records)
        assert again.check_invariants()["problems"] == []
    finally:
        again.shutdown()


def test_another_configuration_never_sees_the_files(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        want = _one_by_one(core, PROMPTS[:1], "a")
    finally:
        core.shutdown()
    other = EngineCore(_cfg(tiny, tmp_path, kv_cache_dtype="bfloat16"))
    try:
        assert other.kv_offload.get_tier_stats().resident_blocks == 0
        assert other.kv_offload.dir != core.kv_offload.dir
        got = _one_by_one(other, PROMPTS[:1], "b")
        assert got[0][1] == 0 and len(got[0][0]) == len(want[0][0])
    finally:
        other.shutdown()


def test_a_full_disk_stops_writes_and_serving_continues(tiny, tmp_path, caplog):
    core = EngineCore(_cfg(tiny, tmp_path))
    calls = []

    def full(path, head, payload):
        calls.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    core.kv_offload.stores[0]._write_file = full
    ref = EngineCore(_cfg(tiny))
    try:
        want = _one_by_one(ref, PROMPTS[:3], "a")
        got = _one_by_one(core, PROMPTS[:3], "a")
        assert core.kv_offload.flush()
        assert [t for t, _ in got] == [t for t, _ in want]
        st = core.kv_offload.get_tier_stats()
        assert st.write_errors == 1 and len(calls) == 1 and st.writes_paused and st.saves_dropped > 0
        assert st.resident_blocks == 0 and _files(tmp_path) == []
        assert not [f for dp, _, fs in os.walk(tmp_path) for f in fs if ".tmp" in f]    # no partial file left
        assert any("disk full" in r.getMessage() for r in caplog.records)
    finally:
        core.shutdown()


def test_the_size_limit_keeps_the_newest_blocks(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path))
    block_file = core.kv_offload.stores[0].block_nbytes + 2048
    core.shutdown()
    limit = 10 * block_file
    core = EngineCore(_cfg(tiny, tmp_path, size_gib=limit / 2**30))
    try:
        _one_by_one(core, PROMPTS[:3], "a")
        assert core.kv_offload.flush()
        st = core.kv_offload.get_tier_stats()
        assert st.resident_bytes <= limit and st.blocks_evicted == st.blocks_stored - st.resident_blocks > 0
        assert sum(os.path.getsize(f) for f in _files(tmp_path)) == st.resident_bytes
    finally:
        core.shutdown()


def test_salts_never_share_tier_blocks(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        _one_by_one(core, PROMPTS[:1], "a", salt="alice")
        assert core.kv_offload.flush()
        _one_by_one(core, PROMPTS[1:3], "fill")
        (_, bob), = _one_by_one(core, PROMPTS[:1], "b", salt="bob")
        (_, alice), = _one_by_one(core, PROMPTS[:1], "c", salt="alice")
        assert bob == 0 and alice == 28
    finally:
        core.shutdown()


def test_concurrent_chunked_prefill_and_preemption(tiny, tmp_path):
    """All six at once, 8-token steps, a pool too small for them: chunked prefill and preemption
    around tier loads; greedy tokens equal the reference and no block leaks."""
    kw = dict(max_num_batched_tokens=8, num_kv_blocks=24)
    ref = EngineCore(_cfg(tiny, **kw))
    tier = EngineCore(_cfg(tiny, tmp_path, **kw))
    try:
        reqs = lambda tag: [(f"{tag}{i}", p, _greedy(12), None) for i, p in enumerate(PROMPTS)]   # noqa: E731
        # (300 s: 8-token steps of six requests took >120 s once on the shared machine at load ~10)
        want = {**_drive(ref, reqs("a"), 300), **_drive(ref, reqs("b"), 300)}
        got = _drive(tier, reqs("a"), 300)
        assert tier.kv_offload.flush()
        got.update(_drive(tier, reqs("b"), 300))
        assert {k: t for k, (t, _) in got.items()} == {k: t for k, (t, _) in want.items()}
        assert tier.scheduler.num_preemptions_total > 0
        assert tier.kv_offload.get_tier_stats().num_loads > 0
        assert tier.check_invariants()["problems"] == [] and tier.check_invariants()["num_free_blocks"] == 24
    finally:
        tier.shutdown()


def test_kv_events_name_the_tier(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path, size_gib=(4 * 4100) / 2**30))
    pool = core.scheduler.kv_cache_manager.block_pool
    pool.enable_kv_events()
    try:
        _one_by_one(core, PROMPTS[:1], "a")
        assert core.kv_offload.flush()
        core.step()                                      # hands the writer's events to the pool
        events = pool.take_kv_events()
        disk = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
        pool_stored = [e for e in events if isinstance(e, BlockStored) and e.medium is None]
        assert pool_stored and len(disk) == core.kv_offload.get_tier_stats().blocks_stored
        assert disk[0].parent_block_hash is None and disk[0].token_ids == PROMPTS[0][:BS]
        assert disk[1].parent_block_hash == disk[0].block_hashes[0]
        removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes]
        assert removed and core.kv_offload.get_tier_stats().blocks_evicted == len(removed)
    finally:
        core.shutdown()


def test_data_parallel_cores_keep_their_own_files(tiny, tmp_path):
    """Two cores (ranks 0 and 1) over one directory: each writes, evicts and reloads only its own files;
    a second process with the same rank takes the next free directory (flock); both restart warm."""
    cores = [EngineCore(_cfg(tiny, tmp_path), data_parallel_rank=r) for r in (0, 1)]
    try:
        dirs = [c.kv_offload.dir for c in cores]
        assert [os.path.basename(d) for d in dirs] == ["dp0", "dp1"]
        intruder = EngineCore(_cfg(tiny, tmp_path), data_parallel_rank=0)
        assert os.path.basename(intruder.kv_offload.dir) == "dp0.1"
        intruder.shutdown()
        want0 = _one_by_one(cores[0], PROMPTS[:3], "a")
        want1 = _one_by_one(cores[1], PROMPTS[3:], "a")
        for c in cores:
            assert c.kv_offload.flush()
        files = [set(_files(d)) for d in dirs]
        assert len(files[0]) == len(files[1]) == 24 and not files[0] & files[1]
    finally:
        for c in cores:
            c.shutdown()
    again = [EngineCore(_cfg(tiny, tmp_path), data_parallel_rank=r) for r in (0, 1)]
    try:
        got0 = _one_by_one(again[0], PROMPTS[:3], "b")
        got1 = _one_by_one(again[1], PROMPTS[3:], "b")
        assert [t for t, _ in got0] == [t for t, _ in want0] and [t for t, _ in got1] == [t for t, _ in want1]
        assert [c for _, c in got0 + got1] == [28] * 6
    finally:
        for c in again:
            c.shutdown()


def test_evict_policy_saves_blocks_as_they_leave_the_pool(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path), kv_offloading_options={"store_policy": "evict"})
    try:
        (first, _), = _one_by_one(core, [PROMPTS[0]], "x")
        assert core.kv_offload.flush() and _files(tmp_path) == []       # still in the pool: nothing written
        _one_by_one(core, PROMPTS[1:3], "fill")
        assert core.kv_offload.flush() and len(_files(tmp_path)) > 0
        (again, cached), = _one_by_one(core, [PROMPTS[0]], "y")
        assert again == first and cached == 28
        before = len(_files(tmp_path))
        resident = len(core.scheduler.kv_cache_manager.block_pool.cached_blocks)
    finally:
        core.shutdown()                                  # writes the pool's resident blocks
    assert resident > 0 and len(_files(tmp_path)) > before


def test_tier_beside_disaggregation(tiny, tmp_path):
    """A decode server with both a P/D connector and the tier: a P/D request pulls its KV from the
    producer; a plain request later finds the same prompt in the tier."""
    shm = tmp_path / "shm"
    shm.mkdir()

    def pd(role):
        return json.dumps({"kv_connector": "SharedMemoryConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shm_dir": str(shm)}})

    ref = EngineCore(_cfg(tiny))
    prod = EngineCore(_cfg(tiny, kv_transfer_config=pd("kv_producer")))
    cons = EngineCore(_cfg(tiny, tmp_path / "tier", kv_transfer_config=pd("kv_consumer")))
    try:
        want = _one_by_one(ref, PROMPTS[:1], "r")[0][0]
        sp = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
        prod.add_request(EngineCoreRequest("p", list(PROMPTS[0]), sp))
        params = None
        while params is None:
            for o in prod.step():
                if o.finish_reason:
                    params = o.kv_transfer_params
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, kv_transfer_params=params)
        got = _drive(cons, [("d", PROMPTS[0], sp, None)])["d"][0]
        assert got == want
        assert cons.get_stats().kv_transfer.num_transfers == 1
        assert cons.kv_offload.flush()
        _one_by_one(cons, PROMPTS[1:3], "fill")
        (again, cached), = _one_by_one(cons, PROMPTS[:1], "t")
        assert again == want and cached == 28 and cons.kv_offload.get_tier_stats().num_loads == 1
    finally:
        for c in (prod, cons):
            c.shutdown()


def test_config_errors():
    with pytest.raises(ValueError, match="kv-offloading-size"):
        EngineConfig.from_kwargs(kv_offloading_backend="native")
    with pytest.raises(ValueError, match="prefix"):
        EngineConfig.from_kwargs(kv_offloading_backend="native", kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="host-size"):
        EngineConfig.from_kwargs(kv_offloading_backend="native", kv_offloading_size=1, kv_offloading_host_size=-1)
    with pytest.raises(ValueError, match="native"):
        EngineConfig.from_kwargs(kv_offloading_backend="lmcache", kv_offloading_size=1)


def test_int8_cache_with_calculated_scales(tiny, tmp_path):
    """int8 KV: scales come from the first batch. Files carry them; within a run the tier serves exact
    blocks (greedy equal to a run without the tier that saw the same first batch). A restart with the
    same configuration takes the files' scales and is warm: test_offloading_ranks.py."""
    ref = EngineCore(_cfg(tiny, kv_cache_dtype="int8"))
    tier = EngineCore(_cfg(tiny, tmp_path, kv_cache_dtype="int8"))
    try:
        want = _one_by_one(ref, PROMPTS[:3], "a") + _one_by_one(ref, PROMPTS[:3], "b")
        got = _one_by_one(tier, PROMPTS[:3], "a")
        assert tier.kv_offload.flush()
        got += _one_by_one(tier, PROMPTS[:3], "b")
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [c for _, c in got[3:]] == [28, 28, 28]
        header, _ = decode_header(open(_files(tmp_path)[0], "rb").read())
        assert len(header["scales"]) == 4 and all(k > 0 and v > 0 for k, v in header["scales"])
    finally:
        tier.shutdown()


def test_prometheus_series(tiny, tmp_path):
    from tokenmill.metrics.prometheus import PrometheusStatLogger

    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        _one_by_one(core, PROMPTS[:3], "a")
        assert core.kv_offload.flush()
        _one_by_one(core, PROMPTS[:1], "b")
        exporter = PrometheusStatLogger("tiny", 256)
        exporter.record(core.get_stats(), None)
        text = exporter.render().decode()
    finally:
        core.shutdown()
    assert 'tokenmill:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 28.0' in text
    assert 'tokenmill:kv_offload_blocks_total{direction="load",engine="0",model_name="tiny"} 7.0' in text
    assert "tokenmill:kv_offload_usage_bytes" in text


def test_a_finished_load_is_admitted_by_the_next_step(tiny, tmp_path):
    """A load that ended between two steps is handed to the scheduler before it schedules, so the next
    step computes the request's first token (it used to take one more step, plus the loop's idle wait:
    one loaded block then lost to one recomputed)."""
    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        _one_by_one(core, PROMPTS[:3], "a")
        assert core.kv_offload.flush()
        store = core.kv_offload.stores[0]
        gate, run_load = threading.Event(), store._run_load
        store._run_load = lambda spec, cancel: (gate.wait(30), run_load(spec, cancel))
        core.add_request(EngineCoreRequest("x", list(PROMPTS[0]), _greedy(1)))
        assert core.step() == [] and "x" in core.scheduler.waiting_for_remote     # ordered the load; held
        gate.set()
        assert store.wait_for_load(30)                 # the load ended between the steps
        (out,) = core.step()
        assert out.req_id == "x" and out.finish_reason == "length" and out.num_cached_tokens == 28
        assert core.kv_offload.get_tier_stats().num_loads == 1
        assert core.check_invariants()["problems"] == []
    finally:
        core.shutdown()


def test_abort_while_loading_leaks_nothing(tiny, tmp_path):
    core = EngineCore(_cfg(tiny, tmp_path))
    try:
        _one_by_one(core, PROMPTS[:3], "a")
        assert core.kv_offload.flush()
        # hold the load thread until the abort is in: a load that finished within the step (a quiet
        # machine) would leave nothing to abort
        gate, run_load = threading.Event(), core.kv_offload.stores[0]._run_load
        core.kv_offload.stores[0]._run_load = lambda spec, cancel: (gate.wait(30), run_load(spec, cancel))
        core.add_request(EngineCoreRequest("x", list(PROMPTS[0]), _greedy()))
        core.step()                                       # schedules the tier load
        assert "x" in core.scheduler.waiting_for_remote
        core.abort_requests(["x"])
        gate.set()
        deadline = time.monotonic() + 30
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            core.step()
            time.sleep(0.002)
        inv = core.check_invariants()
        assert inv["problems"] == [] and inv["num_free_blocks"] == 16 and not core.has_unfinished_requests()
        assert core.kv_offload.index.pins == {}
        (_, c), = _one_by_one(core, PROMPTS[:1], "y")      # the tier still serves the prompt
        assert c == 28
    finally:
        core.shutdown()
