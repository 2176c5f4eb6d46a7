/* Low-bit weight GEMM/GEMV for small steps: y[M, N] = x[M, K] . W[N, K]^T (+ bias), W in 4- or 8-bit codes.
 *
 * Weights stay in their codes; each code is widened to float32 in registers and multiplied with float32
 * activations (bfloat16 activations are widened once per call), so the result equals the dequantised weight's
 * GEMM up to float32 summation order. Group-wise affine codes: w[n, k] = scale[n, g] * q[n, k] + min[n, g],
 * g = k / group; summed per group as  scale * sum(x q) + min * sum(x)  (the second sum once per call).
 *
 * Packed layout (tokenmill/quantization/lowbit.py packs it), 16 output rows per tile:
 *   4-bit: codes [N/16][K/2][16] uint8, byte j of pair p = q[16t+j][2p] | q[16t+j][2p+1] << 4   (q in 0..15)
 *   8-bit: codes [N/16][K][16]   int8,  q in -128..127
 *   scale, min: [N/16][K/group][16] float32 (min may be NULL = 0)
 * The lanes of a vector are 16 output rows, so no horizontal sums are needed and each code is widened once
 * for all M activation rows.
 *
 * One source, compiled per ISA variant by tokenmill/model/layers/cpu_build.py:
 *   AVX-512F (+BW/VL/DQ) path: one 16-lane zmm per tile, up to 8 activation rows per pass; with bfloat16
 *     activations on a CPU with AVX512-BF16 (checked at run time), the bf16 dot-product path below;
 *   AVX2+FMA path: two 8-lane halves per tile, up to 4 rows per pass;
 *   portable C path otherwise.
 */
#include "common.h"
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define NT 16

/* Write a tile's accumulators out[mr][NT] (first nn columns) to y[r0 + r, n0 + j] (row stride ldy elements),
 * adding bias[n0 + j] when given, as bfloat16 (y_bf16) or float32. Shared by the float and integer paths. */
static inline void store_tile(const float *out, int mr, int64_t nn, const float *bias, int64_t n0, void *y,
                              int y_bf16, int64_t ldy, int64_t r0) {
#if defined(__AVX2__)
    if (!y_bf16 && nn == NT) {          /* a whole float32 tile: vector loads/stores (scalar: -10% at 2048 rows) */
        const __m256 b0 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
        for (int r = 0; r < mr; r++) {
            float *yr = (float *)y + (r0 + r) * ldy + n0;
            _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(out + r * NT), b0));
            _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(out + r * NT + 8), b1));
        }
        return;
    }
#endif
    for (int r = 0; r < mr; r++)
        for (int64_t j = 0; j < nn; j++) {
            float v = out[r * NT + j] + (bias ? bias[n0 + j] : 0.f);
            if (y_bf16) ((uint16_t *)y)[(r0 + r) * ldy + n0 + j] = f32_to_bf16(v);
            else ((float *)y)[(r0 + r) * ldy + n0 + j] = v;
        }
}

#if defined(__AVX512F__)
#define MR_MAX 8
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define MR_MAX 4
#define ISA_NAME "avx2"
#else
#define MR_MAX 4
#define ISA_NAME "scalar"
#endif

const char *tm_lowbit_isa(void) { return ISA_NAME; }

#define AI static inline __attribute__((always_inline))

/* acc[r][0..15] += sum over groups of tile t, rows r0 .. r0+MR-1 of xf / xs. */
/* NA independent accumulator chains per row hide the FMA latency. Always 2, whatever the number of rows MR
 * in a pass: a row's summation order (and so its bits) must not depend on how many rows share its pass, i.e.
 * on the step's size (batch invariance, docs/guide/batch_invariance.md; passes of 1-2 rows used to take 4
 * chains, which gave those rows other bits than the same rows in a pass of 3-8).
 * Codes are consumed 4 k at a time, so groups must be multiples of 4. */
#define NA(MR) 2
#if defined(__AVX512F__)
#define VF __m512
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VLOADF(p) _mm512_loadu_ps(p)
#define VSTOREF(p, v) _mm512_storeu_ps(p, v)
#define NH 1          /* passes over a 16-row tile */
#define VL 16         /* lanes per vector */
/* 4-bit: two consecutive k (low / high nibble) of VL rows from the 16 bytes at c. */
#define DEC4(c, w0, w1) do { __m512i v_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c))); \
        w0 = _mm512_cvtepi32_ps(_mm512_and_si512(v_, _mm512_set1_epi32(0xF))); \
        w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v_, 4)); } while (0)
#define DEC8(c, w) w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c))))
#elif defined(__AVX2__) && defined(__FMA__)
#define VF __m256
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VLOADF(p) _mm256_loadu_ps(p)
#define VSTOREF(p, v) _mm256_storeu_ps(p, v)
#define NH 2          /* two 8-row halves: bytes h*8 .. h*8+7 of every 16-byte tile row */
#define VL 8
#define DEC4(c, w0, w1) do { __m256i v_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c))); \
        w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v_, _mm256_set1_epi32(0xF))); \
        w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v_, 4)); } while (0)
#define DEC8(c, w) w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c))))
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* out[r][0..15] = sum over groups, rows r = 0 .. MR-1 of xf (rows K apart) / xs (rows K/G apart). */
AI void tile4(const uint8_t *codes, const float *sc, const float *mn, const float *xf, const float *xs,
              int64_t K, int64_t G, int MR, float *out) {
    const int64_t ng = K / G;
    for (int h = 0; h < NH; h++) {
        VF acc[MR_MAX];
        for (int r = 0; r < MR; r++) acc[r] = VZERO();
        for (int64_t g = 0; g < ng; g++) {
            VF ga[4][MR_MAX];
            for (int a = 0; a < NA(MR); a++)
                for (int r = 0; r < MR; r++) ga[a][r] = VZERO();
            const uint8_t *c = codes + g * (G / 2) * NT + h * VL;
            const float *xg = xf + g * G;
            for (int64_t p = 0; p < G / 2; p += 2) {
                VF w0, w1, w2, w3;
                DEC4(c + p * NT, w0, w1);
                DEC4(c + (p + 1) * NT, w2, w3);
                for (int r = 0; r < MR; r++) {
                    const float *xr = xg + r * K + 2 * p;
                    ga[0][r] = VFMA(w0, VBCAST(xr), ga[0][r]);
                    ga[1][r] = VFMA(w1, VBCAST(xr + 1), ga[1][r]);
                    ga[2 % NA(MR)][r] = VFMA(w2, VBCAST(xr + 2), ga[2 % NA(MR)][r]);
                    ga[3 % NA(MR)][r] = VFMA(w3, VBCAST(xr + 3), ga[3 % NA(MR)][r]);
                }
            }
            VF s = VLOADF(sc + g * NT + h * VL);
            for (int r = 0; r < MR; r++) {
                VF t = VADD(ga[0][r], ga[1][r]);
                if (NA(MR) == 4) t = VADD(t, VADD(ga[2][r], ga[3][r]));
                acc[r] = VFMA(t, s, acc[r]);
            }
            if (mn) {
                VF m = VLOADF(mn + g * NT + h * VL);
                for (int r = 0; r < MR; r++) acc[r] = VFMA(m, VBCAST(xs + r * ng + g), acc[r]);
            }
        }
        for (int r = 0; r < MR; r++) VSTOREF(out + r * NT + h * VL, acc[r]);
    }
}

AI void tile8(const int8_t *codes, const float *sc, const float *mn, const float *xf, const float *xs,
              int64_t K, int64_t G, int MR, float *out) {
    const int64_t ng = K / G;
    for (int h = 0; h < NH; h++) {
        VF acc[MR_MAX];
        for (int r = 0; r < MR; r++) acc[r] = VZERO();
        for (int64_t g = 0; g < ng; g++) {
            VF ga[4][MR_MAX];
            for (int a = 0; a < NA(MR); a++)
                for (int r = 0; r < MR; r++) ga[a][r] = VZERO();
            const int8_t *c = codes + g * G * NT + h * VL;
            const float *xg = xf + g * G;
            for (int64_t k = 0; k < G; k += 4) {
                VF w0, w1, w2, w3;
                DEC8(c + k * NT, w0);
                DEC8(c + (k + 1) * NT, w1);
                DEC8(c + (k + 2) * NT, w2);
                DEC8(c + (k + 3) * NT, w3);
                for (int r = 0; r < MR; r++) {
                    const float *xr = xg + r * K + k;
                    ga[0][r] = VFMA(w0, VBCAST(xr), ga[0][r]);
                    ga[1][r] = VFMA(w1, VBCAST(xr + 1), ga[1][r]);
                    ga[2 % NA(MR)][r] = VFMA(w2, VBCAST(xr + 2), ga[2 % NA(MR)][r]);
                    ga[3 % NA(MR)][r] = VFMA(w3, VBCAST(xr + 3), ga[3 % NA(MR)][r]);
                }
            }
            VF s = VLOADF(sc + g * NT + h * VL);
            for (int r = 0; r < MR; r++) {
                VF t = VADD(ga[0][r], ga[1][r]);
                if (NA(MR) == 4) t = VADD(t, VADD(ga[2][r], ga[3][r]));
                acc[r] = VFMA(t, s, acc[r]);
            }
            if (mn) {
                VF m = VLOADF(mn + g * NT + h * VL);
                for (int r = 0; r < MR; r++) acc[r] = VFMA(m, VBCAST(xs + r * ng + g), acc[r]);
            }
        }
        for (int r = 0; r < MR; r++) VSTOREF(out + r * NT + h * VL, acc[r]);
    }
}

#else
AI void tile4(const uint8_t *codes, const float *sc, const float *mn, const float *xf, const float *xs,
              int64_t K, int64_t G, int MR, float *out) {
    const int64_t ng = K / G;
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NT; j++) {
            float acc = 0.f;
            for (int64_t g = 0; g < ng; g++) {
                float ga = 0.f;
                const uint8_t *c = codes + g * (G / 2) * NT + j;
                const float *xg = xf + r * K + g * G;
                for (int64_t p = 0; p < G / 2; p++) {
                    uint8_t b = c[p * NT];
                    ga += (float)(b & 0xF) * xg[2 * p] + (float)(b >> 4) * xg[2 * p + 1];
                }
                acc += ga * sc[g * NT + j];
                if (mn) acc += mn[g * NT + j] * xs[r * ng + g];
            }
            out[r * NT + j] = acc;
        }
}

AI void tile8(const int8_t *codes, const float *sc, const float *mn, const float *xf, const float *xs,
              int64_t K, int64_t G, int MR, float *out) {
    const int64_t ng = K / G;
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NT; j++) {
            float acc = 0.f;
            for (int64_t g = 0; g < ng; g++) {
                float ga = 0.f;
                const int8_t *c = codes + g * G * NT + j;
                const float *xg = xf + r * K + g * G;
                for (int64_t k = 0; k < G; k++) ga += (float)c[k * NT] * xg[k];
                acc += ga * sc[g * NT + j];
                if (mn) acc += mn[g * NT + j] * xs[r * ng + g];
            }
            out[r * NT + j] = acc;
        }
}
#endif

