"""How contiguous are a server's block tables, and what would other allocation policies give decode attention?

A closed-loop simulation on the engine's own :class:`tokenmill.core.block_pool.BlockPool` (no model): ``--concurrency``
requests run at once; each takes ``ceil(prompt / block_size)`` blocks, then grows by one token per step (a new block
every ``block_size`` tokens) until its output length, frees its blocks (in reverse, as the scheduler does) and is
replaced by a new one. Prompt and output lengths are uniform in ``--prompt`` / ``--output``. After ``--steps`` steps
it samples the running requests' block tables and reports the share of neighbouring entries that are adjacent
(``+1``: the next block id, ``-1``: the previous) and the mean run length in blocks.

Policies (only ``base`` is the engine's; the others are what-ifs, implemented here on the pool's public queue):

- ``base``: pop from the free queue's head (LRU), free in reverse (the engine today, vLLM's design);
- ``run``: a new block is the one after the request's (or this allocation's) last block when that one is free,
  else the queue's head; frees in reverse;
- ``run_fwd``: ``run``, and frees in forward order.

``--time``: decode attention (the CPU kernel, 30 layers, each its own pool on huge pages) over each policy's
sampled tables, alternating policies round by round; prints best / median ms and the ratio to ``base``.

    .venv/bin/python benchmarks/kv_block_alloc_sim.py [--time]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from tokenmill.core.block_pool import BlockPool  # noqa: E402

POLICIES = ("base", "run", "run_fwd")


def simulate(policy: str, num_blocks: int = 2912, concurrency: int = 64, block_size: int = 16, steps: int = 3000,
             seed: int = 0, prompt: tuple[int, int] = (200, 312), output: tuple[int, int] = (128, 256)
             ) -> list[list[list[int]]]:
    """Block tables (ids) of the running requests, sampled every 50 steps in the second half of the run."""
    rnd = random.Random(seed)
    pool = BlockPool(num_blocks, enable_caching=True)

    def take(block):                      # a free block out of queue order (what-if policies only)
        pool.free_queue.remove(block)
        pool._evict(block)
        block.ref_cnt = 1
        return block

    def one_block(after):
        if policy != "base" and after is not None and after + 1 < num_blocks and pool.blocks[after + 1].ref_cnt == 0:
            return take(pool.blocks[after + 1])
        return pool.get_new_blocks(1)[0]

    def new_request():
        p, o = rnd.randint(*prompt), rnd.randint(*output)
        n = -(-p // block_size)
        if policy == "base":
            blocks = pool.get_new_blocks(n)
        else:
            blocks = []
            while len(blocks) < n:
                blocks.append(one_block(blocks[-1].block_id if blocks else None))
        return [blocks, p, o]

    running = [new_request() for _ in range(concurrency)]
    samples = []
    for s in range(steps):
        for r in running:
            if r[1] % block_size == 0:
                r[0].append(one_block(r[0][-1].block_id))
            r[1] += 1
            r[2] -= 1
        for i, r in enumerate(running):
            if r[2] <= 0:
                pool.free_blocks(r[0] if policy == "run_fwd" else reversed(r[0]))
                running[i] = new_request()
        if s > steps // 2 and s % 50 == 0:
            samples.append([[b.block_id for b in r[0]] for r in running])
    return samples


def adjacency(samples: list[list[list[int]]]) -> dict:
    """Share of neighbouring table entries at +1 / -1 / other, and the mean run (ascending) in blocks."""
    c: collections.Counter = collections.Counter()
    runs = []
    for tables in samples:
        for t in tables:
            run = 1
            for a, b in zip(t, t[1:]):
                d = b - a
                c["+1" if d == 1 else "-1" if d == -1 else "other"] += 1
                if d == 1:
                    run += 1
                else:
                    runs.append(run)
                    run = 1
            runs.append(run)
    n = max(1, sum(c.values()))
    return {"+1": c["+1"] / n, "-1": c["-1"] / n, "other": c["other"] / n, "mean_run_blocks": sum(runs) / len(runs)}


def time_attention(tables_by_policy: dict, num_blocks: int, rounds: int) -> dict:
    """Best and median seconds of 30 layers' decode attention over each policy's tables (alternating)."""
    import torch
    import attention_ab as ab
    from tokenmill.model import huge_pages
    from tokenmill.model.layers.cpu_build import cpu_isa
    lib = ab.load(os.path.join(os.path.dirname(__file__), "..", "tokenmill", "model", "csrc"), cpu_isa(), "_allocsim")
    heads, kvh, d, bs, layers = 9, 3, 64, 16, 30
    g = torch.Generator().manual_seed(0)
    shape = (2, num_blocks + 1, bs, kvh, d)
    kvs = [huge_pages.huge_page_tensor(shape, torch.bfloat16) if huge_pages.enabled()
           else torch.empty(shape, dtype=torch.bfloat16) for _ in range(layers)]
    for kv in kvs:
        kv.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
    cases = {}
    for pol, tables in tables_by_policy.items():
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        cases[pol] = (bt, torch.tensor([len(t) * bs - 5 for t in tables], dtype=torch.int32))
    q = torch.randn(len(next(iter(tables_by_policy.values()))), heads, d, generator=g)
    ts: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, (bt, sl) in cases.items():
            t0 = time.perf_counter()
            for kv in kvs:
                ab.decode(lib, q, kv, bt, sl, d ** -0.5)
            ts[k].append(time.perf_counter() - t0)
    return {k: sorted(v) for k, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-blocks", type=int, default=2912, help="pool blocks (default: the engine's default pool here)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--prompt", default="200,312", help="min,max prompt tokens")
    ap.add_argument("--output", default="128,256", help="min,max output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="also time decode attention over each policy's tables")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    pr = tuple(int(x) for x in args.prompt.split(","))
    out = tuple(int(x) for x in args.output.split(","))
    last = {}
    for pol in POLICIES:
        samples = simulate(pol, args.num_blocks, args.concurrency, steps=args.steps, seed=args.seed, prompt=pr, output=out)
        a = adjacency(samples)
        last[pol] = samples[-1]
        print(f"{pol:<8} adjacent +1 {a['+1']:.1%}  -1 {a['-1']:.1%}  other {a['other']:.1%}  "
              f"mean run {a['mean_run_blocks']:.2f} blocks", flush=True)
    if args.time:
        ts = time_attention(last, args.num_blocks, args.rounds)
        b = ts["base"]
        for k, t in ts.items():
            m = len(t) // 2
            print(f"attention over {k:<8} best {t[0] * 1e3:.2f} med {t[m] * 1e3:.2f} ms  base/this best "
                  f"{b[0] / t[0]:.3f} med {b[m] / t[m]:.3f}")


if __name__ == "__main__":
    main()
