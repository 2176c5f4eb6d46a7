"""Bit-for-bit A/B of the integer low-bit GEMM: this tree's kernel against one built from another checkout.

A kernel change that only reorders the exact integer work must leave every output bit as it was (batch
invariance: docs/guide/batch_invariance.md). This builds ``lowbit_gemm.c`` from ``--baseline-csrc`` and from
this tree for each ``--isas`` variant (the project's flags, :mod:`tokenmill.model.layers.cpu_build`), runs
``tm_lowbit_gemm_i8`` (float32 scale/min arrays) and ``tm_lowbit_gemm_i8_h`` (float16 copies) of both on the
same random inputs and counts the calls whose outputs differ in any bit:

* weights: 4-bit with and without a min, 8-bit without (GGUF's Q4_1 / Q4_0 / Q8_0 at group 32), groups 16 and
  64, N not a multiple of 16, K up to 1536;
* rows M = 1-19, 31, 64, 65, 100, 130 and 512 (``--rows``), float32 and bfloat16 activations and outputs,
  with and without bias;
* 1 and 2 threads (``--threads``): with 2, N's tiles per thread decide between the driver's shared and
  thread-private quantisation, and the shapes include both.

Exit status 1 when any call differs. Usage::

    python benchmarks/lowbit_bits_ab.py --baseline-csrc /work/main/tokenmill/model/csrc --isas avx2,scalar
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill.model.layers.cpu_build import isa_supported  # noqa: E402
from tokenmill.quantization.lowbit import load_kernel  # noqa: E402

# (bits, group, with min, K, N)
SHAPES = [(4, 32, True, 576, 960), (4, 32, False, 576, 200), (8, 32, False, 576, 1100),
          (4, 32, True, 1536, 576), (4, 16, True, 256, 80), (4, 64, True, 512, 97), (8, 64, False, 256, 130)]
ROWS = "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,31,64,65,100,130,512"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def run(lib: ctypes.CDLL, entry: str, x: torch.Tensor, codes: torch.Tensor, bits: int, group: int, sc, mn,
        bias, n: int, y_dtype: torch.dtype) -> torch.Tensor:
    """One call of ``entry`` (``tm_lowbit_gemm_i8`` or ``_h``): y[M, n] for x[M, K] (float32 or bfloat16)."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=y_dtype)
    getattr(lib, entry)(_ptr(x), int(x.dtype == torch.bfloat16), k, m, k, n, bits, _ptr(codes), group, _ptr(sc),
                        _ptr(mn), _ptr(bias), _ptr(y), int(y_dtype == torch.bfloat16), n)
    return y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-csrc", required=True, help="another checkout's tokenmill/model/csrc")
    ap.add_argument("--isas", default="avx2,scalar")
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    from lowbit_gemm import load_baseline

    rows = [int(r) for r in args.rows.split(",")]
    total = differ = 0
    for isa in args.isas.split(","):
        if not isa_supported(isa):
            print(f"{isa}: skipped (this CPU cannot run it)")
            continue
        libs = {"this tree": load_kernel(isa), "baseline": load_baseline(args.baseline_csrc, isa)}
        gen = torch.Generator().manual_seed(0)
        n_isa = d_isa = 0
        for bits, group, with_min, k, n in SHAPES:
            q = (torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8) if bits == 4 else
                 torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).view(torch.uint8))
            tiles = (n + 15) // 16
            codes = torch.empty(tiles * 16 * k * bits // 8, dtype=torch.uint8)
            libs["this tree"].tm_lowbit_pack_i8(_ptr(q), n, k, bits, _ptr(codes))
            # scale / min in the [N/16][K/group][16] tile layout, float16 numbers (so _h gives the same bits)
            sc = (torch.rand(tiles, k // group, 16, generator=gen) * 0.02).half()
            mn = (torch.randn(tiles, k // group, 16, generator=gen) * 0.05).half() if with_min else None
            sc32, mn32 = sc.float().contiguous(), (mn.float().contiguous() if mn is not None else None)
            bias = torch.randn(n, generator=gen)
            for m in rows:
                x32 = torch.randn(m, k, generator=gen) * 3
                for x in (x32, x32.to(torch.bfloat16)):
                    for y_dtype in (torch.float32, torch.bfloat16):
                        for threads in (int(t) for t in args.threads.split(",")):
                            torch.set_num_threads(threads)
                            for entry, s_, m_ in (("tm_lowbit_gemm_i8", sc32, mn32),
                                                  ("tm_lowbit_gemm_i8_h", sc.view(torch.int16),
                                                   None if mn is None else mn.view(torch.int16))):
                                b = bias if (m + threads) % 2 else None
                                ys = [run(lib, entry, x, codes, bits, group, s_, m_, b, n, y_dtype)
                                      for lib in libs.values()]
                                n_isa += 1
                                if not torch.equal(ys[0].view(torch.int16 if y_dtype == torch.bfloat16 else
                                                              torch.int32),
                                                   ys[1].view(torch.int16 if y_dtype == torch.bfloat16 else
                                                              torch.int32)):
                                    d_isa += 1
                                    print(f"{isa}: DIFFERS bits {bits} group {group} min {with_min} K {k} N {n} "
                                          f"M {m} x {x.dtype} y {y_dtype} threads {threads} {entry}")
        print(f"{isa}: {n_isa} calls, {d_isa} with differing bits")
        total += n_isa
        differ += d_isa
    print(f"all: {total} calls, {differ} differing")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
