"""How contiguous are a server's block tables, and what would other allocation policies give decode attention?

A closed-loop simulation on the engine's own :class:`tokenmill.core.block_pool.BlockPool` (no model): ``--concurrency``
requests run at once; each takes ``ceil(prompt / block_size)`` blocks, then grows by one token per step (a new block
every ``block_size`` tokens) until its output length, frees its blocks (in reverse, as the scheduler does) and is
replaced by a new one. Prompt and output lengths are uniform in ``--prompt`` / ``--output``. After ``--steps`` steps
it samples the running requests' block tables and reports the share of neighbouring entries that are adjacent
(``+1``: the next block id, ``-1``: the previous) and the mean run length in blocks.

Policies:

- ``lru``: the engine with ``TOKENMILL_KV_BLOCK_RUNS=0``: strict LRU popping from the free queue's head, frees in
  reverse (vLLM's design);
- ``runs``: the engine's default (block runs): a request's next block is the one after its last when that one is
  free and old (uncached, or freed in the older half of the free queue's age span), else the head;
- ``run``, ``run_fwd`` (what-ifs, on the pool's queue directly): the next block whenever it is free, no age
  guard; ``run_fwd`` also frees in forward order (a request's prefix then leaves the cache first).

``lru`` and ``runs`` drive the real :class:`tokenmill.core.kv_cache_manager.KVCacheManager` with token ids, so
prefix caching acts as in the engine: with ``--prefixes N`` each prompt starts with one of N shared prefixes of
``--prefix-len`` tokens (Zipf, exponent ``--zipf``), and the prefix-cache hit rate of each policy is reported
(the age guard's purpose: block runs must not evict what LRU would keep).

``--time``: decode attention (the CPU kernel, 30 layers, each its own pool on huge pages) over each policy's
sampled tables, alternating policies round by round; prints best / median ms and the ratio to ``lru``.
``--time-steps``: whole decode steps (B=64, the packaged model, one runner and its own pool) over the ``lru`` and
``runs`` tables, alternating.

    .venv/bin/python benchmarks/kv_block_alloc_sim.py [--prefixes 100] [--time] [--time-steps]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from tokenmill.core.block_pool import BlockPool  # noqa: E402

POLICIES = ("lru", "runs", "run", "run_fwd")


def simulate(policy: str, num_blocks: int = 2912, concurrency: int = 64, block_size: int = 16, steps: int = 3000,
             seed: int = 0, prompt: tuple[int, int] = (200, 312), output: tuple[int, int] = (128, 256),
             prefixes: int = 0, prefix_len: int = 128, zipf: float = 1.1, stats: dict | None = None,
             old_fraction: float | None = None) -> list[list[list[int]]]:
    """Block tables (ids) of the running requests, sampled every 50 steps in the second half of the run.

    ``stats`` (optional dict) receives ``queries`` and ``hits`` (prompt tokens, from the second half) for the
    ``lru`` / ``runs`` policies; ``old_fraction`` overrides the pool's age guard (``runs``).
    """
    if policy in ("lru", "runs"):
        return _simulate_manager(policy == "runs", num_blocks, concurrency, block_size, steps, seed, prompt, output,
                                 prefixes, prefix_len, zipf, stats, old_fraction)
    rnd = random.Random(seed)
    pool = BlockPool(num_blocks, enable_caching=True, contiguous=False)

    def take(block):                      # a free block out of queue order (what-if policies only)
        pool.free_queue.remove(block)
        pool._evict(block)
        block.ref_cnt = 1
        return block

    def one_block(after):
        if after is not None and after + 1 < num_blocks and pool.blocks[after + 1].ref_cnt == 0:
            return take(pool.blocks[after + 1])
        return pool.get_new_blocks(1)[0]

    def new_request():
        p, o = rnd.randint(*prompt), rnd.randint(*output)
        n = -(-p // block_size)
        blocks: list = []
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


def _simulate_manager(contiguous, num_blocks, concurrency, block_size, steps, seed, prompt, output, prefixes,
                      prefix_len, zipf, stats, old_fraction=None):
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.request import Request
    from tokenmill.sampling_params import SamplingParams

    rnd = random.Random(seed)
    m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, contiguous=contiguous)
    if old_fraction is not None:
        m.block_pool.old_fraction = old_fraction
    shared = [[rnd.randrange(1, 49152) for _ in range(prefix_len)] for _ in range(prefixes)]
    weights = [1.0 / (k + 1) ** zipf for k in range(prefixes)]
    counter = [0]
    half = {"on": False, "queries": 0, "hits": 0}

    def new_request():
        p, o = rnd.randint(*prompt), rnd.randint(*output)
        head = rnd.choices(shared, weights)[0] if shared else []
        tokens = head[:p] + [rnd.randrange(1, 49152) for _ in range(max(0, p - len(head)))]
        counter[0] += 1
        r = Request(f"r{counter[0]}", tokens, SamplingParams(max_tokens=o))
        hit, n = m.get_computed_blocks(r)
        if m.allocate_slots(r, r.num_tokens - n, hit, n) is None:
            raise RuntimeError("pool too small for the concurrency: raise --num-blocks")
        r.num_computed_tokens = r.num_tokens
        m.cache_blocks(r)
        if half["on"]:
            half["queries"] += r.num_tokens
            half["hits"] += n
        return [r, o]

    running = [new_request() for _ in range(concurrency)]
    samples = []
    for s in range(steps):
        half["on"] = s > steps // 2
        for entry in running:
            r = entry[0]
            r.append_output_token_ids(rnd.randrange(1, 49152))
            if m.allocate_slots(r, 1) is None:
                raise RuntimeError("pool too small for the concurrency: raise --num-blocks")
            r.num_computed_tokens += 1
            m.cache_blocks(r)
            entry[1] -= 1
        for i, entry in enumerate(running):
            if entry[1] <= 0:
                m.free(entry[0])
                running[i] = new_request()
        if s > steps // 2 and s % 50 == 0:
            samples.append([list(m.get_block_ids(e[0].request_id)) for e in running])
    if stats is not None:
        stats.update(queries=half["queries"], hits=half["hits"])
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


def time_steps(policies: tuple[str, ...], rounds: int, seed: int, prompt, output, prefixes: int, prefix_len: int,
               zipf: float) -> dict:
    """Seconds per decode step of the packaged model over each policy's tables (one runner, alternating).

    The runner's own pool size is simulated; each sampled request decodes one token at its table's length.
    """
    import roofline as rl
    from tokenmill.config import EngineConfig
    from tokenmill.model.layers.linear import wait_for_packing
    from tokenmill.model.runner import ModelRunner
    cfg = EngineConfig.from_kwargs(model=None, dtype="float32", max_model_len=1024, enforce_eager=True,
                                   max_num_seqs=64, enable_prefix_caching=False)
    r = ModelRunner.from_config(cfg)
    wait_for_packing(r.model)
    rl.fill_kv_pool(r)
    bs = r.block_size
    cases = {}
    for pol in policies:
        tables = simulate(pol, r.num_kv_blocks, 64, bs, seed=seed, prompt=prompt, output=output, prefixes=prefixes,
                          prefix_len=prefix_len, zipf=zipf)[-1]
        order = [b for t in tables for b in t]
        cases[pol] = rl.synthetic_step(r, [1] * len(tables), [len(t) * bs - 5 for t in tables], order=order)
    ts: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, so in cases.items():
            r.execute_model(so)
            t0 = time.perf_counter()
            for _ in range(3):
                r.execute_model(so)
            ts[k].append((time.perf_counter() - t0) / 3)
    return {k: sorted(v) for k, v in ts.items()}


def _print_times(what: str, ts: dict) -> None:
    b = ts["lru"]
    for k, t in ts.items():
        m = len(t) // 2
        print(f"{what} over {k:<8} best {t[0] * 1e3:.2f} med {t[m] * 1e3:.2f} ms  lru/this best "
              f"{b[0] / t[0]:.3f} med {b[m] / t[m]:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-blocks", type=int, default=2912, help="pool blocks (default: the engine's default pool here)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--prompt", default="200,312", help="min,max prompt tokens")
    ap.add_argument("--output", default="128,256", help="min,max output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefixes", type=int, default=0, help="shared prompt prefixes (0: every prompt unique)")
    ap.add_argument("--prefix-len", type=int, default=128, help="tokens per shared prefix")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the prefixes' popularity")
    ap.add_argument("--time", action="store_true", help="also time decode attention over each policy's tables")
    ap.add_argument("--time-steps", action="store_true",
                    help="also time B=64 decode steps of the packaged model over the lru and runs tables")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", default="", help="also write every figure (and every timing sample) here")
    args = ap.parse_args()
    pr = tuple(int(x) for x in args.prompt.split(","))
    out = tuple(int(x) for x in args.output.split(","))
    last = {}
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "policies": {}}
    for pol in POLICIES:
        st: dict = {}
        samples = simulate(pol, args.num_blocks, args.concurrency, steps=args.steps, seed=args.seed, prompt=pr,
                           output=out, prefixes=args.prefixes, prefix_len=args.prefix_len, zipf=args.zipf, stats=st)
        a = adjacency(samples)
        last[pol] = samples[-1]
        result["policies"][pol] = a | st
        hits = f"  prefix hits {st['hits'] / max(1, st['queries']):.2%} of prompt tokens" if st else ""
        print(f"{pol:<8} adjacent +1 {a['+1']:.1%}  -1 {a['-1']:.1%}  other {a['other']:.1%}  "
              f"mean run {a['mean_run_blocks']:.2f} blocks{hits}", flush=True)
    if args.time:
        result["attention_s"] = time_attention(last, args.num_blocks, args.rounds)
        _print_times("attention", result["attention_s"])
    if args.time_steps:
        result["decode_step_b64_s"] = time_steps(("lru", "runs"), args.rounds, args.seed, pr, out, args.prefixes,
                                                 args.prefix_len, args.zipf)
        _print_times("decode step B=64", result["decode_step_b64_s"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
