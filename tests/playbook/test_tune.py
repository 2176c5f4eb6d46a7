"""tokenmill tune: the lever search (synthetic measurements) and an end-to-end run on real servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.playbook.tune import (LEVER_ORDER, Measurement, TuneSettings, flags_to_argv, serve_options, tune,
                                     warm_then_search, write_report)

GOODPUT = {  # synthetic goodput (req/s) per configuration
    "{}": [2.0, 2.1],
    '{"max_num_seqs": 256}': 3.0,
    '{"max_num_seqs": 512}': 3.1,
    '{"max_num_batched_tokens": 4096, "max_num_seqs": 256}': 3.2,
    '{"max_num_batched_tokens": 1024, "max_num_seqs": 256}': 2.5,
    '{"long_prefill_token_threshold": 512, "max_num_seqs": 256}': 3.0,
}


class FakeMeasure:
    def __init__(self, duration_s: float = 1.0) -> None:
        self.calls: list[dict] = []
        self.duration_s = duration_s

    def __call__(self, flags: dict, initial_rate: float) -> Measurement:
        key = json.dumps(flags, sort_keys=True)
        self.calls.append(flags)
        g = GOODPUT.get(key, 1.0)
        if isinstance(g, list):
            g = g[sum(1 for c in self.calls if c == flags) - 1]
        return Measurement(goodput=g, p99_ttft_ms=1500.0, p99_tpot_ms=50.0, slo_attainment=0.95,
                           preemptions=0, curve=[], duration_s=self.duration_s)


def _settings(**kw) -> TuneSettings:
    base = dict(model=None, base_serve_args=[], serve_command=["unused"], workload={"dataset": "random"},
                slos={"ttft": 2000.0, "tpot": 100.0}, noise_runs=2,
                levers=["max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "prefix_caching",
                        "kv_cache_dtype", "speculative"])
    base.update(kw)
    return TuneSettings(**base)


def _cap(flags):
    return {"max_num_seqs_without_preemption": 1000, "kv_cache_memory": 1 << 30}


def test_noise_then_levers_in_order_keep_only_beyond_noise(tmp_path):
    m = FakeMeasure()
    r = tune(_settings(), tmp_path, measure=m, capacity=_cap)
    assert m.calls[:2] == [{}, {}]                       # noise first, on the starting configuration
    assert abs(r.noise - 0.1 / 2.05) < 1e-9 and r.threshold == 0.1   # precision dominates a 4.9% spread
    rows = [(t.lever, t.change, t.verdict) for t in r.trials[2:]]
    assert rows[0] == ("max_num_seqs", {"max_num_seqs": 256}, "kept")          # 3.0 > 2.05 × 1.1
    assert rows[1] == ("max_num_seqs", {"max_num_seqs": 512}, "rejected")      # 3.1 ≤ 3.0 × 1.1
    # TTFT is the binding SLO (1500/2000 > 50/100): a larger budget first, then the opposite direction.
    assert rows[2] == ("max_num_batched_tokens", {"max_num_batched_tokens": 4096}, "rejected")
    assert rows[3] == ("max_num_batched_tokens", {"max_num_batched_tokens": 1024}, "rejected")
    assert rows[4][0] == "long_prefill_token_threshold" and rows[4][2] == "rejected"
    assert r.best_flags == {"max_num_seqs": 256} and r.best_goodput == 3.0
    assert r.skipped["prefix_caching"] == "already on"
    opts = serve_options()
    for lever, flag in (("kv_cache_dtype", "--kv-cache-dtype"), ("speculative", "--speculative-config")):
        assert (lever in r.skipped) == (flag not in opts)   # pulled exactly when main has the flag
    assert "--max-num-seqs 256" in r.serve_command
    order = [t.lever for t in r.trials if t.lever]
    assert order == sorted(order, key=LEVER_ORDER.index)


def test_resume_replays_saved_measurements(tmp_path):
    first = tune(_settings(), tmp_path, measure=FakeMeasure(), capacity=_cap)

    def must_not_run(flags, rate):
        raise AssertionError(f"re-measured {flags}")

    again = tune(_settings(), tmp_path, measure=must_not_run, capacity=_cap)
    assert [(t.change, t.verdict) for t in again.trials] == [(t.change, t.verdict) for t in first.trials]
    assert all(t.resumed for t in again.trials) and again.serve_command == first.serve_command
    with pytest.raises(ValueError, match="other settings"):
        tune(_settings(slos={"ttft": 1000.0}), tmp_path, measure=must_not_run, capacity=_cap)


def test_budget_stops_and_a_later_run_continues(tmp_path):
    m = FakeMeasure(duration_s=40.0)
    r = tune(_settings(budget_minutes=1.5), tmp_path, measure=m, capacity=_cap)
    assert len(m.calls) == 2 and r.stopped_by_budget     # 80 s measured + a 40 s trial would pass 90 s
    assert r.skipped["max_num_seqs"].startswith("not tried")
    more = FakeMeasure(duration_s=40.0)
    r2 = tune(_settings(budget_minutes=3.0), tmp_path, measure=more, capacity=_cap)
    assert [t.resumed for t in r2.trials][:2] == [True, True] and len(more.calls) == 2


def test_report_files(tmp_path):
    r = tune(_settings(), tmp_path, measure=FakeMeasure(), capacity=_cap)
    paths = write_report(r, tmp_path)
    md = paths["md"].read_text()
    assert r.serve_command in md and "| 3 | max_num_seqs | `--max-num-seqs 256` | 3 |" in md
    assert "kept" in md and "rejected" in md and "Levers not pulled" in md
    doc = json.loads(paths["json"].read_text())
    assert doc["best_flags"] == {"max_num_seqs": 256} and len(doc["trials"]) == len(r.trials)
    assert paths["png"].stat().st_size > 5000


def test_flags_to_argv():
    assert flags_to_argv({"max_num_seqs": 8, "enable_prefix_caching": False, "kv_cache_memory": "2GiB",
                          "speculative_config": {"method": "ngram"}}) == \
        ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-memory", "2GiB",
         "--speculative-config", '{"method": "ngram"}']


@pytest.mark.slow
def test_end_to_end_short_mode_on_real_servers(tmp_path):
    """One lever, no time budget: fresh tokenmill servers (real HTTP server, engine core and scheduler; model-free
    executor whose step time grows with its tokens), real goodput searches; then a resume that measures nothing.

    No ``--budget-minutes`` here: a wall-time budget makes the number of trials depend on the machine's speed (on a
    slow CI CPU the two noise runs spent a 0.4 min budget and no lever was tried). The budget's stop-and-resume
    logic has its own test above with a fake measurer; here the lever's step limit bounds the run (2 noise runs +
    at most ``MAX_STEPS_PER_LEVER`` kept steps + the first step's rejected candidates)."""
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "tokenmill.cli", "tune", "--serve-command",
           f"{sys.executable} -m tests.playbook.fake_serve", "--serve-args", "--max-num-seqs 4",
           "--dataset", "random", "--input-len", "32", "--output-len", "16", "--num-prompts", "8",
           "--goodput", "ttft:400", "tpot:40", "--initial-rate", "8", "--max-probes", "3", "--noise-runs", "2",
           "--levers", "max_num_seqs", "--warmup-probes", "0",
           "--output-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=repo)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "tune_report.json").read_text())
    trials = doc["trials"]
    assert [t["kind"] for t in trials[:2]] == ["noise", "noise"] and len(trials) >= 3
    assert all(t["measurement"]["error"] is None for t in trials), [t["measurement"]["error"] for t in trials]
    assert all(t["measurement"]["goodput"] > 0 and t["measurement"]["curve"] for t in trials)
    # no warm-up here (keeps this test's time; warm_then_search has its own test, the real-model sample uses it)
    assert all(t["measurement"]["warmup"] == [] for t in trials)
    assert {t["lever"] for t in trials[2:]} == {"max_num_seqs"}
    assert not doc["stopped_by_budget"]
    kept = [t for t in trials if t["verdict"] == "kept"]
    for t in kept:
        assert " ".join(flags_to_argv(t["change"])) in doc["serve_command"]
    assert doc["serve_command"].startswith("tokenmill serve --max-num-seqs ")
    assert doc["serve_command"].count("--max-num-seqs") == 1   # a kept value replaces the base flag
    if not any("max_num_seqs" in t["change"] for t in kept):
        assert "--max-num-seqs 4" in doc["serve_command"]
    assert (tmp_path / "tune_report.md").read_text().count("| noise |") == 2
    assert (tmp_path / "tune_report.png").exists()
    servers = sorted(tmp_path.glob("server_*.log"))
    assert len(servers) == len(trials)                    # one fresh server per trial
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=repo)
    assert again.returncode == 0, again.stderr[-3000:]
    doc2 = json.loads((tmp_path / "tune_report.json").read_text())
    assert all(t["resumed"] for t in doc2["trials"][: len(trials)])
    assert sorted(tmp_path.glob("server_*.log")) == servers  # nothing measured again
    assert doc2["serve_command"] == doc["serve_command"]


