"""The scheduler with LoRA adapters (no model): at most --max-loras adapters per step, waiting for loads,
aging, failed loads, adapter-keyed block hashes and KV events."""

from __future__ import annotations

import pytest

from tests.core.test_scheduler import BS, FakeRunner, make_req
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core import scheduler as scheduler_mod
from tokenmill.core.prefix_cache import update_block_hashes
from tokenmill.core.request import RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.lora.request import LoRARequest

ADAPTERS = {i: LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 5)}


def lora_req(rid, lid, prompt=5, batch=False, **kw):
    r = make_req(rid, prompt, **kw)
    r.lora_request = ADAPTERS[lid] if lid else None
    r.batch = batch
    return r


class Ready:
    """lora_ready hook: adapters in ``resident`` are loaded; others 'load' after ``delay`` asks; ``bad`` fail."""

    def __init__(self, resident=(), delay=0, bad=()):
        self.resident, self.delay, self.bad = set(resident), delay, set(bad)
        self.asks: dict[int, int] = {}

    def __call__(self, req):
        lid = req.lora_int_id
        if lid in self.bad:
            return False, "adapter_model.safetensors: missing"
        if lid in self.resident:
            return True, None
        self.asks[lid] = self.asks.get(lid, 0) + 1
        if self.asks[lid] > self.delay:
            self.resident.add(lid)
            return True, None
        return False, None


def make(max_loras=2, ready=None, num_blocks=64, max_num_seqs=16):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256),
                     CacheConfig(block_size=BS), max_model_len=64, num_kv_blocks=num_blocks,
                     max_loras=max_loras, lora_ready=ready or Ready(resident=ADAPTERS))


def run(s, n=1):
    outs = {}
    for _ in range(n):
        so = s.schedule()
        ids = {sr.lora_request.lora_int_id for sr in so.scheduled if sr.lora_request is not None}
        assert len(ids) <= s.max_loras
        outs.update({o.req_id: o for o in s.update_from_output(so, FakeRunner()(so))})
        yield so, outs


def test_at_most_max_loras_adapters_per_step_and_fcfs_within():
    s = make(max_loras=2)
    for rid, lid in [("x1", 1), ("b1", 0), ("x2", 2), ("x3", 3), ("x1b", 1), ("b2", 0)]:
        s.add_request(lora_req(rid, lid, max_tokens=3))
    so, _ = next(run(s))
    # adapters 1 and 2 take the slots; adapter 3 waits; base requests and adapter 1's second request run
    assert [sr.req_id for sr in so.scheduled] == ["x1", "b1", "x2", "x1b", "b2"]
    assert [r.request_id for r in s.waiting] == ["x3"]
    assert all(sr.lora_request is (ADAPTERS[1] if sr.req_id.startswith("x1") else ADAPTERS.get(
        {"x2": 2}.get(sr.req_id, 0))) for sr in so.scheduled)
    # once adapter 1 and 2's requests finish, adapter 3 is admitted
    for so, outs in run(s, 6):
        pass
    assert outs["x3"].finish_reason == "length" and not s.has_unfinished_requests()
    assert s.check_invariants() == []


def test_waits_for_a_load_without_blocking_others():
    ready = Ready(resident={1}, delay=2)
    s = make(max_loras=4, ready=ready)
    s.add_request(lora_req("slow", 2, max_tokens=2))
    s.add_request(lora_req("fast", 1, max_tokens=2))
    steps = list(run(s, 4))
    first = [sr.req_id for sr in steps[0][0].scheduled]
    assert first == ["fast"]
    admitted = next(i for i, (so, _) in enumerate(steps) if any(sr.req_id == "slow" and sr.new for sr in so.scheduled))
    assert admitted == 2 and ready.asks[2] == 3


def test_failed_load_fails_the_request_only():
    s = make(max_loras=2, ready=Ready(resident={1}, bad={3}))
    s.add_request(lora_req("bad", 3, max_tokens=2))
    s.add_request(lora_req("ok", 1, max_tokens=2))
    so, outs = next(run(s))
    assert outs["bad"].finish_reason == "error" and "a3" in outs["bad"].error and "missing" in outs["bad"].error
    assert [sr.req_id for sr in so.scheduled] == ["ok"]
    assert "bad" not in s.requests and s.check_invariants() == []


