"""With ``TOKENMILL_CPU_KV_BF16=1`` a float32 model on the CPU low-bit path keeps a bfloat16 KV cache
(``--kv-cache-dtype auto``; opt-in, off by default).

Chosen only there: float32 + CPU + the GGUF's low-bit codes attached. Parity
runs (float32, low-bit off), bfloat16 models, ``--kv-cache-dtype float32``,
the default and ``TOKENMILL_CPU_KV_BF16=0`` keep the model's dtype. The logits of the
same scheduled steps stay within a stated tolerance of the float32-cache
runner's (K/V rounded to 8 mantissa bits is the only difference).
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.model.layers.kv_quant import CPU_KV_BF16_ENV, resolve_kv_cache_dtype
from tokenmill.model.loader import build_model_from_config
from tokenmill.model.runner import ModelRunner
from tokenmill.model.step_graph import CpuStepGraph

from .conftest import tiny_arch
from .test_runner import BLOCK, NUM_BLOCKS, play
from .test_step_graph import lowbit_weights, needs_lowbit

#: largest |logit difference| allowed between the bfloat16- and float32-cache runners on the tiny model
#: (measured max 5.5e-3, greedy tokens equal; the float32 and bfloat16-cache runs differ only in K/V rounding)
LOGIT_ATOL = 2e-2


def make(dtype: torch.dtype, lowbit: bool = True, **kw) -> ModelRunner:
    arch = tiny_arch("llama", max_position_embeddings=128)
    model = build_model_from_config(arch, dtype=dtype, seed=5)
    cfg = EngineConfig.from_kwargs(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=128, max_num_seqs=8,
                                   max_num_batched_tokens=64, dtype=str(dtype).replace("torch.", ""), **kw)
    runner = ModelRunner(model, arch, cfg, torch.device("cpu"), dtype, [2],
                         lowbit_weights=lowbit_weights(model) if lowbit else None)
    return runner, model, arch


def test_resolve_rule(monkeypatch):
    f32, bf16, cpu = torch.float32, torch.bfloat16, torch.device("cpu")
    monkeypatch.delenv(CPU_KV_BF16_ENV, raising=False)
    assert resolve_kv_cache_dtype("auto", f32, cpu, lowbit=True) == f32     # opt-in
    monkeypatch.setenv(CPU_KV_BF16_ENV, "1")
    assert resolve_kv_cache_dtype("auto", f32, cpu, lowbit=True) == bf16
    assert resolve_kv_cache_dtype("auto", f32, cpu, lowbit=False) == f32
    assert resolve_kv_cache_dtype("auto", f32, torch.device("cuda"), lowbit=True) == f32
    assert resolve_kv_cache_dtype("auto", bf16, cpu, lowbit=True) == bf16
    assert resolve_kv_cache_dtype("float32", f32, cpu, lowbit=True) == f32
    assert resolve_kv_cache_dtype("bfloat16", f32, cpu, lowbit=False) == bf16
    assert resolve_kv_cache_dtype("int8", f32, cpu, lowbit=True) == torch.int8
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs(kv_cache_dtype="float16")


def test_chosen_only_on_the_float32_low_bit_path(monkeypatch, caplog):
    needs_lowbit(torch.float32)
    monkeypatch.setenv(CPU_KV_BF16_ENV, "1")
    with caplog.at_level("INFO", logger="tokenmill.model.runner"):
        runner = make(torch.float32)[0]
    assert runner.lowbit_max_tokens and runner.kv_cache_dtype == torch.bfloat16
    assert all(kv.dtype == torch.bfloat16 for kv in runner.kv_caches)
    assert isinstance(runner.step_graph, CpuStepGraph)          # the step graph serves the bfloat16 cache
    assert any("KV cache bfloat16 (float32 model" in r.getMessage() for r in caplog.records)
    # half the bytes per token of the float32 cache
    assert runner.bytes_per_token * 2 == make(torch.float32, kv_cache_dtype="float32")[0].bytes_per_token
    assert make(torch.float32, lowbit=False)[0].kv_cache_dtype == torch.float32       # parity: low-bit off
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "0")
    assert make(torch.float32)[0].kv_cache_dtype == torch.float32
    monkeypatch.delenv("TOKENMILL_CPU_INT4_MAX_TOKENS")
    monkeypatch.setenv(CPU_KV_BF16_ENV, "0")
    assert make(torch.float32)[0].kv_cache_dtype == torch.float32
    monkeypatch.delenv(CPU_KV_BF16_ENV)                          # opt-in: off by default
    assert make(torch.float32)[0].kv_cache_dtype == torch.float32


def test_logits_stay_close_to_the_float32_cache(monkeypatch):
    needs_lowbit(torch.float32)
    monkeypatch.setenv(CPU_KV_BF16_ENV, "1")
    bf, model_b, arch = make(torch.float32)
    ref, model_f, _ = make(torch.float32, kv_cache_dtype="float32")
    assert bf.kv_cache_dtype == torch.bfloat16 and ref.kv_cache_dtype == torch.float32
    logits_b, tokens_b, _ = play(bf, model_b, arch, check_reference=False)
    logits_f, tokens_f, _ = play(ref, model_f, arch, check_reference=False)
    assert len(logits_b) == len(logits_f)
    diff = max(float((b - f).abs().max()) for b, f in zip(logits_b, logits_f))
    assert 0 < diff <= LOGIT_ATOL, diff      # > 0: the cache really is bfloat16
    assert tokens_b == tokens_f
