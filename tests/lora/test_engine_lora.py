"""LoRA through the offline engine (LLM -> EngineCore -> scheduler -> runner): greedy parity with
transformers + peft (float32), a mixed batch equal to each request alone, prefix caching per adapter,
the CPU step graph, n-gram speculation."""

from __future__ import annotations

import pytest
import torch

from tests.lora.conftest import peft_model, reference_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = [[3, 9, 4, 11, 50, 60, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]
N = 8


def greedy(n=N):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def refs(lora_root):
    base, ads = lora_root
    out = {}
    for name in [None, *sorted(ads)]:
        model = peft_model(base, ads[name] if name else None)
        out[name] = [reference_greedy(model, p, N) for p in PROMPTS]
    return out


def make_llm(base, **kw):
    kw.setdefault("max_loras", 3)
    return LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, num_kv_blocks=64, block_size=4,
               max_num_seqs=16, **kw)


def test_greedy_parity_and_mixed_batch(lora_root, refs):
    base, ads = lora_root
    reqs = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(sorted(ads.items()))}
    llm = make_llm(base)
    # each adapter alone, all prompts
    for name in [None, *sorted(ads)]:
        outs = llm.generate(PROMPTS, greedy(), lora_request=reqs.get(name))
        assert [o.outputs[0].token_ids for o in outs] == refs[name], name
    # one mixed batch: every (adapter, prompt) pair at once
    pairs = [(name, i) for name in [None, *sorted(ads)] for i in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[i] for _, i in pairs], greedy(), lora_request=[reqs.get(n) for n, _ in pairs])
    for (name, i), o in zip(pairs, outs):
        assert o.outputs[0].token_ids == refs[name][i], (name, i)
    assert llm.engine_core.check_invariants()["problems"] == []


def test_prefix_cache_is_per_adapter(lora_root, refs):
    base, ads = lora_root
    r4 = LoRARequest("r4", 1, ads["r4"])
    r8 = LoRARequest("r8", 2, ads["r8"])
    llm = make_llm(base)
    p = PROMPTS[1]
    first = llm.generate([p], greedy(), lora_request=r4)[0]
    again = llm.generate([p], greedy(), lora_request=r4)[0]
    other = llm.generate([p], greedy(), lora_request=r8)[0]
    plain = llm.generate([p], greedy())[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert again.outputs[0].token_ids == refs["r4"][1] and other.outputs[0].token_ids == refs["r8"][1]


def test_more_adapters_than_slots(lora_root, refs):
    """--max-loras 1, --max-cpu-loras 1: three adapters cycle through one slot and one CPU entry."""
    base, ads = lora_root
    reqs = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(sorted(ads.items()))]
    llm = make_llm(base, max_loras=1, max_cpu_loras=1)
    outs = llm.generate([PROMPTS[0]] * 3, greedy(), lora_request=reqs)
    for r, o in zip(reqs, outs):
        assert o.outputs[0].token_ids == refs[r.lora_name][0]
    assert llm.engine_core.lora_manager.num_loads >= 3


def test_bad_adapter_fails_only_its_request(lora_root, refs, tmp_path):
    base, ads = lora_root
    llm = make_llm(base)
    bad = LoRARequest("bad", 7, str(tmp_path / "missing"))
    outs = llm.generate([PROMPTS[0], PROMPTS[0]], greedy(), lora_request=[bad, LoRARequest("r4", 1, ads["r4"])])
    assert outs[0].outputs[0].finish_reason == "error" and "does not exist" in outs[0].error
    assert outs[1].outputs[0].token_ids == refs["r4"][0]


def test_ngram_speculation_with_adapters(lora_root, refs):
    base, ads = lora_root
    reqs = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(sorted(ads.items()))}
    llm = make_llm(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    names = [None, *sorted(ads)]
    outs = llm.generate([PROMPTS[1]] * len(names), greedy(), lora_request=[reqs.get(n) for n in names])
    for n, o in zip(names, outs):
        assert o.outputs[0].token_ids == refs[n][1], n


def test_config_refusals(lora_root):
    base, _ = lora_root
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        LLM(base, lora_modules="a=/x")
    with pytest.raises(ValueError, match="needs the eager step"):
        LLM(base, enable_lora=True, enforce_eager=False)
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="lockstep expert-parallel cores"):
        EngineConfig.from_kwargs(model=base, enable_lora=True, data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="ngram speculation only"):
        LLM(base, enable_lora=True, speculative_config={"method": "draft_model", "model": base,
                                                        "num_speculative_tokens": 2})
