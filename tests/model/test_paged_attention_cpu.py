"""The fused CPU paged-attention kernels (decode, prefill), every ISA variant the CPU runs and every KV
dtype, against the torch gather + matmul / SDPA path."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.model.layers import cpu_build, paged_attention_cpu
from tokenmill.model.layers.attention import TorchAttentionBackend, build_attention_metadata
from tokenmill.model.layers.kv_quant import KVScales
from tests.kernel_variants import real_param, variants

pytestmark = pytest.mark.skipif(paged_attention_cpu.load() is None, reason="no C compiler for the CPU kernel")




#: every kernel variant, each built explicitly (avx512: -march=x86-64-v4, avx2: -march=x86-64-v3), and the
#: emulated avx512 one on CPUs without AVX-512 (tests/kernel_variants.py)
ISAS = variants()


@pytest.mark.parametrize("isa", ISAS)
def test_each_variant_is_compiled_for_its_isa(isa):
    assert paged_attention_cpu.compiled_isa(isa) == cpu_build.code_path(isa)     # avx512emu: the avx512 paths
    assert paged_attention_cpu.prefill_preferred(isa) == (isa != "scalar")   # scalar prefill is slower than SDPA


def decode_case(b: int, heads: int, kv_heads: int, d: int, block: int, dtype, seed: int = 0, max_len: int = 70):
    """A decode batch with mixed context lengths on shuffled blocks; returns the inputs of one layer."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, max_len) for _ in range(b)]
    nb = sum(-(-n // block) for n in lens) + 3
    free = list(range(nb))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    cache = torch.randn(2, nb, block, kv_heads, d, generator=g).to(dtype)
    md, _ = build_attention_metadata([n - 1 for n in lens], [1] * b, tables, block)
    q = torch.randn(b, heads, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, d, generator=g).to(dtype)
    return q, k, v, cache, md, build_attention_metadata([n - 1 for n in lens], [1] * b, tables, block)[0]


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 16), (4, 2, 64), (9, 3, 64), (8, 2, 128), (6, 3, 24),
                                             (10, 2, 64), (12, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,block,max_len", [(7, 4, 70), (2, 16, 300), (1, 16, 5)])
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_torch_decode(heads, kv_heads, d, dtype, batch, block, max_len, isa):
    """Whole-request work items (batch 7), per-KV-head items (batch 1-2), GQA groups larger than the
    register tile (10/2, 12/1), the scalar head sizes (16, 24) and contexts shorter than one block."""
    q, k, v, cache, md, md2 = decode_case(batch, heads, kv_heads, d, block, dtype, max_len=max_len)
    cache2 = cache.clone()
    fused = TorchAttentionBackend(use_cpu_kernel=True, cpu_isa=isa)
    plain = TorchAttentionBackend(use_cpu_kernel=False)
    got = fused.forward(q, k, v, cache, md, d ** -0.5)
    want = plain.forward(q, k, v, cache2, md2, d ** -0.5)
    assert md.cache["torch_plan"][0].kernel and not md2.cache["torch_plan"][0].kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(cache, cache2)


def test_kernel_reads_a_strided_block_table_and_the_mixed_batch_decode_group():
    """Block tables as a column slice of a wider buffer (the runner's layout) and decodes mixed with a prefill."""
    torch.manual_seed(0)
    block, kvh, heads, d = 4, 2, 4, 64
    cache = torch.randn(2, 20, block, kvh, d)
    wide = torch.zeros(3, 16, dtype=torch.int32)
    wide[0, :3] = torch.tensor([5, 9, 2])
    wide[1, :1] = torch.tensor([7])
    lens = torch.tensor([10, 3], dtype=torch.int32)
    q = torch.randn(2, heads, d)
    got = paged_attention_cpu.paged_decode(q, cache, wide[:2, :3], lens, 0.125)
    want = paged_attention_cpu.paged_decode(q, cache, wide[:2, :3].contiguous(), lens, 0.125)
    torch.testing.assert_close(got, want)
    # mixed: request 0 prefills 5 tokens, requests 1 and 2 decode
    md, _ = build_attention_metadata([0, 9, 2], [5, 1, 1], [[1, 3], [5, 9, 2], [7]], block)
    md2, _ = build_attention_metadata([0, 9, 2], [5, 1, 1], [[1, 3], [5, 9, 2], [7]], block)
    qm, km, vm = torch.randn(7, heads, d), torch.randn(7, kvh, d), torch.randn(7, kvh, d)
    c2 = cache.clone()
    out = TorchAttentionBackend(True).forward(qm, km, vm, cache, md, 0.125)
    ref = TorchAttentionBackend(False).forward(qm, km, vm, c2, md2, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def prefill_case(new: list[int], ctx: list[int], heads: int, kv_heads: int, d: int, block: int, dtype, seed=0):
    """A batch of prefill chunks (``new[i]`` tokens after ``ctx[i] - new[i]`` cached) on shuffled blocks."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-c // block) for c in ctx) + 2
    free = list(range(nb))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block))] for c in ctx]
    cache = torch.randn(2, nb, block, kv_heads, d, generator=g).to(dtype)
    t = sum(new)
    q = torch.randn(t, heads, d, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, d, generator=g).to(dtype)
    mds = [build_attention_metadata([c - n for c, n in zip(ctx, new)], new, tables, block)[0] for _ in range(2)]
    return q, k, v, cache, mds[0], mds[1]


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 128), (8, 8, 64), (12, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new,ctx,block", [
    ([100], [100], 16),                     # a whole prompt; key tiles that end mid-block
    ([37, 1, 5, 70], [100, 9, 5, 300], 4),  # chunks after cached prefixes, a decode and a tiny prompt mixed in
    ([33, 2], [33, 40], 16),                # a two-token chunk; more than one query tile
])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_kernel_matches_torch(heads, kv_heads, d, dtype, new, ctx, block, isa):
    q, k, v, cache, md, md2 = prefill_case(new, ctx, heads, kv_heads, d, block, dtype)
    cache2 = cache.clone()
    got = TorchAttentionBackend(True, cpu_isa=isa, prefill_kernel=True).forward(q, k, v, cache, md, d ** -0.5)
    want = TorchAttentionBackend(use_cpu_kernel=False).forward(q, k, v, cache2, md2, d ** -0.5)
    assert type(md.cache["torch_plan"][1]).__name__ == "_KernelPrefillPlan"
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(cache, cache2)


def test_prefill_kernel_leaves_unlisted_rows_and_rejects_bad_calls():
    q, k, v, cache, md, _ = prefill_case([20, 7], [20, 30], 4, 2, 64, 4, torch.float32)
    TorchAttentionBackend(use_cpu_kernel=False).forward(q, k, v, cache, md, 0.125)   # writes the K/V
    out = torch.full_like(q, 7.0)
    i32 = dict(dtype=torch.int32)
    paged_attention_cpu.paged_prefill(q, cache, md.block_tables[1:], torch.tensor([20], **i32),
                                      torch.tensor([7], **i32), md.seq_lens[1:], 0.125, out)
    assert torch.all(out[:20] == 7.0) and not torch.any(out[20:] == 7.0)
    with pytest.raises(RuntimeError):   # out of the wrong shape
        paged_attention_cpu.paged_prefill(q, cache, md.block_tables, torch.tensor([0, 20]), torch.tensor([20, 7]),
                                          md.seq_lens, 0.125, out[:5])
    with pytest.raises(RuntimeError):   # head_dim 24: no prefill kernel (the SDPA path serves it)
        paged_attention_cpu.paged_prefill(torch.zeros(3, 2, 24), torch.zeros(2, 4, 4, 1, 24), md.block_tables,
                                          torch.tensor([0]), torch.tensor([3]), torch.tensor([3]), 0.125,
                                          torch.zeros(3, 2, 24))


QUANT_KV = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _quant_cache(cache: torch.Tensor, kv_dtype: torch.dtype, scales: KVScales) -> torch.Tensor:
    """A quantised copy of a float cache (what write_kv would have stored)."""
    from tokenmill.model.layers.kv_quant import quantize
    return torch.stack([quantize(cache[0], scales.k, kv_dtype), quantize(cache[1], scales.v, kv_dtype)])


@pytest.mark.parametrize("kv_dtype", QUANT_KV, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128), (6, 3, 24)])
def test_decode_reads_quantized_cache(kv_dtype, dtype, isa, heads, kv_heads, d):
    """The kernels widen int8 / fp8 on load with the layer's scales: same result as the torch path,
    which dequantises the gathered rows (both see exactly the stored values)."""
    q, k, v, cache, md, md2 = decode_case(7, heads, kv_heads, d, 4, dtype, max_len=70)
    scales = KVScales(k=0.03, v=0.02)
    qc = _quant_cache(cache.float() * 2, kv_dtype, scales)
    qc2 = qc.clone()
    got = TorchAttentionBackend(True, cpu_isa=isa).forward(q, k, v, qc, md, d ** -0.5, scales)
    # reference in float32 on the same stored values (a bfloat16 torch path would round the dequantised K/V)
    want = TorchAttentionBackend(False).forward(q.float(), k.float(), v.float(), qc2, md2, d ** -0.5, scales)
    assert md.cache["torch_plan"][0].kernel
    assert torch.equal(qc.view(torch.uint8), qc2.view(torch.uint8))      # both wrote the same quantised K/V
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", QUANT_KV, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_reads_quantized_cache(kv_dtype, dtype, isa):
    q, k, v, cache, md, md2 = prefill_case([37, 1, 5, 70], [100, 9, 5, 300], 9, 3, 64, 4, dtype)
    scales = KVScales(k=0.05, v=0.01)
    qc = _quant_cache(cache.float(), kv_dtype, scales)
    qc2 = qc.clone()
    got = TorchAttentionBackend(True, cpu_isa=isa, prefill_kernel=True).forward(q, k, v, qc, md, 0.125, scales)
    want = TorchAttentionBackend(False).forward(q.float(), k.float(), v.float(), qc2, md2, 0.125, scales)
    assert type(md.cache["torch_plan"][1]).__name__ == "_KernelPrefillPlan"
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16] + QUANT_KV, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_kv_write_kernel_matches_torch_bit_for_bit(kv_dtype, isa):
    """The C scatter (+ quantise) stores exactly the bytes torch's write_kv does: wide dynamic range
    (fp8 subnormals), exact ties, out-of-range values (saturated), strided source rows."""
    from tokenmill.model.layers.attention import write_kv
    g = torch.Generator().manual_seed(1)
    # every source dtype the kernels pair with this cache (a float32 model's bfloat16 cache included)
    for src in ([torch.float32] if kv_dtype == torch.float32 else [torch.float32, torch.bfloat16]):
        n, kvh, d = 37, 3, 64
        wide = torch.randn(n, 5 * kvh * d, generator=g) * torch.exp2(torch.randint(-20, 12, (n, 5 * kvh * d),
                                                                                   generator=g).float())
        wide[0, :8] = torch.tensor([0.5, 1.5, 2.5, -2.5, 448.0, 1e6, -1e6, 0.0])   # ties, range ends
        wide = wide.to(src)
        k = wide[:, kvh * d:2 * kvh * d].view(n, kvh, d)      # strided rows, as slices of the q/k/v output
        v = wide[:, 3 * kvh * d:4 * kvh * d].view(n, kvh, d)
        slots = torch.randperm(8 * 16, generator=g)[:n]
        a = torch.zeros(2, 8, 16, kvh, d, dtype=kv_dtype)
        b = a.clone()
        assert paged_attention_cpu.write_kv_supports(k, v, a, isa)
        paged_attention_cpu.write_kv(a, k, v, slots, 0.75, 1.25, isa=isa)
        write_kv(b, k, v, slots, 0.75, 1.25)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (src, kv_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128), (6, 3, 24)])
def test_float32_queries_read_a_bfloat16_cache(isa, heads, kv_heads, d):
    """A float32 model's bfloat16 cache (the CPU low-bit path's default): the kernels widen each element
    on load; same result as the torch path, which widens the gathered rows (both see the stored values)."""
    q, k, v, cache, md, md2 = decode_case(7, heads, kv_heads, d, 4, torch.float32, max_len=70)
    bc = cache.to(torch.bfloat16)
    bc2 = bc.clone()
    assert paged_attention_cpu.supports(q, bc, isa)
    got = TorchAttentionBackend(True, cpu_isa=isa).forward(q, k, v, bc, md, d ** -0.5)
    want = TorchAttentionBackend(False).forward(q, k, v, bc2, md2, d ** -0.5)
    assert md.cache["torch_plan"][0].kernel and md.cache["kv_write_kernel"]
    assert torch.equal(bc.view(torch.int16), bc2.view(torch.int16))   # both wrote the same rounded K/V
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if d not in (64, 128):
        return
    q, k, v, cache, md, md2 = prefill_case([37, 1, 5, 70], [100, 9, 5, 300], heads, kv_heads, d, 4, torch.float32)
    bc = cache.to(torch.bfloat16)
    got = TorchAttentionBackend(True, cpu_isa=isa, prefill_kernel=True).forward(q, k, v, bc, md, 0.125)
    want = TorchAttentionBackend(False).forward(q, k, v, bc.clone(), md2, 0.125)
    assert type(md.cache["torch_plan"][1]).__name__ == "_KernelPrefillPlan"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_rows_are_bit_identical_alone_and_batched(kv_dtype, heads, kv_heads, d, isa):
    """A query row's decode output has the same bits whether it is computed alone, as one of the rows of a
    prompt run as decode rows (the batch-invariant prefill: every row j of a 45-token prompt over its own
    j + 1 positions, so lengths cross every partial group of keys the kernel's score pass reduces together),
    in a shuffled batch, or with 1 or 2 threads: the kernel's score reduction (vtsum, several keys per add)
    gives each score vhsum's sums, and no row reads another's. Every variant built explicitly."""
    g = torch.Generator().manual_seed(3)
    block, n = 16, 45
    nb = -(-n // block) + 2
    cache = torch.randn(2, nb, block, kv_heads, d, generator=g) * 3
    cache = cache.round().clamp(-120, 120).to(kv_dtype) if kv_dtype == torch.int8 else cache.to(kv_dtype)
    q_dtype = torch.float32 if kv_dtype != torch.bfloat16 else torch.bfloat16
    q = torch.randn(n, heads, d, generator=g).to(q_dtype)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    lens = torch.arange(1, n + 1, dtype=torch.int32)

    def run(rows, threads):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return paged_attention_cpu.paged_decode(q[rows], cache, table.expand(len(rows), -1).contiguous(),
                                                    lens[rows], d ** -0.5, 0.9, 1.1, isa)
        finally:
            torch.set_num_threads(saved)

    bits = (lambda t: t.view(torch.int16)) if q_dtype == torch.bfloat16 else (lambda t: t.view(torch.int32))
    all_rows = torch.arange(n)
    batched = run(all_rows, 2)
    perm = torch.randperm(n, generator=g)
    shuffled = run(perm, 1)
    for j in range(n):
        alone = run(torch.tensor([j]), 1)
        assert torch.equal(bits(alone[0]), bits(batched[j])), j
    assert torch.equal(bits(shuffled), bits(batched[perm]))


def _rows_case(seed, reqs, heads, kv_heads, d, block, kv_dtype):
    """Random paged K/V on shuffled blocks for requests ``reqs`` = [(new tokens, context after the step)]."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-sl // block) for _, sl in reqs]
    perm = torch.randperm(sum(nblk) + 2, generator=g).to(torch.int32)
    cache = torch.randn(2, sum(nblk) + 2, block, kv_heads, d, generator=g) * 2
    cache = (cache * 30).round().clamp(-127, 127).to(kv_dtype) if kv_dtype == torch.int8 else cache.to(kv_dtype)
    q_dtype = torch.bfloat16 if kv_dtype == torch.bfloat16 and seed % 2 else torch.float32
    q = torch.randn(sum(n for n, _ in reqs), heads, d, generator=g).to(q_dtype)
    table = torch.zeros(len(reqs), max(nblk), dtype=torch.int32)
    first = 0
    for r, nb in enumerate(nblk):
        table[r, :nb] = perm[first:first + nb]
        first += nb
    q_len = torch.tensor([n for n, _ in reqs], dtype=torch.int32)
    seq_lens = torch.tensor([sl for _, sl in reqs], dtype=torch.int32)
    q_start = (torch.cumsum(q_len, 0) - q_len).to(torch.int32)
    return q, cache, table, q_start, q_len, seq_lens


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d,block", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 8),
                                                    (12, 3, 64, 32), (5, 1, 24, 16)])
@pytest.mark.parametrize("isa", ISAS)
def test_rows_kernel_has_the_decode_kernels_bits_per_row(kv_dtype, heads, kv_heads, d, block, isa):
    """paged_rows (several rows of a request per work item, the context read once per tile) gives every row
    the bits paged_decode gives it as one row per token with its own context (seq_len - q_len + j + 1
    positions): prompts from scratch, chunks after a cached prefix, verify-step-sized queries and one-token
    rows, in one call, with 2 threads and 1; contexts cross every partial group of keys and tile boundary
    (tiles of 16 tokens). Every variant built explicitly; the scalar one and head_dim 24 run the decode
    items themselves."""
    reqs = [(45, 45), (5, 262), (1, 17), (33, 40), (9, 9), (17, 300), (2, 3)]
    q, cache, table, q_start, q_len, seq_lens = _rows_case(len(reqs) + d + heads, reqs, heads, kv_heads, d,
                                                           block, kv_dtype)
    # main's way: one decode row per token, per-token block tables and context lengths
    row_table = table.repeat_interleave(q_len.long(), 0).contiguous()
    row_lens = torch.tensor([sl - n + j + 1 for n, sl in reqs for j in range(n)], dtype=torch.int32)
    want = paged_attention_cpu.paged_decode(q, cache, row_table, row_lens, d ** -0.5, 0.9, 1.1, isa)
    saved = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            got = torch.full_like(q, float("nan"))
            paged_attention_cpu.paged_rows(q, cache, table, q_start, q_len, seq_lens, d ** -0.5, got, 0.9, 1.1, isa)
            assert torch.equal(_bits(got), _bits(want)), threads
            # each request alone, and a later chunk of the 45-token prompt alone: the same rows
            for r in (0, 5):
                alone = torch.zeros_like(q)
                paged_attention_cpu.paged_rows(q, cache, table[r:r + 1], q_start[r:r + 1], q_len[r:r + 1],
                                               seq_lens[r:r + 1], d ** -0.5, alone, 0.9, 1.1, isa)
                s, n = int(q_start[r]), int(q_len[r])
                assert torch.equal(_bits(alone[s:s + n]), _bits(want[s:s + n])), r
            chunk = torch.zeros_like(q)   # tokens 20..44 of request 0 after its first 20 (cached) positions
            paged_attention_cpu.paged_rows(q, cache, table[:1], torch.tensor([20], dtype=torch.int32),
                                           torch.tensor([25], dtype=torch.int32), seq_lens[:1], d ** -0.5, chunk,
                                           0.9, 1.1, isa)
            assert torch.equal(_bits(chunk[20:45]), _bits(want[20:45]))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("block", [8, 24, 64, 128])
@pytest.mark.parametrize("isa", ISAS)
def test_rows_value_spans_of_several_blocks_keep_the_decode_bits(kv_dtype, heads, kv_heads, d, block, isa):
    """Pass 2 of a rows item widens the V rows of a span of whole blocks (64 keys: 8 blocks of 8, 2 of 24,
    one of 64 or 128) for its tiles: spans cut at every offset of a row's context (a 200-token prompt, a
    70-token chunk after 263 cached positions, prompts of 64 and 129, one-token rows, five requests in one
    call, 2 threads and 1) give every row the bits of paged_decode's one row per token."""
    reqs = [(200, 200), (70, 333), (1, 130), (64, 64), (129, 129)]
    q, cache, table, q_start, q_len, seq_lens = _rows_case(block + d + heads, reqs, heads, kv_heads, d, block,
                                                           kv_dtype)
    row_table = table.repeat_interleave(q_len.long(), 0).contiguous()
    row_lens = torch.tensor([sl - n + j + 1 for n, sl in reqs for j in range(n)], dtype=torch.int32)
    want = paged_attention_cpu.paged_decode(q, cache, row_table, row_lens, d ** -0.5, 1.0, 1.0, isa)
    saved = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            got = torch.full_like(q, float("nan"))
            paged_attention_cpu.paged_rows(q, cache, table, q_start, q_len, seq_lens, d ** -0.5, got, 1.0, 1.0, isa)
            assert torch.equal(_bits(got), _bits(want)), threads
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d,block", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 8),
                                                    (12, 3, 64, 32)])
