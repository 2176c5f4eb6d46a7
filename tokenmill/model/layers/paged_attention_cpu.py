"""A fused paged-attention decode kernel for the CPU (C, OpenMP), built on first use.

PagedAttention decode (Kwon et al., arXiv 2309.06180, §4.1): every request
has one new query token and attends to its whole context, which lives in
the blocks its block table lists. The portable torch path first gathers
each request's K/V into a contiguous ``[B, KVH, L, D]`` tensor and then runs
two batched matmuls; on the 2-core CPU the gather copy and the tiny
matmuls (3 query rows per KV head) took ~35% of a batch-32 decode step.
This kernel reads K and V once, straight from the block pool:

    for each (request b, KV head h) in parallel (OpenMP):
        s[g, l] = scale · q[b, h·G + g] · K[slot(b, l), h]    for l < seq_len[b], g < G
        p = softmax(s) (float32)
        out[b, h·G + g] = Σ_l p[g, l] · V[slot(b, l), h]

with ``slot(b, l) = block_tables[b, l // block_size] · block_size + l % block_size``
and ``G = H / KVH`` query heads sharing a KV head (GQA, arXiv 2305.13245).
float32 and bfloat16 caches are supported; accumulation is float32.

The C source is compiled on first use by :mod:`tokenmill.model.layers.cpu_build`
(system ``cc``, cached per user, shares torch's OpenMP pool). When no
compiler is available or the build fails, :func:`load` returns None and the
caller keeps the torch path. ``TOKENMILL_CPU_ATTENTION_KERNEL=0`` disables it.
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.model.layers.cpu_build import load_library

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c; c.u = ((uint32_t)x) << 16; return c.f;
}
static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even */
    union { uint32_t u; float f; } c; c.f = f;
    if ((c.u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(c.u >> 16) | ((c.u & 0xffff) ? 0x40 : 0);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

#define LD_F32(p, i) ((p)[i])
#define LD_BF16(p, i) bf16_to_f32((p)[i])
#define ST_F32(p, i, v) ((p)[i] = (v))
#define ST_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))

/* q, out: [B, H, D]; k, v: [num_slots, KVH, D]; block_tables: [B, bt_stride] int32; seq_lens: [B] int32 */
#define DEFINE_KERNEL(NAME, T, LD, ST, DC)                                                            \
void NAME(const T* q, const T* k, const T* v, T* out, const int32_t* block_tables, int64_t bt_stride, \
          const int32_t* seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D_, int64_t block_size, \
          float scale, int num_threads) {                                                             \
    const int64_t G = H / KVH;                                                                        \
    const int64_t D = DC > 0 ? DC : D_;                                                               \
    _Pragma("omp parallel num_threads(num_threads)")                                                  \
    {                                                                                                 \
        int64_t cap = 0, slot_cap = 0; float* s = NULL; int64_t* slots = NULL;                        \
        float qf[G * D]; float acc[G * D];                                                            \
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")                                           \
        for (int64_t b = 0; b < B; b++) {                                                             \
            for (int64_t h = 0; h < KVH; h++) {                                                       \
                const int64_t L = seq_lens[b];                                                        \
                if (L * G > cap) { free(s); cap = L * G; s = (float*)malloc(sizeof(float) * cap); }  \
                if (L > slot_cap) { free(slots); slot_cap = L; slots = (int64_t*)malloc(sizeof(int64_t) * L); } \
                const int32_t* bt = block_tables + b * bt_stride;                                     \
                for (int64_t l0 = 0; l0 < L; l0 += block_size) {  /* slot of each position, no division per l */ \
                    const int64_t base = (int64_t)bt[l0 / block_size] * block_size;                   \
                    const int64_t n = L - l0 < block_size ? L - l0 : block_size;                      \
                    for (int64_t o = 0; o < n; o++) slots[l0 + o] = base + o;                         \
                }                                                                                     \
                for (int64_t g = 0; g < G; g++)                                                       \
                    for (int64_t d = 0; d < D; d++)                                                   \
                        qf[g * D + d] = LD(q, (b * H + h * G + g) * D + d) * scale;                  \
                float m[G]; for (int64_t g = 0; g < G; g++) m[g] = -INFINITY;                         \
                for (int64_t l = 0; l < L; l++) {                                                     \
                    const T* kp = k + (slots[l] * KVH + h) * D;                                       \
                    float kf[D];                                                                      \
                    for (int64_t d = 0; d < D; d++) kf[d] = LD(kp, d);                                \
                    for (int64_t g = 0; g < G; g++) {                                                 \
                        float dot = 0.f;                                                              \
                        for (int64_t d = 0; d < D; d++) dot += qf[g * D + d] * kf[d];                 \
                        s[g * L + l] = dot;                                                           \
                        if (dot > m[g]) m[g] = dot;                                                   \
                    }                                                                                 \
                }                                                                                     \
                float inv[G];                                                                         \
                for (int64_t g = 0; g < G; g++) {                                                     \
                    float sum = 0.f;                                                                  \
                    for (int64_t l = 0; l < L; l++) { float e = expf(s[g * L + l] - m[g]); s[g * L + l] = e; sum += e; } \
                    inv[g] = 1.f / sum;                                                               \
                }                                                                                     \
                memset(acc, 0, sizeof(float) * G * D);                                                \
                for (int64_t l = 0; l < L; l++) {                                                     \
                    const T* vp = v + (slots[l] * KVH + h) * D;                                       \
                    float vf[D];                                                                      \
                    for (int64_t d = 0; d < D; d++) vf[d] = LD(vp, d);                                \
                    for (int64_t g = 0; g < G; g++) {                                                 \
                        const float p = s[g * L + l];                                                 \
                        for (int64_t d = 0; d < D; d++) acc[g * D + d] += p * vf[d];                  \
                    }                                                                                 \
                }                                                                                     \
                for (int64_t g = 0; g < G; g++)                                                       \
                    for (int64_t d = 0; d < D; d++)                                                   \
                        ST(out, (b * H + h * G + g) * D + d, acc[g * D + d] * inv[g]);               \
            }                                                                                         \
        }                                                                                             \
        free(s); free(slots);                                                                         \
    }                                                                                                 \
}

DEFINE_KERNEL(paged_decode_f32_any, float, LD_F32, ST_F32, 0)
DEFINE_KERNEL(paged_decode_bf16_any, uint16_t, LD_BF16, ST_BF16, 0)
DEFINE_KERNEL(paged_decode_f32_64, float, LD_F32, ST_F32, 64)
DEFINE_KERNEL(paged_decode_bf16_64, uint16_t, LD_BF16, ST_BF16, 64)
DEFINE_KERNEL(paged_decode_f32_128, float, LD_F32, ST_F32, 128)
DEFINE_KERNEL(paged_decode_bf16_128, uint16_t, LD_BF16, ST_BF16, 128)
"""

