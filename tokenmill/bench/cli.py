"""``tokenmill bench serve`` and ``tokenmill bench goodput``.

Flag names follow ``vllm bench serve`` (vLLM's longer spellings such as
``--dataset-name``, ``--random-input-len`` and ``--metric-percentiles`` are
accepted as aliases). Wiring::

    from tokenmill.bench.cli import add_bench_subparsers
    add_bench_subparsers(subparsers)      # adds "bench serve" and "bench goodput"
    args = parser.parse_args()
    return args.func(args)                # -> int exit status

or ``python -m tokenmill.bench serve ...`` (see :func:`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from tokenmill.bench.client import VLLM_BACKEND_NAMES, EndpointConfig, normalize_endpoint
from tokenmill.bench.datasets import DATASETS, SampleRequest, build_dataset
from tokenmill.bench.metrics import PERCENTILE_METRICS, parse_goodput
from tokenmill.bench.report import format_table, json_safe, result_json, save_json
from tokenmill.bench.tokenizer import get_tokenizer, resolve_tokenizer_path
from tokenmill.bench.plots import plot_serve, plot_goodput
from tokenmill.bench.goodput_search import probe_from_metrics, search_goodput

logger = logging.getLogger("tokenmill.bench")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


# ------------------------------------------------------------------ parser ---

def _float_list(s: str) -> list[float]:
    try:
        return [float(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _metric_list(s: str) -> list[str]:
    items = [x.strip().lower() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x not in PERCENTILE_METRICS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown metric(s) {bad}; choose from {','.join(PERCENTILE_METRICS)}")
    return items


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _add_common_args(p: argparse.ArgumentParser, goodput_cmd: bool) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None,
                   help=f"Server root URL (default {DEFAULT_BASE_URL}, or http://HOST:PORT from --host/--port).")
    t.add_argument("--host", default=None, help="Server host (vLLM style; used when --base-url is not given).")
    t.add_argument("--port", type=int, default=None, help="Server port (vLLM style).")
    t.add_argument("--endpoint", default="completions",
                   help="completions or chat (also /v1/completions, /v1/chat/completions). Default: completions.")
    t.add_argument("--backend", default=None, choices=["openai", "openai-chat"],
                   help="vLLM alias: openai = completions, openai-chat = chat.")
    t.add_argument("--model", default=None, help="Model id to request (default: the first id from /v1/models).")
    t.add_argument("--tokenizer", default=None,
                   help="Local tokenizer folder or .gguf file (default: the served model when it is "
                        "tokenmill's default SmolLM2-135M-Instruct, or a local path named by --model).")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY).")
    t.add_argument("--request-timeout", type=_positive_float, default=6 * 3600.0,
                   help="Per-request time limit in s (default 21600).")

    w = p.add_argument_group("workload")
    w.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=DATASETS,
                   help="Workload (default random).")
    w.add_argument("--dataset-path", default=None,
                   help="jsonl: the prompts file (JSON lines or a ShareGPT JSON array); mt-bench: "
                        "override the questions file (default: ../shared/data/mt_bench_questions.jsonl when present, "
                        "else the copy bundled in tokenmill/bench/data).")
    w.add_argument("--num-prompts", type=int, default=100 if goodput_cmd else 1000,
                   help="Requests to send, follow-up turns included (default "
                        + ("100 per probe)." if goodput_cmd else "1000)."))
    w.add_argument("--input-len", "--random-input-len", "--prefix-repetition-suffix-len", dest="input_len",
                   type=int, default=None,
                   help="random: prompt tokens after the shared prefix (default 1024); prefix-repetition: "
                        "unique suffix tokens (default 256).")
    w.add_argument("--output-len", "--random-output-len", "--prefix-repetition-output-len", dest="output_len",
                   type=int, default=None,
                   help="max_tokens per request (default 128; for jsonl the reference answer's length "
                        "when the file has one). Overrides lengths in the dataset.")
    w.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="Input/output lengths uniform in [L·(1−r), L·(1+r)], 0 ≤ r < 1 (default 0).")
    w.add_argument("--prefix-len", "--random-prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len",
                   type=int, default=None,
                   help="Shared prefix tokens (random: one prefix for all, default 0; prefix-repetition: "
                        "tokens per prefix, default 256).")
    w.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", dest="num_prefixes", type=int,
                   default=10, help="prefix-repetition: distinct prefixes (default 10).")
    w.add_argument("--multi-turn", action="store_true",
                   help="mt-bench/jsonl: send conversations; each follow-up turn resends the history "
                        "with the server's actual answers.")
    w.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrivals (default 0).")
    w.add_argument("--ignore-eos", action="store_true", help="Send ignore_eos: true (vLLM extra).")
    w.add_argument("--temperature", type=float, default=None, help="Sampling temperature to send (default: server's).")
    w.add_argument("--extra-body", type=json.loads, default=None,
                   help='JSON object merged into every request body, e.g. \'{"top_k": 1}\'.')

    lo = p.add_argument_group("load")
    if not goodput_cmd:
        lo.add_argument("--request-rate", type=_positive_float, default=math.inf,
                        help="Mean arrival rate in req/s (default inf: send all at once).")
    lo.add_argument("--burstiness", type=_positive_float, default=1.0,
                    help="Gamma shape of inter-arrival gaps (1 = Poisson, <1 burstier, >1 more regular).")
    lo.add_argument("--max-concurrency", type=int, default=None, help="Cap on requests in flight.")
    lo.add_argument("--num-warmups", type=int, default=0, help="Warm-up requests before measuring (default 0).")

    r = p.add_argument_group("reporting")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLO limits, e.g. --goodput ttft:500 tpot:50 (keys ttft, tpot, e2el; ms). "
                        "A request is good when it meets every limit given."
                        + (" Required." if goodput_cmd else ""))
    r.add_argument("--percentile-metrics", type=_metric_list, default=list(PERCENTILE_METRICS),
                   help="Metrics shown with percentiles (default ttft,tpot,itl,e2el).")
    r.add_argument("--metric-percentiles", "--percentiles", dest="metric_percentiles", type=_float_list,
                   default=[90.0, 99.0], help="Percentiles to report (default 90,99).")
    r.add_argument("--save-result", nargs="?", const="", default=None, metavar="FILE.json",
                   help="Save results as JSON; without FILE, an automatic name in --result-dir.")
    r.add_argument("--result-filename", default=None, help="vLLM alias: file name for --save-result.")
    r.add_argument("--result-dir", default=".", help="Folder for automatically named results (default .).")
    r.add_argument("--plot", default=None, metavar="FILE.png", help="Save plots to this PNG.")
    r.add_argument("--label", default=None, help="Label stored in the result.")
    r.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="Extra result fields.")
    r.add_argument("--disable-tqdm", action="store_true", help="Hide the progress bar.")

    if goodput_cmd:
        g = p.add_argument_group("search")
        g.add_argument("--attainment", type=float, default=0.9,
                       help="Target share of requests meeting the SLO (default 0.9).")
        g.add_argument("--initial-rate", type=_positive_float, default=1.0, help="First rate probed, req/s (default 1).")
        g.add_argument("--precision", type=_positive_float, default=0.1,
                       help="Stop bisecting when the bracket is narrower than this fraction of the "
                            "passing rate (default 0.1).")
        g.add_argument("--max-rate", type=_positive_float, default=1024.0, help="Highest rate probed, req/s.")
        g.add_argument("--min-rate", type=_positive_float, default=1.0 / 64,
                       help="Lowest rate probed before reporting no goodput, req/s.")
        g.add_argument("--max-probes", type=int, default=16, help="Most benchmark runs (default 16).")


def add_bench_subparsers(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` (with ``serve`` and ``goodput``) to an argparse subparsers object.

    Each leaf parser sets ``func`` to a callable ``(args) -> int``.

    Returns:
        The ``bench`` parser.
    """
    bench = subparsers.add_parser("bench", help="Benchmark an OpenAI-compatible server.",
                                  description="Benchmark an OpenAI-compatible server "
                                              "(definitions as vllm bench serve).")
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,goodput}")
    sub.required = True
    serve = sub.add_parser("serve", help="Load-test a server and report TTFT/TPOT/ITL/E2EL, throughput, goodput.",
                           description="Send a workload at a request rate and report latency, "
                                       "throughput and goodput.")
    _add_common_args(serve, goodput_cmd=False)
    serve.set_defaults(func=run_serve)
    gp = sub.add_parser("goodput", help="Find the highest request rate meeting the SLO (DistServe goodput).",
                        description="Find the highest request rate at which at least --attainment of "
                                    "requests meet the --goodput SLO (DistServe, arXiv 2401.09670): "
                                    "bracket by doubling, then bisect.")
    _add_common_args(gp, goodput_cmd=True)
    gp.set_defaults(func=run_goodput)
    return bench


