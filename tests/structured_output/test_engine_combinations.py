"""Structured outputs combined with the batch lane, chunked prefill and every ``--logprobs-mode`` (slow).

Real default model through the offline LLM API, float32 weights and KV cache (as
test_engine_structured.py: the identity tests compare greedy and seeded tokens over different step
compositions, which float32 keeps bit-for-bit and a bfloat16 cache may not).
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine_core import EngineCoreRequest
from tokenmill.engine.output_processor import child_params
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.xgrammar_backend import unpack_disallowed

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=1024)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"},
                                           "city": {"enum": ["Paris", "London", "Berlin"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
QUESTIONS = ["Describe a person as JSON.", "Describe a French person as JSON.", "Describe a pilot as JSON.",
             "Describe a chef as JSON.", "Describe a teacher as JSON.", "Describe a child as JSON."]


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def json_params(i: int, **kw) -> SamplingParams:
    """Greedy for even ``i``, seeded temperature 0.8 for odd ``i``."""
    if i % 2:
        kw.setdefault("temperature", 0.8)
        kw.setdefault("seed", 1000 + i)
    else:
        kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def check_json(outs, min_stopped: int):
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= min_stopped, [(o.finish_reason, o.text) for o in outs]
    for o in stopped:
        jsonschema.validate(json.loads(o.text), SCHEMA)


# -- 1. the batch lane --------------------------------------------------------------------------------
def add(llm, prompt: str, params: SamplingParams, batch: bool) -> str:
    """``LLM._add`` with the request's lane chosen (the server sets it from ``service_tier: "batch"``)."""
    rid = str(next(llm._counter))
    ids = llm.tokenizer.encode(prompt)
    for i, cid in enumerate(llm.processor.add_request(rid, prompt, ids, params)):
        llm.engine_core.add_request(EngineCoreRequest(cid, ids, child_params(params, i), batch=batch))
    return rid


def test_batch_lane_same_tokens_as_interactive():
    """Constrained batch-lane requests that are running when constrained interactive requests arrive at
    a full house (max_num_seqs=3) are preempted for them (seat preemption of the batch lane), resume
    by recompute with their matchers still in step with their kept output, and finish with the tokens
    they get as interactive requests."""
    llm = LLM(**ENGINE, max_num_seqs=3, num_kv_blocks=256)
    try:
        prompts = [chat(llm, q) for q in QUESTIONS]
        params = [json_params(i) for i in range(len(QUESTIONS))]
        want = [o.outputs[0] for o in llm.generate(prompts, params)]      # all interactive, FCFS
        check_json(want, 4)
        core = llm.engine_core
        pre0 = core.scheduler.num_preemptions_total
        batch_ids = [add(llm, prompts[i], params[i], batch=True) for i in range(3)]
        for _ in range(8):          # the batch lane fills the seats and decodes a few tokens
            deltas, stop_ids = llm.processor.process_outputs(core.step())
            assert not stop_ids
        assert len(core.scheduler.running) == 3 and all(r.batch for r in core.scheduler.running)
        assert all(r.num_output_tokens > 0 for r in core.scheduler.running)
        inter_ids = [add(llm, prompts[i], params[i], batch=False) for i in range(3, 6)]
        ids = batch_ids + inter_ids
        llm._run_until_done(ids)
        got = [llm.processor.final_output(rid).outputs[0] for rid in ids]
        for rid in ids:
            llm.processor.remove_request(rid)
        assert core.scheduler.num_preemptions_total - pre0 >= 3       # every batch request gave its seat
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert core.check_invariants()["problems"] == []
    finally:
        llm.shutdown()


# -- 2. chunked prefill ---------------------------------------------------------------------------------
DOC = " ".join(f"Record {k}: the traveller number {k} lives in {['Paris', 'London', 'Berlin'][k % 3]} and is "
               f"{20 + 3 * k} years old." for k in range(24))


def chunked_run(max_num_batched_tokens: int, long_prefill_token_threshold: int):
    """One long constrained prompt (about 500 tokens) before two short constrained ones, so its
    partial-prefill rows precede their sampling rows in the batch; returns the outputs, the long
    prompt's length and, per step, its scheduled tokens, whether it sampled, whether others sampled."""
    llm = LLM(**ENGINE, max_num_seqs=8, num_kv_blocks=256, max_num_batched_tokens=max_num_batched_tokens,
              long_prefill_token_threshold=long_prefill_token_threshold)
    try:
        sched = llm.engine_core.scheduler
        long_prompt = chat(llm, DOC + " Describe the traveller number 17 as JSON.")
        chunks: list[tuple[int, bool]] = []
        schedule = sched.schedule

        def recording():
            so = schedule()
            others = any(r.sample for r in so.scheduled if r.req_id != "0")
            chunks.extend((len(r.token_ids), r.sample, others) for r in so.scheduled if r.req_id == "0")
            return so

        sched.schedule = recording
        prompts = [long_prompt, chat(llm, QUESTIONS[0]), chat(llm, QUESTIONS[1])]
        params = [json_params(0, max_tokens=50), json_params(2), json_params(1)]
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]   # the long prompt is request "0"
        assert llm.engine_core.check_invariants()["problems"] == []
        return outs, len(llm.tokenizer.encode(long_prompt)), chunks
    finally:
        llm.shutdown()


