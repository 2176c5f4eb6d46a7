"""Fused paged-attention kernels for the CPU (C, OpenMP): decode and prefill, every ISA, every KV dtype.

PagedAttention decode (Kwon et al., arXiv 2309.06180, §4.1): every request
has one new query token and attends to its whole context, which lives in
the blocks its block table lists. The portable torch path first gathers
each request's K/V into a contiguous ``[B, KVH, L, D]`` tensor and then runs
two batched matmuls; on the 2-core CPU the gather copy and the tiny
matmuls (3 query rows per KV head) took ~35% of a batch-32 decode step.
This kernel reads K and V once, straight from the block pool:

    for each work item (request b, KV heads h0..h1) in parallel (OpenMP):
        for each KV head h, query head g of its group:
            s[g, l] = scale · k_scale · q[b, h·G + g] · K[slot(b, l), h]    for l < seq_len[b]
            p = softmax(s) (float32)
            out[b, h·G + g] = v_scale · Σ_l p[g, l] · V[slot(b, l), h]

with ``slot(b, l) = block_tables[b, l // block_size] · block_size + l % block_size``
and ``G = H / KVH`` query heads sharing a KV head (GQA, arXiv 2305.13245).
:func:`paged_rows` serves several query rows of a request (a verify step's
last token and drafts, a batch-invariant prompt's tokens) with the decode
kernel's per-row arithmetic, reading each request's context once per tile of
rows instead of once per row. The prefill kernel (:func:`paged_prefill`) is FlashAttention-2's online
softmax (Dao, arXiv 2307.08691, Algorithm 1) over 16-key tiles of the paged
cache, for every prefill/chunk request of a step in one call.

Cache element types: float32 and bfloat16 (the model's dtype; a float32
model may also keep a bfloat16 cache, the default of its low-bit CPU path,
see :func:`~tokenmill.model.layers.kv_quant.resolve_kv_cache_dtype`), and the
quantised KV caches of ``--kv-cache-dtype``: int8, fp8 e4m3fn, fp8 e5m2,
each with one float scale per layer for K and one for V (the cache holds
``x / scale``). Every element is widened to float32 on load; accumulation is
float32. Query and output: float32 or bfloat16.

One C source (``tokenmill/model/csrc/paged_attention.c`` over the vector
layer ``csrc/vec.h``) is compiled per instruction-set variant by
:mod:`tokenmill.model.layers.cpu_build`: AVX-512 (16-wide), AVX2+FMA
(8-wide) and scalar; head_dim 64 and 128 take the register-tiled vector
loops, other head sizes a scalar decode loop (prefill: the caller's SDPA
path). A decode work item is a whole request (all KV heads) when there are
at least two requests per thread, so it walks each block's contiguous
``[block_size, KVH, D]`` K and V once and prefetches the block two ahead;
smaller batches split requests by KV head to keep every thread busy.
Measured on the 2-core AVX-512 machine (30 layers, each its own cache so
K/V come from DRAM as in a real step; B = 32, contexts 257): 1.3-1.45x the
previous per-(request, head) scalar kernel in bfloat16 and 1.1x in float32,
and within ~1.2x of a plain block-gather copy of the same K/V.

Built on first use (system ``cc``, cached per user, shares torch's OpenMP
pool). When no compiler is available or the build fails, :func:`load`
returns None and the caller keeps the torch path.
``TOKENMILL_CPU_ATTENTION_KERNEL=0`` disables it.
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.model.layers.cpu_build import load_library


_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_DECODE_ARGTYPES = [_P] * 5 + [_I, _P] + [_I] * 5 + [_F, _F, _F, _N]
_PREFILL_ARGTYPES = [_P] * 5 + [_I] + [_P] * 3 + [_I] * 5 + [_F, _F, _F, _N]

#: torch dtype -> the kernels' type suffix (query/output types are the first two).
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "i8",
                torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_COMBOS = [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16")] + [(qs, ks) for qs in ("f32", "bf16") for ks in ("i8", "e4m3", "e5m2")]
_KV_WRITE_ARGTYPES = [_P, _P, _P, _I, _I, _I, _I, _P, _P, _F, _F]
_FUNCTIONS = {**{f"paged_decode_{qs}_{ks}": _DECODE_ARGTYPES for qs, ks in _COMBOS},
              **{f"kv_write_{qs}_{ks}": _KV_WRITE_ARGTYPES for qs, ks in _COMBOS},
              **{f"paged_prefill_{qs}_{ks}": _PREFILL_ARGTYPES for qs, ks in _COMBOS},
              **{f"paged_rows_{qs}_{ks}": _PREFILL_ARGTYPES for qs, ks in _COMBOS},
              "paged_attention_isa": [_P]}
_ISA_NAMES = {1: "scalar", 2: "avx2", 3: "avx512"}


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library (``csrc/paged_attention.c``) for variant ``isa`` (None: this CPU's
    best, see :func:`~tokenmill.model.layers.cpu_build.cpu_isa`), built on first use; None when
    unavailable (logged once)."""
    return load_library("paged_attention", ["paged_attention.c"], _FUNCTIONS, "TOKENMILL_CPU_ATTENTION_KERNEL", isa)