def build_parser() -> argparse.ArgumentParser:
    """Stand-alone parser: ``bench serve|goodput ...``."""
    parser = argparse.ArgumentParser(prog="tokenmill")
    sub = parser.add_subparsers(dest="command", metavar="bench")
    sub.required = True
    add_bench_subparsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``serve`` or ``goodput``; returns the exit status.

    ``argv`` (without the program name) may start with ``bench``
    (``bench serve ...``) or directly with the sub-command (``serve ...``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        argv = ["bench", *argv]
    args = build_parser().parse_args(argv)
    return args.func(args)


# ------------------------------------------------------------------ running ---

def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")


def _base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    if args.host or args.port:
        return f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    return DEFAULT_BASE_URL


def _prepare(args: argparse.Namespace) -> tuple[EndpointConfig, list[SampleRequest], Any, dict[str, Any]]:
    """Resolve target, tokenizer and workload; returns (endpoint, samples, tokenizer, metadata)."""
    from tokenmill.bench.loadgen import fetch_models

    base_url = _base_url(args)
    endpoint = normalize_endpoint(args.backend or args.endpoint)
    model = args.model
    if not model:
        models = asyncio.run(fetch_models(base_url, args.api_key))
        if not models:
            raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
        model = models[0]
        logger.info("model: %s (first id from /v1/models)", model)
    tok_path = resolve_tokenizer_path(args.tokenizer, model)
    logger.info("tokenizer: %s", tok_path)
    tokenizer = get_tokenizer(str(tok_path))
    samples = build_dataset(args.dataset, tokenizer, args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, range_ratio=args.range_ratio,
                            prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                            dataset_path=args.dataset_path, multi_turn=args.multi_turn, seed=args.seed)
    cfg = EndpointConfig(base_url=base_url, endpoint=endpoint, model=model, api_key=args.api_key,
                         ignore_eos=args.ignore_eos, temperature=args.temperature,
                         extra_body=dict(args.extra_body or {}), timeout_s=args.request_timeout)
    meta: dict[str, Any] = {
        "endpoint_type": VLLM_BACKEND_NAMES[endpoint],
        "backend": VLLM_BACKEND_NAMES[endpoint],
        "endpoint": cfg.url.removeprefix(base_url),
        "label": args.label,
        "base_url": base_url,
        "model_id": model,
        "tokenizer_id": str(tok_path),
        "dataset_name": args.dataset,
        "num_prompts": sum(s.num_requests for s in samples),
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "percentiles": args.metric_percentiles,
    }
    for kv in args.metadata or []:
        k, _, v = kv.partition("=")
        meta[k] = v
    return cfg, samples, tokenizer, meta


def _result_path(args: argparse.Namespace, meta: dict[str, Any], rate: float, kind: str) -> Path | None:
    if args.save_result is None and args.result_filename is None:
        return None
    if args.save_result:
        return Path(args.save_result)
    if args.result_filename:
        return Path(args.result_dir) / args.result_filename
    rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
    model = Path(str(meta["model_id"])).name.replace("/", "_")
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = (f"{meta['backend']}-{rate_s}qps{conc}-{model}-{meta['date']}.json" if kind == "serve"
            else f"goodput-{meta['backend']}-{model}-{meta['date']}.json")
    return Path(args.result_dir) / name


def run_serve(args: argparse.Namespace) -> int:
    """``tokenmill bench serve``: one run; prints the table; saves JSON/plot. Returns 0."""
    from tokenmill.bench.loadgen import LoadConfig, run_benchmark

    _setup_logging()
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        cfg, samples, tokenizer, meta = _prepare(args)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    load = LoadConfig(request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, seed=args.seed, num_warmups=args.num_warmups,
                      disable_tqdm=args.disable_tqdm, percentiles=args.metric_percentiles, goodput=slos)
    dist = "Poisson process" if args.burstiness == 1.0 else f"gamma, shape {args.burstiness:g}"
    print(f"Traffic request rate: {args.request_rate:g} req/s ({dist}); "
          f"max concurrency: {args.max_concurrency}; {meta['num_prompts']} requests to {cfg.url}")
    res = asyncio.run(run_benchmark(samples, cfg, load, tokenizer))
    print(format_table(res.metrics, res.records, request_rate=args.request_rate,
                       max_concurrency=args.max_concurrency, selected_metrics=args.percentile_metrics))
    meta["date"] = res.date
    meta["request_rate"] = args.request_rate
    path = _result_path(args, meta, args.request_rate, "serve")
    if path is not None:
        save_json(path, result_json(res.metrics, res.records, res.t0, meta))
        print(f"Saved results to {path}")
    if args.plot:
        title = f"{meta['model_id']} · {args.dataset} · rate {args.request_rate:g} req/s"
        plot_serve(res.records, res.t0, args.plot, slos, title)
        print(f"Saved plot to {args.plot}")
    return 0


def run_goodput(args: argparse.Namespace) -> int:
    """``tokenmill bench goodput``: the DistServe goodput search. Returns 0, or 2 on bad input."""
    from tokenmill.bench.loadgen import LoadConfig, run_benchmark

    _setup_logging()
    try:
        slos = parse_goodput(args.goodput)
        if not slos:
            raise ValueError("bench goodput needs --goodput, e.g. --goodput ttft:1000 tpot:100")
        if not 0 < args.attainment <= 1:
            raise ValueError("--attainment must be in (0, 1]")
        cfg, samples, tokenizer, meta = _prepare(args)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    percentiles = sorted(set(args.metric_percentiles) | {99.0})
    dates: list[str] = []

    def probe(rate: float):
        load = LoadConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                          seed=args.seed, num_warmups=args.num_warmups if not dates else 0,
                          disable_tqdm=args.disable_tqdm, percentiles=percentiles, goodput=slos)
        print(f"--- probe at {rate:.4g} req/s ({meta['num_prompts']} requests)", flush=True)
        res = asyncio.run(run_benchmark(samples, cfg, load, tokenizer))
        dates.append(res.date)
        return probe_from_metrics(rate, json_safe(res.metrics.to_dict()))

    def report(p) -> None:
        print(f"    rate {p.request_rate:8.4g} req/s  attainment {100 * p.slo_attainment:6.2f}%  "
              f"p99 TTFT {p.p99_ttft_ms:9.2f} ms  p99 TPOT {p.p99_tpot_ms:8.2f} ms  "
              f"throughput {p.request_throughput:7.3f} req/s  failed {p.failed}  "
              f"{'PASS' if p.passed else 'miss'}", flush=True)

    result = search_goodput(probe, target=args.attainment, initial_rate=args.initial_rate,
                            precision=args.precision, max_rate=args.max_rate, min_rate=args.min_rate,
                            max_probes=args.max_probes, on_probe=report)
    curve = result.curve()
    print(format_goodput_curve(curve, result.goodput, args.attainment, slos, result.note))
    meta["date"] = dates[0] if dates else ""
    doc = dict(meta)
    doc.update({"goodput_config": slos, "target_attainment": args.attainment,
                "goodput_request_rate": result.goodput, "lowest_failing_rate": result.lowest_failing_rate,
                "search_note": result.note, "precision": args.precision, "curve": curve,
                "probes": [p.metrics for p in result.probes]})
    path = _result_path(args, meta, 0.0, "goodput")
    if path is not None:
        save_json(path, doc)
        print(f"Saved goodput curve to {path}")
    if args.plot:
        plot_goodput(curve, args.plot, target=args.attainment, answer_rate=result.goodput, slos_ms=slos,
                     title=f"{meta['model_id']} · {args.dataset} · goodput {result.goodput:.3g} req/s")
        print(f"Saved plot to {args.plot}")
    return 0


