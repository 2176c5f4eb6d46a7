"""The scheduler with a structured-output manager (duck-typed fake, no model, no grammar library):
the compile wait, failures, aborts, forced drafts and their verification bookkeeping."""

from __future__ import annotations

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

EOS = 2


class FakeManager:
    """Grammar 'emit 10, 11, 12, 13 then EOS': 11-13 are forced after 10; compiles when told to."""

    num_forced_draft_tokens = 3
    SEQ = [10, 11, 12, 13]

    def __init__(self):
        self.states: dict[str, str | None] = {}     # None: compiling, "ready", or an error
        self.pos: dict[str, int] = {}
        self.forced_seen: list[tuple[int, int]] = []
        self.freed: list[str] = []

    def add_request(self, req):
        self.states[req.request_id] = None

    def poll(self, req):
        st = self.states[req.request_id]
        if st == "ready":
            self.pos.setdefault(req.request_id, 0)
        return st

    def has(self, rid):
        return rid in self.pos

    def accept(self, req, tokens):
        for t in tokens:
            p = self.pos[req.request_id]
            assert t == (self.SEQ[p] if p < len(self.SEQ) else EOS), (req.request_id, p, t)
            self.pos[req.request_id] = p + 1
        return self.pos[req.request_id] > len(self.SEQ)

    def drafts(self, req, proposed, max_forced):
        p = self.pos[req.request_id]
        if 1 <= p < len(self.SEQ):
            return self.SEQ[p:p + max_forced], True
        return [], False

    def observe_forced(self, n, a):
        self.forced_seen.append((n, a))

    def free(self, rid):
        self.freed.append(rid)
        self.pos.pop(rid, None)


def make(mgr, blocks=32):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), CacheConfig(block_size=4),
                     max_model_len=64, num_kv_blocks=blocks, structured_output=mgr)


def req(rid, constrained=True, n=5):
    so = StructuredOutputsParams(regex="x") if constrained else None
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=8, structured_outputs=so),
                   eos_token_id=EOS)


def run(sched, so, tokens):
    """Answer a step: per sampling request its given tokens (verified drafts + one), or 10."""
    out = ModelRunnerOutput()
    for sr in so.scheduled:
        if sr.sample:
            toks = tokens(sr)
            out.req_ids.append(sr.req_id)
            out.sampled_token_ids.append(toks[0])
            out.logprobs.append(None)
            if sr.spec_token_ids:
                out.verified_token_ids[sr.req_id] = toks
    return {o.req_id: o for o in sched.update_from_output(so, out)}


def grammar_tokens(mgr):
    def tokens(sr):
        p = mgr.pos.get(sr.req_id, 0)
        seq = mgr.SEQ + [EOS]
        return seq[p:p + len(sr.spec_token_ids) + 1] if sr.req_id in mgr.pos else [7]
    return tokens


def test_compiling_request_waits_without_blocking_others():
    mgr = FakeManager()
    s = make(mgr)
    s.add_request(req("c"))
    s.add_request(req("u", constrained=False))
    assert s.requests["c"].status == RequestStatus.WAITING_FOR_FSM
    so = s.schedule()
    assert [r.req_id for r in so.scheduled] == ["u"]              # the unconstrained one runs meanwhile
    run(s, so, grammar_tokens(mgr))
    assert s.check_invariants() == []
    mgr.states["c"] = "ready"
    so = s.schedule()
    assert {r.req_id for r in so.scheduled} == {"u", "c"}
    assert s.requests["c"].status == RequestStatus.RUNNING


def test_forced_drafts_are_verified_and_counted_apart_from_speculation():
    mgr = FakeManager()
    s = make(mgr)
    s.add_request(req("c"))
    mgr.states["c"] = "ready"
    toks = grammar_tokens(mgr)
    outs = run(s, s.schedule(), toks)                              # prefill: samples 10
    assert outs["c"].new_token_ids == [10]
    r = s.requests["c"]
    assert r.spec_token_ids == [11, 12, 13] and r.spec_forced
    so = s.schedule()
    (sr,) = so.scheduled
    assert sr.spec_token_ids == [11, 12, 13] and sr.token_ids == [10, 11, 12, 13]
    outs = run(s, so, toks)                                        # all 3 accepted + EOS: done
    assert outs["c"].new_token_ids == [11, 12, 13, EOS] and outs["c"].finish_reason == "stop"
    assert mgr.forced_seen == [(3, 3)] and s.spec_stats.num_draft_tokens == 0
    assert mgr.freed == ["c"] and s.check_invariants() == []


