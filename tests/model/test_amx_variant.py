"""AMX: what runs on Intel AMX tiles, checked against the torch reference on CPUs that have them.

tokenmill builds no separate AMX variant of its C kernels (``kernel_plan.ISAS``: avx512, avx2, scalar; an AMX CPU
runs the avx512 variant, tested in tests/model/test_paged_attention_cpu.py, tests/quantization/test_lowbit.py
and tests/model/test_batch_invariance.py); that variant's integer low-bit path has AMX-INT8 tile passes behind a
run-time gate, tested in tests/quantization/test_lowbit_amx.py (on emulated tiles where the CPU lacks AMX) and
tests/model/test_emuamx.py. What else runs on AMX there is oneDNN's packed bfloat16 GEMM
(``PackedLinear``'s dense path: ``--no-batch-invariant`` steps above the low-bit limit, and linears without
low-bit codes). This checks that path against a float64 reference of the same bfloat16 operands; on a CPU
without AMX it is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.layers.linear import PackedLinear, packed_linear_available


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("rows", [1, 9, 64, 300])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576)])
def test_amx_bf16_gemm_matches_the_reference(rows, k, n):
    flags = _cpu_flags()
    if not {"amx_tile", "amx_bf16"} <= flags:
        pytest.skip("this CPU has no AMX (amx_tile/amx_bf16 missing from /proc/cpuinfo): oneDNN's bfloat16 GEMM "
                    "runs AVX512-BF16 or AVX-512 here, covered by the avx512 variant's tests")
    if not packed_linear_available("cpu", torch.bfloat16):
        pytest.skip("oneDNN bfloat16 packing unavailable in this torch build")
    g = torch.Generator().manual_seed(rows * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    y = PackedLinear(w, None)(x)
    ref = x.double() @ w.double().T
    # float32 accumulation of K bfloat16 products (exact in float32), then one rounding to bfloat16: the
    # output's own rounding (2^-9 relative) plus K float32 additions (K * 2^-24 of the sum of |products|)
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * (k * 2.0 ** -24) + 1e-30
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= bound).all()
