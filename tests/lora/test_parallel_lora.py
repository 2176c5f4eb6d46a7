"""LoRA adapters with tensor and pipeline parallelism (mp workers): TP 2 and PP 2 equal TP 1.

A mixed batch (the base and three adapters: ranks 4, 8 rsLoRA and 16 attention-only, all targets
otherwise) runs on one process, on TP 2 and on PP 2. Greedy tokens must be equal; the sampled tokens'
logprobs within a tolerance, because TP changes the order of float32 sums: o_proj/down_proj (and
their adapters' shrink ``x Aᵀ``) sum over their input features in two partial sums then an
all-reduce. Reordering a float32 sum of ``K`` terms moves it by at most ``2 γ_K Σ|terms|`` with
``γ_K ≈ K u``, ``u = 2⁻²⁴`` (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1):
``K ≤ 128`` (the FFN width) gives ``1.5e-5`` of the terms' magnitude per sum; the residual stream
carries it through 2 layers of attention and MLP to the LM head, where the logits' magnitude is a few
units: ``1e-4`` nats leaves a few-fold margin over that and is ~100× below the gap between the greedy
token and the runner-up in these prompts (checked below, or greedy equality would mean nothing).

The TP engine also exercises what reaches the workers: start-up loads, an adapter that has to be
reloaded (``--max-cpu-loras``), runtime load and unload (an unload must drop the workers' copies: a
different folder loaded under the same id afterwards must serve its own weights) and a bad adapter
failing only its request.
"""

from __future__ import annotations

import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

PROMPTS = [[3, 9, 4, 11, 50, 60, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]
N = 8
TOL = 1e-4


def params(n=N):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)


def make_llm(base, **kw):
    kw.setdefault("max_loras", 3)
    return LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, num_kv_blocks=64, block_size=4,
               max_num_seqs=16, **kw)


def _reqs(ads):
    return {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(sorted(ads.items()))}


def _pairs(ads):
    return [(name, i) for name in [None, *sorted(ads)] for i in range(len(PROMPTS))]


def _run(llm, ads):
    reqs = _reqs(ads)
    pairs = _pairs(ads)
    outs = llm.generate([PROMPTS[i] for _, i in pairs], params(), lora_request=[reqs.get(n) for n, _ in pairs])
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]
    # greedy margin: the sampled token's logprob over the runner-up's
    gaps = [lp.top_logprobs[0] - lp.top_logprobs[1] for o in outs for lp in o.outputs[0].logprobs]
    return toks, lps, gaps


@pytest.fixture(scope="module")
def reference(lora_root):
    base, ads = lora_root
    with make_llm(base) as llm:
        return _run(llm, ads)


def _core_load(core, req, timeout=120.0):
    core.load_lora("t", req)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = core.take_lora_results()
        if res:
            return res[0][1]
        time.sleep(0.02)
    raise TimeoutError("adapter load did not finish")


def test_tp2_with_adapters_equals_tp1(lora_root, reference, tmp_path):
    base, ads = lora_root
    ref_toks, ref_lps, gaps = reference
    assert len({tuple(t) for t in ref_toks}) > len(PROMPTS), "adapters do not change the output"
    assert min(gaps) > 10 * TOL, "a near tie between greedy candidates: token equality would test nothing"
    llm = make_llm(base, tensor_parallel_size=2,
                   lora_modules=" ".join(f"{n}={p}" for n, p in sorted(ads.items())))
    try:
        toks, lps, _ = _run(llm, ads)
        assert toks == ref_toks
        for got, want in zip(lps, ref_lps):
            assert got == pytest.approx(want, abs=TOL)
        core = llm.engine_core
        # runtime load and unload reach the workers: an unloaded id's copy is gone from every rank
        extra = LoRARequest("extra", 10, ads["r4"])
        assert _core_load(core, extra) is None
        got = llm.generate([PROMPTS[0]], params(), lora_request=extra)[0].outputs[0].token_ids
        assert got == ref_toks[_pairs(ads).index(("r4", 0))]
        core.unload_lora(10)
        core.step()
        assert 10 not in core.lora_manager.cpu
        # the same id for another folder (the API never does this; it proves the workers dropped theirs;
        # another prompt: the id keys this hand-built request's prefix-cache blocks)
        again = LoRARequest("extra", 10, ads["r8"])
        assert _core_load(core, again) is None
        got = llm.generate([PROMPTS[1]], params(), lora_request=again)[0].outputs[0].token_ids
        assert got == ref_toks[_pairs(ads).index(("r8", 1))]
        # a bad adapter fails only its request, named; the engine keeps serving
        bad = LoRARequest("bad", 11, str(tmp_path / "missing"))
        outs = llm.generate([PROMPTS[0], PROMPTS[2]], params(), lora_request=[bad, LoRARequest("r4", 1, ads["r4"])])
        assert outs[0].outputs[0].finish_reason == "error" and "does not exist" in outs[0].error
        assert outs[1].outputs[0].token_ids == ref_toks[_pairs(ads).index(("r4", 2))]
        assert core.check_invariants()["problems"] == []
    finally:
        llm.shutdown()


