"""Structured outputs end to end on the real default model through the offline LLM API (slow).

Every engine pins float32 weights and KV cache: the identity tests compare greedy and seeded tokens
over different step compositions (verify steps of k + 1 rows against single-token decode steps, a
recompute after preemption); a bfloat16 cache's rounding would turn last-digit differences between
those paths into different argmaxes (as tests/spec_decode/test_spec_smollm2.py explains).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=1024, max_num_seqs=16)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Berlin"]},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["kind", "x", "y"], "additionalProperties": False},
    {"type": "object", "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                            "ok": {"type": "boolean"}},
                                          "required": ["id", "ok"], "additionalProperties": False}},
     "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                      "unit": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["answer", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 16}, "last": {"type": "string", "maxLength": 16}},
        "required": ["first", "last"], "additionalProperties": False}, "active": {"type": "boolean"}},
     "required": ["person", "active"], "additionalProperties": False},
]
QUESTIONS = ["Describe a person as JSON.", "Give facts about a European capital as JSON.",
             "List a few tags for a blog post about cooking, as JSON.", "Give a 2-D point as JSON.",
             "Give two inventory items as JSON.", "How many legs does a spider have? Answer as JSON.",
             "Make up a product code as JSON.", "Describe a user account as JSON."]


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def json_params(i: int, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=StructuredOutputsParams(
        json=SCHEMAS[i % len(SCHEMAS)], disable_any_whitespace=bool(i % 2)), **kw)


def workload(llm):
    """Every schema greedy and seeded (temperature 0.8), in one batch."""
    prompts = [chat(llm, QUESTIONS[i]) for i in range(len(SCHEMAS))] * 2
    params = ([json_params(i) for i in range(len(SCHEMAS))]
              + [json_params(i, temperature=0.8, seed=100 + i) for i in range(len(SCHEMAS))])
    return prompts, params


def run(llm):
    prompts, params = workload(llm)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def baseline():
    """No forced drafts, no speculation: the reference tokens."""
    llm = LLM(**ENGINE, num_kv_blocks=512, structured_outputs_config={"num_forced_draft_tokens": 0})
    outs = run(llm)
    yield llm, outs
    llm.shutdown()


def check_valid(outs):
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= len(outs) * 3 // 4, [(o.finish_reason, o.text) for o in outs]
    for i, o in enumerate(outs):
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMAS[i % len(SCHEMAS)])


def test_json_schemas_validate(baseline):
    llm, outs = baseline
    check_valid(outs)
    stats = llm.engine_core.structured_output.stats
    assert stats.requests_by_kind["json"] == 2 * len(SCHEMAS)
    assert stats.cache_hits >= len(SCHEMAS) and stats.mask_steps > 0   # the seeded half hit the cache


def test_regex_choice_truncation_stop_strings_logprobs_and_n(baseline):
    llm, _ = baseline
    regex = SamplingParams(temperature=0, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} [0-9]{4}"))
    o = llm.generate(chat(llm, "Name a month and a year."), regex)[0].outputs[0]
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{4}", o.text) and o.finish_reason == "stop"
    choice = SamplingParams(temperature=0, max_tokens=10, logprobs=3,
                            structured_outputs=StructuredOutputsParams(choice=["positive", "negative", "neutral"]))
    o = llm.generate(chat(llm, "Is 'I love it' positive or negative?"), choice)[0].outputs[0]
    assert o.text in ("positive", "negative", "neutral") and o.finish_reason == "stop"
    assert all(lp.rank == 1 for lp in o.logprobs)                     # greedy: the masked argmax
    # max_tokens cuts the object: 'length', and the text is not a complete object
    cut = llm.generate(chat(llm, QUESTIONS[0]), json_params(0, max_tokens=4))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    # a stop string ends a constrained output early (the front end's stop, after the grammar's tokens)
    stop = SamplingParams(temperature=0, max_tokens=30, stop=[","],
                          structured_outputs=StructuredOutputsParams(regex=r"alpha,beta,gamma"))
    o = llm.generate(chat(llm, "Say three Greek letters."), stop)[0].outputs[0]
    assert o.text == "alpha" and o.finish_reason == "stop"
    # n > 1: each child has its own matcher over the shared compiled grammar
    many = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10,
                          structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    outs = llm.generate(chat(llm, "Pick a colour."), many)[0].outputs
    assert len(outs) == 3 and all(c.text in ("red", "green", "blue") for c in outs)
    # an invalid constraint fails that request with 400, the others in the batch run
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a(b"))
    res = llm.generate([chat(llm, "hi"), chat(llm, "hello")], [bad, SamplingParams(temperature=0, max_tokens=3)])
    assert res[0].outputs[0].finish_reason == "error" and "structured_outputs.regex" in res[0].error
    assert res[1].outputs[0].finish_reason == "length"
    assert llm.engine_core.check_invariants()["problems"] == []


@pytest.mark.parametrize("variant", ["forced_drafts", "ngram_and_forced_drafts", "preemption"])
def test_same_tokens_as_without(baseline, variant):
    """Forced drafts, n-gram speculation (drafts cut to the grammar, matchers rolled back) and preemption
    by recompute leave the greedy and seeded tokens of every request unchanged."""
    llm0, want = baseline
    kw = dict(ENGINE, num_kv_blocks=512)
    if variant == "ngram_and_forced_drafts":
        kw["speculative_config"] = NGRAM
    if variant == "preemption":
        kw.update(num_kv_blocks=40, structured_outputs_config={"num_forced_draft_tokens": 0})   # 640 slots
    llm = LLM(**kw)
    try:
        got = run(llm)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        stats = llm.engine_core.structured_output.stats
        if variant == "preemption":
            assert llm.engine_core.scheduler.num_preemptions_total > 0
        else:
            assert stats.forced_draft_tokens > 0 and stats.forced_accepted_tokens > 0
        if variant == "ngram_and_forced_drafts":
            assert llm.engine_core.scheduler.spec_stats.num_draft_tokens > 0
        assert llm.engine_core.check_invariants()["problems"] == []
    finally:
        llm.shutdown()