#if defined(__AVX512F__)
/* bfloat16-activation path (AVX512-BF16, Cooper Lake / Zen 4 and later).
 * VDPBF16PS multiplies pairs of bfloat16 and adds both products to a float32 lane: 32 multiply-adds per
 * instruction where the float32 path's FMA does 16, so a verify step of a few rows (speculative decoding),
 * which is compute-bound on the float32 path, costs about half. Codes become bfloat16 pairs in registers:
 * 4-bit codes 0..15 by a 32-entry word table (VPERMW reads 5 index bits, so the table repeats its 16
 * entries and the bits above the nibble need no masking), 8-bit codes by int -> float32 -> the upper half
 * (exact: |q| <= 128 fits bfloat16's 8 significant bits). Products of a bfloat16 activation and a code are
 * exact in float32, so the result equals the widened path's up to summation order (VDPBF16PS flushes
 * denormal inputs to zero). Activation pairs (x[k], x[k+1]) are one 32-bit broadcast straight from the
 * bfloat16 rows. */
#define TBF __attribute__((target("avx512bf16")))
#define AIBF static inline __attribute__((always_inline, target("avx512bf16")))
#define DP(acc, w, xp) _mm512_dpbf16_ps(acc, (__m512bh)(w), (__m512bh)_mm512_set1_epi32(*(const int32_t *)(xp)))

/* 16 lanes of (bf16 q[k], bf16 q[k+1]) from the 16 code bytes at c (4-bit pairs). */
AIBF __m512i dec4_bf16(const uint8_t *c, __m512i table) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    return _mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), table);
}
/* 16 lanes of (bf16 q[k], bf16 q[k+1]) from the 16-byte code rows of k (c) and k+1 (c + NT), 8-bit. */
AIBF __m512i dec8_bf16(const int8_t *c) {
    __m512i f0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))));
    __m512i f1 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(c + NT)))));
    /* low word: f0's upper half; high word: f1's upper half (A | (B & C) = 0xF8) */
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(f0, 16), f1, _mm512_set1_epi32((int)0xFFFF0000u), 0xF8);
}

/* As tile4/tile8, with xb: bfloat16 rows K apart (pairs read as int32). */
AIBF void tile_bf16(int bits, const void *codes, const float *sc, const float *mn, const uint16_t *xb,
                    const float *xs, int64_t K, int64_t G, int MR, float *out) {
    const int64_t ng = K / G, np = G / 2;      /* pairs per group (G is a multiple of 4: np even) */
    const __m512i table = _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
        0x4040, 0x4000, 0x3F80, 0x0000,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080,
        0x4040, 0x4000, 0x3F80, 0x0000);
    __m512 acc[MR_MAX];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 ga[4][MR_MAX];
        for (int a = 0; a < NA(MR); a++)
            for (int r = 0; r < MR; r++) ga[a][r] = _mm512_setzero_ps();
        const uint16_t *xg = xb + g * G;
        int64_t p = 0;
        for (; p + 4 <= np; p += 4) {
            __m512i w0, w1, w2, w3;
            if (bits == 4) {
                const uint8_t *c = (const uint8_t *)codes + (g * np + p) * NT;
                w0 = dec4_bf16(c, table); w1 = dec4_bf16(c + NT, table);
                w2 = dec4_bf16(c + 2 * NT, table); w3 = dec4_bf16(c + 3 * NT, table);
            } else {
                const int8_t *c = (const int8_t *)codes + (g * G + 2 * p) * NT;
                w0 = dec8_bf16(c); w1 = dec8_bf16(c + 2 * NT); w2 = dec8_bf16(c + 4 * NT); w3 = dec8_bf16(c + 6 * NT);
            }
            for (int r = 0; r < MR; r++) {
                const uint16_t *xr = xg + r * K + 2 * p;
                ga[0][r] = DP(ga[0][r], w0, xr);
                ga[1][r] = DP(ga[1][r], w1, xr + 2);
                ga[2 % NA(MR)][r] = DP(ga[2 % NA(MR)][r], w2, xr + 4);
                ga[3 % NA(MR)][r] = DP(ga[3 % NA(MR)][r], w3, xr + 6);
            }
        }
        for (; p < np; p += 2) {
            __m512i w0, w1;
            if (bits == 4) {
                const uint8_t *c = (const uint8_t *)codes + (g * np + p) * NT;
                w0 = dec4_bf16(c, table); w1 = dec4_bf16(c + NT, table);
            } else {
                const int8_t *c = (const int8_t *)codes + (g * G + 2 * p) * NT;
                w0 = dec8_bf16(c); w1 = dec8_bf16(c + 2 * NT);
            }
            for (int r = 0; r < MR; r++) {
                const uint16_t *xr = xg + r * K + 2 * p;
                ga[0][r] = DP(ga[0][r], w0, xr);
                ga[1][r] = DP(ga[1][r], w1, xr + 2);
            }
        }
        __m512 s = _mm512_loadu_ps(sc + g * NT);
        for (int r = 0; r < MR; r++) {
            __m512 t = _mm512_add_ps(ga[0][r], ga[1][r]);
            if (NA(MR) == 4) t = _mm512_add_ps(t, _mm512_add_ps(ga[2][r], ga[3][r]));
            acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
        }
        if (mn) {
            __m512 m = _mm512_loadu_ps(mn + g * NT);
            for (int r = 0; r < MR; r++) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * ng + g]), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(out + r * NT, acc[r]);
}

TBF static void tile_rows_bf16(int bits, const void *codes, const float *sc, const float *mn, const uint16_t *xb,
                               const float *xs, int64_t K, int64_t G, int mr, float *out) {
    switch (mr) {
        case 1: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 1, out); break;
        case 2: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 2, out); break;
        case 3: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 3, out); break;
        case 4: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 4, out); break;
        case 5: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 5, out); break;
        case 6: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 6, out); break;
        case 7: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 7, out); break;
        case 8: tile_bf16(bits, codes, sc, mn, xb, xs, K, G, 8, out); break;
        default: break;
    }
}
#define HAVE_BF16_DOT 1
static int bf16_dot_on = -1;       /* -1: not decided yet (on where the CPU has AVX512-BF16) */
#else
#define HAVE_BF16_DOT 0
static int bf16_dot_on = 0;
#endif

/* Switch the bfloat16 dot-product path on (1) or off (0) for this process; returns whether it is on now
 * (never on a variant without it or a CPU without AVX512-BF16). Ablations and tests switch it. */
int tm_lowbit_set_bf16_dot(int on) {
#if HAVE_BF16_DOT
    __builtin_cpu_init();
    bf16_dot_on = on && __builtin_cpu_supports("avx512bf16");
#else
    (void)on;
#endif
    return bf16_dot_on;
}

/* One tile for rows r0 .. r0+mr-1, dispatched to a constant row count so the accumulators stay in registers. */
static void tile_rows(int bits, const void *codes, const float *sc, const float *mn, const float *xf,
                      const float *xs, int64_t K, int64_t G, int mr, float *out) {
#define CASE(R) case R: \
        if (bits == 4) tile4((const uint8_t *)codes, sc, mn, xf, xs, K, G, R, out); \
        else tile8((const int8_t *)codes, sc, mn, xf, xs, K, G, R, out); break;
    switch (mr) {
        CASE(1) CASE(2) CASE(3) CASE(4)
#if MR_MAX > 4
        CASE(5) CASE(6) CASE(7) CASE(8)
#endif
        default: break;
    }
#undef CASE
#undef B32
}

/* y[M, N] = x[M, K] . dequant(W)[N, K]^T + bias.
 *   x: float32 (x_bf16 = 0) or bfloat16 (x_bf16 = 1), rows ldx elements apart;
 *   codes/scale/min: packed as above for N_pad = ceil(N / 16) * 16 rows; min and bias may be NULL;
 *   y: float32 or bfloat16 (y_bf16), rows ldy elements apart; only the first N columns are written.
 * K must be a multiple of group, group a multiple of 4. */
void tm_lowbit_gemm(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, int64_t N, int bits,
                    const void *codes, int64_t group, const float *scale, const float *min, const float *bias,
                    void *y, int y_bf16, int64_t ldy) {
    const int64_t ng = K / group, ntiles = (N + NT - 1) / NT;
    const int64_t tile_bytes = bits == 4 ? K / 2 * NT : K * NT;
    if (bf16_dot_on < 0) tm_lowbit_set_bf16_dot(1);
    const int dot = x_bf16 && bf16_dot_on;
    /* xf: float32 rows (the float32 path) or the bfloat16 rows copied contiguously (the dot path) */
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K + M * ng));
    float *xs = xf + M * K;
    for (int64_t r = 0; r < M; r++) {
        float *dst = xf + r * K;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * ldx;
            if (dot) {
                memcpy((uint16_t *)xf + r * K, src, sizeof(uint16_t) * (size_t)K);
                if (min)
                    for (int64_t g = 0; g < ng; g++) {
                        float s = 0.f;
                        for (int64_t k = 0; k < group; k++) s += bf16_to_f32(src[g * group + k]);
                        xs[r * ng + g] = s;
                    }
                continue;
            }
            for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_f32(src[k]);
        } else {
            memcpy(dst, (const float *)x + r * ldx, sizeof(float) * (size_t)K);
        }
        if (min)
            for (int64_t g = 0; g < ng; g++) {
                float s = 0.f;
                for (int64_t k = 0; k < group; k++) s += dst[g * group + k];
                xs[r * ng + g] = s;
            }
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        float out[MR_MAX * NT];
        const char *c = (const char *)codes + t * tile_bytes;
        const float *sc = scale + t * ng * NT, *mn = min ? min + t * ng * NT : 0;
        const int64_t n0 = t * NT, nn = N - n0 < NT ? N - n0 : NT;
        for (int64_t r0 = 0; r0 < M; r0 += MR_MAX) {
            const int mr = (int)(M - r0 < MR_MAX ? M - r0 : MR_MAX);
#if HAVE_BF16_DOT
            if (dot)
                tile_rows_bf16(bits, c, sc, mn, (const uint16_t *)xf + r0 * K, xs + r0 * ng, K, group, mr, out);
            else
#endif
            tile_rows(bits, c, sc, mn, xf + r0 * K, xs + r0 * ng, K, group, mr, out);
            store_tile(out, mr, nn, bias, n0, y, y_bf16, ldy, r0);
        }
    }
    free(xf);
}

/* Pack row-major codes q[N, K] (uint8 0..15 for bits 4, int8 for bits 8) into the tile layout above;
 * rows N .. N_pad-1 are zero. out: ceil(N/16) * 16 * K / (bits == 4 ? 2 : 1) bytes. */
void tm_lowbit_pack(const uint8_t *q, int64_t N, int64_t K, int bits, uint8_t *out) {
    const int64_t ntiles = (N + NT - 1) / NT;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        for (int j = 0; j < NT; j++) {
            const int64_t n = t * NT + j;
            const uint8_t *row = n < N ? q + n * K : 0;
            if (bits == 4) {
                uint8_t *o = out + t * (K / 2) * NT + j;
                for (int64_t p = 0; p < K / 2; p++)
                    o[p * NT] = row ? (uint8_t)((row[2 * p] & 0xF) | (row[2 * p + 1] << 4)) : 0;
            } else {
                uint8_t *o = out + t * K * NT + j;
                for (int64_t k = 0; k < K; k++) o[k * NT] = row ? row[k] : 0;
            }
        }
    }
}

