#include "common.h"
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float ld_f32(const float* p) { return *p; }
static inline float ld_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
static inline void st_f32(float* p, float x) { *p = x; }
static inline void st_bf16(uint16_t* p, float x) { *p = f32_to_bf16(x); }

#define PF_DIST 2   /* blocks ahead that a whole-request decode item prefetches (1-8 measured the same) */
/* Ask for the rows of one KV head in one block: n rows of `bytes` bytes, `stride` bytes apart. */
static inline void prefetch_rows(const void* p, int64_t n, int64_t stride, int64_t bytes) {
    const char* c = (const char*)p;
    for (int64_t r = 0; r < n; r++, c += stride)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

/* Scalar path (any head_dim; also the path without AVX-512). One work item = (request b, KV head h). */
#define DEFINE_SCALAR_ITEM(NAME, T, LD, ST)                                                           \
static void NAME(const T* q, const T* k, const T* v, T* out, const int32_t* bt, int64_t L, int64_t b, \
                 int64_t h, int64_t H, int64_t KVH, int64_t G, int64_t D, int64_t bs, float scale,  \
                 float* s, float* work) {                                                           \
    float* qf = work; float* acc = work + G * D;                                                    \
    for (int64_t g = 0; g < G; g++)                                                                 \
        for (int64_t d = 0; d < D; d++) qf[g * D + d] = LD(q + (b * H + h * G + g) * D + d) * scale; \
    for (int64_t l = 0; l < L; l++) {                                                               \
        const T* kp = k + (((int64_t)bt[l / bs] * bs + l % bs) * KVH + h) * D;                      \
        for (int64_t g = 0; g < G; g++) {                                                           \
            float dot = 0.f;                                                                        \
            for (int64_t d = 0; d < D; d++) dot += qf[g * D + d] * LD(kp + d);                      \
            s[g * L + l] = dot;                                                                     \
        }                                                                                           \
    }                                                                                               \
    memset(acc, 0, sizeof(float) * G * D);                                                          \
    for (int64_t g = 0; g < G; g++) {                                                               \
        float mx = -INFINITY, sum = 0.f; float* sg = s + g * L;                                     \
        for (int64_t l = 0; l < L; l++) mx = sg[l] > mx ? sg[l] : mx;                               \
        for (int64_t l = 0; l < L; l++) { sg[l] = expf(sg[l] - mx); sum += sg[l]; }                 \
        qf[g] = 1.f / sum;                                                                          \
    }                                                                                               \
    for (int64_t l = 0; l < L; l++) {                                                               \
        const T* vp = v + (((int64_t)bt[l / bs] * bs + l % bs) * KVH + h) * D;                      \
        for (int64_t g = 0; g < G; g++)                                                             \
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += s[g * L + l] * LD(vp + d);            \
    }                                                                                               \
    for (int64_t g = 0; g < G; g++)                                                                 \
        for (int64_t d = 0; d < D; d++) ST(out + (b * H + h * G + g) * D + d, acc[g * D + d] * qf[g]); \
}
DEFINE_SCALAR_ITEM(scalar_item_f32, float, ld_f32, st_f32)
DEFINE_SCALAR_ITEM(scalar_item_bf16, uint16_t, ld_bf16, st_bf16)

#if defined(__AVX512F__)
static inline __m512 ld16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* AVX-512 path for head_dim = 16 * NC: the query rows of a tile of up to GT query heads (sharing
 * KV head h) and their output accumulators stay in registers; K/V rows are widened to float32 on
 * load. Pass 1 walks the request's blocks for QK^T, pass 2 for PV, each prefetching the next
 * block's rows of this head while it works on the current one. */
#define DEFINE_VEC_ITEM(NAME, T, LD16, ST, NC, GT)                                                  \
static void NAME(const T* q, const T* k, const T* v, T* out, const int32_t* bt, int64_t L, int64_t b, \
                 int64_t h0, int64_t NH, int64_t H, int64_t KVH, int64_t G, int64_t bs, float scale, float* s) { \
    const int64_t D = 16 * NC, row = KVH * D, nblk = (L + bs - 1) / bs;                             \
    const int64_t rb = row * (int64_t)sizeof(T), hb = NH * D * (int64_t)sizeof(T);                  \
    for (int64_t j = 0; j < PF_DIST && j < nblk; j++) {                                             \
        const int64_t n = L - j * bs < bs ? L - j * bs : bs;                                        \
        prefetch_rows(k + (int64_t)bt[j] * bs * row + h0 * D, n, rb, hb);                           \
        prefetch_rows(v + (int64_t)bt[j] * bs * row + h0 * D, n, rb, hb);                           \
    }                                                                                               \
    for (int64_t h = h0; h < h0 + NH; h++)                                                          \
    for (int64_t g0 = 0; g0 < G; g0 += GT) {                                                        \
        const int64_t gc = G - g0 < GT ? G - g0 : GT;                                               \
        __m512 qv[GT][NC], av[GT][NC];                                                              \
        float mx[GT];                                                                               \
        for (int gi = 0; gi < GT; gi++) {                                                           \
            mx[gi] = -INFINITY;                                                                     \
            for (int c = 0; c < NC; c++) {                                                          \
                qv[gi][c] = gi < gc ? _mm512_mul_ps(LD16(q + (b * H + h * G + g0 + gi) * D + 16 * c), \
                                                    _mm512_set1_ps(scale)) : _mm512_setzero_ps();   \
                av[gi][c] = _mm512_setzero_ps();                                                    \
            }                                                                                       \
        }                                                                                           \
        for (int64_t j = 0; j < nblk; j++) {                                                        \
            const int64_t l0 = j * bs, n = L - l0 < bs ? L - l0 : bs;                               \
            const T* kb = k + (int64_t)bt[j] * bs * row + h * D;                                    \
            const int pf = h == h0 && g0 == 0 && j + PF_DIST < nblk;                               \
            const T* kpf = pf ? k + (int64_t)bt[j + PF_DIST] * bs * row + h0 * D : NULL;            \
            const T* vpf = pf ? v + (int64_t)bt[j + PF_DIST] * bs * row + h0 * D : NULL;            \
            for (int64_t o = 0; o < n; o++) {                                                       \
                if (pf) { prefetch_rows(kpf + o * row, 1, rb, hb); prefetch_rows(vpf + o * row, 1, rb, hb); } \
                __m512 kv[NC];                                                                      \
                for (int c = 0; c < NC; c++) kv[c] = LD16(kb + o * row + 16 * c);                   \
                for (int gi = 0; gi < GT; gi++) {                                                   \
                    __m512 a = _mm512_mul_ps(qv[gi][0], kv[0]);                                     \
                    for (int c = 1; c < NC; c++) a = _mm512_fmadd_ps(qv[gi][c], kv[c], a);          \
                    const float dot = _mm512_reduce_add_ps(a);                                      \
                    s[gi * L + l0 + o] = dot;                                                       \
                    mx[gi] = dot > mx[gi] ? dot : mx[gi];                                           \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        float inv[GT];                                                                              \
        for (int gi = 0; gi < GT; gi++) {                                                           \
            float sum = 0.f; float* sg = s + gi * L; const float m = mx[gi];                        \
            for (int64_t l = 0; l < L; l++) { const float e = expf(sg[l] - m); sg[l] = e; sum += e; } \
            inv[gi] = 1.f / sum;                                                                    \
        }                                                                                           \
        for (int64_t j = 0; j < nblk; j++) {                                                        \
            const int64_t l0 = j * bs, n = L - l0 < bs ? L - l0 : bs;                               \
            const T* vb = v + (int64_t)bt[j] * bs * row + h * D;                                    \
            for (int64_t o = 0; o < n; o++) {                                                       \
                __m512 vv[NC];                                                                      \
                for (int c = 0; c < NC; c++) vv[c] = LD16(vb + o * row + 16 * c);                   \
                for (int gi = 0; gi < GT; gi++) {                                                   \
                    const __m512 p = _mm512_set1_ps(s[gi * L + l0 + o]);                            \
                    for (int c = 0; c < NC; c++) av[gi][c] = _mm512_fmadd_ps(p, vv[c], av[gi][c]);  \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int gi = 0; gi < gc; gi++) {                                                           \
            float o16[16];                                                                          \
            T* op = out + (b * H + h * G + g0 + gi) * D;                                            \
            for (int c = 0; c < NC; c++) {                                                          \
                _mm512_storeu_ps(o16, _mm512_mul_ps(av[gi][c], _mm512_set1_ps(inv[gi])));           \
                for (int e = 0; e < 16; e++) ST(op + 16 * c + e, o16[e]);                           \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
}
DEFINE_VEC_ITEM(vec_item_f32_64, float, ld16_f32, st_f32, 4, 4)
DEFINE_VEC_ITEM(vec_item_bf16_64, uint16_t, ld16_bf16, st_bf16, 4, 4)
DEFINE_VEC_ITEM(vec_item_f32_128, float, ld16_f32, st_f32, 8, 2)
DEFINE_VEC_ITEM(vec_item_bf16_128, uint16_t, ld16_bf16, st_bf16, 8, 2)
#define VEC_DISPATCH(SFX)                                                                           \
    if (D == 64) { vec_item_##SFX##_64(q, k, v, out, bt, L, b, h0, NH, H, KVH, G, bs, scale, s); continue; } \
    if (D == 128) { vec_item_##SFX##_128(q, k, v, out, bt, L, b, h0, NH, H, KVH, G, bs, scale, s); continue; }
#else
#define VEC_DISPATCH(SFX)
#endif

/* q, out: [B, H, D]; k, v: [num_slots, KVH, D]; block_tables: [B, bt_stride] int32; seq_lens: [B] int32.
 * One work item per (request, KV head), scheduled dynamically over the threads. The score rows
 * s hold L floats for each of G (scalar) or up to G + 3 (a padded vector tile) query rows. */
#define DEFINE_KERNEL(NAME, T, SFX)                                                                 \
void NAME(const T* q, const T* k, const T* v, T* out, const int32_t* block_tables, int64_t bt_stride, \
          const int32_t* seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,        \
          float scale, int num_threads) {                                                           \
    const int64_t G = H / KVH, hsplit = B >= 2 * num_threads ? 1 : KVH, NH = KVH / hsplit;         \
    _Pragma("omp parallel num_threads(num_threads)")                                                \
    {                                                                                               \
        int64_t cap = 0; float* s = NULL;                                                           \
        float* work = (float*)malloc(sizeof(float) * 2 * G * D);                                    \
        _Pragma("omp for schedule(dynamic, 1)")                                                     \
        for (int64_t it = 0; it < B * hsplit; it++) {                                               \
            const int64_t b = it / hsplit, h0 = (it % hsplit) * NH, L = seq_lens[b];                \
            const int32_t* bt = block_tables + b * bt_stride;                                       \
            if (L * (G + 4) > cap) { free(s); cap = L * (G + 4); s = (float*)malloc(sizeof(float) * cap); } \
            VEC_DISPATCH(SFX)                                                                       \
            for (int64_t h = h0; h < h0 + NH; h++)                                                  \
                scalar_item_##SFX(q, k, v, out, bt, L, b, h, H, KVH, G, D, bs, scale, s, work);      \
        }                                                                                           \
        free(s); free(work);                                                                        \
    }                                                                                               \
}

DEFINE_KERNEL(paged_decode_f32, float, f32)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16)

/* ---------------------------------------------------------------- prefill / chunked prefill
 * Causal attention of R requests' new tokens over their whole context (cached prefix + the new
 * tokens, whose K/V are already in the cache), read straight from the block pool; online softmax
 * over key tiles as in FlashAttention-2 (Dao, arXiv 2307.08691, Algorithm 1), on the CPU.
 * Work item = (request, tile of PQ query tokens, KV head): its PQ * G query rows (the G query heads
 * sharing the KV head, so K/V tiles are read once per group) are kept scaled in float32; each key
 * tile of PK positions is transposed (K) and widened (V) once and reused by every row; S = Q K^T
 * runs PR rows at a time with the rows' accumulators in registers. Rows see keys up to their own
 * position (c + token index, c = cached prefix length); tiles past a row are skipped. */
#define PQ 32
#define PK 16
#define PR 8
void paged_prefill_available(int* out) {   /* 1 when built with the AVX-512 prefill kernel */
#if defined(__AVX512F__)
    *out = 1;
#else
    *out = 0;
#endif
}

#if defined(__AVX512F__)
#define DEFINE_PREFILL(NAME, T, LD, LD16, ST, NC)                                                     \
static void NAME##_item(const T* q, const T* k, const T* v, T* out, const int32_t* bt, int64_t q0,      \
                        int64_t n, int64_t L, int64_t t0, int64_t h, int64_t H, int64_t KVH, int64_t bs, \
                        float scale, float* qf, float* o, float* m, float* l, float* kt, float* vt) {   \
    const int64_t D = 16 * NC, G = H / KVH, row = KVH * D, c = L - n;                                  \
    const int64_t tq = n - t0 < PQ ? n - t0 : PQ, rows = tq * G;                                       \
    const __m512 sc = _mm512_set1_ps(scale);                                                           \
    for (int64_t ri = 0; ri < rows + PR; ri++)                                                         \
        for (int cc = 0; cc < NC; cc++) {                                                              \
            __m512 x = _mm512_setzero_ps();                                                            \
            if (ri < rows) x = _mm512_mul_ps(LD16(q + ((q0 + t0 + ri / G) * H + h * G + ri % G) * D + 16 * cc), sc); \
            _mm512_storeu_ps(qf + ri * D + 16 * cc, x);                                                \
        }                                                                                              \
    memset(o, 0, sizeof(float) * rows * D);                                                            \
    for (int64_t ri = 0; ri < rows; ri++) { m[ri] = -INFINITY; l[ri] = 0.f; }                          \
    const int64_t last = c + t0 + tq - 1;          /* the last key position any row of the tile sees */ \
    for (int64_t p0 = 0; p0 <= last; p0 += PK) {                                                       \
        const int64_t kn = last + 1 - p0 < PK ? last + 1 - p0 : PK;                                    \
        for (int64_t j = 0; j < PK; j++) {                                                             \
            if (j < kn) {                                                                              \
                const int64_t pos = p0 + j, slot = (int64_t)bt[pos / bs] * bs + pos % bs;               \
                const T* kp = k + slot * row + h * D; const T* vp = v + slot * row + h * D;            \
                for (int64_t d = 0; d < D; d++) kt[d * PK + j] = LD(kp + d);                           \
                for (int cc = 0; cc < NC; cc++) _mm512_storeu_ps(vt + j * D + 16 * cc, LD16(vp + 16 * cc)); \
            } else {                                                                                   \
                for (int64_t d = 0; d < D; d++) kt[d * PK + j] = 0.f;                                  \
                for (int cc = 0; cc < NC; cc++) _mm512_storeu_ps(vt + j * D + 16 * cc, _mm512_setzero_ps()); \
            }                                                                                          \
        }                                                                                              \
        const int64_t first_row = p0 > c + t0 ? (p0 - c - t0) * G : 0;  /* rows before see none */    \
        for (int64_t rc = first_row; rc < rows; rc += PR) {                                            \
            __m512 acc[PR];                                                                            \
            for (int i = 0; i < PR; i++) acc[i] = _mm512_setzero_ps();                                 \
            for (int64_t d = 0; d < D; d++) {                                                          \
                const __m512 kd = _mm512_loadu_ps(kt + d * PK);                                        \
                for (int i = 0; i < PR; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qf[(rc + i) * D + d]), kd, acc[i]); \
            }                                                                                          \
            for (int i = 0; i < PR && rc + i < rows; i++) {                                            \
                const int64_t ri = rc + i, qpos = c + t0 + ri / G;                                     \
                int64_t nv = qpos - p0 + 1; nv = nv < kn ? nv : kn;                                    \
                if (nv <= 0) continue;                                                                 \
                const __mmask16 mk = nv >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);       \
                const __m512 s = _mm512_mask_blend_ps(mk, _mm512_set1_ps(-INFINITY), acc[i]);          \
                const float mnew = fmaxf(m[ri], _mm512_reduce_max_ps(s));                              \
                float pj[16];                                                                          \
                _mm512_storeu_ps(pj, _mm512_sub_ps(s, _mm512_set1_ps(mnew)));                          \
                for (int j = 0; j < 16; j++) pj[j] = expf(pj[j]);                                      \
                const float corr = expf(m[ri] - mnew);                                                 \
                float psum = 0.f;                                                                      \
                for (int j = 0; j < 16; j++) psum += pj[j];                                            \
                l[ri] = l[ri] * corr + psum;                                                           \
                m[ri] = mnew;                                                                          \
                __m512 ov[NC];                                                                         \
                const __m512 cv = _mm512_set1_ps(corr);                                                \
                for (int cc = 0; cc < NC; cc++) ov[cc] = _mm512_mul_ps(_mm512_loadu_ps(o + ri * D + 16 * cc), cv); \
                for (int64_t j = 0; j < nv; j++) {                                                     \
                    const __m512 pv = _mm512_set1_ps(pj[j]);                                           \
                    for (int cc = 0; cc < NC; cc++)                                                    \
                        ov[cc] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vt + j * D + 16 * cc), ov[cc]);   \
                }                                                                                      \
                for (int cc = 0; cc < NC; cc++) _mm512_storeu_ps(o + ri * D + 16 * cc, ov[cc]);        \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int64_t ri = 0; ri < rows; ri++) {                                                            \
        const float inv = 1.f / l[ri];                                                                 \
        T* op = out + ((q0 + t0 + ri / G) * H + h * G + ri % G) * D;                                   \
        for (int64_t d = 0; d < D; d++) ST(op + d, o[ri * D + d] * inv);                               \
    }                                                                                                  \
}
DEFINE_PREFILL(prefill_f32_64, float, ld_f32, ld16_f32, st_f32, 4)
DEFINE_PREFILL(prefill_bf16_64, uint16_t, ld_bf16, ld16_bf16, st_bf16, 4)
DEFINE_PREFILL(prefill_f32_128, float, ld_f32, ld16_f32, st_f32, 8)
DEFINE_PREFILL(prefill_bf16_128, uint16_t, ld_bf16, ld16_bf16, st_bf16, 8)
#define PREFILL_ITEM(SFX, D) (D == 64 ? prefill_##SFX##_64_item : prefill_##SFX##_128_item)
#else
#define PREFILL_ITEM(SFX, D) NULL
#endif

/* q, out: [num_tokens, H, D]; k, v: [num_slots, KVH, D]; block_tables: [R, bt_stride] int32 (row r:
 * request r's blocks); q_start, q_len, seq_lens: [R] int32 (first row in q, new tokens, context
 * length after this step). head_dim 64 or 128 and AVX-512 only (paged_prefill_available). */
#define DEFINE_PREFILL_KERNEL(NAME, T, SFX)                                                           \
void NAME(const T* q, const T* k, const T* v, T* out, const int32_t* block_tables, int64_t bt_stride, \
          const int32_t* q_start, const int32_t* q_len, const int32_t* seq_lens, int64_t R, int64_t H,  \
          int64_t KVH, int64_t D, int64_t bs, float scale, int num_threads) {                         \
    void (*item)(const T*, const T*, const T*, T*, const int32_t*, int64_t, int64_t, int64_t, int64_t,  \
                 int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*, float*, float*,     \
                 float*) = PREFILL_ITEM(SFX, D);                                                      \
    if (item == NULL || (D != 64 && D != 128)) return;                                                \
    const int64_t G = H / KVH;                                                                        \
    int64_t total = 0;                                                                                \
    for (int64_t r = 0; r < R; r++) total += (q_len[r] + PQ - 1) / PQ * KVH;                          \
    int64_t* items = (int64_t*)malloc(sizeof(int64_t) * 3 * (total > 0 ? total : 1));                 \
    int64_t w = 0;                                                                                    \
    for (int64_t r = 0; r < R; r++)               /* later tiles see more keys: hand them out first */ \
        for (int64_t t = (q_len[r] + PQ - 1) / PQ - 1; t >= 0; t--)                                   \
            for (int64_t h = 0; h < KVH; h++) { items[w++] = r; items[w++] = t; items[w++] = h; }     \
    _Pragma("omp parallel num_threads(num_threads)")                                                  \
    {                                                                                                 \
        float* buf = (float*)malloc(sizeof(float) * ((2 * PQ * G + PR) * D + 2 * PQ * G + 2 * PK * D)); \
        float* qf = buf; float* o = qf + (PQ * G + PR) * D; float* m = o + PQ * G * D;                \
        float* l = m + PQ * G; float* kt = l + PQ * G; float* vt = kt + PK * D;                       \
        _Pragma("omp for schedule(dynamic, 1)")                                                       \
        for (int64_t it = 0; it < total; it++) {                                                      \
            const int64_t r = items[3 * it], t = items[3 * it + 1], h = items[3 * it + 2];            \
            item(q, k, v, out, block_tables + r * bt_stride, q_start[r], q_len[r], seq_lens[r], t * PQ, \
                 h, H, KVH, bs, scale, qf, o, m, l, kt, vt);                                          \
        }                                                                                             \
        free(buf);                                                                                    \
    }                                                                                                 \
    free(items);                                                                                      \
}
DEFINE_PREFILL_KERNEL(paged_prefill_f32, float, f32)
DEFINE_PREFILL_KERNEL(paged_prefill_bf16, uint16_t, bf16)
