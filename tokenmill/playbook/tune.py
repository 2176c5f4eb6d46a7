"""``tokenmill tune``: the playbook's lever search, one change per run, measured as goodput.

Given a model, a workload (a ``bench serve`` dataset spec or a JSONL of the
user's prompts) and an SLO (``--goodput ttft:MS tpot:MS`` with an attainment
target), ``tune``:

1. **measures run-to-run noise** first: the starting configuration is
   measured ``--noise-runs`` times, each on a fresh server; the noise is the
   relative spread ``(max − min) / mean`` of those goodputs. A change is kept
   only when its goodput exceeds the best so far by more than
   ``max(noise, --precision)`` (the goodput search itself cannot resolve rates
   closer than its bisection precision).
2. **pulls the levers in the playbook's order**, one change per run, each run
   on a fresh ``tokenmill serve`` process with the same seeded workload:
   ``max_num_seqs`` and KV memory until preemptions stop (candidates from
   :mod:`tokenmill.playbook.plan`), ``max_num_batched_tokens`` and
   ``long_prefill_token_threshold`` against whichever of TTFT / TPOT is
   closer to its limit, prefix caching, KV cache dtype, weight quantization,
   speculative decoding, replicas. A lever is pulled only when the engine has
   its flag (read from the ``tokenmill serve`` parser when ``tune`` runs);
   the others are reported as skipped, with the reason. A kept change
   becomes the new baseline and its lever may step again in the same
   direction (up to ``MAX_STEPS_PER_LEVER``).
3. **measures each run as goodput** with ``tokenmill bench goodput``'s
   machinery (:func:`tokenmill.bench.goodput_search.search_goodput`, DistServe
   arXiv 2401.09670 §2.2: the highest Poisson rate at which ``--attainment``
   of requests meet every SLO), plus the preemptions the server counted.
4. **writes a report**: ``tune_report.md``, ``tune_report.json`` and
   ``tune_report.png`` with every trial, its goodput and p99s, what was kept
   and why, and the final ``tokenmill serve`` command line.

``--budget-minutes`` bounds the wall time spent measuring (a trial is not
started when the mean trial time would overrun it). Every measurement is
saved in a state file as soon as it is done; rerunning the same command
replays the decisions from saved measurements and continues where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("tokenmill.tune")

LEVER_ORDER = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "prefix_caching",
               "kv_cache_dtype", "quantization", "speculative", "replicas")
MAX_STEPS_PER_LEVER = 3
STATE_VERSION = 1


# ------------------------------------------------------------------ flags ---

def serve_options() -> dict[str, argparse.Action]:
    """The ``tokenmill serve`` parser's options on this checkout: ``--flag`` → argparse action."""
    from tokenmill.server.cli_args import build_parser

    return dict(build_parser()._option_string_actions)  # noqa: SLF001 - argparse has no public accessor


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 64, "enable_prefix_caching": False}`` → ``["--max-num-seqs", "64", "--no-enable-prefix-caching"]``."""
    argv: list[str] = []
    for k, v in flags.items():
        name = k.replace("_", "-")
        if isinstance(v, bool):
            argv.append(f"--{name}" if v else f"--no-{name}")
        else:
            argv += [f"--{name}", v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict) else str(v)]
    return argv


def merge_serve_args(base: list[str], flags: dict[str, Any], options: dict[str, argparse.Action]) -> list[str]:
    """``base`` serve arguments with the flags in ``flags`` replaced by their new values (appended)."""
    names = {k.replace("_", "-") for k in flags}
    out, i = [], 0
    while i < len(base):
        tok = base[i]
        flag = tok.split("=", 1)[0]
        name = flag[2:].removeprefix("no-") if flag.startswith("--") else None
        if name in names:
            action = options.get(flag) or options.get("--" + name)
            takes_value = action is not None and action.nargs != 0 and "=" not in tok
            i += 2 if takes_value else 1
            continue
        out.append(tok)
        i += 1
    return out + flags_to_argv(flags)


def _normalize(flags: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``flags`` without the entries equal to the base configuration's values (one key per configuration)."""
    return {k: v for k, v in flags.items() if k not in defaults or defaults[k] != v}


def _serve_defaults(base_args: list[str]) -> dict[str, Any]:
    """Every serve field's value under the user's base serve arguments (dataclass defaults otherwise)."""
    from tokenmill.server.cli_args import build_parser

    return dict(vars(build_parser().parse_args(base_args)))


# ------------------------------------------------------------------ measuring ---

@dataclass
class Measurement:
    """One configuration measured on a fresh server.

    Attributes:
        goodput: req/s (0: no probed rate met the target).
        lowest_failing_rate: req/s, or None.
        p99_ttft_ms, p99_tpot_ms, slo_attainment: at the highest passing probe (the lowest probe when none passed).
        preemptions: preemptions the server counted during the search (``tokenmill:num_preemptions_total`` delta).
        curve: probe summaries sorted by rate.
        duration_s: wall time of the trial, start-up included.
        startup_s: server start-up time.
        error: why the trial produced no goodput (server failed to start, ...), else None.
        load_avg: the machine's 1-minute load average at the end of the trial (other processes compete for
            the CPUs: compare trials only at similar load).
        warmup: summaries of the discarded warm-up probes (see :func:`warm_then_search`).
    """

    goodput: float = 0.0
    lowest_failing_rate: float | None = None
    p99_ttft_ms: float = math.nan
    p99_tpot_ms: float = math.nan
    slo_attainment: float = math.nan
    preemptions: float = 0.0
    curve: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    startup_s: float = 0.0
    error: str | None = None
    load_avg: float = math.nan
    warmup: list[dict[str, Any]] = field(default_factory=list)


