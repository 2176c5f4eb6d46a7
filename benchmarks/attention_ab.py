"""The batch-invariant CPU attention, this tree's kernel against another checkout's, side by side in one run.

Under ``--batch-invariant`` (the default) every query row is computed with the paged decode kernel's
arithmetic over its own context: a decode step's rows, and each token of a prompt or chunk (row ``j`` over
``j + 1`` positions). This times, over ``--layers`` layers (each its own cache pool, so decode K/V come from
memory as in a real step), decode at ``--batch`` x ``--context``, one ``--prefill``-token prompt, and a
speculative-decoding verify step (``--verify`` requests of ``--verify-tokens`` tokens after ``--context``
cached ones), with the library built from this tree's ``tokenmill/model/csrc`` and from ``--baseline-csrc``
(e.g. ``/work/main/tokenmill/model/csrc``), the two alternating per repetition. A multi-token case runs
``paged_rows_*`` (several rows per request, one K/V read per tile) where the library has it, else
``paged_decode_*`` over one row per token with per-token block tables (main's way). Prints best and median
ms per step and whether the two produce the same bits.

``--block-layout`` places each request's blocks: ``contiguous`` (request after request, block after block:
what a fresh pool hands out) or ``scattered`` (a seeded random sample of a ``--pool-blocks`` pool, no order:
what a long-running server's block tables look like once finished requests have returned their blocks to
the free queue in arbitrary order); a comma list runs every case in each layout.

    .venv/bin/python benchmarks/attention_ab.py --baseline-csrc /path/to/main/tokenmill/model/csrc
"""

from __future__ import annotations