_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + \
    [ctypes.c_float, ctypes.c_int]
_FUNCTIONS = {f"paged_decode_{t}_{d}": _ARGTYPES for t in ("f32", "bf16") for d in ("any", "64", "128")}


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None when unavailable (logged once)."""
    return load_library("paged_attention", _SOURCE, _FUNCTIONS, "TOKENMILL_CPU_ATTENTION_KERNEL")


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when the kernel can serve this call (CPU, float32/bfloat16, GQA heads divide evenly)."""
    return (q.device.type == "cpu" and kv_cache.device.type == "cpu" and q.dtype == kv_cache.dtype
            and q.dtype in (torch.float32, torch.bfloat16) and q.shape[1] % kv_cache.shape[3] == 0
            and kv_cache.is_contiguous() and load() is not None)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Decode attention for ``B`` single-token queries straight from the paged cache.

    Args:
        q: ``[B, H, D]`` float32 or bfloat16 (made contiguous if needed).
        kv_cache: ``[2, num_blocks, block_size, KVH, D]`` contiguous, same dtype.
        block_tables: ``[B, >= ceil(max(seq_lens) / block_size)]`` int32, last dim contiguous.
        seq_lens: ``[B]`` int32 context lengths (including the new token, whose K/V
            must already be in the cache).
        scale: softmax scale.

    Returns:
        ``[B, H, D]`` in ``q.dtype``.

    Raises:
        RuntimeError: the kernel is unavailable (check :func:`supports` first).
    """
    lib = load()
    if lib is None:
        raise RuntimeError("CPU paged-attention kernel unavailable")
    q = q.contiguous()
    b, h, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    fn = getattr(lib, f"paged_decode_{'f32' if q.dtype == torch.float32 else 'bf16'}_"
                      f"{d if d in (64, 128) else 'any'}")
    fn(q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), out.data_ptr(), block_tables.data_ptr(),
       block_tables.stride(0), seq_lens.data_ptr(), b, h, kvh, d, bs, float(scale), torch.get_num_threads())
    return out
