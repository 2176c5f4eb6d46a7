"""Paged attention over a block-table KV cache.

PagedAttention: Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention" (SOSP'23, arXiv 2309.06180, §4.1-4.3).
Each layer's cache is one preallocated pool
``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K,
1 = V); a request's tokens live in the blocks its block table lists, in
order, so token ``t`` of request ``r`` sits in flat slot
``block_tables[r][t // block_size] * block_size + t % block_size``.

The batch is the flattened concatenation of every scheduled request's new
tokens (prefill chunks and single decode tokens mixed, as in Sarathi-Serve,
arXiv 2403.02310 §4). :class:`TorchAttentionBackend` is portable torch code
(CPU and CUDA); a fused kernel can be added behind :class:`AttentionBackend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what they attend to.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, flat cache slot
            (``block_id * block_size + offset``) where each new token's K/V is
            written.
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths;
            request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
            of the flattened batch.
        seq_lens: ``[num_reqs]`` int32, context length of each request after
            this step (cached + new tokens).
        block_tables: ``[num_reqs, max_num_blocks_per_req]`` int32, padded with 0.
        query_lens: python list of the per-request new-token counts.
        seq_lens_list: python copy of ``seq_lens``.
        max_query_len: ``max(query_lens)``.
        max_seq_len: ``max(seq_lens_list)``.
        block_size: tokens per cache block.
        cache: scratch space the backend fills once per step with derived
            tensors (shared by all layers); callers leave it empty.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def is_decode_only(self) -> bool:
        """True when every request computes exactly one token."""
        return self.max_query_len == 1


def build_attention_metadata(num_computed_tokens: Sequence[int], query_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             device: str | torch.device = "cpu") -> tuple[AttentionMetadata, torch.Tensor]:
    """Build the metadata and positions for one flattened batch.

    Args:
        num_computed_tokens: per request, tokens already in the cache (the
            position of its first new token).
        query_lens: per request, new tokens this step (>= 1).
        block_tables: per request, its block ids in order; must cover
            ``num_computed_tokens + query_len`` tokens.
        block_size: tokens per block.
        device: where the tensors go.

    Returns:
        ``(metadata, positions)`` with ``positions`` ``[num_tokens]`` int64.

    Raises:
        ValueError: lengths disagree, a query length is < 1, or a block table
            is too short for its request.
    """
    n = len(query_lens)
    if len(num_computed_tokens) != n or len(block_tables) != n:
        raise ValueError("num_computed_tokens, query_lens and block_tables need one entry per request")
    if n and min(query_lens) < 1:
        raise ValueError(f"every query length must be >= 1, got {list(query_lens)}")
    seq_lens = [int(c) + int(q) for c, q in zip(num_computed_tokens, query_lens)]
    for i, (s, bt) in enumerate(zip(seq_lens, block_tables)):
        if len(bt) * block_size < s:
            raise ValueError(f"request {i}: block table of {len(bt)} blocks cannot hold {s} tokens "
                             f"(block_size {block_size})")
    max_blocks = max((len(bt) for bt in block_tables), default=0)
    bt_np = np.zeros((n, max(max_blocks, 1)), dtype=np.int32)
    for i, bt in enumerate(block_tables):
        bt_np[i, :len(bt)] = bt
    positions = np.concatenate([np.arange(c, c + q, dtype=np.int64)
                                for c, q in zip(num_computed_tokens, query_lens)]) if n else np.zeros(0, np.int64)
    req_of_tok = np.repeat(np.arange(n), list(query_lens))
    slot = bt_np[req_of_tok, positions // block_size].astype(np.int64) * block_size + positions % block_size
    qsl = np.zeros(n + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(query_lens)
    md = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot).to(device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(bt_np).to(device),
        query_lens=[int(q) for q in query_lens],
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
    )
    return md, torch.from_numpy(positions).to(device)


class AttentionBackend:
    """The attention interface the model calls once per layer per step."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write new K/V into the cache, then attend causally over each request's context.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` (rotary already applied to k).
            kv_cache: this layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
            md: the step's :class:`AttentionMetadata`.
            scale: softmax scale (usually ``head_dim ** -0.5``).

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
        """
        raise NotImplementedError


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping`` ``[num_tokens]``."""
    _, nb, bs, kvh, d = kv_cache.shape
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class TorchAttentionBackend(AttentionBackend):
    """Portable paged attention in plain torch (CPU and CUDA).

    * Decode requests (query length 1), whether the whole batch or the decode
      part of a mixed batch, are served by ONE batched op per layer: gather
      K/V through the block tables up to the longest context, mask positions
      past each request's length, and run grouped-query attention
      (Ainslie et al., GQA, arXiv 2305.13245) through
      ``scaled_dot_product_attention(enable_gqa=True)``.
    * Every other request (a prefill or a prefill chunk) runs its own SDPA
      call over its cached prefix (gathered through its block table) plus
      its new tokens, with a causal mask offset by the prefix length. A
      request with no cached prefix attends to its fresh K/V directly.

    No per-request contiguous KV buffer survives a step; the cache pool is the
    only state.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, md.slot_mapping)
        plan = md.cache.get("torch_plan")
        if plan is None:
            plan = md.cache["torch_plan"] = self._plan(md, q.device)
        dec_rows, dec_reqs, dec_max_len, prefill_reqs = plan
        if not prefill_reqs:
            return self._decode(q, kv_cache, md.block_tables, md.seq_lens, dec_max_len, md.block_size, scale)
        out = torch.empty_like(q)
        if dec_rows is not None:
            out[dec_rows] = self._decode(q[dec_rows], kv_cache, md.block_tables[dec_reqs], md.seq_lens[dec_reqs],
                                         dec_max_len, md.block_size, scale)
        for i, s, e in prefill_reqs:
            out[s:e] = self._prefill_one(q[s:e], k[s:e], v[s:e], kv_cache, md, i, scale)
        return out

    @staticmethod
    def _plan(md: AttentionMetadata, device: torch.device):
        """Split requests into the batched decode group and per-request prefills (once per step)."""
        starts = np.zeros(md.num_reqs + 1, dtype=np.int64)
        starts[1:] = np.cumsum(md.query_lens)
        dec = [i for i, ql in enumerate(md.query_lens) if ql == 1]
        prefill = [(i, int(starts[i]), int(starts[i + 1])) for i, ql in enumerate(md.query_lens) if ql != 1]
        dec_max_len = max((md.seq_lens_list[i] for i in dec), default=0)
        if not prefill or not dec:
            return None, None, dec_max_len, prefill
        rows = torch.tensor(starts[dec], dtype=torch.long, device=device)
        reqs = torch.tensor(dec, dtype=torch.long, device=device)
        return rows, reqs, dec_max_len, prefill

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                max_len: int, block_size: int, scale: float) -> torch.Tensor:
        """One batched attention for ``B`` single-token queries ``q`` ``[B, H, D]`` -> ``[B, H, D]``."""
        b, h, d = q.shape
        kvh = kv_cache.shape[3]
        nblk = _ceil_div(max_len, block_size)
        kv = kv_cache[:, block_tables[:, :nblk]]                       # [2, B, nblk, bs, KVH, D]
        kv = kv.view(2, b, nblk * block_size, kvh, d).transpose(2, 3)  # [2, B, KVH, L, D]
        mask = torch.arange(nblk * block_size, device=q.device)[None, :] < seq_lens[:, None].to(torch.long)
        out = F.scaled_dot_product_attention(q[:, :, None, :], kv[0], kv[1], attn_mask=mask[:, None, None, :],
                                             scale=scale, enable_gqa=h != kvh)
        return out[:, :, 0, :]

    @staticmethod
    def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     md: AttentionMetadata, i: int, scale: float) -> torch.Tensor:
        """Attention for request ``i``'s ``n`` new tokens ``q`` ``[n, H, D]`` over its whole context."""
        n, h, _ = q.shape
        ctx = md.seq_lens_list[i]
        if ctx == n:  # no cached prefix: the fresh K/V are the whole context
            ks, vs, mask, causal = k, v, None, True
        else:
            _, _, bs, kvh, d = kv_cache.shape
            nblk = _ceil_div(ctx, bs)
            kv = kv_cache[:, md.block_tables[i, :nblk]].reshape(2, nblk * bs, kvh, d)[:, :ctx]
            ks, vs = kv[0], kv[1]
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
            causal = False
        out = F.scaled_dot_product_attention(q.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                             attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=h != ks.shape[1])
        return out.transpose(0, 1)


def get_attention_backend(device: str | torch.device) -> AttentionBackend:
    """The attention backend for ``device`` (today :class:`TorchAttentionBackend` everywhere)."""
    return TorchAttentionBackend()