@pytest.mark.parametrize("isa", ISAS)
def test_short_rows_on_whole_request_items_keep_the_decode_bits(kv_dtype, heads, kv_heads, d, block, isa):
    """A call of short rows (a verify step: a few tokens per request) with at least two tiles per thread
    runs items that serve all KV heads of a tile (their K/V rows copied in slot order); every row must keep
    the bits paged_decode gives it as one row per token, and the bits of the same request run alone (one
    tile: one KV head per item)."""
    reqs = [(5, 262), (3, 40), (1, 17), (4, 9), (2, 3), (5, 100), (5, 5), (1, 300), (4, 33)]
    q, cache, table, q_start, q_len, seq_lens = _rows_case(len(reqs) + d + heads + 7, reqs, heads, kv_heads, d,
                                                           block, kv_dtype)
    row_table = table.repeat_interleave(q_len.long(), 0).contiguous()
    row_lens = torch.tensor([sl - n + j + 1 for n, sl in reqs for j in range(n)], dtype=torch.int32)
    want = paged_attention_cpu.paged_decode(q, cache, row_table, row_lens, d ** -0.5, 0.9, 1.1, isa)
    saved = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            got = torch.full_like(q, float("nan"))
            paged_attention_cpu.paged_rows(q, cache, table, q_start, q_len, seq_lens, d ** -0.5, got, 0.9, 1.1, isa)
            assert torch.equal(_bits(got), _bits(want)), threads
            for r in (0, 3):
                alone = torch.zeros_like(q)
                paged_attention_cpu.paged_rows(q, cache, table[r:r + 1], q_start[r:r + 1], q_len[r:r + 1],
                                               seq_lens[r:r + 1], d ** -0.5, alone, 0.9, 1.1, isa)
                s, n = int(q_start[r]), int(q_len[r])
                assert torch.equal(_bits(alone[s:s + n]), _bits(want[s:s + n])), r
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("isa", ISAS)
def test_rows_bit_check_sees_a_different_reduction_order(isa):
    """The check above can fail: the FlashAttention-style prefill kernel (online softmax over 16-key tiles,
    scores reduced along head_dim in order) computes the same attention within float32 rounding but with
    other bits than the decode kernel's rows, which the rows kernel must reproduce."""
    reqs = [(45, 45), (17, 300)]
    q, cache, table, q_start, q_len, seq_lens = _rows_case(3, reqs, 9, 3, 64, 16, torch.float32)
    rows = torch.zeros_like(q)
    paged_attention_cpu.paged_rows(q, cache, table, q_start, q_len, seq_lens, 0.125, rows, isa=isa)
    flash = torch.zeros_like(q)
    paged_attention_cpu.paged_prefill(q, cache, table, q_start, q_len, seq_lens, 0.125, flash, isa=isa)
    torch.testing.assert_close(flash, rows, atol=1e-5, rtol=1e-5)
    assert not torch.equal(_bits(flash), _bits(rows))


