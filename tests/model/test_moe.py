"""Mixtral and Qwen3-MoE: tiny random-weight checkpoints against transformers' own forward.

Tolerance of the logits comparisons (float32): ``atol=2e-4, rtol=1e-4``, as the
dense Llama tests (the paged attention and the grouped expert GEMMs sum in
another order than transformers' eager code; measured differences ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.model.tiny_moe import VOCAB, save_tiny_moe, tiny_moe_model
from tokenmill.model.hf_loader import iter_hf_weights, read_hf_config
from tokenmill.model.layers.moe import FusedMoE, initial_placement, replica_tables, select_experts
from tokenmill.model.loader import load_model

transformers = pytest.importorskip("transformers")

FAMILIES = ["mixtral", "qwen3_moe"]
ATOL, RTOL = 2e-4, 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    """(family, folder, transformers model) for each family."""
    folder = save_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, tiny_moe_model(request.param)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_config_reading(tiny):
    family, folder, _ = tiny
    a = read_hf_config(folder)
    assert a.is_moe and a.num_experts == 8 and a.num_experts_per_tok == 2 and a.moe_intermediate_size == 32
    if family == "mixtral":
        assert a.architecture == "MixtralForCausalLM" and a.norm_topk_prob and not a.qk_norm
        assert a.moe_layer_mask is None
    else:
        assert a.architecture == "Qwen3MoeForCausalLM" and not a.norm_topk_prob and a.qk_norm
        assert a.moe_layer_mask == [True, False, True] and a.intermediate_size == 96 and a.head_dim == 24


def test_chunked_mixed_batch_matches_transformers(tiny, paged_runner):
    family, folder, hf = tiny
    lm = load_model(folder, dtype="float32", with_tokenizer=False)
    layers = lm.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == (
        ["FusedMoE"] * 3 if family == "mixtral" else ["FusedMoE", "SwiGLUMLP", "FusedMoE"])
    g = torch.Generator().manual_seed(3)
    prompts = {r: torch.randint(3, VOCAB, (n,), generator=g).tolist() for r, n in {"a": 23, "b": 9, "c": 14}.items()}
    want = {r: hf_logits(hf, ids) for r, ids in prompts.items()}
    run = paged_runner(lm.model, lm.arch, num_blocks=48, block_size=4, seed=5)
    schedule = [[("a", 0, 7), ("b", 0, 8)], [("b", 8, 9), ("a", 7, 16), ("c", 0, 5)],
                [("a", 16, 17), ("c", 5, 14)], [("a", 17, 18)], [("a", 18, 23)]]
    for step in schedule:
        logits = run.step([(r, prompts[r][s:e]) for r, s, e in step])
        row = 0
        for r, s, e in step:
            torch.testing.assert_close(logits[row:row + e - s], want[r][s:e], atol=ATOL, rtol=RTOL,
                                       msg=f"{family} request {r} tokens {s}:{e}")
            row += e - s
    # every routed (token, expert) pair was counted once per MoE layer
    load = lm.model.expert_load()
    assert load.shape == (len(lm.model.moe_layers()), 8)
    assert load.sum(dim=1).tolist() == [(23 + 9 + 14) * 2] * load.shape[0]


@pytest.mark.parametrize("overrides,mask", [({"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []},
                                             [False, True, False]),
                                            ({"norm_topk_prob": True, "num_experts_per_tok": 3}, [True, False, True])])
def test_qwen3_moe_variants(tmp_path, paged_runner, overrides, mask):
    """norm_topk_prob, decoder_sparse_step, a top-k of 3."""
    hf = tiny_moe_model("qwen3_moe", seed=4, **overrides)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", with_tokenizer=False)
    assert lm.arch.norm_topk_prob and (lm.arch.moe_layer_mask or [True] * 3) == mask
    ids = torch.randint(3, VOCAB, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    run = paged_runner(lm.model, lm.arch)
    got = torch.cat([run.step([("x", ids[:11])]), run.step([("x", ids[11:])])])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def _greedy_hf(hf, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_greedy_through_the_engine_matches_transformers(tiny):
    from tokenmill import LLM, SamplingParams

    family, folder, hf = tiny
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    want = [_greedy_hf(hf, p, 10) for p in prompts]
    with LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
             max_num_seqs=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want, family


def test_select_experts_normalisations():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    w, ids = select_experts(logits, 2, renormalize=True)
    # Mixtral: softmax over the top-k logits
    torch.testing.assert_close(w, torch.softmax(torch.gather(logits, 1, ids), dim=-1))
    assert torch.equal(ids, torch.topk(logits, 2).indices)
    # Qwen3-MoE without norm_topk_prob: the full softmax's probabilities of the chosen experts
    w, ids = select_experts(logits, 3, renormalize=False)
    torch.testing.assert_close(w, torch.gather(torch.softmax(logits, -1), 1, ids))
    assert w.dtype == torch.float32 and ids.dtype == torch.int64


def test_replica_tables():
    p2l = initial_placement(4, 3)
    assert p2l.tolist() == [0, 1, 2, 3, 0, 1, 2]
    l2p, cnt = replica_tables(p2l, 4, 4)
    assert cnt.tolist() == [2, 2, 2, 1]
    assert l2p.tolist() == [[0, 4, -1, -1], [1, 5, -1, -1], [2, 6, -1, -1], [3, -1, -1, -1]]
    with pytest.raises(ValueError, match=r"\[3\] have no physical slot"):
        replica_tables(torch.tensor([0, 1, 2, 2]), 4, 4)
    with pytest.raises(ValueError, match="outside"):
        replica_tables(torch.tensor([0, 1, 2, 4]), 4, 4)


def _logits(model, arch, ids, paged_runner):
    return paged_runner(model, arch).step([("x", ids)])


def test_redundant_slots_and_placement_swaps_keep_outputs(tmp_path, paged_runner):
    """Replicas of experts 0..3 (EPLB's redundant slots) and a permuted placement give the same logits;
    the per-slot counters split a replicated expert's tokens by token index."""
    folder = save_tiny_moe(tmp_path, "mixtral", seed=2)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    base = load_model(folder, dtype="float32", with_tokenizer=False)
    want = _logits(base.model, base.arch, ids, paged_runner)
    base_load = base.model.expert_load(reset=True)               # [layers, 8]

    red = load_model(folder, dtype="float32", with_tokenizer=False, num_redundant_experts=4)
    assert red.arch.num_physical_experts == 12 and red.model.moe_layers()[0].w13.shape[0] == 12
    torch.testing.assert_close(_logits(red.model, red.arch, ids, paged_runner), want, atol=1e-5, rtol=1e-5)
    load = red.model.expert_load(reset=True)                     # [layers, 12]: slot 8 + j replicates expert j
    assert torch.equal(load[:, :8] + torch.nn.functional.pad(load[:, 8:], (0, 4)), base_load)
    assert (load[:, 8:12] > 0).any() and bool((red.model.expert_load() == 0).all())

    # EPLB-style swap: reverse the slots of every layer, moving the weights with the placement
    for m in base.model.moe_layers():
        old = [tuple(t.clone() for t in m.expert_weights(s)) for s in range(8)]
        perm = torch.arange(7, -1, -1)
        for s in range(8):
            m.set_expert_weights(s, *old[int(perm[s])])
        m.set_placement(perm)
    torch.testing.assert_close(_logits(base.model, base.arch, ids, paged_runner), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(base.model.expert_load().flip(1), base_load)


def test_layer_errors():
    m = FusedMoE(16, 8, num_experts=4, top_k=2, renormalize=True, num_redundant_experts=2, ep_size=2, ep_rank=1)
    assert m.num_local_experts == 3 and m.first_slot == 3 and m.local_logical_ids() == [3, 0, 1]
    with pytest.raises(ValueError, match="cannot be split evenly"):
        FusedMoE(16, 8, num_experts=4, top_k=2, renormalize=True, num_redundant_experts=1, ep_size=2)
    with pytest.raises(ValueError, match="shape"):
        m.load_expert_weight(0, "gate_proj", torch.zeros(8, 8))
    assert m.load_expert_weight(2, "gate_proj", torch.zeros(8, 16)) == 0       # expert 2 lives on rank 0
    assert m.load_expert_weight(0, "down_proj", torch.zeros(16, 8)) == 1
    assert "slot 0 (expert 3) gate_proj" in m.missing_expert_weights()
    with pytest.raises(ValueError, match="placement has 5 slots"):
        m.set_placement(torch.arange(5))


def test_loads_transformers_stacked_expert_layout(paged_runner, tmp_path):
    """transformers 5 holds experts stacked (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    from tokenmill.model.loader import build_model_from_config

    hf = tiny_moe_model("qwen3_moe", seed=5)
    sd = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    hf.config.save_pretrained(tmp_path)
    arch = read_hf_config(str(tmp_path))
    model = build_model_from_config(arch, "float32")
    model.load_weights(sd.items())
    ids = list(range(3, 30))
    torch.testing.assert_close(_logits(model, arch, ids, paged_runner), hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_engine_builds_redundant_slots_from_eplb_config(tiny):
    """``--eplb-config num_redundant_experts`` reaches the model: 8 experts + 2 replicas, same greedy tokens."""
    from tokenmill import LLM, SamplingParams

    family, folder, hf = tiny
    prompt = list(range(3, 40))
    with LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, enable_expert_parallel=True, enable_eplb=True,
             eplb_config={"num_redundant_experts": 2}) as llm:
        model = llm.engine_core.executor.model
        assert [m.num_physical_experts for m in model.moe_layers()] == [10] * len(model.moe_layers())
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == _greedy_hf(hf, prompt, 6)
