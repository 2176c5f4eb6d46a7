"""Grouped expert computation on CPU: one GEMM pair per active expert vs torch's grouped GEMM.

Arms, side by side in one process on the same sorted rows (the input of
:meth:`tokenmill.model.layers.moe.FusedMoE.run_experts`), interleaved per repeat:

* ``loop``: what tokenmill runs: per active expert ``F.linear`` (gate/up), SiLU-and-multiply, ``mm`` (down);
* ``grouped_mm``: ``torch._grouped_mm`` over all experts at once (weights pre-transposed ``[E, H, 2I]`` /
  ``[E, I, H]``, offsets = cumulative rows per expert), same activation in between;
* ``dense_all``: every token through every expert (what one GEMM per expert over all tokens would cost,
  the "no routing" upper bound some simple MoE code pays).

Prints median ms per call and the ratio to ``loop``. Usage::

    flock /work/bench.lock .venv/bin/python benchmarks/moe_experts.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="expert width")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,8,32,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenmill.model.layers import fused_cpu

    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
          f"H={args.hidden} I={args.inter} E={args.experts} k={args.top_k}")
    print("| dtype | tokens | active experts | loop ms | grouped_mm ms | dense_all ms | grouped/loop | dense/loop |")
    print("|---|---|---|---|---|---|---|---|")
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    for dname in args.dtypes.split(","):
        dt = getattr(torch, dname)
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(dt)
        w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(dt)
        w13t, w2t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()

        def act(z):
            return fused_cpu.silu_mul(z) if fused_cpu.usable(z) else F.silu(z[:, :i]) * z[:, i:]

        for t in [int(x) for x in args.tokens.split(",")]:
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).flatten()
            counts = torch.bincount(ids, minlength=e)
            order = torch.argsort(ids, stable=True)
            x = torch.randn(t, h, generator=g).to(dt)
            xs = x.index_select(0, order // k)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            cl = counts.tolist()

            def loop():
                out = torch.empty_like(xs)
                off = 0
                for s, c in enumerate(cl):
                    if c:
                        torch.mm(act(F.linear(xs[off:off + c], w13[s])), w2[s].t(), out=out[off:off + c])
                        off += c
                return out

            def grouped():
                return torch._grouped_mm(act(torch._grouped_mm(xs, w13t, offs=offs)), w2t, offs=offs)

            def dense_all():
                return torch.stack([F.linear(act(F.linear(x, w13[s])), w2[s]) for s in range(e)])

            torch.testing.assert_close(grouped().float(), loop().float(), atol=2e-2, rtol=2e-2)
            arms = {"loop": loop, "grouped": grouped, "dense": dense_all}
            times = {a: [] for a in arms}
            for _ in range(3):
                for fn in arms.values():
                    fn()
            for _ in range(args.repeats):
                for a, fn in arms.items():
                    t0 = time.perf_counter()
                    fn()
                    times[a].append((time.perf_counter() - t0) * 1e3)
            med = {a: statistics.median(v) for a, v in times.items()}
            print(f"| {dname} | {t} | {int((counts > 0).sum())} | {med['loop']:.3f} | {med['grouped']:.3f} | "
                  f"{med['dense']:.3f} | {med['grouped'] / med['loop']:.2f} | {med['dense'] / med['loop']:.2f} |")


if __name__ == "__main__":
    main()
