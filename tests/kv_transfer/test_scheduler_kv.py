"""Scheduler + the pull connector's logic, model-free: WAITING_FOR_REMOTE_KVS, jumps, recompute, delay free, aborts."""

from __future__ import annotations

import threading
import time

import pytest

from tests.core.test_scheduler import BS, FakeRunner, make_req, make_sched, step
from tokenmill.config import KVTransferConfig
from tokenmill.core.request import RequestStatus
from tokenmill.kv_transfer.base import KVTransferError, PullConnector
from tokenmill.kv_transfer.params import validate_kv_transfer_params


class ScriptedConnector(PullConnector):
    """A pull connector whose transport is scripted: loads wait for ``release`` and then succeed or fail."""

    def __init__(self, role="kv_both", fail=False, **extra):
        super().__init__(KVTransferConfig(kv_role=role, kv_connector_extra_config=extra), BS)
        self.release = threading.Event()
        self.fail = fail
        self.published: dict[str, list[int]] = {}
        self.loads: list = []

    def _publish(self, req_id, block_ids):
        self.published[req_id] = block_ids

    def _load(self, spec, cancel, deadline):
        self.loads.append(spec)
        while not self.release.wait(0.01):
            if cancel.is_set():
                raise KVTransferError("cancelled")
        if self.fail:
            raise KVTransferError("peer went away")
        return 1000


