"""Rank layouts, checkpoint slicing and the step codec: no processes, no model runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput
from tokenmill.distributed.layout import check_parallel_arch, local_arch, rank_layout, shard_weights, stage_layers
from tokenmill.engine.executor.base import plan_cpus
from tokenmill.engine.executor.step_codec import RequestDelta, StepDecoder, StepEncoder
from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.sampling_params import SamplingParams


def smollm2_arch(**kw) -> ModelArchConfig:
    base = dict(architecture="LlamaForCausalLM", num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                tie_word_embeddings=True)
    base.update(kw)
    return ModelArchConfig(**base)


def test_tp_must_divide_query_heads_with_a_clear_message():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide the model's 9 query heads; "
                                         r"use one of \[1, 3, 9\]"):
        check_parallel_arch(smollm2_arch(), 2, 1)
    with pytest.raises(ValueError, match="KV heads must divide"):
        check_parallel_arch(smollm2_arch(num_attention_heads=12, num_key_value_heads=3, intermediate_size=1536), 2, 1)
    with pytest.raises(ValueError, match="exceeds the model's 30 layers"):
        check_parallel_arch(smollm2_arch(), 1, 31)
    check_parallel_arch(smollm2_arch(), 3, 2)
    check_parallel_arch(smollm2_arch(intermediate_size=1152), 9, 1)        # more ranks than KV heads: replicated


def test_smollm2_tp3_owns_three_query_heads_and_one_kv_head():
    arch = smollm2_arch()
    lays = [rank_layout(arch, 3, 1, r) for r in range(3)]
    assert [lay.q_heads for lay in lays] == [(0, 3), (3, 6), (6, 9)]
    assert [lay.kv_heads for lay in lays] == [(0, 1), (1, 2), (2, 3)]
    assert [lay.ffn for lay in lays] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [lay.vocab for lay in lays] == [(0, 16384), (16384, 32768), (32768, 49152)]
    la = local_arch(arch, lays[1])
    assert (la.num_attention_heads, la.num_key_value_heads, la.intermediate_size, la.vocab_size) == (3, 1, 512, 16384)


def test_kv_heads_replicated_when_tp_exceeds_them():
    arch = smollm2_arch(intermediate_size=1152)
    kv = [rank_layout(arch, 9, 1, r).kv_heads for r in range(9)]
    # query head h reads KV head h // 3: ranks 0-2 hold KV head 0, 3-5 head 1, 6-8 head 2
    assert kv == [(0, 1)] * 3 + [(1, 2)] * 3 + [(2, 3)] * 3


def test_pipeline_stages_own_contiguous_layers():
    assert [stage_layers(30, 4, p) for p in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    lay = rank_layout(smollm2_arch(), 3, 2, 4)         # stage 1, tp rank 1
    assert (lay.pp_rank, lay.tp_rank, lay.layers, lay.q_heads) == (1, 1, (15, 30), (3, 6))
    assert not lay.is_first_stage and lay.is_last_stage


def test_shard_weights_cuts_rows_columns_and_pads_the_vocabulary():
    arch = smollm2_arch(num_hidden_layers=2, vocab_size=10, hidden_size=4, intermediate_size=6,
                        num_attention_heads=3, num_key_value_heads=3, head_dim=2, tie_word_embeddings=False)
    full = {
        "model.embed_tokens.weight": torch.arange(40.).view(10, 4),
        "lm_head.weight": torch.arange(40.).view(10, 4) + 100,
        "model.norm.weight": torch.ones(4),
        "model.layers.1.self_attn.q_proj.weight": torch.arange(24.).view(6, 4),
        "model.layers.1.self_attn.k_proj.weight": torch.arange(24.).view(6, 4),
        "model.layers.1.self_attn.o_proj.weight": torch.arange(24.).view(4, 6),
        "model.layers.1.mlp.up_proj.weight": torch.arange(24.).view(6, 4),
        "model.layers.1.mlp.down_proj.weight": torch.arange(24.).view(4, 6),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4),
    }
    lay = rank_layout(arch, 3, 2, 5)       # last stage (layer 1), tp rank 2: head 2, ffn cols 4-5, vocab rows 8-11
    got = dict(shard_weights(full.items(), lay, tied=False, keep_embedding=False))
    assert "model.embed_tokens.weight" not in got and "model.layers.0.mlp.up_proj.weight" in got
    assert got["model.layers.0.self_attn.q_proj.weight"].tolist() == full[
        "model.layers.1.self_attn.q_proj.weight"][4:6].tolist()
    assert torch.equal(got["model.layers.0.self_attn.o_proj.weight"], full["model.layers.1.self_attn.o_proj.weight"][:, 4:6])
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], full["model.layers.1.mlp.down_proj.weight"][:, 4:6])
    head = got["lm_head.weight"]
    assert head.shape == (4, 4) and torch.equal(head[:2], full["lm_head.weight"][8:]) and not head[2:].any()
    first = dict(shard_weights(full.items(), rank_layout(arch, 3, 2, 0), tied=False, keep_embedding=True))
    assert "lm_head.weight" not in first and "model.layers.1.mlp.up_proj.weight" not in first
    assert torch.equal(first["model.embed_tokens.weight"], full["model.embed_tokens.weight"][:4])


def test_plan_cpus_disjoint_and_shared_when_short():
    assert plan_cpus(2, [0, 1]) == [[0], [1]]
    assert plan_cpus(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert plan_cpus(3, [0, 1]) == [[0], [1], [0]]


def _req(rid, toks, computed, blocks, outs, new=False, sample=True):
    return ScheduledRequest(req_id=rid, token_ids=toks, num_computed_tokens=computed, block_ids=blocks,
                            sample=sample, sampling_params=SamplingParams(max_tokens=8), prompt_token_ids=[5, 6, 7],
                            output_token_ids=outs, new=new)


def test_step_codec_sends_new_requests_in_full_and_running_ones_as_deltas():
    enc, dec = StepEncoder(), StepDecoder()
    s1 = SchedulerOutput([_req("a", [5, 6, 7], 0, [3], [], new=True)], 3)
    d1 = enc.encode(s1)
    assert isinstance(d1.items[0], ScheduledRequest)
    assert dec.decode(d1).scheduled[0] == s1.scheduled[0]
    s2 = SchedulerOutput([_req("a", [9], 3, [3], [9]), _req("b", [1, 2], 0, [4], [], new=True)], 3)
    d2 = enc.encode(s2)
    assert isinstance(d2.items[0], RequestDelta) and d2.items[0].new_block_ids == [] \
        and d2.items[0].new_output_token_ids == [9] and d2.num_new == 1
    assert [dataclasses.asdict(r) for r in dec.decode(d2).scheduled] == [dataclasses.asdict(r) for r in s2.scheduled]
    s3 = SchedulerOutput([_req("a", [4], 4, [3, 8], [9, 4])], 1, finished_req_ids={"b"})
    d3 = enc.encode(s3)
    assert d3.items[0].new_block_ids == [8]
    assert [dataclasses.asdict(r) for r in dec.decode(d3).scheduled] == [dataclasses.asdict(r) for r in s3.scheduled]
    assert enc.num_cached == dec.num_cached == 1
    # preempted, then re-admitted with other blocks: sent in full again
    dec.decode(enc.encode(SchedulerOutput([], 0, preempted_req_ids=["a"])))
    assert enc.num_cached == dec.num_cached == 0
    s5 = SchedulerOutput([_req("a", [5, 6, 7, 9, 4], 0, [11, 12], [9, 4], new=True)], 5)
    d5 = enc.encode(s5)
    assert isinstance(d5.items[0], ScheduledRequest)
    assert dec.decode(d5).scheduled[0].block_ids == [11, 12]
