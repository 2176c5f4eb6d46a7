"""Scheduler with draft tokens, driven by a fake runner (no model): budget, KV slots, truncation, rollback,
prefix-cache hashing, stops inside drafts, dynamic k, preemption and abort with drafts in flight."""

from __future__ import annotations

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_sched(num_blocks=32, budget=64, max_model_len=64, k=4, ranges=None, method="ngram", max_num_seqs=16):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, model="x" if method == "draft_model" else None,
                             num_speculative_tokens_per_batch_size=ranges)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                     CacheConfig(block_size=BS), max_model_len=max_model_len, num_kv_blocks=num_blocks,
                     speculative_config=spec)


def make_req(rid, prompt, eos=None, **sp):
    sp.setdefault("max_tokens", 32)
    return Request(rid, list(prompt), SamplingParams(**sp), eos_token_id=eos, arrival_time=0.0)


class SpecRunner:
    """The 'target' emits ``truth[rid]`` in order; it accepts drafts while they equal it.

    ``propose[rid]`` gives the drafts proposed after each step (a callable of the request's
    output length after the step, or a fixed list); default: the next ``k`` true tokens.
    """

    def __init__(self, truth, propose=None):
        self.truth = truth
        self.propose = propose or {}
        self.seen: list[SchedulerOutput] = []

    def __call__(self, so: SchedulerOutput, sched: Scheduler) -> ModelRunnerOutput:
        self.seen.append(so)
        out = ModelRunnerOutput()
        for sr in so.scheduled:
            if not sr.sample:
                continue
            n_out = len(sr.output_token_ids)
            true = self.truth[sr.req_id][n_out:]
            a = 0
            while a < len(sr.spec_token_ids) and sr.spec_token_ids[a] == true[a]:
                a += 1
            emitted = true[:a + 1]
            out.req_ids.append(sr.req_id)
            out.sampled_token_ids.append(emitted[0])
            out.logprobs.append(None)
            if sr.spec_token_ids:
                out.verified_token_ids[sr.req_id] = emitted
                out.verified_logprobs[sr.req_id] = [None] * len(emitted)
            k = so.num_spec_tokens
            p = self.propose.get(sr.req_id)
            after = n_out + len(emitted)
            drafts = p(after) if callable(p) else (list(p) if p is not None else self.truth[sr.req_id][after:after + k])
            if k and drafts:
                out.draft_token_ids[sr.req_id] = drafts[:k]
        return out


def step(s, runner):
    so = s.schedule()
    assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert so.total_num_scheduled_tokens == sum(len(x.token_ids) for x in so.scheduled)
    outs = s.update_from_output(so, runner(so, s))
    return so, {o.req_id: o for o in outs}


TRUTH = list(range(500, 600))


def test_drafts_are_extra_tokens_in_budget_and_slots():
    s = make_sched(k=4)
    r = make_req("a", range(10, 18))         # 8 prompt tokens = 2 full blocks
    s.add_request(r)
    run = SpecRunner({"a": TRUTH})
    so, outs = step(s, run)                  # prefill; runner proposes 4 drafts
    assert outs["a"].new_token_ids == [500] and r.spec_token_ids == [501, 502, 503, 504]
    assert so.num_spec_tokens == 4
    so, outs = step(s, run)                  # decode 500 + 4 drafts, all accepted + bonus
    (sr,) = so.scheduled
    assert sr.token_ids == [500, 501, 502, 503, 504] and sr.spec_token_ids == [501, 502, 503, 504]
    assert sr.num_computed_tokens == 8 and so.total_num_scheduled_tokens == 5
    assert len(sr.block_ids) == 4            # slots for 8 + 5 tokens: 13 -> 4 blocks of 4
    assert outs["a"].new_token_ids == [501, 502, 503, 504, 505]
    assert r.num_computed_tokens == 13 and r.num_tokens == 14
    st = s.spec_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 4, 4)
    assert st.num_accepted_tokens_per_pos == [1, 1, 1, 1]


