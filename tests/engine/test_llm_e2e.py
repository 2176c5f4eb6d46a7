"""End-to-end engine tests with the real packaged model (SmolLM2-135M-Instruct, Q4_1 GGUF).

Parity with Hugging Face transformers, equivalence across scheduling
configurations (prefix caching, chunked prefill, preemption), seeded sampling
independent of the batch, and stopping rules.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_reference import smollm2_hf_float32
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "List three colours: red,",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Explain, in one sentence, why the sky is blue. " * 3,
    ("You are a helpful assistant. Summarise the following text.\n"
     + "Paged attention stores the key and value cache in fixed-size blocks so that memory is not wasted. " * 12),
    "Translate to French: I like apples and oranges.",
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _lowbit_off():
    """Parity and equivalence run the float32 reference path: the GGUF low-bit small-step path off (its logits
    are checked against the dequantised reference in tests/model/test_gguf.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "0")
        yield


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def reference_ids(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_parity_with_transformers(llm: LLM) -> None:
    """Greedy ids equal transformers' on the same GGUF in float32 (both stop at EOS)."""
    hf = smollm2_hf_float32()
    tok = llm.get_tokenizer()
    ours_all = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    lengths = set()
    for prompt, ours in zip(PROMPTS, ours_all):
        ids = tok.encode(prompt)
        assert ours.prompt_token_ids == ids
        lengths.add(len(ids))
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        theirs = out[0, len(ids):].tolist()
        assert ours.outputs[0].token_ids == theirs, f"greedy ids differ for prompt {prompt[:40]!r}"
    assert len(lengths) >= 8 and max(lengths) > 100


@pytest.mark.parametrize("kwargs", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=8),  # every prompt is chunked
    dict(max_num_seqs=2),
    dict(long_prefill_token_threshold=16),  # long prompts share steps with the others, 16 tokens at a time
])
def test_equivalent_under_scheduling_configs(kwargs, reference_ids) -> None:
    other = LLM(dtype="float32", max_model_len=1024, **kwargs)
    outs = other.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference_ids


def test_equivalent_with_preemption(reference_ids) -> None:
    # 20 blocks x 16 tokens: far fewer than all prompts need at once, so requests are preempted and recomputed.
    small = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=20, block_size=16)
    outs = small.generate(PROMPTS, GREEDY)
    assert small.engine_core.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == reference_ids
    assert small.engine_core.scheduler.kv_cache_usage == 0.0


def test_prefix_cache_hits_same_output(llm: LLM, reference_ids) -> None:
    before = llm.engine_core.get_stats()
    outs = llm.generate(PROMPTS, GREEDY)  # second time: prompts' full blocks are cached
    after = llm.engine_core.get_stats()
    assert [o.outputs[0].token_ids for o in outs] == reference_ids
    assert after.prefix_cache_hits > before.prefix_cache_hits
    assert any(o.num_cached_tokens > 0 for o in outs)


def test_request_larger_than_pool_fails_fast_and_small_completes() -> None:
    small = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=8, block_size=16)  # 128 tokens in the pool
    big = "word " * 300
    outs = small.generate([big, "Hello"], SamplingParams(temperature=0, max_tokens=8))
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].error
    assert outs[1].outputs[0].finish_reason in ("stop", "length") and outs[1].outputs[0].token_ids
    assert small.engine_core.scheduler.kv_cache_usage == 0.0
    assert small.engine_core.scheduler.kv_cache_manager.num_free_blocks == 8


def test_abort_frees_every_block(llm: LLM) -> None:
    from tokenmill.engine.engine_core import EngineCoreRequest

    core = llm.engine_core
    free_before = core.scheduler.kv_cache_manager.num_free_blocks
    ids = llm.get_tokenizer().encode("Tell me a long story about dragons.")
    for i in range(3):
        core.add_request(EngineCoreRequest(f"abort-{i}", ids, SamplingParams(max_tokens=100, ignore_eos=True)))
    for _ in range(4):
        core.step()
    assert core.scheduler.kv_cache_usage > 0
    core.abort_requests([f"abort-{i}" for i in range(3)])
    core.step()
    assert core.scheduler.kv_cache_usage == 0.0
    assert core.scheduler.kv_cache_manager.num_free_blocks == free_before
    assert not core.has_unfinished_requests()


def test_seeded_sampling_independent_of_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Tell me a joke.", "Once upon a time", "What is 2+2?", "Name a fruit."],
        [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), seeded,
         SamplingParams(temperature=0.8, seed=7, max_tokens=16), SamplingParams(temperature=1.0, max_tokens=5)],
    )
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["Once upon a time"], seeded)[0].outputs[0].token_ids
    assert again == alone


