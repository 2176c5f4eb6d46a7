"""--enable-eplb is refused at start-up where it cannot run (before workers start)."""

from __future__ import annotations

import psutil
import pytest

from tokenmill import LLM

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=4, max_model_len=128)


def test_eplb_on_dense_model_refused_one_process(tiny_llama):
    with pytest.raises(ValueError, match="--enable-eplb needs a mixture-of-experts model; LlamaForCausalLM has no experts"):
        LLM(tiny_llama, enable_eplb=True, **ENGINE)


def test_eplb_on_dense_model_refused_before_workers_start(tiny_llama):
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(tiny_llama, enable_eplb=True, tensor_parallel_size=2, **ENGINE)
    assert set(psutil.Process().children(recursive=True)) == before