def format_goodput_curve(curve: list[dict[str, Any]], goodput: float, target: float,
                         slos: dict[str, float], note: str) -> str:
    """The goodput search's printed summary: one row per probe, then the answer."""
    slo = " ".join(f"{k}:{v:g}" for k, v in slos.items())
    lines = [f"{' Goodput search (SLO ' + slo + ' ms, target ' + format(100 * target, 'g') + '%) ':=^96}",
             f"{'rate (req/s)':>12} {'attain (%)':>10} {'p99 TTFT (ms)':>14} {'p99 TPOT (ms)':>14} "
             f"{'req/s':>8} {'goodput':>8} {'out tok/s':>10} {'failed':>7} {'':>5}"]
    for c in curve:
        lines.append(f"{c['request_rate']:>12.4g} {100 * c['slo_attainment']:>10.2f} {c['p99_ttft_ms']:>14.2f} "
                     f"{c['p99_tpot_ms']:>14.2f} {c['request_throughput']:>8.3f} {c['request_goodput']:>8.3f} "
                     f"{c['output_throughput']:>10.2f} {c['failed']:>7d} {'PASS' if c['passed'] else 'miss':>5}")
    lines.append(f"Goodput: {goodput:.4g} req/s ({note})")
    lines.append("=" * 96)
    return "\n".join(lines)
