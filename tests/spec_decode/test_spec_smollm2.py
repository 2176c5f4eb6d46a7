"""Greedy speculative decoding on the real default model (float32): token-identical output, drafts accepted."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

# Every engine here pins a float32 KV cache: these tests compare greedy output over different step compositions
# (verify steps of k + 1 tokens against single-token decode steps); --kv-cache-dtype auto would pick bfloat16 for a
# float32 model on the CPU low-bit path, whose K/V rounding turns the paths' last-digit differences into ulp-sized
# steps (its own bound: tests/model/test_kv_cache_bf16_default.py).
TEXT = ("The scheduler hands out a token budget every step. Running requests are served first, then waiting "
        "requests in policy order. A long prompt takes its slice of the budget.")


def test_ngram_greedy_identical_on_smollm2():
    prompts = [f"Repeat this text exactly:\n{TEXT}\nRepeated:\n", "The capital of France is"]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    base = LLM(dtype="float32", kv_cache_dtype="float32", num_kv_blocks=256)
    want_single = [base.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    want_batch = [o.outputs[0].token_ids for o in base.generate(prompts, greedy)]
    del base
    llm = LLM(dtype="float32", kv_cache_dtype="float32", num_kv_blocks=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts] == want_single
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want_batch
    st = llm.engine_core.scheduler.spec_stats
    assert st.num_accepted_tokens > 10 and st.acceptance_rate > 0.3


def test_early_exit_gguf_draft_is_greedy_identical_and_runs_low_bit(tmp_path):
    """The benchmark's draft: the target's first layers as a GGUF (same Q4_1/Q8_0 blocks), loaded with its
    low-bit codes like the target; greedy output equals the target's alone."""
    import gguf

    from tokenmill.model.loader import default_model_path
    from tokenmill.spec_decode.early_exit import truncate_gguf

    path = truncate_gguf(default_model_path(), 3, tmp_path / "draft.gguf")
    r = gguf.GGUFReader(path)
    assert int(r.fields["llama.block_count"].contents()) == 3
    assert {t.name.split(".")[1] for t in r.tensors if t.name.startswith("blk.")} == {"0", "1", "2"}
    with pytest.raises(ValueError, match="layers must be"):
        truncate_gguf(default_model_path(), 0, tmp_path / "bad.gguf")
    prompt = f"Repeat this text exactly:\n{TEXT}\nRepeated:\n"
    greedy = SamplingParams(temperature=0, max_tokens=24)
    base = LLM(dtype="float32", kv_cache_dtype="float32", num_kv_blocks=128)
    want = base.generate(prompt, greedy)[0].outputs[0].token_ids
    del base
    llm = LLM(dtype="float32", kv_cache_dtype="float32", num_kv_blocks=128,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    draft = llm.engine_core.executor.spec_decode.draft          # uniproc: the executor is the runner
    assert draft.arch.num_hidden_layers == 3 and draft.lowbit_layers == 3 * 4 + 1
    assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == want
    assert llm.engine_core.scheduler.spec_stats.num_draft_tokens > 0