def test_quantization_and_kv_dtype_follow_the_accuracy_report(tmp_path):
    import argparse

    from tokenmill.playbook.tune import LeverContext, lever_kv_cache_dtype, lever_quantization

    def act(choices):
        return argparse.Action(["--x"], "x", choices=choices)

    opts = {"--quantization": act(["int8", "w8a8", "int4"]), "--kv-cache-dtype": act(["auto", "fp8", "int8"])}
    report = {"int8": {"format": "int8", "lossless": True, "top1": 0.995, "kl": 0.001},
              "int4": {"format": "int4", "lossless": False, "top1": 0.93, "kl": 0.05},
              "kv-fp8": {"format": "kv-fp8", "lossless": False}, "kv-int8": {"format": "kv-int8", "lossless": True}}
    ctx = LeverContext(best_flags={}, defaults={"quantization": None, "kv_cache_dtype": "auto"},
                       best=Measurement(), slos={"ttft": 1.0}, options=opts, capacity=_cap, accuracy=report)
    q = lever_quantization(ctx)
    assert [c.flags["quantization"] for c in q] == ["int8", "w8a8"]      # int4 is not lossless: not tried
    assert "lossless (top1 0.995" in q[0].why and "not in the accuracy report" in q[1].why
    kv = lever_kv_cache_dtype(ctx)
    assert [c.flags for c in kv] == [{"kv_cache_dtype": "int8"}]            # fp8 refused by the report
    ctx.accuracy = {}
    assert "accuracy not checked" in lever_quantization(ctx)[0].why
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(list(report.values())))
    from tokenmill.playbook.tune import load_accuracy_report

    assert load_accuracy_report(str(path))["int4"]["lossless"] is False