def test_rejected_forced_draft_rolls_back():
    mgr = FakeManager()
    s = make(mgr)
    s.add_request(req("c"))
    mgr.states["c"] = "ready"
    toks = grammar_tokens(mgr)
    run(s, s.schedule(), toks)
    so = s.schedule()
    computed = s.requests["c"].num_computed_tokens
    # the model split the forced text differently: only the first draft matched, then its own token (12)
    outs = run(s, so, lambda sr: [11, 12])
    assert outs["c"].new_token_ids == [11, 12] and mgr.forced_seen == [(3, 1)]
    r = s.requests["c"]
    assert r.num_computed_tokens == computed - 2 == r.num_tokens - 1
    assert r.spec_token_ids == [13] and r.spec_forced


def test_compile_failure_is_a_400_output_and_frees_everything():
    mgr = FakeManager()
    s = make(mgr)
    s.add_request(req("bad"))
    mgr.states["bad"] = "structured_outputs.regex: invalid regex: boom"
    so = s.schedule()
    assert so.is_empty
    outs = {o.req_id: o for o in s.update_from_output(so, ModelRunnerOutput())}
    o = outs["bad"]
    assert o.finish_reason == "error" and o.error_code == 400 and "invalid regex" in o.error
    assert "bad" not in s.requests and not s.has_unfinished_requests() and s.check_invariants() == []
    assert "bad" in mgr.freed


def test_abort_while_compiling():
    mgr = FakeManager()
    s = make(mgr)
    s.add_request(req("c"))
    s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert not s.waiting_for_grammar and "c" not in s.requests and mgr.freed == ["c"]
    assert s.check_invariants() == [] and not s.has_unfinished_requests()


def test_preempted_constrained_request_keeps_its_place_in_the_grammar():
    mgr = FakeManager()
    s = make(mgr, blocks=3)                     # 12 slots: two 4-token prompts cannot both grow
    for rid in ("a", "b"):
        s.add_request(req(rid, n=4))
        mgr.states[rid] = "ready"
    toks = grammar_tokens(mgr)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        for rid, o in run(s, s.schedule(), toks).items():
            seen[rid] += o.new_token_ids
        assert s.check_invariants() == []
    assert s.num_preemptions_total >= 1
    assert seen == {"a": [10, 11, 12, 13, EOS], "b": [10, 11, 12, 13, EOS]}


def test_structured_request_without_a_manager_is_rejected():
    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), max_model_len=64, num_kv_blocks=8)
    import pytest

    from tokenmill.core.scheduler import RequestRejectedError

    with pytest.raises(RequestRejectedError, match="structured outputs"):
        s.add_request(req("c"))


def test_forced_drafts_only_in_small_batches():
    mgr = FakeManager()
    mgr.forced_draft_max_batch = 1
    s = make(mgr)
    for rid in ("a", "b"):
        s.add_request(req(rid))
        mgr.states[rid] = "ready"
    toks = grammar_tokens(mgr)
    run(s, s.schedule(), toks)                     # both prefill and sample 10
    # two running > 1: no forced drafts are looked for (the grammar is not searched for them)
    assert not s.requests["a"].spec_token_ids and not s.requests["b"].spec_token_ids
    so = s.schedule()
    assert all(not sr.spec_token_ids for sr in so.scheduled) and len(so.scheduled) == 2
    run(s, so, toks)
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    run(s, s.schedule(), toks)                     # alone: its next drafts are the forced tokens
    assert s.requests["a"].spec_forced
    so = s.schedule()                              # and they ride along
    (sr,) = so.scheduled
    assert sr.spec_token_ids == [13]               # (the fake grammar: 10, 11, 12, 13, EOS; 12 emitted)
