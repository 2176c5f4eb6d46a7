"""SmolLM2-135M (9 query / 3 KV heads) with TP 3: greedy float32 output identical to one process."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1(monkeypatch):
    # TP shards run dense float32 weights; one process runs the GGUF's codes, whose batch-invariant default is
    # the integer kernel (int8 activations: ~0.2 of the logits' range from the dense reference, greedy flips at
    # near-ties, by design). This test is about the sharding, so the one process takes the float32 low-bit kernel.
    monkeypatch.setenv("TOKENMILL_CPU_INVARIANT_KERNEL", "float32")
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    # float32 KV cache in both: one process runs the GGUF's low-bit codes, where --kv-cache-dtype auto means
    # bfloat16, while TP shards load dense weights and keep float32; this test is about the sharding
    engine = dict(dtype="float32", num_kv_blocks=256, max_model_len=512, kv_cache_dtype="float32")
    with LLM(**engine) as llm:
        want = llm.generate(PROMPTS, params)
    with LLM(tensor_parallel_size=3, **engine) as llm:
        infos = llm.engine_core.executor.worker_infos
        assert [i.layout.split(";")[0].split(": ")[1] for i in infos] == [
            f"layers 0-29, q heads {3 * r}-{3 * r + 2}, kv heads {r}-{r}, ffn cols {512 * r}-{512 * r + 511}, "
            f"vocab rows {16384 * r}-{16384 * r + 16383}" for r in range(3)]
        got = llm.generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, (g.outputs[0].text, w.outputs[0].text)
        assert [x.logprob for x in g.outputs[0].logprobs] == pytest.approx(
            [x.logprob for x in w.outputs[0].logprobs], abs=1e-3)
