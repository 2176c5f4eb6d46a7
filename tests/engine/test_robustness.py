"""Bad input never takes the engine down: NaN parameters, extreme penalties, failing steps, huge stop strings."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.core.sched_output import ModelRunnerOutput, ScheduledRequest
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.model.sampler import Sampler
from tokenmill.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.nan),
    ("repetition_penalty", math.nan), ("repetition_penalty", 1e-300), ("presence_penalty", math.nan),
    ("frequency_penalty", -math.inf), ("seed", -1), ("top_k", -2),
])
def test_non_finite_or_out_of_range_params_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _req(params: SamplingParams, out=()):
    return ScheduledRequest("r", [1], 0, [0], True, params, [1, 2, 3], list(out))


def test_sampler_never_returns_out_of_vocab_ids_for_broken_logits():
    vocab = 50
    logits = torch.full((4, vocab), math.nan)
    logits[1] = math.inf
    logits[2, :10] = -math.inf
    reqs = [_req(SamplingParams(temperature=1.0, seed=3)), _req(SamplingParams(temperature=0.0)),
            _req(SamplingParams(temperature=0.7, top_p=0.5)), _req(SamplingParams(temperature=1.0, top_k=5))]
    ids, _ = Sampler(seed=0)(logits, reqs)
    assert all(0 <= i < vocab for i in ids)


class _FlakyExecutor:
    """Fails the step whenever request 'bad' is in it."""

    num_kv_blocks = 16
    max_model_len = 256
    eos_token_ids = [2]

    def execute_model(self, so):
        if any(s.req_id == "bad" for s in so.scheduled):
            raise IndexError("index 49152 is out of bounds")
        rows = [s for s in so.scheduled if s.sample]
        return ModelRunnerOutput([s.req_id for s in rows], [7] * len(rows), [None] * len(rows))


def test_failing_step_fails_its_requests_and_the_engine_goes_on():
    core = EngineCore(EngineConfig.from_kwargs(block_size=4, num_kv_blocks=16, max_model_len=256),
                      executor=_FlakyExecutor())
    core.add_request(EngineCoreRequest("bad", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4)))
    outs = core.step()
    assert [(o.req_id, o.finish_reason) for o in outs] == [("bad", "error")] and "49152" in outs[0].error
    assert core.scheduler.kv_cache_usage == 0.0 and not core.has_unfinished_requests()
    core.add_request(EngineCoreRequest("good", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    tokens, finish = [], None
    while core.has_unfinished_requests():
        for o in core.step():
            tokens += o.new_token_ids
            finish = o.finish_reason or finish
    assert tokens == [7, 7, 7] and finish == "length"
    assert core.scheduler.kv_cache_manager.num_free_blocks == 16


class _CharTokenizer:
    """One character per token id (ids are code points)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


def test_huge_stop_string_is_cheap():
    params = SamplingParams(stop=["x" * 1_000_000, "yz"], max_tokens=100)
    t0 = time.perf_counter()
    d = IncrementalDetokenizer(_CharTokenizer(), [1], params)
    text = "".join(d.update([ord(c)]) for c in "abcxxxy") + d.update([ord("z")])
    assert time.perf_counter() - t0 < 2.0
    assert d.stop_matched == "yz" and text == "abcxxx"


def test_top_k_minus_one_and_zero_disable():
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