/* Dense weight from packed codes: out[N, K] = scale * q + min, float32 (out_bf16 = 0) or bfloat16.
 * For large steps, where one dense GEMM after this beats re-widening the codes for every 8 rows. */
void tm_lowbit_dequant(const void *codes, int bits, int64_t N, int64_t K, int64_t group, const float *scale,
                       const float *min, void *out, int out_bf16) {
    const int64_t ng = K / group, ntiles = (N + NT - 1) / NT;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t nn = N - t * NT < NT ? N - t * NT : NT;
        for (int j = 0; j < nn; j++) {
            const int64_t n = t * NT + j;
            for (int64_t k = 0; k < K; k++) {
                const int64_t g = k / group;
                float q;
                if (bits == 4) {
                    uint8_t b = ((const uint8_t *)codes)[t * (K / 2) * NT + (k / 2) * NT + j];
                    q = (float)((k & 1) ? b >> 4 : b & 0xF);
                } else {
                    q = (float)((const int8_t *)codes)[t * K * NT + k * NT + j];
                }
                float v = scale[(t * ng + g) * NT + j] * q + (min ? min[(t * ng + g) * NT + j] : 0.f);
                if (out_bf16) ((uint16_t *)out)[n * K + k] = f32_to_bf16(v);
                else ((float *)out)[n * K + k] = v;
            }
        }
    }
}

/* ====================================================================================================
 * Integer path for larger steps (W4A8 / W8A8): activations quantised to int8 per row and block of SB
 * input columns (symmetric, x ~= dx * xq, |xq| <= 127; SB = group if group <= 32, else 32), dotted with
 * the weight codes in 8-bit integer multiply-adds, as llama.cpp's Q4_1 x Q8_1 dot products do (idea only;
 * written for the tile layout below). Per block:
 *     y[m, n] += scale[n, g] * dx[m, s] * sum_k q[n, k] xq[m, k]   (+ min[n, g] * sum_k x[m, k], float x)
 * The integer sums are exact; the error against the dequantised float32 GEMM is the activations' rounding
 * (|x - dx xq| <= dx / 2 per element).
 *
 * Packed layout ("i8 layout", tm_lowbit_pack_i8), 16 output rows per tile, four consecutive k per 32-bit lane
 * so that one lane of an 8-bit multiply-add (AVX2 VPMADDUBSW + VPMADDWD, or AVX512-VNNI VPDPBUSD) sums one
 * output row's four products:
 *   4-bit: [N/16][K/8][16 rows][4 bytes]: byte i of row r = q[r][k0 + i] | q[r][k0 + 4 + i] << 4 (q in 0..15)
 *   8-bit: [N/16][K/4][16 rows][4 bytes]: q[r][k0 + i] (int8)
 *   scale / min: the float path's [N/16][K/group][16] arrays (shared), or float16 copies of them where every
 *   value is a float16 number (tm_lowbit_gemm_i8_h: GGUF's Q4_0/Q4_1/Q8_0; widened exactly, same bits).
 * 4-bit codes are the unsigned operand and xq the signed one: a 16-bit lane holds at most
 * 2 * 15 * 127 per multiply-add and SB / 2 <= 16 of those products... (16 * 1905 = 30480 < 2^15), so a block
 * of up to 32 columns accumulates in 16 bits. 8-bit codes are signed: |q| is the unsigned operand and xq
 * takes q's sign (VPSIGNB; pairs reach 2 * 128 * 127 = 32512), widened to 32 bits at once. */
#define NT_I8 16

#if defined(__AVX512F__)
#define MR_I8 8
#define VI __m512i
#define VLI 16
#define NHI 1
#define I_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define I_BCAST32(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define I_AND(a, b) _mm512_and_si512(a, b)
#define I_SRLI16(a, n) _mm512_srli_epi16(a, n)
#define I_SET1_8(v) _mm512_set1_epi8(v)
#define I_SET1_16(v) _mm512_set1_epi16(v)
#define I_ZERO() _mm512_setzero_si512()
#define I_ADD16(a, b) _mm512_add_epi16(a, b)
#define I_ADD32(a, b) _mm512_add_epi32(a, b)
#define I_MADDUBS(u, s) _mm512_maddubs_epi16(u, s)
#define I_MADD16(a, b) _mm512_madd_epi16(a, b)
#define I_ABS8(a) _mm512_abs_epi8(a)
#define I_SIGN8(x, w) _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x)
#define I_CVT(a) _mm512_cvtepi32_ps(a)
#elif defined(__AVX2__) && defined(__FMA__)
#define MR_I8 4
#define VI __m256i
#define VLI 8
#define NHI 2
#define I_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define I_BCAST32(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define I_AND(a, b) _mm256_and_si256(a, b)
#define I_SRLI16(a, n) _mm256_srli_epi16(a, n)
#define I_SET1_8(v) _mm256_set1_epi8(v)
#define I_SET1_16(v) _mm256_set1_epi16(v)
#define I_ZERO() _mm256_setzero_si256()
#define I_ADD16(a, b) _mm256_add_epi16(a, b)
#define I_ADD32(a, b) _mm256_add_epi32(a, b)
#define I_MADDUBS(u, s) _mm256_maddubs_epi16(u, s)
#define I_MADD16(a, b) _mm256_madd_epi16(a, b)
#define I_ABS8(a) _mm256_abs_epi8(a)
#define I_SIGN8(x, w) _mm256_sign_epi8(x, w)
#define I_CVT(a) _mm256_cvtepi32_ps(a)
#else
#define MR_I8 4
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* out[r][0..15] for activation rows r < MR: xq rows K apart, dx rows K/SB apart, xs rows K/G apart.
 * SB is a constant at every call site (the block loop unrolls); groups of G = spg * SB columns. */
AI void tile_i8(int bits, const uint8_t *codes, const float *sc, const float *mn, const int8_t *xq,
                const float *dx, const float *xs, int64_t K, int64_t G, const int64_t SB, int MR, float *out) {
    const int64_t nsb = K / SB, ng = K / G, spg = G / SB;
    const VI m0f = I_SET1_8(0x0F), ones = I_SET1_16(1);
    for (int h = 0; h < NHI; h++) {
        VF acc[MR_I8];
        for (int r = 0; r < MR; r++) acc[r] = VZERO();
        int64_t s = 0;
        for (int64_t g = 0; g < ng; g++) {
            const VF wsc = VLOADF(sc + g * NT + h * VL);
            for (int64_t si = 0; si < spg; si++, s++) {
                VI a[MR_I8];
                for (int r = 0; r < MR; r++) a[r] = I_ZERO();
                const int8_t *xb = xq + s * SB;
                if (bits == 4) {
                    const uint8_t *c = codes + s * (SB / 8) * (NT_I8 * 4) + h * VLI * 4;
#pragma GCC unroll 1
                    for (int64_t kb = 0; kb < SB / 8; kb++) {
                        const VI v = I_LOAD(c + kb * NT_I8 * 4);
                        const VI lo = I_AND(v, m0f), hi = I_AND(I_SRLI16(v, 4), m0f);
                        for (int r = 0; r < MR; r++) {
                            const int8_t *xr = xb + r * K + kb * 8;
                            a[r] = I_ADD16(a[r], I_ADD16(I_MADDUBS(lo, I_BCAST32(xr)), I_MADDUBS(hi, I_BCAST32(xr + 4))));
                        }
                    }
                    for (int r = 0; r < MR; r++) a[r] = I_MADD16(a[r], ones);
                } else {
                    const uint8_t *c = codes + s * (SB / 4) * (NT_I8 * 4) + h * VLI * 4;
#pragma GCC unroll 1
                    for (int64_t kb = 0; kb < SB / 4; kb++) {
                        const VI w = I_LOAD(c + kb * NT_I8 * 4);
                        const VI aw = I_ABS8(w);
                        for (int r = 0; r < MR; r++) {
                            const VI xv = I_SIGN8(I_BCAST32(xb + r * K + kb * 4), w);
                            a[r] = I_ADD32(a[r], I_MADD16(I_MADDUBS(aw, xv), ones));
                        }
                    }
                }
                for (int r = 0; r < MR; r++)
                    acc[r] = VFMA(I_CVT(a[r]), VMUL(wsc, VBCAST(dx + r * nsb + s)), acc[r]);
            }
            if (mn) {
                const VF m = VLOADF(mn + g * NT + h * VL);
                for (int r = 0; r < MR; r++) acc[r] = VFMA(m, VBCAST(xs + r * ng + g), acc[r]);
            }
        }
        for (int r = 0; r < MR; r++) VSTOREF(out + r * NT + h * VL, acc[r]);
    }
}

/* The common case, one weight group per block of 32 columns (G == SB == 32: GGUF's Q4_0/Q4_1/Q4_K/Q8_0):
 * as tile_i8 with the block's four (4-bit) or eight (8-bit) column steps unrolled and the pointers walked
 * forward, so the loop keeps its addresses in registers (the generic loop above spilled them). */
AI void tile_i8_b32(int bits, const uint8_t *codes, const float *sc, const float *mn, const int8_t *xq,
                    const float *dx, const float *xs, int64_t K, int MR, float *out) {
    const int64_t nsb = K / 32;
    const VI m0f = I_SET1_8(0x0F), ones = I_SET1_16(1);
    for (int h = 0; h < NHI; h++) {
        VF acc[MR_I8];
        for (int r = 0; r < MR; r++) acc[r] = VZERO();
        const uint8_t *c = codes + h * VLI * 4;
        const float *scp = sc + h * VL, *mnp = mn ? mn + h * VL : 0;
        for (int64_t s = 0; s < nsb; s++) {
            VI a[MR_I8];
            const int8_t *xb = xq + s * 32;
            if (bits == 4) {
#pragma GCC unroll 1
                for (int kb = 0; kb < 4; kb++) {
                    const VI v = I_LOAD(c + kb * NT_I8 * 4);
                    const VI lo = I_AND(v, m0f), hi = I_AND(I_SRLI16(v, 4), m0f);
                    for (int r = 0; r < MR; r++) {
                        const int8_t *xr = xb + r * K + kb * 8;
                        const VI p = I_ADD16(I_MADDUBS(lo, I_BCAST32(xr)), I_MADDUBS(hi, I_BCAST32(xr + 4)));
                        a[r] = kb ? I_ADD16(a[r], p) : p;
                    }
                }
                c += 4 * NT_I8 * 4;
                for (int r = 0; r < MR; r++) a[r] = I_MADD16(a[r], ones);
            } else {
#pragma GCC unroll 1
                for (int kb = 0; kb < 8; kb++) {
                    const VI w = I_LOAD(c + kb * NT_I8 * 4);
                    const VI aw = I_ABS8(w);
                    for (int r = 0; r < MR; r++) {
                        const VI p = I_MADD16(I_MADDUBS(aw, I_SIGN8(I_BCAST32(xb + r * K + kb * 4), w)), ones);
                        a[r] = kb ? I_ADD32(a[r], p) : p;
                    }
                }
                c += 8 * NT_I8 * 4;
            }
            const VF wsc = VLOADF(scp);
            scp += NT;
            for (int r = 0; r < MR; r++)
                acc[r] = VFMA(I_CVT(a[r]), VMUL(wsc, VBCAST(dx + r * nsb + s)), acc[r]);
            if (mnp) {
                const VF m = VLOADF(mnp);
                mnp += NT;
                for (int r = 0; r < MR; r++) acc[r] = VFMA(m, VBCAST(xs + r * nsb + s), acc[r]);
            }
        }
        for (int r = 0; r < MR; r++) VSTOREF(out + r * NT + h * VL, acc[r]);
    }
}
#else
AI void tile_i8(int bits, const uint8_t *codes, const float *sc, const float *mn, const int8_t *xq,
                const float *dx, const float *xs, int64_t K, int64_t G, int64_t SB, int MR, float *out) {
    const int64_t nsb = K / SB, ng = K / G, spg = G / SB;
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NT; j++) {
            float acc = 0.f;
            for (int64_t s = 0; s < nsb; s++) {
                const int64_t g = s / spg;
                int32_t isum = 0;
                for (int64_t k = s * SB; k < (s + 1) * SB; k++) {
                    int q;
                    if (bits == 4) {
                        const uint8_t b = codes[(k / 8) * NT_I8 * 4 + j * 4 + (k % 4)];
                        q = (k % 8) < 4 ? (b & 0xF) : (b >> 4);
                    } else {
                        q = ((const int8_t *)codes)[(k / 4) * NT_I8 * 4 + j * 4 + (k % 4)];
                    }
                    isum += q * xq[r * K + k];
                }
                acc += (float)isum * (sc[g * NT + j] * dx[r * nsb + s]);
                if (mn && s % spg == spg - 1) acc += mn[g * NT + j] * xs[r * ng + g];
            }
            out[r * NT + j] = acc;
        }
}
#endif


