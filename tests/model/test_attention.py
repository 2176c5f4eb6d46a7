"""Paged attention backend vs a dense causal reference (no cache)."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.model.layers.attention import (AttentionMetadata, TorchAttentionBackend, build_attention_metadata,
                                              get_attention_backend)


def dense_causal(q, k, v, scale):
    """Reference: full causal softmax attention over one sequence, GQA by repeating K/V heads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    t = q.shape[0]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v.double()).to(q.dtype)


# Each step lists (request, start, end): the request's tokens [start, end) are computed that step.
SCHEDULE = [
    [("A", 0, 5), ("B", 0, 9)],                      # a prefill chunk + a whole prefill
    [("B", 9, 10), ("A", 5, 11), ("C", 0, 1)],       # decode + later chunk + 1-token prompt (mixed)
    [("A", 11, 12), ("C", 1, 6)],                    # decode + chunk with a cached prefix
    [("A", 12, 13), ("C", 6, 7), ("B", 10, 11)],     # decode-only batch
    [("C", 7, 8)],                                   # single decode
]
LENS = {"A": 13, "B": 11, "C": 8}


def run_schedule(heads, kv_heads, block_size, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    d = 16
    seqs = {r: (torch.randn(n, heads, d, dtype=dtype), torch.randn(n, kv_heads, d, dtype=dtype),
                torch.randn(n, kv_heads, d, dtype=dtype)) for r, n in LENS.items()}
    num_blocks = 40
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, d, dtype=dtype)
    pool = list(range(1, num_blocks))  # block 0 stays unused: it is the table's pad value
    random.Random(seed).shuffle(pool)
    tables = {r: [pool.pop() for _ in range(-(-n // block_size))] for r, n in LENS.items()}
    backend = TorchAttentionBackend()
    scale = d ** -0.5
    got = {r: torch.full((n, heads, d), float("nan"), dtype=dtype) for r, n in LENS.items()}
    for step in SCHEDULE:
        md, pos = build_attention_metadata([s for _, s, _ in step], [e - s for _, s, e in step],
                                           [tables[r] for r, _, _ in step], block_size)
        q = torch.cat([seqs[r][0][s:e] for r, s, e in step])
        k = torch.cat([seqs[r][1][s:e] for r, s, e in step])
        v = torch.cat([seqs[r][2][s:e] for r, s, e in step])
        out = backend.forward(q, k, v, cache, md, scale)
        assert out.shape == q.shape and out.dtype == dtype
        row = 0
        for r, s, e in step:
            got[r][s:e] = out[row:row + e - s]
            row += e - s
    want = {r: dense_causal(*seqs[r], scale) for r in LENS}
    return got, want, cache, tables, seqs


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_matches_dense_reference(heads, kv_heads, block_size):
    got, want, _, _, _ = run_schedule(heads, kv_heads, block_size)
    for r in LENS:
        torch.testing.assert_close(got[r], want[r], atol=1e-5, rtol=1e-5, msg=f"request {r}")


def test_cache_holds_kv_at_block_table_slots():
    _, _, cache, tables, seqs = run_schedule(4, 2, 4)
    for r, n in LENS.items():
        for t in range(n):
            b, o = tables[r][t // 4], t % 4
            assert torch.equal(cache[0, b, o], seqs[r][1][t])
            assert torch.equal(cache[1, b, o], seqs[r][2][t])


def test_bfloat16_close_to_reference():
    got, want, _, _, _ = run_schedule(4, 2, 4, dtype=torch.bfloat16)
    for r in LENS:
        torch.testing.assert_close(got[r].float(), want[r].float(), atol=3e-2, rtol=3e-2)


def test_single_prefill_equals_reference_and_uses_no_cache_read():
    torch.manual_seed(1)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cache = torch.zeros(2, 8, 4, 2, 8)
    md, _ = build_attention_metadata([0], [10], [[5, 2, 7]], 4)
    out = get_attention_backend("cpu").forward(q, k, v, cache, md, 8 ** -0.5)
    torch.testing.assert_close(out, dense_causal(q, k, v, 8 ** -0.5), atol=1e-5, rtol=1e-5)


def test_metadata_builder():
    md, pos = build_attention_metadata([3, 0], [2, 3], [[7, 2], [4]], block_size=4)
    assert pos.tolist() == [3, 4, 0, 1, 2]
    # request 0: token 3 -> block 7 offset 3; token 4 -> block 2 offset 0
    assert md.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 16, 17, 18]
    assert md.query_start_loc.tolist() == [0, 2, 5]
    assert md.seq_lens.tolist() == [5, 3] and md.seq_lens_list == [5, 3]
    assert md.block_tables.tolist() == [[7, 2], [4, 0]]
    assert md.block_tables.dtype == torch.int32 and md.slot_mapping.dtype == torch.int64
    assert (md.max_query_len, md.max_seq_len, md.num_tokens, md.is_decode_only) == (3, 5, 5, False)
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([4], [1], [[0]], block_size=4)


def test_metadata_constructed_by_hand_is_accepted():
    """The runner may build AttentionMetadata itself with only the documented fields."""
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cache = torch.zeros(2, 4, 2, 2, 8)
    md = AttentionMetadata(slot_mapping=torch.tensor([6, 7]), query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
                           seq_lens=torch.tensor([2], dtype=torch.int32),
                           block_tables=torch.tensor([[3]], dtype=torch.int32), query_lens=[2], seq_lens_list=[2],
                           max_query_len=2, max_seq_len=2, block_size=2)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, 0.5)
    torch.testing.assert_close(out, dense_causal(q, k, v, 0.5), atol=1e-5, rtol=1e-5)