def compiled_isa(isa: str | None = None) -> str | None:
    """The vector path the loaded library was compiled for (``avx512``, ``avx2``, ``scalar``), None if unavailable."""
    lib = load(isa)
    if lib is None:
        return None
    level = ctypes.c_int(0)
    lib.paged_attention_isa(ctypes.byref(level))
    return _ISA_NAMES[level.value]


def _suffixes(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[str, str] | None:
    qs, ks = DTYPE_SUFFIX.get(q.dtype), DTYPE_SUFFIX.get(kv_cache.dtype)
    return (qs, ks) if (qs, ks) in _COMBOS else None


def supports(q: torch.Tensor, kv_cache: torch.Tensor, isa: str | None = None) -> bool:
    """True when the decode kernel can serve this call: CPU, query float32/bfloat16 with a cache of the
    same dtype, a bfloat16 cache for a float32 query, or a quantised one (int8, fp8 e4m3fn/e5m2), GQA heads
    divide evenly, library loaded."""
    return (q.device.type == "cpu" and kv_cache.device.type == "cpu" and _suffixes(q, kv_cache) is not None
            and q.shape[1] % kv_cache.shape[3] == 0 and kv_cache.is_contiguous() and load(isa) is not None)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, k_scale: float = 1.0, v_scale: float = 1.0, isa: str | None = None) -> torch.Tensor:
    """Decode attention for ``B`` single-token queries straight from the paged cache.

    Args:
        q: ``[B, H, D]`` float32 or bfloat16 (made contiguous if needed).
        kv_cache: ``[2, num_blocks, block_size, KVH, D]`` contiguous: ``q.dtype``, bfloat16 (float32 ``q``), or int8 /
            float8_e4m3fn / float8_e5m2 holding ``x / k_scale`` (K) and ``x / v_scale`` (V).
        block_tables: ``[B, >= ceil(max(seq_lens) / block_size)]`` int32, last dim contiguous.
        seq_lens: ``[B]`` int32 context lengths (including the new token, whose K/V
            must already be in the cache).
        scale: softmax scale.
        k_scale, v_scale: the cache's dequantisation scales (1.0 for float caches).
        isa: kernel variant (None: this CPU's best).

    Returns:
        ``[B, H, D]`` in ``q.dtype``.

    Raises:
        RuntimeError: the kernel is unavailable (check :func:`supports` first).
    """
    lib = load(isa)
    sfx = _suffixes(q, kv_cache)
    if lib is None or sfx is None:
        raise RuntimeError("CPU paged-attention kernel unavailable for this call")
    q = q.contiguous()
    b, h, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    getattr(lib, f"paged_decode_{sfx[0]}_{sfx[1]}")(
        q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), b, h, kvh, d, bs, float(scale), float(k_scale), float(v_scale),
        torch.get_num_threads())
    return out


