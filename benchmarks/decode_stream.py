"""Why a one-row decode step's weight GEMMs stream slower than a plain read: probes, side by side in one process.

A SmolLM2-135M decode step at one row calls the integer low-bit kernel 121 times (30 layers x fused q/k/v
576->960, o 576->576, fused gate/up 576->3072, down 1536->576, Q4_1 with float16 scales/mins, then the
576->49152 Q8_0 head): 0.2-1.1 MB per call and ~30 MB for the head, ~96 MB per step. Every arm below streams
those byte sizes from DRAM (30 distinct copies of each block weight, as in the model), in the step's order,
with 2 threads (``--threads``), arms interleaved per repetition, medians:

  read/call        plain read of each call's bytes, the GEMM's split (``omp for schedule(static)`` over its
                   16-row tiles), one parallel region (fork/join) per call
  read/call+pf     the same with a software prefetch 2 KB ahead (the kernel's one-row passes do this)
  read/1 region    one parallel region for the whole step, a barrier between calls (``omp for``)
  read/nowait      one region, no barrier (the ideal for independent calls)
  read/1 thread    per-call split with 1 thread
  read/one call    the step's bytes as one buffer, one call
  gemm             the real kernel (``tm_lowbit_gemm_i8_h``) on the same shapes, called from a Python loop
                   as the step graph does (ctypes, prepared arguments)
  gemm/hot         the same with one copy of each weight (cache-resident): the kernel's compute rate
  gemm fused       (when the library has ``tm_lowbit_gemm_i8_seq``) the layer's calls as one kernel call

Also: the cost of an empty parallel region and of a barrier, and of a ctypes call. Per-shape GB/s for the
gemm arms. ``--json F`` writes every figure.

    /work/bin/quiet .venv/bin/python benchmarks/decode_stream.py --reps 15 --json out.json
    # main's kernel beside this tree's: --baseline-csrc /work/main/tokenmill/model/csrc
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill.quantization.lowbit import LowBitWeight, load_kernel  # noqa: E402

# (name, K, N, bits) in a layer's call order, then the head
LAYER = [("qkv", 576, 960, 4), ("o", 576, 576, 4), ("gate/up", 576, 3072, 4), ("down", 1536, 576, 4)]
HEAD = ("head", 576, 49152, 8)


def build_probe() -> ctypes.CDLL:
    """Compile benchmarks/stream_probe.c (the kernels' avx2 flags) and load it (it shares torch's libgomp)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_probe.c")
    out = os.path.join(tempfile.mkdtemp(), "stream_probe.so")
    subprocess.run(["cc", "-O3", "-march=x86-64-v3", "-mtune=generic", "-fopenmp", "-fPIC", "-shared", src, "-o",
                    out], check=True)
    lib = ctypes.CDLL(out)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.probe_calls.argtypes = [P, P, P, I, I, I, I, P]
    lib.probe_calls.restype = ctypes.c_double
    lib.probe_forkjoin.argtypes = [I, I]
    lib.probe_forkjoin.restype = ctypes.c_double
    lib.probe_barrier.argtypes = [I, I]
    lib.probe_barrier.restype = ctypes.c_double
    return lib


