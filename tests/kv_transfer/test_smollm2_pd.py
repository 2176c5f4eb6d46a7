"""Disaggregated greedy decoding with the real packaged model (SmolLM2-135M-Instruct GGUF), float32, both connectors."""

from __future__ import annotations

import json
import time

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is",
           "You are a helpful assistant. Summarise the following text.\n"
           + "Paged attention stores the key and value cache in fixed-size blocks so that memory is not wasted. " * 8]


@pytest.fixture(scope="module", autouse=True)
def _lowbit_off():
    """The float32 reference path (the GGUF low-bit small-step path would differ between batch shapes)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "0")
        yield


def _core(tmp, connector=None, role=None):
    kw = dict(dtype="float32", max_model_len=1024, num_kv_blocks=128)
    if connector:
        kw["kv_transfer_config"] = json.dumps({"kv_connector": connector, "kv_role": role, "kv_port": 0,
                                               "kv_connector_extra_config": {"shm_dir": str(tmp)}})
    return EngineCore(EngineConfig.from_kwargs(**kw))


def _ids(core, rid, prompt_ids, sp):
    core.add_request(EngineCoreRequest(rid, prompt_ids, sp))
    toks, deadline = [], time.monotonic() + 900
    while time.monotonic() < deadline:
        for o in core.step():
            if o.req_id == rid:
                toks += o.new_token_ids
                if o.finish_reason:
                    return toks, o.kv_transfer_params
        time.sleep(0.002)
    raise AssertionError("no finish")


@pytest.mark.parametrize("connector", ["TcpConnector", "SharedMemoryConnector"])
def test_smollm2_disaggregated_equals_colocated(tmp_path, connector):
    ref, prod, cons = _core(tmp_path), _core(tmp_path, connector, "kv_producer"), _core(tmp_path, connector, "kv_consumer")
    try:
        tok = ref.executor.loaded.tokenizer
        for i, text in enumerate(PROMPTS):
            ids = tok.encode(text)
            greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
            want, _ = _ids(ref, f"r{i}", ids, SamplingParams(**greedy))
            _, params = _ids(prod, f"p{i}", ids, SamplingParams(temperature=0, max_tokens=1,
                                                                kv_transfer_params={"do_remote_decode": True}))
            got, _ = _ids(cons, f"d{i}", ids, SamplingParams(**greedy, kv_transfer_params=params))
            assert got == want
        src = cons.get_stats().prompt_tokens_by_source
        assert src["local_compute"] == len(PROMPTS) and cons.get_stats().kv_transfer.num_transfers == len(PROMPTS)
    finally:
        for c in (ref, prod, cons):
            c.shutdown()