#if defined(__AVX2__) && (!defined(__AVX512F__) || (defined(__AMX_TILE__) && defined(__AMX_INT8__)))
/* A tile's 4-bit codes (i8 layout) unpacked to one byte per code: u[K/4][16 rows][4 bytes], byte i of row r in
 * step j = q[r][4j + i] (0..15), the order the AVX2 many-row passes and the AMX tiles (as the B operand) read. */
static void unpack4_tile(const uint8_t *codes, int64_t K, uint8_t *u) {
    const __m256i m0f = _mm256_set1_epi8(0x0F);
    for (int64_t kb = 0; kb < K / 8; kb++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(codes + kb * NT_I8 * 4));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(codes + kb * NT_I8 * 4 + 32));
        uint8_t *o = u + 2 * kb * NT_I8 * 4;
        _mm256_store_si256((__m256i *)o, _mm256_and_si256(v0, m0f));
        _mm256_store_si256((__m256i *)(o + 32), _mm256_and_si256(v1, m0f));
        _mm256_store_si256((__m256i *)(o + 64), _mm256_and_si256(_mm256_srli_epi16(v0, 4), m0f));
        _mm256_store_si256((__m256i *)(o + 96), _mm256_and_si256(_mm256_srli_epi16(v1, 4), m0f));
    }
}

/* This thread's buffer for a tile's unpacked codes (K * 16 bytes, 32-byte aligned), kept across calls. */
static uint8_t *u4_thread_buffer(int64_t K) {
    static __thread uint8_t *buf;
    static __thread int64_t cap;
    if (K * NT_I8 > cap) {
        free(buf);
        buf = (uint8_t *)aligned_alloc(64, (size_t)(K * NT_I8 + 63) / 64 * 64);
        cap = buf ? K * NT_I8 : 0;
    }
    return buf;
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2, G == SB == 32: as tile_i8_b32 with both 8-row halves of the 16-row tile in one pass (HH2). Each
 * activation broadcast then feeds both halves (half the broadcasts per multiply-add), each 64-byte code row
 * is read once per pass, and a pass of one row (decode) carries four independent float chains instead of two
 * in turn. Every output lane sees the same operations in the same order as in tile_i8_b32 (exact integer
 * block sums in any order, then acc = fma(float(sum), scale * dx, acc) and acc = fma(min, xs, acc) per
 * block), so the bits are the same whichever of the two runs and however rows are grouped into passes. */
#define MR_H2 2
/* The float part of one 32-column block for MR rows over both 8-column halves of a tile, the one every pass of
 * this file keeps (the bits depend on it, not on how the exact int32 sums a0/a1 were formed):
 * acc = fma(float(sum), scale * dx, acc), then acc = fma(min, xs, acc) where the weights have mins (mn != NULL).
 * sc, mn: this block's 16 scales / mins; dx, xs: per row r at dx[r * nsb + s] / xs[r * nsb + s]. */
AI void block_float_step_h(int MR, const __m256i *a0, const __m256i *a1, const float *sc, const float *mn,
                           const float *dx, const float *xs, int64_t nsb, int64_t s, __m256 *acc0, __m256 *acc1) {
    const __m256 wsc0 = _mm256_loadu_ps(sc), wsc1 = _mm256_loadu_ps(sc + 8);
    for (int r = 0; r < MR; r++) {
        const __m256 d = _mm256_broadcast_ss(dx + r * nsb + s);
        acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[r]), _mm256_mul_ps(wsc0, d), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[r]), _mm256_mul_ps(wsc1, d), acc1[r]);
    }
    if (mn) {
        const __m256 m0 = _mm256_loadu_ps(mn), m1 = _mm256_loadu_ps(mn + 8);
        for (int r = 0; r < MR; r++) {
            const __m256 xsv = _mm256_broadcast_ss(xs + r * nsb + s);
            acc0[r] = _mm256_fmadd_ps(m0, xsv, acc0[r]);
            acc1[r] = _mm256_fmadd_ps(m1, xsv, acc1[r]);
        }
    }
}
/* Store MR rows of a 16-column tile's accumulators (both halves) to out[r * NT + 0..15]. */
AI void store_rows_h(int MR, const __m256 *acc0, const __m256 *acc1, float *out) {
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(out + r * NT, acc0[r]);
        _mm256_storeu_ps(out + r * NT + 8, acc1[r]);
    }
}
/* One-row passes (decode: the codes stream from memory once per step) prefetch the codes PF_DIST bytes ahead:
 * each call streams only a few hundred KB per thread, too short for the hardware prefetcher's ramp-up alone
 * (AVX2 EPYC, 2 threads, a decode step's 111 MB of codes: 1024-4096 ahead all helped, 2048 the best median,
 * -13%). Prefetches never fault, so reading ahead past the last tile is harmless. */
#define PF_DIST 2048
AI void tile_i8_b32_h2(int bits, const uint8_t *codes, const float *sc, const float *mn, const int8_t *xq,
                       const float *dx, const float *xs, int64_t K, int MR, float *out) {
    const int64_t nsb = K / 32;
    const __m256i m0f = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc0[MR_H2], acc1[MR_H2];
    for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    const uint8_t *c = codes;
    const float *scp = sc, *mnp = mn;
    for (int64_t s = 0; s < nsb; s++) {
        __m256i a0[MR_H2], a1[MR_H2];
        const int8_t *xb = xq + s * 32;
        if (MR == 1) {
            _mm_prefetch((const char *)c + PF_DIST, _MM_HINT_T0);
            _mm_prefetch((const char *)c + PF_DIST + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)c + PF_DIST + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)c + PF_DIST + 192, _MM_HINT_T0);
            if (bits == 8) {
                _mm_prefetch((const char *)c + PF_DIST + 256, _MM_HINT_T0);
                _mm_prefetch((const char *)c + PF_DIST + 320, _MM_HINT_T0);
                _mm_prefetch((const char *)c + PF_DIST + 384, _MM_HINT_T0);
                _mm_prefetch((const char *)c + PF_DIST + 448, _MM_HINT_T0);
            }
        }
        if (bits == 4) {
#pragma GCC unroll 4
            for (int kb = 0; kb < 4; kb++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(c + kb * NT_I8 * 4));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(c + kb * NT_I8 * 4 + 32));
                const __m256i lo0 = _mm256_and_si256(v0, m0f), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m0f);
                const __m256i lo1 = _mm256_and_si256(v1, m0f), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m0f);
                for (int r = 0; r < MR; r++) {
                    const int8_t *xr = xb + r * K + kb * 8;
                    const __m256i x0 = _mm256_set1_epi32(*(const int32_t *)xr);
                    const __m256i x1 = _mm256_set1_epi32(*(const int32_t *)(xr + 4));
                    const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1));
                    const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0), _mm256_maddubs_epi16(hi1, x1));
                    a0[r] = kb ? _mm256_add_epi16(a0[r], p0) : p0;
                    a1[r] = kb ? _mm256_add_epi16(a1[r], p1) : p1;
                }
            }
            c += 4 * NT_I8 * 4;
            for (int r = 0; r < MR; r++) {
                a0[r] = _mm256_madd_epi16(a0[r], ones);
                a1[r] = _mm256_madd_epi16(a1[r], ones);
            }
        } else {
#pragma GCC unroll 2
            for (int kb = 0; kb < 8; kb++) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(c + kb * NT_I8 * 4));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(c + kb * NT_I8 * 4 + 32));
                const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
                for (int r = 0; r < MR; r++) {
                    const __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xb + r * K + kb * 4));
                    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(xv, w0)), ones);
                    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(xv, w1)), ones);
                    a0[r] = kb ? _mm256_add_epi32(a0[r], p0) : p0;
                    a1[r] = kb ? _mm256_add_epi32(a1[r], p1) : p1;
                }
            }
            c += 8 * NT_I8 * 4;
        }
        block_float_step_h(MR, a0, a1, scp, mnp, dx, xs, nsb, s, acc0, acc1);
        scp += NT;
        if (mnp) mnp += NT;
    }
    store_rows_h(MR, acc0, acc1, out);
}

/* Many-row passes (a batched decode step or a prefill chunk: >= U4_MIN_ROWS rows per row chunk), AVX2, 4-bit,
 * G == SB == 32. The tile's codes are unpacked once per tile into this thread's L1-resident buffer, one byte
 * per code in the order the multiply-adds consume them: u[K/4][16 rows][4 bytes], byte i of row r in step j
 * = q[r][4j + i] (0..15). Every pass of up to 4 activation rows then takes both 8-row halves of the tile at
 * once without the nibble unpack: per 4 columns and row, one activation broadcast feeds two VPMADDUBSW over
 * the 16 output rows (the packed loop above needs two broadcasts and the unpack per 8 columns and half), and
 * the two code vectors of a step are the only ones live, so 4 rows x 2 halves of 16-bit accumulators fit the
 * 16 ymm registers (the float accumulators, touched once per block, live in L1 between blocks). The unpack
 * costs about one pass's worth of loads and stores per tile, shared by every row of the chunk.
 * Bits: each 16-bit lane sums the same 16 products (|q x| <= 15 * 127) as tile_i8_b32's, exactly; the block's
 * int32 sum is the same number, and the float epilogue is the same operations in the same order
 * (acc = fma(float(sum), scale * dx, acc), then acc = fma(min, xs, acc), per block), so every output's bits
 * equal tile_i8_b32's and tile_i8_b32_h2's for any grouping of rows into passes. */
