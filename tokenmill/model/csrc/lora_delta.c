/* Multi-LoRA delta for one linear layer: y[i, :] += (x[i, :] . A_s(i)^T) . B_s(i)^T for the rows i of a step
 * that use an adapter (slot s(i)), grouped by adapter (Punica's SGMV shape, Chen et al., arXiv 2310.18547 §4:
 * "shrink" x.A then "expand" .B over segments of rows that share an adapter).
 *
 * Layouts (tokenmill/model/layers/lora.py fills them; R = the slot rank, k = fused sub-projections):
 *   A: [S][k][R][K]  row r of slice j of slot s is A_{s,j}[r, :] (PEFT's lora_A rows), zero-padded ranks unused
 *   B: [S][R][N]     column block off[j] .. off[j+1]-1 of row r is (scale * B_{s,j})[:, r]
 *   ranks: [S][k] int32, the real rank of slice j in slot s (0: the adapter does not target that slice)
 *   meta: int32 [1 + nseg + (nseg + 1) + nrows]: nseg, then each segment's slot, then the segments' offsets
 *         into `rows`, then `rows`: the step's adapter rows sorted by slot (built once per step, read by every
 *         layer).
 * Only the rows listed are touched, and only each slot's real rank is read (bytes ~ the adapters the step uses).
 *
 * Row independence (batch invariance, docs/guide/batch_invariance.md): a row's delta is computed by the same
 * instruction sequence whatever the other rows are, how many share its segment, and where it sits in the batch:
 * the shrink is one fixed-order dot product per (row, rank vector) (2 x 16-lane accumulators, a fixed horizontal
 * sum), the expand sums the ranks in order 0..r-1 into a float32 accumulator per output column, which is then
 * added to y once. Threads only split (segment, rank vector) and (segment, column tile) work items.
 *
 * bfloat16 (x, y, A, B in bfloat16): widened to float32 in registers, float32 accumulation, y rounded to bfloat16
 * once (torch's round-to-nearest-even). Variant f32_wbf16: float32 x and y, bfloat16 A and B (widened on load).
 */
#include "common.h"
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define CT 64   /* output columns per expand work item */

/* ---- float32 / bfloat16 loads of 16 (AVX-512) or 8 (AVX2) lanes ------------------------------------------- */
#if defined(__AVX512F__)
static inline __m512 ld16(const void *p, int bf) {
    if (bf) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}
#elif defined(__AVX2__)
static inline __m256 ld8(const void *p, int bf) {
    if (bf) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}
#endif

static inline float ld1(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* out[i] = dot(x_i[0..K), a[0..K)) for nr <= 4 rows (x float32, a float32 or bfloat16; a read once for all nr
 * rows). Each row's arithmetic is the same whatever nr: two 16-lane (AVX2: 8-lane) accumulator chains over
 * k, added, then a fixed horizontal sum, then the scalar tail. */
static inline __attribute__((always_inline)) void dotn_impl(const float *const *x, const int nr, const void *a,
                                                             int64_t K, int abf, float *out) {
    int64_t k0 = 0;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX512F__)
    __m512 c0[4], c1[4];
    const size_t esz = abf ? 2 : 4;
    for (int i = 0; i < nr; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512 a0 = ld16((const char *)a + k * esz, abf), a1 = ld16((const char *)a + (k + 16) * esz, abf);
        for (int i = 0; i < nr; i++) {
            c0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x[i] + k), a0, c0[i]);
            c1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x[i] + k + 16), a1, c1[i]);
        }
    }
    for (; k + 16 <= K; k += 16) {
        const __m512 a0 = ld16((const char *)a + k * esz, abf);
        for (int i = 0; i < nr; i++) c0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x[i] + k), a0, c0[i]);
    }
    for (int i = 0; i < nr; i++) s[i] = _mm512_reduce_add_ps(_mm512_add_ps(c0[i], c1[i]));
    k0 = k;