import argparse
import json
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
    with open(os.path.join(csrc, "paged_attention.c")) as f:   # an older tree may lack paged_rows_*
        has_rows = "paged_rows_" in f.read()
    funcs = {k: v for k, v in pac._FUNCTIONS.items() if has_rows or not k.startswith("paged_rows_")}
    try:
        return cpu_build.load_library("paged_attention" + tag, ["paged_attention.c"], funcs,
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


def rows(lib, q, kv, bt, q_len, seq_lens, scale):
    """One ``paged_rows_<q>_<kv>`` call of ``lib`` (``bt``: one row per request); returns the output."""
    sfx = pac._suffixes(q, kv)
    out = torch.empty_like(q)
    _, h, d = q.shape
    _, _, bs, kvh, _ = kv.shape
    q_start = (torch.cumsum(q_len, 0) - q_len).to(torch.int32)
    getattr(lib, f"paged_rows_{sfx[0]}_{sfx[1]}")(
        q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), out.data_ptr(), bt.data_ptr(), bt.stride(0),
        q_start.data_ptr(), q_len.data_ptr(), seq_lens.data_ptr(), q_len.shape[0], h, kvh, d, bs, scale, 1.0, 1.0,
        torch.get_num_threads())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-csrc", required=True, help="another checkout's tokenmill/model/csrc")
    ap.add_argument("--isa", default=None, help="kernel variant (default: this CPU's best)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="query and KV cache dtype")
    ap.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16"],
                    help="KV cache dtype (default: --dtype; float32 + bfloat16 is the AVX2 float32 default)")
    ap.add_argument("--verify", type=int, default=16, help="requests of the verify-step case")
    ap.add_argument("--verify-tokens", type=int, default=5, help="tokens per request (last + drafts)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=257)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--chunks", default="8x256", help="the mixed-chunk case: requests x new tokens per request")
    ap.add_argument("--chunk-prefix", type=int, default=0, help="cached tokens before each request's chunk")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the raw timings here")
    ap.add_argument("--only", default="", help="run only the cases whose label contains one of these comma-separated texts (e.g. prefill,chunks)")
    ap.add_argument("--block-layout", default="contiguous",
                    help="contiguous, scattered, or a comma list of both (each case runs in each layout)")
    ap.add_argument("--pool-blocks", type=int, default=0,
                    help="blocks per layer pool in the scattered layout (default: the engine's default pool, "
                         "1 GiB over the model's 30 layers, for this KV dtype)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isa = args.isa or cpu_build.cpu_isa()
    dt = getattr(torch, args.dtype)
    kdt = getattr(torch, args.kv_dtype or args.dtype)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tokenmill", "model", "csrc")
    libs = {"baseline": load(args.baseline_csrc, isa, "_baseline"), "this tree": load(here, isa, "_this")}
    heads, kvh, d, bs = 9, 3, 64, 16
    print(f"{isa}, {args.dtype} (KV {kdt}), {args.threads} threads, {args.layers} layers, heads {heads}/{kvh} x {d}, "
          f"load average {os.getloadavg()[0]:.1f}")
    vt = args.verify_tokens
    nc, ct = (int(x) for x in args.chunks.split("x"))
    # (label, per-request (new tokens, context after the step))
    cases = [(f"decode B={args.batch} ctx {args.context}", [(1, args.context)] * args.batch),
             (f"prefill {args.prefill}", [(args.prefill, args.prefill)]),
             (f"chunks {nc}x{ct} after {args.chunk_prefix}", [(ct, ct + args.chunk_prefix)] * nc),
             (f"verify {args.verify}x{vt} ctx {args.context}", [(vt, args.context + vt)] * args.verify),
             (f"decode B=1 ctx {args.context}", [(1, args.context)])]
    cases = [c for c in cases if any(o in c[0] for o in args.only.split(","))]
    layouts = args.block_layout.split(",")
    if any(lay not in ("contiguous", "scattered") for lay in layouts):
        raise SystemExit(f"--block-layout: contiguous or scattered, got {args.block_layout!r}")
    pool_default = (1 << 30) // (30 * 2 * kvh * d * torch.empty((), dtype=kdt).element_size() * bs)
    cases = [(f"{label} {lay}" if len(layouts) > 1 else label, reqs, lay) for label, reqs in cases for lay in layouts]
    results = []
    for label, reqs, layout in cases:
        nblks = [-(-sl // bs) for _, sl in reqs]
        pool = sum(nblks) + 1
        if layout == "scattered":
            pool = max(pool, args.pool_blocks or pool_default)
            ids = torch.randperm(pool, generator=torch.Generator().manual_seed(0))[:sum(nblks)].to(torch.int32)
        else:
            ids = torch.arange(sum(nblks), dtype=torch.int32)
        kvs = [torch.randn(2, pool, bs, kvh, d).to(kdt) for _ in range(args.layers)]
        bt = torch.zeros(len(reqs), max(nblks), dtype=torch.int32)
        first = 0
        for r, nb in enumerate(nblks):
            bt[r, :nb] = ids[first:first + nb]
            first += nb
        q_len = torch.tensor([n for n, _ in reqs], dtype=torch.int32)
        seq_lens = torch.tensor([sl for _, sl in reqs], dtype=torch.int32)
        # main's way: one decode row per token, token j of a request over sl - n + j + 1 positions
        row_bt = bt.repeat_interleave(q_len.long(), 0).contiguous()
        row_sl = torch.tensor([sl - n + j + 1 for n, sl in reqs for j in range(n)], dtype=torch.int32)
        q = torch.randn(int(q_len.sum()), heads, d).to(dt)
        scale = d ** -0.5

        def run(lib, kv):
            if max(n for n, _ in reqs) > 1 and hasattr(lib, f"paged_rows_{pac._suffixes(q, kv)[0]}_"
                                                            f"{pac._suffixes(q, kv)[1]}"):
                return rows(lib, q, kv, bt, q_len, seq_lens, scale)
            return decode(lib, q, kv, row_bt, row_sl, scale)

        outs = {k: run(lib, kvs[0]) for k, lib in libs.items()}
        iv = torch.int16 if dt == torch.bfloat16 else torch.int32
        same = torch.equal(outs["baseline"].view(iv), outs["this tree"].view(iv))
        ts = {k: [] for k in libs}
        for _ in range(args.reps):
            for k, lib in libs.items():
                t0 = time.perf_counter()
                for kv in kvs:
                    run(lib, kv)
                ts[k].append(time.perf_counter() - t0)
        cells = "  ".join(f"{k} {min(v) * 1e3:7.2f} ms (median {statistics.median(v) * 1e3:7.2f})"
                          for k, v in ts.items())
        ratio = statistics.median(ts["baseline"]) / statistics.median(ts["this tree"])
        print(f"{label:<26} {cells}  baseline/this {ratio:.2f}x  same bits: {same}", flush=True)
        results.append({"case": label, "block_layout": layout, "pool_blocks": pool, "same_bits": same,
                        **{f"{k}_ms": [round(x * 1e3, 3) for x in v] for k, v in ts.items()}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa, "dtype": args.dtype, "kv_dtype": str(kdt).replace("torch.", ""),
                       "threads": args.threads, "layers": args.layers, "heads": [heads, kvh, d],
                       "load_average": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
