"""Batch lane in the scheduler: interactive first, batch only with what is left; queue state for admission."""

from __future__ import annotations

import pytest

from tokenmill.core.request import RequestStatus
from tests.core.test_scheduler import make_req, make_sched, shape, step


def batch_req(rid, prompt, arrival=0.0, priority=0, **sp):
    r = make_req(rid, prompt, arrival=arrival, priority=priority, **sp)
    r.batch = True
    return r


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_interactive_admitted_before_earlier_batch(policy):
    s = make_sched(max_num_seqs=1, policy=policy)
    s.add_request(batch_req("b", 4, arrival=1.0, priority=-10 if policy == "priority" else 0, max_tokens=1))
    s.add_request(make_req("i", 4, arrival=2.0, priority=5 if policy == "priority" else 0, max_tokens=1))
    so, _ = step(s)
    assert [x.req_id for x in so.scheduled] == ["i"]
    so, _ = step(s)
    assert [x.req_id for x in so.scheduled] == ["b"]


def test_running_batch_prefill_gets_only_the_budget_interactive_leaves():
    s = make_sched(budget=16, num_blocks=40, max_model_len=128)
    s.add_request(batch_req("b", 40, arrival=1.0))
    so, _ = step(s)
    assert shape(so) == [("b", 0, 16, False, True)]
    s.add_request(make_req("i", 10, arrival=2.0))
    so, _ = step(s)
    # the interactive prompt goes first, the batch prompt continues with the 6 tokens left
    assert shape(so) == [("i", 0, 10, True, True), ("b", 16, 6, False, False)]


def test_batch_decode_keeps_running_alongside_interactive():
    s = make_sched(budget=16, num_blocks=40, max_model_len=128)
    s.add_request(batch_req("b", 4, arrival=1.0))
    step(s)
    s.add_request(make_req("i", 30, arrival=2.0))
    so, _ = step(s)
    # a decode is one token: it is not deferred (deferring decodes would only stretch the batch job)
    assert shape(so) == [("b", 4, 1, True, False), ("i", 0, 15, False, True)]


def test_interactive_preempts_running_batch_for_a_seat():
    s = make_sched(max_num_seqs=2, budget=64)
    s.add_request(batch_req("b1", 4, arrival=1.0))
    s.add_request(batch_req("b2", 4, arrival=2.0))
    step(s)
    assert s.num_running == 2
    s.add_request(make_req("i", 4, arrival=3.0))
    so, _ = step(s)
    assert so.preempted_req_ids == ["b2"]          # the latest batch request gives up its seat
    assert {x.req_id for x in so.scheduled} == {"b1", "i"}
    assert [r.request_id for r in s.waiting] == ["b2"]
    # b2 waits until an interactive-free seat opens
    so, _ = step(s)
    assert {x.req_id for x in so.scheduled} == {"b1", "i"}


def test_interactive_preempts_running_batch_for_blocks():
    s = make_sched(num_blocks=4, budget=64, prefix=False)
    s.add_request(batch_req("b", 12, arrival=1.0, max_tokens=3))   # 3 blocks of 4 + room to grow
    step(s)
    s.add_request(make_req("i", 8, arrival=2.0, max_tokens=2))     # needs 2 blocks; 1 free
    so, _ = step(s)
    assert "b" in so.preempted_req_ids
    assert [x.req_id for x in so.scheduled] == ["i"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED and [r.request_id for r in s.waiting] == ["b"]


def test_batch_never_preempts_interactive():
    s = make_sched(max_num_seqs=1)
    s.add_request(make_req("i", 4, arrival=1.0))
    step(s)
    s.add_request(batch_req("b", 4, arrival=2.0))
    so, _ = step(s)
    assert not so.preempted_req_ids and [x.req_id for x in so.scheduled] == ["i"]


def test_preemption_victim_is_batch_before_interactive():
    s = make_sched(num_blocks=3, budget=64, prefix=False)
    s.add_request(make_req("i", 4, arrival=2.0, max_tokens=8))
    s.add_request(batch_req("b", 4, arrival=1.0, max_tokens=8))
    step(s)
    # both hold a full block and grow: the pool (3 blocks) runs out; the batch request goes
    for _ in range(4):
        so, _ = step(s)
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == ["b"]


def test_queue_state_counts_lanes_priorities_and_prefill_left():
    s = make_sched(budget=8, num_blocks=40, max_model_len=128, policy="priority")
    s.add_request(make_req("run", 20, arrival=0.0, priority=0, max_tokens=5))
    step(s)                                  # 8 of 20 prompt tokens computed
    s.add_request(make_req("w0", 6, arrival=1.0, priority=0))
    s.add_request(make_req("w1", 7, arrival=2.0, priority=1))
    s.add_request(make_req("w1b", 3, arrival=3.0, priority=1))
    s.add_request(batch_req("bw", 9, arrival=4.0))
    q = s.queue_state()
    assert q.waiting_by_priority == {0: (1, 6), 1: (2, 10)}
    assert q.batch_waiting == (1, 9)
    assert q.running_prefill == (1, 12) and q.num_decoding == 0
    assert q.remaining_output_tokens == [5]
    assert q.max_num_seqs == 16 and q.max_num_batched_tokens == 8
    s.finish_requests(["w1"], RequestStatus.FINISHED_ABORTED)
    assert s.queue_state().waiting_by_priority == {0: (1, 6), 1: (1, 3)}
    # drain everything: the counters return to zero
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s)
    q = s.queue_state()
    assert q.waiting_by_priority == {} and q.batch_waiting == (0, 0) and q.running_prefill == (0, 0)
    assert s.waiting.counts == {}


def test_preempted_request_counts_its_generated_tokens_as_prefill_left():
    s = make_sched(num_blocks=4, prefix=False)
    s.add_request(make_req("a", 4, arrival=1.0, max_tokens=8))
    s.add_request(make_req("b", 4, arrival=2.0, max_tokens=8))
    for _ in range(6):
        so, _ = step(s)
        if so.preempted_req_ids:
            break
    victim = s.requests[so.preempted_req_ids[0]]
    assert s.queue_state().waiting_by_priority == {0: (1, victim.num_tokens)}
