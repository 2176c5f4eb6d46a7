"""Scheduler driven by a fake runner: budget, chunking, preemption, rejection, stops, prefix hits."""

from __future__ import annotations

import zlib

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import RequestRejectedError, Scheduler
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_sched(num_blocks=12, max_num_seqs=16, budget=64, policy="fcfs", chunked=True,
               prefix=True, max_model_len=64):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        scheduling_policy=policy, enable_chunked_prefill=chunked),
        CacheConfig(block_size=BS, enable_prefix_caching=prefix),
        max_model_len=max_model_len, num_kv_blocks=num_blocks)


def make_req(rid, prompt, arrival=0.0, priority=0, eos=None, salt=None, **sp):
    sp.setdefault("max_tokens", 8)
    if isinstance(prompt, int):  # distinct tokens per request id: no accidental prefix hits
        base = 100 + zlib.crc32(rid.encode()) % 100_000 * 100
        prompt = list(range(base, base + prompt))
    return Request(rid, prompt, SamplingParams(**sp), eos_token_id=eos,
                   arrival_time=arrival, priority=priority, cache_salt=salt)


class FakeRunner:
    """Samples a fixed token (per request, or scripted per request) for each ``sample`` request."""

    def __init__(self, token=7, script=None):
        self.token = token
        self.script = {k: list(v) for k, v in (script or {}).items()}

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for sr in so.scheduled:
            if sr.sample:
                s = self.script.get(sr.req_id)
                out.req_ids.append(sr.req_id)
                out.sampled_token_ids.append(s.pop(0) if s else self.token)
                out.logprobs.append(None)
        return out


def step(sched, runner=None):
    runner = runner or FakeRunner()
    so = sched.schedule()
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(so.scheduled) <= sched.max_num_seqs
    outs = sched.update_from_output(so, runner(so))
    return so, {o.req_id: o for o in outs}


def shape(so):
    return [(s.req_id, s.num_computed_tokens, len(s.token_ids), s.sample, s.new) for s in so.scheduled]


# -- basic life cycle -------------------------------------------------------
def test_prefill_decode_finish_frees_blocks():
    s = make_sched()
    r = make_req("a", 10, max_tokens=3)
    s.add_request(r)
    assert s.num_waiting == 1 and s.num_waiting_tokens == 10
    so, outs = step(s)
    (sr,) = so.scheduled
    assert sr.token_ids == r.prompt_token_ids and sr.num_computed_tokens == 0
    assert sr.block_ids == [0, 1, 2] and sr.sample and sr.new
    assert so.total_num_scheduled_tokens == 10
    assert outs["a"].new_token_ids == [7] and outs["a"].finish_reason is None
    assert r.status == RequestStatus.RUNNING and r.first_scheduled_time is not None
    assert r.first_token_time is not None and s.num_waiting_tokens == 0
    so, outs = step(s)
    assert shape(so) == [("a", 10, 1, True, False)]
    assert so.scheduled[0].token_ids == [7] and so.scheduled[0].block_ids == [0, 1, 2]
    so, outs = step(s)
    assert outs["a"].finish_reason == "length" and r.status == RequestStatus.FINISHED_LENGTH
    o = outs["a"]
    assert o.num_prompt_tokens == 10 and o.num_cached_tokens == 0 and o.num_preemptions == 0
    assert o.finished_time is not None and o.arrival_time == 0.0
    assert r.output_token_ids == [7, 7, 7]
    assert s.num_running == 0 and not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 12 and s.kv_cache_usage == 0.0
    so = s.schedule()
    assert so.is_empty and so.finished_req_ids == {"a"}
    assert s.schedule().finished_req_ids == set()


