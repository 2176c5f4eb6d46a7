"""tokenmill against Hugging Face transformers (and optionally llama.cpp) on this machine.

For each engine and workload, one after another (never two servers at once),
the script starts the engine's OpenAI-compatible server as a subprocess on a
free 127.0.0.1 port, waits for ``/health``, warms it up with a few short
requests and two long ones at once (:func:`warm_up`), and runs ``tokenmill bench serve`` (its Python API: same load
generator, same definitions as ``vllm bench serve``) at every max
concurrency; then it stops the server (a fresh server per workload, so no
cache or first-request configuration carries over).

Engines (same model, same dtype, same thread budget):

* ``tokenmill``: ``tokenmill serve`` on the packaged SmolLM2-135M-Instruct GGUF
  (dequantized to ``--dtype`` at load time).
* ``transformers``: transformers' own server, ``transformers serve
  --continuous-batching`` (paged attention, continuous batching), started via
  ``benchmarks/hf_server.py serve``. It cannot read the GGUF file itself
  (see ``hf_server.py``), so the same GGUF is first exported once to a Hugging
  Face folder (dequantized float32 weights, the exact values transformers
  computes with when loading the GGUF) and served with ``--dtype``.
  ``hf_server.py`` adds ``data: [DONE]`` to its streams and sends the
  role-only chat chunk with the first token, so TTFT means the same thing for
  every engine. It has no ``ignore_eos``; the random workload sends
  ``generation_config: {"eos_token_id": -1}`` instead (end-of-sequence
  disabled, the same effect).
* ``llamacpp`` (optional, ``--llama-server PATH``): ``llama-server -m GGUF``
  with ``--parallel`` = the highest concurrency. It computes with the GGUF's
  own quantized weights (Q4_1/Q8_0), not ``--dtype``: not the same arithmetic.

Thread budget: ``--threads`` (default: all cores) for every engine:
``OMP_NUM_THREADS``/``MKL_NUM_THREADS``/``TOKENMILL_NUM_THREADS``, and
``--threads``/``--threads-batch`` for llama-server. Sampling is greedy
(``temperature 0``) for every engine, so the chat workload's answers, and so
their lengths, are comparable.

Workloads:

* ``random``: random 256-token prompts, 128 output tokens, ``ignore_eos``,
  ``/v1/completions``.
* ``mt-bench``: MT-bench first-turn prompts on ``/v1/chat/completions``,
  ``max_tokens`` 128, stopping at end of sequence.

Each cell sends ``--num-prompts`` requests (default ``max(8, 2 × concurrency)``)
all at once, at most ``concurrency`` in flight. Reported per engine, workload
and concurrency: output tok/s, p99 TTFT, mean and p99 TPOT, goodput (vLLM's
``request_goodput``: requests meeting the per-request SLO TTFT ≤
``--slo-ttft-ms`` and TPOT ≤ ``--slo-tpot-ms``, ÷ duration), and the ratios
tokenmill / other (against ``tokenmill``, or the first ``tokenmill@ISA`` when
plain tokenmill did not run). With ``--goodput-search``, DistServe's goodput
(the highest Poisson rate at which ≥ ``--attainment`` of requests meet both
SLOs) per engine. With llamacpp in the run, issue 31's targets
(:data:`TARGETS`: c=1 mean TPOT ≤ llama-server's, c=64 output tok/s ≥ 5× and
MT-bench goodput ≥ 5×) are evaluated: met, or the factor still missing. Saves
``OUT/compare_engines.json`` (with every cell's full ``bench serve`` result
under ``OUT/raw/``, the llama-server ``--version`` and whether tokenmill ran
batch-invariant), ``OUT/compare_engines.png`` and the servers' logs.

Ablations of tokenmill itself: an engine name ``tokenmill@ISA`` (``avx2``,
``avx512``, ``scalar``) runs tokenmill with ``TOKENMILL_CPU_ISA=ISA`` (its C
kernels built for that instruction set; e.g. the AVX2 path on an AVX-512 CPU),
compared against plain ``tokenmill`` (the CPU's best) in the same run.

Quick mode (``--quick``, about 10 minutes with tokenmill and llama-server):
concurrency 1, 16, 64; random 256 → 128 and MT-bench; 4 requests at
concurrency 1 and one per slot above (``--min-prompts 4 --prompts-per-slot 1``);
engines tokenmill and llamacpp unless ``--engines`` says otherwise; with
``--goodput-search``, 30 s probes of at least 16 requests (about 5 more
minutes per engine). The header names the CPU and its instruction-set level
(the kernel variant tokenmill picks). ``--dtype`` defaults to what tokenmill's
``--dtype auto`` picks on the CPU (float32 without native bfloat16).

Usage::

    .venv/bin/python benchmarks/compare_engines.py --quick --llama-server PATH   # ~10 min
    .venv/bin/python benchmarks/compare_engines.py --quick --engines tokenmill,tokenmill@avx2 --dtype float32
    .venv/bin/python benchmarks/compare_engines.py --quick --llama-server PATH --workloads= \
        --goodput-search tokenmill,llamacpp                           # goodput search only, ~10 min
    .venv/bin/python benchmarks/compare_engines.py                       # full sweep
    .venv/bin/python benchmarks/compare_engines.py --concurrency 1,4 --num-prompts 4 \\
        --output-len 32 --out-dir results/compare-smoke                 # smoke run
    .venv/bin/python benchmarks/compare_engines.py --engines tokenmill,transformers,llamacpp \\
        --llama-server /work/llama-build/build/bin/llama-server
    .venv/bin/python benchmarks/compare_engines.py --replot results/compare_engines.json
    .venv/bin/python benchmarks/compare_engines.py --replot a/compare_engines.json b/compare_engines.json \
        --out-dir results/merged                                       # merge runs (e.g. one search each)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ENGINES = ("tokenmill", "transformers", "llamacpp")
#: ``tokenmill@ISA`` engines: tokenmill with TOKENMILL_CPU_ISA=ISA (an ablation of its kernel variants)
TOKENMILL_ISAS = ("avx512", "avx2", "scalar")
BASELINE = "tokenmill"


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: dataset, endpoint and whether EOS is ignored."""

    name: str
    dataset: str
    endpoint: str
    ignore_eos: bool


WORKLOADS = {
    "random": Workload("random", "random", "completions", True),
    "mt-bench": Workload("mt-bench", "mt-bench", "chat", False),
}

#: Keys of a cell (one engine × workload × concurrency) shown in the table.
CELL_KEYS = ("output_throughput", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "request_goodput")


# ------------------------------------------------------------ results math ---

