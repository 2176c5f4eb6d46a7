"""The lever search: noise runs, then one change per run in the playbook's order, kept beyond the noise."""

from __future__ import annotations

import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tokenmill.playbook.tune.flags import merge_serve_args, normalize_flags, serve_defaults, serve_options
from tokenmill.playbook.tune.levers import LEVERS, LeverContext, MAX_STEPS_PER_LEVER
from tokenmill.playbook.tune.measure import GoodputMeasurer, Measurement
from tokenmill.playbook.tune.planning import load_accuracy_report, plan_capacity
from tokenmill.playbook.tune.settings import LEVER_ORDER, TuneSettings
from tokenmill.playbook.tune.state import StateFile, Trial


@dataclass
class TuneResult:
    """Outcome of :func:`tune`."""

    settings: TuneSettings
    trials: list[Trial]
    noise: float
    threshold: float
    baseline_goodput: float
    best_flags: dict[str, Any]
    best_goodput: float
    skipped: dict[str, str]
    serve_command: str
    stopped_by_budget: bool
    elapsed_s: float


def tune(settings: TuneSettings, output_dir: Path, state_path: Path | None = None,
         measure: Callable[[dict[str, Any], float], Measurement] | None = None,
         capacity: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None) -> TuneResult:
    """Run the lever search (see :mod:`tokenmill.playbook.tune`) and return its result (the caller writes the report).

    Args:
        settings: the session.
        output_dir: folder for server logs (and the default state file).
        state_path: resumable state file (default ``output_dir/tune_state.json``).
        measure: ``(flags, initial_rate) -> Measurement``; default :class:`GoodputMeasurer` (real servers).
        capacity: ``flags -> plan dict`` for the max_num_seqs lever; default :func:`plan_capacity`.

    Raises:
        ValueError: unknown lever, no ``--goodput`` SLO, or a state file of another session.
    """
    return LeverSearch(settings, output_dir, state_path, measure, capacity).run()


