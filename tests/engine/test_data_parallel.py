"""--data-parallel-size: N engine cores behind one API process (model-free executor)."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

from tests.server.fakes import CharTokenizer, make_crashing_executor, make_slow_fake_executor
from tokenmill.config import EngineConfig
from tokenmill.engine.dp_engine import DPAsyncEngine, cpu_shares, make_async_engine
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.sampling_params import SamplingParams


def test_cpu_shares():
    assert cpu_shares([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert cpu_shares([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert cpu_shares([0, 1], 3) == [[0], [1], [0]]
    with pytest.raises(ValueError):
        cpu_shares([], 2)


def test_config_and_factory():
    cfg = EngineConfig.from_kwargs(data_parallel_size=2)
    assert isinstance(make_async_engine(cfg, executor_factory=make_slow_fake_executor), DPAsyncEngine)
    assert isinstance(make_async_engine(EngineConfig()), AsyncEngine)
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs(data_parallel_size=0)


async def _run(engine, rid: str, n_tokens: int) -> list[int]:
    toks: list[int] = []
    async for out in engine.generate(rid, "abc", [3, 4, 5], SamplingParams(max_tokens=n_tokens, ignore_eos=True)):
        toks.extend(out.outputs[0].token_ids)
    return toks


async def test_two_cores_balance_pin_and_label_metrics():
    cfg = EngineConfig.from_kwargs(data_parallel_size=2, num_kv_blocks=64, max_model_len=256)
    cpus = sorted(os.sched_getaffinity(0))
    prom = PrometheusStatLogger("fake", 256)
    engine = DPAsyncEngine(cfg, CharTokenizer(), executor_factory=make_slow_fake_executor, stat_loggers=[prom],
                           start_timeout=120)
    try:
        info = engine.start()
        assert info.num_kv_blocks == 128 and info.max_model_len == 256
        for i, e in enumerate(engine.engines):
            assert psutil.Process(e.info.pid).cpu_affinity() == cpu_shares(cpus, 2)[i]
            if os.path.exists(f"/proc/{e.info.pid}/comm"):       # Linux: the core names itself (top, pgrep)
                with open(f"/proc/{e.info.pid}/comm") as f:
                    assert f.read().strip() == f"tokenmill-dp{i}"
        await engine.start_background()
        # four concurrent long requests: 4 x waiting + running sends them two and two
        outs = await asyncio.gather(*(_run(engine, f"r{i}", 12) for i in range(4)))
        assert all(len(o) == 12 for o in outs)
        assert engine.num_routed == [2, 2]
        # while one core is busy, a new request goes to the idle one
        busy = asyncio.ensure_future(_run(engine, "long", 40))
        await asyncio.sleep(0.5)
        first = engine._owner["long"]
        assert len(await _run(engine, "short", 2)) == 2
        assert engine.num_routed[1 - first] == 3
        await busy
        await asyncio.sleep(0.3)   # let the last stats arrive
        text = prom.render().decode()
        for i in (0, 1):
            line = [l for l in text.splitlines()
                    if l.startswith(f'tokenmill:generation_tokens_total{{engine="{i}",model_name="fake"}}')
                    or l.startswith(f'tokenmill:generation_tokens_total{{model_name="fake",engine="{i}"}}')]
            assert line and float(line[0].split()[-1]) > 0, text[:2000]
        assert engine.get_stats().num_kv_blocks == 128
    finally:
        engine.shutdown()
    assert all(not e._proc.is_alive() for e in engine.engines)


async def test_a_dead_core_fails_its_requests_and_the_engine_reports_it():
    cfg = EngineConfig.from_kwargs(data_parallel_size=2, num_kv_blocks=64, max_model_len=256)
    engine = DPAsyncEngine(cfg, CharTokenizer(), executor_factory=make_crashing_executor, start_timeout=120)
    try:
        engine.start()
        await engine.start_background()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_run(engine, "x", 4), 30)
        await asyncio.sleep(0.2)
        assert not engine.is_healthy and "data-parallel engine" in (engine.dead_reason or "")
        with pytest.raises(EngineDeadError):
            await _run(engine, "y", 4)
    finally:
        engine.shutdown()


async def test_a_killed_core_fails_the_requests_on_the_live_core_too():
    """The server stops serving when a core dies; requests on the other core get the error at once
    (a 503 / error event) instead of being cut off when the API process exits."""
    cfg = EngineConfig.from_kwargs(data_parallel_size=2, num_kv_blocks=64, max_model_len=256)
    engine = DPAsyncEngine(cfg, CharTokenizer(), executor_factory=make_slow_fake_executor, start_timeout=120)
    try:
        engine.start()
        await engine.start_background()
        runs = [asyncio.ensure_future(_run(engine, f"r{i}", 200)) for i in range(2)]
        for _ in range(100):
            if len(engine._owner) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(engine._owner.values()) == [0, 1]
        os.kill(engine.engines[0].info.pid, 9)
        results = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert all("exit code -9" in str(r) for r in results), results
        await asyncio.sleep(0.3)
        assert engine.engines[1]._proc.is_alive() and not engine.is_healthy
        inv = await engine.engines[1].check_invariants()     # the live core dropped the request, freed its blocks
        assert not inv["problems"] and inv["num_requests"] == 0, inv
        assert inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    finally:
        engine.shutdown()
    assert all(not e._proc.is_alive() for e in engine.engines)


def test_slo_view_is_the_core_the_request_would_run_on():
    """--slo under data parallelism predicts from the queue of the core the request goes to."""
    from tokenmill.metrics.stats import EngineStats

    class Core:
        def __init__(self, waiting, running, tag):
            self._w, self._stats, self.tag = waiting, EngineStats(num_running=running, num_steps=tag), tag

        def waiting_load(self):
            return self._w, 100 * self._w

        def get_stats(self):
            return self._stats

        def running_load(self):
            return self._stats.num_running

        def inflight_by_priority(self):
            return {0: (self.tag, 10 * self.tag)}

    dp = DPAsyncEngine.__new__(DPAsyncEngine)
    dp.engines = [Core(2, 1, 1), Core(0, 3, 2), Core(1, 0, 3)]   # scores 9, 3, 4
    assert dp.next_engine() == 1
    stats, inflight = dp.slo_view()
    assert stats.num_steps == 2 and inflight == {0: (2, 20)}
    assert dp.inflight_by_priority() == {0: (6, 60)}