def prefill_supports(q: torch.Tensor, kv_cache: torch.Tensor, isa: str | None = None) -> bool:
    """True when :func:`paged_prefill` can serve this layer: :func:`supports` and head_dim 64 or 128."""
    return supports(q, kv_cache, isa) and q.shape[-1] in (64, 128)


def prefill_preferred(isa: str | None = None) -> bool:
    """Whether the prefill kernel beats torch's SDPA path on this variant: the vector ones (AVX2,
    AVX-512: 1.5-2.6x SDPA at 256 tokens on the 2-core AMD EPYC); the scalar build is slower
    than SDPA (0.6-0.8x), so the backend keeps SDPA there."""
    return compiled_isa(isa) in ("avx2", "avx512")


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, q_start: torch.Tensor,
                  q_len: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                  k_scale: float = 1.0, v_scale: float = 1.0, isa: str | None = None) -> None:
    """Causal attention for ``R`` prefill (or prefill-chunk) requests straight from the paged cache.

    Request ``r`` owns rows ``q_start[r] : q_start[r] + q_len[r]`` of ``q``;
    its context is ``seq_lens[r]`` tokens (a cached prefix of
    ``seq_lens[r] - q_len[r]`` tokens, then the new ones, whose K/V must
    already be in the cache), and new token ``i`` attends to positions
    ``<= seq_lens[r] - q_len[r] + i``. FlashAttention-2's online softmax
    (Dao, arXiv 2307.08691, Algorithm 1) over 16-key tiles; float32
    accumulation. Rows of ``out`` that belong to no listed request are not
    touched.

    Args:
        q: ``[num_tokens, H, D]`` contiguous, float32 or bfloat16, ``D`` 64 or 128.
        kv_cache: ``[2, num_blocks, block_size, KVH, D]`` contiguous, ``q.dtype`` or quantised
            (see :func:`paged_decode`).
        block_tables: ``[R, >= ceil(max(seq_lens) / block_size)]`` int32, last dim contiguous.
        q_start, q_len, seq_lens: ``[R]`` int32.
        scale: softmax scale.
        out: ``[num_tokens, H, D]`` contiguous, same dtype as ``q``; written in place.
        k_scale, v_scale: the cache's dequantisation scales.
        isa: kernel variant (None: this CPU's best).

    Raises:
        RuntimeError: the kernel cannot serve the call (check :func:`prefill_supports`).
    """
    if not prefill_supports(q, kv_cache, isa):
        raise RuntimeError("CPU paged prefill kernel unavailable for this call")
    if not (q.is_contiguous() and out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype):
        raise RuntimeError("paged_prefill needs contiguous q and out of the same shape and dtype")
    _run_ragged("paged_prefill", q, kv_cache, block_tables, q_start, q_len, seq_lens, scale, out, k_scale, v_scale,
                isa)