#elif defined(__AVX2__)
    __m256 c0[4], c1[4];
    const size_t esz = abf ? 2 : 4;
    for (int i = 0; i < nr; i++) c0[i] = c1[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 a0 = ld8((const char *)a + k * esz, abf), a1 = ld8((const char *)a + (k + 8) * esz, abf);
        for (int i = 0; i < nr; i++) {
            c0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k), a0, c0[i]);
            c1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k + 8), a1, c1[i]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 a0 = ld8((const char *)a + k * esz, abf);
        for (int i = 0; i < nr; i++) c0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + k), a0, c0[i]);
    }
    for (int i = 0; i < nr; i++) {
        __m256 c = _mm256_add_ps(c0[i], c1[i]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        s[i] = _mm_cvtss_f32(h);
    }
    k0 = k;
#else
    for (int i = 0; i < nr; i++) {
        float acc[16] = {0};
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            for (int l = 0; l < 16; l++) acc[l] += x[i][k + l] * ld1(a, k + l, abf);
        for (int l = 0; l < 16; l++) s[i] += acc[l];
        k0 = k;
    }
#endif
    for (int i = 0; i < nr; i++) {
        float v = s[i];
        for (int64_t k = k0; k < K; k++) v += x[i][k] * ld1(a, k, abf);
        out[i] = v;
    }
}

/* dotn_impl with the row count a constant (the unrolled accumulators stay in registers). */
static void dotn(const float *const *x, int nr, const void *a, int64_t K, int abf, float *out) {
    switch (nr) {
    case 4: dotn_impl(x, 4, a, K, abf, out); break;
    case 3: dotn_impl(x, 3, a, K, abf, out); break;
    case 2: dotn_impl(x, 2, a, K, abf, out); break;
    default: dotn_impl(x, 1, a, K, abf, out); break;
    }
}

/* acc[0..n) = sum_{r < rank} z[r] * b[r * ldb + c], c < n <= CT, r in order 0..rank-1 from 0 (one FMA chain per
 * element; the 16-lane vectors of a tile are independent chains, so the loop over r is outside). */
static void expand_tile(const float *z, int rank, const void *b, int64_t ldb, int bbf, int64_t n, float *acc) {
    int64_t c = 0;
#if defined(__AVX512F__)
    const size_t esz = bbf ? 2 : 4;
    if (n == CT) {
        __m512 v0 = _mm512_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;
        for (int r = 0; r < rank; r++) {
            const __m512 zr = _mm512_set1_ps(z[r]);
            const char *br = (const char *)b + r * ldb * esz;
            v0 = _mm512_fmadd_ps(zr, ld16(br, bbf), v0);
            v1 = _mm512_fmadd_ps(zr, ld16(br + 16 * esz, bbf), v1);
            v2 = _mm512_fmadd_ps(zr, ld16(br + 32 * esz, bbf), v2);
            v3 = _mm512_fmadd_ps(zr, ld16(br + 48 * esz, bbf), v3);
        }
        _mm512_storeu_ps(acc, v0);
        _mm512_storeu_ps(acc + 16, v1);
        _mm512_storeu_ps(acc + 32, v2);
        _mm512_storeu_ps(acc + 48, v3);
        return;
    }
    for (; c + 16 <= n; c += 16) {
        __m512 v = _mm512_setzero_ps();
        for (int r = 0; r < rank; r++)
            v = _mm512_fmadd_ps(_mm512_set1_ps(z[r]), ld16((const char *)b + (r * ldb + c) * esz, bbf), v);
        _mm512_storeu_ps(acc + c, v);
    }
#elif defined(__AVX2__)
    const size_t esz = bbf ? 2 : 4;
    if (n == CT) {
        __m256 v[8];
        for (int q = 0; q < 8; q++) v[q] = _mm256_setzero_ps();
        for (int r = 0; r < rank; r++) {
            const __m256 zr = _mm256_set1_ps(z[r]);
            const char *br = (const char *)b + r * ldb * esz;
            for (int q = 0; q < 8; q++) v[q] = _mm256_fmadd_ps(zr, ld8(br + 8 * q * esz, bbf), v[q]);
        }
        for (int q = 0; q < 8; q++) _mm256_storeu_ps(acc + 8 * q, v[q]);
        return;
    }
    for (; c + 8 <= n; c += 8) {
        __m256 v = _mm256_setzero_ps();
        for (int r = 0; r < rank; r++)
            v = _mm256_fmadd_ps(_mm256_set1_ps(z[r]), ld8((const char *)b + (r * ldb + c) * esz, bbf), v);
        _mm256_storeu_ps(acc + c, v);
    }
#endif
    for (; c < n; c++) {
        float v = 0.f;
        for (int r = 0; r < rank; r++) v = fmaf(z[r], ld1(b, r * ldb + c, bbf), v);
        acc[c] = v;
    }
}

