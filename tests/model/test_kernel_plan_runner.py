"""The model runner runs by its config's kernel plan (tokenmill/kernel_plan.py), not by the environment."""

from __future__ import annotations

import torch

from tokenmill.config import EngineConfig
from tokenmill.kernel_plan import CpuKernelSwitches
from tokenmill.model.loader import build_model_from_config
from tokenmill.model.runner import ModelRunner

from .conftest import tiny_arch
from .test_runner import BLOCK, NUM_BLOCKS
from .test_step_graph import lowbit_weights, needs_lowbit


def _runner(monkeypatch, switches: CpuKernelSwitches | None) -> ModelRunner:
    for name in ("TOKENMILL_CPU_INT4_MAX_TOKENS", "TOKENMILL_CPU_KV_BF16", "TOKENMILL_CPU_STEP_GRAPH"):
        monkeypatch.delenv(name, raising=False)
    arch = tiny_arch("llama", max_position_embeddings=128)
    model = build_model_from_config(arch, dtype=torch.float32, seed=5)
    kw = {} if switches is None else {"cpu_kernels": switches}
    cfg = EngineConfig.from_kwargs(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=128, max_num_seqs=8,
                                   max_num_batched_tokens=64, dtype="float32", **kw)
    return ModelRunner(model, arch, cfg, torch.device("cpu"), torch.float32, [2], lowbit_weights=lowbit_weights(model))


def test_runner_follows_the_config_switches(monkeypatch):
    needs_lowbit(torch.float32)
    default = _runner(monkeypatch, None)
    p = default.kernel_plan
    assert (p.lowbit_max_tokens, p.kv_cache_dtype, default.kv_cache_dtype) == (8, "bfloat16", torch.bfloat16)
    assert default.lowbit_max_tokens == 8 and default.step_graph is not None
    # the environment says the defaults; the config says otherwise, and wins
    off = _runner(monkeypatch, CpuKernelSwitches(int4_max_tokens=0, step_graph=False))
    assert off.kernel_plan.lowbit_max_tokens == 0 and off.lowbit_max_tokens == 0
    assert off.kv_cache_dtype == torch.float32 and off.step_graph is None
    kv = _runner(monkeypatch, CpuKernelSwitches(kv_bf16=False, int4_max_tokens=2))
    assert kv.kv_cache_dtype == torch.float32 and kv.lowbit_max_tokens == 2
    lin = kv.model.model.layers[0].mlp.down_proj
    assert lin.lowbit_max_rows == 2