def warm_then_search(probe: Callable[[float], Any], settings: "TuneSettings", initial_rate: float,
                     on_probe: Callable[[Any], None] | None = None,
                     after_warmup: Callable[[], None] | None = None) -> tuple[Any, list[Any]]:
    """``settings.warmup_probes`` discarded probes at ``initial_rate``, then the goodput search.

    A fresh server is slow on its first stretch of traffic (on CPU, e.g., oneDNN builds a primitive for each new
    GEMM row count the first time a step of that many tokens runs; measured with the packaged model: the first
    probe of every trial missed the SLO with p99 TTFT 2-11 s where later probes at the same or higher rates met
    it with ~0.5 s). Without a warm-up that cold first probe fails and caps the search below the rate it started
    at, so no lever could ever beat the baseline. The warm-up probes run the whole workload once at the rate the
    search starts from; ``after_warmup`` runs between warm-up and search (e.g. to read counters).

    Returns:
        ``(SearchResult, warm-up probes)``.
    """
    from tokenmill.bench.goodput_search import search_goodput

    warm = []
    for _ in range(max(0, settings.warmup_probes)):
        p = probe(initial_rate)
        logger.info("  warm-up probe %.4g req/s (discarded): attainment %.1f%%, p99 TTFT %.0f ms, p99 TPOT %.1f ms",
                    p.request_rate, 100 * p.slo_attainment, p.p99_ttft_ms, p.p99_tpot_ms)
        warm.append(p)
    if after_warmup is not None:
        after_warmup()
    result = search_goodput(probe, target=settings.attainment, initial_rate=initial_rate,
                            precision=settings.precision, max_rate=settings.max_rate, min_rate=settings.min_rate,
                            max_probes=settings.max_probes, on_probe=on_probe)
    return result, warm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_preemptions(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "tokenmill:num_preemptions_total":
                total += s.value
    return total


class ServerProcess:
    """A ``tokenmill serve`` (or ``--serve-command``) process in its own session, stopped with its children.

    Raises (from :meth:`start`):
        RuntimeError: the process exited or did not answer ``/health`` within ``timeout_s`` (log tail included).
    """

    def __init__(self, argv: list[str], port: int, log_path: Path) -> None:
        self.argv, self.port, self.log_path = argv, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        import httpx

        t0 = time.monotonic()
        log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        log.close()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not answer /health within {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 15) -> str:
        try:
            return " | ".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT, then SIGKILL to the whole process group after 30 s; always reaps."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core and anything else it started
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


@dataclass
class TuneSettings:
    """Everything that defines a tuning session (the state file refuses to resume a different one).

    Attributes:
        model: model path passed to the server (None: the server's default).
        base_serve_args: serve flags the user fixed, e.g. ``["--dtype", "bfloat16"]``.
        serve_command: command that starts a server (model and flags are appended).
        workload: bench dataset arguments (dataset, dataset_path, num_prompts, input_len, output_len, range_ratio,
            prefix_len, num_prefixes, multi_turn, seed, ignore_eos, endpoint, tokenizer, temperature).
        slos: SLO limits in ms, e.g. ``{"ttft": 2000, "tpot": 100}``.
        attainment: target share of requests meeting the SLO.
        initial_rate, precision, min_rate, max_rate, max_probes: goodput search settings (as bench goodput).
        noise_runs: measurements of the starting configuration.
        warmup_probes: discarded probes of the whole workload on each fresh server before its search.
        levers: levers to try, in the playbook's order.
        budget_minutes: measuring time allowed (None: unbounded).
        startup_timeout_s: seconds a server may take to start.
        accuracy_report: JSON of ``benchmarks/quant_accuracy.py --json``; formats it finds not lossless are
            not tried (None: formats are tried and their accuracy reported as not checked).
    """

    model: str | None
    base_serve_args: list[str]
    serve_command: list[str]
    workload: dict[str, Any]
    slos: dict[str, float]
    attainment: float = 0.9
    initial_rate: float = 1.0
    precision: float = 0.1
    min_rate: float = 1.0 / 64
    max_rate: float = 1024.0
    max_probes: int = 8
    noise_runs: int = 2
    warmup_probes: int = 1
    levers: list[str] = field(default_factory=lambda: list(LEVER_ORDER))
    budget_minutes: float | None = None
    startup_timeout_s: float = 300.0
    accuracy_report: str | None = None

    def fingerprint(self) -> str:
        """Hash of what determines measurements (budget and lever list excluded: they may change on resume)."""
        d = asdict(self)
        for k in ("budget_minutes", "levers", "startup_timeout_s", "accuracy_report"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class GoodputMeasurer:
    """Measures a configuration: fresh server, goodput search on the fixed workload, stop.

    The workload is built once (same seeded prompts and arrivals for every trial).
    """

    def __init__(self, settings: TuneSettings, log_dir: Path) -> None:
        from tokenmill.bench.datasets import build_dataset
        from tokenmill.bench.tokenizer import get_tokenizer, resolve_tokenizer_path

        self.s = settings
        self.log_dir = log_dir
        w = settings.workload
        tok_path = resolve_tokenizer_path(w.get("tokenizer"), settings.model)
        self.tokenizer = get_tokenizer(str(tok_path))
        self.samples = build_dataset(w.get("dataset", "random"), self.tokenizer, int(w.get("num_prompts", 32)),
                                     input_len=w.get("input_len"), output_len=w.get("output_len"),
                                     range_ratio=float(w.get("range_ratio", 0.0)), prefix_len=w.get("prefix_len"),
                                     num_prefixes=int(w.get("num_prefixes", 10)), dataset_path=w.get("dataset_path"),
                                     multi_turn=bool(w.get("multi_turn", False)), seed=int(w.get("seed", 0)))
        n = sum(s.num_requests for s in self.samples)
        self.mean_prompt_len = sum(s.prompt_len for s in self.samples) / max(1, len(self.samples))
        self.mean_output_len = sum(s.expected_output_len for s in self.samples) / max(1, len(self.samples))
        self.max_seq_len = max(s.prompt_len + s.expected_output_len for s in self.samples)
        self.num_requests = n
        self._count = len(list(log_dir.glob("server_*.log")))  # a resumed session keeps earlier logs

    def __call__(self, flags: dict[str, Any], initial_rate: float) -> Measurement:
        from tokenmill.bench.client import EndpointConfig, normalize_endpoint
        from tokenmill.bench.goodput_search import probe_from_metrics
        from tokenmill.bench.loadgen import LoadConfig, fetch_models, run_benchmark
        from tokenmill.bench.report import json_safe

        self._count += 1
        t0 = time.monotonic()
        port = _free_port()
        argv = list(self.s.serve_command) + ([self.s.model] if self.s.model else []) + list(self.s.base_serve_args) \
            + flags_to_argv(flags) + ["--host", "127.0.0.1", "--port", str(port)]
        srv = ServerProcess(argv, port, self.log_dir / f"server_{self._count:03d}.log")
        m = Measurement()
        logger.info("trial server: %s", shlex.join(argv))
        try:
            m.startup_s = srv.start(self.s.startup_timeout_s)
            w = self.s.workload
            api_key = _serve_defaults(self.s.base_serve_args).get("api_key")  # a server behind --api-key
            model_id = asyncio.run(fetch_models(srv.url, api_key))[0]
            cfg = EndpointConfig(base_url=srv.url, endpoint=normalize_endpoint(w.get("endpoint", "completions")),
                                 model=model_id, api_key=api_key, ignore_eos=bool(w.get("ignore_eos", False)),
                                 temperature=w.get("temperature"), timeout_s=600.0)
            before = [0.0]

            warm = [min(4, len(self.samples))]  # the first probe on a fresh server starts with warm-up requests

            def probe(rate: float):
                load = LoadConfig(request_rate=rate, seed=int(w.get("seed", 0)), disable_tqdm=True,
                                  num_warmups=warm.pop() if warm else 0, percentiles=[50.0, 99.0],
                                  goodput=dict(self.s.slos))
                res = asyncio.run(run_benchmark(self.samples, cfg, load, self.tokenizer))
                return probe_from_metrics(rate, json_safe(res.metrics.to_dict()))

            def on_probe(p) -> None:
                logger.info("  probe %.4g req/s: attainment %.1f%%, p99 TTFT %.0f ms, p99 TPOT %.1f ms -> %s",
                            p.request_rate, 100 * p.slo_attainment, p.p99_ttft_ms, p.p99_tpot_ms,
                            "pass" if p.passed else "miss")

            def after_warmup() -> None:
                before[0] = _scrape_preemptions(srv.url)

            result, warmups = warm_then_search(probe, self.s, initial_rate, on_probe, after_warmup)
            m.warmup = [p.summary() for p in warmups]
            m.preemptions = _scrape_preemptions(srv.url) - before[0]
            m.goodput = result.goodput
            m.lowest_failing_rate = result.lowest_failing_rate
            m.curve = result.curve()
            at = [c for c in m.curve if c["passed"] and c["request_rate"] == result.goodput] or m.curve[:1]
            if at:
                m.p99_ttft_ms, m.p99_tpot_ms = at[0]["p99_ttft_ms"], at[0]["p99_tpot_ms"]
                m.slo_attainment = at[0]["slo_attainment"]
        except Exception as e:  # noqa: BLE001 - a failed trial is a result (not kept), never the end of tuning
            m.error = f"{type(e).__name__}: {e}"
            logger.warning("trial failed: %s", m.error)
        finally:
            srv.stop()
        m.duration_s = time.monotonic() - t0
        m.load_avg = os.getloadavg()[0]
        return m


# ------------------------------------------------------------------ levers ---

@dataclass
class Change:
    """One candidate change: flags to set on top of the current best, and why."""

    flags: dict[str, Any]
    why: str


@dataclass
class LeverContext:
    """What a lever sees: the current best flags (over the base defaults), its measurement, the SLO, helpers."""

    best_flags: dict[str, Any]
    defaults: dict[str, Any]
    best: Measurement
    slos: dict[str, float]
    options: dict[str, argparse.Action]
    capacity: Callable[[dict[str, Any]], dict[str, Any] | None]
    accuracy: dict[str, dict[str, Any]] = field(default_factory=dict)

    def verdict(self, fmt: str) -> tuple[bool | None, str]:
        """(lossless?, text) for a weight format or ``kv-<dtype>`` from the accuracy report (None: not in it)."""
        r = self.accuracy.get(fmt)
        if r is None or "lossless" not in r:
            return None, ("accuracy not checked (pass --accuracy-report from benchmarks/quant_accuracy.py --json)"
                          if not self.accuracy else f"{fmt} not in the accuracy report")
        figs = ", ".join(f"{k} {r[k]:.4g}" for k in ("top1", "kl", "ppl_ratio", "greedy") if k in r)
        return bool(r["lossless"]), f"accuracy report: {'lossless' if r['lossless'] else 'NOT lossless'} ({figs})"

    def value(self, name: str) -> Any:
        return self.best_flags.get(name, self.defaults.get(name))

    def has(self, flag: str) -> bool:
        return flag in self.options

    def choices(self, flag: str) -> list[str]:
        a = self.options.get(flag)
        return list(a.choices or []) if a is not None else []


def _binding_slo(ctx: LeverContext) -> str:
    """'ttft' or 'tpot': the limit the best run's p99 is closer to (ratio p99 / limit)."""
    r_ttft = ctx.best.p99_ttft_ms / ctx.slos["ttft"] if "ttft" in ctx.slos else 0.0
    r_tpot = ctx.best.p99_tpot_ms / ctx.slos["tpot"] if "tpot" in ctx.slos else 0.0
    r_ttft = 0.0 if math.isnan(r_ttft) else r_ttft
    r_tpot = 0.0 if math.isnan(r_tpot) else r_tpot
    return "ttft" if r_ttft >= r_tpot else "tpot"


def lever_max_num_seqs(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--max-num-seqs"):
        return "the engine has no --max-num-seqs"
    seqs = int(ctx.value("max_num_seqs"))
    cap = ctx.capacity(ctx.best_flags)
    fit = cap["max_num_seqs_without_preemption"] if cap else None
    out: list[Change] = []
    if ctx.best.preemptions > 0:
        if ctx.has("--kv-cache-memory") and cap:
            mem = 2 * int(cap["kv_cache_memory"])
            out.append(Change({"kv_cache_memory": str(mem)},
                              f"{ctx.best.preemptions:.0f} preemptions: double the KV pool to {mem / 2**20:.0f} MiB"))
        if fit and fit < seqs:
            out.append(Change({"max_num_seqs": max(1, fit)},
                              f"{ctx.best.preemptions:.0f} preemptions: the pool holds {fit} requests at their peak "
                              f"(tokenmill plan), not {seqs}"))
        return out or "preemptions, but no KV memory or max_num_seqs change is possible"
    new = seqs * 2
    if fit is not None and fit < new:
        if fit > seqs:
            new = fit
        elif ctx.has("--kv-cache-memory") and cap:
            mem = 2 * int(cap["kv_cache_memory"])
            return [Change({"max_num_seqs": new, "kv_cache_memory": str(mem)},
                           f"no preemptions; {new} running requests need a larger pool ({mem / 2**20:.0f} MiB)")]
        else:
            return f"no preemptions and the pool holds no more than {fit} requests"
    return [Change({"max_num_seqs": new}, f"no preemptions at {seqs}: a bigger decode batch ({new})")]


def lever_max_num_batched_tokens(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--max-num-batched-tokens"):
        return "the engine has no --max-num-batched-tokens"
    cur = int(ctx.value("max_num_batched_tokens"))
    up, down = cur * 2, max(64, cur // 2)
    if _binding_slo(ctx) == "ttft":
        order = [(up, f"p99 TTFT is the binding limit: a larger step budget ({up}) prefills faster")]
        if down < cur:
            order.append((down, f"the opposite direction ({down})"))
    else:
        order = [(down, f"p99 TPOT is the binding limit: a smaller step budget ({down}) shortens decode steps")]
        order.append((up, f"the opposite direction ({up})"))
    return [Change({"max_num_batched_tokens": v}, why) for v, why in order if v != cur]


def lever_long_prefill_token_threshold(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--long-prefill-token-threshold"):
        return "the engine has no --long-prefill-token-threshold"
    cur = int(ctx.value("long_prefill_token_threshold") or 0)
    budget = int(ctx.value("max_num_batched_tokens") or 2048)
    if _binding_slo(ctx) != "ttft":
        return "p99 TPOT, not TTFT, is the binding limit: a prefill cap would not help"
    new = max(64, (cur or budget) // 4)
    if cur and new >= cur:
        return "already capped"
    return [Change({"long_prefill_token_threshold": new},
                   f"p99 TTFT is the binding limit: cap each prompt's share of a step at {new} tokens")]


def lever_prefix_caching(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--enable-prefix-caching"):
        return "the engine has no --enable-prefix-caching"
    if ctx.value("enable_prefix_caching"):
        return "already on"
    return [Change({"enable_prefix_caching": True}, "reuse KV blocks of shared prompt prefixes")]


def lever_kv_cache_dtype(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--kv-cache-dtype"):
        return "the engine has no --kv-cache-dtype (not on main yet)"
    want = [c for c in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8") if c in ctx.choices("--kv-cache-dtype")] or ["fp8"]
    if ctx.value("kv_cache_dtype") in want:
        return "already a 1-byte KV cache"
    out, refused = [], []
    for d in want:
        ok, text = ctx.verdict(f"kv-{d}")
        if ok is False:
            refused.append(f"{d}: {text}")
        else:
            out.append(Change({"kv_cache_dtype": d}, f"1-byte KV cache ({d}): twice the tokens in the pool; {text}"))
    return out[:1] or "; ".join(refused)


def lever_quantization(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--quantization"):
        return "the engine has no --quantization (not on main yet)"
    choices = [c for c in ("int8", "w8a8", "int4") if c in ctx.choices("--quantization")] or ["int8"]
    if ctx.value("quantization") in choices:
        return "already quantized"
    out, refused = [], []
    for q in choices:
        ok, text = ctx.verdict(q)
        if ok is False:
            refused.append(f"{q}: {text}")
        else:
            out.append(Change({"quantization": q}, f"{q} weights: fewer bytes read per decode step; {text}"))
    return out or "; ".join(refused)


def lever_speculative(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--speculative-config"):
        return "the engine has no --speculative-config (not on main yet)"
    if ctx.value("speculative_config"):
        return "already on"
    return [Change({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
                   "n-gram speculative decoding (3 draft tokens): fewer decode steps when drafts are accepted")]


def lever_replicas(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--data-parallel-size"):
        return "the engine has no --data-parallel-size (not on main yet)"
    cur = int(ctx.value("data_parallel_size") or 1)
    return [Change({"data_parallel_size": cur * 2}, f"{cur * 2} engine replicas behind one endpoint")]


LEVERS: dict[str, Callable[[LeverContext], list[Change] | str]] = {
    "max_num_seqs": lever_max_num_seqs, "max_num_batched_tokens": lever_max_num_batched_tokens,
    "long_prefill_token_threshold": lever_long_prefill_token_threshold, "prefix_caching": lever_prefix_caching,
    "kv_cache_dtype": lever_kv_cache_dtype, "quantization": lever_quantization, "speculative": lever_speculative,
    "replicas": lever_replicas,
}


# ------------------------------------------------------------------ the search ---

@dataclass
class Trial:
    """One row of the report."""

    index: int
    kind: str              # noise | lever
    lever: str | None
    change: dict[str, Any]
    flags: dict[str, Any]
    why: str
    measurement: Measurement
    verdict: str           # baseline | kept | rejected | failed
    reason: str
    resumed: bool = False


class StateFile:
    """Measurements saved as they are made, keyed by configuration (and run number for the noise runs).

    Raises (on load):
        ValueError: the file belongs to a different session (model, workload, SLO or serve arguments differ).
    """

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.data: dict[str, Any] = {"version": STATE_VERSION, "fingerprint": fingerprint, "measurements": {}}
        if path.exists():
            d = json.loads(path.read_text())
            if d.get("fingerprint") != fingerprint:
                raise ValueError(f"{path} holds a tuning session with other settings (model, workload, SLO or "
                                 f"serve arguments); use another --state-file or delete it")
            self.data = d

    @staticmethod
    def key(flags: dict[str, Any], run: int = 0) -> str:
        return json.dumps(flags, sort_keys=True) + (f"#{run}" if run else "")

    def get(self, key: str) -> Measurement | None:
        d = self.data["measurements"].get(key)
        return Measurement(**d) if d is not None else None

    def put(self, key: str, m: Measurement) -> None:
        self.data["measurements"][key] = asdict(m)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)

    def measured_seconds(self) -> float:
        return sum(float(m.get("duration_s", 0.0)) for m in self.data["measurements"].values())


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
    """Run the lever search (see module docstring) and return its result (the report is written by the caller).

    Args:
        settings: the session.
        output_dir: folder for server logs (and the default state file).
        state_path: resumable state file (default ``output_dir/tune_state.json``).
        measure: ``(flags, initial_rate) -> Measurement``; default :class:`GoodputMeasurer` (real servers).
        capacity: ``flags -> plan dict`` for the max_num_seqs lever; default :func:`plan_capacity`.

    Raises:
        ValueError: unknown lever, no ``--goodput`` SLO, or a state file of another session.
    """
    unknown = [lv for lv in settings.levers if lv not in LEVERS]
    if unknown:
        raise ValueError(f"unknown lever(s) {unknown}; choose from {', '.join(LEVER_ORDER)}")
    if not settings.slos:
        raise ValueError("tune needs an SLO: --goodput ttft:MS tpot:MS")
    output_dir.mkdir(parents=True, exist_ok=True)
    state = StateFile(state_path or output_dir / "tune_state.json", settings.fingerprint())
    measurer = measure
    if measurer is None:
        measurer = GoodputMeasurer(settings, output_dir)
    cap_fn = capacity
    if cap_fn is None:
        mp = getattr(measurer, "mean_prompt_len", None)
        mo = getattr(measurer, "mean_output_len", None)
        cap_fn = lambda flags: plan_capacity(settings, flags, mp, mo)  # noqa: E731
    options = serve_options()
    defaults = _serve_defaults(settings.base_serve_args)
    accuracy = load_accuracy_report(settings.accuracy_report)
    budget_s = settings.budget_minutes * 60 if settings.budget_minutes else math.inf
    t_start = time.monotonic()
    trials: list[Trial] = []
    stopped = False

    def out_of_budget() -> bool:
        done = [t.measurement.duration_s for t in trials]
        mean = sum(done) / len(done) if done else 0.0
        return spent_before_trials() + mean > budget_s

    measured_keys: set[str] = set()

    def spent_before_trials() -> float:
        # Budget counts every measurement this session has made, in this run or before a resume.
        return sum(state.get(k).duration_s for k in measured_keys)

    def run(flags: dict[str, Any], run_no: int, initial_rate: float) -> tuple[Measurement, bool] | None:
        key = state.key(flags, run_no)
        saved = state.get(key)
        if saved is not None:
            measured_keys.add(key)
            return saved, True
        if out_of_budget():
            return None
        m = measurer(flags, initial_rate)
        state.put(key, m)
        measured_keys.add(key)
        return m, False

    # 1. Noise: the starting configuration, several times.
    runs: list[Measurement] = []
    for i in range(max(1, settings.noise_runs)):
        got = run({}, i, settings.initial_rate if not runs else max(runs[0].goodput, settings.min_rate))
        if got is None:
            stopped = True
            break
        m, resumed = got
        runs.append(m)
        trials.append(Trial(len(trials) + 1, "noise", None, {}, {}, f"starting configuration, run {i + 1}", m,
                            "baseline" if not m.error else "failed",
                            "noise measurement" if not m.error else m.error, resumed))
    good = [m.goodput for m in runs if not m.error]
    baseline = sum(good) / len(good) if good else 0.0
    noise = (max(good) - min(good)) / baseline if len(good) > 1 and baseline > 0 else 0.0
    threshold = max(noise, settings.precision)
    best_flags: dict[str, Any] = {}
    best = max((m for m in runs if not m.error), key=lambda m: m.goodput, default=Measurement())
    best_goodput = baseline
    start_rate = max(baseline, settings.min_rate) if baseline > 0 else settings.initial_rate
    skipped: dict[str, str] = {}
    if not good:
        stopped = stopped or not runs
        skipped = {lv: "the starting configuration could not be measured" for lv in settings.levers}

    # 2. Levers in the playbook's order.
    tried = {state.key({})}
    for lever in ([lv for lv in LEVER_ORDER if lv in settings.levers] if good else []):
        steps = 0
        while steps < MAX_STEPS_PER_LEVER:
            ctx = LeverContext(best_flags=dict(best_flags), defaults=defaults, best=best, slos=settings.slos,
                               options=options, capacity=cap_fn, accuracy=accuracy)
            proposal = LEVERS[lever](ctx)
            if isinstance(proposal, str):
                if steps == 0:
                    skipped[lever] = proposal
                break
            kept = False
            # After a kept step only the same direction continues (the first candidate); never re-measure a
            # configuration already measured in this session (e.g. stepping back to where the lever started).
            for change in (proposal if steps == 0 else proposal[:1]):
                flags = _normalize({**best_flags, **change.flags}, defaults)
                if state.key(flags) in tried:
                    continue
                tried.add(state.key(flags))
                got = run(flags, 0, start_rate)
                if got is None:
                    stopped = True
                    break
                m, resumed = got
                bar = best_goodput * (1 + threshold)
                if m.error:
                    verdict, reason = "failed", m.error
                elif m.goodput > bar:
                    verdict = "kept"
                    reason = (f"goodput {m.goodput:.3g} > {best_goodput:.3g} × (1 + {threshold:.2f}) = {bar:.3g} req/s")
                else:
                    verdict = "rejected"
                    reason = (f"goodput {m.goodput:.3g} ≤ {bar:.3g} req/s (best {best_goodput:.3g} + "
                              f"{100 * threshold:.0f}% noise)")
                trials.append(Trial(len(trials) + 1, "lever", lever, change.flags, flags, change.why, m, verdict,
                                    reason, resumed))
                if verdict == "kept":
                    best_flags, best, best_goodput, kept = flags, m, m.goodput, True
                    break
            if stopped or not kept:
                break
            steps += 1
        if stopped:
            break
    if stopped:
        for lever in settings.levers:
            if lever not in skipped and not any(t.lever == lever for t in trials):
                skipped[lever] = "not tried: --budget-minutes spent"
    model = settings.model or ""
    serve_cmd = shlex.join(["tokenmill", "serve", *([model] if model else []),
                            *merge_serve_args(settings.base_serve_args, best_flags, options)])
    return TuneResult(settings=settings, trials=trials, noise=noise, threshold=threshold, baseline_goodput=baseline,
                      best_flags=best_flags, best_goodput=best_goodput, skipped=skipped, serve_command=serve_cmd,
                      stopped_by_budget=stopped, elapsed_s=time.monotonic() - t_start)


def load_accuracy_report(path: str | None) -> dict[str, dict[str, Any]]:
    """``benchmarks/quant_accuracy.py --json`` output (a list of per-format dicts) keyed by format label.

    Raises:
        ValueError: the file is not such a list.
    """
    if not path:
        return {}
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "format" in r for r in rows):
        raise ValueError(f"{path}: expected the JSON list written by benchmarks/quant_accuracy.py --json")
    return {str(r["format"]): r for r in rows}


def plan_capacity(settings: TuneSettings, flags: dict[str, Any], prompt_len: float | None,
                  output_len: float | None) -> dict[str, Any] | None:
    """:func:`tokenmill.playbook.plan.plan` for the trial's flags and the workload's mean lengths, as a dict.

    None when the model cannot be planned (e.g. a fake server in tests without a model path).
    """
    from tokenmill.config import parse_size
    from tokenmill.playbook.plan import QUANTIZATIONS, PlanOptions, default_model_path, plan

    vals = _serve_defaults(settings.base_serve_args + flags_to_argv(
        {k: v for k, v in flags.items() if k in ("kv_cache_memory", "max_num_seqs", "block_size", "kv_cache_dtype")}))
    path = settings.model or default_model_path()
    if path is None or prompt_len is None:
        return None
    try:
        shape = _cached_shape(path)
        dtype = vals.get("dtype", "auto")
        if dtype == "auto":
            dtype = _engine_auto_dtype()
        # the engine's KV dtype (auto: bfloat16 for a float32 model on the CPU low-bit path) and sharding
        device = str(vals.get("device") or "auto").split(":")[0]
        opts = PlanOptions(dtype=dtype, kv_cache_dtype=vals.get("kv_cache_dtype") or "auto",
                           device=_engine_device() if device == "auto" else device,
                           quantization=vals.get("quantization") if vals.get("quantization") in QUANTIZATIONS else None,
                           tensor_parallel_size=int(vals.get("tensor_parallel_size") or 1),
                           pipeline_parallel_size=int(vals.get("pipeline_parallel_size") or 1),
                           kv_cache_memory=parse_size(vals.get("kv_cache_memory")) or (1 << 30),
                           block_size=int(vals.get("block_size") or 16), max_model_len=vals.get("max_model_len"),
                           prompt_len=int(round(prompt_len)), output_len=int(round(output_len or 0)),
                           context_lengths=[])
        if vals.get("num_kv_blocks"):
            return None
        return plan(shape, opts).to_dict()
    except (ValueError, FileNotFoundError):
        return None


@functools.lru_cache(maxsize=4)
def _cached_shape(path: str):
    from tokenmill.playbook.plan import load_shape

    return load_shape(path)


@functools.lru_cache(maxsize=1)
def _engine_device() -> str:
    """What ``--device auto`` becomes in the engine on this machine (cuda when torch sees one, else cpu)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=1)
def _engine_auto_dtype() -> str:
    """What ``--dtype auto`` becomes in the engine on this machine (its own rule: bfloat16 on CUDA and on CPUs
    with native bfloat16, else float32)."""
    import torch

    from tokenmill.model.loader import resolve_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(resolve_dtype("auto", device)).replace("torch.", "")


# ------------------------------------------------------------------ report ---

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


# ------------------------------------------------------------------ CLI ---

def add_tune_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``tokenmill tune`` (workload and SLO flags as ``tokenmill bench goodput``)."""
    from tokenmill.bench.datasets import DATASETS

    p.add_argument("model_path", metavar="MODEL", nargs="?", default=None,
                   help="GGUF file or HF folder to serve (default: the packaged SmolLM2-135M-Instruct).")
    p.add_argument("--serve-args", default="", help="Serve flags fixed for every trial, one string, e.g. "
                                                    "'--dtype bfloat16 --max-model-len 4096'.")
    p.add_argument("--serve-command", default=None,
                   help="Command that starts a server; MODEL, flags, --host and --port are appended "
                        "(default: this Python's 'tokenmill serve'; e.g. 'taskset -c 0 tokenmill serve').")
    w = p.add_argument_group("workload (as tokenmill bench serve)")
    w.add_argument("--dataset", default="random", choices=DATASETS, help="Workload [default: random].")
    w.add_argument("--dataset-path", default=None, help="jsonl: your prompts file; mt-bench: the questions file.")
    w.add_argument("--num-prompts", type=int, default=32, help="Requests per probe [default: 32].")
    w.add_argument("--input-len", type=int, default=None, help="random: prompt tokens.")
    w.add_argument("--output-len", type=int, default=None, help="max_tokens per request.")
    w.add_argument("--range-ratio", type=float, default=0.0, help="Length spread, 0 <= r < 1 [default: 0].")
    w.add_argument("--prefix-len", type=int, default=None, help="Shared prefix tokens.")
    w.add_argument("--num-prefixes", type=int, default=10, help="prefix-repetition: distinct prefixes.")
    w.add_argument("--multi-turn", action="store_true", help="mt-bench/jsonl: send whole conversations.")
    w.add_argument("--endpoint", default="completions", help="completions or chat [default: completions].")
    w.add_argument("--ignore-eos", action="store_true", help="Send ignore_eos: true.")
    w.add_argument("--temperature", type=float, default=None, help="Sampling temperature to send.")
    w.add_argument("--tokenizer", default=None, help="Benchmark tokenizer (default: the model's).")
    w.add_argument("--seed", type=int, default=0, help="Workload and arrival seed [default: 0].")
    s = p.add_argument_group("SLO and search")
    s.add_argument("--goodput", nargs="+", required=True, metavar="KEY:MS",
                   help="SLO limits, e.g. --goodput ttft:2000 tpot:100 (keys ttft, tpot, e2el; ms).")
    s.add_argument("--attainment", type=float, default=0.9, help="Target share meeting the SLO [default: 0.9].")
    s.add_argument("--initial-rate", type=float, default=1.0, help="First rate probed, req/s [default: 1].")
    s.add_argument("--precision", type=float, default=0.1, help="Bisection precision, relative [default: 0.1].")
    s.add_argument("--max-probes", type=int, default=8, help="Most probes per goodput search [default: 8].")
    s.add_argument("--max-rate", type=float, default=1024.0, help="Highest rate probed, req/s.")
    s.add_argument("--min-rate", type=float, default=1.0 / 64, help="Lowest rate probed, req/s.")
    s.add_argument("--noise-runs", type=int, default=2,
                   help="Measurements of the starting configuration to estimate noise [default: 2].")
    s.add_argument("--warmup-probes", type=int, default=1,
                   help="Discarded probes of the whole workload on each fresh server before its goodput search "
                        "(a cold server is slow at first) [default: 1].")
    s.add_argument("--levers", default=",".join(LEVER_ORDER),
                   help="Levers to try (always in the playbook's order) [default: all: "
                        + ",".join(LEVER_ORDER) + "].")
    s.add_argument("--budget-minutes", type=float, default=None, help="Measuring time allowed (default: none).")
    s.add_argument("--accuracy-report", default=None, metavar="JSON",
                   help="benchmarks/quant_accuracy.py --json output: weight formats / KV dtypes it finds not "
                        "lossless are not tried, the others carry its verdict.")
    s.add_argument("--startup-timeout", type=float, default=300.0, help="Seconds a server may take to start.")
    o = p.add_argument_group("output")
    o.add_argument("--output-dir", default="tune-results", help="Report, logs and state [default: tune-results].")
    o.add_argument("--state-file", default=None,
                   help="Resumable state (default: OUTPUT_DIR/tune_state.json); rerun the same command to resume.")


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    """Build :class:`TuneSettings` from parsed ``tune`` flags.

    Raises:
        ValueError: bad SLO, lever names or serve arguments.
    """
    from tokenmill.bench.metrics import parse_goodput
    from tokenmill.server.cli_args import build_parser

    slos = parse_goodput(args.goodput)
    base = shlex.split(args.serve_args or "")
    try:
        build_parser().parse_args(base)
    except SystemExit:
        raise ValueError(f"--serve-args {args.serve_args!r}: not valid tokenmill serve flags") from None
    cmd = shlex.split(args.serve_command) if args.serve_command else [sys.executable, "-m", "tokenmill.cli", "serve"]
    levers = [x.strip() for x in args.levers.split(",") if x.strip()]
    workload = {k: getattr(args, k) for k in ("dataset", "dataset_path", "num_prompts", "input_len", "output_len",
                                              "range_ratio", "prefix_len", "num_prefixes", "multi_turn", "endpoint",
                                              "ignore_eos", "temperature", "tokenizer", "seed")}
    if not 0 < args.attainment <= 1:
        raise ValueError("--attainment must be in (0, 1]")
    return TuneSettings(model=args.model_path, base_serve_args=base, serve_command=cmd, workload=workload,
                        slos=slos, attainment=args.attainment, initial_rate=args.initial_rate,
                        precision=args.precision, min_rate=args.min_rate, max_rate=args.max_rate,
                        max_probes=args.max_probes, noise_runs=args.noise_runs,
                        warmup_probes=args.warmup_probes, levers=levers,
                        budget_minutes=args.budget_minutes, startup_timeout_s=args.startup_timeout,
                        accuracy_report=args.accuracy_report)


def run_tune_cli(args: argparse.Namespace) -> int:
    """``tokenmill tune``: 0 after writing the report; 2 on bad input."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    def _terminate(signum, frame):  # SIGTERM unwinds like Ctrl-C: the trial's server is stopped, not orphaned
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread
        pass
    try:
        settings = settings_from_args(args)
        out = Path(args.output_dir)
        result = tune(settings, out, Path(args.state_file) if args.state_file else None)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenmill tune: error: {e}", file=sys.stderr)
        return 2
    paths = write_report(result, out)
    print(format_markdown(result, paths["png"].name))
    print(f"\nreport: {paths['md']}, {paths['json']}, {paths['png']}")
    return 0
