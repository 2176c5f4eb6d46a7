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

import abc
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.model.layers import paged_attention_cpu
from tokenmill.model.layers.kv_quant import KVScales, dequantize, is_quantized, quantize


#: With the fused CPU decode kernel, a request with at most this many new tokens (a speculative-decoding
#: verify step: its last token and the drafts) runs as that many decode rows instead of a prefill. Measured
#: side by side on the 2-core EPYC (one layer, 9/3 heads, bfloat16, one thread): 5 rows after 256 cached
#: tokens 74 vs 98 us with the prefill kernel, 9 rows after 600 270 vs 299 us.
SHORT_QUERY_AS_DECODE = 8


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
        cache: scratch space the backend fills on the first layer with
            derived tensors (gather indices, masks) shared by all layers;
            callers leave it empty and build a new metadata object per step
            (or clear it before reusing one).
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


class AttentionBackend(abc.ABC):
    """The attention interface the model calls once per layer per step."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        """Write new K/V into the cache, then attend causally over each request's context.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` (rotary already applied to k).
            kv_cache: this layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
                (contiguous).
            md: the step's :class:`AttentionMetadata`.
            scale: softmax scale (usually ``head_dim ** -0.5``).
            kv_scales: this layer's K/V scales for a quantised cache (int8 / fp8; see
                :mod:`tokenmill.model.layers.kv_quant`); None means 1.0. With
                ``kv_scales.calculate`` set they are computed from this batch's K/V first.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
        """


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping`` ``[num_tokens]``.

    A quantised cache (int8 / fp8) receives ``quantize(k, k_scale)`` and ``quantize(v, v_scale)``.
    """
    _, nb, bs, kvh, d = kv_cache.shape
    if is_quantized(kv_cache.dtype):
        kq, vq = quantize(k, k_scale, kv_cache.dtype), quantize(v, v_scale, kv_cache.dtype)
        # index_copy_ on the raw bytes: float8 index_copy_ is not implemented on every device
        raw = kv_cache.view(torch.uint8) if kv_cache.dtype != torch.int8 else kv_cache
        raw[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, kq.view(raw.dtype))
        raw[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, vq.view(raw.dtype))
        return
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


@dataclass
class _DecodePlan:
    """Per-step gather indices for the batched decode group (shared by all layers)."""

    rows: torch.Tensor | None    # [B] token rows of the decode requests (None: the whole batch)
    block_tables: torch.Tensor   # [B, max_blocks] int32 of the group
    seq_lens: torch.Tensor       # [B] int32 of the group
    length: int                  # L: longest decode context in the group
    kernel: bool                 # served by the fused CPU kernel (no gather indices built)
    kv_rows: torch.Tensor | None = None  # [B * KVH * L] int64 rows of the cache viewed as [slots * KVH, D]
    pad: torch.Tensor | None = None      # [B, 1, 1, L] bool, True past the request's context
    has_pad: bool = False                # some request of the group is shorter than L


@dataclass
class _KernelPrefillPlan:
    """Every prefill/chunk request of the step, for one call of the fused CPU prefill kernel."""

    block_tables: torch.Tensor  # [R, max_blocks] int32
    q_start: torch.Tensor       # [R] int32 first token row of each request
    q_len: torch.Tensor         # [R] int32 new tokens
    seq_lens: torch.Tensor      # [R] int32 context after this step


@dataclass
class _RowsPlan:
    """Requests served as decode rows with several tokens (a verify step, a batch-invariant prompt or chunk):
    one call of the CPU rows kernel, each request's context read once per tile of its rows."""

    block_tables: torch.Tensor  # [R, max_blocks] int32
    q_start: torch.Tensor       # [R] int32 first token row of each request
    q_len: torch.Tensor         # [R] int32 new tokens
    seq_lens: torch.Tensor      # [R] int32 context after this step


def _ragged_plan_args(md, starts, which: list[int], device) -> tuple[torch.Tensor, ...]:
    """``(block_tables, q_start, q_len, seq_lens)`` of the step's requests ``which``, for a ragged-query kernel
    plan (:class:`_KernelPrefillPlan`, :class:`_RowsPlan`)."""
    idx = torch.tensor(which, device=device)
    return (md.block_tables[idx].contiguous(), torch.tensor(starts[which], dtype=torch.int32, device=device),
            torch.tensor([md.query_lens[i] for i in which], dtype=torch.int32, device=device),
            md.seq_lens[idx].contiguous())


