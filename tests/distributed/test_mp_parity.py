"""Greedy float32 outputs of TP 2, PP 2 and TP 2 x PP 2 (mp workers) equal the single-process engine's.

The workload (tiny random Llama, 4 layers) runs with a small KV pool (so
requests are preempted), a 16-token step budget (so prompts are prefilled in
chunks) and prefix caching (the second round shares a 16-token prefix with the
first); the test checks each of these happened and that tokens and their
logprobs are the same as on one process.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.executor import WorkerDiedError

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True, max_model_len=128)
PREFIX = list(range(10, 26))
ROUND1 = [PREFIX + [30, 31, 32], list(range(40, 75)), [5, 6, 7], list(range(60, 82))]
ROUND2 = [PREFIX + [90, 91], PREFIX + [92]]
PARAMS = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=3)


def _run(llm: LLM) -> tuple[list, list, dict]:
    outs = llm.generate(ROUND1, PARAMS) + llm.generate(ROUND2, PARAMS)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]
    s = llm.engine_core.get_stats()
    return toks, lps, {"preemptions": s.num_preemptions_total, "hits": s.prefix_cache_hits}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with LLM(tiny_llama, **ENGINE) as llm:
        toks, lps, stats = _run(llm)
    assert stats["preemptions"] > 0 and stats["hits"] >= 16, stats
    return toks, lps


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_layouts_match_one_process(tiny_llama, reference, tp, pp):
    llm = LLM(tiny_llama, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    ex = llm.engine_core.executor
    pids = ex.pids
    try:
        assert len(_alive(pids)) == tp * pp
        assert [i.layout.split(":")[0] for i in ex.worker_infos] == [
            f"rank {r} (tp {r % tp}/{tp}, pp {r // tp}/{pp})" for r in range(tp * pp)]
        toks, lps, stats = _run(llm)
        assert stats["preemptions"] > 0 and stats["hits"] >= 16, stats
        assert toks == reference[0]
        for got, want in zip(lps, reference[1]):
            assert got == pytest.approx(want, abs=1e-4)
        # each worker's step stats are reported; all TP ranks exchanged something
        assert len(ex.last_step_stats) == tp * pp and all(s.comm > 0 for s in ex.last_step_stats)
        if (tp, pp) == (2, 1):      # (one start-up less than a separate test) a dead worker fails fast
            _check_dead_worker_fails_fast(llm, pids)
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids), "worker processes left behind after shutdown"


def _check_dead_worker_fails_fast(llm: LLM, pids: list[int]) -> None:
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1"):
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
    assert time.monotonic() - t0 < 60        # no hang (generous: the shared 2-core machine runs at load ~20)
    with pytest.raises(WorkerDiedError):        # and it stays dead
        llm.generate([[9]], SamplingParams(max_tokens=1))
    assert not _alive(pids)                     # the executor stopped the survivor too


def test_tp_that_does_not_divide_heads_is_refused_before_start(tiny_llama):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide the model's 4 query heads"):
        LLM(tiny_llama, tensor_parallel_size=3, **ENGINE)
    assert set(psutil.Process().children(recursive=True)) == before


def test_quantization_with_tp_is_refused_before_start(tiny_llama):
    with pytest.raises(ValueError, match="--quantization int8 is not supported with tensor/pipeline parallelism"):
        LLM(tiny_llama, tensor_parallel_size=2, quantization="int8", **ENGINE)