/* The delta, in place on y. bf: x, y, A, B are bfloat16 (else float32). See the header comment for layouts.
 *   x [*, ldx], y [*, ldy]; K = in features, N = out features; k slices with column offsets off[0..k]
 *   (off[0] = 0, off[k] = N); R = slot rank; nthreads: OpenMP threads (<= 0: one).
 * Work items (built serially, split statically over the threads):
 *   shrink: (segment, block of <= RB rows, slice, chunk of <= QC rank vectors): the chunk's rank vectors stay in
 *           L1 while the block's rows stream past them;
 *   expand: (segment, block of <= RB rows, slice, tile of <= CT columns): the tile of B stays in L1. */
#define RB 16
#define QC 8
typedef struct { int32_t g, i0, i1, j, r0, r1; } item_t;

static void lora_delta(const void *x, int64_t ldx, void *y, int64_t ldy, int64_t K, int64_t N, const void *A,
                       const void *B, int k, const int64_t *off, int64_t R, const int32_t *ranks,
                       const int32_t *meta, int nthreads, int bf, int wbf) {
    const int nseg = meta[0];
    if (nseg <= 0) return;
    const int32_t *seg_slot = meta + 1, *seg_off = meta + 1 + nseg, *rows = seg_off + nseg + 1;
    const int64_t nrows = seg_off[nseg], kR = (int64_t)k * R;
    const size_t esz = wbf ? 2 : 4;
    int64_t n_sh = 0, n_ex = 0, work = 0;
    for (int g = 0; g < nseg; g++) {
        const int64_t blocks = (seg_off[g + 1] - seg_off[g] + RB - 1) / RB;
        for (int j = 0; j < k; j++) {
            const int64_t rk = ranks[seg_slot[g] * k + j];
            if (rk == 0) continue;
            n_sh += blocks * ((rk + QC - 1) / QC);
            n_ex += blocks * ((off[j + 1] - off[j] + CT - 1) / CT);
            work += (seg_off[g + 1] - seg_off[g]) * rk * (K + off[j + 1] - off[j]);
        }
    }
    if (n_sh == 0) return;
    /* z [nrows][kR] float32, (bfloat16 only) the rows of x widened [nrows][K], then the item tables */
    const size_t zbytes = sizeof(float) * (size_t)(nrows * kR + (bf ? nrows * K : 0));
    char *mem = (char *)malloc(zbytes + sizeof(item_t) * (size_t)(n_sh + n_ex) + 64);
    if (!mem) return;
    float *z = (float *)mem, *xf = z + nrows * kR;
    item_t *sh = (item_t *)(mem + ((zbytes + 15) & ~(size_t)15)), *ex = sh + n_sh;
    int64_t a = 0, e = 0;
    for (int g = 0; g < nseg; g++)
        for (int32_t i0 = seg_off[g]; i0 < seg_off[g + 1]; i0 += RB) {
            const int32_t i1 = i0 + RB < seg_off[g + 1] ? i0 + RB : seg_off[g + 1];
            for (int j = 0; j < k; j++) {
                const int32_t rk = ranks[seg_slot[g] * k + j];
                if (rk == 0) continue;
                for (int32_t r0 = 0; r0 < rk; r0 += QC)
                    sh[a++] = (item_t){g, i0, i1, j, r0, r0 + QC < rk ? r0 + QC : rk};
                for (int64_t c0 = off[j]; c0 < off[j + 1]; c0 += CT)
                    ex[e++] = (item_t){g, i0, i1, j, (int32_t)c0, (int32_t)(c0 + CT < off[j + 1] ? c0 + CT : off[j + 1])};
            }
        }
    if (nthreads <= 0 || work < 65536) nthreads = 1;       /* too small to split */
#pragma omp parallel num_threads(nthreads)
    {
        if (bf) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nrows; i++) {
                const uint16_t *src = (const uint16_t *)x + (int64_t)rows[i] * ldx;
                for (int64_t c = 0; c < K; c++) xf[i * K + c] = bf16_to_f32(src[c]);
            }
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_sh; it++) {
            const item_t w = sh[it];
            const int s = seg_slot[w.g];
            for (int32_t r = w.r0; r < w.r1; r++) {
                const char *av = (const char *)A + (((int64_t)s * k + w.j) * R + r) * K * (int64_t)esz;
                /* one row per call: measured faster than 4-row blocks here (the rank vector is in L1 anyway) */
                for (int32_t i0 = w.i0; i0 < w.i1; i0 += 1) {
                    const int nr = 1;
                    const float *xr[4];
                    float d[4];
                    for (int q = 0; q < nr; q++)
                        xr[q] = bf ? xf + (int64_t)(i0 + q) * K : (const float *)x + (int64_t)rows[i0 + q] * ldx;
                    dotn(xr, nr, av, K, wbf, d);
                    for (int q = 0; q < nr; q++) z[(int64_t)(i0 + q) * kR + w.j * R + r] = d[q];
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_ex; it++) {
            const item_t w = ex[it];
            const int s = seg_slot[w.g];
            const int rank = ranks[s * k + w.j];
            const int64_t c0 = w.r0, n = w.r1 - w.r0;
            const char *b = (const char *)B + ((int64_t)s * R * N + c0) * (int64_t)esz;
            float acc[CT];
            for (int32_t i = w.i0; i < w.i1; i++) {
                expand_tile(z + (int64_t)i * kR + w.j * R, rank, b, N, wbf, n, acc);
                const int64_t row = rows[i];
                if (bf) {
                    uint16_t *yr = (uint16_t *)y + row * ldy + c0;
                    for (int64_t c = 0; c < n; c++) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + acc[c]);
                } else {
                    float *yr = (float *)y + row * ldy + c0;
                    for (int64_t c = 0; c < n; c++) yr[c] += acc[c];
                }
            }
        }
    }
    free(mem);
}

