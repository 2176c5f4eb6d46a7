"""benchmarks/roofline.py --block-layout: the block orders its synthetic steps hand out."""

from __future__ import annotations

from tests.bench.benchmark_module import load_benchmark

rl = load_benchmark("roofline")
sim = load_benchmark("kv_block_alloc_sim")


def _adjacent_share(order, n):
    head = order[:n]
    return sum(b - a == 1 for a, b in zip(head, head[1:])) / (n - 1)


def test_layouts_are_permutations_of_the_pool_and_differ_in_runs(monkeypatch):
    n = 2912
    assert rl.block_order("contiguous", n) is None
    scattered = rl.block_order("scattered", n)
    engine = rl.block_order("engine", n)
    monkeypatch.setenv("TOKENMILL_KV_BLOCK_RUNS", "0")
    engine_lru = rl.block_order("engine", n)
    for order in (scattered, engine, engine_lru):
        assert sorted(order) == list(range(n))
    # The 64 simulated tables hold over 1,000 blocks: the first 1,000 entries are what a B=64 step reads.
    assert _adjacent_share(scattered, 1000) < 0.01
    assert _adjacent_share(engine_lru, 1000) < 0.1
    assert _adjacent_share(engine, 1000) > 0.4
