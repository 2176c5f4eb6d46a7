"""Where a small decode step's time goes, and what the CPU step graph buys (issue 11, concurrency 1).

Runs the packaged SmolLM2-135M GGUF (or ``--model``) in a :class:`ModelRunner`
and, for decode steps of ``--batches`` requests with ``--context`` cached
tokens each (greedy), reports side by side, arms interleaved round by round:

* ``graph``: the step with :class:`~tokenmill.model.step_graph.CpuStepGraph`
  (the default where it applies), and ``eager``: the same step through the
  eager forward (``TOKENMILL_CPU_STEP_GRAPH=0``'s path), each as the median of
  ``execute_model`` and its parts (input preparation, forward, LM head +
  sampling);
* ``C kernels``: the time spent inside the C kernels (low-bit GEMMs,
  attention, fused element-wise ops; every ctypes function wrapped with a
  timer in a separate pass), so ``forward + sample - C kernels - LM head
  torch ops`` is the Python / dispatch overhead the step still pays;
* the LM head alone, and the sampler after it;
* the engine loop around the runner at batch 1 (an in-process
  :class:`EngineCore`): scheduling and output update per step, what the
  engine-core process adds per step before sending (stats snapshot + pickling
  the outputs), and the API process's per-token CPU (output processing with
  incremental detokenisation), which runs in the other process.

With ``--server N``, also the whole serving path at concurrency 1: two
``tokenmill serve`` processes (step graph on / ``TOKENMILL_CPU_STEP_GRAPH=0``),
both up at once and idle in turn, get the same ``N`` seeded random prompts
(``--server-input-len`` words, ``--server-output-len`` tokens with
``ignore_eos``, streamed, greedy), alternating request by request. Reported per
arm: the client-side TPOT (median over requests), and the CPU time per output
token of the engine-core process, the API process (HTTP, SSE, detokenisation)
and this client, read from ``/proc``: on a 2-core machine the API process and
the client compete with the engine core's two threads.

Run it with the ISA settings of the machine you emulate, e.g. AVX2::

    TOKENMILL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/step_overhead.py --dtype float32
    .venv/bin/python benchmarks/step_overhead.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import fill_kv_pool, synthetic_step  # noqa: E402

from tokenmill import envs  # noqa: E402


def kernel_timers():
    """Wrap every ctypes function of the loaded kernel libraries with a timer.

    Returns:
        ``(acc, restore)``: ``acc`` maps ``library:function`` to accumulated
        seconds (and ``...#`` to calls); ``restore()`` unwraps them.
    """
    from tokenmill.model.layers import cpu_build

    acc: dict[str, float] = {}
    wrapped = []
    for (name, _isa), lib in list(cpu_build._libs.items()):
        if lib is None:
            continue
        for fname in list(vars(lib)):
            obj = getattr(lib, fname)
            if fname.startswith("_") or not hasattr(obj, "argtypes"):
                continue
            label = f"{name}:{fname}"

            def w(*a, _fn=obj, _l=label):
                t0 = time.perf_counter()
                _fn(*a)
                acc[_l] = acc.get(_l, 0.0) + time.perf_counter() - t0
                acc[_l + "#"] = acc.get(_l + "#", 0) + 1
            w.argtypes = obj.argtypes   # callers read the declared signature (lowbit_linear: float16-scale entry)
            setattr(lib, fname, w)
            wrapped.append((lib, fname, obj))
    # step graphs hold function objects: rebuild their prepared calls with the wrapped ones

    def restore() -> None:
        for lib, fname, obj in wrapped:
            setattr(lib, fname, obj)
    return acc, restore


def runner_arms(runner, so, rounds: int, reps: int) -> dict[str, dict[str, float]]:
    """Median seconds of the step and its parts for the graph and eager arms, interleaved."""
    graph = runner.step_graph
    rows: dict[str, list[dict[str, float]]] = {"graph": [], "eager": []}
    arms = ["graph", "eager"] if graph is not None else ["eager"]
    for _ in range(rounds):
        for arm in arms:
            runner.step_graph = graph if arm == "graph" else None
            runner.execute_model(so)
            for _ in range(reps):
                t0 = time.perf_counter()
                runner.execute_model(so)
                t = dict(runner.last_timings)
                t["step"] = time.perf_counter() - t0
                rows[arm].append(t)
    runner.step_graph = graph
    return {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in rows.items() if rs}


def kernel_time(runner, so, arm: str, reps: int) -> tuple[float, dict[str, float]]:
    """Median seconds inside C kernels per step for one arm, and the per-function split of that run."""
    from tokenmill.model import step_graph as sg

    graph = runner.step_graph
    runner.step_graph = graph if arm == "graph" else None
    acc, restore = kernel_timers()
    if runner.step_graph is not None:   # prepared calls hold the unwrapped functions: rebuild with the timers
        runner.step_graph = sg.CpuStepGraph(runner.model, runner.kv_caches, runner.lowbit_max_tokens,
                                            graph.max_tokens)
    try:
        runner.execute_model(so)
        totals, splits = [], []
        for _ in range(reps):
            acc.clear()
            runner.execute_model(so)
            totals.append(sum(v for k, v in acc.items() if not k.endswith("#")))
            splits.append(dict(acc))
    finally:
        restore()
        runner.step_graph = graph
    i = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    return totals[i], splits[i]


def head_and_sampler(runner, so, reps: int) -> tuple[float, float]:
    """Median seconds of the LM head (``compute_logits``) and of the sampler on its logits."""
    n = len(so.scheduled)
    hidden = torch.randn(n, runner.arch.hidden_size).to(runner.dtype)
    reqs = [r for r in so.scheduled if r.sample]
    th, ts = [], []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            logits = runner.model.compute_logits(hidden).float()
            t1 = time.perf_counter()
            runner.sampler(logits, reqs)
            t2 = time.perf_counter()
            th.append(t1 - t0)
            ts.append(t2 - t1)
    return statistics.median(th[1:]), statistics.median(ts[1:])


def engine_loop(runner, steps: int, prompt_len: int) -> dict[str, float]:
    """One request through an in-process EngineCore: mean seconds per decode step of each part.

    ``core_send``: what the engine-core process does per step besides ``step()`` (stats snapshot
    and pickling the outputs for the API process); ``api_process``: the API process's output
    processing (detokenisation, stop checks) of those outputs, measured here in-process.
    """
    from tokenmill.engine.core_proc import dumps
    from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.sampling_params import SamplingParams

    core = EngineCore(runner.config, executor=runner)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    tok = getattr(getattr(runner, "loaded", None), "tokenizer", None)
    op = OutputProcessor(tok) if tok is not None else None
    ids = torch.randint(3, runner.arch.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    core.add_request(EngineCoreRequest("e0", ids, params))
    if op is not None:
        op.add_request("e0", None, ids, params)
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
        core.step()
    core.step()
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = core.step()
        t1 = time.perf_counter()
        dumps(("outputs", outs, core.get_stats(), 1))
        t2 = time.perf_counter()
        if op is not None:
            op.process_outputs(outs)
        t3 = time.perf_counter()
        t = runner.last_timings
        rows.append({"step": t1 - t0, "runner": t["prepare"] + t["forward"] + t["sample"],
                     "schedule": core._last_schedule_time, "core_send": t2 - t1, "api_process": t3 - t2})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _start_server(arm: str, dtype: str, threads: int, log_dir: str):
    import socket
    import subprocess

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = dict(os.environ, TOKENMILL_CPU_STEP_GRAPH="1" if arm == "graph" else "0",
               TOKENMILL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    log = open(os.path.join(log_dir, f"server-{arm}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--dtype", dtype, "--host", "127.0.0.1",
                             "--port", str(port), "--max-num-seqs", "8"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def _wait_ready(url: str, proc, timeout: float = 600.0) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def _stream_one(client, url: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times (s) of the streamed chunks that carry text."""
    import json

    model = client.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    times = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0].get("text"):
                    times.append(time.perf_counter())
    return times


