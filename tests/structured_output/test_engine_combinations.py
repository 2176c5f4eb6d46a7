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
    with their matchers rebuilt, and finish with the tokens they get as interactive requests."""
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


def chunked_run(max_num_batched_tokens: int):
    """One long constrained prompt (about 500 tokens) after two short constrained ones; returns the
    outputs, the long prompt's length and, per step, how many of its tokens were scheduled."""
    llm = LLM(**ENGINE, max_num_seqs=8, num_kv_blocks=256, max_num_batched_tokens=max_num_batched_tokens)
    try:
        sched = llm.engine_core.scheduler
        long_prompt = chat(llm, DOC + " Describe the traveller number 17 as JSON.")
        chunks: list[tuple[int, bool]] = []
        schedule = sched.schedule

        def recording():
            so = schedule()
            others = any(r.sample for r in so.scheduled if r.req_id != "2")
            chunks.extend((len(r.token_ids), r.sample, others) for r in so.scheduled if r.req_id == "2")
            return so

        sched.schedule = recording
        prompts = [chat(llm, QUESTIONS[0]), chat(llm, QUESTIONS[1]), long_prompt]
        params = [json_params(2), json_params(1), json_params(0, max_tokens=50)]
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]   # the long prompt is request "2"
        assert llm.engine_core.check_invariants()["problems"] == []
        return outs, len(llm.tokenizer.encode(long_prompt)), chunks
    finally:
        llm.shutdown()


def test_chunked_prefill_same_tokens_as_unchunked():
    """A constrained request whose prompt is prefilled over many 32-token steps (no mask filled, no token
    sampled, no matcher advanced until its last chunk), next to constrained requests decoding in those
    same steps, produces the tokens of the run that prefills every prompt in one step."""
    want, n_prompt, whole = chunked_run(2048)
    got, _, chunked = chunked_run(32)
    assert n_prompt > 400
    assert whole[0][:2] == (n_prompt, True)                  # reference: one prefill step that samples
    first = next(i for i, c in enumerate(chunked) if c[1])    # the chunk that reaches the prompt's end
    prefill = chunked[:first + 1]
    assert len(prefill) >= math.ceil(n_prompt / 32) - 2       # at most 2 blocks (32 tokens) from the prefix cache
    assert all(n <= 32 for n, _, _ in prefill) and sum(n for n, _, _ in prefill) > n_prompt - 64
    assert sum(others for _, _, others in prefill[:-1]) >= 5   # the short requests sampled meanwhile
    check_json(want, 3)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
