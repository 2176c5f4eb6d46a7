"""``tokenmill tune`` flags and entry point."""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
from pathlib import Path

from tokenmill.playbook.tune.report import format_markdown, write_report
from tokenmill.playbook.tune.search import tune
from tokenmill.playbook.tune.settings import LEVER_ORDER, TuneSettings
from tokenmill.server.cli_args import build_parser


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
