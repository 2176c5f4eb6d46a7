"""Ablation of ``TOKENMILL_HUGE_PAGES``: ordinary 4 KiB pages against transparent huge pages, side by side in one run.

Three measurements, each alternating the two arms round by round in one process (a shared VM's speed drifts
by 10-50% within minutes; alternating cancels the drift that separate runs would book to one arm):

1. **read bandwidth**: best sum over a ``--gib`` GiB float32 tensor from ``torch.ones`` against one from
   :func:`tokenmill.model.huge_pages.huge_page_tensor`;
2. **decode attention** (the CPU paged-attention kernel alone): ``--batch`` requests of ``--context`` tokens,
   ``--layers`` layers each with its own pool of ``--pool-blocks`` blocks (0: what the batch needs), the
   requests' blocks a seeded random sample of the pool (a long-running server's block tables), over a
   bfloat16 cache (the AVX2 low-bit path's default for a float32 model);
3. **decode steps**: two model runners of the packaged model (``TOKENMILL_HUGE_PAGES`` 0 and 1), each timing a decode step at B=1 and B=``--batch`` over the same scattered block tables.

Prints best and median per arm and the ratios (ordinary / huge: above 1 favours huge pages); ``--json`` keeps
every sample. docs/benchmarks/2026-12-03-huge-pages-avx2.md has a run.

    .venv/bin/python benchmarks/huge_pages_ab.py [--rounds 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from tokenmill import envs  # noqa: E402
from tokenmill.model import huge_pages  # noqa: E402


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _summary(plain: list[float], huge: list[float], unit: str = "ms", scale: float = 1e3) -> dict:
    p, h = sorted(plain), sorted(huge)
    m = len(p) // 2
    return {"plain_min": p[0] * scale, "plain_med": p[m] * scale, "huge_min": h[0] * scale, "huge_med": h[m] * scale,
            "ratio_min": p[0] / h[0], "ratio_med": p[m] / h[m], "unit": unit,
            "plain": [x * scale for x in plain], "huge": [x * scale for x in huge]}


def _print(name: str, s: dict) -> None:
    print(f"{name:<34} ordinary min {s['plain_min']:8.2f} med {s['plain_med']:8.2f} {s['unit']} | huge min "
          f"{s['huge_min']:8.2f} med {s['huge_med']:8.2f} | ordinary/huge min {s['ratio_min']:.3f} "
          f"med {s['ratio_med']:.3f}", flush=True)


def bandwidth(gib: float, rounds: int) -> dict:
    """Seconds per sum of a ``gib`` GiB tensor on each kind of page, alternating."""
    n = int(gib * 2**30) // 4
    arms = {"plain": torch.ones(n), "huge": huge_pages.huge_page_tensor((n,), torch.float32).fill_(1.0)}
    ts: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        for k, x in arms.items():
            t0 = time.perf_counter()
            x.sum()
            ts[k].append(time.perf_counter() - t0)
    s = _summary(ts["plain"], ts["huge"])
    s["plain_best_gb_s"], s["huge_best_gb_s"] = n * 4 / min(ts["plain"]) / 1e9, n * 4 / min(ts["huge"]) / 1e9
    return s


def attention(batch: int, context: int, layers: int, pool_blocks: int, rounds: int) -> dict:
    """Seconds per ``layers`` decode-attention calls over a scattered pool on each kind of page, alternating."""
    import attention_ab as ab
    from tokenmill.model.layers.cpu_build import cpu_isa
    lib = ab.load(os.path.join(os.path.dirname(__file__), "..", "tokenmill", "model", "csrc"), cpu_isa(), "_hugepages")
    heads, kvh, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    nb = -(-context // bs)
    nblocks = max(pool_blocks, batch * nb + 1)
    bt = torch.randperm(nblocks, generator=g)[:batch * nb].to(torch.int32).view(batch, nb)
    sl = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, d, generator=g)
    plain = [torch.empty(2, nblocks, bs, kvh, d, dtype=torch.bfloat16) for _ in range(layers)]
    huge = [huge_pages.huge_page_tensor((2, nblocks, bs, kvh, d), torch.bfloat16) for _ in range(layers)]
    for a, b in zip(plain, huge):
        a.copy_(torch.randn(a.shape, generator=g).to(torch.bfloat16))
        b.copy_(a)
    sc = d ** -0.5
    same = torch.equal(ab.decode(lib, q, plain[0], bt, sl, sc), ab.decode(lib, q, huge[0], bt, sl, sc))
    ts: dict[str, list[float]] = {"plain": [], "huge": []}
    for _ in range(rounds):
        for k, kvs in (("plain", plain), ("huge", huge)):
            t0 = time.perf_counter()
            for kv in kvs:
                ab.decode(lib, q, kv, bt, sl, sc)
            ts[k].append(time.perf_counter() - t0)
    s = _summary(ts["plain"], ts["huge"])
    s["same_bits"] = same
    s["pool_blocks"] = nblocks
    return s


def steps(batch: int, context: int, rounds: int) -> dict:
    """Seconds per decode step (B=1 and B=``batch``) of two runners, ordinary and huge pages, alternating."""
    import roofline as rl
    from tokenmill.config import EngineConfig
    from tokenmill.model.layers.linear import wait_for_packing
    from tokenmill.model.runner import ModelRunner
    runners = {}
    for name, flag in (("plain", "0"), ("huge", "1")):
        envs.set("TOKENMILL_HUGE_PAGES", flag)
        cfg = EngineConfig.from_kwargs(model=None, dtype="float32", max_model_len=1024, enforce_eager=True,
                                       max_num_seqs=batch, enable_prefix_caching=False)
        r = ModelRunner.from_config(cfg)
        wait_for_packing(r.model)
        rl.fill_kv_pool(r)
        order = torch.randperm(r.num_kv_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        runners[name] = (r, {f"B={batch}": (rl.synthetic_step(r, [1] * batch, [context] * batch, order=order), 3),
                             "B=1": (rl.synthetic_step(r, [1], [context], order=order), 10)})
    envs.unset("TOKENMILL_HUGE_PAGES")
    ts = {(n, k): [] for n in runners for k in runners["plain"][1]}
    for _ in range(rounds):
        for n, (r, cases) in runners.items():
            for k, (so, reps) in cases.items():
                r.execute_model(so)
                t0 = time.perf_counter()
                for _ in range(reps):
                    r.execute_model(so)
                ts[(n, k)].append((time.perf_counter() - t0) / reps)
    return {k: _summary(ts[("plain", k)], ts[("huge", k)]) | {"pool_blocks": runners["plain"][0].num_kv_blocks}
            for k in runners["plain"][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--pool-blocks", default="0,2912", help="comma list: attention pools per layer (0: the batch's)")
    ap.add_argument("--skip-steps", action="store_true", help="bandwidth and attention only")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not huge_pages.enabled():
        raise SystemExit("huge pages are off here (TOKENMILL_HUGE_PAGES=0, or no MADV_HUGEPAGE): nothing to compare")
    from tokenmill.model.process_tuning import configure_threads
    threads = configure_threads(torch.device("cpu"))
    print(f"torch {torch.__version__}, {threads} threads, {platform.processor() or platform.machine()}; "
          f"transparent huge pages: {_thp_mode()}")
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": threads,
                 "thp": _thp_mode(), "args": vars(args)}
    out["bandwidth"] = bandwidth(args.gib, args.rounds)
    _print(f"read {args.gib:g} GiB", out["bandwidth"])
    print(f"  best GB/s: ordinary {out['bandwidth']['plain_best_gb_s']:.1f}, huge {out['bandwidth']['huge_best_gb_s']:.1f}")
    out["attention"] = {}
    for pb in (int(x) for x in args.pool_blocks.split(",")):
        s = attention(args.batch, args.context + 1, args.layers, pb, args.rounds)
        out["attention"][str(pb)] = s
        _print(f"attention B={args.batch} x{args.layers} pool {s['pool_blocks']}", s)
        if not s["same_bits"]:
            print("  the two arms gave different bits (they must not)")
    if not args.skip_steps:
        out["steps"] = steps(args.batch, args.context, args.rounds)
        for k, s in out["steps"].items():
            _print(f"decode step {k} ctx {args.context}", s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
