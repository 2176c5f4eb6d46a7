"""The tune report: Markdown, JSON and a PNG chart of every trial, and the final serve command."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.playbook.tune.flags import flags_to_argv
from tokenmill.playbook.tune.search import TuneResult


def _ms(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.0f}"


def _f1(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def _change_str(change: dict[str, Any]) -> str:
    return " ".join(flags_to_argv(change)) if change else "(starting configuration)"


def result_json(r: TuneResult) -> dict[str, Any]:
    """The JSON report: settings, noise, every trial with its measurement, skipped levers, final command."""
    return {
        "settings": asdict(r.settings), "noise": r.noise, "threshold": r.threshold,
        "baseline_goodput": r.baseline_goodput, "best_goodput": r.best_goodput, "best_flags": r.best_flags,
        "serve_command": r.serve_command, "stopped_by_budget": r.stopped_by_budget, "skipped_levers": r.skipped,
        "elapsed_s": r.elapsed_s,
        "trials": [{**{k: v for k, v in asdict(t).items() if k != "measurement"},
                    "measurement": asdict(t.measurement)} for t in r.trials],
    }


def format_markdown(r: TuneResult, chart_name: str | None = None) -> str:
    """The Markdown report."""
    s = r.settings
    slo = ", ".join(f"{k.upper()} ≤ {v:g} ms" for k, v in s.slos.items())
    w = s.workload
    wl = ", ".join(f"{k} {v}" for k, v in w.items() if v not in (None, False, ""))
    n_noise = sum(1 for t in r.trials if t.kind == "noise" and not t.measurement.error)
    lines = [
        "# tokenmill tune report", "",
        f"- model: `{s.model or '(packaged default)'}`; base serve arguments: `{shlex.join(s.base_serve_args) or '(none)'}`",
        f"- workload: {wl}",
        f"- SLO: {slo}, attainment ≥ {100 * s.attainment:g}% (goodput: the highest Poisson request rate meeting it, "
        f"bisected to {100 * s.precision:g}%); each fresh server first serves {s.warmup_probes} discarded "
        f"warm-up probe(s) of the whole workload",
        (f"- run-to-run noise: {100 * r.noise:.1f}% over {n_noise} runs of the starting configuration"
         if n_noise > 1 else f"- run-to-run noise: not measured ({n_noise} run of the starting configuration)")
        + f"; a change is kept when goodput rises more than {100 * r.threshold:.1f}% (max of noise and search "
          f"precision)",
        f"- goodput: {r.baseline_goodput:.3g} req/s at the start → **{r.best_goodput:.3g} req/s** "
        f"({'+' if r.best_goodput >= r.baseline_goodput else ''}"
        f"{100 * (r.best_goodput / r.baseline_goodput - 1) if r.baseline_goodput else 0:.0f}%)",
        f"- machine: {_machine()}; load average (1 min) at the end of each trial in the table",
        f"- time: {r.elapsed_s / 60:.1f} min in this invocation"
        + (f", budget {s.budget_minutes:g} min" if s.budget_minutes else "")
        + (" — **stopped by the budget**" if r.stopped_by_budget else ""),
        "", "## Final command", "", "```bash", r.serve_command, "```", "",
        "## Trials", "",
        "| # | lever | change | goodput req/s | attainment | p99 TTFT ms | p99 TPOT ms | preemptions | trial s | load | verdict | why |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for t in r.trials:
        m = t.measurement
        att = "-" if math.isnan(m.slo_attainment) else f"{100 * m.slo_attainment:.0f}%"
        lines.append(f"| {t.index} | {t.lever or 'noise'} | `{_change_str(t.change)}` | {m.goodput:.3g} | {att} | "
                     f"{_ms(m.p99_ttft_ms)} | {_ms(m.p99_tpot_ms)} | {m.preemptions:.0f} | {m.duration_s:.0f} | "
                     f"{_f1(m.load_avg)} | "
                     f"{t.verdict}{' (resumed)' if t.resumed else ''} | {t.why}; {t.reason} |")
    lines += ["", "p99s and attainment are those of the highest rate that met the target (the lowest rate probed "
              "when none did); preemptions are counted over the whole goodput search.", ""]
    if r.skipped:
        lines += ["## Levers not pulled", ""]
        lines += [f"- `{lv}`: {why}" for lv, why in r.skipped.items()]
        lines.append("")
    if chart_name:
        lines += ["## Chart", "", f"![goodput per trial]({chart_name})", ""]
    return "\n".join(lines)


def plot_trials(r: TuneResult, path: str) -> None:
    """Bar chart: goodput per trial, coloured by verdict, with the keep threshold over the best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"baseline": "#888888", "kept": "#2a9d3f", "rejected": "#c0392b", "failed": "#000000"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(r.trials) + 2), 4.2))
    xs = list(range(1, len(r.trials) + 1))
    ax.bar(xs, [t.measurement.goodput for t in r.trials], color=[colors[t.verdict] for t in r.trials])
    best, bars = r.baseline_goodput, []
    for t in r.trials:
        bars.append(best * (1 + r.threshold))
        if t.verdict == "kept":
            best = t.measurement.goodput
    ax.step(xs, bars, where="mid", color="#333333", linestyle="--", linewidth=1, label="keep above (best + noise)")
    ax.set_xticks(xs, [(t.lever or "noise").replace("_", "\n") for t in r.trials], fontsize=7)
    ax.set_ylabel("goodput (req/s)")
    slo = ", ".join(f"{k} {v:g} ms" for k, v in r.settings.slos.items())
    ax.set_title(f"tokenmill tune: {r.baseline_goodput:.3g} → {r.best_goodput:.3g} req/s (SLO {slo}, "
                 f"{100 * r.settings.attainment:g}%)", fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()]
              + [ax.get_lines()[0]], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_report(r: TuneResult, output_dir: Path) -> dict[str, Path]:
    """Write ``tune_report.{md,json,png}`` into ``output_dir``; returns the paths."""
    paths = {"md": output_dir / "tune_report.md", "json": output_dir / "tune_report.json",
             "png": output_dir / "tune_report.png"}
    paths["json"].write_text(json.dumps(result_json(r), indent=2, default=str))
    plot_trials(r, str(paths["png"]))
    paths["md"].write_text(format_markdown(r, paths["png"].name))
    return paths