def test_rows_kernel_serves_verify_and_invariant_prefill_requests():
    """The backend sends a short query after cached context (a verify step) and, under batch invariance,
    every multi-token request to the rows kernel; one-token requests stay in the decode group."""
    md, _ = build_attention_metadata([300, 0, 40], [5, 12, 1], [list(range(20)), [20], [21, 22, 23]], 16)
    plan = TorchAttentionBackend._plan(md, 9, 3, torch.device("cpu"), use_kernel=True, use_prefill_kernel=True)
    dec, pre, n, rows = plan
    assert n == 18 and rows.q_len.tolist() == [5] and rows.q_start.tolist() == [0]
    assert dec.rows.tolist() == [17] and type(pre).__name__ == "_KernelPrefillPlan"
    md.cache.clear()
    dec, pre, n, rows = TorchAttentionBackend._plan(md, 9, 3, torch.device("cpu"), use_kernel=True,
                                                    use_prefill_kernel=True, batch_invariant=True)
    assert rows.q_len.tolist() == [5, 12] and rows.q_start.tolist() == [0, 5] and not pre
    assert dec.rows.tolist() == [17]


def _vec_item_decode_library(isa, monkeypatch):
    """The paged-attention library with AVX2 decode on the tiled decode item (DEFINE_VEC_ITEM: GT query heads
    x head_dim in registers, one KV head per walk) instead of the rows item, built with
    ``-DTOKENMILL_DECODE_VEC_ITEM`` under its own cache name."""
    monkeypatch.setitem(cpu_build._ISA_FLAGS, isa, [*cpu_build._ISA_FLAGS[isa], "-DTOKENMILL_DECODE_VEC_ITEM"])
    lib = cpu_build.load_library("paged_attention_vecitem", ["paged_attention.c"], paged_attention_cpu._FUNCTIONS,
                                 "TOKENMILL_CPU_ATTENTION_KERNEL", isa)
    assert lib is not None
    return lib


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d,block", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 8),
                                                    (12, 3, 64, 32), (10, 2, 64, 16), (12, 4, 128, 32),
                                                    (16, 8, 128, 16), (24, 8, 64, 16)])
