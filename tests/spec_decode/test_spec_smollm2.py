"""Greedy speculative decoding on the real default model (float32): token-identical output, drafts accepted."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = ("The scheduler hands out a token budget every step. Running requests are served first, then waiting "
        "requests in policy order. A long prompt takes its slice of the budget.")


def test_ngram_greedy_identical_on_smollm2():
    prompts = [f"Repeat this text exactly:\n{TEXT}\nRepeated:\n", "The capital of France is"]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    base = LLM(dtype="float32", num_kv_blocks=256)
    want_single = [base.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    want_batch = [o.outputs[0].token_ids for o in base.generate(prompts, greedy)]
    del base
    llm = LLM(dtype="float32", num_kv_blocks=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert [llm.generate(p, greedy)[0].outputs[0].token_ids for p in prompts] == want_single
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want_batch
    st = llm.engine_core.scheduler.spec_stats
    assert st.num_accepted_tokens > 10 and st.acceptance_rate > 0.3