def test_rollback_over_rejected_drafts_and_no_hash_of_rejected_tokens():
    s = make_sched(k=4)
    r = make_req("a", range(10, 17))         # 7 prompt tokens
    s.add_request(r)
    # drafts: the first two right, then wrong ones (999, 998)
    run = SpecRunner({"a": TRUTH}, propose={"a": lambda n: [TRUTH[n], TRUTH[n + 1], 999, 998]})
    step(s, run)                              # prefill -> 500; drafts [501, 502, 999, 998]
    so, outs = step(s, run)
    assert so.scheduled[0].token_ids == [500, 501, 502, 999, 998]
    assert outs["a"].new_token_ids == [501, 502, 503]     # two accepted + the target's token
    # computed: 7 prompt + 500, 501, 502 (the positions of 999/998 rolled back)
    assert r.num_computed_tokens == 10 and r.num_tokens == 11
    st = s.spec_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 4, 2)
    assert st.num_accepted_tokens_per_pos == [1, 1, 0, 0]
    # Only full blocks of accepted tokens are cached: blocks 0 and 1 (tokens 0..7), never one holding 999.
    km = s.kv_cache_manager
    assert km.num_cached_blocks["a"] == 2
    probe = make_req("p", [*range(10, 17), 500, 501, 502, 999, 998, 0])
    hit_blocks, n_hit = km.get_computed_blocks(probe)
    assert n_hit == 8                        # block 2 would need 999 at position 11: never hashed
    same = make_req("q", [*range(10, 17), 500, 501, 502, 503, 7, 7, 7, 7])
    assert km.get_computed_blocks(same)[1] == 8   # block 2 not full of computed tokens yet either


def test_budget_truncates_drafts():
    s = make_sched(k=4, budget=7)
    for rid in ("a", "b"):
        s.add_request(make_req(rid, range(10, 13)))
    run = SpecRunner({"a": TRUTH, "b": TRUTH})
    step(s, run)                              # both prefills: 6 tokens
    so, _ = step(s, run)
    # a: 1 + 4 drafts = 5 tokens; b: the 2 left = 1 + 1 draft
    assert [(x.req_id, len(x.token_ids), len(x.spec_token_ids)) for x in so.scheduled] == [("a", 5, 4), ("b", 2, 1)]
    assert so.total_num_scheduled_tokens == 7


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_drafts_truncated_at_limits(limit):
    if limit == "max_tokens":
        s = make_sched(k=4)
        r = make_req("a", range(10, 14), max_tokens=4)
    else:
        s = make_sched(k=4, max_model_len=8)
        r = make_req("a", range(10, 14), max_tokens=None)   # 4 prompt + at most 4 generated
    s.add_request(r)
    run = SpecRunner({"a": TRUTH})
    step(s, run)                                # 1 output; 3 may follow
    so, outs = step(s, run)
    # even if every draft is accepted the request must end at 4 outputs: 1 + drafts + 1 <= 4
    assert len(so.scheduled[0].spec_token_ids) == 2
    assert outs["a"].new_token_ids == [501, 502, 503] and outs["a"].finish_reason == "length"
    assert r.num_output_tokens == 4 and r.num_tokens <= 8


def test_dynamic_k_by_batch_size():
    ranges = [[1, 1, 4], [2, 3, 2], [4, 100, 0]]
    for nreq, want in ((1, 4), (2, 2), (3, 2), (4, 0), (6, 0)):
        s = make_sched(k=4, ranges=ranges)
        truth = {}
        for i in range(nreq):
            s.add_request(make_req(f"r{i}", range(10 + 10 * i, 13 + 10 * i)))
            truth[f"r{i}"] = TRUTH
        run = SpecRunner(truth)
        so, _ = step(s, run)
        assert so.num_spec_tokens == want
        so, _ = step(s, run)
        assert all(len(x.spec_token_ids) == want for x in so.scheduled), (nreq, so.scheduled)
    # the table follows the batch size seen at scheduling time: drafts of a request proposed at a
    # smaller batch are cut when the batch grows
    s = make_sched(k=4, ranges=ranges)
    s.add_request(make_req("a", range(10, 13)))
    run = SpecRunner({"a": TRUTH, "b": TRUTH})
    step(s, run)
    assert len(s.requests["a"].spec_token_ids) == 4
    s.add_request(make_req("b", range(40, 43)))
    so, _ = step(s, run)                      # 1 running when scheduled: a keeps 4 drafts
    assert len(so.scheduled[0].spec_token_ids) == 4 and so.num_spec_tokens == 2
    so, _ = step(s, run)                      # 2 running: k = 2
    assert [len(x.spec_token_ids) for x in so.scheduled] == [2, 2]


