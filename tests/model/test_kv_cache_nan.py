"""The KV pool is allocated without zeroing: attention must never let unwritten slots reach an output.

Every attention path (CPU decode kernel, CPU prefill kernel, SDPA prefill with a cached prefix, the torch
decode path that gathers up to the batch's longest context) runs the same steps over a pool filled with
NaN and over a zeroed pool; the logits must be equal and finite. NaN is the worst garbage: a masked
position has probability 0, and 0 x NaN = NaN, so a path that reads one unwritten V row shows it.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.kv_cache import KVCacheLayout, allocate_kv_caches
from tokenmill.model.layers import paged_attention_cpu
from tokenmill.model.layers.attention import TorchAttentionBackend
from tokenmill.model.loader import build_model_from_config

PATHS = {
    "kernels": dict(use_cpu_kernel=True, prefill_kernel=True),
    "decode-kernel+sdpa": dict(use_cpu_kernel=True, prefill_kernel=False),
    "torch": dict(use_cpu_kernel=False),
}


def _steps(runner) -> list[torch.Tensor]:
    """Prefills of different lengths, mixed decode steps (contexts of different lengths, blocks only
    partly written), a chunked prefill over a cached prefix next to decodes, and a late short request."""
    out = [runner.step([("a", [5, 6, 7, 8, 9]), ("b", list(range(10, 21)))])]
    for t in range(3):
        out.append(runner.step([("a", [30 + t]), ("b", [40 + t])], last_only=True))
    out.append(runner.step([("c", list(range(50, 57)))]))                  # first chunk of c
    out.append(runner.step([("a", [60]), ("c", list(range(57, 63))), ("b", [61])]))  # c's second chunk + decodes
    out.append(runner.step([("d", [3])]))                                   # a 1-token request alone
    for t in range(2):
        out.append(runner.step([("a", [70 + t]), ("b", [71 + t]), ("c", [72 + t]), ("d", [73 + t])],
                               last_only=True))
    return out


@pytest.mark.parametrize("path,dtype", [(p, torch.float32) for p in PATHS] + [("kernels", torch.bfloat16)])
def test_nan_filled_pool_gives_the_zeroed_pool_outputs(paged_runner, make_tiny_arch, path, dtype):
    if PATHS[path].get("use_cpu_kernel") and paged_attention_cpu.compiled_isa() is None:
        pytest.skip("the CPU attention kernels are not available on this machine")
    arch = make_tiny_arch()
    results = {}
    for name, fill in (("zero", 0.0), ("nan", float("nan"))):
        model = build_model_from_config(arch, dtype=dtype, attn_backend=TorchAttentionBackend(**PATHS[path]))
        runner = paged_runner(model, arch, num_blocks=32, block_size=4, seed=1, dtype=dtype)
        for c in runner.caches:
            c.fill_(fill)
        results[name] = _steps(runner)
    for got, want in zip(results["nan"], results["zero"]):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)


def test_allocation_is_not_zeroed_unless_asked(monkeypatch):
    layout = KVCacheLayout(num_blocks=4, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                           dtype=torch.float32, bytes_per_token=2 * 2 * 2 * 8 * 4, max_model_len=16)
    caches = allocate_kv_caches(layout, torch.device("cpu"))
    assert len(caches) == 2 and tuple(caches[0].shape) == layout.shape
    monkeypatch.setenv("TOKENMILL_KV_CACHE_ZERO", "1")
    assert all(bool((c == 0).all()) for c in allocate_kv_caches(layout, torch.device("cpu")))