@pytest.mark.parametrize("isa", [real_param("avx2")])
def test_avx2_decode_on_the_rows_item_keeps_the_tiled_items_bits(kv_dtype, heads, kv_heads, d, block, isa,
                                                                monkeypatch):
    """On AVX2 paged_decode runs the rows kernel's item (all of a request's KV heads per walk, a register plan
    that fits 16 ymm registers); every row must keep the bits of the tiled decode item it replaced (the
    arithmetic the other variants and main's decode use): the same vtsum score reduction, softmax loop and PV
    fma chain. Both builds run the same rows (contexts crossing partial key groups and blocks) with 1 and 2
    threads, whole-request items (batch >= 4) and per-KV-head items (batch 1). The shapes cover the item's
    copy plans: all heads' K and V rows widened in one sweep (9/3 x 64), K only (12/4 x 128, block 32: the V
    block is over the cap, and G = 3 widens V in registers), neither (16/8 x 128), and V in registers with
    one head per item (batch 1, G = 3)."""
    reqs = [(1, n) for n in (1, 7, 8, 9, 16, 17, 45, 262, 300, 33)]
    q, cache, table, _, _, seq_lens = _rows_case(d + heads + block, reqs, heads, kv_heads, d, block, kv_dtype)
    sfx = paged_attention_cpu._suffixes(q, cache)
    ref = _vec_item_decode_library(isa, monkeypatch)
    saved = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            got = paged_attention_cpu.paged_decode(q, cache, table, seq_lens, d ** -0.5, 0.9, 1.1, isa)
            for rows in (slice(None), slice(7, 8)):       # whole-request items; one request: per-KV-head items
                want = torch.full_like(q[rows], float("nan"))
                qq, tt, ll = q[rows].contiguous(), table[rows].contiguous(), seq_lens[rows].contiguous()
                getattr(ref, f"paged_decode_{sfx[0]}_{sfx[1]}")(
                    qq.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), want.data_ptr(), tt.data_ptr(),
                    tt.stride(0), ll.data_ptr(), qq.shape[0], heads, kv_heads, d, block, d ** -0.5, 0.9, 1.1,
                    threads)
                assert torch.equal(_bits(got[rows]), _bits(want)), (threads, rows)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d,block", [(9, 3, 64, 16), (8, 2, 128, 16), (12, 4, 64, 8),
                                                    (6, 3, 24, 16)])
