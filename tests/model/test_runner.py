"""ModelRunner: persistent input buffers, bucket padding and the compiled step against a fresh eager path."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput
from tokenmill.model.layers.attention import build_attention_metadata
from tokenmill.model.loader import build_model_from_config
from tokenmill.model.runner import InputBuffers, ModelRunner, parse_buckets
from tokenmill.sampling_params import SamplingParams

from .conftest import tiny_arch

BLOCK = 4
NUM_BLOCKS = 48

# (req_id, num new tokens) per step: chunked prefills, decodes, a request joining late,
# batch sizes 10 -> 11 -> 3 -> 5 -> 1 -> 19 -> 5 tokens (crossing the 4/8/16 buckets).
STEPS = [
    [("a", 7), ("b", 3)],
    [("a", 1), ("b", 6), ("c", 4)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("a", 1), ("c", 1), ("d", 3)],
    [("d", 1)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 15)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)],
]
PROMPT_LEN = {"a": 7, "b": 9, "c": 4, "d": 3, "e": 15}


def make_runner(model, arch, **kw) -> ModelRunner:
    cfg = EngineConfig.from_kwargs(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=128,
                                   max_num_seqs=8, max_num_batched_tokens=64, **kw)
    return ModelRunner(model, arch, cfg, torch.device("cpu"), torch.float32, [2])


class RecordingSampler:
    """Greedy sampler that keeps every step's logits."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, reqs):
        self.logits.append(logits.clone())
        return logits.argmax(-1).tolist(), [None] * len(reqs)