def remote(prompt_len, ids=None):
    return {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "x",
            "remote_block_ids": ids or list(range(100, 100 + -(-prompt_len // BS))), "remote_num_tokens": prompt_len,
            "remote_block_size": BS}


def kv_step(sched, conn, runner=None):
    """One engine step as EngineCore runs it (schedule, worker side, update, connector results)."""
    so = sched.schedule()
    conn.start_load_kv(so.kv_connector_metadata)
    outs = sched.update_from_output(so, (runner or FakeRunner())(so))
    conn.start_load_kv(conn.build_connector_meta())
    done = conn.get_finished()
    sched.update_from_kv_connector(done.finished_sending, done.finished_recving, done.failed_recving)
    return so, {o.req_id: o for o in outs}


def wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def make(conn, **kw):
    s = make_sched(**kw)
    s.kv_connector = conn
    return s


def test_waiting_for_remote_kv_does_not_hold_the_scheduler_then_jumps():
    conn = ScriptedConnector()
    s = make(conn, num_blocks=16)
    a = make_req("a", 10, kv_transfer_params=remote(10), temperature=0)
    b = make_req("b", 6)
    s.add_request(a)
    s.add_request(b)
    so, _ = kv_step(s, conn)
    assert [r.req_id for r in so.scheduled] == ["b"]           # a takes no budget and no seat
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(s.kv_cache_manager.get_block_ids("a")) == 3       # blocks for the whole prompt
    for _ in range(3):                                            # b keeps stepping while a loads
        so, outs = kv_step(s, conn)
        assert [r.req_id for r in so.scheduled] == ["b"] and "b" in outs
    spec = conn.loads[0]
    assert spec.remote_block_ids == [100, 101, 102] and spec.local_block_ids == s.kv_cache_manager.get_block_ids("a")
    conn.release.set()
    wait_for(lambda: not conn._pool._work_queue.qsize() and conn.stats.num_transfers == 1)
    kv_step(s, conn)  # picks up the finished load
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 9
    so, outs = kv_step(s, conn)
    sr = {r.req_id: r for r in so.scheduled}["a"]
    assert sr.num_computed_tokens == 9 and sr.token_ids == [a.prompt_token_ids[-1]] and sr.sample
    assert outs["a"].new_token_ids == [7]
    assert s.prompt_tokens_by_source["external_kv_transfer"] == 9
    assert s.check_invariants() == []


def test_failed_load_recomputes_the_prompt_and_is_counted():
    conn = ScriptedConnector(fail=True)
    s = make(conn)
    a = make_req("a", 10, kv_transfer_params=remote(10))
    s.add_request(a)
    kv_step(s, conn)
    conn.release.set()
    wait_for(lambda: conn.stats.num_failed == 1)
    kv_step(s, conn)
    assert conn.stats.num_recomputed == 1 and a.num_computed_tokens == 0
    so, outs = kv_step(s, conn)
    assert so.scheduled[0].num_computed_tokens == 0 and len(so.scheduled[0].token_ids) == 10
    assert outs["a"].new_token_ids == [7]
    assert s.check_invariants() == []


def test_abort_while_loading_holds_blocks_until_the_load_stops():
    conn = ScriptedConnector()
    s = make(conn, num_blocks=8)
    s.add_request(make_req("a", 10, kv_transfer_params=remote(10)))
    kv_step(s, conn)
    wait_for(lambda: len(conn.loads) == 1)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 5     # still held: the load thread may write into them
    assert s.check_invariants() == []
    assert s.has_unfinished_requests()
    deadline = time.monotonic() + 60     # the load thread notices the cancel within 10 ms, on a quiet machine
    while time.monotonic() < deadline:
        kv_step(s, conn)
        if s.kv_cache_manager.num_free_blocks == 8:
            break
        time.sleep(0.005)
    assert s.kv_cache_manager.num_free_blocks == 8 and s.check_invariants() == []
    assert not s.has_unfinished_requests()


def test_abort_before_the_load_starts():
    conn = ScriptedConnector()
    s = make(conn, num_blocks=8)
    s.add_request(make_req("a", 10, kv_transfer_params=remote(10)))
    so = s.schedule()                        # load decided, worker side not yet run
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    conn.start_load_kv(so.kv_connector_metadata)
    failed: set = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = conn.get_finished()
        failed |= done.failed_recving
        s.update_from_kv_connector(done.finished_sending, done.finished_recving, done.failed_recving)
        if failed:
            break
        time.sleep(0.005)
    assert failed == {"a"} and conn.stats.num_failed == 0     # a cancel is no failure
    assert s.kv_cache_manager.num_free_blocks == 8 and s.check_invariants() == []


def test_producer_keeps_blocks_until_sent_or_expired():
    conn = ScriptedConnector(role="kv_producer", abort_timeout_s=0.2)
    s = make(conn, num_blocks=8)
    a = make_req("a", 10, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    b = make_req("b", 10, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    _, outs = kv_step(s, conn)
    params = outs["a"].kv_transfer_params
    assert outs["a"].finish_reason == "length" and params["do_remote_prefill"] is True
    assert params["remote_block_ids"] == conn.published["a"] and len(params["remote_block_ids"]) == 3
    assert params["remote_request_id"] == "a" and params["remote_num_tokens"] == 10
    assert s.kv_cache_manager.num_free_blocks == 2 and s.check_invariants() == []
    assert s.has_unfinished_requests()
    assert conn._mark_sent("a", 123)                 # a consumer pulled a
    kv_step(s, conn)
    assert s.kv_cache_manager.num_free_blocks == 5 and conn.stats.bytes_sent == 123
    time.sleep(0.25)                                 # nobody pulls b
    kv_step(s, conn)
    assert s.kv_cache_manager.num_free_blocks == 8 and conn.stats.num_expired == 1
    assert not s.has_unfinished_requests() and s.check_invariants() == []


def test_aborted_producer_request_is_not_kept():
    conn = ScriptedConnector(role="kv_producer")
    s = make(conn, num_blocks=8)
    s.add_request(make_req("a", 10, kv_transfer_params={"do_remote_decode": True}, max_tokens=1))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 8 and not s.has_unfinished_requests()


def test_consumer_role_ignores_remote_decode_and_producer_ignores_remote_prefill():
    conn = ScriptedConnector(role="kv_producer")
    s = make(conn)
    a = make_req("a", 10, kv_transfer_params=remote(10))
    s.add_request(a)
    so, _ = kv_step(s, conn)
    assert so.scheduled[0].req_id == "a" and len(so.scheduled[0].token_ids) == 10


def test_local_prefix_hit_loads_only_the_rest():
    conn = ScriptedConnector()
    s = make(conn, num_blocks=16)
    first = make_req("first", list(range(50, 60)))
    s.add_request(first)
    for _ in range(10):
        step(s)
    assert first.is_finished
    a = make_req("a", list(range(50, 60)), kv_transfer_params=remote(10))
    s.add_request(a)
    kv_step(s, conn)
    spec = conn.loads[0] if conn.loads else None
    wait_for(lambda: conn.loads)
    spec = conn.loads[0]
    assert a.num_computed_tokens == 8 and spec.remote_block_ids == [102] and spec.num_tokens == 2
    conn.release.set()
    wait_for(lambda: conn.stats.num_transfers == 1)
    kv_step(s, conn)
    assert a.num_computed_tokens == 9 and s.check_invariants() == []


@pytest.mark.parametrize("bad, msg", [
    ([1], "JSON object"), ({"do_remote_decode": "yes"}, "boolean"), ({"remote_port": -1}, "non-negative"),
    ({"do_remote_prefill": True}, "needs"), ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
    ({"remote_block_ids": [1, "a"]}, "remote_block_ids"),
])
def test_kv_transfer_params_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        validate_kv_transfer_params(bad)


def test_kv_transfer_config_validation():
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_json('{"kv_connector": "TcpConnector", "kv_role": "producer"}')
    with pytest.raises(ValueError, match="unknown kv_connector"):
        KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig.from_json('{"kv_connector": "TcpConnector", "kv_rol": "kv_both"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig.from_kwargs(kv_transfer_config="{kv_connector")
    with pytest.raises(ValueError, match="kv_port"):
        KVTransferConfig.from_json({"kv_port": 70000})
    c = KVTransferConfig.from_json('{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_consumer", '
                                   '"kv_buffer_device": "cpu"}')
    assert c.is_consumer and not c.is_producer and c.for_rank(2).kv_port == c.kv_port + 2
    z = KVTransferConfig.from_json('{"kv_port": 0, "engine_id": "pf"}')
    assert z.for_rank(0) is z and (z.for_rank(1).kv_port, z.for_rank(1).engine_id) == (0, "pf-dp1")


def test_a_head_without_blocks_takes_them_from_a_loaded_request_behind_it():
    """Nothing runs; the head of the waiting queue (a preempted request: preemption puts its victims in
    front) needs more blocks than are free, and the blocks are held by a request behind it whose K/V was
    loaded. That request's blocks are released (they stay in the prefix cache), so the head runs, and the
    released request later finds its prefix in the pool again. Before, the engine stopped here: seen with
    the KV offloading tier (tests/kv_transfer/test_offloading.py's chunked-prefill and preemption test)."""
    conn = ScriptedConnector()
    s = make(conn, num_blocks=8)
    a = make_req("a", 20, kv_transfer_params=remote(20), temperature=0, max_tokens=2)
    s.add_request(a)
    kv_step(s, conn)
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and len(s.kv_cache_manager.get_block_ids("a")) == 5
    conn.release.set()
    wait_for(lambda: conn._recv_done or conn._recv_failed)
    done = conn.get_finished()
    s.update_from_kv_connector(done.finished_sending, done.finished_recving, done.failed_recving)
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 19
    h = make_req("h", 22, max_tokens=2)            # 6 blocks; 3 are free
    s.add_request(h)
    s.waiting.remove(h)
    s.waiting.add_front(h)                         # where a preempted victim goes
    so, _ = kv_step(s, conn)
    assert [r.req_id for r in so.scheduled] == ["h"]
    assert "a" not in s.kv_cache_manager.req_to_blocks and a.num_computed_tokens == 0
    assert a.status == RequestStatus.PREEMPTED and a.num_preemptions == 1     # (so it does not pull again)
    finished = set()
    for _ in range(20):
        so, outs = kv_step(s, conn)
        finished |= {rid for rid, o in outs.items() if o.finish_reason}
        if finished == {"h", "a"}:
            break
    assert finished == {"h", "a"}
    assert a.num_cached_tokens == 19 and len(conn.loads) == 1 and s.check_invariants() == []