def server_arms(dtype: str, threads: int, n: int, input_len: int, output_len: int) -> dict[str, dict[str, float]]:
    """Concurrency 1 through two servers (graph / eager), requests alternating; see the module docstring."""
    import random
    import tempfile

    import httpx
    import psutil

    words = "the of and to in is was for on that with as by at from his her an it were are which this be".split()
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(words) for _ in range(input_len)) for _ in range(n)]
    log_dir = tempfile.mkdtemp(prefix="step_overhead_")
    servers = {}
    try:
        for arm in ("graph", "eager"):
            servers[arm] = _start_server(arm, dtype, threads, log_dir)
        for arm, (proc, url, _) in servers.items():
            _wait_ready(url, proc)
        procs = {}
        for arm, (proc, url, _) in servers.items():
            api = psutil.Process(proc.pid)
            kids = api.children(recursive=True)
            procs[arm] = (api, kids)
        me = psutil.Process()
        cpu = lambda p: sum(p.cpu_times()[:2])
        res = {arm: {"tpot": [], "core": 0.0, "api": 0.0, "client": 0.0, "tokens": 0} for arm in servers}
        with httpx.Client() as client:
            for arm, (_, url, _) in servers.items():        # warm-up
                _stream_one(client, url, prompts[0], 8)
            for prompt in prompts:
                for arm, (_, url, _) in servers.items():
                    api, kids = procs[arm]
                    c0, a0, m0 = sum(cpu(k) for k in kids), cpu(api), cpu(me)
                    ts = _stream_one(client, url, prompt, output_len)
                    r = res[arm]
                    r["core"] += sum(cpu(k) for k in kids) - c0
                    r["api"] += cpu(api) - a0
                    r["client"] += cpu(me) - m0
                    r["tokens"] += len(ts)
                    if len(ts) > 1:
                        r["tpot"].append((ts[-1] - ts[0]) / (len(ts) - 1))
        return {arm: {"tpot": statistics.median(r["tpot"]), "core": r["core"] / r["tokens"],
                      "api": r["api"] / r["tokens"], "client": r["client"] / r["tokens"]}
                for arm, r in res.items()}
    finally:
        for proc, _, log in servers.values():
            proc.terminate()
            try:
                proc.wait(60)
            except Exception:  # noqa: BLE001 - make sure it is gone
                proc.kill()
                proc.wait()
            log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: packaged SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the two arms")
    ap.add_argument("--reps", type=int, default=10, help="steps per arm per round")
    ap.add_argument("--engine-steps", type=int, default=40)
    ap.add_argument("--server", type=int, default=0, metavar="N",
                    help="also measure N concurrency-1 requests per arm through two servers (graph / eager)")
    ap.add_argument("--server-input-len", type=int, default=100, help="words per prompt (--server)")
    ap.add_argument("--server-output-len", type=int, default=64, help="output tokens per request (--server)")
    ap.add_argument("--server-only", action="store_true", help="skip the in-process measurements")
    args = ap.parse_args()
    if args.server_only:
        threads = envs.TOKENMILL_NUM_THREADS or len(os.sched_getaffinity(0))
        report_server(args, threads)
        return

    from tokenmill.config import EngineConfig
    from tokenmill.model.layers import cpu_build
    from tokenmill.model.layers.linear import wait_for_packing
    from tokenmill.model.process_tuning import configure_threads
    from tokenmill.model.runner import ModelRunner

    threads = configure_threads(torch.device("cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (-(-(args.context + args.engine_steps + 16) // 16)) + 64
    cfg = EngineConfig.from_kwargs(model=args.model, dtype=args.dtype, num_kv_blocks=blocks,
                                   max_model_len=max(1024, args.context + args.engine_steps + 64), enforce_eager=True,
                                   max_num_seqs=max(batches), enable_prefix_caching=False)
    runner = ModelRunner.from_config(cfg)
    wait_for_packing(runner.model)
    fill_kv_pool(runner)   # synthetic steps attend over unwritten positions: finite values, not garbage
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {threads} threads, kernels {cpu_build.cpu_isa()}, dtype {args.dtype}, "
          f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '-')}, "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}, low-bit steps <= "
          f"{runner.lowbit_max_tokens} tokens, step graph {'on' if runner.step_graph else 'off'}, "
          f"load average {load[0]:.1f}")
    print(f"\n{'batch':>5} {'arm':<6}{'step ms':>9}{'prepare':>9}{'forward':>9}{'sample':>9}{'C kernels':>11}"
          f"{'LM head':>9}{'sampler':>9}{'overhead':>10}{'x eager':>9}")
    for b in batches:
        so = synthetic_step(runner, [1] * b, [args.context] * b)
        arms = runner_arms(runner, so, args.rounds, args.reps)
        head, sampler = head_and_sampler(runner, so, args.reps)
        for arm, t in arms.items():
            kt, split = kernel_time(runner, so, arm, args.reps)
            overhead = t["step"] - kt - sampler
            print(f"{b:>5} {arm:<6}{t['step'] * 1e3:>9.2f}{t['prepare'] * 1e3:>9.2f}{t['forward'] * 1e3:>9.2f}"
                  f"{t['sample'] * 1e3:>9.2f}{kt * 1e3:>11.2f}{head * 1e3:>9.2f}{sampler * 1e3:>9.2f}"
                  f"{overhead * 1e3:>10.2f}{arms['eager']['step'] / t['step']:>8.2f}x")
            if arm == "eager" and b == batches[0]:
                parts = sorted(((k, v) for k, v in split.items() if not k.endswith("#")), key=lambda kv: -kv[1])
                print("      C kernels of the eager step: " + ", ".join(
                    f"{k.split(':')[1]} {v * 1e3:.2f} ms ({split[k + '#']})" for k, v in parts))
    print("  overhead = step - C kernels - sampler: Python, dispatch, allocation and torch ops around the kernels")

    br = engine_loop(runner, args.engine_steps, args.context)
    print(f"\nengine loop at batch 1 (in-process EngineCore, {args.engine_steps} decode steps, medians): "
          f"core.step {br['step'] * 1e3:.2f} ms = runner {br['runner'] * 1e3:.2f} ms + scheduler/update "
          f"{br['schedule'] * 1e3:.3f} ms + rest {(br['step'] - br['runner'] - br['schedule']) * 1e3:.3f} ms; "
          f"engine-core process per step before sending (stats + pickle) {br['core_send'] * 1e3:.3f} ms; "
          f"API process per token (output processing + detokenisation, the other process) "
          f"{br['api_process'] * 1e3:.3f} ms")
    if args.server:
        del runner
        report_server(args, threads)


def report_server(args, threads: int) -> None:
    res = server_arms(args.dtype, threads, args.server, args.server_input_len, args.server_output_len)
    print(f"\nserving at concurrency 1 ({args.server} requests per arm, alternating; {args.server_input_len}-word "
          f"prompts, {args.server_output_len} output tokens), load average {os.getloadavg()[0]:.1f}:")
    print(f"{'arm':<7}{'TPOT ms':>9}{'tok/s':>8}{'core CPU ms/tok':>17}{'API CPU ms/tok':>16}{'client CPU ms/tok':>19}")
    for arm, r in res.items():
        print(f"{arm:<7}{r['tpot'] * 1e3:>9.2f}{1 / r['tpot']:>8.1f}{r['core'] * 1e3:>17.2f}{r['api'] * 1e3:>16.2f}"
              f"{r['client'] * 1e3:>19.2f}")


if __name__ == "__main__":
    main()