class LeverSearch:
    """One session of :func:`tune`: its state file, measurer, budget and the trials so far.

    :meth:`run` measures the noise (:meth:`measure_noise`), then pulls each lever in the playbook's order
    (:meth:`pull_lever`); every measurement goes through :meth:`measure_flags`, which replays saved ones and
    refuses to start a trial the budget cannot pay for.
    """

    def __init__(self, settings: TuneSettings, output_dir: Path, state_path: Path | None = None,
                 measure: Callable[[dict[str, Any], float], Measurement] | None = None,
                 capacity: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None) -> None:
        unknown = [lv for lv in settings.levers if lv not in LEVERS]
        if unknown:
            raise ValueError(f"unknown lever(s) {unknown}; choose from {', '.join(LEVER_ORDER)}")
        if not settings.slos:
            raise ValueError("tune needs an SLO: --goodput ttft:MS tpot:MS")
        output_dir.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.state = StateFile(state_path or output_dir / "tune_state.json", settings.fingerprint())
        self.measurer = measure if measure is not None else GoodputMeasurer(settings, output_dir)
        if capacity is None:
            mp = getattr(self.measurer, "mean_prompt_len", None)
            mo = getattr(self.measurer, "mean_output_len", None)
            capacity = lambda flags: plan_capacity(settings, flags, mp, mo)  # noqa: E731
        self.capacity = capacity
        self.options = serve_options()
        self.defaults = serve_defaults(settings.base_serve_args)
        self.accuracy = load_accuracy_report(settings.accuracy_report)
        self.budget_s = settings.budget_minutes * 60 if settings.budget_minutes else math.inf
        self.t_start = time.monotonic()
        self.trials: list[Trial] = []
        self.stopped = False
        self.measured_keys: set[str] = set()
        # the search's position: filled by measure_noise, moved by pull_lever
        self.noise = self.threshold = self.baseline = self.best_goodput = 0.0
        self.best_flags: dict[str, Any] = {}
        self.best = Measurement()
        self.start_rate = settings.initial_rate
        self.skipped: dict[str, str] = {}
        self.tried: set[str] = set()

    # -- budget and measurements ------------------------------------------------------------------------
    def spent_before_trials(self) -> float:
        """Seconds of every measurement this session has made, in this run or before a resume."""
        return sum(self.state.get(k).duration_s for k in self.measured_keys)

    def out_of_budget(self) -> bool:
        """True when one more trial of the mean duration so far would overrun ``--budget-minutes``."""
        done = [t.measurement.duration_s for t in self.trials]
        mean = sum(done) / len(done) if done else 0.0
        return self.spent_before_trials() + mean > self.budget_s

    def measure_flags(self, flags: dict[str, Any], run_no: int, initial_rate: float) -> tuple[Measurement, bool] | None:
        """``(measurement, resumed)`` of ``flags`` (run ``run_no``): from the state file when saved, else measured
        now and saved; None when the budget is spent."""
        key = self.state.key(flags, run_no)
        saved = self.state.get(key)
        if saved is not None:
            self.measured_keys.add(key)
            return saved, True
        if self.out_of_budget():
            return None
        m = self.measurer(flags, initial_rate)
        self.state.put(key, m)
        self.measured_keys.add(key)
        return m, False

    # -- the two phases -----------------------------------------------------------------------------------
    def measure_noise(self) -> bool:
        """Measure the starting configuration ``--noise-runs`` times; set the baseline, noise and keep threshold.

        Returns:
            True when at least one run succeeded (the levers can be pulled).
        """
        settings = self.settings
        runs: list[Measurement] = []
        for i in range(max(1, settings.noise_runs)):
            got = self.measure_flags({}, i, settings.initial_rate if not runs else max(runs[0].goodput, settings.min_rate))
            if got is None:
                self.stopped = True
                break
            m, resumed = got
            runs.append(m)
            self.trials.append(Trial(len(self.trials) + 1, "noise", None, {}, {}, f"starting configuration, run {i + 1}",
                                     m, "baseline" if not m.error else "failed",
                                     "noise measurement" if not m.error else m.error, resumed))
        good = [m.goodput for m in runs if not m.error]
        self.baseline = sum(good) / len(good) if good else 0.0
        self.noise = (max(good) - min(good)) / self.baseline if len(good) > 1 and self.baseline > 0 else 0.0
        self.threshold = max(self.noise, settings.precision)
        self.best = max((m for m in runs if not m.error), key=lambda m: m.goodput, default=Measurement())
        self.best_goodput = self.baseline
        self.start_rate = max(self.baseline, settings.min_rate) if self.baseline > 0 else settings.initial_rate
        if not good:
            self.stopped = self.stopped or not runs
            self.skipped = {lv: "the starting configuration could not be measured" for lv in settings.levers}
        self.tried = {self.state.key({})}
        return bool(good)

    def pull_lever(self, lever: str) -> None:
        """Step ``lever`` while it keeps winning (at most ``MAX_STEPS_PER_LEVER`` kept steps); after a kept step
        only the same direction continues (the proposal's first candidate), and a configuration already
        measured in this session (e.g. stepping back to where the lever started) is never measured again."""
        steps = 0
        while steps < MAX_STEPS_PER_LEVER:
            ctx = LeverContext(best_flags=dict(self.best_flags), defaults=self.defaults, best=self.best,
                               slos=self.settings.slos, options=self.options, capacity=self.capacity,
                               accuracy=self.accuracy)
            proposal = LEVERS[lever](ctx)
            if isinstance(proposal, str):
                if steps == 0:
                    self.skipped[lever] = proposal
                break
            kept = False
            for change in (proposal if steps == 0 else proposal[:1]):
                flags = normalize_flags({**self.best_flags, **change.flags}, self.defaults)
                if self.state.key(flags) in self.tried:
                    continue
                self.tried.add(self.state.key(flags))
                got = self.measure_flags(flags, 0, self.start_rate)
                if got is None:
                    self.stopped = True
                    break
                m, resumed = got
                verdict, reason = self.judge(m)
                self.trials.append(Trial(len(self.trials) + 1, "lever", lever, change.flags, flags, change.why, m,
                                         verdict, reason, resumed))
                if verdict == "kept":
                    self.best_flags, self.best, self.best_goodput, kept = flags, m, m.goodput, True
                    break
            if self.stopped or not kept:
                break
            steps += 1

    def judge(self, m: Measurement) -> tuple[str, str]:
        """``(verdict, reason)`` of a trial: ``kept`` only above the best goodput by more than the threshold."""
        bar = self.best_goodput * (1 + self.threshold)
        if m.error:
            return "failed", m.error
        if m.goodput > bar:
            return "kept", (f"goodput {m.goodput:.3g} > {self.best_goodput:.3g} × (1 + {self.threshold:.2f}) = "
                            f"{bar:.3g} req/s")
        return "rejected", (f"goodput {m.goodput:.3g} ≤ {bar:.3g} req/s (best {self.best_goodput:.3g} + "
                            f"{100 * self.threshold:.0f}% noise)")

    def run(self) -> TuneResult:
        """Both phases, then the result with the final ``tokenmill serve`` command line."""
        settings = self.settings
        good = self.measure_noise()
        for lever in ([lv for lv in LEVER_ORDER if lv in settings.levers] if good else []):
            self.pull_lever(lever)
            if self.stopped:
                break
        if self.stopped:
            for lever in settings.levers:
                if lever not in self.skipped and not any(t.lever == lever for t in self.trials):
                    self.skipped[lever] = "not tried: --budget-minutes spent"
        model = settings.model or ""
        serve_cmd = shlex.join(["tokenmill", "serve", *([model] if model else []),
                                *merge_serve_args(settings.base_serve_args, self.best_flags, self.options)])
        return TuneResult(settings=settings, trials=self.trials, noise=self.noise, threshold=self.threshold,
                          baseline_goodput=self.baseline, best_flags=self.best_flags, best_goodput=self.best_goodput,
                          skipped=self.skipped, serve_command=serve_cmd, stopped_by_budget=self.stopped,
                          elapsed_s=time.monotonic() - self.t_start)
