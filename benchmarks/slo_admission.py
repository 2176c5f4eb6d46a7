"""SLO-aware admission control against fixed caps and no admission control, same seeded overload.

Workload (seeded, identical for every server): ``--num-prompts`` requests with
mixed prompt lengths (``--long-share`` of them ~``--long-words`` words, the
rest ~``--short-words``, each ±50%), ``--output-len`` tokens with
``ignore_eos``, Poisson arrivals at ``--overload`` × the reference rate.

The reference rate is the DistServe goodput of the server without admission
control (the highest rate at which ``--attainment`` of requests meet the SLO,
``tokenmill bench goodput`` on the same workload), or ``--peak-rate`` when
given. Past it every added request makes others late; goodput (requests
meeting the SLO per second) peaks there.

Servers, each fresh, each loaded with the same arrivals:

* ``none``: no admission control (every request queues);
* ``caps``: ``--max-num-waiting-requests`` = reference rate × TTFT limit
  (Little's law: the queue that drains within the TTFT target), the fixed cap
  an operator would set;
* ``slo``: ``--slo ttft:MS tpot:MS`` (the predictor refuses requests predicted to miss, judged with the
  safety margins it learns from its own observed error);
* ``slo_raw``: the same without the learnt margins (``TOKENMILL_SLO_CALIBRATION=0``): the ablation.

Printed per server: goodput (requests meeting the SLO per second of the
run), share refused (HTTP 429), SLO attainment of the admitted requests,
p90/p99 TTFT of the admitted requests, p99 TPOT, and goodput relative to
``none``. Targets (issue 19): with ``--slo``, ≥ 90% of admitted requests meet
the SLO at 2× overload, and goodput ≥ 1.5× the uncapped server's.

    .venv/bin/python benchmarks/slo_admission.py --slo ttft:1500 tpot:150 --overload 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_engines import REPO, Server, free_port, load_average, thread_env  # noqa: E402
from long_prefill_threshold import WORDS, pct  # noqa: E402


def set_autogroup_nice(pid: int, nice: int | None) -> None:
    """Give the server's session (its own, ``start_new_session``) the scheduler weight of ``nice``.

    With ``kernel.sched_autogroup_enabled`` (Linux's default on desktops and on this project's machines)
    the CPU is shared fairly between *sessions*, and a process's nice value only ranks it within its
    own session: ``nice -n 19`` work of other sessions does not yield to a measurement. The autogroup's
    own nice value (``/proc/PID/autogroup``) is what ranks sessions. Needs root for values below 0.
    """
    if nice is None:
        return
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError as e:
        print(f"warning: could not set the server's autogroup nice to {nice}: {e}", flush=True)


def write_workload(path: Path, num_prompts: int, long_share: float, long_words: int, short_words: int,
                   output_len: int, seed: int) -> None:
    """The jsonl prompts file: mixed lengths, seeded."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num_prompts):
            base = long_words if rng.random() < long_share else short_words
            n = max(4, int(base * rng.uniform(0.5, 1.5)))
            words = " ".join(rng.choice(WORDS) for _ in range(n))
            f.write(json.dumps({"prompt": "Continue: " + words, "output_len": output_len}) + "\n")


def bench_cmd(base_url: str, workload: Path, args, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "bench", *extra, "--base-url", base_url,
            "--dataset", "jsonl", "--dataset-path", str(workload), "--seed", str(args.seed),
            "--ignore-eos", "--disable-tqdm", "--goodput", *args.slo]


def serve_cmd(port: int, args, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--dtype", args.dtype,
            "--max-num-seqs", str(args.max_num_seqs), *extra]


def find_reference_rate(args, workload: Path, out_dir: Path) -> float:
    port = free_port()
    server = Server("tokenmill-ref", serve_cmd(port, args, []), thread_env(args.threads), port,
                    out_dir / "server-ref.log")
    server.start(args.startup_timeout)
    set_autogroup_nice(server.proc.pid, args.autogroup_nice)
    result = out_dir / "goodput-ref.json"
    try:
        subprocess.run(bench_cmd(server.base_url, workload, args, ["goodput"])
                       + ["--num-prompts", str(args.search_prompts), "--initial-rate", str(args.initial_rate),
                          "--attainment", str(args.attainment), "--precision", "0.15", "--max-probes", "7",
                          "--num-warmups", "1", "--save-result", "--result-filename", str(result)],
                       check=True, cwd=str(REPO), stdout=subprocess.DEVNULL)
    finally:
        server.stop()
    return float(json.loads(result.read_text())["goodput_request_rate"])


