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

/* out[q] = dot(x[0..K), a_q[0..K)) for na <= 4 rank vectors a_q = a + q * lda (x float32, a float32 or
 * bfloat16), x read once for all na. Each dot's arithmetic is the same whatever na: two 16-lane (AVX2: 8-lane)
 * accumulator chains over k, added, then a fixed horizontal sum, then the scalar tail. (na independent pairs of
 * chains keep the FMA units busy; one vector at a time waited on the FMA latency.) */
static inline __attribute__((always_inline)) void dotq_impl(const float *x, const void *a, const int na, int64_t lda,
                                                             int64_t K, int abf, float *out) {
    int64_t k0 = 0;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    const size_t esz = abf ? 2 : 4;
    const char *ap[4];
    for (int q = 0; q < na; q++) ap[q] = (const char *)a + q * lda * (int64_t)esz;
#if defined(__AVX512F__)
    __m512 c0[4], c1[4];
    for (int q = 0; q < na; q++) c0[q] = c1[q] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
        for (int q = 0; q < na; q++) {
            c0[q] = _mm512_fmadd_ps(x0, ld16(ap[q] + k * esz, abf), c0[q]);
            c1[q] = _mm512_fmadd_ps(x1, ld16(ap[q] + (k + 16) * esz, abf), c1[q]);
        }
    }
    for (; k + 16 <= K; k += 16) {
        const __m512 x0 = _mm512_loadu_ps(x + k);
        for (int q = 0; q < na; q++) c0[q] = _mm512_fmadd_ps(x0, ld16(ap[q] + k * esz, abf), c0[q]);
    }
    for (int q = 0; q < na; q++) s[q] = _mm512_reduce_add_ps(_mm512_add_ps(c0[q], c1[q]));
    k0 = k;
#elif defined(__AVX2__)
    __m256 c0[4], c1[4];
    for (int q = 0; q < na; q++) c0[q] = c1[q] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int q = 0; q < na; q++) {
            c0[q] = _mm256_fmadd_ps(x0, ld8(ap[q] + k * esz, abf), c0[q]);
            c1[q] = _mm256_fmadd_ps(x1, ld8(ap[q] + (k + 8) * esz, abf), c1[q]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + k);
        for (int q = 0; q < na; q++) c0[q] = _mm256_fmadd_ps(x0, ld8(ap[q] + k * esz, abf), c0[q]);
    }
    for (int q = 0; q < na; q++) {
        __m256 c = _mm256_add_ps(c0[q], c1[q]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        s[q] = _mm_cvtss_f32(h);
    }
    k0 = k;
#else
    for (int q = 0; q < na; q++) {
        float acc[16] = {0};
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            for (int l = 0; l < 16; l++) acc[l] += x[k + l] * ld1(ap[q], k + l, abf);
        for (int l = 0; l < 16; l++) s[q] += acc[l];
        k0 = k;
    }
#endif
    for (int q = 0; q < na; q++) {
        float v = s[q];
        for (int64_t k = k0; k < K; k++) v += x[k] * ld1(ap[q], k, abf);
        out[q] = v;
    }
}

/* dotq_impl with the vector count a constant (the unrolled accumulators stay in registers). */
static void dotq(const float *x, const void *a, int na, int64_t lda, int64_t K, int abf, float *out) {
    switch (na) {
    case 4: dotq_impl(x, a, 4, lda, K, abf, out); break;
    case 3: dotq_impl(x, a, 3, lda, K, abf, out); break;
    case 2: dotq_impl(x, a, 2, lda, K, abf, out); break;
    default: dotq_impl(x, a, 1, lda, K, abf, out); break;
    }
}

/* acc_i[0..n) = sum_{r < rank} z_i[r] * b[r * ldb + c], c < n <= CT, for nr <= 2 rows i sharing the loads of b;
 * r in order 0..rank-1 from 0 (one FMA chain per element, the same whatever nr; the 16-lane vectors of a tile are
 * independent chains, so the loop over r is outside). */
