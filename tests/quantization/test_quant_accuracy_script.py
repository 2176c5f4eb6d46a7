"""benchmarks/quant_accuracy.py: step packing, metrics, results merging, and the packed driver on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("_bench_quant_accuracy", ROOT / "benchmarks" / "quant_accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


qa = _load()


def test_pack_steps_packs_and_chunks():
    steps = qa.pack_steps([5, 3, 10], 8)
    assert steps == [[(0, 0, 5), (1, 0, 3)], [(2, 0, 8)], [(2, 8, 10)]]
    # every token of every sequence exactly once, in order, no step over budget
    for lens, budget, seqs in (([1] * 7, 3, None), ([40, 1, 17, 2], 8, None), ([9, 9, 9], 100, 2)):
        steps = qa.pack_steps(lens, budget, seqs)
        fed = {i: 0 for i in range(len(lens))}
        for st in steps:
            assert sum(b - a for _, a, b in st) <= budget
            assert seqs is None or len(st) <= seqs
            for i, a, b in st:
                assert a == fed[i] and b > a
                fed[i] = b
        assert fed == dict(enumerate(lens))
    assert qa.pack_steps([9, 9, 9], 100, 2) == [[(0, 0, 9), (1, 0, 9)], [(2, 0, 9)]]
    with pytest.raises(ValueError):
        qa.pack_steps([3, 0], 8)
    with pytest.raises(ValueError):
        qa.pack_steps([3], 0)


def test_agreement_and_kl():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 11, generator=g)
    a = qa.Agreement()
    a.add(torch.log_softmax(ref, -1), ref.clone())
    assert a.top1 == 1.0 and a.kl == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(6, 11, generator=g)
    b = qa.Agreement()
    b.add(torch.log_softmax(ref, -1), other)
    p, q = torch.softmax(ref, -1), torch.softmax(other, -1)
    want = (p * (p.log() - q.log())).sum(-1).mean().item()
    assert b.kl == pytest.approx(want, rel=1e-5)
    assert b.top1 == pytest.approx((ref.argmax(-1) == other.argmax(-1)).float().mean().item())
    assert math.isnan(qa.Agreement().top1)


def test_greedy_agreement_and_threshold():
    assert qa.greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5   # counts up to the first difference
    assert qa.greedy_agreement([[1, 2], [5, 6]], [[1, 2], [0, 6]]) == 0.5
    ok = {"top1": 0.995, "kl": 0.001, "ppl_ratio": 1.004, "greedy": 0.95}
    assert qa.is_lossless(ok)
    for k, bad in (("top1", 0.98), ("kl", 0.02), ("ppl_ratio", 1.02), ("greedy", 0.5)):
        assert not qa.is_lossless({**ok, k: bad})


def test_rows_are_valid_engine_settings_and_serve_flags():
    for label, (kwargs, _env) in qa.ROWS.items():
        EngineConfig.from_kwargs(**kwargs)   # raises on a bad value
    assert qa.serve_argv({"dtype": "float32", "kv_cache_dtype": "fp8", "calculate_kv_scales": True}) == [
        "--dtype", "float32", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"]
    assert qa.serve_argv({"calculate_kv_scales": False}) == []


def test_results_merge_across_processes(tmp_path):
    path = str(tmp_path / "r.json")
    a = {"float32": {"format": "float32", "ppl": 1.0}}
    b = {"int8": {"format": "int8", "ppl": 2.0}}
    qa.save_results(path, a, ["float32"])
    qa.save_results(path, b, ["int8"])                  # another process: keeps float32
    rows = qa.load_results(path)
    assert set(rows) == {"float32", "int8"} and [r["format"] for r in json.loads(Path(path).read_text())] == [
        "float32", "int8"]
    assert set(b) == {"float32", "int8"}                 # the caller sees the merged rows


@pytest.fixture
def tiny_runner(tiny_checkpoint):
    from tokenmill.model.runner import ModelRunner

    path = tiny_checkpoint()
    cfg = EngineConfig.from_kwargs(model=path, dtype="float32", num_kv_blocks=64, block_size=16,
                                   max_model_len=256, max_num_seqs=16)
    return ModelRunner.from_config(cfg, with_tokenizer=False)


def test_packed_driver_matches_one_sequence_at_a_time(tiny_runner):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (7, 30, 2, 19)]
    held = torch.randint(3, 90, (25,), generator=g).tolist()
    out = {}
    for name, step_tokens, batch in (("packed", 2048, 80), ("small", 3, 1)):
        drv = qa.Driver(tiny_runner, step_tokens, batch)
        seqs = prompts + [held]
        tables = drv.tables([len(p) + 6 for p in prompts] + [len(held)])
        got: dict[int, torch.Tensor] = {}
        drv.teacher_force(seqs, tables, lambda i, lg: got.__setitem__(i, lg))
        assert sorted(got) == list(range(len(seqs))) and all(got[i].shape[0] == len(s) for i, s in enumerate(seqs))
        first = [int(got[i][-1].argmax()) for i in range(len(prompts))]
        out[name] = (got, drv.greedy(prompts, first, 6, tables))
    for i in range(len(prompts) + 1):
        torch.testing.assert_close(out["packed"][0][i], out["small"][0][i], rtol=1e-4, atol=1e-4)
    assert out["packed"][1] == out["small"][1] and all(len(c) == 6 for c in out["packed"][1])

    # evaluate(): the reference against itself is lossless
    res, ref = qa.evaluate(tiny_runner, prompts, held, 6, 2048, 80, None)
    assert ref is not None and len(ref.logprobs) == len(prompts) and res["ppl"] > 1
    res2, none = qa.evaluate(tiny_runner, prompts, held, 6, 3, 2, ref)
    assert none is None and res2["top1"] == 1.0 and res2["greedy"] == 1.0 and res2["kl"] < 1e-6
    assert res2["ppl_ratio"] == pytest.approx(1.0, abs=1e-4) and res2["lossless"]


def test_results_merge_keeps_fields_written_by_the_other_mode(tmp_path):
    path = str(tmp_path / "r.json")
    qa.save_results(path, {"int8": {"format": "int8", "tok_s": {"1": 5.0}}}, ["int8"])     # --mode serve first
    qa.save_results(path, {"int8": {"format": "int8", "ppl": 2.0, "top1": 0.9}}, ["int8"])  # then accuracy
    assert qa.load_results(path)["int8"] == {"format": "int8", "tok_s": {"1": 5.0}, "ppl": 2.0, "top1": 0.9}
    line = qa.table({"int8": {"format": "int8", "tok_s": {"1": 5.0}}}, 2048).splitlines()[-1]
    assert line.startswith("| int8 | - |") and "| 5.0 | - | not measured |" in line   # tok/s only


def test_build_runner_runs_the_threads_asked(tiny_checkpoint, monkeypatch):
    """--threads reaches the runner (ModelRunner.from_config sets the engine core's threads from
    TOKENMILL_NUM_THREADS, else one per CPU: setting torch's threads beforehand was overridden)."""
    monkeypatch.delenv("TOKENMILL_NUM_THREADS", raising=False)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        qa.build_runner({"model": tiny_checkpoint(), "dtype": "float32"}, {}, 8, 64, 4, threads=1, with_tokenizer=False)
        assert torch.get_num_threads() == 1
        assert "TOKENMILL_NUM_THREADS" not in __import__("os").environ      # restored afterwards
    finally:
        torch.set_num_threads(old)
