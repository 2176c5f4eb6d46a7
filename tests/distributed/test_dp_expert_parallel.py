"""Expert parallelism across data-parallel engine cores (``--data-parallel-size 2 --enable-expert-parallel``).

Two engine core processes, each with its own scheduler, KV pool and attention, each holding half of every
MoE layer's experts; tokens cross between the cores by all-to-all inside every MoE layer, and the cores
step in lockstep waves (an idle core runs dummy steps). Checked on the tiny random-weight Mixtral and
Qwen3-MoE in float32: the greedy tokens equal the one-process engine's (EP = 1), with one core busy and
the other idle, and with both busy; a dead or stuck core fails the other core's requests with an error
(never a hang); every process started is gone afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from tests.model.tiny_moe import save_tiny_moe
from tests.server.fakes import CharTokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.dp_engine import DPAsyncEngine

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True, max_model_len=128)
PROMPTS = [list(range(10, 26)) + [30, 31], list(range(40, 69)), [5, 6, 7], list(range(60, 80))]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> (checkpoint folder, greedy tokens of the one-process engine), computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            folder = save_tiny_moe(tmp_path_factory.mktemp(family), family, seed=3)
            with LLM(folder, **ENGINE) as llm:
                cache[family] = (folder, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)])
        return cache[family]
    return get


def _engine(folder: str, **kw) -> DPAsyncEngine:
    cfg = EngineConfig.from_kwargs(model=folder, data_parallel_size=2, enable_expert_parallel=True,
                                   **{**ENGINE, **kw})
    return DPAsyncEngine(cfg, CharTokenizer(), start_timeout=600)   # a contended CPU can delay a core minutes


async def _generate(engine: DPAsyncEngine, rid: str, prompt: list[int], params: SamplingParams = PARAMS) -> list[int]:
    toks: list[int] = []
    async for out in engine.generate(rid, None, prompt, params):
        if out.error:
            raise RuntimeError(out.error)
        toks.extend(out.outputs[0].token_ids)
    return toks


def _pids(engine: DPAsyncEngine) -> list[int]:
    return [e.info.pid for e in engine.engines if e.info is not None]


def _assert_gone(pids: list[int]) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:        # never leave a core behind, even when the assertion fails
        p.kill()
    assert not alive, f"engine core processes left running: {[p.pid for p in alive]}"


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
async def test_dp2_expert_parallel_matches_one_process(reference, family):
    folder, want = reference(family)
    engine = _engine(folder)
    pids: list[int] = []
    try:
        engine.start()
        pids = _pids(engine)
        assert "experts per rank 4 (physical slots 0-3 of 8, expert-parallel rank 0/2), redundant experts 0" \
            in engine.engines[0].info.parallel
        assert "physical slots 4-7 of 8, expert-parallel rank 1/2" in engine.engines[1].info.parallel
        await engine.start_background()
        # one request: core 0 runs it, core 1 has nothing and serves core 0's tokens with dummy steps
        assert await _generate(engine, "solo", PROMPTS[0]) == want[0]
        assert engine.num_routed == [1, 0]
        # all at once: both cores busy, batches of different sizes on each
        got = await asyncio.gather(*(_generate(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        assert got == want
        assert min(engine.num_routed) >= 1, engine.num_routed
        for e in engine.engines:            # no KV block leaked on either core
            assert (await e.check_invariants())["problems"] == []
    finally:
        engine.shutdown()
        _assert_gone(pids)


async def test_tp2_dp2_expert_parallel_matches_one_process(reference):
    """``-tp 2 --data-parallel-size 2 --enable-expert-parallel``: two engine cores with two ``mp`` workers each;
    the four workers form one expert-parallel world (2 slots each: experts sharded over the TP x DP group),
    attention stays tensor-parallel within each core. Greedy tokens equal the one-process engine's with one
    request (core 1's workers run dummy steps) and with four at once; no process is left behind."""
    folder, want = reference("mixtral")
    engine = _engine(folder, tensor_parallel_size=2)
    pids: list[int] = []
    try:
        engine.start()
        pids = _pids(engine)
        info = [e.info.parallel for e in engine.engines]
        assert "rank 0; experts per rank 2 (physical slots 0-1 of 8, expert-parallel rank 0/4)" in info[0], info
        assert "rank 1; experts per rank 2 (physical slots 2-3 of 8, expert-parallel rank 1/4)" in info[0], info
        assert "rank 0; experts per rank 2 (physical slots 4-5 of 8, expert-parallel rank 2/4)" in info[1], info
        assert "rank 1; experts per rank 2 (physical slots 6-7 of 8, expert-parallel rank 3/4)" in info[1], info
        pids += [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]
        assert len(pids) == 6, pids          # 2 cores + 2 x 2 workers
        await engine.start_background()
        assert await _generate(engine, "solo", PROMPTS[0]) == want[0]
        got = await asyncio.gather(*(_generate(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        assert got == want
        assert min(engine.num_routed) >= 1, engine.num_routed
        await asyncio.sleep(0.5)             # the stats sent when the wave ended
        stats = [e.get_stats().expert_parallel for e in engine.engines]
        assert stats[1]["dummy_steps"] > 0, stats     # core 1 served the solo request's experts
        assert all(s["all_to_all_seconds"] > 0 for s in stats), stats
        for e in engine.engines:
            assert (await e.check_invariants())["problems"] == []
    finally:
        engine.shutdown()
        _assert_gone(pids)


async def _wait_dead(engine: DPAsyncEngine, task: asyncio.Task, timeout: float) -> BaseException:
    t0 = time.monotonic()
    with pytest.raises((EngineDeadError, RuntimeError)) as info:
        await asyncio.wait_for(task, timeout)
    assert time.monotonic() - t0 < timeout
    return info.value


# "stop" once failed here and not as a script: the per-step sync ran on a sub-group created without a timeout
# (torch's default for gloo is 30 min), so a core waiting in the sync, not in an all-to-all, never timed out.
# Every group now gets TOKENMILL_DIST_TIMEOUT (tests/distributed/test_expert_parallel.py checks the groups).
@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_dead_or_stuck_core_fails_requests(reference, monkeypatch, how):
    """Core 1 killed (its sockets close: the peer's next collective fails at once) or stopped (SIGSTOP:
    the peer's collective times out after TOKENMILL_DIST_TIMEOUT s): core 0's request fails with an
    error, the engine reports itself unhealthy, and no process is left behind."""
    folder, _ = reference("mixtral")
    monkeypatch.setenv("TOKENMILL_DIST_TIMEOUT", "8")
    engine = _engine(folder)
    pids: list[int] = []
    try:
        engine.start()
        pids = _pids(engine)
        await engine.start_background()
        long = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
        first = asyncio.Event()

        async def run() -> None:
            async for out in engine.generate("long", None, PROMPTS[1], long):
                first.set()
                if out.error:
                    raise RuntimeError(out.error)

        task = asyncio.ensure_future(run())
        await asyncio.wait_for(first.wait(), 120)
        os.kill(pids[1], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        await _wait_dead(engine, task, 90)
        deadline = time.monotonic() + 30
        while engine.engines[0].is_healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not engine.is_healthy
        assert not engine.engines[0].is_healthy        # the surviving core left too: its collectives failed
    finally:
        if pids and how == "stop":
            try:
                os.kill(pids[1], signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown()
        _assert_gone(pids)


@pytest.mark.slow
async def test_tp2_dp2_dead_worker_fails_requests(reference):
    """``-tp 2 --data-parallel-size 2 --enable-expert-parallel``: a worker of core 1 killed mid-request ends
    core 1 (its executor sees the worker's socket close) and core 0 (its workers' next all-to-all with the dead
    worker fails): core 0's request fails with an error, never a hang, and no process is left behind."""
    folder, _ = reference("mixtral")
    engine = _engine(folder, tensor_parallel_size=2)
    pids: list[int] = []
    try:
        engine.start()
        pids = _pids(engine)
        workers1 = [c.pid for c in psutil.Process(pids[1]).children(recursive=True)]
        pids += [c.pid for c in psutil.Process(pids[0]).children(recursive=True)] + workers1
        assert len(pids) == 6, pids
        await engine.start_background()
        long = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
        first = asyncio.Event()

        async def run() -> None:
            async for out in engine.generate("long", None, PROMPTS[1], long):
                first.set()
                if out.error:
                    raise RuntimeError(out.error)

        task = asyncio.ensure_future(run())
        await asyncio.wait_for(first.wait(), 120)
        os.kill(workers1[1], signal.SIGKILL)
        await _wait_dead(engine, task, 90)
        deadline = time.monotonic() + 30      # core 1 first stops its other worker (up to 5 s), then exits
        while any(e.is_healthy for e in engine.engines) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not engine.engines[0].is_healthy and not engine.engines[1].is_healthy
    finally:
        engine.shutdown()
        _assert_gone(pids)


@pytest.mark.slow
async def test_dp2_expert_parallel_eplb_rebalances_without_changing_outputs(reference):
    """EPLB over the data-parallel expert group: per-expert loads of both cores are gathered (all-reduced)
    every 3 steps, the placement changes, weights move between the core processes (with 2 redundant
    slots: replicas), and the greedy tokens stay those of the one-process engine."""
    folder, want = reference("mixtral")
    engine = _engine(folder, enable_eplb=True,
                     eplb_config={"window_size": 3, "step_interval": 3, "num_redundant_experts": 2})
    pids: list[int] = []
    try:
        engine.start()
        pids = _pids(engine)
        assert "experts per rank 5 (physical slots 0-4 of 10, expert-parallel rank 0/2), redundant experts 2" \
            in engine.engines[0].info.parallel
        await engine.start_background()
        got = await asyncio.gather(*(_generate(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        assert got == want
        await asyncio.sleep(1.0)           # the stats sent when the wave ended
        stats = [e.get_stats() for e in engine.engines]
        for s in stats:
            assert s.eplb is not None and s.eplb.num_rebalances >= 2, s.eplb
            assert s.expert_parallel["steps"] >= s.num_steps > 0
        # both cores computed the same placement from the same all-reduced loads
        assert stats[0].eplb.num_placement_changes == stats[1].eplb.num_placement_changes >= 1
        assert stats[0].eplb.num_experts_moved == stats[1].eplb.num_experts_moved
    finally:
        engine.shutdown()
        _assert_gone(pids)


@pytest.mark.slow
async def test_tp2_dp2_eplb_rebalances_without_changing_outputs(reference):
    """EPLB over the TP x DP expert group (4 workers in 2 engine cores, 2 redundant slots): the loads of all
    four workers are all-reduced, weights move between workers of different cores, and the greedy tokens stay
    the one-process engine's."""
    folder, want = reference("mixtral")
    engine = _engine(folder, tensor_parallel_size=2, enable_eplb=True,
                     eplb_config={"window_size": 3, "step_interval": 3, "num_redundant_experts": 4})
    pids: list[int] = []
    try:
        engine.start()
        pids = _pids(engine)
        pids += [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]
        assert "physical slots 9-11 of 12, expert-parallel rank 3/4), redundant experts 4" \
            in engine.engines[1].info.parallel
        await engine.start_background()
        got = await asyncio.gather(*(_generate(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        assert got == want
        await asyncio.sleep(1.0)
        stats = [e.get_stats() for e in engine.engines]
        for s in stats:
            assert s.eplb is not None and s.eplb.num_rebalances >= 2, s.eplb
        assert stats[0].eplb.num_placement_changes == stats[1].eplb.num_placement_changes >= 1
        assert stats[0].eplb.num_experts_moved == stats[1].eplb.num_experts_moved > 0
    finally:
        engine.shutdown()
        _assert_gone(pids)


def test_refuses_what_is_not_built():
    """Pipeline parallelism and a Ray backend with experts shared over data-parallel cores are refused before
    any process starts, with the reason; ``-tp 2`` on ``mp`` is accepted."""
    from tokenmill.engine.executor.dp_ep import check_dp_expert_parallel

    def cfg(**kw):
        return EngineConfig.from_kwargs(model="unused", data_parallel_size=2, enable_expert_parallel=True, **kw)

    with pytest.raises(ValueError, match="--pipeline-parallel-size 1"):
        check_dp_expert_parallel(cfg(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="--distributed-executor-backend mp"):
        check_dp_expert_parallel(cfg(tensor_parallel_size=2, distributed_executor_backend="ray"))
    check_dp_expert_parallel(cfg(tensor_parallel_size=2))
    check_dp_expert_parallel(cfg())