static inline __attribute__((always_inline)) void expand_impl(const float *const *z, const int nr, int rank,
                                                               const void *b, int64_t ldb, int bbf, int64_t n,
                                                               float *const *acc) {
    int64_t c = 0;
    const size_t esz = bbf ? 2 : 4;
#if defined(__AVX512F__)
    if (n == CT) {
        __m512 v[2][4];
        for (int i = 0; i < nr; i++) v[i][0] = v[i][1] = v[i][2] = v[i][3] = _mm512_setzero_ps();
        for (int r = 0; r < rank; r++) {
            const char *br = (const char *)b + r * ldb * esz;
            const __m512 b0 = ld16(br, bbf), b1 = ld16(br + 16 * esz, bbf), b2 = ld16(br + 32 * esz, bbf),
                         b3 = ld16(br + 48 * esz, bbf);
            for (int i = 0; i < nr; i++) {
                const __m512 zr = _mm512_set1_ps(z[i][r]);
                v[i][0] = _mm512_fmadd_ps(zr, b0, v[i][0]);
                v[i][1] = _mm512_fmadd_ps(zr, b1, v[i][1]);
                v[i][2] = _mm512_fmadd_ps(zr, b2, v[i][2]);
                v[i][3] = _mm512_fmadd_ps(zr, b3, v[i][3]);
            }
        }
        for (int i = 0; i < nr; i++)
            for (int q = 0; q < 4; q++) _mm512_storeu_ps(acc[i] + 16 * q, v[i][q]);
        return;
    }
    for (; c + 16 <= n; c += 16) {
        __m512 v[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int r = 0; r < rank; r++) {
            const __m512 br = ld16((const char *)b + (r * ldb + c) * esz, bbf);
            for (int i = 0; i < nr; i++) v[i] = _mm512_fmadd_ps(_mm512_set1_ps(z[i][r]), br, v[i]);
        }
        for (int i = 0; i < nr; i++) _mm512_storeu_ps(acc[i] + c, v[i]);
    }
#elif defined(__AVX2__)
    if (n == CT) {
        __m256 v[2][8];
        for (int i = 0; i < nr; i++)
            for (int q = 0; q < 8; q++) v[i][q] = _mm256_setzero_ps();
        for (int r = 0; r < rank; r++) {
            const char *br = (const char *)b + r * ldb * esz;
            for (int q = 0; q < 8; q++) {
                const __m256 bq = ld8(br + 8 * q * esz, bbf);
                for (int i = 0; i < nr; i++) v[i][q] = _mm256_fmadd_ps(_mm256_set1_ps(z[i][r]), bq, v[i][q]);
            }
        }
        for (int i = 0; i < nr; i++)
            for (int q = 0; q < 8; q++) _mm256_storeu_ps(acc[i] + 8 * q, v[i][q]);
        return;
    }
    for (; c + 8 <= n; c += 8) {
        __m256 v[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int r = 0; r < rank; r++) {
            const __m256 br = ld8((const char *)b + (r * ldb + c) * esz, bbf);
            for (int i = 0; i < nr; i++) v[i] = _mm256_fmadd_ps(_mm256_set1_ps(z[i][r]), br, v[i]);
        }
        for (int i = 0; i < nr; i++) _mm256_storeu_ps(acc[i] + c, v[i]);
    }
#endif
    for (; c < n; c++)
        for (int i = 0; i < nr; i++) {
            float v = 0.f;
            for (int r = 0; r < rank; r++) v = fmaf(z[i][r], ld1(b, r * ldb + c, bbf), v);
            acc[i][c] = v;
        }
}

static void expand_tile(const float *const *z, int nr, int rank, const void *b, int64_t ldb, int bbf, int64_t n,
                        float *const *acc) {
    if (nr == 2) expand_impl(z, 2, rank, b, ldb, bbf, n, acc);
    else expand_impl(z, 1, rank, b, ldb, bbf, n, acc);
}

/* dst[0..n) = src[0..n) widened from bfloat16 (exact). */
static void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16) _mm512_storeu_ps(dst + c, ld16(src + c, 1));
#elif defined(__AVX2__)
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(dst + c, ld8(src + c, 1));
#endif
    for (; c < n; c++) dst[c] = bf16_to_f32(src[c]);
}

