"""EPLB on the real MoE layer: rebalancing mid-run changes no greedy output; a skewed router's measured
imbalance drops after rebalancing (tiny random-weight Mixtral, float32)."""

from __future__ import annotations

import pytest
import torch

from tests.model.tiny_moe import VOCAB, save_tiny_moe
from tokenmill import LLM, SamplingParams

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=32, max_num_seqs=6,
              max_model_len=128, enable_prefix_caching=False)
HOT = [5, 6]          # experts whose router rows are biased (with the shared embedding direction, few experts win)


def skew_router(tensors: dict, hot: list[int], strength: float = 1.0, seed: int = 0) -> None:
    """Bias a Mixtral checkpoint's routers toward the ``hot`` experts, in place (``tensors``: name -> tensor).

    A constant direction ``c`` (half the embeddings' scale) is added to every
    token embedding, so the residual stream carries it into every layer, and
    ``strength * c / (|c| sqrt(hidden))`` to the hot experts' router rows: after
    RMSNorm (unit RMS) their logits rise by about ``strength`` times c's share
    of the hidden state, for every token.
    """
    g = torch.Generator().manual_seed(seed)
    emb = tensors["model.embed_tokens.weight"]
    c = torch.randn(emb.shape[1], generator=g) * emb.std() * 0.5
    emb += c
    for k, t in tensors.items():
        if k.endswith("block_sparse_moe.gate.weight"):
            t[hot] += strength * c / (c.norm() * emb.shape[1] ** 0.5)


def save_skewed_moe(folder, seed: int = 3, strength: float = 12.0) -> str:
    """The tiny Mixtral of ``tests/model/tiny_moe.py`` with its routers biased toward ``HOT`` (:func:`skew_router`)."""
    import glob

    from safetensors.torch import load_file, save_file

    save_tiny_moe(folder, "mixtral", seed=seed)
    for f in glob.glob(f"{folder}/*.safetensors"):
        t = load_file(f)
        skew_router(t, HOT, strength)
        save_file(t, f, metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def skewed_moe(tmp_path_factory) -> str:
    return save_skewed_moe(tmp_path_factory.mktemp("skewed_moe"))


def _prompts(n: int = 6):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(5, 30, (n,), generator=g)]


PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(skewed_moe):
    with LLM(skewed_moe, **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS)]


def test_rebalancing_mid_run_keeps_greedy_outputs_one_rank(skewed_moe, reference):
    eplb = {"window_size": 3, "step_interval": 4, "num_redundant_experts": 2}
    with LLM(skewed_moe, enable_eplb=True, enable_expert_parallel=True, eplb_config=eplb, **ENGINE) as llm:
        outs = llm.generate(_prompts(), PARAMS)
        st = llm.engine_core.get_stats().eplb
        ctl = llm.engine_core.executor.eplb
        layers = ctl.layers
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert st is not None and st.num_rebalances >= 3 and st.num_placement_changes >= 1 and st.num_experts_moved >= 1
    from tokenmill.model.loader import load_model

    ref = load_model(skewed_moe, dtype="float32", with_tokenizer=False).model.moe_layers()   # identity placement
    load = ctl.window.load()
    for i, layer in enumerate(layers):
        # the busiest expert of the window got a replica (the first redundant slot always goes to it)
        assert layer.logical_replica_count[int(load[i].argmax())] >= 2, (load[i], layer.physical_to_logical)
        for s in range(layer.num_local_experts):    # every slot holds its expert's checkpoint weights
            e = int(layer.physical_to_logical[s])
            assert torch.equal(layer.w13[s], ref[i].w13[e]) and torch.equal(layer.w2[s], ref[i].w2[e]), (i, s, e)
    assert st.expert_imbalance_ratio > 2.0          # the router is skewed
    assert st.imbalance_ratio == 1.0                # one rank: nothing to balance, only the maps changed


def test_two_ranks_rebalance_keeps_outputs_and_drops_measured_imbalance(skewed_moe, reference, monkeypatch):
    """EP = 2 (mp workers, gloo): one rebalance at step 10 of ~16; greedy tokens equal one process's; the
    imbalance measured after it (busiest / mean rank) is lower than the one measured before it."""
    monkeypatch.setenv("TOKENMILL_EPLB_STATS_STEPS", "1")       # workers inherit it: fresh stats every step
    eplb = {"window_size": 10, "step_interval": 10, "num_redundant_experts": 2}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(skewed_moe, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, eplb_config=eplb,
             **ENGINE) as llm:
        outs = llm.generate(_prompts(), params)
        st = llm.engine_core.get_stats().eplb
        steps = llm.engine_core.get_stats().num_steps
    assert [o.outputs[0].token_ids for o in outs] == [r[:12] for r in reference]
    assert 10 < steps < 20, steps
    assert st.num_ranks == 2 and st.num_rebalances == 1 and st.num_placement_changes == 1
    assert st.num_experts_moved >= 1
    assert st.imbalance_before > 1.3, st                 # the hot experts start on one rank
    assert st.imbalance_ratio < st.imbalance_before - 0.2, st
    assert st.imbalance_after < st.imbalance_before


def test_eplb_refused_at_start_up_where_it_cannot_run(skewed_moe):
    import psutil

    with pytest.raises(ValueError, match="--enable-eplb needs --enable-expert-parallel"):
        LLM(skewed_moe, enable_eplb=True, **ENGINE)
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=r"8 experts \+ 1 redundant slots do not divide over 2 expert-parallel "
                                         r"ranks; use e.g. \[2, 4\]"):
        LLM(skewed_moe, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
            eplb_config={"num_redundant_experts": 1}, **ENGINE)
    assert set(psutil.Process().children(recursive=True)) == before