class Driver:
    """Plays STEPS through a runner, feeding back sampled tokens, on shuffled non-contiguous blocks."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.free = list(range(NUM_BLOCKS))
        rng.shuffle(self.free)
        self.tokens = {r: [rng.randrange(3, vocab) for _ in range(n)] for r, n in PROMPT_LEN.items()}
        self.computed = {r: 0 for r in PROMPT_LEN}
        self.tables: dict[str, list[int]] = {r: [] for r in PROMPT_LEN}

    def schedule(self, step) -> SchedulerOutput:
        params = SamplingParams(temperature=0.0, max_tokens=64)
        out = []
        for rid, n in step:
            c = self.computed[rid]
            assert c + n <= len(self.tokens[rid]), (rid, c, n)
            while len(self.tables[rid]) * BLOCK < c + n:
                self.tables[rid].append(self.free.pop())
            out.append(ScheduledRequest(rid, self.tokens[rid][c:c + n], c, list(self.tables[rid]),
                                        sample=c + n == len(self.tokens[rid]), sampling_params=params,
                                        prompt_token_ids=self.tokens[rid][:PROMPT_LEN[rid]],
                                        output_token_ids=self.tokens[rid][PROMPT_LEN[rid]:], new=c == 0))
        return SchedulerOutput(scheduled=out, total_num_scheduled_tokens=sum(n for _, n in step))

    def update(self, so: SchedulerOutput, req_ids, sampled) -> None:
        for r in so.scheduled:
            self.computed[r.req_id] += len(r.token_ids)
        for rid, t in zip(req_ids, sampled):
            self.tokens[rid].append(t)


def fresh_eager_logits(model, arch, so: SchedulerOutput, caches) -> torch.Tensor:
    """The reference: metadata built from scratch for this step, an unpadded eager forward."""
    md, pos = build_attention_metadata([r.num_computed_tokens for r in so.scheduled],
                                       [len(r.token_ids) for r in so.scheduled],
                                       [r.block_ids for r in so.scheduled], BLOCK)
    ids = torch.tensor([t for r in so.scheduled for t in r.token_ids])
    with torch.inference_mode():
        hidden = model(ids, pos, caches, md)
        last = md.query_start_loc[1:].long() - 1
        rows = [i for i, r in enumerate(so.scheduled) if r.sample]
        return model.compute_logits(hidden[last[rows]])


def play(runner: ModelRunner, model, arch, check_reference: bool = True):
    """Run STEPS through ``runner``; compare each step with the fresh eager path; return (logits, tokens)."""
    rec = RecordingSampler()
    runner.sampler = rec
    ref_caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, arch.num_key_value_heads, arch.head_dim)
                  for _ in range(arch.num_hidden_layers)]
    d = Driver(arch.vocab_size)
    all_tokens = []
    for step in STEPS:
        so = d.schedule(step)
        n_before = len(rec.logits)
        out = runner.execute_model(so)
        if check_reference:
            ref = fresh_eager_logits(model, arch, so, ref_caches)
            got = rec.logits[n_before] if len(rec.logits) > n_before else torch.zeros(0, arch.vocab_size)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        all_tokens.append(out.sampled_token_ids)
        d.update(so, out.req_ids, out.sampled_token_ids)
    return rec.logits, all_tokens, d


@pytest.fixture(scope="module")
def tiny():
    arch = tiny_arch("llama", max_position_embeddings=128)
    return build_model_from_config(arch, seed=3), arch


def test_persistent_buffers_match_fresh_eager_path(tiny):
    model, arch = tiny
    runner = make_runner(model, arch)
    assert runner.compile_buckets == []
    logits, tokens, _ = play(runner, model, arch)
    assert [len(t) for t in tokens] == [1, 3, 3, 3, 1, 5, 5]   # b samples only after its 2nd chunk


def test_kv_pool_has_a_scratch_block_the_scheduler_never_gets(tiny):
    model, arch = tiny
    runner = make_runner(model, arch)
    assert runner.num_kv_blocks == NUM_BLOCKS and runner.scratch_block == NUM_BLOCKS
    assert runner.kv_caches[0].shape[1] == NUM_BLOCKS + 1


def test_bucket_padding_gives_identical_logits_and_never_touches_other_slots(tiny):
    model, arch = tiny
    eager_logits, eager_tokens, _ = play(make_runner(model, arch), model, arch)
    runner = make_runner(model, arch)
    runner.compile_buckets = [4, 8, 16, 32]          # pad without compiling: exercises the padding path only
    for c in runner.kv_caches:                       # the pool is allocated unzeroed (garbage may hold NaN != NaN)
        c.fill_(0.5)
    before = [c.clone() for c in runner.kv_caches]
    owned: set[int] = set()
    rec = RecordingSampler()
    runner.sampler = rec
    d = Driver(arch.vocab_size)
    tokens = []
    for step in STEPS:
        so = d.schedule(step)
        ids, pos, md, _ = runner.prepare_inputs(so)
        n = so.total_num_scheduled_tokens
        assert ids.shape[0] == runner.padded_num_tokens(n) >= n
        assert (md.slot_mapping[n:] // BLOCK == runner.scratch_block).all()
        assert (ids[n:] == 0).all() and (pos[n:] == 0).all()
        for r in so.scheduled:
            owned.update(b * BLOCK + o for b in r.block_ids for o in range(BLOCK))
        out = runner.execute_model(so)
        tokens.append(out.sampled_token_ids)
        d.update(so, out.req_ids, out.sampled_token_ids)
        # every slot outside the requests' own blocks and the scratch block is untouched
        for layer, (c0, c1) in enumerate(zip(before, runner.kv_caches)):
            flat0, flat1 = c0.flatten(1, 2), c1.flatten(1, 2)                 # [2, slots, KVH, D]
            changed = (flat0 != flat1).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
            stray = [s for s in changed if s not in owned and s // BLOCK != runner.scratch_block]
            assert not stray, f"layer {layer}: padding wrote to slots {stray[:5]}"
    assert tokens == eager_tokens
    for a, b in zip(rec.logits, eager_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert any(c[:, runner.scratch_block].abs().sum() > 0 for c in runner.kv_caches)  # padding did write there


def test_buffers_grow_for_a_step_beyond_their_size(tiny):
    model, arch = tiny
    runner = make_runner(model, arch)
    runner.buffers = InputBuffers(4, 1, 2, torch.device("cpu"))
    play(runner, model, arch)
    assert runner.buffers.max_num_tokens >= 19 and runner.buffers.max_num_reqs >= 5


def test_step_timings_are_recorded(tiny):
    model, arch = tiny
    runner = make_runner(model, arch)
    play(runner, model, arch, check_reference=False)
    assert set(runner.last_timings) == {"prepare", "forward", "sample"}
    assert all(v >= 0 for v in runner.last_timings.values())


def test_parse_buckets():
    assert parse_buckets(None, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert parse_buckets("8, 2,2", 2048) == [2, 8]
    with pytest.raises(ValueError):
        parse_buckets("0,4", 64)


@pytest.mark.slow
def test_compiled_step_matches_eager(tiny):
    """torch.compile of the dense parts (two tiny buckets), padded steps included."""
    model, arch = tiny
    _, eager_tokens, _ = play(make_runner(model, arch), model, arch, check_reference=False)
    model = build_model_from_config(arch, seed=3)        # the eager runner packed the first one's linears
    runner = make_runner(model, arch, enforce_eager=False, compile_sizes="4,16")
    try:
        assert runner.compile_buckets == [4, 16]
        logits, tokens, _ = play(runner, model, arch)       # compares each step with the fresh eager path
        assert tokens == eager_tokens
    finally:
        model.set_dense_fns(None, None)


def test_pool_smaller_than_max_model_len_is_warned(tiny, caplog):
    model, arch = tiny
    cfg = EngineConfig.from_kwargs(num_kv_blocks=2, block_size=4, max_model_len=128, max_num_seqs=2,
                                   max_num_batched_tokens=64)
    with caplog.at_level("WARNING", logger="tokenmill.model.runner"):
        ModelRunner(model, arch, cfg, torch.device("cpu"), torch.float32, [2])
    assert any("holds 8 tokens, less than max_model_len=128" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tokenmill.model.runner"):
        make_runner(model, arch)
    assert not any("less than max_model_len" in r.getMessage() for r in caplog.records)