/* y[c] = bf16(float(y[c]) + acc[c]) for c < n, rounded to nearest even as f32_to_bf16 (NaN stays NaN). */
static void add_bf16(uint16_t *y, const float *acc, int64_t n) {
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512i exp = _mm512_set1_epi32(0x7f800000), low = _mm512_set1_epi32(0xffff), one = _mm512_set1_epi32(1),
                  half = _mm512_set1_epi32(0x7fff), qbit = _mm512_set1_epi32(0x40);
    for (; c + 16 <= n; c += 16) {
        const __m512 s = _mm512_add_ps(ld16(y + c, 1), _mm512_loadu_ps(acc + c));
        const __m512i u = _mm512_castps_si512(s);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(
            _mm512_srli_epi32(u, 16), one))), 16);
        const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exp), exp);
        if (special) {
            const __mmask16 payload = _mm512_test_epi32_mask(u, low);
            const __m512i sp = _mm512_mask_or_epi32(_mm512_srli_epi32(u, 16), payload, _mm512_srli_epi32(u, 16), qbit);
            r = _mm512_mask_mov_epi32(r, special, sp);
        }
        _mm256_storeu_si256((__m256i *)(y + c), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; c < n; c++) y[c] = f32_to_bf16(bf16_to_f32(y[c]) + acc[c]);
}

/* The delta, in place on y. bf: x, y, A, B are bfloat16 (else float32). See the header comment for layouts.
 *   x [*, ldx], y [*, ldy]; K = in features, N = out features; k slices with column offsets off[0..k]
 *   (off[0] = 0, off[k] = N); R = slot rank; nthreads: OpenMP threads (<= 0: one).
 * Work items (built serially, split statically over the threads):
 *   shrink: (segment, block of <= RB rows, slice, chunk of <= QC rank vectors): the chunk's rank vectors stay in
 *           L1 while the block's rows stream past them, 4 vectors per pass over a row;
 *   expand: (segment, block of <= RB rows, slice, tile of <= CT columns): the tile of B stays in L1 while the
 *           block's rows pass it two at a time. */
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
            for (int64_t i = 0; i < nrows; i++)
                widen_bf16((const uint16_t *)x + (int64_t)rows[i] * ldx, xf + i * K, K);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n_sh; it++) {
            const item_t w = sh[it];
            const int s = seg_slot[w.g];
            const char *a0 = (const char *)A + (((int64_t)s * k + w.j) * R) * K * (int64_t)esz;
            for (int32_t r = w.r0; r < w.r1; r += 4) {
                const int na = w.r1 - r < 4 ? w.r1 - r : 4;
                const char *av = a0 + (int64_t)r * K * (int64_t)esz;
                {   /* prefetch the next 4 rank vectors (the next pass) into L1 */
                    const char *pf = av + 4 * K * (int64_t)esz;
                    for (int64_t o = 0; o < 4 * K * (int64_t)esz; o += 64) __builtin_prefetch(pf + o, 0, 3);
                }
                for (int32_t i = w.i0; i < w.i1; i++) {
                    const float *xr = bf ? xf + (int64_t)i * K : (const float *)x + (int64_t)rows[i] * ldx;
                    dotq(xr, av, na, K, K, wbf, z + (int64_t)i * kR + w.j * R + r);
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
            float acc_mem[2][CT];
            for (int r = 0; r < rank; r++) {   /* prefetch the next tile of B */
                const char *pf = b + ((int64_t)r * N + CT) * (int64_t)esz;
                __builtin_prefetch(pf, 0, 3);
                __builtin_prefetch(pf + 64, 0, 3);
                if (!wbf) { __builtin_prefetch(pf + 128, 0, 3); __builtin_prefetch(pf + 192, 0, 3); }
            }
            float *acc[2] = {acc_mem[0], acc_mem[1]};
            for (int32_t i = w.i0; i < w.i1; i += 2) {
                const int nr = w.i1 - i < 2 ? 1 : 2;
                const float *zr[2] = {z + (int64_t)i * kR + w.j * R, z + (int64_t)(i + nr - 1) * kR + w.j * R};
                expand_tile(zr, nr, rank, b, N, wbf, n, acc);
                for (int q = 0; q < nr; q++) {
                    const int64_t row = rows[i + q];
                    if (bf) add_bf16((uint16_t *)y + row * ldy + c0, acc[q], n);
                    else {
                        float *yr = (float *)y + row * ldy + c0;
                        for (int64_t c = 0; c < n; c++) yr[c] += acc[q][c];
                    }
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