def test_stop_inside_accepted_drafts_ends_request_there():
    s = make_sched(k=4)
    r = make_req("a", range(10, 13), eos=503)
    s.add_request(r)
    run = SpecRunner({"a": TRUTH})
    step(s, run)
    so, outs = step(s, run)                   # drafts 501..504 all accepted; EOS 503 inside
    assert outs["a"].new_token_ids == [501, 502, 503] and outs["a"].finish_reason == "stop"
    assert r.output_token_ids == [500, 501, 502, 503] and s.kv_cache_manager.num_free_blocks == 32
    # stop_token_ids likewise, with stop_reason; min_tokens keeps an early EOS from stopping
    s = make_sched(k=4)
    r = make_req("b", range(10, 13), stop_token_ids=[502])
    s.add_request(r)
    run = SpecRunner({"b": TRUTH})
    step(s, run)
    _, outs = step(s, run)
    assert outs["b"].new_token_ids == [501, 502] and outs["b"].stop_reason == 502
    s = make_sched(k=4)
    r = make_req("c", range(10, 13), eos=501, min_tokens=3)
    s.add_request(r)
    run = SpecRunner({"c": TRUTH})
    step(s, run)
    _, outs = step(s, run)
    assert outs["c"].new_token_ids == [501, 502, 503, 504, 505] and outs["c"].finish_reason is None


def test_drafts_dropped_before_anyone_is_preempted():
    # 3 blocks of 4: a (7-token prompt) holds 2, c (3-token prompt) holds 1; the pool is full.
    s = make_sched(num_blocks=3, k=4)
    a, c = make_req("a", range(10, 17), max_tokens=6), make_req("c", range(30, 33), max_tokens=2)
    s.add_request(a)
    s.add_request(c)
    run = SpecRunner({"a": TRUTH, "c": TRUTH})
    step(s, run)
    assert s.kv_cache_manager.num_free_blocks == 0 and len(a.spec_token_ids) == 4
    so, outs = step(s, run)
    # a's 4 drafts would need a third block: they are dropped, nobody is preempted
    assert [(x.req_id, x.spec_token_ids) for x in so.scheduled] == [("a", []), ("c", [])]
    assert not so.preempted_req_ids and outs["a"].new_token_ids == [501]
    assert a.num_computed_tokens == 8 and s.spec_stats.num_drafts == 0


def test_preemption_with_drafts_in_flight():
    # 6 blocks: a and b hold 2 each after prefill; a's step with 4 drafts takes the last 2 blocks,
    # b cannot get one even without drafts and is preempted (latest arrival): its drafts are forgotten.
    s = make_sched(num_blocks=6, k=4)
    a, b = make_req("a", range(10, 18), max_tokens=8), make_req("b", range(30, 38), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    run = SpecRunner({"a": TRUTH, "b": TRUTH})
    step(s, run)
    assert len(b.spec_token_ids) == 4
    so, outs = step(s, run)
    assert [(x.req_id, len(x.spec_token_ids)) for x in so.scheduled] == [("a", 4)]
    assert so.preempted_req_ids == ["b"]
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0 and b.status == RequestStatus.PREEMPTED
    # a finishes (8 tokens); b is re-admitted, recomputes its prefix and continues correctly
    for _ in range(6):
        step(s, run)
    assert a.output_token_ids == TRUTH[:8] and b.output_token_ids == TRUTH[:8]
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_free_blocks == 6


def test_abort_with_drafts_in_flight_frees_blocks():
    s = make_sched(k=4)
    s.add_request(make_req("a", range(10, 18)))
    run = SpecRunner({"a": TRUTH})
    step(s, run)
    so = s.schedule()                         # drafts scheduled ...
    assert so.scheduled[0].spec_token_ids
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)   # ... then the client goes away
    assert s.update_from_output(so, run(so, s)) == []
    assert s.kv_cache_manager.num_free_blocks == 32 and not s.has_unfinished_requests()
    assert s.spec_stats.num_drafts == 0