def run_one(name: str, serve_extra: list[str], rate: float, args, workload: Path, out_dir: Path,
            env_extra: dict[str, str] | None = None) -> dict:
    port = free_port()
    server = Server(f"tokenmill-{name}", serve_cmd(port, args, serve_extra), {**thread_env(args.threads),
                                                                            **(env_extra or {})}, port,
                    out_dir / f"server-{name}.log")
    server.start(args.startup_timeout)
    set_autogroup_nice(server.proc.pid, args.autogroup_nice)
    result = out_dir / f"bench-{name}.json"
    try:
        subprocess.run(bench_cmd(server.base_url, workload, args, ["serve"])
                       + ["--num-prompts", str(args.num_prompts), "--request-rate", f"{rate:.4f}",
                          "--num-warmups", "2", "--save-result", "--result-filename", str(result)],
                       check=True, cwd=str(REPO), stdout=subprocess.DEVNULL)
        metrics = _scrape(server.base_url)
    finally:
        server.stop()
    res = json.loads(result.read_text())
    res["_metrics"] = metrics
    return res


def _scrape(base_url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return ""


def summarize(name: str, res: dict, slo_ms: dict[str, float]) -> dict:
    codes = res["status_codes"]
    ok = [i for i, s in enumerate(res["successes"]) if s]
    refused = sum(1 for c in codes if c == 429)
    ttft = [res["ttfts"][i] * 1e3 for i in ok]
    tpot = [res["tpots"][i] * 1e3 for i in ok]

    def good(i: int) -> bool:
        return (res["ttfts"][i] * 1e3 <= slo_ms.get("ttft", float("inf"))
                and res["tpots"][i] * 1e3 <= slo_ms.get("tpot", float("inf")))

    n_good = sum(1 for i in ok if good(i))
    miss_ttft = sum(1 for i in ok if res["ttfts"][i] * 1e3 > slo_ms.get("ttft", float("inf")))
    miss_tpot = sum(1 for i in ok if res["tpots"][i] * 1e3 > slo_ms.get("tpot", float("inf")))
    return {"name": name, "n": len(codes), "refused": refused, "admitted": len(ok), "good": n_good,
            "goodput": n_good / res["duration"], "duration": res["duration"],
            "attainment_admitted": n_good / len(ok) if ok else float("nan"),
            "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99), "tpot_p99": pct(tpot, 99),
            "other_failures": len(codes) - len(ok) - refused, "miss_ttft": miss_ttft, "miss_tpot": miss_tpot}


def prediction_error(metrics_text: str) -> str:
    """Mean absolute TTFT and TPOT prediction errors from the server's /metrics (histogram sum / count),
    and the TPOT decode-batch cap and margin factor at the end of the run."""
    vals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("tokenmill:") and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                vals[name] = float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass

    def mean_abs(kind: str, unit: float, fmt: str) -> str:
        s = vals.get(f"tokenmill:{kind}_prediction_abs_error_seconds_sum")
        c = vals.get(f"tokenmill:{kind}_prediction_abs_error_seconds_count")
        return f"{fmt.format(unit * s / c)} ms over {int(c)}" if s is not None and c else "n/a"

    out = f"mean |TTFT prediction error| {mean_abs('ttft', 1000, '{:.0f}')}, " \
          f"mean |TPOT prediction error| {mean_abs('tpot', 1000, '{:.1f}')}"
    if "tokenmill:slo_decode_batch_limit" in vals:
        out += f"; decode batch cap {vals['tokenmill:slo_decode_batch_limit']:.0f}"
    if "tokenmill:slo_tpot_margin_factor" in vals:
        out += f", TPOT margin factor {vals['tokenmill:slo_tpot_margin_factor']:.2f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slo", nargs="+", default=["ttft:1500", "tpot:150"], metavar="KEY:MS",
                    help="the SLO, for --slo and for goodput (default ttft:1500 tpot:150)")
    ap.add_argument("--peak-rate", type=float, default=None,
                    help="reference rate, req/s (default: measured with bench goodput on the uncapped server)")
    ap.add_argument("--overload", type=float, default=2.0, help="arrival rate as a multiple of the reference")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--search-prompts", type=int, default=50)
    ap.add_argument("--initial-rate", type=float, default=2.0)
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--long-words", type=int, default=500)
    ap.add_argument("--short-words", type=int, default=60)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--servers", default="none,caps,slo,slo_raw")
    ap.add_argument("--reference-only", action="store_true",
                    help="measure the reference rate, print it and stop (run the servers later with --peak-rate, "
                         "so each part fits a short measurement slot)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--autogroup-nice", type=int, default=None,
                    help="scheduler autogroup nice of each server's session (e.g. -10 on a shared machine where "
                         "other sessions' niced work would otherwise get an equal CPU share; see "
                         "set_autogroup_nice); run the script itself with the same (echo N > /proc/self/autogroup)")
    args = ap.parse_args()

    slo_ms = {k: float(v) for k, v in (item.split(":") for item in " ".join(args.slo).replace(",", " ").split())}
    out_dir = Path(tempfile.mkdtemp(prefix="slo-admission-"))
    workload = out_dir / "mixed.jsonl"
    write_workload(workload, args.num_prompts, args.long_share, args.long_words, args.short_words,
                   args.output_len, args.seed)
    print(f"workload: {args.num_prompts} requests, {args.long_share:.0%} ~{args.long_words} words, the rest "
          f"~{args.short_words} words, {args.output_len} output tokens; SLO {' '.join(args.slo)}; "
          f"load average {load_average():.2f}; files in {out_dir}", flush=True)
    ref = args.peak_rate if args.peak_rate else find_reference_rate(args, workload, out_dir)
    if args.reference_only:
        print(f"reference (goodput) rate {ref:.4g} req/s (load average {load_average():.2f})")
        return
    rate = args.overload * ref
    cap = max(1, round(ref * slo_ms.get("ttft", 1000.0) / 1000.0))
    print(f"reference (goodput) rate {ref:.3g} req/s{' (given)' if args.peak_rate else ' (measured)'}; "
          f"arrivals at {args.overload:g}x = {rate:.3g} req/s; caps server: --max-num-waiting-requests {cap}",
          flush=True)
    configs = {"none": [], "caps": ["--max-num-waiting-requests", str(cap)], "slo": ["--slo", *args.slo],
               "slo_raw": ["--slo", *args.slo]}
    envs = {"slo_raw": {"TOKENMILL_SLO_CALIBRATION": "0"}}
    rows = []
    for name in args.servers.split(","):
        res = run_one(name, configs[name], rate, args, workload, out_dir, envs.get(name))
        row = summarize(name, res, slo_ms)
        row["prediction"] = prediction_error(res["_metrics"]) if name.startswith("slo") else ""
        row["load_average"] = load_average()
        rows.append(row)
        print(f"  {name}: done ({row['duration']:.0f} s, load average {row['load_average']:.2f}; goodput "
              f"{row['goodput']:.3f} req/s, refused {row['refused']}/{row['n']}, admitted meeting SLO "
              f"{row['attainment_admitted']:.1%}; misses: TTFT {row['miss_ttft']}, TPOT {row['miss_tpot']})", flush=True)
    base = next((r for r in rows if r["name"] == "none"), rows[0])
    print(f"\n{'server':>6} {'goodput req/s':>13} {'vs none':>7} {'refused':>8} {'admitted meet SLO':>17} "
          f"{'TTFT p90/p99 ms':>17} {'TPOT p99 ms':>11} {'other fail':>10}")
    for r in rows:
        print(f"{r['name']:>6} {r['goodput']:>13.3f} {r['goodput'] / base['goodput'] if base['goodput'] else float('inf'):>6.2f}x "
              f"{r['refused'] / r['n']:>8.1%} {r['attainment_admitted']:>17.1%} "
              f"{r['ttft_p90']:>8.0f}/{r['ttft_p99']:>8.0f} {r['tpot_p99']:>11.1f} {r['other_failures']:>10}")
    for r in rows:
        if r["prediction"]:
            print(f"{r['name']}: {r['prediction']}")
    print(f"load average at the end {load_average():.2f}")
    (out_dir / "summary.json").write_text(json.dumps({"reference_rate": ref, "rate": rate, "cap": cap,
                                                      "slo_ms": slo_ms, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