#define U4_MIN_ROWS 8
AI void tile_i8_b32_u(int bits, const uint8_t *u, const float *sc, const float *mn, const int8_t *xq, const float *dx,
                       const float *xs, int64_t K, int MR, float *out) {
    const int64_t nsb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0[MR_I8], acc1[MR_I8];
    for (int r = 0; r < MR; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        __m256i a0[MR_I8], a1[MR_I8];
        for (int r = 0; r < MR; r++) a0[r] = a1[r] = _mm256_setzero_si256();
        const int8_t *xb = xq + s * 32;
        const uint8_t *c = u + s * 8 * NT_I8 * 4;
        if (bits == 8 && MR == 4) {    /* 8-bit: |q| unsigned x (x with q's sign), pairs widened at once */
            /* the block's 8 column steps in one asm statement (no loop), the first step assigning the int32
             * accumulators instead of adding to zeroed ones (U_STEP8's OP): see the 4-bit case below */
            const int64_t K3 = 3 * K;
            __m256i w0, w1, t, v, p;
#define U8_ROW(J, X, A0, A1, OP) \
                        "vpbroadcastd " #J "*4+" X ", %[t]\n\t" \
                        "vpsignb " #J "*64(%[c]), %[t], %[v]\n\t" \
                        "vpmaddubsw %[v], %[w0], %[p]\n\t" \
                        OP(A0) \
                        "vpsignb " #J "*64+32(%[c]), %[t], %[v]\n\t" \
                        "vpmaddubsw %[v], %[w1], %[p]\n\t" \
                        OP(A1)
#define U8_SET(A) "vpmaddwd %[ones], %[p], %[" A "]\n\t"
#define U8_ADD(A) "vpmaddwd %[ones], %[p], %[p]\n\t" "vpaddd %[p], %[" A "], %[" A "]\n\t"
#define U_STEP8(J, OP) \
                        "vpabsb " #J "*64(%[c]), %[w0]\n\t" \
                        "vpabsb " #J "*64+32(%[c]), %[w1]\n\t" \
                        U8_ROW(J, "(%[x])", "a00", "a10", OP) \
                        U8_ROW(J, "(%[x],%[k1])", "a01", "a11", OP) \
                        U8_ROW(J, "(%[x],%[k1],2)", "a02", "a12", OP) \
                        U8_ROW(J, "(%[x],%[k3])", "a03", "a13", OP)
            __asm__(U_STEP8(0, U8_SET) U_STEP8(1, U8_ADD) U_STEP8(2, U8_ADD) U_STEP8(3, U8_ADD)
                    U_STEP8(4, U8_ADD) U_STEP8(5, U8_ADD) U_STEP8(6, U8_ADD) U_STEP8(7, U8_ADD)
                    : [a00] "=&x"(a0[0]), [a01] "=&x"(a0[1]), [a02] "=&x"(a0[2]), [a03] "=&x"(a0[3]),
                      [a10] "=&x"(a1[0]), [a11] "=&x"(a1[1]), [a12] "=&x"(a1[2]), [a13] "=&x"(a1[3]),
                      [w0] "=&x"(w0), [w1] "=&x"(w1), [t] "=&x"(t), [v] "=&x"(v), [p] "=&x"(p)
                    : [c] "r"(c), [x] "r"(xb), [k1] "r"(K), [k3] "r"(K3), [ones] "x"(ones)
                    : "memory");
#undef U_STEP8
#undef U8_ADD
#undef U8_SET
#undef U8_ROW
        } else if (bits == 8) {
#pragma GCC unroll 1
            for (int j = 0; j < 8; j++) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(c + j * NT_I8 * 4));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(c + j * NT_I8 * 4 + 32));
                const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
                for (int r = 0; r < MR; r++) {
                    const __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xb + r * K + 4 * j));
                    a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(xv, w0)), ones));
                    a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(xv, w1)), ones));
                }
            }
        } else if (MR == 4) {  /* GCC keeps 8 products and 8 accumulators live at once here (spills): the steps by hand */
            /* The block's 8 column steps in one asm statement, unrolled (no loop counter or branch per step), the
             * first step writing each accumulator instead of adding to a zeroed one: 2 fewer VPADDW per row and
             * block (the sums are the same integers). AVX2 EPYC, one thread, L1-resident 64-row tile, 4-bit
             * with mins: 62% -> 66% of the instruction peak (benchmarks/lowbit_kernel_ab.py --peak). */
            const int64_t K3 = 3 * K;
            __m256i w0, w1, t, p;
#define U4_ROW(J, X, A0, A1, OP) \
                        "vpbroadcastd " #J "*4+" X ", %[t]\n\t" \
                        "vpmaddubsw %[t], %[w0], " OP(A0) \
                        "vpmaddubsw %[t], %[w1], " OP(A1)
#define U4_SET(A) "%[" A "]\n\t"
#define U4_ADD(A) "%[p]\n\t" "vpaddw %[p], %[" A "], %[" A "]\n\t"
#define U_STEP4(J, OP) \
                        "vmovdqa " #J "*64(%[c]), %[w0]\n\t" \
                        "vmovdqa " #J "*64+32(%[c]), %[w1]\n\t" \
                        U4_ROW(J, "(%[x])", "a00", "a10", OP) \
                        U4_ROW(J, "(%[x],%[k1])", "a01", "a11", OP) \
                        U4_ROW(J, "(%[x],%[k1],2)", "a02", "a12", OP) \
                        U4_ROW(J, "(%[x],%[k3])", "a03", "a13", OP)
            __asm__(U_STEP4(0, U4_SET) U_STEP4(1, U4_ADD) U_STEP4(2, U4_ADD) U_STEP4(3, U4_ADD)
                    U_STEP4(4, U4_ADD) U_STEP4(5, U4_ADD) U_STEP4(6, U4_ADD) U_STEP4(7, U4_ADD)
                    : [a00] "=&x"(a0[0]), [a01] "=&x"(a0[1]), [a02] "=&x"(a0[2]), [a03] "=&x"(a0[3]),
                      [a10] "=&x"(a1[0]), [a11] "=&x"(a1[1]), [a12] "=&x"(a1[2]), [a13] "=&x"(a1[3]),
                      [w0] "=&x"(w0), [w1] "=&x"(w1), [t] "=&x"(t), [p] "=&x"(p)
                    : [c] "r"(c), [x] "r"(xb), [k1] "r"(K), [k3] "r"(K3)
                    : "memory");
#undef U_STEP4
#undef U4_ADD
#undef U4_SET
#undef U4_ROW
        } else
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(c + j * NT_I8 * 4));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(c + j * NT_I8 * 4 + 32));
            for (int r = 0; r < MR; r++) {
                const __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xb + r * K + 4 * j));
                a0[r] = _mm256_add_epi16(a0[r], _mm256_maddubs_epi16(w0, xv));
                a1[r] = _mm256_add_epi16(a1[r], _mm256_maddubs_epi16(w1, xv));
            }
        }
        if (bits == 4)
            for (int r = 0; r < MR; r++) {
                a0[r] = _mm256_madd_epi16(a0[r], ones);
                a1[r] = _mm256_madd_epi16(a1[r], ones);
            }
        block_float_step_h(MR, a0, a1, sc + s * NT, mn ? mn + s * NT : NULL, dx, xs, nsb, s, acc0, acc1);
    }
    store_rows_h(MR, acc0, acc1, out);
}

static void tile_rows_i8_u(int bits, const uint8_t *u, const float *sc, const float *mn, const int8_t *xq,
                           const float *dx, const float *xs, int64_t K, int mr, float *out) {
#define U_CASES(B) switch (mr) { \
        case 1: tile_i8_b32_u(B, u, sc, mn, xq, dx, xs, K, 1, out); break; \
        case 2: tile_i8_b32_u(B, u, sc, mn, xq, dx, xs, K, 2, out); break; \
        case 3: tile_i8_b32_u(B, u, sc, mn, xq, dx, xs, K, 3, out); break; \
        default: tile_i8_b32_u(B, u, sc, mn, xq, dx, xs, K, 4, out); break; }
    if (bits == 4) U_CASES(4) else U_CASES(8)
#undef U_CASES
}

/* The many-row passes' codes for tile c when a row chunk of `rows` rows takes them (4- or 8-bit, group 32,
 * >= U4_MIN_ROWS rows): 4-bit codes unpacked into this thread's buffer, 8-bit ones as they are (the i8 layout
 * already is one byte per code in that order); else NULL (tile_rows_i8's passes). Same bits either way. */
static const uint8_t *many_rows_codes(int bits, const uint8_t *c, int64_t K, int64_t group, int64_t rows) {
    if (group != 32 || rows < U4_MIN_ROWS) return 0;
    if (bits == 8) return c;
    uint8_t *u = u4_thread_buffer(K);
    if (u) unpack4_tile(c, K, u);
    return u;
}
#define HAVE_U4 1
#define HAVE_H2 1
#else
#define HAVE_H2 0
#define HAVE_U4 0
#define many_rows_codes(bits, c, K, group, rows) ((const uint8_t *)0)
#endif


#if defined(__AVX512F__)
/* AVX512-VNNI (Ice Lake, Cascade Lake, Zen 4 and later; checked at run time): VPDPBUSD multiplies four
 * unsigned x signed byte pairs per 32-bit lane and adds them to the lane in one instruction, where the
 * AVX-512BW path above needs VPMADDUBSW + VPMADDWD (+ VPADDD). Same operands (4-bit codes or |8-bit codes|
 * unsigned, the int8 activations signed), same integer sums (the BW path cannot saturate: see above), same
 * float epilogue in the same order, so the results are bit-identical to tile_i8_b32's: the switch changes
 * speed, never bits (tests/quantization/test_lowbit.py checks it). The common G == SB == 32 case only. */
#define AIVNNI static inline __attribute__((always_inline, target("avx512vnni")))
#define TVNNI __attribute__((target("avx512vnni")))
AIVNNI void tile_i8_b32_vnni(int bits, const uint8_t *codes, const float *sc, const float *mn, const int8_t *xq,
                             const float *dx, const float *xs, int64_t K, int MR, float *out) {
    const int64_t nsb = K / 32;
    const __m512i m0f = _mm512_set1_epi8(0x0F);
    __m512 acc[MR_I8];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *c = codes;
    const float *scp = sc, *mnp = mn;
    for (int64_t s = 0; s < nsb; s++) {
        /* two integer chains per row in passes of < 6 rows (VPDPBUSD's latency is 5 cycles: one chain of 8
         * per block stalled a pass of few rows), one in larger passes (enough chains; two spilled registers);
         * the integer sums are exact, so the bits do not depend on the split */
        __m512i a[MR_I8], b[MR_I8];
#define B_(r) (*(MR < 6 ? &b[r] : &a[r]))
        for (int r = 0; r < MR; r++) a[r] = b[r] = _mm512_setzero_si512();
        const int8_t *xb = xq + s * 32;
        if (bits == 4) {
#pragma GCC unroll 1
            for (int kb = 0; kb < 4; kb++) {
                const __m512i v = _mm512_loadu_si512((const void *)(c + kb * NT_I8 * 4));
                const __m512i lo = _mm512_and_si512(v, m0f), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
                for (int r = 0; r < MR; r++) {
                    const int8_t *xr = xb + r * K + kb * 8;
                    a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_set1_epi32(*(const int32_t *)xr));
                    B_(r) = _mm512_dpbusd_epi32(B_(r), hi, _mm512_set1_epi32(*(const int32_t *)(xr + 4)));
                }
            }
            c += 4 * NT_I8 * 4;
        } else {
#pragma GCC unroll 1
            for (int kb = 0; kb < 8; kb += 2) {
                const __m512i w0 = _mm512_loadu_si512((const void *)(c + kb * NT_I8 * 4));
                const __m512i w1 = _mm512_loadu_si512((const void *)(c + (kb + 1) * NT_I8 * 4));
                const __m512i aw0 = _mm512_abs_epi8(w0), aw1 = _mm512_abs_epi8(w1);
                const __mmask64 n0 = _mm512_movepi8_mask(w0), n1 = _mm512_movepi8_mask(w1);
                for (int r = 0; r < MR; r++) {
                    const __m512i x0 = _mm512_set1_epi32(*(const int32_t *)(xb + r * K + kb * 4));
                    const __m512i x1 = _mm512_set1_epi32(*(const int32_t *)(xb + r * K + kb * 4 + 4));
                    a[r] = _mm512_dpbusd_epi32(a[r], aw0, _mm512_mask_sub_epi8(x0, n0, _mm512_setzero_si512(), x0));
                    B_(r) = _mm512_dpbusd_epi32(B_(r), aw1, _mm512_mask_sub_epi8(x1, n1, _mm512_setzero_si512(), x1));
                }
            }
            c += 8 * NT_I8 * 4;
        }
        if (MR < 6)
            for (int r = 0; r < MR; r++) a[r] = _mm512_add_epi32(a[r], b[r]);
#undef B_
        const __m512 wsc = _mm512_loadu_ps(scp);
        scp += NT;
        for (int r = 0; r < MR; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), _mm512_mul_ps(wsc, _mm512_set1_ps(dx[r * nsb + s])),
                                     acc[r]);
        if (mnp) {
            const __m512 m = _mm512_loadu_ps(mnp);
            mnp += NT;
            for (int r = 0; r < MR; r++) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nsb + s]), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(out + r * NT, acc[r]);
}

