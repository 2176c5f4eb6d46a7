"""Kernel-only A/B of the integer low-bit GEMM: this tree's build against another checkout's, with an A/A arm.

Times ``tm_lowbit_gemm_i8_h`` (the model's entry point: int8 activations, float16 scales) called directly through
ctypes (no ``lowbit_linear`` wrapper, no output allocation per call) on the SmolLM2-135M weight shapes
(Q4_1-like 4-bit codes with mins for the block linears, Q8_0 codes for the 576 -> 49152 LM head) at the given
row counts. Three arms per shape, interleaved per repetition with their order rotated: ``base`` (the kernel
built from ``--baseline-csrc``), ``base again`` (the same library under a second name: the A/A arm, i.e. what
the harness itself reads between two identical arms) and ``tree`` (this checkout's kernel). Medians of
``--reps``; prints GMAC/s per arm, ``base / tree`` (> 1: the tree is faster) and ``base / base again``
(the A/A reading), and the sum over one step's GEMMs (each shape times its count per step). Each shape has one
weight copy (cache-warm after the first call, as in a step where the same weights come round every step they
stream from memory; the head's 28 MB do not fit the L3). Run it under ``/work/bin/quiet``.

    python benchmarks/lowbit_kernel_ab.py --baseline-csrc /tmp/base/tokenmill/model/csrc --rows 64 [--json F] [--peak]

``--peak`` first measures the instruction peak of the kernel's inner mix (benchmarks/peak_probe.c: 8 independent
chains of VPMADDUBSW + VPADDW for the 4-bit weights, VPSIGNB + VPMADDUBSW + VPMADDWD + VPADDD for the 8-bit head,
registers only) at 1 and ``--threads`` threads, and prints each arm's GMAC/s as a share of its mix's peak at
``--threads`` (the FBGEMM int8 rate is the other yardstick: benchmarks/roofline.py).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tokenmill.quantization.lowbit import LowBitWeight, load_kernel  # noqa: E402

# (name, K, N, count per step, bits)
SHAPES = [("Q4_1 576->960 (qkv)", 576, 960, 30, 4), ("Q4_1 576->576 (o)", 576, 576, 30, 4),
          ("Q4_1 576->3072 (gate/up)", 576, 3072, 30, 4), ("Q4_1 1536->576 (down)", 1536, 576, 30, 4),
          ("Q8_0 576->49152 (head)", 576, 49152, 1, 8)]


def instruction_peak(threads: int, iters: int = 20_000_000) -> dict:
    """GMAC/s of the inner instruction mixes (benchmarks/peak_probe.c, built with the kernels' avx2 flags) at 1 and
    ``threads`` threads: {"4": {1: gmacs, threads: gmacs}, "8": {...}}; one VPMADDUBSW = 32 int8 MACs."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak_probe.c")
    out = os.path.join(tempfile.mkdtemp(), "peak_probe.so")
    subprocess.run(["cc", "-O2", "-march=x86-64-v3", "-mtune=generic", "-fopenmp", "-fPIC", "-shared", src, "-o", out],
                   check=True)
    lib = ctypes.CDLL(out)
    lib.peak_probe.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    lib.peak_probe.restype = ctypes.c_double
    peak = {}
    for mix in (4, 8):
        peak[str(mix)] = {}
        for th in sorted({1, threads}):
            sec = lib.peak_probe(mix, iters, th)
            peak[str(mix)][th] = iters * 8 * 32 * th / sec / 1e9
            print(f"instruction peak, {mix}-bit mix, {th} thread(s): {peak[str(mix)][th]:.1f} GMAC/s "
                  f"({iters * 8 / sec / 1e9:.2f} VPMADDUBSW/ns per thread)", flush=True)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-csrc", required=True)
    ap.add_argument("--isa", default="avx2")
    ap.add_argument("--rows", default="64")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--peak", action="store_true", help="measure the inner mixes' instruction peak, print shares")
    args = ap.parse_args()
    from lowbit_gemm import load_baseline

    torch.set_num_threads(args.threads)
    tree, base = load_kernel(args.isa), load_baseline(args.baseline_csrc, args.isa)
    libs = {"base": base, "base again": base, "tree": tree}
    print(f"isa {args.isa}, threads {args.threads}, medians of {args.reps}; load average {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC")
    result = {"isa": args.isa, "threads": args.threads, "reps": args.reps, "rows": {}}
    peak = instruction_peak(args.threads) if args.peak else None
    if peak:
        result["instruction_peak_gmacs"] = peak
    for m in (int(r) for r in args.rows.split(",")):
        print(f"\nM={m}\n{'shape':<26}" + "".join(f"{k + ' GMAC/s':>18}" for k in libs)
              + f"{'base/tree':>11}{'A/A':>7}")
        tot = {k: 0.0 for k in libs}
        rows = {}
        for si, (name, k, n, count, bits) in enumerate(SHAPES):
            g = torch.Generator().manual_seed(si)
            lo, hi = (0, 16) if bits == 4 else (-127, 128)
            scale = (torch.rand(n, k // 32, generator=g) * 0.05).half().float()
            mn = (torch.randn(n, k // 32, generator=g) * 0.1).half().float() if bits == 4 else None
            w = LowBitWeight.from_codes(torch.randint(lo, hi, (n, k), generator=g), scale, mn, bits)
            assert w.prepare_i8(tree)
            x = torch.randn(m, k, generator=g)
            y = torch.empty(m, n)
            mh = None if w.min_h is None else w.min_h.data_ptr()

            def call(lib):
                lib.tm_lowbit_gemm_i8_h(x.data_ptr(), 0, k, m, k, n, bits, w.codes_i8.data_ptr(), 32,
                                        w.scale_h.data_ptr(), mh, None, y.data_ptr(), 0, n)

            names = list(libs)
            for key in names:
                call(libs[key])
            times = {key: [] for key in names}
            reps = args.reps if n < 49152 else max(5, args.reps // 3)
            for rep in range(reps):
                for key in names[rep % len(names):] + names[:rep % len(names)]:
                    t = time.perf_counter()
                    call(libs[key])
                    times[key].append(time.perf_counter() - t)
            med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
            for key in names:
                tot[key] += med[key] * count
            macs = m * k * n
            print(f"{name:<26}" + "".join(f"{macs / med[key] / 1e9:18.1f}" for key in names)
                  + f"{med['base'] / med['tree']:11.3f}{med['base'] / med['base again']:7.3f}", flush=True)
            rows[name] = {"count": count, "seconds": med, "gmacs": {key: macs / med[key] / 1e9 for key in names}}
            if peak:
                pk = peak[str(bits)][args.threads]
                rows[name]["share_of_peak"] = {key: macs / med[key] / 1e9 / pk for key in names}
                print(f"{'':<26}" + "".join(f"{macs / med[key] / 1e9 / pk * 100:17.1f}%" for key in names)
                      + f"   (share of the {bits}-bit mix's instruction peak, {pk:.0f} GMAC/s)", flush=True)
        print(f"{'all GEMMs of a step, ms':<26}" + "".join(f"{tot[key] * 1e3:18.2f}" for key in libs)
              + f"{tot['base'] / tot['tree']:11.3f}{tot['base'] / tot['base again']:7.3f}")
        result["rows"][m] = {"shapes": rows, "step_seconds": tot}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
