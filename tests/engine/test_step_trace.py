"""TOKENMILL_STEP_TRACE: the engine core's one-JSON-line-per-step trace (tokenmill.engine.core_proc.StepTrace)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tokenmill.engine.core_proc import StepTrace


def _core(decode: int, prefill: int, timings: dict | None) -> SimpleNamespace:
    return SimpleNamespace(
        _last_step=(decode, prefill, 0.0, 0.0, 0), _last_schedule_time=0.002,
        executor=SimpleNamespace(last_timings=timings),
        scheduler=SimpleNamespace(num_running=decode + 1, num_waiting=3, num_preemptions_total=2))


def test_step_trace_is_off_unless_the_switch_names_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_STEP_TRACE", raising=False)
    assert StepTrace.from_env() is None
    monkeypatch.setenv("TOKENMILL_STEP_TRACE", str(tmp_path / "t.jsonl"))
    trace = StepTrace.from_env()
    assert trace is not None
    trace.close()


def test_step_trace_writes_one_line_per_step_with_the_step_shape_and_times(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"earlier": 1}\n')                 # appends
    trace = StepTrace(str(path))
    trace.record(_core(64, 0, {"prepare": 0.001, "forward": 0.08, "sample": 0.02}), 1.0, 1.1, 1.2, 1.25, 64)
    trace.record(_core(8, 2040, None), 2.0, 2.0, 3.5, 3.5, 8)      # an executor without timings
    trace.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {"earlier": 1}
    a, b = rows[1:]
    assert (a["loop"], a["start"], a["end"], a["sent"]) == (1.0, 1.1, 1.2, 1.25)
    shape = (a["decode"], a["prefill"], a["outputs"], a["running"], a["waiting"], a["preemptions"])
    assert shape == (64, 0, 64, 65, 3, 2)
    assert (a["prepare"], a["forward"], a["sample"], a["schedule"]) == (0.001, 0.08, 0.02, 0.002)
    assert (b["decode"], b["prefill"]) == (8, 2040) and "forward" not in b
