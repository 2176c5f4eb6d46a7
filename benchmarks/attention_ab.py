"""The batch-invariant CPU attention, this tree's kernel against another checkout's, side by side in one run.

Under ``--batch-invariant`` (the default) every query row runs the paged decode kernel over its own context:
a decode step's rows, and each token of a prompt or chunk (row ``j`` over ``j + 1`` positions). This times
``paged_decode_*`` over ``--layers`` layers (each its own cache pool, so decode K/V come from memory as in a
real step) for decode at ``--batch`` x ``--context`` and for one ``--prefill``-token prompt as decode rows
(the rows share one block table), with the library built from this tree's ``tokenmill/model/csrc`` and from
``--baseline-csrc`` (e.g. ``/work/main/tokenmill/model/csrc``), the two alternating per repetition; prints
best and median ms per step and whether the two produce the same bits.

    .venv/bin/python benchmarks/attention_ab.py --baseline-csrc /path/to/main/tokenmill/model/csrc
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill.model.layers import cpu_build, paged_attention_cpu as pac  # noqa: E402


def load(csrc: str, isa: str, tag: str):
    """The paged-attention library built from the C sources in ``csrc`` for variant ``isa``."""
    saved = cpu_build.CSRC_DIR
    cpu_build.CSRC_DIR = os.path.abspath(csrc)
    try:
        return cpu_build.load_library("paged_attention" + tag, ["paged_attention.c"], pac._FUNCTIONS,
                                      "TOKENMILL_CPU_ATTENTION_KERNEL", isa)
    finally:
        cpu_build.CSRC_DIR = saved


def decode(lib, q, kv, bt, sl, scale):
    """One ``paged_decode_<q>_<kv>`` call of ``lib``; returns the output."""
    sfx = pac._suffixes(q, kv)
    out = torch.empty_like(q)
    b, h, d = q.shape
    _, _, bs, kvh, _ = kv.shape
    getattr(lib, f"paged_decode_{sfx[0]}_{sfx[1]}")(
        q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), out.data_ptr(), bt.data_ptr(), bt.stride(0),
        sl.data_ptr(), b, h, kvh, d, bs, scale, 1.0, 1.0, torch.get_num_threads())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-csrc", required=True, help="another checkout's tokenmill/model/csrc")
    ap.add_argument("--isa", default=None, help="kernel variant (default: this CPU's best)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="query and KV cache dtype")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=257)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isa = args.isa or cpu_build.cpu_isa()
    dt = getattr(torch, args.dtype)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tokenmill", "model", "csrc")
    libs = {"baseline": load(args.baseline_csrc, isa, "_baseline"), "this tree": load(here, isa, "_this")}
    heads, kvh, d, bs = 9, 3, 64, 16
    print(f"{isa}, {args.dtype}, {args.threads} threads, {args.layers} layers, heads {heads}/{kvh} x {d}, "
          f"load average {os.getloadavg()[0]:.1f}")
    cases = [(f"decode B={args.batch} ctx {args.context}", [args.context] * args.batch, False),
             (f"prefill {args.prefill} as decode rows", list(range(1, args.prefill + 1)), True),
             (f"decode B=1 ctx {args.context}", [args.context], False)]
    for label, lens, shared_table in cases:
        nblk = -(-max(lens) // bs)
        rows = len(lens)
        if shared_table:        # one request's prompt: every row reads the same blocks
            kvs = [torch.randn(2, nblk + 1, bs, kvh, d).to(dt) for _ in range(args.layers)]
            bt = torch.arange(nblk, dtype=torch.int32).repeat(rows, 1).contiguous()
        else:
            kvs = [torch.randn(2, rows * nblk + 1, bs, kvh, d).to(dt) for _ in range(args.layers)]
            bt = torch.arange(rows * nblk, dtype=torch.int32).reshape(rows, -1).contiguous()
        sl = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(rows, heads, d).to(dt)
        outs = {k: decode(lib, q, kvs[0], bt, sl, d ** -0.5) for k, lib in libs.items()}
        same = torch.equal(outs["baseline"].view(torch.int16 if dt == torch.bfloat16 else torch.int32),
                           outs["this tree"].view(torch.int16 if dt == torch.bfloat16 else torch.int32))
        ts = {k: [] for k in libs}
        for _ in range(args.reps):
            for k, lib in libs.items():
                t0 = time.perf_counter()
                for kv in kvs:
                    decode(lib, q, kv, bt, sl, d ** -0.5)
                ts[k].append(time.perf_counter() - t0)
        cells = "  ".join(f"{k} {min(v) * 1e3:7.2f} ms (median {statistics.median(v) * 1e3:7.2f})"
                          for k, v in ts.items())
        print(f"{label:<30} {cells}  same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
