"""Speculative decoding (ngram) under tensor parallelism: TP 2 mp workers give the single process's greedy tokens.

Every rank runs the ordinary model runner with its own speculative-decoding state; the step description
carries each request's drafts and the step's draft length to the workers, and the output rank's proposals
come back in its ModelRunnerOutput.
"""

from __future__ import annotations

from tokenmill import LLM, SamplingParams

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
              max_model_len=128)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
# repeated phrases, so prompt lookup finds drafts (and a tiny random model's greedy output loops)
PROMPTS = [[5, 6, 7, 8, 9, 10] * 3 + [5, 6], list(range(20, 30)) * 2 + [20], [40, 41, 42, 43] * 4]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_ngram_tp2_greedy_identical_to_one_process(tiny_llama):
    with LLM(tiny_llama, **ENGINE) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    with LLM(tiny_llama, tensor_parallel_size=2, speculative_config=SPEC, **ENGINE) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        single = llm.generate(PROMPTS[0], PARAMS)[0].outputs[0].token_ids
        st = llm.engine_core.scheduler.spec_stats
    assert got == want
    assert single == want[0]
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st
