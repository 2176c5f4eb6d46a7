/* Paged attention on the CPU: decode (one query token per request) and prefill / chunked prefill,
 * reading K/V straight from the block pool. One source for every instruction-set variant (see
 * vec.h: AVX-512 16-wide, AVX2+FMA 8-wide, scalar), compiled once per variant by cpu_build.py.
 *
 * Cache layout (per layer): k, v each [num_slots, KVH, D], slot = block_table[pos / bs] * bs + pos % bs.
 * Cache element types: float32, bfloat16, int8, fp8 e4m3fn, fp8 e5m2. Quantised caches hold
 * round(x / k_scale) (resp. v_scale), one float scale per layer for K and one for V; kernels widen
 * each element to float32 on load and fold the scales into the query scale (K) and the output (V):
 *     s = scale * k_scale * (q . k_q),   out = v_scale * sum_l p_l v_q[l].
 * Accumulation is float32 throughout. Query / output types: float32 or bfloat16. */
#include "vec.h"
#include <stdlib.h>
#include <string.h>

#define PF_DIST 2   /* blocks ahead that a whole-request decode item prefetches (1-8 measured the same) */
/* Ask for the rows of one KV head in one block: n rows of `bytes` bytes, `stride` bytes apart. */
static inline void prefetch_rows(const void* p, int64_t n, int64_t stride, int64_t bytes) {
    const char* c = (const char*)p;
    for (int64_t r = 0; r < n; r++, c += stride)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

void paged_attention_isa(int* out) { *out = vec_isa_level(); }

/* ================================================================ decode
 * PagedAttention decode (Kwon et al., arXiv 2309.06180, §4.1), two passes per work item:
 * s = q K^T over the request's blocks (and the running max), p = exp(s - max), out = p V / sum(p). */

/* Any head_dim. One work item = (request b, KV head h). */
#define DEFINE_SCALAR_ITEM(NAME, QT, QLD, KT, KLD, ST)                                               \
static void NAME(const QT* q, const KT* k, const KT* v, QT* out, const int32_t* bt, int64_t L, int64_t b, \
                 int64_t h, int64_t H, int64_t KVH, int64_t G, int64_t D, int64_t bs, float qscale,   \
                 float vscale, float* s, float* work) {                                              \
    float* qf = work; float* acc = work + G * D;                                                     \
    for (int64_t g = 0; g < G; g++)                                                                  \
        for (int64_t d = 0; d < D; d++) qf[g * D + d] = QLD(q + (b * H + h * G + g) * D + d) * qscale; \
    for (int64_t l = 0; l < L; l++) {                                                                \
        const KT* kp = k + (((int64_t)bt[l / bs] * bs + l % bs) * KVH + h) * D;                      \
        for (int64_t g = 0; g < G; g++) {                                                            \
            float dot = 0.f;                                                                         \
            for (int64_t d = 0; d < D; d++) dot += qf[g * D + d] * KLD(kp + d);                      \
            s[g * L + l] = dot;                                                                      \
        }                                                                                            \
    }                                                                                                \
    memset(acc, 0, sizeof(float) * G * D);                                                           \
    for (int64_t g = 0; g < G; g++) {                                                                \
        float mx = -INFINITY, sum = 0.f; float* sg = s + g * L;                                      \
        for (int64_t l = 0; l < L; l++) mx = sg[l] > mx ? sg[l] : mx;                                \
        for (int64_t l = 0; l < L; l++) { sg[l] = expf(sg[l] - mx); sum += sg[l]; }                  \
        qf[g] = vscale / sum;                                                                        \
    }                                                                                                \
    for (int64_t l = 0; l < L; l++) {                                                                \
        const KT* vp = v + (((int64_t)bt[l / bs] * bs + l % bs) * KVH + h) * D;                      \
        for (int64_t g = 0; g < G; g++)                                                              \
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += s[g * L + l] * KLD(vp + d);            \
    }                                                                                                \
    for (int64_t g = 0; g < G; g++)                                                                  \
        for (int64_t d = 0; d < D; d++) ST(out + (b * H + h * G + g) * D + d, acc[g * D + d] * qf[g]); \
}

/* head_dim = VW * NC: the query rows of a tile of up to GT query heads (sharing KV head h) stay in
 * vector registers in pass 1 and their output accumulators in pass 2; K/V rows are widened on
 * load. Pass 1 walks the request's blocks for QK^T, pass 2 for PV; the first head's pass 1
 * prefetches the rows of heads h0..h0+NH-1 of the block PF_DIST ahead. */
#define DEFINE_VEC_ITEM(NAME, QT, QLDV, KT, KLDV, ST, NC, GT)                                        \
static void NAME(const QT* q, const KT* k, const KT* v, QT* out, const int32_t* bt, int64_t L, int64_t b, \
                 int64_t h0, int64_t NH, int64_t H, int64_t KVH, int64_t G, int64_t bs, float qscale, \
                 float vscale, float* s) {                                                           \
    const int64_t D = VW * NC, row = KVH * D, nblk = (L + bs - 1) / bs;                              \
    const int64_t rb = row * (int64_t)sizeof(KT), hb = NH * D * (int64_t)sizeof(KT);                 \
    for (int64_t j = 0; j < PF_DIST && j < nblk; j++) {                                              \
        const int64_t n = L - j * bs < bs ? L - j * bs : bs;                                         \
        prefetch_rows(k + (int64_t)bt[j] * bs * row + h0 * D, n, rb, hb);                            \
        prefetch_rows(v + (int64_t)bt[j] * bs * row + h0 * D, n, rb, hb);                            \
    }                                                                                                \
    for (int64_t h = h0; h < h0 + NH; h++)                                                           \
    for (int64_t g0 = 0; g0 < G; g0 += GT) {                                                         \
        const int64_t gc = G - g0 < GT ? G - g0 : GT;                                                \
        float mx[GT], inv[GT];                                                                       \
        {                                                                                            \
            vf qv[GT][NC];                                                                           \
            for (int gi = 0; gi < GT; gi++) {                                                        \
                mx[gi] = -INFINITY;                                                                  \
                for (int c = 0; c < NC; c++)                                                         \
                    qv[gi][c] = gi < gc ? vmul(QLDV(q + (b * H + h * G + g0 + gi) * D + VW * c), vset1(qscale)) \
                                        : vzero();                                                   \
            }                                                                                        \
            vf mxv[GT];                                                                              \
            float kf[VW * VW * NC];     /* VW keys' rows of K, widened to float32 */                 \
            for (int gi = 0; gi < GT; gi++) mxv[gi] = vset1(-INFINITY);                              \
            for (int64_t j = 0; j < nblk; j++) {                                                     \
                const int64_t l0 = j * bs, n = L - l0 < bs ? L - l0 : bs;                            \
                const KT* kb = k + (int64_t)bt[j] * bs * row + h * D;                                \
                const int pf = h == h0 && g0 == 0 && j + PF_DIST < nblk;                             \
                const KT* kpf = pf ? k + (int64_t)bt[j + PF_DIST] * bs * row + h0 * D : NULL;        \
                const KT* vpf = pf ? v + (int64_t)bt[j + PF_DIST] * bs * row + h0 * D : NULL;        \
                /* VW keys at a time: their VW partial-product vectors reduced together (vtsum: the   \
                 * same sums as vhsum per key); only the tile's gc real query heads */                \
                for (int64_t o0 = 0; o0 < n; o0 += VW) {                                             \
                    const int64_t m = n - o0 < VW ? n - o0 : VW;                                     \
                    for (int64_t u = 0; u < m; u++) {   /* the keys widened once, for every head */  \
                        const KT* kp = kb + (o0 + u) * row;                                          \
                        if (pf) {                       /* one row of the block PF_DIST ahead per key */ \
                            prefetch_rows(kpf + (o0 + u) * row, 1, rb, hb);                          \
                            prefetch_rows(vpf + (o0 + u) * row, 1, rb, hb);                          \
                        }                                                                            \
                        for (int c = 0; c < NC; c++) vst(kf + u * D + VW * c, KLDV(kp + VW * c));   \
                    }                                                                                \
                    for (int gi = 0; gi < gc; gi++) {                                                \
                        vf a[VW];                                                                    \
                        for (int u = 0; u < VW; u++) {                                               \
                            if (u < m) {                                                             \
                                const float* kp = kf + u * D;                                        \
                                vf t = vmul(qv[gi][0], vld_f32(kp));                                 \
                                for (int c = 1; c < NC; c++) t = vfma(qv[gi][c], vld_f32(kp + VW * c), t); \
                                a[u] = t;                                                            \
                            } else {                                                                 \
                                a[u] = vzero();                                                      \
                            }                                                                        \
                        }                                                                            \
                        const vf sv = vtsum(a);                                                      \
                        float* sp = s + gi * L + l0 + o0;                                            \
                        if (m == VW) {                                                               \
                            vst(sp, sv);                                                             \
                            mxv[gi] = vmax(sv, mxv[gi]);    /* a NaN score leaves the max, as below */ \
                        } else {                                                                     \
                            float tb[VW];                                                            \
                            vst(tb, sv);                                                             \
                            for (int64_t u = 0; u < m; u++) {                                        \
                                sp[u] = tb[u];                                                       \
                                mx[gi] = tb[u] > mx[gi] ? tb[u] : mx[gi];                            \
                            }                                                                        \
                        }                                                                            \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            for (int gi = 0; gi < gc; gi++) {                                                        \
                const float vm = vhmax(mxv[gi]);                                                     \
                mx[gi] = vm > mx[gi] ? vm : mx[gi];                                                  \
            }                                                                                        \
        }                                                                                            \
        for (int gi = 0; gi < gc; gi++) {                                                            \
            float sum = 0.f; float* sg = s + gi * L; const float m = mx[gi];                         \
            for (int64_t l = 0; l < L; l++) { const float e = expf(sg[l] - m); sg[l] = e; sum += e; } \
            inv[gi] = vscale / sum;                                                                  \
        }                                                                                            \
        vf av[GT][NC];                                                                               \
        for (int gi = 0; gi < GT; gi++)                                                              \
            for (int c = 0; c < NC; c++) av[gi][c] = vzero();                                        \
        for (int64_t j = 0; j < nblk; j++) {                                                         \
            const int64_t l0 = j * bs, n = L - l0 < bs ? L - l0 : bs;                                \
            const KT* vb = v + (int64_t)bt[j] * bs * row + h * D;                                    \
            for (int64_t o = 0; o < n; o++) {                                                        \
                vf vv[NC];                                                                           \
                for (int c = 0; c < NC; c++) vv[c] = KLDV(vb + o * row + VW * c);                    \
                for (int gi = 0; gi < GT; gi++) {                                                    \
                    if (gi >= gc) break;                                                             \
                    const vf p = vset1(s[gi * L + l0 + o]);                                          \
                    for (int c = 0; c < NC; c++) av[gi][c] = vfma(p, vv[c], av[gi][c]);              \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int gi = 0; gi < gc; gi++) {                                                            \
            float ob[VW];                                                                            \
            QT* op = out + (b * H + h * G + g0 + gi) * D;                                            \
            for (int c = 0; c < NC; c++) {                                                           \
                vst(ob, vmul(av[gi][c], vset1(inv[gi])));                                            \
                for (int e = 0; e < VW; e++) ST(op + VW * c + e, ob[e]);                             \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}

/* Query-head tile per vector work item: enough rows to cover SmolLM/Llama-style groups of 3-4 at
 * head_dim 64 in one walk over the blocks; 2 at head_dim 128 (register pressure). */
#define GT64 4
#define GT128 2

/* AVX2: decode rows run the rows kernel's item (DEFINE_ROWS_ITEM, one token, the request's KV heads
 * h0..h0+NH-1 in one walk over its blocks): the same arithmetic per row as DEFINE_VEC_ITEM, with a
 * register plan that fits 16 ymm registers (DEFINE_VEC_ITEM keeps GT x NC query and output vectors
 * live: 32 at head_dim 64, spilled). AVX-512 (not measurable on the AVX2 machine this was written on)
 * and the scalar variant keep DEFINE_VEC_ITEM. -DTOKENMILL_DECODE_VEC_ITEM builds AVX2 decode on
 * DEFINE_VEC_ITEM too (tests: the two must give the same bits). */
/* Decode calls on per-KV-head items (B < 2 x threads, e.g. B = 1): the rows item prefetches its K rows
 * DECODE_PF_BLOCKS blocks ahead in pass 1, V likewise in pass 2 (V's first blocks during pass 1's last ones),
 * and during its last blocks the first K blocks of item it + num_threads (the thread's likely next item). One
 * item reads one KV head's rows (D elements every KVH * D) of blocks scattered by the block table: alone the
 * hardware prefetchers left it latency-bound (~5 GB/s per thread). Decode B=1, SmolLM2 9/3 x 64, bfloat16 KV,
 * ctx 257, a step's worth of other reads between layers (AVX2 EPYC, 2026-12-03): 1.10-1.14x with
 * consecutive blocks, 1.21-1.24x with shuffled ones, 1.17x at ctx 1024; 1, 4 blocks ahead or an L2 hint
 * measured the same, the next-item prefetch +1-4%. With K/V already in cache it costs ~7% (1 us per call).
 * docs/benchmarks/2026-12-03-decode-b1-avx2.md. Whole-request items (larger batches) keep none: their
 * slot-order sweep is the hardware prefetchers' pattern, and prefetch measured slower there. */
#define DECODE_PF_BLOCKS 2
#if VW == 8 && !defined(TOKENMILL_DECODE_VEC_ITEM)
#define DECODE_AS_ROWS 1
#else
#define DECODE_AS_ROWS 0
#endif

/* q, out: [B, H, D]; k, v: [num_slots, KVH, D]; block_tables: [B, bt_stride] int32; seq_lens: [B] int32.
 * A work item is a whole request (all KV heads) when there are at least two requests per thread
 * (each block's contiguous [bs, KVH, D] rows are walked once and prefetched PF_DIST ahead), else
 * (request, KV head) so small batches keep every thread busy; scheduled dynamically. The score
 * rows s hold L floats for each of G (scalar) or up to GT64 (vector tile) query rows. */
#define DEFINE_DECODE(QS, KS, QT, KT, RAWMUL)                                                       \
DEFINE_SCALAR_ITEM(dec_scalar_##QS##_##KS, QT, sld_##QS, KT, sld_##KS, sst_##QS)                    \
DEFINE_VEC_ITEM(dec_vec64_##QS##_##KS, QT, vld_##QS, KT, vld_##KS, sst_##QS, 64 / VW, GT64)          \
DEFINE_VEC_ITEM(dec_vec128_##QS##_##KS, QT, vld_##QS, KT, vld_##KS, sst_##QS, 128 / VW, GT128)      \
void paged_decode_##QS##_##KS(const QT* q, const KT* k, const KT* v, QT* out, const int32_t* block_tables, \
                              int64_t bt_stride, const int32_t* seq_lens, int64_t B, int64_t H,      \
                              int64_t KVH, int64_t D, int64_t bs, float scale, float k_scale,        \
                              float v_scale, int num_threads) {                                      \
    const int64_t G = H / KVH, hsplit = B >= 2 * num_threads ? 1 : KVH, NH = KVH / hsplit;          \
    const float qscale = scale * k_scale * (RAWMUL), vscale = v_scale * (RAWMUL);                    \
    _Pragma("omp parallel num_threads(num_threads)")                                                 \
    {                                                                                                \
        int64_t cap = 0; float* s = NULL;                                                            \
        float* work = (float*)malloc(sizeof(float) * 2 * G * D);                                     \
        _Pragma("omp for schedule(dynamic, 1)")                                                      \
        for (int64_t it = 0; it < B * hsplit; it++) {                                                \
            const int64_t b = it / hsplit, h0 = (it % hsplit) * NH, L = seq_lens[b];                 \
            const int32_t* bt = block_tables + b * bt_stride;                                        \
            if (DECODE_AS_ROWS && (D == 64 || D == 128)) {  /* one token: paged_rows_*'s own item */  \
                const int64_t pf = hsplit > 1 ? DECODE_PF_BLOCKS : 0, nit = it + num_threads;        \
                const int32_t* nbt = pf && nit < B * hsplit ? block_tables + nit / hsplit * bt_stride : NULL; \
                const int64_t nh0 = (nit % hsplit) * NH, nL = nbt ? seq_lens[nit / hsplit] : 0;      \
                const int64_t Ls = (L + VW - 1) / VW * VW + VW, need = Ls * NH * G;                  \
                if (need > cap) { free(s); cap = need; s = rows_buf_alloc(NH * G, NH, D, Ls, bs); }  \
                float *qf, *sc, *mxv, *mx, *o, *kf, *vt;                                             \
                rows_buf_split(s, NH * G, NH, D, Ls, &qf, &sc, &mxv, &mx, &o, &kf, &vt);             \
                if (D == 64)                                                                         \
                    rows64_##QS##_##KS(q, k, v, out, bt, b, 1, L, 0, 1, h0, NH, H, KVH, bs, qscale, vscale, \
                                       Ls, qf, sc, mxv, mx, o, kf, vt, pf, nbt, nh0, nL);          \
                else                                                                                 \
                    rows128_##QS##_##KS(q, k, v, out, bt, b, 1, L, 0, 1, h0, NH, H, KVH, bs, qscale, vscale, \
                                        Ls, qf, sc, mxv, mx, o, kf, vt, pf, nbt, nh0, nL);         \
                continue;                                                                            \
            }                                                                                        \
            const int64_t need = L * (G > GT64 ? G : GT64);                                          \
            if (need > cap) { free(s); cap = need; s = (float*)malloc(sizeof(float) * cap); }        \
            if (D == 64) {                                                                           \
                dec_vec64_##QS##_##KS(q, k, v, out, bt, L, b, h0, NH, H, KVH, G, bs, qscale, vscale, s); \
            } else if (D == 128) {                                                                   \
                dec_vec128_##QS##_##KS(q, k, v, out, bt, L, b, h0, NH, H, KVH, G, bs, qscale, vscale, s); \
            } else {                                                                                 \
                for (int64_t h = h0; h < h0 + NH; h++)                                               \
                    dec_scalar_##QS##_##KS(q, k, v, out, bt, L, b, h, H, KVH, G, D, bs, qscale, vscale, s, work); \
            }                                                                                        \
        }                                                                                            \
        free(s); free(work);                                                                         \
    }                                                                                                \
}

/* ================================================================ prefill / chunked prefill
 * Causal attention of R requests' new tokens over their whole context (cached prefix + the new
 * tokens, whose K/V are already in the cache), read straight from the block pool; online softmax
 * over key tiles as in FlashAttention-2 (Dao, arXiv 2307.08691, Algorithm 1), on the CPU.
 * Work item = (request, tile of PQ query tokens, KV head): its PQ * G query rows (the G query heads
 * sharing the KV head, so K/V tiles are read once per group) are kept scaled in float32; each key
 * tile of PK positions is transposed (K) and widened (V) once and reused by every row; S = Q K^T
 * runs PR rows at a time with the rows' PK scores in registers (PK / VW vectors each). Rows see keys
 * up to their own position (c + token index, c = cached prefix length); tiles past a row are
 * skipped. head_dim 64 or 128. */
#define PQ 32
#define PK 16
#define PKV (PK / VW)
#if VW == 16
#define PR 8
#else
#define PR 4
#endif

#define DEFINE_PREFILL_ITEM(NAME, QT, QLDV, KT, KLD, KLDV, ST, NC)                                    \
static void NAME(const QT* q, const KT* k, const KT* v, QT* out, const int32_t* bt, int64_t q0,       \
                 int64_t n, int64_t L, int64_t t0, int64_t h, int64_t H, int64_t KVH, int64_t bs,      \
                 float qscale, float vscale, float* qf, float* o, float* m, float* l, float* kt, float* vt) { \
    const int64_t D = VW * NC, G = H / KVH, row = KVH * D, c = L - n;                                  \
    const int64_t tq = n - t0 < PQ ? n - t0 : PQ, rows = tq * G;                                       \
    const vf sc = vset1(qscale);                                                                       \
    for (int64_t ri = 0; ri < rows + PR; ri++)                                                         \
        for (int cc = 0; cc < NC; cc++) {                                                              \
            vf x = vzero();                                                                            \
            if (ri < rows) x = vmul(QLDV(q + ((q0 + t0 + ri / G) * H + h * G + ri % G) * D + VW * cc), sc); \
            vst(qf + ri * D + VW * cc, x);                                                             \
        }                                                                                              \
    memset(o, 0, sizeof(float) * rows * D);                                                            \
    for (int64_t ri = 0; ri < rows; ri++) { m[ri] = -INFINITY; l[ri] = 0.f; }                          \
    const int64_t last = c + t0 + tq - 1;          /* the last key position any row of the tile sees */ \
    for (int64_t p0 = 0; p0 <= last; p0 += PK) {                                                       \
        const int64_t kn = last + 1 - p0 < PK ? last + 1 - p0 : PK;                                    \
        for (int64_t j = 0; j < PK; j++) {                                                             \
            if (j < kn) {                                                                              \
                const int64_t pos = p0 + j, slot = (int64_t)bt[pos / bs] * bs + pos % bs;               \
                const KT* kp = k + slot * row + h * D; const KT* vp = v + slot * row + h * D;          \
                for (int64_t d = 0; d < D; d++) kt[d * PK + j] = KLD(kp + d);                          \
                for (int cc = 0; cc < NC; cc++) vst(vt + j * D + VW * cc, KLDV(vp + VW * cc));         \
            } else {                                                                                   \
                for (int64_t d = 0; d < D; d++) kt[d * PK + j] = 0.f;                                  \
                for (int cc = 0; cc < NC; cc++) vst(vt + j * D + VW * cc, vzero());                    \
            }                                                                                          \
        }                                                                                              \
        const int64_t first_row = p0 > c + t0 ? (p0 - c - t0) * G : 0;  /* rows before see none */    \
        for (int64_t rc = first_row; rc < rows; rc += PR) {                                            \
            vf acc[PR][PKV];                                                                           \
            for (int i = 0; i < PR; i++)                                                               \
                for (int u = 0; u < PKV; u++) acc[i][u] = vzero();                                     \
            for (int64_t d = 0; d < D; d++) {                                                          \
                vf kd[PKV];                                                                            \
                for (int u = 0; u < PKV; u++) kd[u] = vld_f32(kt + d * PK + VW * u);                   \
                for (int i = 0; i < PR; i++) {                                                         \
                    const vf qd = vset1(qf[(rc + i) * D + d]);                                         \
                    for (int u = 0; u < PKV; u++) acc[i][u] = vfma(qd, kd[u], acc[i][u]);              \
                }                                                                                      \
            }                                                                                          \
            for (int i = 0; i < PR && rc + i < rows; i++) {                                            \
                const int64_t ri = rc + i, qpos = c + t0 + ri / G;                                     \
                int64_t nv = qpos - p0 + 1; nv = nv < kn ? nv : kn;                                    \
                if (nv <= 0) continue;                                                                 \
                float pj[PK];                                                                          \
                for (int u = 0; u < PKV; u++) vst(pj + VW * u, acc[i][u]);                             \
                float mt = m[ri];                                                                      \
                for (int64_t j = 0; j < nv; j++) mt = pj[j] > mt ? pj[j] : mt;                         \
                float psum = 0.f;                                                                      \
                for (int64_t j = 0; j < nv; j++) { pj[j] = expf(pj[j] - mt); psum += pj[j]; }          \
                const float corr = expf(m[ri] - mt);                                                   \
                l[ri] = l[ri] * corr + psum;                                                           \
                m[ri] = mt;                                                                            \
                vf ov[NC];                                                                             \
                const vf cv = vset1(corr);                                                             \
                for (int cc = 0; cc < NC; cc++) ov[cc] = vmul(vld_f32(o + ri * D + VW * cc), cv);      \
                for (int64_t j = 0; j < nv; j++) {                                                     \
                    const vf pv = vset1(pj[j]);                                                        \
                    for (int cc = 0; cc < NC; cc++) ov[cc] = vfma(pv, vld_f32(vt + j * D + VW * cc), ov[cc]); \
                }                                                                                      \
                for (int cc = 0; cc < NC; cc++) vst(o + ri * D + VW * cc, ov[cc]);                     \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int64_t ri = 0; ri < rows; ri++) {                                                            \
        const float inv = vscale / l[ri];                                                              \
        QT* op = out + ((q0 + t0 + ri / G) * H + h * G + ri % G) * D;                                  \
        for (int64_t d = 0; d < D; d++) ST(op + d, o[ri * D + d] * inv);                               \
    }                                                                                                  \
}

/* q, out: [num_tokens, H, D]; k, v: [num_slots, KVH, D]; block_tables: [R, bt_stride] int32 (row r:
 * request r's blocks); q_start, q_len, seq_lens: [R] int32 (first row in q, new tokens, context
 * length after this step). head_dim 64 or 128 (other sizes return without writing). */
#define DEFINE_PREFILL(QS, KS, QT, KT, RAWMUL)                                                        \
DEFINE_PREFILL_ITEM(pre64_##QS##_##KS, QT, vld_##QS, KT, sld_##KS, vld_##KS, sst_##QS, 64 / VW)      \
DEFINE_PREFILL_ITEM(pre128_##QS##_##KS, QT, vld_##QS, KT, sld_##KS, vld_##KS, sst_##QS, 128 / VW)    \
void paged_prefill_##QS##_##KS(const QT* q, const KT* k, const KT* v, QT* out, const int32_t* block_tables, \
                               int64_t bt_stride, const int32_t* q_start, const int32_t* q_len,       \
                               const int32_t* seq_lens, int64_t R, int64_t H, int64_t KVH, int64_t D,  \
                               int64_t bs, float scale, float k_scale, float v_scale, int num_threads) { \
    if (D != 64 && D != 128) return;                                                                  \
    const float qscale = scale * k_scale * (RAWMUL), vscale = v_scale * (RAWMUL);                     \
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
            if (D == 64)                                                                              \
                pre64_##QS##_##KS(q, k, v, out, block_tables + r * bt_stride, q_start[r], q_len[r], seq_lens[r], \
                                  t * PQ, h, H, KVH, bs, qscale, vscale, qf, o, m, l, kt, vt);        \
            else                                                                                      \
                pre128_##QS##_##KS(q, k, v, out, block_tables + r * bt_stride, q_start[r], q_len[r], seq_lens[r], \
                                   t * PQ, h, H, KVH, bs, qscale, vscale, qf, o, m, l, kt, vt);       \
        }                                                                                             \
        free(buf);                                                                                    \
    }                                                                                                 \
    free(items);                                                                                      \
}

/* ================================================================ rows (batch-invariant, several rows per request)
 * Request r's q_len[r] new tokens over its paged context, token t seeing the first
 * seq_len - q_len + t + 1 positions (the causal mask), every row with the decode kernel's arithmetic
 * for its own context: the same bits as paged_decode_* over one row per token (a decode step, a
 * speculative-decoding verify step, a prompt or chunk under batch invariance), whatever the tile,
 * the item split, the thread count or the other rows. What is shared is the memory traffic, not the
 * arithmetic: a work item (request, tile of up to RT tokens, KV head) widens each K/V vector of the
 * tile's context once for its tq * G query rows, instead of once per token.
 *
 * Per row, exactly as DEFINE_VEC_ITEM: q scaled by qscale (one vmul); score of key l = vtsum over VW
 * keys of (q_0 k_0, then fma over the NC chunks in order); max over the row's scores (NaN ignored:
 * the value does not depend on the grouping); p_l = expf(s_l - max) and their sum in one loop over
 * l < L (the same loop text, which the compiler vectorises as in DEFINE_VEC_ITEM); out = v_scale / sum
 * times (fma(p_l, v_l, acc) over l in order, per output vector). Registers: pass 1 one row x VW keys
 * (chunks outermost, the VW keys' accumulators live), pass 2 up to RRB query heads of one token x RCW
 * output vectors, the V rows of a block widened once. An item may cover NH consecutive KV heads (AVX2
 * decode: a whole request per item, its K then its V rows read in order). The scalar variant, and head
 * sizes other than 64 / 128, run DEFINE_VEC_ITEM / DEFINE_SCALAR_ITEM themselves once per token (the
 * decode kernel's own code, so the bits hold by construction). */
/* A rows item's float buffers for nr query rows of nh KV heads, 64-byte aligned, each part a multiple of VW
 * floats: qf [nr, D] (scaled queries), s [nr, Ls] (scores, then p), mxv [nr, VW], mx [nr] (max, then the
 * row's v_scale / sum), o [nr, D] (output accumulators), kf [VW, D] (VW keys widened; [nh, 16, D] when
 * rows_seqk), vt [bs, D] (a block's V; [nh, bs, D] when rows_seqv).
 * rows_seqk / rows_seqv: an item serving several KV heads (AVX2 decode, a whole request) widens their
 * K rows of a key group / V rows of a block in one sweep in slot order, each slot's NH * D contiguous
 * elements at a time, instead of one head's rows at a time (a stride of KVH * D): decode B=64 from DRAM
 * 1.20x faster (AVX2 EPYC, 2026-12-02 night). Off where the widened part would exceed ROWS_KF_CAP /
 * ROWS_VT_CAP floats (32 / 48 KiB, to stay in L1/L2). Only where the values go changes, not the arithmetic. */
#define ROWS_KF_CAP 8192
#define ROWS_VT_CAP 12288
static inline int64_t rows_pad(int64_t x) { return (x + 15) / 16 * 16; }
static inline int rows_seqk(int64_t nh, int64_t D) { return nh > 1 && nh * 16 * D <= ROWS_KF_CAP; }
static inline int rows_seqv(int64_t nh, int64_t D, int64_t bs) {
    return nh > 1 && nh * bs * D <= ROWS_VT_CAP;
}
/* Pass 2 of an item that widens V one KV head at a time (not rows_seqv; not the register-widened one-token
 * tile) widens the V rows of ROWS_PV_SPAN keys (rows_vt_blocks whole blocks, at least one) at a time, so each
 * tile's accumulators are loaded and stored once per span instead of once per block (16-key blocks: a
 * 16-iteration inner loop). The FMAs per accumulator still run over the keys in order: the same bits.
 * Prefill 512 / 8 x 256 chunks, AVX2 EPYC float32: 1.05x / 1.04x (spans of 32 / 128 / 256 keys: less). */
#ifndef ROWS_PV_SPAN
#define ROWS_PV_SPAN 64
#endif
static inline int64_t rows_vt_blocks(int64_t bs) { return bs >= ROWS_PV_SPAN ? 1 : ROWS_PV_SPAN / bs; }
static inline float* rows_buf_alloc(int64_t nr, int64_t nh, int64_t D, int64_t Ls, int64_t bs) {
    const int64_t n = rows_pad(nr * D) * 2 + rows_pad(nr * Ls) + rows_pad(nr * 16) + rows_pad(nr)
                      + rows_pad(16 * D) * (rows_seqk(nh, D) ? nh : 1) + rows_pad(bs * D) * (rows_seqv(nh, D, bs) ? nh : rows_vt_blocks(bs));
    return (float*)aligned_alloc(64, sizeof(float) * n);
}
static inline void rows_buf_split(float* buf, int64_t nr, int64_t nh, int64_t D, int64_t Ls, float** qf, float** s,
                                  float** mxv, float** mx, float** o, float** kf, float** vt) {
    *qf = buf; *s = *qf + rows_pad(nr * D); *mxv = *s + rows_pad(nr * Ls); *mx = *mxv + rows_pad(nr * 16);
    *o = *mx + rows_pad(nr); *kf = *o + rows_pad(nr * D); *vt = *kf + rows_pad(16 * D) * (rows_seqk(nh, D) ? nh : 1);
}

#define RT 16
#define RRB 3
#define RCW 4

/* Software prefetch in whole-request items (NH > 1: AVX2 decode at B >= 2 x threads, verify tiles). A served
 * request's blocks are a random set of pool blocks (the pool hands out blocks from a free queue that finished
 * requests leave in arbitrary order), so every block's K (V) rows, one contiguous run of bs x NH x D elements,
 * start a new stream that the hardware prefetcher must pick up again. The item walks a stream of 2 x nblk
 * blocks, K of blocks 0..nblk-1 (pass 1) then V of blocks 0..nblk-1 (pass 2), and while it works on one
 * block it asks for the rows of the block ROWS_PF_DIST ahead in that stream, a key group's slots at a time,
 * so the requests' first V blocks arrive during pass 1's last K blocks. A block that follows the one before
 * it in the pool (a contiguous table, e.g. a prompt's blocks from a fresh pool) is left to the hardware
 * prefetcher, which already streams it: asking again cost 5% there. Caches of 1-2 byte elements only: with
 * float32 rows (12 KiB blocks at 3 x 64) the prefetches made scattered decode 6% slower. Measured (AVX2 EPYC,
 * 2026-12-03, docs/benchmarks/2026-12-03-kv-block-layout-avx2.md), attention alone, 30 layers, bfloat16 cache:
 * decode B=64 after 320 on scattered blocks 1.08x, verify 16 x 5 1.05x; one block ahead as good as 2 or 4.
 * Prefetches change no arithmetic. -DROWS_PF_DIST=0 builds without them. */
#ifndef ROWS_PF_DIST
#define ROWS_PF_DIST 1
#endif
#ifndef ROWS_PF_SKIP_ADJ
#define ROWS_PF_SKIP_ADJ 1
#endif
#ifndef ROWS_PF_HINT
#define ROWS_PF_HINT 3
#endif
/* The cache lines of n rows of `bytes` bytes, `stride` bytes apart (every line a byte of a row lies on). */
static inline void prefetch_lines(const char* p, int64_t n, int64_t stride, int64_t bytes) {
    for (int64_t r = 0; r < n; r++, p += stride)
        for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < (uintptr_t)p + (uintptr_t)bytes; a += 64)
            __builtin_prefetch((const void*)a, 0, ROWS_PF_HINT);
}
/* Slots s0..s0+cnt-1 (heads h0.., hb bytes of each slot's rb) of stream block p: K of block p, or V of block
 * p - nblk; nothing past the stream's end or a slot at or past position L. kh, vh: the caches offset to head
 * h0, as bytes. */
static inline void rows_prefetch(const char* kh, const char* vh, const int32_t* bt, int64_t nblk, int64_t L,
                                 int64_t p, int64_t s0, int64_t cnt, int64_t bs, int64_t rb, int64_t hb) {
    if (ROWS_PF_DIST <= 0 || p >= 2 * nblk) return;
    const int64_t j = p < nblk ? p : p - nblk;
    cnt = L - j * bs - s0 < cnt ? L - j * bs - s0 : cnt;
    if (cnt <= 0 || (ROWS_PF_SKIP_ADJ && j > 0 && bt[j] == bt[j - 1] + 1)) return;   /* see above */
    const char* a = (p < nblk ? kh : vh) + ((int64_t)bt[j] * bs + s0) * rb;
    if (hb == rb) prefetch_lines(a, 1, 0, cnt * rb);       /* all KV heads: the slots are one run */
    else prefetch_lines(a, cnt, rb, hb);
}

#define DEFINE_ROWS_ITEM(NAME, QT, QLDV, KT, KLDV, ST, NC)                                            \
static void NAME(const QT* q, const KT* k, const KT* v, QT* out, const int32_t* bt, int64_t q0,       \
                 int64_t n, int64_t L, int64_t t0, int64_t tq, int64_t h0, int64_t NH, int64_t H,       \
                 int64_t KVH, int64_t bs, float qscale, float vscale, int64_t Ls, float* qf, float* s,  \
                 float* mxv, float* mx, float* o, float* kf, float* vt, int64_t pf, const int32_t* nbt, int64_t nh0, int64_t nL) { \
    const int64_t D = VW * NC, G = H / KVH, row = KVH * D, c0 = L - n, rows = tq * G, nr = NH * rows;  \
    const int64_t Lmax = c0 + t0 + tq, nblk = (Lmax + bs - 1) / bs;                                    \
    const int seqk = rows_seqk(NH, D), seqv = rows_seqv(NH, D, bs);                                    \
    const int rpf = NH > 1 && sizeof(KT) <= 2;     /* software prefetch (see rows_prefetch) */         \
    const int64_t rb = row * (int64_t)sizeof(KT), hb = NH * D * (int64_t)sizeof(KT);                   \
    const char* kh = (const char*)(k + h0 * D), * vh = (const char*)(v + h0 * D);                      \
    for (int64_t p = 0; rpf && p < ROWS_PF_DIST; p++) rows_prefetch(kh, vh, bt, nblk, Lmax, p, 0, bs, bs, rb, hb); \
    for (int64_t ri = 0; ri < nr; ri++) {          /* row ri: KV head h0 + ri / rows, token, q head */ \
        const int64_t hh = h0 + ri / rows, rr = ri % rows;                                             \
        for (int c = 0; c < NC; c++)                                                                   \
            vst(qf + ri * D + VW * c,                                                                  \
                vmul(QLDV(q + ((q0 + t0 + rr / G) * H + hh * G + rr % G) * D + VW * c), vset1(qscale))); \
        vst(mxv + ri * VW, vset1(-INFINITY));                                                          \
        mx[ri] = -INFINITY;                                                                            \
    }                                                                                                  \
    /* pass 1: scores, VW keys at a time, every row that sees the group; per row the NC chunks in     \
     * order (c outer, the VW keys' accumulators in registers, each q chunk loaded once). No software \
     * prefetch: PF_DIST 2/4/8 blocks ahead measured 10-30% slower than none (AVX2 EPYC, decode B=64); \
     * again on 2026-12-02 night, one block ahead (K in pass 1, V in pass 2) 3%, two 7% slower; on a     \
     * server's scattered blocks it pays (rpf, whole-request items: see rows_prefetch). Except          \
     * pf > 0 (decode on per-KV-head items, see DECODE_PF_BLOCKS): K and V pf blocks ahead; nbt (when not \
     * NULL): the next item's block table row, KV head nh0 and context nL, whose first K blocks are      \
     * prefetched during pass 2's last ones. Prefetches only: the arithmetic is the same. */             \
    const int64_t hrb = NH * D * (int64_t)sizeof(KT), rwb = row * (int64_t)sizeof(KT);                 \
    for (int64_t j = 0; j < pf && j < nblk; j++)                                                       \
        prefetch_rows(k + ((int64_t)bt[j] * bs) * row + h0 * D, Lmax - j * bs < bs ? Lmax - j * bs : bs, rwb, hrb); \
    for (int64_t j = 0; j < nblk; j++) {                                                               \
        const int64_t l0 = j * bs, nb = Lmax - l0 < bs ? Lmax - l0 : bs;                               \
        if (pf && j + pf < nblk) {                                                                     \
            const int64_t jp = j + pf, np = Lmax - jp * bs < bs ? Lmax - jp * bs : bs;                 \
            prefetch_rows(k + ((int64_t)bt[jp] * bs) * row + h0 * D, np, rwb, hrb);                    \
        }                                                                                              \
        if (pf && j + pf >= nblk && j + pf - nblk < nblk) { /* the last blocks: V's first blocks */     \
            const int64_t jp = j + pf - nblk, np = Lmax - jp * bs < bs ? Lmax - jp * bs : bs;          \
            prefetch_rows(v + ((int64_t)bt[jp] * bs) * row + h0 * D, np, rwb, hrb);                    \
        }                                                                                              \
        for (int64_t o0 = 0; o0 < nb; o0 += VW) {                                                      \
            const int64_t m = nb - o0 < VW ? nb - o0 : VW, p0 = l0 + o0;                               \
            const int64_t tf = p0 - c0 - t0 > 0 ? p0 - c0 - t0 : 0;   /* first token that sees p0 */     \
            if (rpf)                /* this group's slots of the block ahead; the last group: the rest */ \
                rows_prefetch(kh, vh, bt, nblk, Lmax, j + ROWS_PF_DIST, o0, o0 + VW >= nb ? bs - o0 : VW, bs, rb, hb); \
            if (seqk)                                                                                  \
                for (int64_t u = 0; u < VW; u++)                                                       \
                    for (int64_t hi = 0; hi < NH; hi++) {                                              \
                        const KT* kp = k + ((int64_t)bt[j] * bs + o0 + u) * row + (h0 + hi) * D;       \
                        for (int c = 0; c < NC; c++)                                                   \
                            vst(kf + (hi * VW + u) * D + VW * c, u < m ? KLDV(kp + VW * c) : vzero()); \
                    }                                                                                  \
            for (int64_t hi = 0; hi < NH; hi++) {                                                      \
                const KT* kb = k + (int64_t)bt[j] * bs * row + (h0 + hi) * D;                          \
                float* kf_ = seqk ? kf + hi * VW * D : kf;                                             \
                for (int64_t u = 0; !seqk && u < VW; u++)                                              \
                    for (int c = 0; c < NC; c++)                                                       \
                        vst(kf + u * D + VW * c, u < m ? KLDV(kb + (o0 + u) * row + VW * c) : vzero()); \
                for (int64_t ti = tf; ti < tq; ti++)                                                   \
                for (int64_t ri = hi * rows + ti * G; ri < hi * rows + ti * G + G; ri++) {             \
                    int64_t nv = c0 + t0 + ti + 1 - p0; nv = nv < m ? nv : m;                          \
                    const float* qr = qf + ri * D;                                                     \
                    vf a[VW];                                                                          \
                    {                                                                                  \
                        const vf qc = vld_f32(qr);                                                     \
                        for (int u = 0; u < VW; u++) a[u] = vmul(qc, vld_f32(kf_ + u * D));            \
                    }                                                                                  \
                    for (int c = 1; c < NC; c++) {                                                     \
                        const vf qc = vld_f32(qr + VW * c);                                            \
                        for (int u = 0; u < VW; u++) a[u] = vfma(qc, vld_f32(kf_ + u * D + VW * c), a[u]); \
                    }                                                                                  \
                    const vf sv = vtsum(a);                                                            \
                    float* sp = s + ri * Ls + p0;                                                      \
                    vst(sp, sv);                                                                       \
                    if (nv == VW) {                                                                    \
                        vst(mxv + ri * VW, vmax(sv, vld_f32(mxv + ri * VW)));                          \
                    } else {                                                                           \
                        for (int64_t u = 0; u < nv; u++) mx[ri] = sp[u] > mx[ri] ? sp[u] : mx[ri];     \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    /* softmax numerators and 1 / sum, per row over its own context */                                 \
    for (int64_t ri = 0; ri < nr; ri++) {                                                              \
        const float vm = vhmax(vld_f32(mxv + ri * VW));                                                \
        const float mr = vm > mx[ri] ? vm : mx[ri];                                                    \
        const int64_t Lr = c0 + t0 + (ri % rows) / G + 1;                                              \
        float sum = 0.f; float* sg = s + ri * Ls; const float m = mr;                                  \
        for (int64_t l = 0; l < Lr; l++) { const float e = expf(sg[l] - m); sg[l] = e; sum += e; }     \
        mx[ri] = vscale / sum;                                                                         \
    }                                                                                                  \
    /* pass 2: out = sum_l p_l v_l, each span's V rows widened once for every row that sees them;     \
     * tiles of RRB query heads of one token x RCW output vectors, accumulators in registers */        \
    memset(o, 0, sizeof(float) * nr * D);                                                              \
    const int dv = !seqv && tq == 1 && G == RRB;   /* one tile: V widened in registers */              \
    const int64_t nsb = seqv || dv ? 1 : rows_vt_blocks(bs);   /* blocks per span of keys */           \
    for (int64_t j = 0; j < nblk; j += nsb) {                                                          \
        const int64_t l0 = j * bs, nb = Lmax - l0 < nsb * bs ? Lmax - l0 : nsb * bs;                   \
        const int64_t tf = l0 - c0 - t0 > 0 ? l0 - c0 - t0 : 0;                                        \
        if (pf && j + pf < nblk) {                                                                     \
            const int64_t jp = j + pf, np = Lmax - jp * bs < bs ? Lmax - jp * bs : bs;                 \
            prefetch_rows(v + ((int64_t)bt[jp] * bs) * row + h0 * D, np, rwb, hrb);                    \
        }                                                                                              \
        if (nbt && j + pf >= nblk && (j + pf - nblk) * bs < nL) {  /* the next item's first K blocks */ \
            const int64_t jp = j + pf - nblk, np = nL - jp * bs < bs ? nL - jp * bs : bs;              \
            prefetch_rows(k + ((int64_t)nbt[jp] * bs) * row + nh0 * D, np, rwb, hrb);                  \
        }                                                                                              \
        for (int64_t jb = 0; rpf && !seqv && jb < nsb; jb++)  /* the span ROWS_PF_DIST spans ahead */       \
            rows_prefetch(kh, vh, bt, nblk, Lmax, nblk + j + ROWS_PF_DIST * nsb + jb, 0, bs, bs, rb, hb);     \
        if (seqv)                                                                                      \
            for (int64_t u = 0; u < nb; u++) {                                                         \
                if (rpf)            /* slot u of the block ahead; the last slot: the rest */            \
                    rows_prefetch(kh, vh, bt, nblk, Lmax, nblk + j + ROWS_PF_DIST, u, u + 1 == nb ? bs - u : 1, \
                                  bs, rb, hb);                                                         \
                for (int64_t hi = 0; hi < NH; hi++) {                                                  \
                    const KT* vp = v + ((int64_t)bt[j] * bs + u) * row + (h0 + hi) * D;               \
                    for (int c = 0; c < NC; c++) vst(vt + (hi * bs + u) * D + VW * c, KLDV(vp + VW * c)); \
                }                                                                                      \
            }                                                                                          \
        for (int64_t hi = 0; hi < NH; hi++) {                                                          \
            const KT* vb = v + (int64_t)bt[j] * bs * row + (h0 + hi) * D;                              \
            const float* vt_ = seqv ? vt + hi * bs * D : vt;                                           \
            for (int64_t u = 0; !seqv && !dv && u < nb; u++) {   /* the span's V rows, block by block */\
                const KT* vp = v + ((int64_t)bt[j + u / bs] * bs + u % bs) * row + (h0 + hi) * D;      \
                for (int c = 0; c < NC; c++) vst(vt + u * D + VW * c, KLDV(vp + VW * c));              \
            }                                                                                          \
            for (int64_t ti = tf; ti < tq; ti++) {                                                     \
                int64_t nv = c0 + t0 + ti + 1 - l0; nv = nv < nb ? nv : nb;                           \
                for (int64_t g0 = 0; g0 < G; g0 += RRB) {                                              \
                    const int64_t gc = G - g0 < RRB ? G - g0 : RRB, r0 = hi * rows + ti * G + g0;      \
                    const float* sr = s + r0 * Ls + l0;                                                \
                    for (int cv = 0; cv < NC; cv += RCW) {                                             \
                        vf acc[RRB][RCW];                                                              \
                        float* op = o + r0 * D + VW * cv;                                              \
                        if (gc == RRB) {                                                               \
                            for (int i = 0; i < RRB; i++)                                              \
                                for (int x = 0; x < RCW; x++) acc[i][x] = vld_f32(op + i * D + VW * x); \
                            for (int64_t u = 0; dv && u < nv; u++) {                                   \
                                const KT* vp = vb + u * row + VW * cv;                                 \
                                vf p[RRB];                                                             \
                                for (int i = 0; i < RRB; i++) p[i] = vset1(sr[i * Ls + u]);            \
                                for (int x = 0; x < RCW; x++) {                                        \
                                    const vf vv = KLDV(vp + VW * x);                                   \
                                    for (int i = 0; i < RRB; i++) acc[i][x] = vfma(p[i], vv, acc[i][x]); \
                                }                                                                      \
                            }                                                                          \
                            for (int64_t u = 0; !dv && u < nv; u++) {                                  \
                                const float* vp = vt_ + u * D + VW * cv;                                \
                                vf p[RRB];                                                             \
                                for (int i = 0; i < RRB; i++) p[i] = vset1(sr[i * Ls + u]);            \
                                for (int x = 0; x < RCW; x++) {                                        \
                                    const vf vv = vld_f32(vp + VW * x);                                \
                                    for (int i = 0; i < RRB; i++) acc[i][x] = vfma(p[i], vv, acc[i][x]); \
                                }                                                                      \
                            }                                                                          \
                            for (int i = 0; i < RRB; i++)                                              \
                                for (int x = 0; x < RCW; x++) vst(op + i * D + VW * x, acc[i][x]);     \
                        } else {                                                                       \
                            for (int64_t i = 0; i < gc; i++) {                                         \
                                for (int x = 0; x < RCW; x++) acc[0][x] = vld_f32(op + i * D + VW * x); \
                                for (int64_t u = 0; u < nv; u++) {                                     \
                                    const vf p = vset1(sr[i * Ls + u]);                                \
                                    for (int x = 0; x < RCW; x++)                                      \
                                        acc[0][x] = vfma(p, vld_f32(vt_ + u * D + VW * (cv + x)), acc[0][x]); \
                                }                                                                      \
                                for (int x = 0; x < RCW; x++) vst(op + i * D + VW * x, acc[0][x]);     \
                            }                                                                          \
                        }                                                                              \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int64_t ri = 0; ri < nr; ri++) {                                                              \
        const int64_t hh = h0 + ri / rows, rr = ri % rows;                                             \
        float ob[VW];                                                                                  \
        QT* op = out + ((q0 + t0 + rr / G) * H + hh * G + rr % G) * D;                                 \
        for (int c = 0; c < NC; c++) {                                                                 \
            vst(ob, vmul(vld_f32(o + ri * D + VW * c), vset1(mx[ri])));                                \
            for (int e = 0; e < VW; e++) ST(op + VW * c + e, ob[e]);                                   \
        }                                                                                              \
    }                                                                                                  \
}

/* q, out: [num_tokens, H, D]; k, v: [num_slots, KVH, D]; block_tables: [R, bt_stride] int32 (row r:
 * request r's blocks); q_start, q_len, seq_lens: [R] int32 (first row in q, new tokens, context length
 * after this step; q_len <= seq_len). Any head_dim. Work items (request, tile of tokens, KV head) are
 * handed out longest context first; a tile has RT tokens, fewer where a long context would make its score
 * rows (tokens x G x context floats) exceed 4 MiB. Short tiles (all KV heads' rows <= 64, e.g. a verify
 * step) with at least two tiles per thread: items (request, tile, all KV heads), whose K/V copies run in
 * slot order (verify 16 x 5 after 257, AVX2 EPYC: 1.18x). A row's arithmetic is the same in either item.
 * Scalar variant / other head sizes: items (request, token), the decode kernel's item functions. */
#define DEFINE_ROWS(QS, KS, QT, KT, RAWMUL)                                                           \
void paged_rows_##QS##_##KS(const QT* q, const KT* k, const KT* v, QT* out, const int32_t* block_tables, \
                            int64_t bt_stride, const int32_t* q_start, const int32_t* q_len,          \
                            const int32_t* seq_lens, int64_t R, int64_t H, int64_t KVH, int64_t D,     \
                            int64_t bs, float scale, float k_scale, float v_scale, int num_threads) {  \
    const float qscale = scale * k_scale * (RAWMUL), vscale = v_scale * (RAWMUL);                     \
    const int64_t G = H / KVH;                                                                        \
    const int vec = VW > 1 && (D == 64 || D == 128);                                                  \
    int64_t maxL = 1;                                                                                 \
    for (int64_t r = 0; r < R; r++) maxL = seq_lens[r] > maxL ? seq_lens[r] : maxL;                   \
    const int64_t Ls = (maxL + VW - 1) / VW * VW + VW;                                                \
    int64_t pt = vec ? RT : 1;                                                                        \
    while (pt > 1 && pt * G * Ls > ((int64_t)1 << 20)) pt /= 2;                                       \
    /* short rows (a verify step's few tokens per request) with enough tiles for every thread: one item  \
     * serves all KV heads of its tile (as AVX2 decode does), so their K/V rows are copied in slot order */ \
    int64_t qmax = 1, tiles = 0;                                                                      \
    for (int64_t r = 0; r < R; r++) {                                                                 \
        qmax = q_len[r] > qmax ? q_len[r] : qmax; tiles += (q_len[r] + pt - 1) / pt;                  \
    }                                                                                                 \
    const int64_t ptr = qmax < pt ? qmax : pt;                                                        \
    const int64_t hg = vec && KVH > 1 && ptr * G * KVH <= 64 && tiles >= 2 * num_threads ? KVH : 1;    \
    const int64_t nh = vec ? KVH / hg : 1;                                                            \
    int64_t total = 0;                                                                                \
    for (int64_t r = 0; r < R; r++) total += (q_len[r] + pt - 1) / pt * nh;                           \
    int64_t* items = (int64_t*)malloc(sizeof(int64_t) * 3 * (total > 0 ? total : 1));                 \
    int64_t w = 0;                                                                                    \
    for (int64_t r = 0; r < R; r++)                                                                   \
        for (int64_t t = (q_len[r] + pt - 1) / pt - 1; t >= 0; t--)                                   \
            for (int64_t h = 0; h < nh; h++) { items[w++] = r; items[w++] = t * pt; items[w++] = h * hg; } \
    _Pragma("omp parallel num_threads(num_threads)")                                                  \
    {                                                                                                 \
        float* buf = vec ? rows_buf_alloc(ptr * G * hg, hg, D, Ls, bs)                                \
                         : (float*)malloc(sizeof(float) * (maxL * (G > GT64 ? G : GT64) + 2 * G * D)); \
        _Pragma("omp for schedule(dynamic, 1)")                                                       \
        for (int64_t it = 0; it < total; it++) {                                                      \
            const int64_t r = items[3 * it], t0 = items[3 * it + 1], h = items[3 * it + 2];           \
            const int32_t* bt = block_tables + r * bt_stride;                                         \
            const int64_t n = q_len[r], L = seq_lens[r];                                              \
            if (vec) {                                                                                \
                const int64_t tq = n - t0 < pt ? n - t0 : pt;                                         \
                float *qf, *s, *mxv, *mx, *o, *kf, *vt;                                               \
                rows_buf_split(buf, ptr * G * hg, hg, D, Ls, &qf, &s, &mxv, &mx, &o, &kf, &vt);       \
                if (D == 64)                                                                          \
                    rows64_##QS##_##KS(q, k, v, out, bt, q_start[r], n, L, t0, tq, h, hg, H, KVH, bs, qscale, \
                                       vscale, Ls, qf, s, mxv, mx, o, kf, vt, 0, NULL, 0, 0);     \
                else                                                                                  \
                    rows128_##QS##_##KS(q, k, v, out, bt, q_start[r], n, L, t0, tq, h, hg, H, KVH, bs, qscale, \
                                        vscale, Ls, qf, s, mxv, mx, o, kf, vt, 0, NULL, 0, 0);    \
            } else {                    /* one token: paged_decode_*'s own item for its context */    \
                const int64_t b = q_start[r] + t0, Lr = L - n + t0 + 1;                               \
                float* s = buf; float* work = s + maxL * (G > GT64 ? G : GT64);                       \
                if (D == 64)                                                                          \
                    dec_vec64_##QS##_##KS(q, k, v, out, bt, Lr, b, 0, KVH, H, KVH, G, bs, qscale, vscale, s); \
                else if (D == 128)                                                                    \
                    dec_vec128_##QS##_##KS(q, k, v, out, bt, Lr, b, 0, KVH, H, KVH, G, bs, qscale, vscale, s); \
                else                                                                                  \
                    for (int64_t hh = 0; hh < KVH; hh++)                                              \
                        dec_scalar_##QS##_##KS(q, k, v, out, bt, Lr, b, hh, H, KVH, G, D, bs, qscale, vscale, \
                                               s, work);                                              \
            }                                                                                         \
        }                                                                                             \
        free(buf);                                                                                    \
    }                                                                                                 \
    free(items);                                                                                      \
}

/* Exported: paged_{decode,prefill,rows}_<query/output type>_<cache type>. */
#define DEFINE_ALL(QS, KS, QT, KT, RAWMUL)                                                            \
    DEFINE_ROWS_ITEM(rows64_##QS##_##KS, QT, vld_##QS, KT, vld_##KS, sst_##QS, 64 / VW)              \
    DEFINE_ROWS_ITEM(rows128_##QS##_##KS, QT, vld_##QS, KT, vld_##KS, sst_##QS, 128 / VW)            \
    DEFINE_DECODE(QS, KS, QT, KT, RAWMUL) DEFINE_PREFILL(QS, KS, QT, KT, RAWMUL) DEFINE_ROWS(QS, KS, QT, KT, RAWMUL)
DEFINE_ALL(f32, f32, float, float, 1.f)
DEFINE_ALL(bf16, bf16, uint16_t, uint16_t, 1.f)
DEFINE_ALL(f32, bf16, float, uint16_t, 1.f)   /* float32 model, bfloat16 KV cache (AVX2 low-bit default) */
DEFINE_ALL(f32, i8, float, int8_t, 1.f)
DEFINE_ALL(bf16, i8, uint16_t, int8_t, 1.f)
DEFINE_ALL(f32, e4m3, float, uint8_t, E4M3_RAW_MUL)
DEFINE_ALL(bf16, e4m3, uint16_t, uint8_t, E4M3_RAW_MUL)
DEFINE_ALL(f32, e5m2, float, uint8_t, 1.f)
DEFINE_ALL(bf16, e5m2, uint16_t, uint8_t, 1.f)

/* ================================================================ KV write (+ quantise)
 * Scatter this step's K and V rows into the cache: row t of k / v (KVH * D elements, `k_stride` /
 * `v_stride` elements apart: they may be column slices of the fused q/k/v projection) goes to slot
 * slot_mapping[t]. Quantised caches store x * inv_scale, saturated at the format's largest value and
 * rounded to nearest even (the same bits as torch's conversion of the clamped value). */
static inline uint8_t f32_to_e4m3(float x) {    /* |x| <= 448, finite */
    union { uint32_t u; float f; } c; c.f = x;
    const uint8_t sign = (uint8_t)((c.u >> 24) & 0x80u);
    c.u &= 0x7fffffffu;
    if (c.f < 0.015625f) return sign | (uint8_t)rintf(c.f * 512.f);         /* subnormal: steps of 2^-9 */
    c.u += 0x7ffffu + ((c.u >> 20) & 1u);                                      /* round to 3 mantissa bits */
    return sign | (uint8_t)((((c.u >> 23) - 120u) << 3) | ((c.u >> 20) & 7u));
}
static inline uint8_t f32_to_e5m2(float x) {    /* |x| <= 57344, finite */
    union { uint32_t u; float f; } c; c.f = x;
    const uint8_t sign = (uint8_t)((c.u >> 24) & 0x80u);
    c.u &= 0x7fffffffu;
    if (c.f < 6.103515625e-05f) return sign | (uint8_t)rintf(c.f * 65536.f);  /* subnormal: steps of 2^-16 */
    c.u += 0xfffffu + ((c.u >> 21) & 1u);                                      /* round to 2 mantissa bits */
    return sign | (uint8_t)((((c.u >> 23) - 112u) << 2) | ((c.u >> 21) & 3u));
}
static inline float clampf(float x, float lim) { return x > lim ? lim : (x < -lim ? -lim : x); }
static inline void qst_f32(float* p, float x, float inv) { (void)inv; *p = x; }
static inline void qst_bf16(uint16_t* p, float x, float inv) { (void)inv; *p = f32_to_bf16(x); }
static inline void qst_i8(int8_t* p, float x, float inv) { *p = (int8_t)rintf(clampf(x * inv, 127.f)); }
static inline void qst_e4m3(uint8_t* p, float x, float inv) { *p = f32_to_e4m3(clampf(x * inv, 448.f)); }
static inline void qst_e5m2(uint8_t* p, float x, float inv) { *p = f32_to_e5m2(clampf(x * inv, 57344.f)); }

#define DEFINE_KV_WRITE(QS, KS, QT, KT)                                                               \
void kv_write_##QS##_##KS(const QT* k, const QT* v, const int64_t* slot_mapping, int64_t n, int64_t row,  \
                          int64_t k_stride, int64_t v_stride, KT* kc, KT* vc, float k_inv, float v_inv) { \
    for (int64_t t = 0; t < n; t++) {                                                                 \
        const QT* kr = k + t * k_stride; const QT* vr = v + t * v_stride;                             \
        KT* kd = kc + slot_mapping[t] * row; KT* vd = vc + slot_mapping[t] * row;                     \
        for (int64_t i = 0; i < row; i++) {                                                           \
            qst_##KS(kd + i, sld_##QS(kr + i), k_inv);                                                \
            qst_##KS(vd + i, sld_##QS(vr + i), v_inv);                                                \
        }                                                                                             \
    }                                                                                                 \
}
DEFINE_KV_WRITE(f32, f32, float, float)
DEFINE_KV_WRITE(bf16, bf16, uint16_t, uint16_t)
DEFINE_KV_WRITE(f32, bf16, float, uint16_t)
DEFINE_KV_WRITE(f32, i8, float, int8_t)
DEFINE_KV_WRITE(bf16, i8, uint16_t, int8_t)
DEFINE_KV_WRITE(f32, e4m3, float, uint8_t)
DEFINE_KV_WRITE(bf16, e4m3, uint16_t, uint8_t)
DEFINE_KV_WRITE(f32, e5m2, float, uint8_t)
DEFINE_KV_WRITE(bf16, e5m2, uint16_t, uint8_t)
