"""Measuring a trial: a fresh server, warm-up probes, then the goodput search (DistServe arXiv 2401.09670 §2.2)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tokenmill.playbook.tune.flags import serve_defaults, flags_to_argv
from tokenmill.playbook.tune.server import ServerProcess, free_port, scrape_preemptions
from tokenmill.playbook.tune.settings import TuneSettings

logger = logging.getLogger("tokenmill.tune")


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
        port = free_port()
        argv = list(self.s.serve_command) + ([self.s.model] if self.s.model else []) + list(self.s.base_serve_args) \
            + flags_to_argv(flags) + ["--host", "127.0.0.1", "--port", str(port)]
        srv = ServerProcess(argv, port, self.log_dir / f"server_{self._count:03d}.log")
        m = Measurement()
        logger.info("trial server: %s", shlex.join(argv))
        try:
            m.startup_s = srv.start(self.s.startup_timeout_s)
            w = self.s.workload
            api_key = serve_defaults(self.s.base_serve_args).get("api_key")  # a server behind --api-key
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
                before[0] = scrape_preemptions(srv.url)

            result, warmups = warm_then_search(probe, self.s, initial_rate, on_probe, after_warmup)
            m.warmup = [p.summary() for p in warmups]
            m.preemptions = scrape_preemptions(srv.url) - before[0]
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