def test_full_blocks_cached_after_step():
    s = make_sched()
    r = make_req("a", 10, max_tokens=5)
    s.add_request(r)
    blocks = s.kv_cache_manager.block_pool.blocks
    step(s)  # computes 0..9
    assert [blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    step(s)  # computes 10
    assert blocks[2].block_hash is None
    step(s)  # computes 11 -> block 2 full
    assert blocks[2].block_hash == r.block_hashes[2]


# -- budget and chunking ----------------------------------------------------
def test_chunked_prefill_chunks_follow_budget():
    s = make_sched(budget=8)
    s.add_request(make_req("a", 20, max_tokens=2))
    so, outs = step(s)
    assert shape(so) == [("a", 0, 8, False, True)] and outs == {}
    so, outs = step(s)
    assert shape(so) == [("a", 8, 8, False, False)] and outs == {}
    so, outs = step(s)
    assert shape(so) == [("a", 16, 4, True, False)] and outs["a"].new_token_ids == [7]
    assert so.scheduled[0].block_ids == [0, 1, 2, 3, 4]


def test_decode_first_then_chunk_of_new_prompt():
    s = make_sched(budget=8)
    s.add_request(make_req("a", 4, max_tokens=10))
    step(s)
    s.add_request(make_req("b", 20, arrival=1.0))
    so, _ = step(s)
    assert shape(so) == [("a", 4, 1, True, False), ("b", 0, 7, False, True)]
    so, _ = step(s)
    assert shape(so) == [("a", 5, 1, True, False), ("b", 7, 7, False, False)]
    so, _ = step(s)
    assert shape(so) == [("a", 6, 1, True, False), ("b", 14, 6, True, False)]
    assert so.total_num_scheduled_tokens == 7


def test_budget_shared_by_several_waiting_requests():
    s = make_sched(budget=10)
    for i, n in enumerate([4, 4, 4]):
        s.add_request(make_req(f"r{i}", n, arrival=float(i)))
    so, _ = step(s)
    assert shape(so) == [("r0", 0, 4, True, True), ("r1", 0, 4, True, True), ("r2", 0, 2, False, True)]
    so, _ = step(s)
    assert shape(so) == [("r0", 4, 1, True, False), ("r1", 4, 1, True, False), ("r2", 2, 2, True, False)]


def test_max_num_seqs_cap():
    s = make_sched(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_req(f"r{i}", 4, arrival=float(i), max_tokens=2))
    so, _ = step(s)
    assert [x.req_id for x in so.scheduled] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 1
    so, outs = step(s)
    assert [x.req_id for x in so.scheduled] == ["r0", "r1"]
    assert outs["r0"].finish_reason == "length"
    so, _ = step(s)
    assert shape(so) == [("r2", 0, 4, True, True)]


def test_no_chunking_prompt_waits_for_room_in_budget():
    s = make_sched(budget=8, chunked=False)
    s.add_request(make_req("a", 4, max_tokens=3))
    step(s)
    s.add_request(make_req("b", 8, arrival=1.0))
    so, _ = step(s)  # a decodes (1 token); b needs 8 > 7 left: waits
    assert shape(so) == [("a", 4, 1, True, False)]
    so, outs = step(s)
    assert outs["a"].finish_reason == "length"
    so, _ = step(s)
    assert shape(so) == [("b", 0, 8, True, True)]
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens"):
        s.add_request(make_req("c", 9))


# -- queue order ------------------------------------------------------------
def test_fcfs_head_of_line_blocks_later_requests():
    s = make_sched(num_blocks=4)
    s.add_request(make_req("a", 8, max_tokens=2))  # blocks 0,1 (+ room)
    step(s)
    s.add_request(make_req("big", 12, arrival=1.0, max_tokens=2))  # needs 3 blocks, 2 free
    s.add_request(make_req("small", 2, arrival=2.0, max_tokens=2))
    so, outs = step(s)
    assert [x.req_id for x in so.scheduled] == ["a"]
    assert s.num_waiting == 2 and outs["a"].finish_reason == "length"
    # small (1 block) would have fit the free blocks, but stayed behind big. a freed
    # [0, 1, 2] tail first, so the queue is 3 (never used), 2, 1, 0.
    so, _ = step(s)
    # (Strict LRU hands big [3, 2, 1]; block runs rewind the head to the free run's start: [1, 2, 3].)
    assert [(x.req_id, sorted(x.block_ids)) for x in so.scheduled] == [("big", [1, 2, 3]), ("small", [0])]


def test_fcfs_ignores_priority_and_priority_policy_orders_by_priority_then_arrival():
    s = make_sched(max_num_seqs=1)
    s.add_request(make_req("late-urgent", 4, arrival=2.0, priority=-5))
    s.add_request(make_req("early", 4, arrival=1.0, priority=3))
    so, _ = step(s)
    assert [x.req_id for x in so.scheduled] == ["late-urgent"]  # fcfs: insertion (arrival) order

    p = make_sched(max_num_seqs=1, policy="priority")
    p.add_request(make_req("x", 4, arrival=1.0, priority=1, max_tokens=1))
    p.add_request(make_req("y", 4, arrival=3.0, priority=0, max_tokens=1))
    p.add_request(make_req("z", 4, arrival=2.0, priority=0, max_tokens=1))
    order = []
    while p.has_unfinished_requests():
        so, _ = step(p)
        order += [x.req_id for x in so.scheduled]
    assert order == ["z", "y", "x"]


# -- preemption -------------------------------------------------------------
def test_preempt_latest_arrival_by_recompute():
    s = make_sched(num_blocks=4, prefix=False)
    a = make_req("a", 4, arrival=1.0, max_tokens=10)
    b = make_req("b", 4, arrival=2.0, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    so, _ = step(s)
    assert [x.block_ids for x in so.scheduled] == [[0], [1]]
    so, _ = step(s)
    assert [x.block_ids for x in so.scheduled] == [[0, 2], [1, 3]]
    for _ in range(3):
        step(s)  # positions 5..7: no new blocks
    assert a.num_tokens == 9 and s.kv_cache_manager.num_free_blocks == 0
    so, outs = step(s)  # a needs a 3rd block: b (later arrival) is preempted
    assert so.preempted_req_ids == ["b"]
    assert shape(so) == [("a", 8, 1, True, False)]
    assert so.scheduled[0].block_ids == [0, 2, 3]  # b freed [1, 3] tail first: 3 is reused first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions_total == 1
    assert s.kv_cache_manager.get_block_ids("b") == []
    assert s.num_waiting == 1 and s.num_running == 1 and "b" not in outs
    assert s.num_waiting_tokens == 4  # b's prompt is waiting again
    # b needs 3 blocks for its 9 tokens; only 1 is free while a runs.
    while a.status == RequestStatus.RUNNING:
        so, _ = step(s)
        assert [x.req_id for x in so.scheduled] == ["a"]
    so, outs = step(s)
    assert shape(so) == [("b", 0, 9, True, True)]
    assert so.scheduled[0].token_ids == b.prompt_token_ids + [7] * 5
    assert outs["b"].num_preemptions == 1
    while s.has_unfinished_requests():
        step(s)
    assert b.num_output_tokens == 10 and s.kv_cache_manager.num_free_blocks == 4


def test_preempted_request_goes_to_front_of_waiting_queue():
    s = make_sched(num_blocks=4, prefix=False, max_num_seqs=2)
    a = make_req("a", 4, arrival=1.0, max_tokens=10)
    b = make_req("b", 4, arrival=2.0, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    for _ in range(5):
        step(s)
    s.add_request(make_req("c", 1, arrival=3.0, max_tokens=1))
    so, _ = step(s)
    assert so.preempted_req_ids == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert [x.req_id for x in so.scheduled] == ["a"]  # no admission in a preempting step


def test_priority_victim_lowest_priority_even_if_already_scheduled():
    s = make_sched(num_blocks=4, prefix=False, policy="priority")
    s.add_request(make_req("low", 4, arrival=1.0, priority=1, max_tokens=8))
    so, _ = step(s)
    assert [(x.req_id, x.block_ids) for x in so.scheduled] == [("low", [0])]
    s.add_request(make_req("high", 7, arrival=2.0, priority=0, max_tokens=8))
    so, _ = step(s)
    assert [(x.req_id, x.block_ids) for x in so.scheduled] == [("low", [0, 1]), ("high", [2, 3])]
    so, _ = step(s)  # low position 5, high position 7: no new block
    assert so.preempted_req_ids == []
    # low (scheduled first, running order) then high at position 8 needs a block: the victim is
    # low (priority 1) although it arrived earlier; its already scheduled token is refunded.
    so, _ = step(s)
    assert so.preempted_req_ids == ["low"]
    assert shape(so) == [("high", 8, 1, True, False)]
    assert so.total_num_scheduled_tokens == 1
    # low freed [0, 1] tail first: strict LRU gives high block 1; block runs may rewind to 0 (uncached).
    assert so.scheduled[0].block_ids[:2] == [2, 3] and so.scheduled[0].block_ids[2] in (0, 1)
    assert s.num_preemptions_total == 1 and [r.request_id for r in s.waiting] == ["low"]


def test_victim_is_request_being_scheduled_stops_running_pass():
    s = make_sched(num_blocks=4, prefix=False, policy="priority")
    low = make_req("low", 8, arrival=1.0, priority=1, max_tokens=8)
    high = make_req("high", 5, arrival=2.0, priority=0, max_tokens=8)
    s.add_request(low)
    s.add_request(high)
    so, _ = step(s)
    assert [(x.req_id, x.block_ids) for x in so.scheduled] == [("high", [0, 1]), ("low", [2, 3])]
    so, _ = step(s)  # low (position 8) needs a 3rd block; it is itself the lowest priority
    assert so.preempted_req_ids == ["low"]
    assert shape(so) == [("high", 5, 1, True, False)]
    assert low.status == RequestStatus.PREEMPTED and s.kv_cache_manager.num_free_blocks == 2


# -- rejection --------------------------------------------------------------
def test_rejections_and_small_request_proceeds():
    s = make_sched(num_blocks=4, max_model_len=32)
    with pytest.raises(RequestRejectedError, match="empty"):
        s.add_request(make_req("empty", []))
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len"):
        s.add_request(make_req("long", 30, max_tokens=3))
    with pytest.raises(RequestRejectedError, match="max_model_len is 32"):
        s.add_request(make_req("full", 32, max_tokens=None))
    big = make_req("big", 10, max_tokens=8)  # 17 tokens of K/V -> 5 blocks > 4
    with pytest.raises(RequestRejectedError, match=r"needs 5 KV blocks.*only 4 blocks") as e:
        s.add_request(big)
    assert isinstance(e.value, ValueError)
    assert big.status == RequestStatus.FINISHED_ERROR and "5 KV blocks" in big.error
    assert s.num_waiting == 0 and not s.has_unfinished_requests()
    # Exactly fits: 10 + 7 - 1 = 16 tokens = 4 blocks.
    ok = make_req("ok", 10, max_tokens=7)
    s.add_request(ok)
    with pytest.raises(RequestRejectedError, match="already in use"):
        s.add_request(make_req("ok", 1))
    while s.has_unfinished_requests():
        step(s)
    assert ok.num_output_tokens == 7 and ok.status == RequestStatus.FINISHED_LENGTH


def test_max_tokens_none_resolves_to_context_left():
    s = make_sched(max_model_len=16)
    r = make_req("a", 10, max_tokens=None)
    s.add_request(r)
    assert r.max_tokens == 6
    r2 = make_req("b", 15, max_tokens=None)
    s.add_request(r2)
    assert r2.max_tokens == 1


def test_max_tokens_zero_finishes_without_blocks():
    s = make_sched()
    r = make_req("z", 5, max_tokens=0)
    s.add_request(r)
    assert s.num_waiting == 0 and s.has_unfinished_requests()
    so = s.schedule()
    assert so.is_empty and s.kv_cache_manager.num_free_blocks == 12
    (o,) = s.update_from_output(so, ModelRunnerOutput())
    assert o.req_id == "z" and o.finish_reason == "length" and o.new_token_ids == []
    assert not s.has_unfinished_requests()


# -- abort / stop from the front end ---------------------------------------
def test_abort_running_and_waiting_frees_everything():
    s = make_sched(num_blocks=6, max_num_seqs=1)
    s.add_request(make_req("a", 10))
    s.add_request(make_req("b", 5, arrival=1.0))
    step(s)
    assert s.kv_cache_manager.num_free_blocks == 3
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert s.num_running == 0 and s.num_waiting == 0 and s.num_waiting_tokens == 0
    assert s.kv_cache_manager.num_free_blocks == 6 and s.kv_cache_usage == 0.0
    assert not s.has_unfinished_requests()
    so = s.schedule()
    assert so.is_empty and so.finished_req_ids == {"a", "b"}
    with pytest.raises(ValueError):
        s.finish_requests("a", RequestStatus.RUNNING)


def test_stop_between_schedule_and_update_is_skipped():
    s = make_sched()
    r = make_req("a", 4)
    s.add_request(r)
    so = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert s.update_from_output(so, FakeRunner()(so)) == []
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == []
    assert s.kv_cache_manager.num_free_blocks == 12


# -- prefix cache through the scheduler ------------------------------------
def test_prefix_hit_starts_with_tokens_computed_and_counts_tokens():
    s = make_sched()
    s.add_request(make_req("a", list(range(10))))
    step(s)
    b = make_req("b", list(range(10)), arrival=1.0)
    s.add_request(b)
    so, outs = step(s)
    assert shape(so)[1] == ("b", 8, 2, True, True)
    assert so.scheduled[1].token_ids == [8, 9] and so.scheduled[1].block_ids == [0, 1, 3]
    assert outs["b"].num_cached_tokens == 8
    st = s.prefix_cache_stats
    assert (st.queries, st.hits) == (20, 8)
    # Fully cached 9-token prompt: exactly its last token is computed.
    c = make_req("c", list(range(9)), arrival=2.0)
    s.add_request(c)
    so, _ = step(s)
    assert shape(so)[-1] == ("c", 8, 1, True, True)
    s2 = make_sched(prefix=False)
    s2.add_request(make_req("a", list(range(10))))
    step(s2)
    s2.add_request(make_req("b", list(range(10))))
    so, _ = step(s2)
    assert shape(so)[1] == ("b", 0, 10, True, True)


def test_recompute_after_preemption_not_counted_as_hits():
    s = make_sched(num_blocks=4)
    a = make_req("a", 4, arrival=1.0, max_tokens=10)
    b = make_req("b", 4, arrival=2.0, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    for _ in range(6):
        step(s)
    assert b.num_preemptions == 1
    st = s.prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (2, 8, 0)
    while s.has_unfinished_requests():
        step(s)
    assert (st.requests, st.queries, st.hits) == (2, 8, 0)
    assert b.num_cached_tokens == 0 and b.num_output_tokens == 10


# -- stop conditions --------------------------------------------------------
def run_one(req, runner, **kw):
    s = make_sched(**kw)
    s.add_request(req)
    last = None
    while s.has_unfinished_requests():
        _, outs = step(s, runner)
        last = outs.get(req.request_id, last)
    return last


def test_eos_stops():
    r = make_req("a", 4, eos=2, max_tokens=10)
    o = run_one(r, FakeRunner(script={"a": [5, 2, 5]}))
    assert o.finish_reason == "stop" and o.stop_reason is None
    assert r.output_token_ids == [5, 2]


def test_eos_list_and_ignore_eos():
    r = make_req("a", 4, eos=[2, 3], max_tokens=10)
    run_one(r, FakeRunner(script={"a": [5, 3]}))
    assert r.output_token_ids == [5, 3] and r.status == RequestStatus.FINISHED_STOPPED
    r = make_req("b", 4, eos=2, max_tokens=4, ignore_eos=True)
    o = run_one(r, FakeRunner(token=2))
    assert r.output_token_ids == [2, 2, 2, 2] and o.finish_reason == "length"


def test_stop_token_ids_set_stop_reason():
    r = make_req("a", 4, max_tokens=10, stop_token_ids=[42])
    o = run_one(r, FakeRunner(script={"a": [1, 42, 1]}))
    assert o.finish_reason == "stop" and o.stop_reason == 42 and r.output_token_ids == [1, 42]


def test_min_tokens_suppresses_eos_and_stop_ids():
    r = make_req("a", 4, eos=2, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    o = run_one(r, FakeRunner(script={"a": [2, 9, 2, 5]}))
    assert r.output_token_ids == [2, 9, 2] and o.finish_reason == "stop"


def test_max_tokens_and_max_model_len():
    r = make_req("a", 4, max_tokens=3)
    assert run_one(r, FakeRunner()).finish_reason == "length" and r.num_output_tokens == 3
    # max_model_len ends the request even when min_tokens is not reached.
    r = make_req("b", 6, eos=7, max_tokens=None, min_tokens=50)
    o = run_one(r, FakeRunner(), max_model_len=8)
    assert o.finish_reason == "length" and r.num_tokens == 8


def test_logprobs_passed_through():
    from tokenmill.outputs import TokenLogprobs

    s = make_sched()
    s.add_request(make_req("a", 4, max_tokens=1))
    so = s.schedule()
    lp = TokenLogprobs(logprob=-0.5, rank=1, top_token_ids=[7], top_logprobs=[-0.5])
    (o,) = s.update_from_output(so, ModelRunnerOutput(["a"], [7], [lp]))
    assert o.new_logprobs == [lp] and o.finish_reason == "length"


def test_long_prefill_token_threshold_lets_a_short_request_start_in_the_first_step():
    """A 100-token prompt then a 5-token one, budget 64: without a cap the long prompt takes the whole
    first step and the short one starts in the second; capped at 16 tokens per request and step, both
    start in the first step and the long prompt still completes."""
    def run(threshold):
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      long_prefill_token_threshold=threshold),
                      CacheConfig(block_size=BS), max_model_len=256, num_kv_blocks=64)
        s.add_request(make_req("long", 100, arrival=0.0, max_tokens=2))
        s.add_request(make_req("short", 5, arrival=1.0, max_tokens=2))
        first_token_step, chunks, n = {}, [], 0
        while s.has_unfinished_requests():
            so, outs = step(s)
            n += 1
            chunks.append({sr.req_id: len(sr.token_ids) for sr in so.scheduled})
            for rid in outs:
                first_token_step.setdefault(rid, n)
        return first_token_step, chunks

    plain, plain_chunks = run(0)
    capped, capped_chunks = run(16)
    assert plain_chunks[0] == {"long": 64} and plain["short"] == 2
    assert capped_chunks[0] == {"long": 16, "short": 5} and capped["short"] == 1
    assert max(c.get("long", 0) for c in capped_chunks) == 16 and set(capped) == {"long", "short"}
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_prompt_logprobs_params_are_checked():
    assert SamplingParams(prompt_logprobs=0, max_tokens=1).prompt_logprobs == 0
    for bad, match in [(dict(prompt_logprobs=21), r"prompt_logprobs must be in \[0, 20\]"),
                       (dict(prompt_logprobs=-1), r"prompt_logprobs must be in \[0, 20\]"),
                       (dict(prompt_logprobs=2, max_tokens=0), "needs max_tokens >= 1")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_prompt_logprobs_skip_prefix_hits_and_arrive_once_with_the_first_token():
    """A request asking for prompt logprobs computes its whole prompt even when its blocks are cached, and
    they come with its first token only; a later identical request without them takes the cache hit."""
    s = make_sched(num_blocks=32, budget=64, max_model_len=64)
    prompt = list(range(500, 520))
    s.add_request(make_req("warm", prompt, max_tokens=1))
    step(s)
    s.add_request(make_req("plp", prompt, max_tokens=3, prompt_logprobs=1))

    def runner(so):
        out = FakeRunner()(so)
        for sr in so.scheduled:
            if sr.prompt_logprobs is not None:
                m = min(sr.num_computed_tokens + len(sr.token_ids), len(sr.prompt_token_ids) - 1) - sr.num_computed_tokens
                out.prompt_logprobs[sr.req_id] = (sr.num_computed_tokens + 1, [f"lp{sr.num_computed_tokens + 1 + j}"
                                                                              for j in range(m)])
        return out

    so, outs = step(s, runner)
    assert [(sr.req_id, sr.num_computed_tokens, len(sr.token_ids)) for sr in so.scheduled] == [("plp", 0, 20)]
    assert outs["plp"].prompt_logprobs == [None] + [f"lp{t}" for t in range(1, 20)]
    assert outs["plp"].num_cached_tokens == 0
    so, outs = step(s, runner)
    assert outs["plp"].prompt_logprobs is None and all(sr.prompt_logprobs is None for sr in so.scheduled)
    s.add_request(make_req("hit", prompt, max_tokens=1))
    so, outs = step(s)
    assert outs["hit"].num_cached_tokens == 16