@dataclass
class _PrefillPlan:
    """One prefill/chunk request: its token rows and (with a cached prefix) gather indices."""

    req: int
    start: int
    end: int
    kv_rows: torch.Tensor | None  # [H * ctx] rows of the cache viewed as [slots * KVH, D], heads repeated
    mask: torch.Tensor | None     # [n, ctx] bool causal mask offset by the prefix length


class TorchAttentionBackend(AttentionBackend):
    """Portable paged attention in plain torch (CPU and CUDA).

    * Decode requests (query length 1), whether the whole batch or the decode
      part of a mixed batch, are served by ONE batched op per layer: K/V rows
      are gathered through the block tables straight into a
      ``[B, KVH, L, D]`` layout (one ``index_select`` over the cache viewed as
      ``[slots * KVH, D]``), positions past each request's length are masked,
      and grouped-query attention (Ainslie et al., GQA, arXiv 2305.13245) runs
      as two batched matmuls with the ``G = H / KVH`` query heads of a group
      as the rows, so K/V are never repeated.
    * Every other request (a prefill or a prefill chunk) runs its own
      ``scaled_dot_product_attention`` over its cached prefix plus its new
      tokens, with a causal mask offset by the prefix length. A request with
      no cached prefix attends to its fresh K/V directly.

    Gather indices and masks are computed once per step (the first layer) and
    cached in ``md.cache``. No per-request contiguous KV buffer survives a
    step; the cache pool is the only state.

    Measured on the 2-core CPU (float32, B = 32, L = 512, one layer): the
    row-granular gather + matmuls take 6.9 ms against 10.5 ms for a
    block-granular gather followed by a head permute, and SDPA's
    ``enable_gqa`` path was 2-10x slower than either.

    On CPU with float32/bfloat16 the decode group instead goes to the fused
    kernel of :mod:`tokenmill.model.layers.paged_attention_cpu`, which reads
    K/V straight from the block pool (no gather copy): 2-2.8x faster than
    the gather + matmuls over 30 layers at B = 32, L = 257, measured side by
    side. Prefill and prefill-chunk requests likewise go, all in one call
    per layer, to that module's prefill kernel (FlashAttention-2-style
    online softmax over the paged cache; AVX-512, head_dim 64/128): no
    gather of the cached prefix and no per-head repeat of K/V. Measured side
    by side against this class's SDPA path on the 2-core machine (one
    layer, 9/3 heads, bfloat16): 1.7x for a 512-token prompt, 1.1-1.2x for
    a 256-token chunk after a 768-token prefix and for a 2048-token prompt.
    A request with at most :data:`SHORT_QUERY_AS_DECODE` new tokens after
    cached context (a speculative-decoding verify step) is served as decode rows, one per
    token (row ``j`` sees ``seq_len - query_len + j + 1`` positions), each computed exactly as
    a one-token step computes it: by the rows kernel
    (:func:`~tokenmill.model.layers.paged_attention_cpu.paged_rows`, the decode kernel's
    per-row arithmetic with each request's context read once per tile of rows; main expanded
    such a request into per-token decode rows, which read the context once per row). ``use_cpu_kernel=False`` (or a failed kernel build) keeps the torch
    path; CUDA always takes the torch path until a fused GPU kernel is added
    behind :class:`AttentionBackend`.

    A quantised cache (``--kv-cache-dtype`` int8 / fp8) is read the same
    ways: the CPU kernels widen each element on load and fold the layer's
    K/V scales into the query scale and the output; the torch path
    dequantises the gathered rows (and the fresh K/V of a prompt without a
    cached prefix go through the same quantise/dequantise round trip, so
    every path sees the values the cache holds). A float cache of another
    dtype than the query (a float32 model's bfloat16 cache, the CPU low-bit
    path's default) is widened likewise.

    Args:
        use_cpu_kernel: allow the fused CPU kernels.
        cpu_isa: kernel variant (``avx512``, ``avx2``, ``scalar``; None: this CPU's best).
        prefill_kernel: use the CPU prefill kernel (None: where it beats SDPA, see
            :func:`~tokenmill.model.layers.paged_attention_cpu.prefill_preferred`).
        batch_invariant: with the CPU kernels, every query row (a decode token, a prompt or chunk token,
            a verify row) is computed with the decode kernel's arithmetic as its own row over its own context
            (one-token requests by the decode kernel, longer ones by the rows kernel, same bits)
            (``seq_len - query_len + j + 1`` positions), so a token's attention output has the same bits
            whether it was computed in a decode step, in a prefill or chunk of any size, after a
            prefix-cache hit or in a recompute after preemption, and whatever else is in the batch or the
            thread count (docs/guide/batch_invariance.md). The runner sets it from
            ``--batch-invariant`` (default on); off, prefills take the FlashAttention-style prefill
            kernel, whose online softmax rounds differently from the decode kernel's two passes.
    """

    def __init__(self, use_cpu_kernel: bool = True, cpu_isa: str | None = None,
                 prefill_kernel: bool | None = None, batch_invariant: bool = False) -> None:
        self.use_cpu_kernel = use_cpu_kernel
        self.cpu_isa = cpu_isa
        self.prefill_kernel = prefill_kernel
        self.batch_invariant = batch_invariant
        self._workspace: torch.Tensor | None = None

    def _gather(self, kv_cache: torch.Tensor, kv_rows: torch.Tensor) -> torch.Tensor:
        """K/V rows ``kv_rows`` of the cache viewed as ``[2, slots * KVH, D]`` -> ``[2, len(kv_rows), D]``.

        Copies into a workspace kept across layers and steps (grown on
        demand): a fresh multi-megabyte tensor per layer costs page faults
        that, measured on the 2-core CPU, took longer than the copy itself.
        The result is only valid until the next call.
        """
        d = kv_cache.shape[-1]
        n = kv_rows.numel()
        ws = self._workspace
        if ws is None or ws.dtype != kv_cache.dtype or ws.device != kv_cache.device or ws.shape[1] < n:
            ws = self._workspace = torch.empty(2, max(n, 1), d, dtype=kv_cache.dtype, device=kv_cache.device)
        flat = kv_cache.view(2, -1, d)
        out = ws[:, :n]
        torch.index_select(flat[0], 0, kv_rows, out=out[0])
        torch.index_select(flat[1], 0, kv_rows, out=out[1])
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`.

        Rows of ``q``/``k``/``v`` beyond ``sum(md.query_lens)`` are padding
        (a compiled step runs a fixed bucket size): their K/V are written to
        the slots ``md.slot_mapping`` gives them (a scratch block no request
        owns) and their output rows are zero.
        """
        ks = vs = 1.0
        if kv_scales is not None and is_quantized(kv_cache.dtype):
            if kv_scales.calculate:
                n = md.num_tokens
                kv_scales.maybe_calculate(k[:n], v[:n], kv_cache.dtype)
            ks, vs = kv_scales.k, kv_scales.v
        plan = md.cache.get("torch_plan")
        if plan is None:
            use_kernel = self.use_cpu_kernel and paged_attention_cpu.supports(q, kv_cache, self.cpu_isa)
            use_prefill_kernel = (use_kernel and paged_attention_cpu.prefill_supports(q, kv_cache, self.cpu_isa)
                                  and (self.prefill_kernel if self.prefill_kernel is not None
                                       else paged_attention_cpu.prefill_preferred(self.cpu_isa)))
            plan = md.cache["torch_plan"] = self._plan(md, q.shape[1], kv_cache.shape[3], q.device, use_kernel,
                                                       use_prefill_kernel, self.batch_invariant)
            md.cache["kv_write_kernel"] = use_kernel and paged_attention_cpu.write_kv_supports(k, v, kv_cache,
                                                                                               self.cpu_isa)
        if md.cache.get("kv_write_kernel", False):   # one C call: scatter (and quantise) this step's K/V
            paged_attention_cpu.write_kv(kv_cache, k, v, md.slot_mapping, ks, vs, self.cpu_isa)
        else:
            write_kv(kv_cache, k, v, md.slot_mapping, ks, vs)
        dec, prefills, num_tokens, rows = plan
        if q.shape[0] != num_tokens:
            out = q.new_zeros(q.shape)
            out[:num_tokens] = self._forward(q[:num_tokens], k[:num_tokens], v[:num_tokens], kv_cache,
                                             dec, prefills, scale, ks, vs, rows)
            return out
        return self._forward(q, k, v, kv_cache, dec, prefills, scale, ks, vs, rows)

    def _forward(self, q, k, v, kv_cache, dec, prefills, scale, ks: float = 1.0, vs: float = 1.0,
                 rows: _RowsPlan | None = None) -> torch.Tensor:
        if not prefills and rows is None:
            return self._decode(q, kv_cache, dec, scale, ks, vs)
        out = torch.empty_like(q)
        if dec is not None:
            out[dec.rows] = self._decode(q[dec.rows], kv_cache, dec, scale, ks, vs)
        if rows is not None:
            paged_attention_cpu.paged_rows(q.contiguous(), kv_cache, rows.block_tables, rows.q_start, rows.q_len,
                                           rows.seq_lens, scale, out, ks, vs, self.cpu_isa)
        if isinstance(prefills, _KernelPrefillPlan):
            paged_attention_cpu.paged_prefill(q.contiguous(), kv_cache, prefills.block_tables, prefills.q_start,
                                              prefills.q_len, prefills.seq_lens, scale, out, ks, vs, self.cpu_isa)
            return out
        for p in prefills:
            out[p.start:p.end] = self._prefill_one(q[p.start:p.end], k[p.start:p.end], v[p.start:p.end],
                                                   kv_cache, p, scale, ks, vs)
        return out

    @staticmethod
    def _plan(md: AttentionMetadata, num_heads: int, num_kv_heads: int, device: torch.device,
              use_kernel: bool = False, use_prefill_kernel: bool = False, batch_invariant: bool = False):
        """Split requests into the batched decode group and the prefills; build gather indices.

        With ``use_prefill_kernel`` the prefills are one :class:`_KernelPrefillPlan`
        (no gather indices); otherwise a list of :class:`_PrefillPlan`. With ``batch_invariant`` and
        ``use_kernel`` every request is served as decode rows, one per new token: one-token requests in the
        decode group, longer ones in one :class:`_RowsPlan` (the rows kernel). Returns
        ``(decode plan or None, prefills, num_tokens, rows plan or None)``.
        """
        bs = md.block_size
        starts = np.zeros(md.num_reqs + 1, dtype=np.int64)
        starts[1:] = np.cumsum(md.query_lens)
        # With the decode kernel, a short query (a verify step: the last token and its drafts) becomes that
        # many decode rows, row j with context seq_len - ql + j + 1: the causal mask for free, and each row
        # computed exactly as a decode step computes it.
        # Only a query that follows cached context qualifies: a whole short prompt keeps the prefill path, whose
        # numerics with a quantised KV cache (int8/fp8) are what the documented divergence bound was measured on.
        short = SHORT_QUERY_AS_DECODE if use_kernel else 1
        sl_list = md.seq_lens_list
        as_dec = [ql == 1 or (ql <= short and sl_list[i] > ql) or (batch_invariant and use_kernel)
                  for i, ql in enumerate(md.query_lens)]
        rows_plan = None
        multi = [i for i, d in enumerate(as_dec) if d and md.query_lens[i] > 1]
        if multi:   # as_dec admits a multi-token query only with the kernel: the rows kernel serves them
            rows_plan = _RowsPlan(*_ragged_plan_args(md, starts, multi, device))
        dec = [i for i, d in enumerate(as_dec) if d and md.query_lens[i] == 1]
        prefills = []
        pre = [i for i, d in enumerate(as_dec) if not d]
        if use_prefill_kernel and pre:
            prefills = _KernelPrefillPlan(*_ragged_plan_args(md, starts, pre, device))
            pre = []
        for i in pre:
            ql, ctx, s, e = md.query_lens[i], md.seq_lens_list[i], int(starts[i]), int(starts[i + 1])
            rows = mask = None
            if ctx != ql:
                pos = torch.arange(ctx, device=device)
                slots = md.block_tables[i, pos // bs].to(torch.long) * bs + pos % bs            # [ctx]
                heads = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)  # [H]
                rows = (slots[None, :] * num_kv_heads + heads[:, None]).reshape(-1)
                mask = torch.ones(ql, ctx, dtype=torch.bool, device=device).tril(ctx - ql)
            prefills.append(_PrefillPlan(i, s, e, rows, mask))
        dplan = None
        if dec:
            whole = len(dec) == md.num_reqs   # no prefill in the step: the decode group is the batch
            bt = md.block_tables if whole else md.block_tables[torch.tensor(dec, device=device)]
            sl = md.seq_lens if whole else md.seq_lens[torch.tensor(dec, device=device)]
            length = max(md.seq_lens_list[i] for i in dec)
            rows = None if whole else torch.tensor(starts[dec], dtype=torch.long, device=device)
            dplan = _DecodePlan(rows, bt, sl, length, kernel=use_kernel)
            if not use_kernel:
                pos = torch.arange(length, device=device)
                slots = bt[:, pos // bs].to(torch.long) * bs + pos % bs                        # [B, L]
                kvh = torch.arange(num_kv_heads, device=device)
                dplan.kv_rows = (slots[:, None, :] * num_kv_heads + kvh[None, :, None]).reshape(-1)  # [B*KVH*L]
                dplan.pad = (pos[None, :] >= sl[:, None].to(torch.long))[:, None, None, :]
                dplan.has_pad = min(md.seq_lens_list[i] for i in dec) < length
        return dplan, prefills, int(starts[-1]), rows_plan

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float,
                ks: float = 1.0, vs: float = 1.0) -> torch.Tensor:
        """One batched attention for ``B`` single-token queries ``q`` ``[B, H, D]`` -> ``[B, H, D]``."""
        if plan.kernel:
            return paged_attention_cpu.paged_decode(q, kv_cache, plan.block_tables, plan.seq_lens, scale, ks, vs,
                                                    self.cpu_isa)
        b, h, d = q.shape
        kvh = kv_cache.shape[3]
        kv = self._gather(kv_cache, plan.kv_rows).view(2, b, kvh, plan.length, d)
        kc, vc = kv[0], kv[1]
        if is_quantized(kv_cache.dtype):
            kc, vc = dequantize(kc, ks, q.dtype), dequantize(vc, vs, q.dtype)
        elif kc.dtype != q.dtype:   # a float32 model's bfloat16 cache
            kc, vc = kc.to(q.dtype), vc.to(q.dtype)
        if plan.has_pad:   # positions past a request's context were never written (the pool is not zeroed)
            vc = vc.masked_fill(plan.pad.reshape(b, 1, plan.length, 1), 0)
        scores = torch.matmul(q.view(b, kvh, h // kvh, d), kc.transpose(-1, -2)).float() * scale
        scores.masked_fill_(plan.pad, float("-inf"))                     # [B, KVH, G, L]
        probs = scores.softmax(dim=-1).to(q.dtype)
        return torch.matmul(probs, vc).reshape(b, h, d)

    def _prefill_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     plan: _PrefillPlan, scale: float, ks: float = 1.0, vs: float = 1.0) -> torch.Tensor:
        """Attention for one request's ``n`` new tokens ``q`` ``[n, H, D]`` over its whole context.

        K/V come with heads already repeated to ``H`` (gathered that way, or
        ``repeat_interleave`` of the fresh ones) and the call is 4-D (batch
        1): on CPU this reaches SDPA's fused flash kernel, ~3x faster than
        the 3-D ``enable_gqa`` call at 512 tokens.
        """
        n, h, d = q.shape
        quant = is_quantized(kv_cache.dtype)
        if plan.kv_rows is None:  # no cached prefix: the fresh K/V are the whole context
            if quant:   # the values the cache holds
                k = dequantize(quantize(k, ks, kv_cache.dtype), ks, q.dtype)
                v = dequantize(quantize(v, vs, kv_cache.dtype), vs, q.dtype)
            elif kv_cache.dtype != q.dtype:
                k, v = k.to(kv_cache.dtype).to(q.dtype), v.to(kv_cache.dtype).to(q.dtype)
            g = h // k.shape[1]
            kk, vv = k.transpose(0, 1), v.transpose(0, 1)
            if g > 1:
                kk, vv = kk.repeat_interleave(g, dim=0), vv.repeat_interleave(g, dim=0)
        else:
            kv = self._gather(kv_cache, plan.kv_rows).view(2, h, -1, d)
            kt, vt = kv[0], kv[1]
            if quant:
                kt, vt = dequantize(kt, ks, q.dtype), dequantize(vt, vs, q.dtype)
            elif kt.dtype != q.dtype:
                kt, vt = kt.to(q.dtype), vt.to(q.dtype)
            kk, vv = kt, vt
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None], attn_mask=plan.mask,
                                             is_causal=plan.mask is None, scale=scale)
        return out[0].transpose(0, 1)


def get_attention_backend(device: str | torch.device) -> AttentionBackend:
    """The attention backend for ``device`` (today :class:`TorchAttentionBackend` everywhere)."""
    return TorchAttentionBackend()
