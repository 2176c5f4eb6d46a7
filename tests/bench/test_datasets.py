"""Workload builders: exact token lengths, shared prefixes, MT-bench, user files."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.datasets import (build_dataset, count_tokens, default_mt_bench_path,
                                      jsonl_dataset, mt_bench_dataset, prefix_repetition_dataset,
                                      random_dataset)


def test_random_prompts_have_requested_lengths(tokenizer):
    samples = random_dataset(tokenizer, 20, input_len=64, output_len=16, seed=1)
    assert len(samples) == 20
    lens = [count_tokens(tokenizer, s.prompt) for s in samples]
    assert lens == [s.prompt_len for s in samples]          # reported = true count
    assert sum(n == 64 for n in lens) >= 18                 # decode/re-encode converges
    assert all(abs(n - 64) <= 2 for n in lens)
    assert all(s.expected_output_len == 16 for s in samples)
    assert len({s.prompt for s in samples}) == 20


def test_random_range_ratio_and_seed(tokenizer):
    a = random_dataset(tokenizer, 30, input_len=40, output_len=20, range_ratio=0.5, seed=2)
    b = random_dataset(tokenizer, 30, input_len=40, output_len=20, range_ratio=0.5, seed=2)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    outs = [s.expected_output_len for s in a]
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 3
    assert all(18 <= s.prompt_len <= 62 for s in a)
    with pytest.raises(ValueError):
        random_dataset(tokenizer, 2, range_ratio=1.0)


def test_random_shared_prefix(tokenizer):
    samples = random_dataset(tokenizer, 8, input_len=32, output_len=4, prefix_len=48, seed=3)
    first = samples[0].prompt
    # Every prompt starts with the same prefix text (cacheable), then differs.
    common = min(len(s.prompt) for s in samples)
    k = 0
    while k < common and all(s.prompt[k] == first[k] for s in samples):
        k += 1
    prefix = first[:k]
    assert count_tokens(tokenizer, prefix) >= 44
    assert all(abs(s.prompt_len - 80) <= 2 for s in samples)


def test_prefix_repetition(tokenizer):
    samples = prefix_repetition_dataset(tokenizer, 12, prefix_len=40, suffix_len=10, num_prefixes=3,
                                        output_len=5, seed=4)
    assert len(samples) == 12
    heads = {}
    for s in samples:
        heads.setdefault(s.prompt[:60], []).append(s)
    assert len(heads) == 3 and all(len(v) == 4 for v in heads.values())
    assert len({s.prompt for s in samples}) == 12           # unique suffixes
    assert all(abs(s.prompt_len - 50) <= 2 for s in samples)


def test_mt_bench_single_and_multi_turn(tokenizer):
    path = default_mt_bench_path()
    assert path.is_file(), path
    single = mt_bench_dataset(tokenizer, 10, output_len=32, seed=0)
    assert len(single) == 10 and all(s.num_requests == 1 for s in single)
    assert all(isinstance(s.prompt, list) and s.prompt[0]["role"] == "user" for s in single)
    assert all(s.prompt_len > 20 for s in single)   # counted after the chat template
    multi = mt_bench_dataset(tokenizer, 9, multi_turn=True, seed=0)
    assert sum(s.num_requests for s in multi) == 9          # requests, follow-ups included
    assert [s.num_requests for s in multi] == [2, 2, 2, 2, 1]
    many = mt_bench_dataset(tokenizer, 100, seed=0)         # more than the 80 questions: reused
    assert len(many) == 100


def test_jsonl_formats(tmp_path, tokenizer):
    lines = [
        {"prompt": "Tell me a joke.", "max_tokens": 7},
        "A bare string prompt",
        {"conversations": [{"from": "human", "value": "What is 2+2?"},
                           {"from": "gpt", "value": "It is four, of course my friend."},
                           {"from": "human", "value": "And 3+3?"}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi there"}]},
        {"nothing": "here"},
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    samples = jsonl_dataset(tokenizer, f, 4, seed=0)
    assert len(samples) == 4
    by_kind = {("text" if isinstance(s.prompt, str) else s.prompt[-1]["content"]): s for s in samples}
    assert by_kind["What is 2+2?"].expected_output_len == count_tokens(tokenizer, "It is four, of course my friend.")
    assert by_kind["Hi there"].prompt[0]["role"] == "system"
    assert by_kind["What is 2+2?"].follow_ups == ()
    multi = jsonl_dataset(tokenizer, f, 5, multi_turn=True, seed=0)
    assert sum(s.num_requests for s in multi) == 5
    # --output-len overrides lengths in the file
    assert all(s.expected_output_len == 3 for s in jsonl_dataset(tokenizer, f, 4, output_len=3))
    # a ShareGPT-style JSON array works too
    arr = tmp_path / "sharegpt.json"
    arr.write_text(json.dumps([lines[2], lines[2]]))
    assert len(jsonl_dataset(tokenizer, arr, 2)) == 2


def test_build_dataset_errors(tokenizer):
    with pytest.raises(ValueError):
        build_dataset("nope", tokenizer, 1)
    with pytest.raises(ValueError):
        build_dataset("jsonl", tokenizer, 1)
    with pytest.raises(ValueError):
        build_dataset("random", tokenizer, 0)