def default_num_prompts(concurrency: int, minimum: int = 8, per_slot: int = 2) -> int:
    """Requests per cell when ``--num-prompts`` is not given: ``max(minimum, per_slot × concurrency)``."""
    return max(minimum, per_slot * concurrency)


def cell_from_metrics(engine: str, workload: str, concurrency: int, m: dict[str, Any]) -> dict[str, Any]:
    """The summary of one run from ``BenchmarkMetrics.to_dict()`` (vLLM key names)."""
    return {
        "engine": engine, "workload": workload, "concurrency": concurrency,
        "num_requests": int(m.get("completed", 0)) + int(m.get("failed", 0)),
        "completed": int(m.get("completed", 0)), "failed": int(m.get("failed", 0)),
        "duration_s": m.get("duration"),
        "output_throughput": m.get("output_throughput"),
        "request_throughput": m.get("request_throughput"),
        "request_goodput": m.get("request_goodput"),
        "good_requests": m.get("good_requests"),
        "slo_attainment": m.get("slo_attainment"),
        "total_output_tokens": m.get("total_output_tokens"),
        "mean_ttft_ms": m.get("mean_ttft_ms"), "p99_ttft_ms": m.get("p99_ttft_ms"),
        "mean_tpot_ms": m.get("mean_tpot_ms"), "median_tpot_ms": m.get("median_tpot_ms"),
        "p99_tpot_ms": m.get("p99_tpot_ms"),
        "mean_itl_ms": m.get("mean_itl_ms"), "p99_itl_ms": m.get("p99_itl_ms"),
        "max_concurrent_requests": m.get("max_concurrent_requests"),
    }


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def ratio(a: Any, b: Any) -> float | None:
    """``a / b``; ``inf`` when only ``b`` is 0; ``None`` when either is missing or both are 0."""
    a, b = _num(a), _num(b)
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


