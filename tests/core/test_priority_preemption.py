"""Priority at a full house (issue 30): with --scheduling-policy priority and every seat (or block)
held by lower-priority requests, a higher-priority request preempts the lowest-priority running one
by recompute and starts in the next step; the victim keeps its output and resumes later."""

from __future__ import annotations

from tests.core.test_scheduler import FakeRunner, make_req, make_sched, step
from tokenmill.core.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def _run_until_done(s, runner, limit=200):
    outs = {}
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return outs
        _, o = step(s, runner)
        for rid, out in o.items():
            outs.setdefault(rid, []).extend(out.new_token_ids)
    raise AssertionError("did not finish")


def test_high_priority_at_a_full_house_starts_next_step_and_the_victim_resumes_intact():
    s = make_sched(num_blocks=64, max_num_seqs=2, policy="priority")
    runner = FakeRunner(script={"low-a": range(10, 20), "low-b": range(20, 30), "high": range(30, 40)})
    low_a = make_req("low-a", 4, arrival=1.0, priority=5, max_tokens=6)
    low_b = make_req("low-b", 4, arrival=2.0, priority=5, max_tokens=6)
    s.add_request(low_a)
    s.add_request(low_b)
    outs = {}
    for _ in range(3):                       # both seats taken, both decoding
        _, o = step(s, runner)
        for rid, out in o.items():
            outs.setdefault(rid, []).extend(out.new_token_ids)
    assert [r.request_id for r in s.running] == ["low-a", "low-b"]
    s.add_request(make_req("high", 4, arrival=3.0, priority=0, max_tokens=3))
    so, o = step(s, runner)
    # the next step: the latest low-priority request yields its seat; high prefills in this very step
    assert so.preempted_req_ids == ["low-b"]
    assert [x.req_id for x in so.scheduled] == ["low-a", "high"] and "high" in o
    assert low_b.status == RequestStatus.PREEMPTED and low_b.num_preemptions == 1
    assert low_b.output_token_ids == [20, 21, 22]            # its output so far is kept
    for rid, out in o.items():
        outs.setdefault(rid, []).extend(out.new_token_ids)
    for rid, toks in _run_until_done(s, runner).items():
        outs.setdefault(rid, []).extend(toks)
    # the victim recomputed its prompt + output and continued where it stopped: nothing lost or repeated
    assert outs["low-b"] == list(range(20, 26)) and low_b.output_token_ids == list(range(20, 26))
    assert outs["low-a"] == list(range(10, 16)) and outs["high"] == [30, 31, 32]
    assert s.num_preemptions_total == 1 and s.check_invariants() == []


def test_equal_or_lower_priority_never_preempts_and_fcfs_never_does():
    for policy, prio in (("priority", 5), ("priority", 7), ("fcfs", 0)):
        s = make_sched(num_blocks=64, max_num_seqs=2, policy=policy)
        s.add_request(make_req("a", 4, arrival=1.0, priority=5))
        s.add_request(make_req("b", 4, arrival=2.0, priority=5))
        step(s)
        s.add_request(make_req("c", 4, arrival=3.0, priority=prio))
        so, _ = step(s)
        assert so.preempted_req_ids == [] and [r.request_id for r in s.running] == ["a", "b"], policy
        assert [r.request_id for r in s.waiting] == ["c"]


def test_the_victim_is_the_lowest_priority_then_latest_and_no_ping_pong():
    s = make_sched(num_blocks=64, max_num_seqs=3, policy="priority")
    s.add_request(make_req("p3-early", 4, arrival=1.0, priority=3))
    s.add_request(make_req("p9", 4, arrival=2.0, priority=9))
    s.add_request(make_req("p3-late", 4, arrival=3.0, priority=3))
    step(s)
    s.add_request(make_req("u1", 4, arrival=4.0, priority=1))
    s.add_request(make_req("u2", 4, arrival=5.0, priority=1))
    so, _ = step(s)
    assert so.preempted_req_ids == ["p9", "p3-late"]            # lowest priority first, then latest
    assert sorted(r.request_id for r in s.running) == ["p3-early", "u1", "u2"]
    for _ in range(2):   # the victims wait; nobody of equal priority preempts anybody back
        so, _ = step(s)
        assert so.preempted_req_ids == []
    assert [r.request_id for r in s.waiting] == ["p3-late", "p9"]


def test_high_priority_preempts_for_blocks_when_seats_are_free():
    # 4 blocks of 4 tokens: two low requests of 7 prompt tokens hold the whole pool (2 blocks each)
    s = make_sched(num_blocks=4, max_num_seqs=8, policy="priority", prefix=False)
    s.add_request(make_req("low-a", 7, arrival=1.0, priority=2, max_tokens=2))
    s.add_request(make_req("low-b", 7, arrival=2.0, priority=2, max_tokens=2))
    step(s)
    assert s.kv_cache_manager.num_free_blocks == 0 and len(s.running) == 2
    s.add_request(make_req("high", 5, arrival=3.0, priority=0, max_tokens=2))
    so, _ = step(s)
    assert so.preempted_req_ids == ["low-b"]
    assert [x.req_id for x in so.scheduled] == ["low-a", "high"]
    assert s.check_invariants() == []


def test_batch_lane_request_never_preempts_interactive_work():
    s = make_sched(num_blocks=64, max_num_seqs=1, policy="priority")
    s.add_request(make_req("inter-low", 4, arrival=1.0, priority=9))
    step(s)
    batch = Request("batch-high", list(range(500, 504)), SamplingParams(max_tokens=4), arrival_time=2.0,
                    priority=0, batch=True)
    s.add_request(batch)
    so, _ = step(s)
    assert so.preempted_req_ids == [] and [r.request_id for r in s.running] == ["inter-low"]