def test_chunked_prefill_same_tokens_as_unchunked():
    """A constrained request whose prompt is prefilled in 16-token chunks over many steps (no mask row, no
    token sampled, no matcher advanced until its last chunk), ahead of constrained requests decoding in
    those same steps, produces the tokens of the run that prefills every prompt in one step."""
    want, n_prompt, whole = chunked_run(2048, 0)
    got, _, chunked = chunked_run(32, 16)
    assert n_prompt > 400
    assert whole[0][:2] == (n_prompt, True)                  # reference: one prefill step that samples
    first = next(i for i, c in enumerate(chunked) if c[1])    # the chunk that reaches the prompt's end
    prefill = chunked[:first + 1]
    assert len(prefill) >= math.ceil(n_prompt / 16) - 4       # at most 4 chunks' worth from the prefix cache
    assert all(n <= 16 for n, _, _ in prefill) and sum(n for n, _, _ in prefill) > n_prompt - 64
    assert sum(others for _, _, others in prefill[:-1]) >= 5   # the short requests sampled meanwhile
    check_json(want, 3)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]


# -- 3. --logprobs-mode -----------------------------------------------------------------------------------
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
TOP = 5


def allowed_sets(llm, token_ids: list[int]) -> list[set[int] | None]:
    """Per generated position, the tokens the grammar allowed there (None: more than ``TOP``), replaying
    the output through a fresh matcher of the engine's backend."""
    backend = llm.engine_core.structured_output.backend
    matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(json=SCHEMA)))
    bitmask = backend.allocate_bitmask(1)
    vocab = llm.engine_core.executor.arch.vocab_size
    out = []
    for t in token_ids:
        matcher.fill_bitmask(bitmask, 0)
        allowed = (~unpack_disallowed(bitmask)[0][:vocab]).nonzero()[0]
        out.append(set(allowed.tolist()) if len(allowed) <= TOP else None)
        assert matcher.accept_token(t)
    return out


def test_logprobs_modes_report_the_masked_distribution():
    """Every ``--logprobs-mode`` reports values after the grammar mask, as vLLM does (its runner masks the
    logits in place before the sampler, whose raw modes read them first): a token the grammar refuses
    is ``-inf`` (never a finite stand-in), never among the finite top entries. Raw modes are before
    temperature and top-k, processed after them; the logprobs modes renormalise over the allowed tokens
    (a forced token has logprob 0), the logits modes report the model's logits of the allowed tokens.
    Greedy and seeded (temperature 0.8, top_k 3) requests, both with forced-token drafts on (their
    logprobs come from the verify path) and off (the sampler's path)."""
    res = {}
    for mode in MODES:
        for forced in (4, 0):
            llm = LLM(**ENGINE, max_num_seqs=4, num_kv_blocks=128, logprobs_mode=mode,
                      structured_outputs_config={"num_forced_draft_tokens": forced})
            try:
                prompts = [chat(llm, QUESTIONS[0]), chat(llm, QUESTIONS[1])]
                params = [json_params(0, logprobs=TOP, max_tokens=40),
                          json_params(1, logprobs=TOP, max_tokens=40, top_k=3)]
                outs = [o.outputs[0] for o in llm.generate(prompts, params)]
                res[mode, forced] = [(o, allowed_sets(llm, o.token_ids)) for o in outs]
            finally:
                llm.shutdown()
    base = res["raw_logits", 0]
    for (mode, forced), per_req in res.items():
        for r, (o, allowed) in enumerate(per_req):
            assert o.token_ids == base[r][0].token_ids, (mode, forced, r)   # the mode never changes tokens
            assert any(a is not None and len(a) == 1 for a in allowed)      # forced positions are covered
            for i, (lp, a) in enumerate(zip(o.logprobs, allowed)):
                where = (mode, forced, r, i)
                vals = dict(zip(lp.top_token_ids, lp.top_logprobs))
                assert lp.top_token_ids[0] == o.token_ids[i] or r == 1, where   # greedy: the masked argmax
                assert vals.get(o.token_ids[i], lp.logprob) == lp.logprob and math.isfinite(lp.logprob), where
                finite = {t for t, v in vals.items() if math.isfinite(v)}
                assert all(v == -math.inf for v in vals.values() if not math.isfinite(v)), where
                if a is None:
                    continue
                cap = 3 if (r == 1 and mode.startswith("processed")) else TOP     # top_k=3 truncates processed
                assert finite <= a and len(finite) == min(len(a), cap), (where, vals, a)
                if mode.endswith("logprobs") and len(finite) == len(a):            # all allowed tokens listed
                    assert abs(math.log(sum(math.exp(vals[t]) for t in finite))) < 1e-4, (where, vals)
                if mode.endswith("logprobs") and len(a) == 1:
                    assert lp.logprob == 0.0, where
                # raw logits of the allowed tokens: the same numbers in every raw mode and request
                raw = dict(zip(base[r][0].logprobs[i].top_token_ids, base[r][0].logprobs[i].top_logprobs))
                if mode == "raw_logprobs" and len(finite) == len(a):
                    z = math.log(sum(math.exp(raw[t]) for t in a))
                    assert all(abs(vals[t] - (raw[t] - z)) < 1e-4 for t in a), (where, vals, raw)
                if mode == "processed_logits":
                    scale = 0.8 if r == 1 else 1.0
                    assert all(abs(vals[t] - raw[t] / scale) < 1e-4 * max(1.0, abs(raw[t])) for t in finite), \
                        (where, vals, raw)