void tm_lora_delta_f32(const void *x, int64_t ldx, void *y, int64_t ldy, int64_t K, int64_t N, const void *A,
                       const void *B, int k, const int64_t *off, int64_t R, const int32_t *ranks,
                       const int32_t *meta, int nthreads) {
    lora_delta(x, ldx, y, ldy, K, N, A, B, k, off, R, ranks, meta, nthreads, 0, 0);
}

void tm_lora_delta_bf16(const void *x, int64_t ldx, void *y, int64_t ldy, int64_t K, int64_t N, const void *A,
                        const void *B, int k, const int64_t *off, int64_t R, const int32_t *ranks,
                        const int32_t *meta, int nthreads) {
    lora_delta(x, ldx, y, ldy, K, N, A, B, k, off, R, ranks, meta, nthreads, 1, 1);
}

/* float32 activations, bfloat16 adapter weights (--lora-dtype bfloat16 on a float32 model: half the bytes). */
void tm_lora_delta_f32_wbf16(const void *x, int64_t ldx, void *y, int64_t ldy, int64_t K, int64_t N, const void *A,
                             const void *B, int k, const int64_t *off, int64_t R, const int32_t *ranks,
                             const int32_t *meta, int nthreads) {
    lora_delta(x, ldx, y, ldy, K, N, A, B, k, off, R, ranks, meta, nthreads, 0, 1);
}