@pytest.mark.parametrize("isa", ISAS)
def test_small_batch_decode_with_prefetch_keeps_the_rows_bits(kv_dtype, heads, kv_heads, d, block, isa):
    """Decode calls with fewer than two requests per thread run per-KV-head items that prefetch their K/V
    rows blocks ahead, V's first blocks during the score pass and the next item's first K blocks (AVX2; on
    other variants the same call without). Prefetching must not touch the arithmetic: every row of a 1-, 2-
    or 3-request call on 1-3 threads (contexts shorter than the prefetch distance, crossing blocks, shuffled
    block tables, the next item in the same or another request) has the bits of the same row run alone
    through paged_rows (no prefetch) and batched with enough requests for whole-request items."""
    ctxs = (1, 5, block, block + 1, 2 * block + 3, 300)
    reqs = [(1, n) for n in ctxs]
    q, cache, table, _, _, seq_lens = _rows_case(d + heads + block + 1, reqs, heads, kv_heads, d, block, kv_dtype)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        batched = paged_attention_cpu.paged_decode(q, cache, table, seq_lens, d ** -0.5, 0.9, 1.1, isa)
        one = torch.ones(1, dtype=torch.int32)
        for r in range(len(ctxs)):
            torch.set_num_threads(1)
            alone = torch.full_like(q[r:r + 1], float("nan"))
            paged_attention_cpu.paged_rows(q[r:r + 1], cache, table[r:r + 1], one * 0, one, seq_lens[r:r + 1],
                                           d ** -0.5, alone, 0.9, 1.1, isa)
            assert torch.equal(_bits(alone), _bits(batched[r:r + 1])), r
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in ([0], [5], [4], [5, 0], [1, 5, 3], [2, 3]):
                got = paged_attention_cpu.paged_decode(q[rows], cache, table[rows].contiguous(), seq_lens[rows],
                                                       d ** -0.5, 0.9, 1.1, isa)
                assert torch.equal(_bits(got), _bits(batched[rows])), (threads, rows)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("heads,kv_heads,d,block", [(9, 3, 64, 16), (8, 2, 128, 16), (12, 3, 64, 32),
                                                    (16, 8, 128, 16)])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_and_verify_on_a_servers_scattered_block_tables(kv_dtype, heads, kv_heads, d, block, isa):
    """Block tables as a long-running server has them: a random, non-monotonic sample of a pool several times
    larger than the requests need, some requests' blocks in short adjacent runs (a prompt from a fresh part of
    the pool) and the rest scattered, the tables' unused columns holding ids far outside the pool. The whole-
    request items (decode batch >= 2 x threads, verify tiles), which prefetch the next block's rows through the
    table, must give every row the bits of one-row-per-token decode calls (each request alone: per-KV-head
    items) and match the torch reference. 8 KV heads x 128: V widened one head at a time over spans of
    blocks (not rows_seqv), the span ahead prefetched."""
    rng = random.Random(11 + d + block)
    g = torch.Generator().manual_seed(5 + heads)
    lens = [1, 16, 17, 31, 33, 100, 257, 300, 64, 7, 129, 200]
    nblk = [-(-n // block) for n in lens]
    pool = 4 * sum(nblk)
    free = list(range(pool))
    rng.shuffle(free)
    table = torch.full((len(lens), max(nblk) + 2), 1 << 30, dtype=torch.int32)
    for r, nb in enumerate(nblk):
        if r % 3 == 0:                       # an adjacent run (ids not in use by the other requests)
            start = pool + r * 40
            ids = list(range(start, start + nb))
        else:
            ids = [free.pop() for _ in range(nb)]
        table[r, :nb] = torch.tensor(ids, dtype=torch.int32)
    size = pool + len(lens) * 40 + 40
    cache = torch.randn(2, size, block, kv_heads, d, generator=g) * 2
    cache = (cache * 30).round().clamp(-127, 127).to(kv_dtype) if kv_dtype == torch.int8 else cache.to(kv_dtype)
    q_dtype = torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32
    q = torch.randn(len(lens), heads, d, generator=g).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = paged_attention_cpu.paged_decode(q, cache, table, seq_lens, d ** -0.5, 0.9, 1.1, isa)
        for r in range(len(lens)):
            alone = paged_attention_cpu.paged_decode(q[r:r + 1], cache, table[r:r + 1].contiguous(), seq_lens[r:r + 1],
                                                     d ** -0.5, 0.9, 1.1, isa)
            assert torch.equal(_bits(got[r:r + 1]), _bits(alone)), r
        # the torch reference: gather each request's positions through its table
        kf, vf = cache[0].float() * 0.9, cache[1].float() * 1.1
        for r, n in enumerate(lens):
            slots = (table[r, :nblk[r]].long()[:, None] * block + torch.arange(block)).flatten()[:n]
            k = kf.flatten(0, 1)[slots].repeat_interleave(heads // kv_heads, 1)      # [n, heads, d]
            v = vf.flatten(0, 1)[slots].repeat_interleave(heads // kv_heads, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * d ** -0.5, -1)
            tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-3 if kv_dtype == torch.int8 else 1e-4   # int8: |k| ~ 100
            torch.testing.assert_close(got[r].float(), torch.einsum("hn,nhd->hd", p, v), atol=tol, rtol=tol)
        # a verify step on the same tables: 1-3 tokens per request, the last ones of its context
        q_len = torch.tensor([min(n, 1 + r % 3) for r, n in enumerate(lens)], dtype=torch.int32)
        qv = torch.randn(int(q_len.sum()), heads, d, generator=g).to(q_dtype)
        q_start = (torch.cumsum(q_len, 0) - q_len).to(torch.int32)
        rows = torch.full_like(qv, float("nan"))
        paged_attention_cpu.paged_rows(qv, cache, table, q_start, q_len, seq_lens, d ** -0.5, rows, 0.9, 1.1, isa)
        row_table = table.repeat_interleave(q_len.long(), 0).contiguous()
        row_lens = torch.tensor([n - int(q_len[r]) + j + 1 for r, n in enumerate(lens) for j in range(int(q_len[r]))],
                                dtype=torch.int32)
        want = paged_attention_cpu.paged_decode(qv, cache, row_table, row_lens, d ** -0.5, 0.9, 1.1, isa)
        assert torch.equal(_bits(rows), _bits(want))
    finally:
        torch.set_num_threads(saved)
