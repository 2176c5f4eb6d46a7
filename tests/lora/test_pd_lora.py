"""Prefill-decode disaggregation with a LoRA adapter (two engine cores in one process, TCP connector):
the adapter travels with the request, the decode side's greedy tokens equal one server's, both sides'
block hashes carry the same adapter key (though each server numbers the adapter its own way), and an
adapter that fails to load on the decode side fails the request cleanly and frees the producer's KV."""

from __future__ import annotations

import json
import time

import pytest

from tokenmill.config import EngineConfig
from tokenmill.core.prefix_cache import update_block_hashes
from tokenmill.core.request import Request
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.lora.request import LoRARequest, adapter_content_hash
from tokenmill.sampling_params import SamplingParams

PROMPT = list(range(5, 30))      # 25 tokens: 6 full blocks of 4 and a partial one
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


def _cfg(model, role=None, **extra):
    kw = dict(model=model, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=256, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    if role:
        kw["kv_transfer_config"] = json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_port": 0,
                                               "kv_connector_extra_config": extra})
    return EngineConfig.from_kwargs(**kw)


def _run(core, rid, sp, lora, prompt=PROMPT, timeout=120.0):
    core.add_request(EngineCoreRequest(rid, list(prompt), sp, lora_request=lora))
    toks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for o in core.step():
            if o.req_id != rid:
                continue
            toks += o.new_token_ids
            if o.finish_reason:
                return toks, o
        time.sleep(0.002)
    raise AssertionError(f"request {rid} did not finish")


def _settle(core, timeout=10.0):
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        core.step()
        time.sleep(0.005)


def _hashes(lora):
    return update_block_hashes(Request("h", list(PROMPT), SamplingParams(max_tokens=1), lora_request=lora), 4)


@pytest.fixture(scope="module")
def cores(lora_root):
    base, _ = lora_root
    made = [EngineCore(_cfg(base)), EngineCore(_cfg(base, "kv_producer", abort_timeout_s=600)),
            EngineCore(_cfg(base, "kv_consumer", transfer_timeout_s=30))]
    try:
        yield made
    finally:
        for c in made:
            c.shutdown()


def test_pd_with_an_adapter_equals_one_server(lora_root, cores):
    _, ads = lora_root
    ref, prod, cons = cores
    digest = adapter_content_hash(ads["r4"])
    on_p = LoRARequest("r4", 1, ads["r4"], content_hash=digest)
    on_d = LoRARequest("r4", 5, ads["r4"], content_hash=digest)     # the decode server numbers it its own way
    want, _ = _run(ref, "r", SamplingParams(**GREEDY), on_p)
    base_toks, _ = _run(ref, "rb", SamplingParams(**GREEDY), None)
    assert want != base_toks, "the adapter does not change the output"
    first, out = _run(prod, "p", SamplingParams(max_tokens=1, temperature=0,
                                                kv_transfer_params={"do_remote_decode": True}), on_p)
    params = out.kv_transfer_params
    assert first == want[:1] and params["do_remote_prefill"]
    got, _ = _run(cons, "d", SamplingParams(**GREEDY, kv_transfer_params=params), on_d)
    assert got == want
    assert cons.get_stats().prompt_tokens_by_source["external_kv_transfer"] == len(PROMPT) - 1
    # both servers key the blocks by the adapter's name and content, not by their own ids
    assert _hashes(on_p) == _hashes(on_d) != _hashes(None)
    # the loaded blocks are the adapter's on the decode server: its next request hits them, the base's does not
    _, again = _run(cons, "d2", SamplingParams(**GREEDY), on_d)
    _, plain = _run(cons, "d3", SamplingParams(**GREEDY), None)
    assert again.num_cached_tokens >= 4 * 6 - 4 and plain.num_cached_tokens == 0
    _settle(prod)
    inv = prod.check_invariants()
    assert inv["num_free_blocks"] == 64 and inv["problems"] == []


def test_adapter_failing_on_the_decode_side_frees_the_producer(lora_root, cores, tmp_path):
    _, ads = lora_root
    _, prod, cons = cores
    digest = adapter_content_hash(ads["r8"])
    on_p = LoRARequest("r8", 2, ads["r8"], content_hash=digest)
    missing = LoRARequest("r8", 9, str(tmp_path / "not-there"), content_hash=digest)   # decode side lost it
    free0 = prod.check_invariants()["num_free_blocks"]
    _, out = _run(prod, "p", SamplingParams(max_tokens=1, temperature=0,
                                            kv_transfer_params={"do_remote_decode": True}), on_p,
                  prompt=[t + 1 for t in PROMPT])
    _settle(prod, timeout=0.3)
    assert prod.check_invariants()["num_free_blocks"] < free0     # kept for the consumer
    toks, res = _run(cons, "d", SamplingParams(**GREEDY, kv_transfer_params=out.kv_transfer_params), missing,
                     prompt=[t + 1 for t in PROMPT])
    assert toks == [] and res.finish_reason == "error" and "not-there" in res.error
    deadline = time.monotonic() + 20          # abort_timeout_s is 600: only the release frees it this soon
    while prod.check_invariants()["num_free_blocks"] != free0 and time.monotonic() < deadline:
        _settle(prod, timeout=0.2)
        time.sleep(0.02)
    inv = prod.check_invariants()
    assert inv["num_free_blocks"] == free0 and inv["problems"] == []
    assert prod.get_stats().kv_transfer.num_released >= 1
    assert cons.check_invariants()["problems"] == []