def test_max_tokens_zero_and_one(llm: LLM) -> None:
    one = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    assert len(one.token_ids) == 1 and one.finish_reason in ("length", "stop")
    zero = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=0))[0].outputs[0]
    assert zero.token_ids == [] and zero.text == "" and zero.finish_reason == "length"


def test_min_tokens_suppresses_eos(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Say just the word yes."}]
    free = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert free.finish_reason == "stop"  # stops at <|im_end|>
    n = len(free.token_ids)
    forced = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 5))[0].outputs[0]
    assert len(forced.token_ids) >= n + 5


def test_stop_string_across_token_boundaries(llm: LLM, reference_ids) -> None:
    tok = llm.get_tokenizer()
    full = llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0]
    # Pick a stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    text = full.text
    assert pieces[-1] == text
    k = next(i for i in range(2, len(pieces)) if len(pieces[i]) - len(pieces[i - 2]) >= 4)
    start = len(pieces[k - 2]) - 2
    stop = text[start:start + 4]
    assert stop and stop in text
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    incl = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert incl.text == text[: text.index(stop) + len(stop)]


def test_multibyte_utf8_output_has_no_replacement_chars(llm: LLM) -> None:
    """Greedy answers full of emoji / CJK (byte-level BPE splits them across tokens), cut at max_tokens."""
    convs = [[{"role": "user", "content": "Write a short happy message with emoji 😀🎉."}],
             [{"role": "user", "content": "What is the Japanese word for 'thank you'? Write it in Japanese characters."}]]
    outs = [llm.chat(c, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0] for c in convs for n in (13, 14, 40)]
    outs += [o.outputs[0] for o in llm.generate(["Emoji list: 😀 😃 😄 😁 😆 😅", "中文：你好，世界。日本語：こんにちは。中文："],
                                                  SamplingParams(temperature=0, max_tokens=20))]
    tok = llm.get_tokenizer()
    for out in outs:
        assert "\ufffd" not in out.text
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert sum(any(ord(c) > 0x2000 for c in out.text) for out in outs) >= 4


def test_n_greater_than_one_and_timings(llm: LLM) -> None:
    out = llm.generate(["Pick a random animal:"], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                                   ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_bad_prompts_raise_value_error(llm: LLM) -> None:
    for bad in ([49152], [-1], ["a", "b"]):
        with pytest.raises(ValueError, match="token ids"):
            llm.generate([bad], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=2))
    assert not llm.engine_core.has_unfinished_requests()


@pytest.fixture(scope="module")
def prompt_logprob_runs(llm: LLM):
    """Prompt logprobs (top 3) of three prompts, the long one included, computed the plain way
    (after test_prefix_cache_hits_same_output the module LLM holds these prompts' blocks: they must
    be recomputed, not read from the cache)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    return llm.generate([PROMPTS[1], PROMPTS[4], PROMPTS[7]], params)


def test_prompt_logprobs_match_transformers(prompt_logprob_runs) -> None:
    hf = smollm2_hf_float32()
    for out in prompt_logprob_runs:
        ids = out.prompt_token_ids
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(ids) and plp[0] is None
        assert out.num_cached_tokens == 0
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)   # [P, V]
        for t in range(1, len(ids)):
            e = plp[t]
            assert abs(e.logprob - ref[t - 1, ids[t]].item()) < 2e-3, (t, e.logprob)
            assert e.rank == int((ref[t - 1] > ref[t - 1, ids[t]]).sum()) + 1
            assert len(e.top_token_ids) == 3 and e.top_token_ids[0] == int(ref[t - 1].argmax())


def test_prompt_logprobs_same_when_chunked_and_preempted(prompt_logprob_runs) -> None:
    # a 300-token step budget and a 24-block pool that two copies of the long prompt (17 blocks each)
    # cannot share: the second copy starts with a chunk, is preempted mid-prompt, and is recomputed
    small = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=24, block_size=16, max_num_batched_tokens=300)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    outs = small.generate([PROMPTS[1], PROMPTS[4], PROMPTS[7], PROMPTS[7]], params)
    assert small.engine_core.scheduler.num_preemptions_total > 0
    for got, want in zip(outs, [*prompt_logprob_runs, prompt_logprob_runs[2]]):
        assert got.error is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert abs(a.logprob - b.logprob) < 1e-4 and a.top_token_ids == b.top_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert small.engine_core.scheduler.kv_cache_usage == 0.0
