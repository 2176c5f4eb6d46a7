"""The step executor (csrc/step_exec.c, :class:`tokenmill.model.step_graph.ExecutorRun`): a prepared list of C
kernel calls run in one C loop makes the same calls as Python would, in the same order, none skipped.

Checked two ways: on chains of fused element-wise kernels whose result depends on every call and on their
order (each kernel variant this CPU runs, and the emulated avx512 one), and on a model's whole decode steps
(random Q4_1 weights, several steps so a skipped K/V write shows in the next step's attention), executor against
per-call, bit for bit."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tokenmill.model.layers import fused_cpu
from tokenmill.model.step_graph import ExecutorRun, executor_plan, load_executor

from ..kernel_variants import variants

pytestmark = pytest.mark.skipif(load_executor() is None or fused_cpu.load() is None,
                                reason="no C compiler for the CPU kernels")


def chain(lib, n: int = 96, rows: int = 3, seed: int = 0):
    """Buffers and a list of ``(fn, args)`` calls: alternating add+RMSNorm (residual in place), RoPE in place,
    SiLU-and-multiply, each reading the previous call's output, with per-call epsilons (float arguments)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    res = torch.randn(rows, n, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    hn = torch.zeros(rows, n)
    gu = torch.zeros(rows, n)
    act = torch.zeros(rows, n // 2)
    cos, sin = torch.rand(rows, 32, generator=g), torch.rand(rows, 32, generator=g)
    bufs = dict(x=x, res=res, w=w, hn=hn, gu=gu, act=act, cos=cos, sin=sin)
    p = lambda t: t.data_ptr()
    calls = []
    for k in range(6):
        eps = 1e-6 * (k + 1) + 1e-3 * k
        calls.append((lib.rms_norm_f32, (p(x), p(res), p(res), p(w), p(hn), rows, n, eps, 1)))
        calls.append((lib.rope_f32, (p(hn), rows, n, n // 32, 32, 32, p(cos), p(sin), 1)))
        calls.append((lib.rms_norm_f32, (p(hn), None, None, p(w), p(gu), rows, n, 1e-5, 1)))
        calls.append((lib.silu_mul_f32, (p(gu), p(act), rows, n // 2, 1)))
        calls.append((lib.rms_norm_f32, (p(act), None, None, p(w), p(x[:, : n // 2]), rows, n // 2, 1e-5, 1)))
    return bufs, calls


def run_python(calls) -> None:
    for fn, args in calls:
        fn(*args)


def bits(bufs: dict) -> dict:
    return {k: v.clone().view(torch.int32) for k, v in bufs.items()}


@pytest.mark.parametrize("isa", variants())
def test_executor_makes_the_calls_in_order_bit_for_bit(isa):
    ex = load_executor()
    lib = fused_cpu.load(isa)
    ref_bufs, ref_calls = chain(lib)
    run_python(ref_calls)
    got_bufs, got_calls = chain(lib)
    run = ExecutorRun(ex, got_calls)
    assert run.n == len(got_calls) == 30
    run()
    want, got = bits(ref_bufs), bits(got_bufs)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert ref_bufs["res"].isfinite().all() and not torch.equal(ref_bufs["res"], chain(lib)[0]["res"])

    # the comparison sees a reordered or a skipped call
    for altered in (lambda c: c[:7] + [c[8], c[7]] + c[9:], lambda c: c[:12] + c[13:]):
        b, c = chain(lib)
        ExecutorRun(ex, altered(c))()
        assert any(not torch.equal(want[k], v) for k, v in bits(b).items())


def test_plan_keeps_python_callables_in_place_and_groups_c_runs():
    ex = load_executor()
    lib = fused_cpu.load()
    bufs, calls = chain(lib)
    seen = []
    snap = lambda: seen.append(bufs["res"].clone())
    mixed = calls[:4] + [(snap, ())] + calls[4:9] + [(snap, ())] + calls[9:]
    plan = executor_plan(ex, mixed)
    assert [type(f) for f, _ in plan] == [ExecutorRun, type(snap), ExecutorRun, type(snap), ExecutorRun]
    assert [f.n for f, _ in plan if isinstance(f, ExecutorRun)] == [4, 5, len(calls) - 9]
    for fn, args in plan:
        fn(*args)
    ref, ref_calls = chain(lib)
    run_python(ref_calls[:4])
    assert torch.equal(seen[0], ref["res"])
    run_python(ref_calls[4:9])
    assert torch.equal(seen[1], ref["res"])
    run_python(ref_calls[9:])
    assert torch.equal(bufs["res"], ref["res"]) and torch.equal(bufs["x"], ref["x"])


def test_executor_refuses_what_it_cannot_call():
    ex = load_executor()
    lib = fused_cpu.load()
    assert ExecutorRun.signature(ex, len) == -1
    f = ctypes.CFUNCTYPE(None, ctypes.c_double)(lambda v: None)
    f.argtypes = [ctypes.c_double]
    assert ExecutorRun.signature(ex, f) == -1               # no such signature in the executor
    with pytest.raises(ValueError):
        ExecutorRun(ex, [(len, ())])
    # a corrupted table stops at the bad row and says so (nothing after it is called)
    bufs, calls = chain(lib)
    run = ExecutorRun(ex, calls)
    run.table[3, 1] = 99
    before = bufs["act"].clone()
    with pytest.raises(RuntimeError, match="call 3 of 30"):
        run()
    assert torch.equal(bufs["act"], before)                  # call 3 (the first SiLU) never ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_steps_with_the_executor_equal_the_per_call_steps(dtype, monkeypatch):
    """Whole decode steps of a model with random Q4_1 weights (steps of 1 and 3 requests, 4 steps each, the K/V
    written by one step read by the next): the executor's outputs equal the per-call path's bit for bit."""
    from .test_step_graph import BLOCK, build, needs_lowbit

    needs_lowbit(dtype)
    outs = {}
    for form in ("per_call", "executor"):
        runner, model, _ = build("qwen2", dtype, graph=True, monkeypatch=monkeypatch)
        g = runner.step_graph
        if form == "per_call":
            g._exec = None
        else:
            assert g._exec is not None
        gen = torch.Generator().manual_seed(1)
        for kv in g.kv_caches:
            kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
        res = []
        for m in (1, 3):
            bufs = [runner.buffers.to_device(k, m) for k in ("slot_mapping", "block_tables", "seq_lens")]
            slots, tables, lens = bufs
            for step in range(4):
                ids = torch.tensor([5 + step, 9, 17][:m])
                pos = torch.tensor([3 + step, 4 + step, 5 + step][:m])
                for r, p in enumerate(pos.tolist()):
                    tables[r].copy_(torch.arange(8 * r, 8 * r + tables.shape[1]).to(tables.dtype))
                    lens[r] = p + 1
                    slots[r] = (8 * r + p // BLOCK) * BLOCK + p % BLOCK
                res.append(g.run(ids, pos, *bufs).clone())
        if form == "executor":
            plans = list(g._plans.values())
            assert plans and all(len(p) == 1 and isinstance(p[0][0], ExecutorRun) for p in plans[:1])
        outs[form] = res
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert all(o.isfinite().all() for o in outs["per_call"])
    for a, b in zip(outs["per_call"], outs["executor"], strict=True):
        assert torch.equal(a.view(view), b.view(view))