def make_weight(k: int, n: int, bits: int, lib) -> LowBitWeight:
    """Random codes with float16 scales (and mins for 4-bit), as the GGUF's Q4_1 / Q8_0, integer layout."""
    if bits == 4:
        w = LowBitWeight.from_codes(torch.randint(0, 16, (n, k)), torch.rand(n, k // 32).half().float(),
                                    torch.randn(n, k // 32).half().float(), 4)
    else:
        w = LowBitWeight.from_codes(torch.randint(-127, 128, (n, k)), torch.rand(n, k // 32).half().float(),
                                    None, 8)
    assert w.prepare_i8(lib) and w.scale_h is not None
    w.codes, w.scale, w.min = w.codes_i8, None, None     # keep only what the integer path reads
    return w


def gemm_args(w: LowBitWeight, x: torch.Tensor, y: torch.Tensor) -> tuple:
    return (x.data_ptr(), 0, x.stride(0), 1, w.in_features, w.out_features, w.bits, w.codes_i8.data_ptr(), w.group,
            w.scale_h.data_ptr(), None if w.min_h is None else w.min_h.data_ptr(), None, y.data_ptr(), 0,
            w.out_features)


def model_step(args) -> None:
    """Whole decode steps (B=``--batch``, ``--context`` cached tokens) of the packaged model through the CPU step
    graph, its prepared calls in this tree's form (ctypes values made once, :meth:`CpuStepGraph._fast_calls`) and
    in the plain form (each call converting its Python ints through ``argtypes``, as before), and through the step
    executor (csrc/step_exec.c: the prepared calls run by one C loop, ``TOKENMILL_CPU_STEP_EXECUTOR``), the arms
    rotated per repetition in one process; each arm's final hidden states are compared bit for bit."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline import synthetic_step
    from tokenmill.config import EngineConfig
    from tokenmill.model.process_tuning import configure_threads
    from tokenmill.model.runner import ModelRunner
    from tokenmill.model.step_graph import CpuStepGraph

    threads = configure_threads(torch.device("cpu"))
    cfg = EngineConfig.from_kwargs(dtype="float32", num_kv_blocks=args.batch * (args.context // 16 + 2) + 8,
                                   max_model_len=1024, enforce_eager=True, max_num_seqs=max(args.batch, 8),
                                   enable_prefix_caching=False)
    runner = ModelRunner.from_config(cfg)
    from tokenmill.model.layers.linear import wait_for_packing
    wait_for_packing(runner.model)
    g = runner.step_graph
    assert isinstance(g, CpuStepGraph), "the step graph does not serve this model here"
    so = synthetic_step(runner, [1] * args.batch, [args.context] * args.batch)
    torch.manual_seed(0)
    for kv in runner.kv_caches:          # a context to attend over (the synthetic step never wrote one)
        kv.copy_(torch.randn(kv.shape) * 0.5)
    fast = CpuStepGraph._fast_calls
    ex = g._exec
    # name -> (call form, executor): "prepared calls" is the per-call path (TOKENMILL_CPU_STEP_EXECUTOR=0)
    forms = {"plain calls": (lambda calls: [(fn, a, fn) for fn, a in calls], None), "prepared calls": (fast, None)}
    if ex is not None:
        forms["executor"] = (fast, ex)
    tables, plans, finals = {}, {}, {}
    for name, (form, lib) in forms.items():
        g._calls.clear()
        g._plans.clear()
        g._fast_calls, g._exec = form, lib
        runner.execute_model(so)
        runner.execute_model(so)
        tables[name], plans[name] = dict(g._calls), dict(g._plans)
        finals[name] = g.final[:args.batch].clone()
    g._fast_calls = fast
    ref = finals["plain calls"]
    same = bool(ref.isfinite().all()) and all(torch.equal(ref.view(torch.int32), f.view(torch.int32))
                                              for f in finals.values())
    times = {k: [] for k in forms}
    a0 = _cpu_snap()
    for _ in range(args.reps):
        for name in forms:
            g._calls, g._plans, g._exec = tables[name], plans[name], forms[name][1]
            t0 = time.perf_counter()
            runner.execute_model(so)
            times[name].append(time.perf_counter() - t0)
    others = _cpu_others(a0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"decode B={args.batch} ctx {args.context}, float32, {threads} threads, step graph, medians of {args.reps} "
          f"(arms alternating); final hidden states bit-equal: {same}; other processes' CPU during the runs: "
          f"{others:.2f} s")
    for k, v in med.items():
        print(f"  {k:<16} {v * 1e3:7.2f} ms (min {min(times[k]) * 1e3:7.2f})")
    print(f"  plain / prepared: {med['plain calls'] / med['prepared calls']:.3f}x")
    if "executor" in med:
        print(f"  prepared / executor: {med['prepared calls'] / med['executor']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "context": args.context, "threads": threads, "bits_equal": same,
                       "other_cpu_s": others, "median_ms": {k: v * 1e3 for k, v in med.items()},
                       "all_ms": {k: [x * 1e3 for x in v] for k, v in times.items()}}, f, indent=1)


def _cpu_snap() -> tuple[int, int]:
    """(busy jiffies of the machine, of this process) from /proc."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    return sum(v[:3]) + sum(v[5:7]), int(st[11]) + int(st[12])


def _cpu_others(a: tuple[int, int]) -> float:
    """CPU-seconds other processes used since snapshot ``a`` (steal time excluded): a quiet run reads ~0."""
    b = _cpu_snap()
    return ((b[0] - a[0]) - (b[1] - a[1])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--baseline-csrc", default="", help="also time the kernel built from this csrc directory")
    ap.add_argument("--json", default="")
    ap.add_argument("--model-step", action="store_true", help="time whole step-graph decode steps instead")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    if args.model_step:
        model_step(args)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    probe = build_probe()
    libs = {"gemm": load_kernel("avx2")}
    if args.baseline_csrc:
        sys.path.insert(0, os.path.dirname(__file__))
        from lowbit_gemm import load_baseline
        libs["gemm main"] = load_baseline(args.baseline_csrc, "avx2")
    lib = libs["gemm"]
    # weights: 30 distinct copies per block shape (DRAM-streamed, as in the model) + the head
    layers = [[make_weight(k, n, b, lib) for _, k, n, b in LAYER] for _ in range(args.layers)]
    head = make_weight(HEAD[1], HEAD[2], HEAD[3], lib)
    seq = [(LAYER[j][0], w) for ws in layers for j, w in enumerate(ws)] + [("head", head)]
    hot = [(LAYER[j][0], w) for _ in range(args.layers) for j, w in enumerate(layers[0])]
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    ys = {n: torch.empty(1, n) for n in (960, 576, 3072, 49152)}
    step_bytes = sum(w.i8_stream_bytes for _, w in seq)
    # the plain-read arms: one buffer per call with the call's bytes (codes + scales + mins), its tiles
    bufs = [torch.randint(0, 255, (w.i8_stream_bytes,), dtype=torch.uint8) for _, w in seq]
    tiles = [(w.out_features + 15) // 16 for _, w in seq]
    n = len(bufs)
    ptrs = (ctypes.c_void_p * n)(*[b.data_ptr() for b in bufs])
    sizes = (ctypes.c_int64 * n)(*[b.numel() // t * t for b, t in zip(bufs, tiles)])
    tbytes = (ctypes.c_int64 * n)(*[b.numel() // t for b, t in zip(bufs, tiles)])
    one = torch.randint(0, 255, (step_bytes,), dtype=torch.uint8)
    one_ptr = (ctypes.c_void_p * 1)(one.data_ptr())
    one_size = (ctypes.c_int64 * 1)(step_bytes // 4096 * 4096)
    one_tile = (ctypes.c_int64 * 1)(4096)
    sink = ctypes.c_int64()

    def read(mode, pf=0, threads=args.threads):
        return lambda: probe.probe_calls(ptrs, sizes, tbytes, n, mode, pf, threads, ctypes.byref(sink))

    def gemm_seq(calls, timed=None):
        def run():
            t0 = time.perf_counter()
            for fn, a in calls:
                fn(*a)
            return time.perf_counter() - t0
        return run

    arms = {
        "read/call": read(0),
        "read/call+pf": read(0, 2048),
        "read/1 region": read(1),
        "read/nowait": read(2),
        "read/1 thread": read(0, 0, 1),
        "read/one call": lambda: probe.probe_calls(one_ptr, one_size, one_tile, 1, 0, 0, args.threads,
                                                   ctypes.byref(sink)),
    }
    per_call = {}
    for name, l in libs.items():
        f = l.tm_lowbit_gemm_i8_h
        calls = [(f, gemm_args(w, xs[w.in_features], ys[w.out_features])) for _, w in seq]
        arms[name] = gemm_seq(calls)
        arms[name + "/hot"] = gemm_seq([(f, gemm_args(w, xs[w.in_features], ys[w.out_features])) for _, w in hot])
        per_call[name] = calls
    times = {k: [] for k in arms}
    shape_t = {name: {s: [] for s in [x[0] for x in LAYER] + ["head"]} for name in libs}
    for f in arms.values():
        f()
    a0 = _cpu_snap()
    for _ in range(args.reps):
        for k, f in arms.items():
            times[k].append(f())
        for name, calls in per_call.items():     # per-shape: each call timed alone (adds ~0.1 us per call)
            acc = {s: 0.0 for s in shape_t[name]}
            for (s, _), (fn, a) in zip(seq, calls):
                t0 = time.perf_counter()
                fn(*a)
                acc[s] += time.perf_counter() - t0
            for s, v in acc.items():
                shape_t[name][s].append(v)
    others = _cpu_others(a0)
    med = lambda v: sorted(v)[len(v) // 2]
    hot_bytes = step_bytes - head.i8_stream_bytes
    res = {"threads": args.threads, "reps": args.reps, "step_bytes": step_bytes,
           "load_average_before": os.getloadavg(), "arms": {}, "per_shape": {}}
    print(f"threads {args.threads}, {n} calls, {step_bytes / 1e6:.1f} MB per step, medians of {args.reps}; "
          f"load average {os.getloadavg()[0]:.2f}; other processes' CPU during the runs {others:.2f} s")
    res["other_cpu_s"] = others
    for k, v in times.items():
        b = hot_bytes if k.endswith("/hot") else step_bytes
        m = med(v)
        res["arms"][k] = {"median_ms": m * 1e3, "min_ms": min(v) * 1e3, "GB_s": b / m / 1e9, "all_ms": [x * 1e3 for x in v]}
        print(f"  {k:<16} {m * 1e3:8.2f} ms (min {min(v) * 1e3:7.2f})  {b / m / 1e9:6.1f} GB/s")
    for name in libs:
        res["per_shape"][name] = {}
        for s, v in shape_t[name].items():
            b = sum(w.i8_stream_bytes for ss, w in seq if ss == s)
            cnt = sum(1 for ss, _ in seq if ss == s)
            m = med(v)
            res["per_shape"][name][s] = {"ms": m * 1e3, "us_per_call": m / cnt * 1e6, "bytes_per_call": b // cnt,
                                         "GB_s": b / m / 1e9}
            print(f"  {name:<10} {s:<8} {b // cnt / 1e3:8.0f} KB/call {m / cnt * 1e6:8.1f} us/call "
                  f"{b / m / 1e9:6.1f} GB/s")
    fj = med([probe.probe_forkjoin(2000, args.threads) for _ in range(5)])
    bar = med([probe.probe_barrier(2000, args.threads) for _ in range(5)])
    t0 = time.perf_counter()
    for _ in range(2000):
        probe.probe_calls(ptrs, sizes, tbytes, 0, 0, 0, args.threads, ctypes.byref(sink))
    ct = (time.perf_counter() - t0) / 2000
    res.update(forkjoin_us=fj * 1e6, barrier_us=bar * 1e6, ctypes_call_us=ct * 1e6,
               load_average_after=os.getloadavg())
    print(f"  empty parallel region {fj * 1e6:.2f} us, barrier {bar * 1e6:.2f} us, ctypes call (8 args) {ct * 1e6:.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