def test_final_command_replaces_overridden_base_flags():
    from tokenmill.playbook.tune import merge_serve_args

    base = ["--max-num-seqs", "4", "--dtype", "bfloat16", "--no-enable-prefix-caching", "--block-size=32"]
    got = merge_serve_args(base, {"max_num_seqs": 8, "enable_prefix_caching": True, "block_size": 16},
                           serve_options())
    assert got == ["--dtype", "bfloat16", "--max-num-seqs", "8", "--enable-prefix-caching", "--block-size", "16"]


def test_warmup_probes_run_first_at_the_start_rate_and_are_left_out_of_the_search():
    """A cold server fails its first probe (real model: p99 TTFT 2-11 s, later probes ~0.5 s); without a warm-up
    that failure caps the goodput below the start rate. The warm-up probe is discarded."""
    from tokenmill.bench.goodput_search import Probe

    events: list = []

    def probe(rate: float) -> Probe:
        cold = not any(isinstance(e, float) for e in events)
        events.append(rate)
        ok = rate <= 3.0 and not cold
        return Probe(rate, 1.0 if ok else 0.2, 500.0 if ok else 9000.0, 50.0, rate, rate if ok else 0.0, 10.0,
                     10, 0, passed=ok)

    s = _settings(warmup_probes=1, initial_rate=2.0, max_probes=6)
    result, warm = warm_then_search(probe, s, 2.0, after_warmup=lambda: events.append("after"))
    assert events[:3] == [2.0, "after", 2.0] and len(warm) == 1 and not warm[0].passed
    assert result.goodput >= 2.0 and all(c["request_rate"] != 2.0 or c["passed"] for c in result.curve())
    events.clear()
    cold, _ = warm_then_search(probe, _settings(warmup_probes=0, initial_rate=2.0, max_probes=6), 2.0)
    assert cold.goodput < 2.0                      # the bias the warm-up removes
    assert _settings(warmup_probes=0).fingerprint() != _settings(warmup_probes=1).fingerprint()
