"""The grouped multi-LoRA delta (``csrc/lora_delta.c`` and the torch forms) on random layers.

Each kernel variant the CPU runs is built and tested explicitly (a variant it cannot run is skipped with
the reason), float32 and bfloat16: the delta equals the per-request torch loop within the dtype's rounding,
and every row's bits equal the row computed alone, whatever its neighbours, its place, the step's size and
the thread count (the batch invariance the engine promises, docs/guide/batch_invariance.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.kernel_variants import variants
from tokenmill.model.layers import cpu_build
from tokenmill.model.layers.lora import LoRABatch, LoRALinear, load_kernel

DTYPES = [torch.float32, torch.bfloat16]
# a q/k/v-like layer with widths that are not multiples of the kernel's 16-lane vectors or 64-column tiles
SLICES = [("q_proj", 0, 72), ("k_proj", 72, 40), ("v_proj", 112, 40)]
K_IN, N_OUT, SLOTS, RANK = 76, 152, 4, 8
SLOT_RANKS = [8, 3, 5, 1]


def _layer(dtype: torch.dtype, seed: int = 0) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(K_IN, N_OUT, bias=False).to(dtype)
    lin = LoRALinear(base, SLICES, K_IN, SLOTS, RANK, dtype)
    for s, r in enumerate(SLOT_RANKS):
        # slot 2 does not target k_proj (its rank there is 0)
        w = {n: (torch.randn(r, K_IN, generator=g).to(dtype), torch.randn(width, r, generator=g).to(dtype))
             for n, _, width in SLICES if not (s == 2 and n == "k_proj")}
        lin.set_slot(s, w)
    return lin


def _kernel_or_skip(isa: str):
    if not cpu_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernel variant (missing instructions in /proc/cpuinfo)")
    lib = load_kernel(isa)
    if lib is None:
        pytest.skip(f"the {isa} LoRA kernel did not build (no C compiler?)")
    return lib


def _run(lin: LoRALinear, x: torch.Tensor, req_slots, query_lens, mode: str, isa: str | None = None,
         threads: int | None = None, num_rows: int | None = None, y0: torch.Tensor | None = None) -> torch.Tensor:
    """``base(x) + delta`` (or ``y0 + delta``) for requests of ``query_lens`` rows each with ``req_slots``
    (-1: base)."""
    b = LoRABatch(dtype=lin.a_rows.dtype, mode=mode)
    lin.batch = b
    b.fill(np.asarray(req_slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64),
           num_rows or x.shape[0])
    y = lin.base(x) if y0 is None else y0.clone()
    if mode == "kernel":
        fn, args = lin.kernel_call(x, y, threads or torch.get_num_threads(), isa)
        fn(*args)
    else:
        lin.add_delta_(x, y)
    return y


def _reference(lin: LoRALinear, x: torch.Tensor, row_slot) -> torch.Tensor:
    """The delta in float64 from the stored (dtype-rounded) matrices, plus the base output."""
    y = lin.base(x).double()
    R, k = lin.max_rank, lin.k
    a = lin.a_rows.double().view(SLOTS, k, R, K_IN)
    b = lin.b_all.double().view(SLOTS, R, N_OUT)
    for i, s in enumerate(row_slot):
        if s < 0:
            continue
        for j, (_, off, w) in enumerate(SLICES):
            r = int(lin.ranks[s, j])
            y[i, off:off + w] += (x[i].double() @ a[s, j, :r].t()) @ b[s, :r, off:off + w]
    return y


@pytest.mark.parametrize("isa", variants())
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_reference_and_torch_forms(isa, dtype):
    _kernel_or_skip(isa)
    lin = _layer(dtype)
    g = torch.Generator().manual_seed(1)
    slots, lens = [0, -1, 2, 1, 0, 3, 2], [1, 1, 3, 1, 2, 1, 4]
    rows = sum(lens) + 3          # three padding rows
    x = torch.randn(rows, K_IN, generator=g).to(dtype)
    row_slot = np.repeat(slots, lens).tolist() + [-1] * 3
    ref = _reference(lin, x, row_slot)
    # float32: summation order only (K_IN + rank terms of size ~ sqrt(K_IN)); bfloat16: one rounding of y
    # (2^-8 relative) plus the base GEMM's own rounding, as the torch forms
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.06, 2 ** -7)
    got = _run(lin, x, slots, lens, "kernel", isa, num_rows=rows)
    torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)
    base = lin.base(x)
    assert torch.equal(got[row_slot.index(-1)], base[row_slot.index(-1)])      # base row untouched
    assert torch.equal(got[-3:], base[-3:])                                       # padding untouched
    for mode in ("loop", "stacked", "segmented"):
        torch.testing.assert_close(_run(lin, x, slots, lens, mode, num_rows=rows).double(), ref,
                                   atol=2 * atol, rtol=2 * rtol)


@pytest.mark.parametrize("isa", variants())
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_rows_do_not_depend_on_the_batch(isa, dtype):
    """Row ``i`` of an ``M``-row step (random slots, M in 1..40, 1 and 2 threads) is bit-identical to the row
    computed alone, and to the row in a prefill-shaped step (runs of rows of one adapter). The delta is
    added to a fixed ``y`` (the base layer's own row dependence is the base kernel's business)."""
    _kernel_or_skip(isa)
    lin = _layer(dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    rng = np.random.default_rng(5)
    x = torch.randn(40, K_IN, generator=g).to(dtype)
    y0 = torch.randn(40, N_OUT, generator=g).to(dtype)
    slots = rng.integers(-1, SLOTS, size=40)
    alone = torch.stack([_run(lin, x[i:i + 1].clone(), [slots[i]], [1], "kernel", isa, threads=1,
                              y0=y0[i:i + 1])[0] for i in range(40)])
    for m in (1, 2, 5, 16, 17, 40):
        for threads in (1, 2):
            y = _run(lin, x[:m], slots[:m], np.ones(m, dtype=np.int64), "kernel", isa, threads=threads, y0=y0[:m])
            assert torch.equal(y, alone[:m]), (m, threads)
    # prefill-shaped: 3 requests of 13 rows, slot of row 0 for each run
    lens = [13, 13, 14]
    req_slots = [slots[0], slots[13], slots[26]]
    y = _run(lin, x, req_slots, lens, "kernel", isa, threads=2, y0=y0)
    for i, s in enumerate(np.repeat(req_slots, lens)):
        one = _run(lin, x[i:i + 1].clone(), [s], [1], "kernel", isa, threads=1, y0=y0[i:i + 1])[0]
        assert torch.equal(y[i], one), i


def test_strided_rows_and_auto_mode():
    """The kernel reads rows with a row stride (views of the step graph's persistent buffers); ``auto`` takes
    the kernel, ``torch`` only the torch forms."""
    if load_kernel() is None:
        pytest.skip("the LoRA kernel did not build (no C compiler?)")
    lin = _layer(torch.float32)
    buf = torch.randn(6, K_IN + 10)
    x = buf[:, :K_IN]
    assert x.stride(0) == K_IN + 10
    # one base output for both: the base GEMM itself may round a strided input differently from a contiguous
    # one (oneDNN with 2 threads on the AMD EPYC: 1.2e-7 apart); only the delta's reading of strides is tested
    y0 = lin.base(x.contiguous())
    ref = _run(lin, x.contiguous(), [1, 3], [2, 4], "kernel", y0=y0)
    out = torch.zeros(6, N_OUT + 7)
    b = LoRABatch(mode="auto", invariant=True)
    lin.batch = b
    b.fill(np.array([1, 3]), np.array([2, 4]), 6)
    out[:, :N_OUT] = y0
    lin.add_delta_(x, out[:, :N_OUT])
    assert torch.equal(out[:, :N_OUT], ref)
    b.mode = "torch"
    out[:, :N_OUT] = y0
    lin.add_delta_(x, out[:, :N_OUT])
    torch.testing.assert_close(out[:, :N_OUT], ref, atol=1e-4, rtol=1e-5)


def test_set_slot_validates_and_clears():
    lin = _layer(torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        lin.set_slot(0, {"q_proj": (torch.zeros(RANK + 1, K_IN), torch.zeros(72, RANK + 1))})
    with pytest.raises(ValueError, match="do not fit"):
        lin.set_slot(0, {"q_proj": (torch.zeros(4, K_IN + 1), torch.zeros(72, 4))})
    lin.clear_slot(1)
    assert int(lin.ranks[1].sum()) == 0 and lin.a_rows.view(SLOTS, 3, RANK, K_IN)[1].abs().sum() == 0
    x = torch.randn(3, K_IN)
    assert torch.equal(_run(lin, x, [1], [3], "kernel" if load_kernel() else "loop"), lin.base(x))


@pytest.mark.parametrize("isa", variants())
def test_bfloat16_output_rounding_matches_torch(isa):
    """The bfloat16 kernel adds the float32 delta to ``y`` and rounds once to nearest even, as torch's
    ``(y.float() + delta).to(bfloat16)`` (the vector rounding of the AVX-512 variant and the scalar tail alike),
    infinities and NaN included. The delta is exact here (rank 1, A one-hot, x and B bfloat16: each product is
    exact in float32), so the rounding is all that is compared."""
    _kernel_or_skip(isa)
    n_out = 83                                       # 5 vectors of 16 and a scalar tail
    lin = LoRALinear(nn.Linear(K_IN, n_out, bias=False), [("o_proj", 0, n_out)], K_IN, 1, 1, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    a = torch.zeros(1, K_IN)
    a[0, 0] = 1.0
    b = (torch.randn(n_out, 1, generator=g) * 3).to(torch.bfloat16)
    lin.set_slot(0, {"o_proj": (a.to(torch.bfloat16), b)})
    x = torch.zeros(4, K_IN, dtype=torch.bfloat16)
    x[:, 0] = torch.tensor([1.0, -0.0078125, 3.0e-3, 1.5e38]).to(torch.bfloat16)
    y0 = (torch.randn(4, n_out, generator=g) * 10).to(torch.bfloat16)
    y0[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0e38, -3.0e38, 0.0]).to(torch.bfloat16)
    y0[3, 17] = float("nan")
    y = _run(lin, x, [0] * 4, [1] * 4, "kernel", isa, threads=1, y0=y0)
    delta = x[:, :1].float() * b.float().t()          # exact products
    want = (y0.float() + delta).to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert bool(same.all()), (y[~same], want[~same])
    assert bool(y.isnan().any()) and bool(y.isinf().any())
