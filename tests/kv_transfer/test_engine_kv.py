"""Two engine cores in one process (tiny random Llama, float32): KV moved by each connector, greedy parity."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.distributed.conftest import save_tiny_llama
from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

CONNECTORS = ["TcpConnector", "SharedMemoryConnector"]
PROMPT = list(range(5, 42))          # 37 tokens: 9 full blocks of 4 and a partial one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_pd"))


def _cfg(model, role=None, connector="TcpConnector", tmp=None, **extra):
    kw = dict(model=model, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=256)
    if role:
        cfg = {"kv_connector": connector, "kv_role": role, "kv_port": 0,
               "kv_connector_extra_config": {"shm_dir": str(tmp), **extra} if tmp else extra}
        kw["kv_transfer_config"] = json.dumps(cfg)
    return EngineConfig.from_kwargs(**kw)


def _run(core, rid, sp, prompt=PROMPT, timeout=90.0):   # generous: load averages reach 65
    core.add_request(EngineCoreRequest(rid, list(prompt), sp))
    toks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for o in core.step():
            if o.req_id != rid:
                continue
            toks += o.new_token_ids
            if o.finish_reason:
                return toks, o
        time.sleep(0.002)
    raise AssertionError(f"request {rid} did not finish")


def _settle(core, timeout=10.0):
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        core.step()
        time.sleep(0.005)


GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_disaggregated_greedy_equals_colocated(tiny, tmp_path, connector):
    ref = EngineCore(_cfg(tiny))
    prod = EngineCore(_cfg(tiny, "kv_producer", connector, tmp_path))
    cons = EngineCore(_cfg(tiny, "kv_consumer", connector, tmp_path))
    try:
        want, _ = _run(ref, "r", SamplingParams(**GREEDY))
        first, out = _run(prod, "p", SamplingParams(max_tokens=1, temperature=0,
                                                     kv_transfer_params={"do_remote_decode": True}))
        params = out.kv_transfer_params
        assert first == want[:1] and params["do_remote_prefill"] and len(params["remote_block_ids"]) == 10
        if connector == "TcpConnector":   # held for the consumer (shared memory: copied to a file, then freed)
            assert prod.check_invariants()["num_free_blocks"] == 54
        got, _ = _run(cons, "d", SamplingParams(**GREEDY, kv_transfer_params=params))
        assert got == want
        src = cons.get_stats().prompt_tokens_by_source
        # the decode server computed only the last prompt token (for its logits)
        assert src == {"local_compute": 1, "local_cache_hit": 0, "external_kv_transfer": len(PROMPT) - 1}
        kt = cons.get_stats().kv_transfer
        assert kt.num_transfers == 1 and kt.bytes_received == 4 * 2 * 10 * 4 * 2 * 16 * 4   # layers x K,V x blocks x ...
        _settle(prod)
        assert prod.check_invariants()["num_free_blocks"] == 64 and prod.check_invariants()["problems"] == []
        assert prod.get_stats().kv_transfer.bytes_sent == kt.bytes_received
        assert cons.check_invariants()["problems"] == []
    finally:
        for c in (ref, prod, cons):
            c.shutdown()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_producer_gone_before_the_pull_recomputes(tiny, tmp_path, connector):
    ref = EngineCore(_cfg(tiny))
    prod = EngineCore(_cfg(tiny, "kv_producer", connector, tmp_path))
    cons = EngineCore(_cfg(tiny, "kv_consumer", connector, tmp_path, transfer_timeout_s=2))
    try:
        want, _ = _run(ref, "r", SamplingParams(**GREEDY))
        _, out = _run(prod, "p", SamplingParams(max_tokens=1, temperature=0,
                                                 kv_transfer_params={"do_remote_decode": True}))
        time.sleep(0.1)
        prod.shutdown()          # side channel closed, shared-memory file deleted
        got, _ = _run(cons, "d", SamplingParams(**GREEDY, kv_transfer_params=out.kv_transfer_params))
        assert got == want
        kt = cons.get_stats().kv_transfer
        assert kt.num_failed == 1 and kt.num_recomputed == 1 and kt.num_transfers == 0
        assert cons.get_stats().prompt_tokens_by_source["local_compute"] == len(PROMPT)
        assert cons.check_invariants()["problems"] == [] and cons.check_invariants()["num_free_blocks"] == 64
    finally:
        for c in (ref, prod, cons):
            c.shutdown()


def test_wrong_engine_or_request_is_refused_and_recomputed(tiny):
    prod = EngineCore(_cfg(tiny, "kv_producer"))
    cons = EngineCore(_cfg(tiny, "kv_consumer"))
    try:
        _, out = _run(prod, "p", SamplingParams(max_tokens=1, temperature=0,
                                                 kv_transfer_params={"do_remote_decode": True}))
        bad = dict(out.kv_transfer_params, remote_request_id="nope")
        _run(cons, "d", SamplingParams(max_tokens=2, kv_transfer_params=bad))
        assert cons.get_stats().kv_transfer.num_recomputed == 1
        bad = dict(out.kv_transfer_params, remote_engine_id="other")
        _run(cons, "e", SamplingParams(max_tokens=2, kv_transfer_params=bad))
        assert cons.get_stats().kv_transfer.num_recomputed == 2
        _settle(prod, timeout=0.5)
        assert prod.check_invariants()["num_free_blocks"] == 54     # still held for the real consumer
        good, _ = _run(cons, "f", SamplingParams(max_tokens=2, kv_transfer_params=out.kv_transfer_params))
        assert cons.get_stats().kv_transfer.num_transfers == 1
        _settle(prod)
        assert prod.check_invariants()["num_free_blocks"] == 64
    finally:
        prod.shutdown()
        cons.shutdown()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_release_frees_the_kept_kv_at_once(tiny, tmp_path, connector):
    """The router's release (decode leg failed) frees the producer's hold now, not after abort_timeout_s;
    a consumer that comes anyway recomputes."""
    ref = EngineCore(_cfg(tiny))
    prod = EngineCore(_cfg(tiny, "kv_producer", connector, tmp_path, abort_timeout_s=600))
    cons = EngineCore(_cfg(tiny, "kv_consumer", connector, tmp_path, transfer_timeout_s=2))
    try:
        want, _ = _run(ref, "r", SamplingParams(**GREEDY))
        _, out = _run(prod, "p", SamplingParams(max_tokens=1, temperature=0,
                                                 kv_transfer_params={"do_remote_decode": True}))
        params = out.kv_transfer_params
        assert prod.release_kv([("another-engine", "p"), (None, "unknown")]) == 0
        if connector == "SharedMemoryConnector":   # the file exists before it is released
            deadline = time.monotonic() + 10
            while not os.path.exists(params["remote_shm_path"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert os.path.exists(params["remote_shm_path"])
        assert prod.release_kv([(params["remote_engine_id"], "p")]) == 1
        assert prod.release_kv([(None, "p")]) == 0          # once
        _settle(prod, timeout=5)
        inv = prod.check_invariants()
        assert inv["num_free_blocks"] == 64 and inv["problems"] == [] and not prod.has_unfinished_requests()
        kt = prod.get_stats().kv_transfer
        assert kt.num_released == 1 and kt.num_expired == 0
        if connector == "SharedMemoryConnector":
            assert not os.path.exists(params["remote_shm_path"])
        got, _ = _run(cons, "d", SamplingParams(**GREEDY, kv_transfer_params=params))
        assert got == want
        assert cons.get_stats().kv_transfer.num_recomputed == 1
    finally:
        for c in (ref, prod, cons):
            c.shutdown()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_consumer_that_ends_a_request_before_the_pull_frees_the_producer_at_once(tiny, tmp_path, connector):
    """Issue 30: every path on which the consumer ends a transfer early frees the producer's KV now
    (not after abort_timeout_s): the consumer's release (what a decode server sends when it refused
    the request, kv_transfer/notify.py) and a consumer engine that decides to recompute the prompt
    instead of loading it (here: prompt logprobs, which need the prompt computed)."""
    from tokenmill.kv_transfer.notify import release_remote

    prod = EngineCore(_cfg(tiny, "kv_producer", connector, tmp_path, abort_timeout_s=600))
    cons = EngineCore(_cfg(tiny, "kv_consumer", connector, tmp_path, transfer_timeout_s=5))
    try:
        base = prod.check_invariants()["num_free_blocks"]
        held = []
        for i in range(4):
            _, out = _run(prod, f"p{i}", SamplingParams(max_tokens=1, temperature=0,
                                                         kv_transfer_params={"do_remote_decode": True}),
                          prompt=[p + i for p in PROMPT])
            held.append(out.kv_transfer_params)
        _settle(prod, timeout=0.5)
        if connector == "TcpConnector":
            assert prod.check_invariants()["num_free_blocks"] == base - 4 * 10    # kept for a consumer
        else:       # the shared-memory producer frees its blocks once the file is written
            deadline = time.monotonic() + 10
            while not all(os.path.exists(p["remote_shm_path"]) for p in held) and time.monotonic() < deadline:
                time.sleep(0.01)
        # a refusal on the decode side (the API process calls this): freed at once
        for p in held[:3]:
            assert release_remote(p)
        assert not release_remote(held[0]) and not release_remote(None) and not release_remote({"x": 1})
        # the consumer engine declines to load (prompt logprobs): it tells the producer itself
        _run(cons, "d3", SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1,
                                        kv_transfer_params=held[3]), prompt=[p + 3 for p in PROMPT])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            _settle(prod, timeout=0.2)
            if prod.check_invariants()["num_free_blocks"] == base and (connector == "TcpConnector" or not any(
                    os.path.exists(p["remote_shm_path"]) for p in held)):
                break
            time.sleep(0.02)
        inv = prod.check_invariants()
        assert inv["num_free_blocks"] == base and inv["problems"] == [] and not prod.has_unfinished_requests()
        if connector == "TcpConnector":
            assert prod.get_stats().kv_transfer.num_released == 4 and prod.get_stats().kv_transfer.num_expired == 0
        else:
            assert not any(os.path.exists(p["remote_shm_path"]) for p in held)
        # a later prefill is served at once
        _, out = _run(prod, "later", SamplingParams(max_tokens=1, temperature=0), timeout=30)
        assert out.finish_reason == "length"
    finally:
        for c in (prod, cons):
            c.shutdown()


def test_release_during_a_pull_frees_nothing_the_pull_reads(tiny):
    prod = EngineCore(_cfg(tiny, "kv_producer", abort_timeout_s=600))
    try:
        _run(prod, "p", SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True}))
        c = prod.kv_connector
        with c._lock:                                   # what the side channel does when a pull is accepted
            assert c._begin_transfer_locked("p")
            assert not c._begin_transfer_locked("p")    # a second pull of the same KV is refused
        assert prod.release_kv([(None, "p")]) == 0
        _settle(prod, timeout=0.3)
        assert prod.check_invariants()["num_free_blocks"] == 54    # still held: the pull reads the blocks
        c._end_transfer("p", 123)
        _settle(prod)
        assert prod.check_invariants()["num_free_blocks"] == 64
        assert prod.get_stats().kv_transfer.num_released == 0 and prod.get_stats().kv_transfer.bytes_sent == 123
    finally:
        prod.shutdown()


def test_start_up_errors(tiny):
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        EngineCore(EngineConfig.from_kwargs(model=tiny, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=8,
                                            kv_transfer_config='{"kv_connector": "TcpConnector", "kv_port": 0}'))
    with pytest.raises(ValueError, match="tensor and pipeline"):
        EngineCore(EngineConfig.from_kwargs(model=tiny, tensor_parallel_size=2, num_kv_blocks=8,
                                            kv_transfer_config='{"kv_connector": "TcpConnector", "kv_port": 0}'))


def test_cli_refuses_kv_transfer_combinations_in_one_line(capsys):
    """A quantised KV cache or TP with ``--kv-transfer-config`` is refused by the CLI in one line, before any
    process starts (it used to get as far as the engine core and print its traceback)."""
    from tokenmill import cli

    kvt = '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 0}'
    for extra, needle in ((["--kv-cache-dtype", "fp8"], "needs --kv-cache-dtype auto"),
                          (["--tensor-parallel-size", "2"], "needs one rank per engine")):
        args = cli.build_parser().parse_args(["serve", "--kv-transfer-config", kvt, *extra])
        assert cli._config_or_exit(args, "serve") is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    ok = cli.build_parser().parse_args(["serve", "--kv-transfer-config", kvt])
    assert cli._config_or_exit(ok, "serve") is not None