TVNNI static void tile_rows_i8_vnni(int bits, const uint8_t *codes, const float *sc, const float *mn,
                                    const int8_t *xq, const float *dx, const float *xs, int64_t K, int mr, float *out) {
    switch (mr) {
        case 1: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 1, out); break;
        case 2: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 2, out); break;
        case 3: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 3, out); break;
        case 4: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 4, out); break;
        case 5: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 5, out); break;
        case 6: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 6, out); break;
        case 7: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 7, out); break;
        case 8: tile_i8_b32_vnni(bits, codes, sc, mn, xq, dx, xs, K, 8, out); break;
        default: break;
    }
}
#define HAVE_VNNI 1
static int vnni_on = -1;           /* -1: not decided yet (on where the CPU has AVX512-VNNI) */
#else
#define HAVE_VNNI 0
static int vnni_on = 0;
#endif

#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* AMX-INT8 many-row passes (Sapphire Rapids and later Xeons; compiled into the avx512 variant with -mamx-tile
 * -mamx-int8, used only where the run-time gate below lets them: the CPU has AMX-TILE and AMX-INT8, Linux
 * granted this process the tile data state, TOKENMILL_CPU_AMX is on, and a first-use self-check gave the
 * bits of the VNNI / AVX-512BW passes). A row chunk of >= AMX_MIN_ROWS rows takes a 16-output-row tile in
 * passes of up to 16 activation rows. Per 32-column block s one TDPBSSD (signed x signed bytes, exact int32
 * sums) multiplies
 *     A = the pass's int8 activation rows, 16 x 32 bytes (xq rows K apart: the rows themselves, no copy) by
 *     B = the block's codes in the i8 layout, 8 x 64 bytes (row j = columns 4j..4j+3 of the 16 output rows,
 *         4 bytes each: the i8 layout of 8-bit codes as it is, 4-bit codes unpacked to one byte per code),
 * into C = 16 x 16 int32 (row m, column n: sum over the block's 32 columns of xq[m][k] q[n][k]), which is
 * stored (TILESTORED) and folded into the float accumulators by the epilogue every pass of this file keeps,
 * per block and in this order: acc = fma(float(sum), scale * dx, acc), then acc = fma(min, xs, acc). The
 * integer sums are the same numbers as VPDPBUSD's / VPMADDUBSW's (8-bit codes: q x xq directly instead of
 * |q| x (xq with q's sign); exact either way: |sum| <= 32 * 128 * 127), so every output's bits equal those
 * passes', whatever the grouping of rows. Tiles: a full pass alternates two sets (C tmm0 / A tmm1 / B tmm2
 * and C tmm7 / A tmm6 / B tmm5) over consecutive blocks; the chunk's last pass of fewer than 16 rows uses
 * C tmm3 / A tmm4 / B tmm2, configured for its row count. */
#define AMX_MIN_ROWS 8
#define AMX_ROWS 16
#define HAVE_AMX 1
static int amx_on = -1;            /* -1: not decided yet (the gate runs at the first many-row call) */
static int amx_corrupt = 0;        /* test hook (tm_lowbit_amx_test_corrupt): spoil the AMX sums */
int tm_lowbit_set_amx(int on);

/* The tile configuration for a row chunk of `rows` rows (LDTILECFG's 64-byte format: palette, then each
 * tile's bytes per row at 16 + 2i and rows at 48 + i). */
static void amx_configure(int rows) {
    uint8_t cfg[64] __attribute__((aligned(64)));
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
#define TILE_SHAPE(i, r, colsb) do { cfg[16 + 2 * (i)] = (uint8_t)(colsb); cfg[48 + (i)] = (uint8_t)(r); } while (0)
    const int full = rows >= AMX_ROWS, rem = rows % AMX_ROWS;
    if (full) {
        TILE_SHAPE(0, AMX_ROWS, 64); TILE_SHAPE(1, AMX_ROWS, 32);
        TILE_SHAPE(7, AMX_ROWS, 64); TILE_SHAPE(6, AMX_ROWS, 32); TILE_SHAPE(5, 8, 64);
    }
    TILE_SHAPE(2, 8, 64);
    if (rem) { TILE_SHAPE(3, rem, 64); TILE_SHAPE(4, rem, 32); }
#undef TILE_SHAPE
    /* GCC's _tile_loadconfig names only the first 8 bytes of cfg as read: the barrier keeps every store above */
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(cfg);
}

/* The float epilogue of one block for MR rows: o[r][0..15] = fma(float(c[r][0..15]), sc * dx[r], o[r]), then
 * + min * xs[r] (mn != NULL); dx, xs: per row r at [r * nsb + s]. */
static inline void amx_block_epilogue(int MR, const int32_t *c, const float *sc, const float *mn, const float *dx,
                                      const float *xs, int64_t nsb, int64_t s, float *o) {
    const __m512 wsc = _mm512_loadu_ps(sc);
    if (mn) {
        const __m512 m = _mm512_loadu_ps(mn);
        for (int r = 0; r < MR; r++) {
            __m512 acc = _mm512_loadu_ps(o + r * NT);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(c + r * NT))),
                                  _mm512_mul_ps(wsc, _mm512_set1_ps(dx[r * nsb + s])), acc);
            _mm512_storeu_ps(o + r * NT, _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nsb + s]), acc));
        }
    } else {
        for (int r = 0; r < MR; r++) {
            const __m512 acc = _mm512_loadu_ps(o + r * NT);
            _mm512_storeu_ps(o + r * NT,
                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(c + r * NT))),
                                             _mm512_mul_ps(wsc, _mm512_set1_ps(dx[r * nsb + s])), acc));
        }
    }
}

/* out[r][0..15] for the R rows of a chunk (R <= 64; tiles configured by amx_configure(R) in this thread):
 * b: the tile's codes one byte per code ([K/4][16][4]); xq rows K apart, dx / xs rows K/32 apart. */
static void tile_chunk_amx(const uint8_t *b, const float *sc, const float *mn, const int8_t *xq, const float *dx,
                           const float *xs, int64_t K, int R, float *out) {
    const int64_t nsb = K / 32;
    int32_t cb[2][AMX_ROWS * NT] __attribute__((aligned(64)));
    /* the codes and activation rows were written by plain stores: the tile loads (asm without a memory
     * operand in GCC's intrinsics) must not be scheduled above them */
    __asm__ volatile("" ::: "memory");
    for (int r0 = 0; r0 < R; r0 += AMX_ROWS) {
        const int mr = R - r0 < AMX_ROWS ? R - r0 : AMX_ROWS;
        float *o = out + r0 * NT;
        memset(o, 0, sizeof(float) * (size_t)(mr * NT));
        const int8_t *a = xq + r0 * K;
        const float *dxr = dx + r0 * nsb, *xsr = xs + r0 * nsb;
        int64_t s = 0;
        if (mr == AMX_ROWS) {
            for (; s + 2 <= nsb; s += 2) {
                _tile_loadd(2, b + s * 8 * NT_I8 * 4, NT_I8 * 4);
                _tile_loadd(1, a + s * 32, K);
                _tile_zero(0);
                _tile_dpbssd(0, 1, 2);
                _tile_loadd(5, b + (s + 1) * 8 * NT_I8 * 4, NT_I8 * 4);
                _tile_loadd(6, a + (s + 1) * 32, K);
                _tile_zero(7);
                _tile_dpbssd(7, 6, 5);
                _tile_stored(0, cb[0], NT * 4);
                _tile_stored(7, cb[1], NT * 4);
                if (amx_corrupt) cb[0][0] += 1, cb[1][NT + 1] -= 1;
                amx_block_epilogue(AMX_ROWS, cb[0], sc + s * NT, mn ? mn + s * NT : 0, dxr, xsr, nsb, s, o);
                amx_block_epilogue(AMX_ROWS, cb[1], sc + (s + 1) * NT, mn ? mn + (s + 1) * NT : 0, dxr, xsr, nsb,
                                   s + 1, o);
            }
            for (; s < nsb; s++) {
                _tile_loadd(2, b + s * 8 * NT_I8 * 4, NT_I8 * 4);
                _tile_loadd(1, a + s * 32, K);
                _tile_zero(0);
                _tile_dpbssd(0, 1, 2);
                _tile_stored(0, cb[0], NT * 4);
                if (amx_corrupt) cb[0][0] += 1;
                amx_block_epilogue(AMX_ROWS, cb[0], sc + s * NT, mn ? mn + s * NT : 0, dxr, xsr, nsb, s, o);
            }
        } else {
            for (; s < nsb; s++) {
                _tile_loadd(2, b + s * 8 * NT_I8 * 4, NT_I8 * 4);
                _tile_loadd(4, a + s * 32, K);
                _tile_zero(3);
                _tile_dpbssd(3, 4, 2);
                _tile_stored(3, cb[0], NT * 4);
                if (amx_corrupt) cb[0][0] += 1;
                amx_block_epilogue(mr, cb[0], sc + s * NT, mn ? mn + s * NT : 0, dxr, xsr, nsb, s, o);
            }
        }
    }
}

/* The AMX passes' codes for tile c: 8-bit as they are, 4-bit unpacked into this thread's buffer (NULL: no
 * memory; the caller keeps the other passes). */
static const uint8_t *amx_codes(int bits, const uint8_t *c, int64_t K) {
    if (bits == 8) return c;
    uint8_t *u = u4_thread_buffer(K);
    if (u) unpack4_tile(c, K, u);
    return u;
}
#else
#define HAVE_AMX 0
static int amx_on = 0;
#endif