def test_n_children_each_speculate_independently():
    s = make_sched(k=3)
    for i in range(3):                        # n = 3 choices of one prompt: three requests sharing blocks
        s.add_request(make_req(f"x-{i}", range(10, 19), seed=i))
    truth = {f"x-{i}": list(range(600 + 100 * i, 700 + 100 * i)) for i in range(3)}
    run = SpecRunner(truth, propose={"x-1": [0, 0, 0]})      # choice 1's drafts are always wrong
    for _ in range(4):
        step(s, run)
    outs = {rid: s.requests[rid].output_token_ids for rid in truth}
    for rid, t in truth.items():
        assert outs[rid] == t[:len(outs[rid])]
    assert len(outs["x-0"]) == 1 + 4 * 3 and len(outs["x-1"]) == 4


def test_draft_model_reserves_lookahead_slots():
    s = make_sched(k=4, method="draft_model")
    assert s.num_lookahead_tokens == 4
    r = make_req("a", range(10, 18))
    s.add_request(r)
    run = SpecRunner({"a": TRUTH})
    step(s, run)
    so, _ = step(s, run)
    # 8 + 5 scheduled tokens + 4 lookahead slots for the draft's next proposals -> 17 -> 5 blocks
    assert len(so.scheduled[0].block_ids) == 5


def test_speculative_config_validation():
    parse = SpeculativeConfig.parse
    c = parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)       # vLLM's defaults
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert parse({"model": "d.gguf", "num_speculative_tokens": 2}).method == "draft_model"
    c = parse({"method": "ngram", "num_speculative_tokens": 4,
               "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 8, 2], [9, 16, 0]]})
    assert [c.num_tokens_for_batch(b) for b in (1, 4, 5, 8, 9, 16, 17, 500)] == [4, 4, 2, 2, 0, 0, 0, 0]
    bad = [
        "not json", "[1]", {"method": "ngram"}, {"method": "eagle", "num_speculative_tokens": 1},
        {"method": "ngram", "num_speculative_tokens": 0}, {"method": "ngram", "num_speculative_tokens": 2, "x": 1},
        {"method": "draft_model", "num_speculative_tokens": 2},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]},
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 3]]},
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [6, 9, 1]]},
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 1], [3, 9, 1]]},
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 0, 1]]},
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []},
        {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 2]]},
    ]
    for b in bad:
        with pytest.raises(ValueError, match="speculative_config"):
            parse(b)


class _CharTokenizer:
    """id i decodes to chr(ord('a') + i)."""

    def decode(self, ids, **kw):
        return "".join(chr(97 + i) for i in ids)


def test_stop_string_inside_accepted_drafts_drops_the_tokens_after_it():
    from tokenmill.core.sched_output import EngineCoreOutput
    from tokenmill.engine.output_processor import OutputProcessor

    proc = OutputProcessor(_CharTokenizer())
    proc.add_request("r", None, [0], SamplingParams(stop=["cd"], max_tokens=20))
    # one step emits 5 tokens (accepted drafts + target token): "b c d e f"; "cd" completes at the 3rd
    deltas, stop_ids = proc.process_outputs([EngineCoreOutput(req_id="r", new_token_ids=[1, 2, 3, 4, 5],
                                                              new_logprobs=[None] * 5)])
    assert stop_ids == ["r"]
    (d,) = deltas
    assert d.outputs[0].token_ids == [1, 2, 3] and d.outputs[0].text == "b"
    assert d.outputs[0].finish_reason == "stop" and d.outputs[0].stop_reason == "cd"