def compute_ratios(cells: Sequence[dict[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """``baseline`` / other for every (workload, concurrency) both engines ran (keys of :data:`CELL_KEYS`).

    Throughput and goodput ratios above 1 favour the baseline; latency ratios
    (p99 TTFT, mean and p99 TPOT) below 1 favour it.
    """
    index = {(c["engine"], c["workload"], c["concurrency"]): c for c in cells}
    out = []
    for c in cells:
        if c["engine"] == baseline:
            continue
        base = index.get((baseline, c["workload"], c["concurrency"]))
        if base is None:
            continue
        if not base.get("completed") or not c.get("completed"):  # latencies of nothing: no ratio
            out.append({"baseline": baseline, "other": c["engine"], "workload": c["workload"],
                        "concurrency": c["concurrency"], **{k: None for k in CELL_KEYS}})
            continue
        out.append({"baseline": baseline, "other": c["engine"], "workload": c["workload"],
                    "concurrency": c["concurrency"], **{k: ratio(base.get(k), c.get(k)) for k in CELL_KEYS}})
    return out


def _fmt(v: Any, spec: str) -> str:
    v = _num(v)
    if v is None:
        return "—"
    if math.isinf(v):
        return "inf"
    return format(v, spec)


def format_tables(cells: Sequence[dict[str, Any]], ratios: Sequence[dict[str, Any]],
                  slo: dict[str, float]) -> str:
    """The printed result: one row per cell, then one row per ratio (TPOT: mean and p99, ms)."""
    slo_s = f"TTFT ≤ {slo.get('ttft', 0):g} ms, TPOT ≤ {slo.get('tpot', 0):g} ms"
    lines = [f"Per engine (goodput: requests meeting {slo_s}, per s of benchmark duration)",
             f"| {'engine':<12} | {'workload':<8} | {'conc':>4} | {'reqs':>4} | {'out tok/s':>9} | "
             f"{'p99 TTFT ms':>11} | {'mean TPOT ms':>12} | {'p99 TPOT ms':>11} | {'goodput req/s':>13} | "
             f"{'good':>9} | {'failed':>6} |",
             "|" + "|".join("-" * w for w in (14, 10, 6, 6, 11, 13, 14, 13, 15, 11, 8)) + "|"]
    order = {e: i for i, e in enumerate(ENGINES)}
    for c in sorted(cells, key=lambda c: (c["workload"], c["concurrency"], order.get(c["engine"], 99))):
        good = f"{c.get('good_requests') or 0}/{c.get('num_requests', 0)}"
        lines.append(f"| {c['engine']:<12} | {c['workload']:<8} | {c['concurrency']:>4} | "
                     f"{c.get('num_requests', 0):>4} | {_fmt(c.get('output_throughput'), '.1f'):>9} | "
                     f"{_fmt(c.get('p99_ttft_ms'), '.0f'):>11} | {_fmt(c.get('mean_tpot_ms'), '.2f'):>12} | "
                     f"{_fmt(c.get('p99_tpot_ms'), '.1f'):>11} | "
                     f"{_fmt(c.get('request_goodput'), '.3f'):>13} | {good:>9} | {c.get('failed', 0):>6} |")
    if ratios:
        base = ratios[0].get("baseline", BASELINE)
        lines += ["", f"Ratios {base} / other (tok/s and goodput: > 1 favours {base}; "
                      f"TTFT and TPOT: < 1 favours {base})",
                  f"| {'other':<12} | {'workload':<8} | {'conc':>4} | {'out tok/s':>9} | {'p99 TTFT':>8} | "
                  f"{'mean TPOT':>9} | {'p99 TPOT':>8} | {'goodput':>7} |",
                  "|" + "|".join("-" * w for w in (14, 10, 6, 11, 10, 11, 10, 9)) + "|"]
        for r in sorted(ratios, key=lambda r: (r["workload"], r["concurrency"], order.get(r["other"], 99))):
            lines.append(f"| {r['other']:<12} | {r['workload']:<8} | {r['concurrency']:>4} | "
                         f"{_fmt(r['output_throughput'], '.2f') + '×':>9} | {_fmt(r['p99_ttft_ms'], '.2f'):>8} | "
                         f"{_fmt(r.get('mean_tpot_ms'), '.2f'):>9} | "
                         f"{_fmt(r['p99_tpot_ms'], '.2f'):>8} | {_fmt(r['request_goodput'], '.2f'):>7} |")
    return "\n".join(lines)


def baseline_engine(engines: Sequence[str]) -> str:
    """The engine the ratios are taken against: ``tokenmill`` when it ran, else the first ``tokenmill@ISA``
    (a run of ``--engines tokenmill@avx2,llamacpp`` compares that variant); ``tokenmill`` when neither ran."""
    names = list(dict.fromkeys(engines))
    if BASELINE in names:
        return BASELINE
    return next((e for e in names if e.startswith(BASELINE + "@")), BASELINE)


#: Issue 31's targets against llama-server: (key, description, metric, workload, concurrency, goal, sense).
#: ``sense`` "max": the ratio tokenmill / llama-server must be ≤ goal; "min": ≥ goal. ``concurrency`` None:
#: the goodput search's result on its workload (DistServe goodput), not a cell.
TARGETS: tuple[tuple[str, str, str, str, int | None, float, str], ...] = (
    ("tpot_c1_random", "c=1 mean TPOT, random", "mean_tpot_ms", "random", 1, 1.0, "max"),
    ("tpot_c1_mt_bench", "c=1 mean TPOT, MT-bench", "mean_tpot_ms", "mt-bench", 1, 1.0, "max"),
    ("tok_s_c64_random", "c=64 output tok/s, random", "output_throughput", "random", 64, 5.0, "min"),
    ("tok_s_c64_mt_bench", "c=64 output tok/s, MT-bench", "output_throughput", "mt-bench", 64, 5.0, "min"),
    ("goodput_mt_bench", "MT-bench goodput (search)", "goodput_req_s", "mt-bench", None, 5.0, "min"),
)


def evaluate_targets(cells: Sequence[dict[str, Any]], searches: dict[str, Any], baseline: str = BASELINE,
                     other: str = "llamacpp",
                     targets: Sequence[tuple[str, str, str, str, int | None, float, str]] = TARGETS,
                     ) -> list[dict[str, Any]]:
    """Each target's figures for ``baseline`` and ``other``, their ratio, whether it is met, and how far off.

    Args:
        cells: :func:`cell_from_metrics` dicts.
        searches: engine → :func:`goodput_search` result (for targets with concurrency None).
        targets: rows as in :data:`TARGETS`.

    Returns:
        One dict per target whose figures both engines have: ``key``, ``description``, ``baseline``,
        ``other``, ``value`` and ``other_value`` (the metric's unit: ms, tok/s or req/s), ``ratio``
        (baseline / other), ``goal`` and ``sense``, ``met`` (bool) and ``shortfall``: the factor by which
        the ratio misses the goal (``goal / ratio`` for "min", ``ratio / goal`` for "max"; ≤ 1 when met;
        ``None`` when the ratio is not finite). Targets lacking either figure are left out.
    """
    index = {(c["engine"], c["workload"], c["concurrency"]): c for c in cells if c.get("completed")}
    out = []
    for key, desc, metric, workload, conc, goal, sense in targets:
        if conc is None:
            a = searches.get(baseline, {})
            b = searches.get(other, {})
            if a.get("workload") != workload or b.get("workload") != workload:
                continue
            va, vb = _num(a.get(metric)), _num(b.get(metric))
        else:
            ca, cb = index.get((baseline, workload, conc)), index.get((other, workload, conc))
            if ca is None or cb is None:
                continue
            va, vb = _num(ca.get(metric)), _num(cb.get(metric))
        r = ratio(va, vb)
        if r is None:
            continue
        # within floating-point rounding of the goal counts as met (a search gave 0.35000000000000003 req/s,
        # and 1.75 over it is 4.999999999999999)
        met = r <= goal * (1 + 1e-9) if sense == "max" else r >= goal * (1 - 1e-9)
        if math.isinf(r) or r == 0:
            shortfall = None if not met else 0.0
        else:
            shortfall = r / goal if sense == "max" else goal / r
        out.append({"key": key, "description": desc, "baseline": baseline, "other": other, "value": va,
                    "other_value": vb, "ratio": r, "goal": goal, "sense": sense, "met": met,
                    "shortfall": shortfall})
    return out


def format_targets(rows: Sequence[dict[str, Any]]) -> str:
    """The targets as a table: figures, ratio, goal, met or the factor still missing."""
    if not rows:
        return "Targets: none evaluable (need both engines' cells / goodput searches)"
    base, other = rows[0]["baseline"], rows[0]["other"]
    lines = [f"Targets (issue 31), {base} / {other}",
             f"| {'target':<30} | {base:>14} | {other:>14} | {'ratio':>7} | {'goal':>7} | {'met':<20} |",
             "|" + "|".join("-" * w for w in (32, 16, 16, 9, 9, 22)) + "|"]
    for r in rows:
        goal = ("≤ " if r["sense"] == "max" else "≥ ") + f"{r['goal']:g}×"
        if r["met"]:
            verdict = "yes"
        elif r["shortfall"] is None:
            verdict = "no"
        else:
            verdict = f"no ({r['shortfall']:.2f}× short)"
        lines.append(f"| {r['description']:<30} | {_fmt(r['value'], '.3f'):>14} | {_fmt(r['other_value'], '.3f'):>14} | "
                     f"{_fmt(r['ratio'], '.2f') + '×':>7} | {goal:>7} | {verdict:<20} |")
    return "\n".join(lines)


def build_report(cells: Sequence[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The saved JSON document: metadata, cells, ratios against :func:`baseline_engine`, issue 31's targets."""
    base = baseline_engine(meta.get("engines") or [c["engine"] for c in cells])
    ratios = compute_ratios(cells, base)
    return {**meta, "baseline": base, "cells": list(cells), "ratios": ratios,
            "targets": evaluate_targets(cells, meta.get("goodput_search") or {}, base)}


def plot_report(doc: dict[str, Any], path: Path) -> Path:
    """PNG: rows = workloads, columns = output tok/s, p99 TPOT, goodput, against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["cells"]
    workloads = [w for w in WORKLOADS if any(c["workload"] == w for c in cells)] or ["random"]
    cols = [("output_throughput", "output tok/s"), ("p99_ttft_ms", "p99 TTFT (ms)"),
            ("p99_tpot_ms", "p99 TPOT (ms)"), ("request_goodput", "goodput (req/s)")]
    fig, axes = plt.subplots(len(workloads), len(cols), figsize=(4.2 * len(cols), 3.4 * len(workloads)),
                             squeeze=False)
    slo = doc.get("slo_ms", {})
    for i, w in enumerate(workloads):
        for j, (key, label) in enumerate(cols):
            ax = axes[i][j]
            for eng in list(ENGINES) + sorted({c["engine"] for c in cells} - set(ENGINES)):
                pts = sorted((c["concurrency"], _num(c.get(key))) for c in cells
                             if c["engine"] == eng and c["workload"] == w and c.get("completed")
                             and _num(c.get(key)) is not None
                             and not (key.endswith("_ms") and not _num(c.get(key))))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=eng)
            if key == "p99_ttft_ms" and slo.get("ttft"):
                ax.axhline(slo["ttft"], color="grey", ls="--", lw=1, label="SLO")
            if key == "p99_tpot_ms" and slo.get("tpot"):
                ax.axhline(slo["tpot"], color="grey", ls="--", lw=1, label="SLO")
            ax.set_xscale("log", base=2)
            concs = sorted({c["concurrency"] for c in cells})
            ax.set_xticks(concs)
            ax.set_xticklabels([str(x) for x in concs])
            ax.set_xlabel("max concurrency")
            ax.set_title(f"{w}: {label}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if key.endswith("_ms"):
                ax.set_yscale("log")
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"{doc.get('model', '')} · {doc.get('dtype', '')} · {doc.get('threads', '')} threads · "
                 f"{doc.get('date', '')}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------- servers ---

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return float("nan")


def _inherit_autogroup_nice(pid: int) -> None:
    """Give a server started in its own session (its own scheduler autogroup under Linux's sched_autogroup)
    the autogroup nice value of this process, so both engines run at the priority the benchmark was started
    with (e.g. ``echo -15 > /proc/self/autogroup`` on a shared machine); a no-op where unsupported."""
    try:
        with open("/proc/self/autogroup") as f:
            nice = int(f.read().split("nice")[1])
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except (OSError, ValueError, IndexError):
        pass


@dataclass
class Server:
    """A server subprocess in its own process group, its log file and its URL."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    _log: Any = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float, poll_s: float = 1.0) -> float:
        """Start and wait until ``/health`` answers 200 (polled every ``poll_s`` s); returns the start-up
        time, s (to within ``poll_s``)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(self.cmd) + "\n")
        self._log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        _inherit_autogroup_nice(self.proc.pid)
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during start-up; "
                                   f"see {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /health within {timeout_s:g} s; see {self.log_path}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 20 s."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "TOKENMILL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


#: SmolLM2-135M KV bytes per token per byte of dtype: 2 (K, V) × 30 layers × 3 KV heads × 64 head dim.
KV_ELEMS_PER_TOKEN = 2 * 30 * 3 * 64
#: transformers continuous batching: tokens per cache page (``ContinuousBatchingConfig.page_size`` default).
CB_PAGE_SIZE = 256


def transformers_cb_args(args: argparse.Namespace) -> list[str]:
    """``--cb-num-blocks``/``--cb-max-batch-tokens`` matching tokenmill's defaults (1 GiB KV, 2048 tokens/step).

    Left to itself on CPU, transformers sizes its paged cache and attention-mask
    buffers from free *system* memory (a 14 GiB process was seen on this
    24 GiB shared machine). Skipped when ``--transformers-args`` sets them.
    """
    given = " ".join(args.transformers_args)
    out: list[str] = []
    if "--cb-num-blocks" not in given:
        per_token = KV_ELEMS_PER_TOKEN * (4 if args.dtype == "float32" else 2)
        out += ["--cb-num-blocks", str(max(1, int(args.kv_cache_gib * 2**30) // (per_token * CB_PAGE_SIZE)))]
    if "--cb-max-batch-tokens" not in given:
        out += ["--cb-max-batch-tokens", str(args.max_batch_tokens)]
    return out


def make_server(engine: str, args: argparse.Namespace, gguf: Path, hf_dir: Path | None,
                max_conc: int, log_dir: Path, tag: str = "") -> Server:
    port = free_port()
    env = thread_env(args.threads)
    py = sys.executable
    if engine == "tokenmill" or engine.startswith("tokenmill@"):
        if "@" in engine:
            env["TOKENMILL_CPU_ISA"] = engine.split("@", 1)[1]
        cmd = [py, "-m", "tokenmill.cli", "serve", "--model", str(args.tokenmill_model or gguf),
               "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port), *args.tokenmill_args]
    elif engine == "transformers":
        assert hf_dir is not None
        cmd = [py, str(REPO / "benchmarks" / "hf_server.py"), "serve", "--continuous-batching",
               "--device", "cpu", "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *transformers_cb_args(args), *args.transformers_args, str(hf_dir)]
    elif engine == "llamacpp":
        per_slot = args.llama_ctx_per_slot
        cmd = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--threads", str(args.threads), "--threads-batch", str(args.threads),
               "--parallel", str(max_conc), "--ctx-size", str(per_slot * max_conc),
               "--no-webui", *args.llama_args]
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return Server(engine, cmd, env, port, log_dir / f"{engine}{'-' + tag if tag else ''}.log")


# ------------------------------------------------------------- running ---

def endpoint_for(engine: str, wl: Workload, base_url: str, model: str, timeout_s: float) -> Any:
    """The bench EndpointConfig for one engine and workload (greedy; EOS ignored as each engine allows)."""
    from tokenmill.bench.client import EndpointConfig

    extra: dict[str, Any] = {}
    ignore_eos = wl.ignore_eos
    if engine == "transformers" and wl.ignore_eos:
        # transformers serve rejects unknown fields (422) such as ignore_eos; EOS -1 disables stopping.
        ignore_eos = False
        extra["generation_config"] = json.dumps({"eos_token_id": -1})
    return EndpointConfig(base_url=base_url, endpoint=wl.endpoint, model=model, ignore_eos=ignore_eos,
                          temperature=0.0, extra_body=extra, timeout_s=timeout_s)


def run_cell(samples: list, cfg: Any, concurrency: int, tokenizer: Any, slo: dict[str, float]) -> Any:
    from tokenmill.bench.loadgen import LoadConfig, run_benchmark

    load = LoadConfig(max_concurrency=concurrency, seed=0, num_warmups=0, disable_tqdm=True,
                      percentiles=[50.0, 90.0, 99.0], goodput=dict(slo))
    return asyncio.run(run_benchmark(samples, cfg, load, tokenizer))


#: Prompt tokens of the two long warm-up requests (``warm_up``).
WARMUP_LONG = 768


def warm_up(engine: str, server: Server, model: str, wl: Workload, tokenizer: Any,
            args: argparse.Namespace) -> float:
    """A few requests to the workload's endpoint (first-request set-up: CB cache, compilation); returns s.

    Random prompts (seed 123) for every workload: none shares a prefix with a cell's prompts (MT-bench
    warm-up prompts drawn from MT-bench were served from the prefix cache in the cell after). First
    ``min(4, max concurrency)`` of ``--input-len`` tokens at once, then two long ones at once (``WARMUP_LONG``
    tokens, or what one llama-server slot holds): llama-server served the first step holding more than
    ~512 prompt tokens about 2.6 s late (the goodput searches' first probe failed on it, seed 0, 2026-12-03),
    so every engine now meets that size in the warm-up instead of in a measured cell.
    """
    from tokenmill.bench.datasets import build_dataset

    t0 = time.perf_counter()
    cfg = endpoint_for(engine, wl, server.base_url, model, args.request_timeout)
    n = min(4, max(args.concurrency))
    long_len = min(WARMUP_LONG, args.llama_ctx_per_slot - 16)
    for k, input_len, seed in ((n, args.input_len, 123), (2, long_len, 124)):
        samples = build_dataset("random", tokenizer, k, input_len=input_len, output_len=8, seed=seed)
        res = run_cell(samples, cfg, k, tokenizer, {})
        if res.metrics.failed:
            errs = sorted({r.error for r in res.records if not r.success})[:3]
            raise RuntimeError(f"{engine}: warm-up on {wl.name} failed: {errs}")
    return time.perf_counter() - t0


def goodput_search(engine: str, cfg: Any, wl: Workload, samples_for: Any, tokenizer: Any,
                   slo: dict[str, float], args: argparse.Namespace,
                   raw_dir: Path | None = None, fresh: Any = None) -> dict[str, Any]:
    """DistServe goodput of one engine on ``wl``: ``search_goodput`` over Poisson-arrival probes.

    Each probe at ``rate`` req/s sends ``n = max(--goodput-min-prompts, rate × --goodput-probe-s)``
    requests of the workload (``samples_for(wl, n, seed)``: the same list for every
    engine at a given ``n`` and seed) with Poisson arrivals; ``--goodput-seed`` seeds both the
    arrival process and the prompt sample (0, the default, is the sample and arrivals every search
    used before the flag), so a policy tuned on one seed family can be checked on held-out seeds.
    Each probe's per-request results (TTFT, TPOT, ITLs, lengths, which SLO each request missed) go to
    ``raw/ENGINE-goodput-seedS-rateR.json`` when ``raw_dir`` is given.

    ``fresh`` (a callable returning a new endpoint config; ``--goodput-fresh-server``): called before every
    probe but the first, so each probe meets a freshly started and warmed server. Probes draw from the same
    prompt list, so on one server (the default) every probe after the first finds its prompts in the
    engines' prefix caches (tokenmill's pool, llama-server's slots) and only the first runs cold:
    llama-server's first probe on seed 0 failed on two prompts arriving together (2.3-2.7 s TTFT cold,
    0.1 s from its cache; 2026-12-03). With a fresh server per probe it failed on them at every rate
    (0.35, 0.175, 0.087 req/s): 16-request probes are too small for one cold pair. Neither is a steady
    state; docs/benchmarks/2026-12-03-kv-block-runs-avx2.md section 3.

    Returns:
        ``goodput_req_s`` (req/s), ``lowest_failing_rate`` (req/s or None),
        the search's ``note``, the target and SLO (ms), and the ``curve`` (one
        probe summary per rate).
    """
    from tokenmill.bench.goodput_search import probe_from_metrics, search_goodput
    from tokenmill.bench.loadgen import LoadConfig, run_benchmark

    probes_run = 0

    def probe(rate: float):
        nonlocal cfg, probes_run
        if fresh is not None and probes_run:
            cfg = fresh()
        probes_run += 1
        n = max(args.goodput_min_prompts, math.ceil(rate * args.goodput_probe_s))
        seed = args.goodput_seed
        load = LoadConfig(request_rate=rate, burstiness=1.0, seed=seed, num_warmups=0, disable_tqdm=True,
                          percentiles=[50.0, 90.0, 99.0], goodput=dict(slo))
        res = asyncio.run(run_benchmark(samples_for(wl, n, seed), cfg, load, tokenizer))
        if raw_dir is not None:
            from tokenmill.bench.report import result_json, save_json
            save_json(raw_dir / f"{engine}-goodput-seed{seed}-rate{rate:.3f}.json", result_json(
                res.metrics, res.records, res.t0, {
                    "engine": engine, "workload": wl.name, "request_rate": rate, "goodput_seed": seed,
                    "endpoint_type": wl.endpoint, "date": res.date, "num_prompts": n, "slo_ms": slo}))
        return probe_from_metrics(rate, res.metrics.to_dict())

    def report(p) -> None:
        print(f"    goodput probe {wl.name} rate {p.request_rate:6.3f} req/s: attainment {p.slo_attainment:.0%} "
              f"({'pass' if p.passed else 'fail'}), p99 TTFT {p.p99_ttft_ms:.0f} ms, p99 TPOT "
              f"{p.p99_tpot_ms:.1f} ms, {p.output_throughput:.1f} tok/s", flush=True)

    res = search_goodput(probe, target=args.attainment, initial_rate=args.goodput_initial_rate,
                         precision=args.goodput_precision, max_probes=args.goodput_max_probes, on_probe=report)
    doc = {"engine": engine, "workload": wl.name, "goodput_seed": args.goodput_seed, "goodput_req_s": res.goodput,
           "lowest_failing_rate": res.lowest_failing_rate, "note": res.note, "attainment_target": args.attainment,
           "slo_ms": slo, "curve": res.curve()}
    print(f"    {engine} goodput on {wl.name}: {res.goodput:.3f} req/s ({res.note})", flush=True)
    return doc


def format_goodput(searches: dict[str, Any], attainment: float, slo: dict[str, float],
                   baseline: str = BASELINE) -> str:
    """Goodput per engine and the ratio ``baseline`` / engine."""
    base = searches.get(baseline, {}).get("goodput_req_s")
    lines = [f"Goodput (highest Poisson rate with ≥ {attainment:.0%} of requests meeting TTFT ≤ "
             f"{slo.get('ttft', 0):g} ms and TPOT ≤ {slo.get('tpot', 0):g} ms)",
             f"| engine       | workload | goodput req/s | lowest failing req/s | {baseline + ' / engine':>18} |",
             "|--------------|----------|---------------|----------------------|--------------------|"]
    for eng, d in searches.items():
        g = d["goodput_req_s"]
        r = ratio(base, g) if eng != baseline else None
        lines.append(f"| {eng:<12} | {d['workload']:<8} | {g:>13.3f} | {_fmt(d['lowest_failing_rate'], '.3f'):>20} | "
                     f"{(_fmt(r, '.2f') + '×') if r is not None else '—':>18} |")
    return "\n".join(lines)


def merge_reports(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several saved runs as one document (e.g. the concurrency cells of one run and each engine's goodput
    search from runs of their own).

    Cells: all of them, a later run's cell replacing an earlier one's for the same (engine, workload,
    concurrency). Goodput searches: merged by engine, later wins. ``engines``: the union in order of first
    appearance. The first document's other metadata is kept; ``merged_from`` lists every run's ``date``,
    engines and load averages. Ratios and targets are recomputed by the caller.
    """
    if not docs:
        raise ValueError("merge_reports: no documents")
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    searches: dict[str, Any] = {}
    engines: list[str] = []
    for d in docs:
        for c in d.get("cells", []):
            cells[(c["engine"], c["workload"], c["concurrency"])] = c
        searches.update(d.get("goodput_search") or {})
        engines += [e for e in d.get("engines", []) if e not in engines]
    out = {k: v for k, v in docs[0].items() if k not in ("cells", "ratios", "targets")}
    out.update({"engines": engines, "cells": list(cells.values()), "goodput_search": searches,
                "merged_from": [{k: d.get(k) for k in ("date", "engines", "workloads", "concurrency",
                                                       "load_average_start", "load_average_end")}
                                for d in docs]})
    return out


def save(doc: dict[str, Any], out_dir: Path) -> Path:
    from tokenmill.bench.report import json_safe

    path = out_dir / "compare_engines.json"
    path.write_text(json.dumps(json_safe(doc), indent=2))
    return path


def cpu_isa_info() -> dict[str, Any]:
    """The CPU's vector instruction sets (from /proc/cpuinfo) and the kernel variant tokenmill picks."""
    out: dict[str, Any] = {}
    try:
        from tokenmill.model.layers import cpu_build

        flags = cpu_build._cpu_flags()
        out["isa_flags"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni",
                                        "amx_bf16", "amx_tile") if f in flags]
        out["tokenmill_isa"] = next(i for i in cpu_build.ISAS if cpu_build.isa_supported(i))
    except Exception as exc:  # noqa: BLE001 - the header must not stop the benchmark
        out["isa_error"] = str(exc)
    return out


def isa_header(info: dict[str, Any]) -> str:
    """One line: CPU model, cores, vector ISA flags and tokenmill's kernel variant."""
    return (f"# CPU: {info.get('cpu', '?')}, {info.get('cpu_count')} cores; ISA: "
            f"{' '.join(info.get('isa_flags', [])) or 'no AVX2'}; tokenmill kernels: {info.get('tokenmill_isa', '?')}")


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": platform.node(), "cpu_count": os.cpu_count(),
                            "python": platform.python_version(), **cpu_isa_info()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def resolve_dtype_name(dtype: str) -> str:
    """``auto`` → the dtype tokenmill's ``--dtype auto`` picks on this CPU ("bfloat16" or "float32", see
    :func:`tokenmill.model.loader.resolve_dtype`); any other name unchanged."""
    if dtype != "auto":
        return dtype
    from tokenmill.model.loader import resolve_dtype

    return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")


def llama_server_version(path: Path | None, timeout_s: float = 30.0) -> str | None:
    """``llama-server --version`` (version number, commit, compiler, target), or None when it cannot run."""
    if path is None:
        return None
    try:
        r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines()
             if ln.strip().startswith(("version", "built with"))]
    return "; ".join(lines) or None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=None,
                   help="Comma-separated: tokenmill, tokenmill@avx2 / @avx512 / @scalar (tokenmill with that kernel "
                        "variant), transformers, llamacpp (default tokenmill,transformers; with --quick "
                        "tokenmill,llamacpp; llamacpp needs --llama-server and is skipped without it).")
    p.add_argument("--quick", action="store_true",
                   help="About 10 minutes: concurrency 1,16,64, random and mt-bench, --min-prompts 4 "
                        "--prompts-per-slot 1, and shorter goodput probes if --goodput-search is given "
                        "(--goodput-probe-s 30 --goodput-min-prompts 16); explicit flags still win.")
    p.add_argument("--workloads", default="random,mt-bench",
                   help="Comma-separated: random, mt-bench. Empty (--workloads=) with --goodput-search: only the "
                        "goodput search runs, no concurrency cells.")
    p.add_argument("--concurrency", default="1,4,16,64", help="Max concurrency values (default 1,4,16,64).")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="Requests per cell (default max(--min-prompts, --prompts-per-slot × concurrency)).")
    p.add_argument("--min-prompts", type=int, default=8, help="See --num-prompts (default 8).")
    p.add_argument("--prompts-per-slot", type=int, default=2, help="See --num-prompts (default 2).")
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens (default 256).")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens for both workloads (default 128).")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="Compute dtype for tokenmill and transformers (default auto: what tokenmill's "
                        "--dtype auto picks on this CPU, bfloat16 with native bfloat16 (AVX512-BF16, AMX), "
                        "else float32; resolved here and passed explicitly to both engines).")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="Threads for each engine (default: all cores).")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="Goodput SLO on TTFT (default 2000).")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="Goodput SLO on TPOT (default 100).")
    p.add_argument("--out-dir", type=Path, default=REPO / "results" / "compare_engines",
                   help="Where the JSON, PNG, raw results and server logs go (default results/compare_engines).")
    p.add_argument("--hf-model-dir", type=Path, default=None,
                   help="Hugging Face folder for transformers (default: the packaged GGUF exported once to "
                        "~/.cache/tokenmill/hf-export/<name>).")
    p.add_argument("--tokenmill-model", default=None, help="Model for tokenmill (default: the packaged GGUF).")
    p.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (enables llamacpp).")
    p.add_argument("--llama-ctx-per-slot", type=int, default=1024,
                   help="llama-server context per parallel slot, tokens (default 1024).")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache size for transformers' continuous batching, GiB (default 1, tokenmill's default).")
    p.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="Tokens per step for transformers' continuous batching (default 2048, tokenmill's "
                        "--max-num-batched-tokens default).")
    p.add_argument("--tokenmill-args", type=shlex.split, default=[],
                   help="Extra tokenmill serve flags as one string, e.g. --tokenmill-args='--flag value'.")
    p.add_argument("--transformers-args", type=shlex.split, default=[],
                   help="Extra transformers serve flags as one string, e.g. --transformers-args='--flag value'.")
    p.add_argument("--llama-args", type=shlex.split, default=[],
                   help="Extra llama-server flags as one string, e.g. --llama-args='--flag value'.")
    p.add_argument("--goodput-search", default="",
                   help="Comma-separated engines whose goodput (DistServe, arXiv 2401.09670: the highest Poisson "
                        "request rate at which ≥ --attainment of requests meet both SLOs) is searched on "
                        "--goodput-workload, on the same server right after that engine's concurrency sweep "
                        "(e.g. tokenmill,llamacpp). Empty: no search.")
    p.add_argument("--goodput-workload", default="mt-bench", help="Workload of the goodput search (default mt-bench).")
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment target (default 0.9).")
    p.add_argument("--goodput-probe-s", type=float, default=60.0,
                   help="Each probe sends max(--goodput-min-prompts, rate × this) requests (default 60 s).")
    p.add_argument("--goodput-min-prompts", type=int, default=24, help="See --goodput-probe-s (default 24).")
    p.add_argument("--goodput-initial-rate", type=float, default=1.0, help="First probed rate, req/s (default 1).")
    p.add_argument("--goodput-precision", type=float, default=0.15,
                   help="Stop bisecting when the bracket is narrower than this × the passing rate (default 0.15).")
    p.add_argument("--goodput-seed", type=int, default=0,
                   help="Seed of the goodput probes' Poisson arrivals and of their prompt sample (default 0, "
                        "the sample every earlier search used). Tune on some seeds, report held-out ones.")
    p.add_argument("--goodput-fresh-server", action="store_true",
                   help="Start a fresh, warmed server for every probe of a goodput search, so every probe runs "
                        "cold (default: one server per search; its probes after the first find the earlier probes' "
                        "prompts in the prefix caches, and only the first runs cold).")
    p.add_argument("--goodput-max-probes", type=int, default=8, help="Probes per engine at most (default 8).")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="Seconds to wait for /health.")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="Per-request limit, s.")
    p.add_argument("--replot", type=Path, nargs="+", default=None, metavar="JSON",
                   help="Only re-print the tables and targets and redraw the PNG from saved JSON(s). Several: "
                        "merged (see merge_reports) and saved to --out-dir/compare_engines.json.")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=", 1)[0] for a in argv}
        for flag, dest, value in (("--concurrency", "concurrency", "1,16,64"), ("--min-prompts", "min_prompts", 4),
                                  ("--prompts-per-slot", "prompts_per_slot", 1),
                                  ("--workloads", "workloads", "random,mt-bench"),
                                  ("--goodput-probe-s", "goodput_probe_s", 30.0),
                                  ("--goodput-min-prompts", "goodput_min_prompts", 16)):
            if flag not in given:
                setattr(args, dest, value)
    if args.engines is None:
        args.engines = "tokenmill,llamacpp" if args.quick else "tokenmill,transformers"
    if args.goodput_search and not 0 < args.attainment <= 1:
        p.error("--attainment must be in (0, 1]")
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in args.engine_list if e not in ENGINES and not (
        e.startswith("tokenmill@") and e.split("@", 1)[1] in TOKENMILL_ISAS)]
    if bad:
        p.error(f"unknown engine(s) {bad}; choose from {','.join(ENGINES)}")
    args.goodput_engines = [e.strip() for e in args.goodput_search.split(",") if e.strip()]
    bad = [e for e in args.goodput_engines if e not in args.engine_list]
    if bad:
        p.error(f"--goodput-search engine(s) {bad} are not in --engines")
    if args.goodput_workload not in WORKLOADS:
        p.error(f"unknown --goodput-workload {args.goodput_workload!r}")
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in args.workload_list if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workload(s) {bad}; choose from {','.join(WORKLOADS)}")
    if not args.workload_list and not args.goodput_engines:
        p.error("--workloads is empty: give workloads, or --goodput-search for a search-only run")
    args.dtype = resolve_dtype_name(args.dtype)
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error("--concurrency: comma-separated integers")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency values must be ≥ 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}

    if args.replot:
        docs = [json.loads(p.read_text()) for p in args.replot]
        doc = merge_reports(docs) if len(docs) > 1 else docs[0]
        base = baseline_engine(doc.get("engines") or [c["engine"] for c in doc["cells"]])
        doc["ratios"] = compute_ratios(doc["cells"], base)
        doc["targets"] = evaluate_targets(doc["cells"], doc.get("goodput_search") or {}, base)
        print(format_tables(doc["cells"], doc["ratios"], doc.get("slo_ms", slo)))
        if doc.get("goodput_search"):
            print(format_goodput(doc["goodput_search"], args.attainment, doc.get("slo_ms", slo), base))
        print(format_targets(doc["targets"]))
        png = args.replot[0].with_suffix(".png")
        if len(docs) > 1:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            print(f"Saved merged results to {save(doc, args.out_dir)}")
            png = args.out_dir / "compare_engines.png"
        if doc["cells"]:
            print(f"Saved plot to {plot_report(doc, png)}")
        return 0

    from tokenmill.bench.datasets import build_dataset
    from tokenmill.bench.loadgen import fetch_models
    from tokenmill.bench.report import result_json, save_json
    from tokenmill.bench.tokenizer import default_gguf_path, get_tokenizer

    engines = list(args.engine_list)
    skipped: dict[str, str] = {}
    if "llamacpp" in engines and (args.llama_server is None or not args.llama_server.is_file()):
        skipped["llamacpp"] = ("no --llama-server given" if args.llama_server is None
                               else f"{args.llama_server} not found")
        engines.remove("llamacpp")
        print(f"skipping llamacpp: {skipped['llamacpp']}")

    out_dir = args.out_dir
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    gguf = default_gguf_path()
    tokenizer = get_tokenizer(str(gguf))

    hf_dir = None
    if "transformers" in engines:
        hf_dir = args.hf_model_dir or (Path.home() / ".cache" / "tokenmill" / "hf-export" / gguf.stem)
        if not (hf_dir / "config.json").is_file():
            print(f"exporting {gguf.name} to {hf_dir} for transformers serve ...", flush=True)
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "hf_server.py"), "export",
                            "--gguf", str(gguf), "--out", str(hf_dir)],
                           env=thread_env(args.threads), check=True)

    # The same requests for every engine: one sample list per (workload, size).
    samples_cache: dict[tuple[str, int], list] = {}

    def samples_for(wl: Workload, n: int, seed: int = 0) -> list:
        key = (wl.name, n, seed)
        if key not in samples_cache:
            if wl.dataset == "random":
                samples_cache[key] = build_dataset("random", tokenizer, n, input_len=args.input_len,
                                                   output_len=args.output_len, seed=seed)
            else:
                samples_cache[key] = build_dataset(wl.dataset, tokenizer, n, output_len=args.output_len,
                                                   seed=seed)
        return samples_cache[key]

    meta: dict[str, Any] = {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(), "model": gguf.name, "dtype": args.dtype, "threads": args.threads,
        "engines": engines, "skipped_engines": skipped, "workloads": args.workload_list,
        "concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts, "slo_ms": slo, "temperature": 0.0,
        "goodput_seed": args.goodput_seed,
        "load_average_start": load_average(), "engine_runs": {},
        # tokenmill's batch-invariant inference is on unless its flags turn it off
        "tokenmill_batch_invariant": "--no-batch-invariant" not in args.tokenmill_args,
        "llama_server_version": llama_server_version(args.llama_server) if "llamacpp" in engines else None,
    }
    print(isa_header(meta["machine"]))
    if meta["llama_server_version"]:
        print(f"# llama-server: {meta['llama_server_version']}")
    print(f"# engines {', '.join(engines)}; dtype {args.dtype}; threads {args.threads}; tokenmill batch-invariant "
          f"{'on' if meta['tokenmill_batch_invariant'] else 'off'}; concurrency "
          f"{','.join(map(str, args.concurrency))}; workloads {','.join(args.workload_list)}; load average "
          f"{meta['load_average_start']:.2f}", flush=True)
    cells: list[dict[str, Any]] = []
    searches: dict[str, Any] = {}
    meta["goodput_search"] = searches
    max_conc = max(args.concurrency)
    for engine in engines:
        wanted = list(args.workload_list)
        if engine in args.goodput_engines and args.goodput_workload not in wanted:
            wanted.append(args.goodput_workload)
        run_info: dict[str, Any] = {"load_average_before": load_average(), "workloads": {}}
        meta["engine_runs"][engine] = run_info
        for wname in wanted:
            # A fresh server per cell (workload x concurrency), and one for the goodput search: no state
            # carries over. The cells' prompt lists overlap (one seeded stream: the c=64 cell's first 16
            # prompts are the c=16 cell's), so a server kept across cells served part of each later cell
            # from its prefix cache.
            wl = WORKLOADS[wname]
            concs = list(args.concurrency if wname in args.workload_list else [])
            runs = [(c, False) for c in concs]
            if engine in args.goodput_engines and wname == args.goodput_workload:
                runs.append((None, True))
            infos: list[dict[str, Any]] = []
            run_info["workloads"][wname] = infos
            for conc, search in runs:
                server = make_server(engine, args, gguf, hf_dir, max_conc, out_dir / "logs",
                                     f"{wname}-{'goodput' if search else f'c{conc}'}")
                live = [server]            # the running server (a goodput search starts one per probe)
                info: dict[str, Any] = {"command": server.cmd, "concurrency": conc, "goodput_search": search}
                infos.append(info)
                print(f"\n=== {engine} / {wname} / {'goodput search' if search else f'c={conc}'}: starting "
                      f"{' '.join(server.cmd)}", flush=True)
                try:
                    info["startup_s"] = server.start(args.startup_timeout)
                    models = asyncio.run(fetch_models(server.base_url))
                    model = models[0] if models else ""
                    info["model_id"] = model
                    info["warmup_s"] = warm_up(engine, server, model, wl, tokenizer, args)
                    print(f"    up in {info['startup_s']:.1f} s, warm-up {info['warmup_s']:.1f} s, "
                          f"model id {model!r}", flush=True)
                    cfg = endpoint_for(engine, wl, server.base_url, model, args.request_timeout)
                    if search:
                        restarts: list[float] = info.setdefault("restarts_s", [])

                        def fresh() -> Any:     # called within this iteration only (goodput_search below)
                            live[0].stop()
                            nxt = make_server(engine, args, gguf, hf_dir, max_conc, out_dir / "logs",
                                              f"{wname}-goodput-{len(restarts) + 2}")
                            live[0] = nxt
                            restarts.append(nxt.start(args.startup_timeout))
                            warm_up(engine, nxt, model, wl, tokenizer, args)
                            return endpoint_for(engine, wl, nxt.base_url, model, args.request_timeout)

                        searches[engine] = goodput_search(engine, cfg, wl, samples_for, tokenizer, slo, args,
                                                          raw_dir=out_dir / "raw",
                                                          fresh=fresh if args.goodput_fresh_server else None)
                        save(build_report(cells, meta), out_dir)
                        continue
                    n = args.num_prompts or default_num_prompts(conc, args.min_prompts, args.prompts_per_slot)
                    samples = samples_for(wl, n)
                    la = load_average()
                    res = run_cell(samples, cfg, conc, tokenizer, slo)
                    m = res.metrics.to_dict()
                    cell = cell_from_metrics(engine, wname, conc, m)
                    cell["load_average_1m"] = la
                    if res.metrics.failed:
                        cell["errors"] = sorted({r.error for r in res.records if not r.success})[:5]
                    cells.append(cell)
                    raw = out_dir / "raw" / f"{engine}-{wname}-c{conc}.json"
                    save_json(raw, result_json(res.metrics, res.records, res.t0, {
                        "engine": engine, "workload": wname, "max_concurrency": conc, "model_id": model,
                        "endpoint_type": wl.endpoint, "date": res.date, "num_prompts": n}))
                    print(f"    {wname:<8} c={conc:<3} n={n:<4} {cell['output_throughput']:8.1f} tok/s  "
                          f"p99 TTFT {_fmt(cell['p99_ttft_ms'], '.0f'):>7} ms  "
                          f"p99 TPOT {_fmt(cell['p99_tpot_ms'], '.1f'):>7} ms  "
                          f"goodput {_fmt(cell['request_goodput'], '.3f')} req/s  "
                          f"failed {cell['failed']}  (load {la:.2f})", flush=True)
                    if cell.get("errors"):
                        print(f"      errors: {cell['errors']}", flush=True)
                    save(build_report(cells, meta), out_dir)
                except Exception as exc:  # noqa: BLE001 - record the failure, go on with the next run
                    info["error"] = f"{type(exc).__name__}: {exc}"
                    print(f"    {engine} / {wname} FAILED: {info['error']}\n{live[0].log_tail(1500)}", flush=True)
                finally:
                    live[0].stop()
        run_info["load_average_after"] = load_average()
    meta["load_average_end"] = load_average()
    doc = build_report(cells, meta)
    path = save(doc, out_dir)
    print()
    print(format_tables(cells, doc["ratios"], slo))
    if searches:
        print()
        print(format_goodput(searches, args.attainment, slo, doc["baseline"]))
    if "llamacpp" in engines:
        print()
        print(format_targets(doc["targets"]))
    print(f"\nmachine: {meta['machine'].get('cpu', '?')}, {meta['machine']['cpu_count']} cores; "
          f"load average {meta['load_average_start']:.2f} at start, {meta['load_average_end']:.2f} at end")
    print(f"Saved results to {path}")
    if cells:
        print(f"Saved plot to {plot_report(doc, out_dir / 'compare_engines.png')}")
    errors = [i.get("error") for r in meta["engine_runs"].values() for w in r["workloads"].values() for i in w]
    return 0 if (cells or searches) and not any(errors) else 1


if __name__ == "__main__":
    sys.exit(main())
