"""``--distributed-executor-backend ray``: TP 2 on a local Ray cluster equals one process."""

from __future__ import annotations

import importlib.util

import psutil
import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="ray is not installed (pip install 'tokenmill[ray]')")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41], list(range(60, 90))]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


def test_ray_tp2_matches_one_process(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)        # a local cluster owned by this test
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    engine = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    with LLM(tiny_llama, **engine) as llm:
        want = llm.generate(PROMPTS, PARAMS)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # (with the KV offloading tier: its per-rank stores run in the actors, over the same one start-up)
    llm = LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray", kv_offloading_backend="native",
              kv_offloading_size=0.01, kv_offloading_dir=str(tmp_path), **engine)
    try:
        ex = llm.engine_core.executor
        assert ex.backend == "ray" and len(ex.worker_infos) == 2
        assert [i.layout.split(";")[0] for i in ex.worker_infos] == [
            "rank 0 (tp 0/2, pp 0/1): layers 0-3, q heads 0-1, kv heads 0-0, ffn cols 0-63, vocab rows 0-50",
            "rank 1 (tp 1/2, pp 0/1): layers 0-3, q heads 2-3, kv heads 1-1, ffn cols 64-127, vocab rows 51-101"]
        got = llm.generate(PROMPTS, PARAMS)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert [x.logprob for x in g.outputs[0].logprobs] == pytest.approx(
                [x.logprob for x in w.outputs[0].logprobs], abs=1e-4)
        core = llm.engine_core
        assert core.kv_offload.flush()
        core.scheduler.reset_prefix_cache()              # the pool forgets: the prompts come from the actors' tiers
        again = llm.generate(PROMPTS, PARAMS)
        assert [g.outputs[0].token_ids for g in again] == [g.outputs[0].token_ids for g in got]
        st = core.kv_offload.get_tier_stats()
        assert st.num_loads == 2 and st.blocks_loaded == 1 + 7 and st.num_failed_loads == 0
    finally:
        llm.shutdown()
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"Ray processes left behind: {[(p.pid, p.name()) for p in left]}"