def test_pp2_and_lru_with_adapters(lora_root, reference):
    """PP 2 (each stage holds its layers' adapters) with one slot and one adapter in memory: the three
    adapters cycle through the workers (the core's LRU drops and reloads them)."""
    base, ads = lora_root
    ref_toks, ref_lps, _ = reference
    llm = make_llm(base, pipeline_parallel_size=2, max_loras=1, max_cpu_loras=1)
    try:
        toks, lps, _ = _run(llm, ads)
        assert toks == ref_toks
        for got, want in zip(lps, ref_lps):
            assert got == pytest.approx(want, abs=TOL)
        assert llm.engine_core.lora_manager.num_loads >= 3
    finally:
        llm.shutdown()


def test_shard_adapter_cuts_column_and_row_targets(lora_root):
    """The cut itself: column targets keep B's rows of the rank, row targets A's columns, layers renumbered."""
    import torch

    from tokenmill.distributed.layout import rank_layout
    from tokenmill.lora.adapter import load_adapter
    from tokenmill.lora.tp import shard_adapter
    from tokenmill.model.checkpoint import load_arch_config

    base, ads = lora_root
    arch = load_arch_config(base)
    full = load_adapter(ads["r4"], arch, 16)
    d = arch.head_dim
    for rank in range(4):       # tp 2 x pp 2
        lay = rank_layout(arch, 2, 2, rank)
        part = shard_adapter(full, lay)
        assert {i for i, _ in part.modules} == set(range(lay.num_layers))
        for (i, mod), w in part.modules.items():
            g = full.modules[(i + lay.layers[0], mod)]
            if mod in ("o_proj", "down_proj"):
                lo, hi = (lay.q_heads[0] * d, lay.q_heads[1] * d) if mod == "o_proj" else lay.ffn
                assert torch.equal(w.a, g.a[:, lo:hi]) and torch.equal(w.b, g.b)
            else:
                lo, hi = {"q_proj": (lay.q_heads[0] * d, lay.q_heads[1] * d),
                          "k_proj": (lay.kv_heads[0] * d, lay.kv_heads[1] * d),
                          "v_proj": (lay.kv_heads[0] * d, lay.kv_heads[1] * d)}.get(mod, lay.ffn)
                assert torch.equal(w.b, g.b[lo:hi]) and torch.equal(w.a, g.a)


@pytest.mark.skipif(__import__("importlib").util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_tp2_with_a_runtime_adapter(lora_root, reference, monkeypatch):
    """The Ray executor carries the adapter ops as actor calls: a runtime load reaches both actors."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)        # a local cluster owned by this test
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    base, ads = lora_root
    ref_toks, _, _ = reference
    llm = make_llm(base, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        req = LoRARequest("r8", 2, ads["r8"])
        assert _core_load(llm.engine_core, req) is None
        outs = llm.generate(PROMPTS, params(), lora_request=req)
        assert [o.outputs[0].token_ids for o in outs] == [ref_toks[_pairs(ads).index(("r8", i))]
                                                          for i in range(len(PROMPTS))]
    finally:
        llm.shutdown()