/* Switch the AVX512-VNNI integer dot products on (1) or off (0) for this process; returns whether they are
 * on now (never on a variant without them or a CPU without AVX512-VNNI). Bits are the same either way. */
int tm_lowbit_set_vnni(int on) {
#if HAVE_VNNI
    __builtin_cpu_init();
    vnni_on = on && __builtin_cpu_supports("avx512vnni");
#else
    (void)on;
#endif
    return vnni_on;
}

static void tile_rows_i8(int bits, const uint8_t *codes, const float *sc, const float *mn, const int8_t *xq,
                         const float *dx, const float *xs, int64_t K, int64_t G, int64_t SB, int mr, float *out) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define B32(R) if (SB == 32 && G == 32) { tile_i8_b32(bits, codes, sc, mn, xq, dx, xs, K, R, out); break; }
#else
#define B32(R)
#endif
#define CASE(R) case R: \
        B32(R) \
        if (SB == 32) tile_i8(bits, codes, sc, mn, xq, dx, xs, K, G, 32, R, out); \
        else if (SB == 16) tile_i8(bits, codes, sc, mn, xq, dx, xs, K, G, 16, R, out); \
        else tile_i8(bits, codes, sc, mn, xq, dx, xs, K, G, SB, R, out); \
        break;
#if HAVE_VNNI
    /* passes of few rows keep the BW path: VPDPBUSD's 5-cycle latency on 2 chains per row made 1-row passes
     * (decode) ~30% slower there (benchmarks/lowbit_gemm.py --per-shape, Ice Lake-SP); same bits either way */
    if (vnni_on && mr >= 4 && SB == 32 && G == 32) {
        tile_rows_i8_vnni(bits, codes, sc, mn, xq, dx, xs, K, mr, out);
        return;
    }
#endif
#if HAVE_H2
    /* passes of 1-2 rows (decode) take both halves at once; larger passes keep one half at a time: with both,
     * 3-4 rows' accumulators spill (AVX2, 2 threads, 64 rows: -12% vs this split, 2026-12-02); same bits */
    if (SB == 32 && G == 32 && mr <= 2) {
        if (mr == 1) tile_i8_b32_h2(bits, codes, sc, mn, xq, dx, xs, K, 1, out);
        else tile_i8_b32_h2(bits, codes, sc, mn, xq, dx, xs, K, 2, out);
        return;
    }
#endif
    switch (mr) {
        CASE(1) CASE(2) CASE(3) CASE(4)
#if MR_I8 > 4
        CASE(5) CASE(6) CASE(7) CASE(8)
#endif
        default: break;
    }
#undef CASE
}

/* Quantise one row of K activations (float32 or bfloat16) to int8 per block of SB: xq, dx [K/SB];
 * xs [K/G]: the float sums per weight group (for the min term). */
static void quantize_row_i8(const void *x, int x_bf16, int64_t K, int64_t G, int64_t SB, int8_t *xq, float *dx,
                            float *xs) {
#if defined(__AVX2__)
    if (SB % 8 == 0) {      /* 8 columns per step (bfloat16 widened exactly): the same rounding as below */
        const float *xf = (const float *)x;
        const uint16_t *xh = (const uint16_t *)x;
#define LOAD8(i) (x_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32( \
                               _mm_loadu_si128((const __m128i *)(xh + (i)))), 16)) : _mm256_loadu_ps(xf + (i)))
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int64_t g = 0; g < K / G; g++) xs[g] = 0.f;
        for (int64_t s = 0; s < K / SB; s++) {
            const int64_t b = s * SB;
            __m256 mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
            for (int64_t k = 0; k < SB; k += 8) {
                const __m256 v = LOAD8(b + k);
                sm = _mm256_add_ps(sm, v);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v, absmask));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sm), _mm256_extractf128_ps(sm, 1));
            s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
            xs[s * SB / G] += _mm_cvtss_f32(s4);
            dx[s] = amax / 127.f;
            const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            for (int64_t k = 0; k < SB; k += 8) {   /* round to nearest even (MXCSR default), as lrintf */
                const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(LOAD8(b + k), id));
                const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                _mm_storel_epi64((__m128i *)(xq + s * SB + k), _mm_packs_epi16(q16, q16));
            }
        }
        return;
#undef LOAD8
    }
#endif
    float buf[64];
    for (int64_t g = 0; g < K / G; g++) xs[g] = 0.f;
    for (int64_t s = 0; s < K / SB; s++) {
        const int64_t k0 = s * SB;
        float amax = 0.f, sum = 0.f;
        for (int64_t k = 0; k < SB; k++) {
            const float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k0 + k]) : ((const float *)x)[k0 + k];
            buf[k] = v;
            sum += v;
            const float a = fabsf(v);
            amax = a > amax ? a : amax;
        }
        xs[k0 / G] += sum;
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        dx[s] = d;
        for (int64_t k = 0; k < SB; k++) xq[k0 + k] = (int8_t)lrintf(buf[k] * id);
    }
}

/* This thread's scratch buffer of at least n bytes, kept (and grown) across calls. */
static int8_t *i8_thread_buffer(size_t n) {
    static __thread int8_t *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = (int8_t *)malloc(n);
        cap = buf ? n : 0;
    }
    return buf;
}

/* float16 -> float32, exact (normal, subnormal, zero, inf, NaN). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t bits;
    if (e == 0x1F) bits = sign | 0x7F800000u | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else {                                  /* subnormal: m * 2^-24, normalised */
        int sh = 0;
        uint32_t mm = m;
        while (!(mm & 0x400)) { mm <<= 1; sh++; }
        bits = sign | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* n float16 values to float32 (exactly: every float16 is a float32). */
static void f16_row_to_f32(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = f16_to_f32(h[i]);
}

/* Tile t's scale and min arrays ([K/group][16] each) as float32: the float32 arrays themselves, or the
 * float16 copies (scale_h given) widened into this thread's buffer. The widening is exact, so both give the
 * kernel the same values and the same bits; the float16 copies are a sixth fewer bytes to stream (4-bit
 * codes with a min: 20 instead of 24 bytes per 32 weights), which is what a one-row step is bound by. */
static void tile_scales(const float *scale, const float *min, const uint16_t *scale_h, const uint16_t *min_h,
                        int64_t t, int64_t ng, const float **sc, const float **mn) {
    if (!scale_h) {
        *sc = scale + t * ng * NT;
        *mn = min ? min + t * ng * NT : 0;
        return;
    }
    static __thread float *buf;
    static __thread int64_t cap;
    if (2 * ng * NT > cap) {
        free(buf);
        buf = (float *)malloc(sizeof(float) * (size_t)(2 * ng * NT));
        cap = buf ? 2 * ng * NT : 0;
    }
    f16_row_to_f32(scale_h + t * ng * NT, buf, ng * NT);
    *sc = buf;
    if (min_h) f16_row_to_f32(min_h + t * ng * NT, buf + ng * NT, ng * NT);
    *mn = min_h ? buf + ng * NT : 0;
}

/* The integer path's driver: float32 scale/min arrays, or float16 ones (scale_h, min_h; scale = min = NULL). */
static void gemm_i8(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, int64_t N, int bits,
                    const void *codes, int64_t group, const float *scale, const float *min, const uint16_t *scale_h,
                    const uint16_t *min_h, const float *bias, void *y, int y_bf16, int64_t ldy, int use_amx) {
    const int64_t SB = group < 32 ? group : 32;
    const int64_t ng = K / group, nsb = K / SB, ntiles = (N + NT - 1) / NT;
    const int64_t tile_bytes = bits == 4 ? K / 2 * NT : K * NT;
    const size_t esz = x_bf16 ? 2 : 4;
    if (vnni_on < 0) tm_lowbit_set_vnni(1);
#if HAVE_AMX
    if (use_amx < 0) {
        if (amx_on < 0 && group == 32 && M >= AMX_MIN_ROWS) tm_lowbit_set_amx(1);
        use_amx = amx_on > 0;
    }
    /* a row chunk of c rows takes the AMX passes (same bits as the others) */
#define AMX_CHUNK(c) (use_amx && group == 32 && (c) >= AMX_MIN_ROWS)
#else
    (void)use_amx;
#endif
    /* Rows in chunks of MC (their int8 rows stay in each core's L2 while the threads split the tiles):
     * without them a 2048-row prefill chunk streamed all its rows from L3 once per tile (-28% at 2048 rows). */
    const int64_t MC = 64;
    if (ntiles >= 16 * (int64_t)omp_get_max_threads()) {
        /* Every thread quantises each row chunk itself into its own buffer (kept between calls): every thread
         * reads every row, so rows quantised by one thread were fetched from the other cores' caches, and the
         * next call's writes invalidated the copies there (AVX2, 2 threads, 64 x 576 rows: quantisation 26 us
         * instead of 9, the tiles 12 us more; the 64 x 576 x 576 call 142 -> 118 us, 2048 rows +8-20%).
         * Quantising 64 rows costs about two tiles' work, hence only with >= 16 tiles per thread; with
         * more threads per tile the rows are quantised once, shared (below). */
#pragma omp parallel
        {
            int8_t *xq = i8_thread_buffer((size_t)(MC * K) + sizeof(float) * (size_t)(MC * (nsb + ng)) + 64);
            float *dx = (float *)(((uintptr_t)(xq + MC * K) + 63) & ~(uintptr_t)63);
            float *xs = dx + MC * nsb;
            for (int64_t c0 = 0; c0 < M; c0 += MC) {
                const int64_t c1 = M - c0 < MC ? M : c0 + MC;
                for (int64_t r = c0; r < c1; r++)
                    quantize_row_i8((const char *)x + (size_t)(r * ldx) * esz, x_bf16, K, group, SB,
                                    xq + (r - c0) * K, dx + (r - c0) * nsb, xs + (r - c0) * ng);
#if HAVE_AMX
                const int amx = AMX_CHUNK(c1 - c0);
                if (amx) amx_configure((int)(c1 - c0));
#endif
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < ntiles; t++) {
                    float out[MR_I8 * NT];
                    const uint8_t *c = (const uint8_t *)codes + t * tile_bytes;
                    const float *sc, *mn;
                    tile_scales(scale, min, scale_h, min_h, t, ng, &sc, &mn);
                    const int64_t n0 = t * NT, nn = N - n0 < NT ? N - n0 : NT;
#if HAVE_AMX
                    const uint8_t *b = amx ? amx_codes(bits, c, K) : 0;
                    if (b) {
                        float outc[MC * NT];
                        tile_chunk_amx(b, sc, mn, xq, dx, xs, K, (int)(c1 - c0), outc);
                        store_tile(outc, (int)(c1 - c0), nn, bias, n0, y, y_bf16, ldy, c0);
                        continue;
                    }
#endif
                    const uint8_t *u = many_rows_codes(bits, c, K, group, c1 - c0);
                    for (int64_t r0 = c0; r0 < c1; r0 += MR_I8) {
                        const int mr = (int)(c1 - r0 < MR_I8 ? c1 - r0 : MR_I8);
#if HAVE_U4
                        if (u) tile_rows_i8_u(bits, u, sc, mn, xq + (r0 - c0) * K, dx + (r0 - c0) * nsb,
                                              xs + (r0 - c0) * ng, K, mr, out);
                        else
#endif
                        tile_rows_i8(bits, c, sc, mn, xq + (r0 - c0) * K, dx + (r0 - c0) * nsb,
                                     xs + (r0 - c0) * ng, K, group, SB, mr, out);
                        store_tile(out, mr, nn, bias, n0, y, y_bf16, ldy, r0);
                    }
                }
#if HAVE_AMX
                if (amx) _tile_release();
#endif
            }
        }
        return;
    }
    int8_t *xq = (int8_t *)malloc((size_t)(M * K) + sizeof(float) * (size_t)(M * (nsb + ng)) + 64);
    float *dx = (float *)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63);
    float *xs = dx + M * nsb;