def test_aging_drains_the_slots(monkeypatch):
    """Adapters 1 and 2 keep getting requests; adapter 3's request waits, ages, and then gets a slot
    because requests of adapters 1 and 2 stop being admitted (base requests still are)."""
    clock = [1000.0]
    monkeypatch.setattr(scheduler_mod.time, "time", lambda: clock[0])
    s = make(max_loras=2)
    s.add_request(lora_req("r1", 1, max_tokens=4))
    s.add_request(lora_req("r2", 2, max_tokens=4))
    s.add_request(lora_req("starved", 3, max_tokens=2))
    got_in, step_no, n = None, 0, 0
    for step_no in range(40):
        for lid in (1, 2):
            n += 1
            s.add_request(lora_req(f"more{n}", lid, max_tokens=4))
        s.add_request(lora_req(f"base{n}", 0, max_tokens=1))
        so, outs = next(run(s))
        if any(sr.req_id == "starved" for sr in so.scheduled):
            got_in = step_no
            break
        if step_no == 0:
            assert all(not sr.req_id.startswith("starved") for sr in so.scheduled)
        clock[0] += 0.5
    assert got_in is not None, "the request of a third adapter starved"
    assert got_in * 0.5 >= scheduler_mod.LORA_AGING_S


def test_adapters_never_share_blocks_and_events_carry_the_id():
    s = make(max_loras=4)
    s.kv_cache_manager.block_pool.enable_kv_events()
    prompt = list(range(500, 500 + 3 * BS + 1))
    reqs = [lora_req("base", 0, prompt=prompt), lora_req("l1", 1, prompt=prompt), lora_req("l2", 2, prompt=prompt),
            lora_req("l1again", 1, prompt=prompt)]
    hashes = [update_block_hashes(r, BS)[:] for r in reqs]
    assert len({h[0] for h in hashes[:3]}) == 3 and hashes[1] == hashes[3]
    assert len({h[-1] for h in hashes[:3]}) == 3       # chained: every block differs
    for r in reqs[:3]:
        s.add_request(r)
    next(run(s))
    s.add_request(reqs[3])
    so, _ = next(run(s))
    (sr,) = [x for x in so.scheduled if x.req_id == "l1again"]
    assert sr.num_computed_tokens == 3 * BS             # a hit on adapter 1's own blocks only
    events = s.kv_cache_manager.block_pool.take_kv_events()
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert sorted(e.lora_id or 0 for e in stored) == [0, 1, 2]


def test_salt_only_hashes_unchanged():
    from tokenmill.core.prefix_cache import hash_block_tokens

    r = make_req("s", list(range(BS)), salt="x")
    assert update_block_hashes(r, BS) == [hash_block_tokens(None, list(range(BS)), ("x",))]


def test_an_interactive_request_takes_a_slot_held_by_the_batch_lane():
    """--max-loras 1: a batch-lane request of adapter 1 runs; an interactive request of adapter 2 takes the
    slot at once (the batch request is preempted and resumes after); an interactive holder is never
    preempted for it."""
    s = make(max_loras=1)
    s.add_request(lora_req("batch1", 1, max_tokens=6, batch=True))
    gen = run(s, 20)
    so, _ = next(gen)
    assert [sr.req_id for sr in so.scheduled] == ["batch1"]
    s.add_request(lora_req("inter2", 2, max_tokens=2))
    so, _ = next(gen)
    assert [sr.req_id for sr in so.scheduled] == ["inter2"]
    assert s.requests["batch1"].num_preemptions == 1
    for so, outs in gen:
        if not s.has_unfinished_requests():
            break
    assert outs["inter2"].finish_reason == "length" and outs["batch1"].finish_reason == "length"
    assert s.check_invariants() == []
    # an interactive holder keeps its slot: the other adapter's interactive request waits
    s = make(max_loras=1)
    s.add_request(lora_req("i1", 1, max_tokens=6))
    gen = run(s, 2)
    next(gen)
    s.add_request(lora_req("i2", 2, max_tokens=2))
    so, _ = next(gen)
    assert [sr.req_id for sr in so.scheduled] == ["i1"] and s.requests["i1"].num_preemptions == 0
