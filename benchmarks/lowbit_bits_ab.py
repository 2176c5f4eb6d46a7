"""This tree's low-bit integer kernel against another checkout's build, bit for bit (every variant the CPU runs).

Random weights of several shapes (4/8-bit, with and without mins, groups 16/32/64, N up to 1100 with partial
tiles), M = 1..20, 31, 64, 65, 100, 130 and 512 rows (the many-row passes), float32 and bfloat16 activations and outputs, 1 and 2 threads,
the float32-scale entry point (``tm_lowbit_gemm_i8``) and the float16 one (``tm_lowbit_gemm_i8_h``, where the
scales are float16 numbers). Prints the number of comparisons and of differing ones per variant; exits 1 on
any difference. Not a timing: run it under ``/work/bin/shared``.

    python benchmarks/lowbit_bits_ab.py --baseline-csrc /work/main/tokenmill/model/csrc
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tokenmill.model.layers.cpu_build import isa_supported  # noqa: E402
from tokenmill.quantization.lowbit import LowBitWeight, load_kernel  # noqa: E402

# (bits, N, K, group, with_min)
SHAPES = [(4, 960, 576, 32, True), (4, 40, 192, 32, True), (8, 1100, 576, 32, False), (4, 1536, 576, 64, True),
          (8, 48, 256, 16, True), (4, 200, 1536, 32, False), (8, 33, 128, 32, True)]
ROWS = list(range(1, 21)) + [31, 64, 65, 100, 130, 512]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-csrc", required=True)
    ap.add_argument("--isas", default="avx2,scalar")
    args = ap.parse_args()
    from lowbit_gemm import load_baseline

    bad_total = 0
    for isa in args.isas.split(","):
        if not isa_supported(isa):
            print(f"{isa}: skipped (this CPU cannot run it)")
            continue
        new, old = load_kernel(isa), load_baseline(args.baseline_csrc, isa)
        n_cmp = n_bad = 0
        for si, (bits, n, k, group, with_min) in enumerate(SHAPES):
            g = torch.Generator().manual_seed(si)
            lo, hi = (0, 16) if bits == 4 else (-128, 128)
            scale = (torch.rand(n, k // group, generator=g) * 0.05).half().float()
            mn = (torch.randn(n, k // group, generator=g) * 0.1).half().float() if with_min else None
            w = LowBitWeight.from_codes(torch.randint(lo, hi, (n, k), generator=g), scale, mn, bits)
            assert w.prepare_i8(new)
            bias = torch.randn(n, generator=g) if si % 2 else None
            for m in ROWS:
                x32 = torch.randn(m, k, generator=g)
                for xd in (torch.float32, torch.bfloat16):
                    x = x32.to(xd)
                    for yd in (torch.float32, torch.bfloat16):
                        for threads in (1, 2):
                            torch.set_num_threads(threads)
                            for half in ((False, True) if w.scale_h is not None else (False,)):
                                ys = []
                                for lib in (new, old):
                                    y = torch.full((m, n), float("nan"), dtype=yd)
                                    fn, sc, mnp = ((lib.tm_lowbit_gemm_i8_h, w.scale_h, w.min_h) if half else
                                                   (lib.tm_lowbit_gemm_i8, w.scale, w.min))
                                    fn(x.data_ptr(), int(xd == torch.bfloat16), x.stride(0), m, k, n, bits,
                                       w.codes_i8.data_ptr(), w.group, sc.data_ptr(),
                                       None if mnp is None else mnp.data_ptr(),
                                       None if bias is None else bias.data_ptr(), y.data_ptr(),
                                       int(yd == torch.bfloat16), n)
                                    ys.append(y.view(torch.int16 if yd == torch.bfloat16 else torch.int32))
                                n_cmp += 1
                                n_bad += int(not torch.equal(ys[0], ys[1]))
        torch.set_num_threads(2)
        print(f"{isa}: {n_cmp} comparisons, {n_bad} with differing bits")
        bad_total += n_bad
    sys.exit(1 if bad_total else 0)


if __name__ == "__main__":
    main()
