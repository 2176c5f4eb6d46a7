"""benchmarks/kv_block_alloc_sim.py: block-table adjacency of the engine's allocator and of the what-if policies."""

from __future__ import annotations

from tests.bench.benchmark_module import load_benchmark

sim = load_benchmark("kv_block_alloc_sim")


def test_adjacency_counts_neighbours_and_runs():
    a = sim.adjacency([[[3, 4, 5, 9, 8, 20]]])
    assert a["+1"] == 2 / 5 and a["-1"] == 1 / 5 and a["other"] == 2 / 5
    assert a["mean_run_blocks"] == 6 / 4               # runs [3 4 5] [9] [8] [20]


def test_tables_hold_every_running_request_and_no_block_twice():
    for policy in sim.POLICIES:
        samples = sim.simulate(policy, num_blocks=600, concurrency=8, steps=400)
        assert samples and all(len(tables) == 8 for tables in samples)
        for tables in samples:
            ids = [b for t in tables for b in t]
            assert len(ids) == len(set(ids)) and all(0 <= b < 600 for b in ids)


def test_the_engine_scatters_tables_and_the_run_policies_keep_runs():
    base = sim.adjacency(sim.simulate("base", num_blocks=1200, concurrency=16, steps=1500))
    run = sim.adjacency(sim.simulate("run", num_blocks=1200, concurrency=16, steps=1500))
    fwd = sim.adjacency(sim.simulate("run_fwd", num_blocks=1200, concurrency=16, steps=1500))
    assert base["mean_run_blocks"] < 1.3 < run["mean_run_blocks"] < fwd["mean_run_blocks"]