#pragma omp parallel for schedule(static) if (M * K >= 16384)
    for (int64_t r = 0; r < M; r++)
        quantize_row_i8((const char *)x + (size_t)(r * ldx) * esz, x_bf16, K, group, SB, xq + r * K, dx + r * nsb,
                        xs + r * ng);
#pragma omp parallel
    for (int64_t c0 = 0; c0 < M; c0 += MC) {
    const int64_t c1 = M - c0 < MC ? M : c0 + MC;
#if HAVE_AMX
    const int amx = AMX_CHUNK(c1 - c0);
    if (amx) amx_configure((int)(c1 - c0));
#endif
#pragma omp for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        float out[MR_I8 * NT];
        const uint8_t *c = (const uint8_t *)codes + t * tile_bytes;
        const float *sc, *mn;
        tile_scales(scale, min, scale_h, min_h, t, ng, &sc, &mn);
        const int64_t n0 = t * NT, nn = N - n0 < NT ? N - n0 : NT;
#if HAVE_AMX
        const uint8_t *b = amx ? amx_codes(bits, c, K) : 0;
        if (b) {
            float outc[MC * NT];
            tile_chunk_amx(b, sc, mn, xq + c0 * K, dx + c0 * nsb, xs + c0 * ng, K, (int)(c1 - c0), outc);
            store_tile(outc, (int)(c1 - c0), nn, bias, n0, y, y_bf16, ldy, c0);
            continue;
        }
#endif
        const uint8_t *u = many_rows_codes(bits, c, K, group, c1 - c0);
        for (int64_t r0 = c0; r0 < c1; r0 += MR_I8) {
            const int mr = (int)(c1 - r0 < MR_I8 ? c1 - r0 : MR_I8);
#if HAVE_U4
            if (u) tile_rows_i8_u(bits, u, sc, mn, xq + r0 * K, dx + r0 * nsb, xs + r0 * ng, K, mr, out);
            else
#endif
            tile_rows_i8(bits, c, sc, mn, xq + r0 * K, dx + r0 * nsb, xs + r0 * ng, K, group, SB, mr, out);
            store_tile(out, mr, nn, bias, n0, y, y_bf16, ldy, r0);
        }
    }
#if HAVE_AMX
    if (amx) _tile_release();
#endif
    }
    free(xq);
#if HAVE_AMX
#undef AMX_CHUNK
#endif
}


/* y[M, N] = x[M, K] . dequant(W)[N, K]^T + bias on the integer path (arguments as tm_lowbit_gemm; codes in
 * the i8 layout). K must be a multiple of group; SB = min(group, 32) (group a multiple of 32 when larger);
 * SB a multiple of 8 (4-bit) or 4 (8-bit). */
void tm_lowbit_gemm_i8(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, int64_t N, int bits,
                       const void *codes, int64_t group, const float *scale, const float *min, const float *bias,
                       void *y, int y_bf16, int64_t ldy) {
    gemm_i8(x, x_bf16, ldx, M, K, N, bits, codes, group, scale, min, 0, 0, bias, y, y_bf16, ldy, -1);
}

/* As tm_lowbit_gemm_i8 with the scale and min arrays (same [N/16][K/group][16] layout) in float16: for weights
 * whose scales and mins are float16 values (GGUF's Q4_0/Q4_1/Q8_0 store them so), widened exactly per tile,
 * so the results are bit-identical to tm_lowbit_gemm_i8 with their float32 widening. min_h may be NULL. */
void tm_lowbit_gemm_i8_h(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, int64_t N, int bits,
                         const void *codes, int64_t group, const uint16_t *scale_h, const uint16_t *min_h,
                         const float *bias, void *y, int y_bf16, int64_t ldy) {
    gemm_i8(x, x_bf16, ldx, M, K, N, bits, codes, group, 0, 0, scale_h, min_h, bias, y, y_bf16, ldy, -1);
}

/* Pack row-major codes q[N, K] into the i8 layout above; rows N .. N_pad-1 are zero.
 * K must be a multiple of 8 (4-bit) or 4 (8-bit). */
void tm_lowbit_pack_i8(const uint8_t *q, int64_t N, int64_t K, int bits, uint8_t *out) {
    const int64_t ntiles = (N + NT - 1) / NT;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        for (int j = 0; j < NT; j++) {
            const int64_t n = t * NT + j;
            const uint8_t *row = n < N ? q + n * K : 0;
            if (bits == 4) {
                uint8_t *o = out + t * (K / 2) * NT + j * 4;
                for (int64_t kb = 0; kb < K / 8; kb++)
                    for (int i = 0; i < 4; i++)
                        o[kb * NT * 4 + i] = row ? (uint8_t)((row[kb * 8 + i] & 0xF) | (row[kb * 8 + 4 + i] << 4)) : 0;
            } else {
                uint8_t *o = out + t * K * NT + j * 4;
                for (int64_t kb = 0; kb < K / 4; kb++)
                    for (int i = 0; i < 4; i++) o[kb * NT * 4 + i] = row ? row[kb * 4 + i] : 0;
            }
        }
    }
}

/* ====================================================================================================
 * The AMX gate. AMX runs only where (1) CPUID reports AMX-TILE and AMX-INT8, (2) Linux granted this process the
 * tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it the first tile instruction
 * faults), (3) the switch allows it (tm_lowbit_set_amx(1); TOKENMILL_CPU_AMX), and (4) a self-check on a small
 * random problem gives the bits of the VNNI / AVX-512BW passes (both 4-bit codes with mins and 8-bit codes
 * without, full and partial 16-row passes, an odd and an even block count, two row chunks). A CPU whose AMX
 * passes disagreed would otherwise give other tokens than every other CPU kind: it keeps the other passes
 * (tm_lowbit_amx_status says why). */
enum { AMX_NOT_BUILT = 0, AMX_OFF = 1, AMX_NO_CPU = 2, AMX_NO_PERMISSION = 3, AMX_SELF_CHECK_FAILED = 4,
       AMX_ON = 5 };
static int amx_status = AMX_NOT_BUILT;

#if HAVE_AMX
#if defined(TOKENMILL_EMUAMX)
/* the amxemu test variant (csrc/emuamx.h): the emulated tiles need neither the instructions nor the kernel */
static int amx_cpu_has(void) { return 1; }
static int amx_permission(void) { return 1; }
#else
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
/* CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8 */
static int amx_cpu_has(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return ((d >> 24) & 1) && ((d >> 25) & 1);
}
/* Linux >= 5.16 enables the tile data state (XCR0 bit 18) per process on request; asked once per process. */
static int amx_permission(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
#else
    return 0;
#endif
}
#endif

/* One self-check problem: y with the AMX passes (forced) and without them, compared bit for bit. */
static int amx_self_check_case(int bits, int with_min, int64_t M, int64_t K, int64_t N, uint32_t seed) {
    const int64_t ntiles = (N + NT - 1) / NT, ng = K / 32;
    uint8_t *q = (uint8_t *)malloc((size_t)(N * K));
    uint8_t *packed = (uint8_t *)calloc((size_t)(ntiles * NT * K), 1);
    float *x = (float *)malloc(sizeof(float) * (size_t)(M * K));
    float *sc = (float *)malloc(sizeof(float) * (size_t)(ntiles * ng * NT));
    float *mn = (float *)malloc(sizeof(float) * (size_t)(ntiles * ng * NT));
    float *y0 = (float *)malloc(sizeof(float) * (size_t)(M * N));
    float *y1 = (float *)malloc(sizeof(float) * (size_t)(M * N));
    int same = 0;
    if (q && packed && x && sc && mn && y0 && y1) {
        uint32_t r = seed;
#define NEXT() (r = r * 1664525u + 1013904223u, r >> 8)
        for (int64_t i = 0; i < N * K; i++) q[i] = (uint8_t)(bits == 4 ? NEXT() & 0xF : NEXT() & 0xFF);
        for (int64_t i = 0; i < M * K; i++)     /* blocks of very different magnitudes, some all zero */
            x[i] = ((int64_t)(i / 32) % 7 == 3) ? 0.f
                   : ((float)(NEXT() & 0xFFFF) / 32768.f - 1.f) * (float)(1 << ((i / 32) % 9));
        for (int64_t i = 0; i < ntiles * ng * NT; i++) {
            sc[i] = (float)(NEXT() & 0xFFFF) / 65536.f * 0.05f;
            mn[i] = ((float)(NEXT() & 0xFFFF) / 32768.f - 1.f) * 0.1f;
        }
#undef NEXT
        tm_lowbit_pack_i8(q, N, K, bits, packed);
        gemm_i8(x, 0, K, M, K, N, bits, packed, 32, sc, with_min ? mn : 0, 0, 0, 0, y1, 0, N, 1);
        gemm_i8(x, 0, K, M, K, N, bits, packed, 32, sc, with_min ? mn : 0, 0, 0, 0, y0, 0, N, 0);
        same = memcmp(y0, y1, sizeof(float) * (size_t)(M * N)) == 0;
    }
    free(q); free(packed); free(x); free(sc); free(mn); free(y0); free(y1);
    return same;
}

static int amx_self_check(void) {
    return amx_self_check_case(4, 1, 45, 96, 40, 1u) && amx_self_check_case(8, 0, 77, 128, 24, 2u) &&
           amx_self_check_case(4, 0, 16, 64, 16, 3u) && amx_self_check_case(8, 1, 9, 32, 40, 4u);
}
#endif

/* Switch the AMX-INT8 many-row passes on (1) or off (0) for this process, through the gate above (on: the
 * CPU check, the permission request and the self-check run now); returns whether they are on now (never on
 * a variant without them). Bits are the same either way. */
int tm_lowbit_set_amx(int on) {
#if HAVE_AMX
    if (!on) amx_status = AMX_OFF;
    else if (!amx_cpu_has()) amx_status = AMX_NO_CPU;
    else if (!amx_permission()) amx_status = AMX_NO_PERMISSION;
    else amx_status = amx_self_check() ? AMX_ON : AMX_SELF_CHECK_FAILED;
    amx_on = amx_status == AMX_ON;
#else
    (void)on;
#endif
    return amx_on;
}

/* Why the AMX passes are on or off: 0 not in this build, 1 switched off, 2 the CPU has no AMX-TILE/AMX-INT8,
 * 3 Linux refused the tile data permission, 4 the self-check found other bits than the VNNI/AVX-512BW passes,
 * 5 on. */
int tm_lowbit_amx_status(void) { return amx_status; }

/* Test hook: nonzero makes the AMX passes add an error to the tiles' integer sums (the next
 * tm_lowbit_set_amx(1) must then find it and keep AMX off); 0 restores them. */
void tm_lowbit_amx_test_corrupt(int on) {
#if HAVE_AMX
    amx_corrupt = on;
#else
    (void)on;
#endif
}
