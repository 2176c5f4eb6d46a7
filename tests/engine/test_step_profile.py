"""The --slo start-up profile (tokenmill/engine/step_profile.py): model-free, on a fake clock.

The fake executor advances a fake ``time.perf_counter`` by a known cost per step (fixed + per decode
+ per prompt token), so the profile's measurements are checked exactly, whatever the machine's load.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.server.fakes import FakeExecutor
from tokenmill.config import EngineConfig
from tokenmill.engine import step_profile
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

FIXED, PER_DECODE, PER_TOKEN = 0.004, 0.0005, 0.0002
PER_CONTEXT = 1e-6      # seconds per prompt row per context token (ClockedExecutor.per_context, when set)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ClockedExecutor(FakeExecutor):
    """Each step costs FIXED + PER_DECODE per decode + PER_TOKEN per prompt token on the fake clock;
    the first step costs 10x (one-time costs of a first forward)."""

    def __init__(self, clock: Clock, **kw) -> None:
        super().__init__(step_time=0.0, **kw)
        self.clock = clock
        self.steps = 0
        self.prefills: list[int] = []       # prompt tokens of each step
        self.per_context = 0.0              # seconds per prompt row per token of context before it

    def execute_model(self, so):
        prefill = sum(len(r.token_ids) for r in so.scheduled if len(r.token_ids) > 1)
        decode = sum(1 for r in so.scheduled if len(r.token_ids) == 1)
        context = sum(len(r.token_ids) * r.num_computed_tokens + len(r.token_ids) * (len(r.token_ids) - 1) // 2
                      for r in so.scheduled if len(r.token_ids) > 1)
        cost = FIXED + PER_DECODE * decode + PER_TOKEN * prefill + self.per_context * context
        self.clock.t += cost * (10 if self.steps == 0 else 1)
        self.prefills.append(prefill)
        self.steps += 1
        return super().execute_model(so)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(time, "perf_counter", c)
    return c


def _core(clock, **kw) -> EngineCore:
    base = dict(num_kv_blocks=256, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=256,
                slo="ttft:500")
    base.update(kw)
    cfg = EngineConfig.from_kwargs(**base)
    return EngineCore(cfg, executor=ClockedExecutor(clock, num_kv_blocks=256, max_model_len=512))


def test_profile_measures_decode_batches_and_the_prefill_rate_and_leaves_no_trace(clock):
    core = _core(clock)
    prof = step_profile.run_profile(core)
    assert [b for b, _ in prof.decode_points] == [1.0, 8.0, 32.0]
    for b, t in prof.decode_points:
        assert t == pytest.approx(FIXED + PER_DECODE * b, rel=1e-9)
    # the joins prefill beside the running decodes: (step - decode_step_time(running)) / tokens is the
    # marginal rate
    assert prof.prefill_seconds_per_token == pytest.approx(PER_TOKEN, rel=1e-9)
    inv = core.check_invariants()
    assert inv["problems"] == [] and inv["num_requests"] == 0 and inv["num_free_blocks"] == inv["num_kv_blocks"]
    st = core.get_stats()
    assert st.num_steps == 0 and st.prefix_cache_queries == 0 and st.prefix_cache_hits == 0
    assert st.prompt_tokens_by_source["local_compute"] == 0
    # a real request afterwards runs as on a fresh engine (nothing of the profile is cached for it)
    core.add_request(EngineCoreRequest("real", [5] * 40, SamplingParams(max_tokens=2)))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert outs[0].num_cached_tokens == 0 and outs[-1].finish_reason == "length"


def test_profile_respects_small_max_num_seqs_and_budget(clock):
    core = _core(clock, max_num_seqs=4, max_num_batched_tokens=64)
    prof = step_profile.run_profile(core)
    assert [b for b, _ in prof.decode_points] == [1.0, 4.0]
    assert prof.prefill_seconds_per_token == pytest.approx(PER_TOKEN, rel=1e-9)
    assert core.check_invariants()["num_free_blocks"] == 256


def test_short_prefill_samples_get_one_longer_sample_sized_by_time(clock, monkeypatch):
    # the joins' prefill parts (64 tokens x 0.2 ms = 12.8 ms) are under PREFILL_SAMPLE_MIN_S: one prompt
    # joins alone beside the 32 decodes, sized to ~PREFILL_SAMPLE_S (750 tokens) but at most the token
    # budget left (256 - 32 decodes)
    core = _core(clock)
    prof = step_profile.run_profile(core)
    assert max(core.executor.prefills) == 256 - 32
    assert prof.prefill_seconds_per_token == pytest.approx(PER_TOKEN, rel=1e-9)
    assert core.check_invariants()["num_free_blocks"] == 256
    # joins long enough to time: no extra sample (the largest prefill is a join's 64 tokens)
    monkeypatch.setattr(step_profile, "PREFILL_SAMPLE_MIN_S", 0.001)
    core = _core(clock)
    step_profile.run_profile(core)
    assert max(core.executor.prefills) == step_profile.PREFILL_TOKENS
    # a budget with room: a sample sized by time (PREFILL_SAMPLE_S / rate: 0.03 / 0.0002 = 150 tokens),
    # then one twice as long; no context cost on this clock: the context term is 0 and the rate exact
    monkeypatch.setattr(step_profile, "PREFILL_SAMPLE_MIN_S", 0.1)
    monkeypatch.setattr(step_profile, "PREFILL_SAMPLE_S", 0.03)
    core = _core(clock, max_num_batched_tokens=1024, max_model_len=1024)
    prof = step_profile.run_profile(core)
    assert sorted(core.executor.prefills)[-2:] == [150, 300]
    assert prof.prefill_seconds_per_context == pytest.approx(0.0, abs=1e-12)
    assert prof.prefill_seconds_per_token == pytest.approx(PER_TOKEN, rel=1e-9)


def test_two_single_prompt_samples_give_the_rate_and_the_context_term(clock, monkeypatch, tmp_path):
    # every prompt row also costs PER_CONTEXT per token before it (the attention over its context):
    # the two single-prompt samples (~150 and ~300 tokens) separate it from the per-token rate exactly
    monkeypatch.setattr(step_profile, "PREFILL_SAMPLE_S", 0.03)
    core = _core(clock, max_num_batched_tokens=1024, max_model_len=1024)
    core.executor.per_context = PER_CONTEXT
    prof = step_profile.run_profile(core)
    assert prof.prefill_seconds_per_context == pytest.approx(PER_CONTEXT, rel=1e-6)
    assert prof.prefill_seconds_per_token == pytest.approx(PER_TOKEN, rel=1e-6)
    # it seeds the online model, which learns later steps net of it and hands it to the predictor
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    core = _core(clock, max_num_batched_tokens=1024, max_model_len=1024)
    core.executor.per_context = PER_CONTEXT
    step_profile.calibrate(core, "profile")
    snap = core.get_stats().step_timing
    assert snap.prefill_seconds_per_context == pytest.approx(PER_CONTEXT, rel=1e-6)
    assert step_profile.load_cached(step_profile.profile_key(core)).prefill_seconds_per_context == \
        pytest.approx(PER_CONTEXT, rel=1e-6)
    core.add_request(EngineCoreRequest("long", [7] * 600, SamplingParams(max_tokens=1)))
    while core.has_unfinished_requests():
        core.step()
    core.step()         # the next step times the last one (idle: its own span)
    assert core.get_stats().step_timing.prefill_seconds_per_token == pytest.approx(PER_TOKEN, rel=0.02)


def test_over_its_time_budget_the_profile_skips_the_larger_batches(clock):
    core = _core(clock)
    prof = step_profile.run_profile(core, budget_s=0.0)
    assert [b for b, _ in prof.decode_points] == [1.0, 8.0]     # the warm-up, batch 1 and the first join only
    assert prof.prefill_seconds_per_token == pytest.approx(PER_TOKEN, rel=1e-9)
    inv = core.check_invariants()
    assert inv["problems"] == [] and inv["num_requests"] == 0 and inv["num_free_blocks"] == inv["num_kv_blocks"]


def test_calibrate_seeds_the_model_caches_by_key_and_warms_up_on_a_hit(clock, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    core = _core(clock)
    prof = step_profile.calibrate(core, "cache")
    assert prof is not None and prof.source == "profiled"
    snap = core.step_time_model.snapshot()
    assert snap.ready and snap.decode_step_time(8) == pytest.approx(FIXED + 8 * PER_DECODE)
    assert snap.prefill_seconds_per_token == pytest.approx(prof.prefill_seconds_per_token)
    files = list((tmp_path / "slo_profiles").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["max_num_seqs"] == 64
    # same key: loaded, with one warm-up request (the first forward's one-time costs) and no profile
    core2 = _core(clock)
    got = step_profile.calibrate(core2, "cache")
    assert got.source == "cache" and core2.executor.steps == 2     # the warm-up's prefill + decode
    assert core2.step_time_model.snapshot().decode_points == snap.decode_points
    assert core2.check_invariants()["num_free_blocks"] == 256 and core2.get_stats().num_steps == 0
    # another key (seats) profiles again; "profile" always profiles; "off" does nothing
    assert step_profile.calibrate(_core(clock, max_num_seqs=16), "cache").source == "profiled"
    assert len(list((tmp_path / "slo_profiles").glob("*.json"))) == 2
    # batch invariance changes the kernels, hence the key
    plain = _core(clock, batch_invariant=False)
    assert step_profile.profile_key(plain)["batch_invariant"] is False
    assert step_profile.profile_key(core)["batch_invariant"] is True
    assert step_profile.calibrate(plain, "cache").source == "profiled"
    assert len(list((tmp_path / "slo_profiles").glob("*.json"))) == 3
    assert step_profile.calibrate(_core(clock), "profile").source == "profiled"
    off = _core(clock)
    assert step_profile.calibrate(off, "off") is None and not off.step_time_model.snapshot().ready
    with pytest.raises(ValueError, match="slo_calibration"):
        step_profile.calibrate(off, "sometimes")


def test_a_bad_cache_entry_is_profiled_again(clock, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    core = _core(clock)
    path = step_profile.cache_path(step_profile.profile_key(core))
    import os

    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    prof = step_profile.calibrate(core, "cache")
    assert prof.source == "profiled" and "ignoring the cached step-time profile" in caplog.text
    assert json.loads(open(path).read())["prefill_seconds_per_token"] > 0


def test_seed_validates():
    from tokenmill.metrics.step_timing import StepTimeModel

    m = StepTimeModel()
    with pytest.raises(ValueError):
        m.seed([], 1e-4)
    with pytest.raises(ValueError):
        m.seed([(1.0, 0.01)], 0.0)
    m.seed([(1.0, 0.01), (8.0, 0.02)], 1e-4)
    # the next real steps refine it (no warm-up steps skipped, no bootstrap)
    m.observe(8, 0, 0.03)
    assert 0.02 < m.snapshot().decode_step_time(8) < 0.03