def paged_rows(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, q_start: torch.Tensor,
               q_len: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
               k_scale: float = 1.0, v_scale: float = 1.0, isa: str | None = None) -> None:
    """Several query rows per request with the decode kernel's bits, each request's context read once per tile.

    Request ``r`` owns rows ``q_start[r] : q_start[r] + q_len[r]`` of ``q``; new token ``i`` attends to the
    first ``seq_lens[r] - q_len[r] + i + 1`` positions of its block table (causal). Every row is computed
    with exactly :func:`paged_decode`'s arithmetic for that context (two passes: scores with the kernel's
    per-key reduction, ``exp(s - max)`` and their sum in order, then ``sum_l p_l v_l`` in order), so its
    bits equal ``paged_decode`` over one row per token -- a decode step, a speculative-decoding verify step,
    a batch-invariant prompt or chunk, whatever the tiling, the other rows or the thread count
    (``tests/model/test_paged_attention_cpu.py``). What is shared is the memory traffic: a work item
    (request, up to 16 tokens, KV head) widens each K/V vector of the tile's context once for all its
    rows (PagedAttention's decode, Kwon et al., arXiv 2309.06180 §4.1, over a tile of query rows). On the
    scalar variant and for head sizes other than 64 / 128 it runs the decode kernel's own per-token items.
    Rows of ``out`` that belong to no listed request are not touched.

    Args:
        q: ``[num_tokens, H, D]`` contiguous, float32 or bfloat16, any ``D``.
        kv_cache: ``[2, num_blocks, block_size, KVH, D]`` contiguous (see :func:`paged_decode`).
        block_tables: ``[R, >= ceil(max(seq_lens) / block_size)]`` int32, last dim contiguous.
        q_start, q_len, seq_lens: ``[R]`` int32 (``1 <= q_len[r] <= seq_lens[r]``).
        scale: softmax scale.
        out: ``[num_tokens, H, D]`` contiguous, same dtype as ``q``; written in place.
        k_scale, v_scale: the cache's dequantisation scales.
        isa: kernel variant (None: this CPU's best).

    Raises:
        RuntimeError: the kernel cannot serve the call (check :func:`supports`), or ``q``/``out`` are not
            contiguous tensors of one shape and dtype.
    """
    if not supports(q, kv_cache, isa):
        raise RuntimeError("CPU paged rows kernel unavailable for this call")
    if not (q.is_contiguous() and out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype):
        raise RuntimeError("paged_rows needs contiguous q and out of the same shape and dtype")
    _run_ragged("paged_rows", q, kv_cache, block_tables, q_start, q_len, seq_lens, scale, out, k_scale, v_scale, isa)


def _run_ragged(kernel: str, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                q_start: torch.Tensor, q_len: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                k_scale: float, v_scale: float, isa: str | None) -> None:
    """Call ``{kernel}_{q dtype}_{kv dtype}`` (``paged_prefill`` or ``paged_rows``: the same ragged-query
    signature) after putting the index tensors in the int32 contiguous form the C code reads."""
    _, h, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    q_start, q_len, seq_lens = (t.to(torch.int32).contiguous() for t in (q_start, q_len, seq_lens))
    qs, ks = _suffixes(q, kv_cache)
    getattr(load(isa), f"{kernel}_{qs}_{ks}")(
        q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), q_start.data_ptr(), q_len.data_ptr(), seq_lens.data_ptr(), q_len.shape[0], h, kvh,
        d, bs, float(scale), float(k_scale), float(v_scale), torch.get_num_threads())


def write_kv_supports(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, isa: str | None = None) -> bool:
    """True when :func:`write_kv` can serve these rows: :func:`supports`-style dtype pair, each row's
    ``[KVH, D]`` contiguous (rows may be strided, e.g. slices of the fused q/k/v output)."""
    return (k.device.type == "cpu" and _suffixes(k, kv_cache) is not None and v.dtype == k.dtype
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
            and v.stride(-2) == v.shape[-1] and kv_cache.is_contiguous() and load(isa) is not None)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0, isa: str | None = None) -> None:
    """Scatter ``k``/``v`` ``[num_tokens, KVH, D]`` into ``kv_cache`` at ``slot_mapping`` in one C call.

    Same result as :func:`tokenmill.model.layers.attention.write_kv` (bit for bit: quantised caches
    store ``x / scale`` clamped to the format's range and rounded to nearest even) without its
    2-12 torch ops per layer.

    Raises:
        RuntimeError: the call is not supported (check :func:`write_kv_supports`).
    """
    if not write_kv_supports(k, v, kv_cache, isa):
        raise RuntimeError("CPU kv_write kernel unavailable for this call")
    n = k.shape[0]
    sm = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() else \
        slot_mapping.to(torch.int64).contiguous()
    qs, ks = _suffixes(k, kv_cache)
    getattr(load(isa), f"kv_write_{qs}_{ks}")(
        k.data_ptr(), v.data_ptr(), sm.data_ptr(), n, k.shape[-2] * k.shape[-1], k.stride(0), v.stride(0),
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), 1.0 / float(k_scale), 1.0 / float(v_scale))
