#include "common.h"
/* R(v): the value after a store in T (identity for float, bf16 rounding for bf16) */
#define LD_F32(v) (v)
#define R_F32(v) (v)
#define ST_F32(v) (v)
#define LD_BF16(v) bf16_to_f32(v)
#define R_BF16(v) bf16_to_f32(f32_to_bf16(v))
#define ST_BF16(v) f32_to_bf16(v)
#define PAR_MIN 16384

/* x, residual (may be NULL), h_out (may be NULL when residual is NULL), out: [T, N]; w: [N].
   h = R(x + residual) (or x); out = R(R(h * rsqrt(mean(h^2) + eps)) * w); h_out = h. */
#define DEFINE_NORM(NAME, T, LD, R, ST)                                                             \
void NAME(const T* x, const T* residual, T* h_out, const T* w, T* out, int64_t rows, int64_t n,    \
          float eps, int num_threads) {                                                             \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * n >= PAR_MIN) schedule(static)")   \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        const T* xr = x + t * n;                                                                    \
        float h[n];                                                                                 \
        if (residual) {                                                                             \
            const T* rr = residual + t * n; T* hr = h_out + t * n;                                  \
            for (int64_t i = 0; i < n; i++) { float v = LD(xr[i]) + LD(rr[i]); hr[i] = ST(v); h[i] = R(v); } \
        } else {                                                                                    \
            for (int64_t i = 0; i < n; i++) h[i] = LD(xr[i]);                                       \
        }                                                                                           \
        float ss = 0.f;                                                                             \
        for (int64_t i = 0; i < n; i++) ss += h[i] * h[i];                                          \
        const float inv = 1.f / sqrtf(ss / (float)n + eps);                                         \
        T* o = out + t * n;                                                                         \
        for (int64_t i = 0; i < n; i++) o[i] = ST(R(h[i] * inv) * LD(w[i]));                        \
    }                                                                                               \
}

/* In place on `heads` consecutive heads of head_dim d per row (row stride `stride` elements):
   for i < rd/2: y[i] = R(R(x[i] c[i]) + R(-x[i+rd/2] s[i])); for rd/2 <= i < rd:
   y[i] = R(R(x[i] c[i]) + R(x[i-rd/2] s[i])); dims >= rd unchanged. cos/sin: [T, rd]. */
#define DEFINE_ROPE(NAME, T, LD, R, ST)                                                             \
void NAME(T* x, int64_t rows, int64_t stride, int64_t heads, int64_t d, int64_t rd, const T* cos_, \
          const T* sin_, int num_threads) {                                                         \
    const int64_t half = rd / 2;                                                                    \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * heads * d >= PAR_MIN) schedule(static)") \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        const T* c = cos_ + t * rd; const T* s = sin_ + t * rd;                                     \
        for (int64_t hh = 0; hh < heads; hh++) {                                                    \
            T* p = x + t * stride + hh * d;                                                         \
            float y[rd];                                                                            \
            for (int64_t i = 0; i < half; i++) {                                                    \
                const float a = LD(p[i]), b = LD(p[i + half]);                                      \
                y[i] = R(R(a * LD(c[i])) + R(-b * LD(s[i])));                                       \
                y[i + half] = R(R(b * LD(c[i + half])) + R(a * LD(s[i + half])));                   \
            }                                                                                       \
            for (int64_t i = 0; i < rd; i++) p[i] = ST(y[i]);                                       \
        }                                                                                           \
    }                                                                                               \
}

/* gate_up: [T, 2I] (gate then up); out: [T, I] = R(R(silu(gate)) * up). expf's argument is clamped at 80
 * (and the result times 0 for a gate below -80, where the true |silu| < 1e-33): expf(-gate) would
 * overflow past -88.7, and under -ffast-math the division by 1 + inf may be a reciprocal approximation whose
 * Newton step returns NaN. A clamp, not a branch: the loop stays vectorised as before (a branch changed the
 * vectorisation and so the bits of every silu, moving greedy near-ties). The argument is clamped at -80 too
 * (a gate above 80): there 1 + expf(-gate) is 1.f either way, so no bit changes, but a lane whose expf
 * underflows sends the whole vector of libmvec's expf to its scalar special-case path (measured on the Zen 5
 * EPYC: 64 x 1536 SiLU with gates of |x| ~ 100 took 174 us instead of 15, and a bfloat16 decode step's SiLU
 * 4.35 ms instead of 1.24, tokenmill/model/step_graph.py profile, B=64). */
#define DEFINE_SILU(NAME, T, LD, R, ST)                                                             \
void NAME(const T* gu, T* out, int64_t rows, int64_t inter, int num_threads) {                      \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * inter >= PAR_MIN) schedule(static)") \
    for (int64_t t = 0; t < rows; t++) {                                                            \
        const T* g = gu + t * 2 * inter; const T* u = g + inter; T* o = out + t * inter;            \
        for (int64_t i = 0; i < inter; i++) {                                                       \
            const float gv = LD(g[i]);                                                              \
            const float sv = gv / (1.f + expf(-fminf(fmaxf(gv, -80.f), 80.f))) * (float)(gv >= -80.f);           \
            o[i] = ST(R(sv) * LD(u[i]));                                                            \
        }                                                                                           \
    }                                                                                               \
}

DEFINE_NORM(rms_norm_f32, float, LD_F32, R_F32, ST_F32)
DEFINE_NORM(rms_norm_bf16, uint16_t, LD_BF16, R_BF16, ST_BF16)
DEFINE_ROPE(rope_f32, float, LD_F32, R_F32, ST_F32)
DEFINE_ROPE(rope_bf16, uint16_t, LD_BF16, R_BF16, ST_BF16)
DEFINE_SILU(silu_mul_f32, float, LD_F32, R_F32, ST_F32)
DEFINE_SILU(silu_mul_bf16, uint16_t, LD_BF16, R_BF16, ST_BF16)

/* Row-wise argmax with torch.argmax's answer, for the sampler's greedy rows.
 * x: [rows, n] float32 (n >= 1), row r at x + r * stride. idx[r] = the index of the row's first maximum, or, if the
 * row holds a NaN, of its first NaN (torch.argmax ranks NaN above every number); best[r] = x[r, idx[r]].
 * -0.0 and +0.0 are equal (a tie: the first one wins).
 * Two passes per row (192 KB at a 49152-token vocabulary: the second pass reads it from L2): the maximum
 * (vmaxps, 4 accumulators) and the largest |bits| as an integer (a NaN is an exponent of all ones with a non-zero
 * mantissa: above 0x7f800000), then the first index whose value equals that maximum (a compare, stopping at the
 * first hit). Only comparisons and a max touch the values, so -ffast-math cannot change an answer: with no NaN in
 * the row the maximum is the same number whichever operand a max returns on equal values (only -0.0 vs +0.0 can
 * differ, and they compare equal), and NaN is found from the bits, which -ffinite-math-only cannot fold away. */
static int64_t first_nan(const float* x, int64_t n) {
    const uint32_t* u = (const uint32_t*)x;
    for (int64_t i = 0; i < n; i++) if ((u[i] & 0x7fffffffu) > 0x7f800000u) return i;
    return 0;   /* not reached: called only for a row holding a NaN */
}

#if defined(__AVX2__)
#include <immintrin.h>
static int64_t argmax_row(const float* x, int64_t n) {
    const uint32_t* u = (const uint32_t*)x;
    int64_t i = 0;
    float m = x[0];
    uint32_t mag = 0;
    if (n >= 32) {
        const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
        __m256 m0 = _mm256_loadu_ps(x), m1 = m0, m2 = m0, m3 = m0;
        __m256i b0 = _mm256_setzero_si256(), b1 = b0, b2 = b0, b3 = b0;
        for (; i + 32 <= n; i += 32) {
            const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
            const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
            m0 = _mm256_max_ps(m0, v0); m1 = _mm256_max_ps(m1, v1);
            m2 = _mm256_max_ps(m2, v2); m3 = _mm256_max_ps(m3, v3);
            b0 = _mm256_max_epi32(b0, _mm256_and_si256(_mm256_castps_si256(v0), abs_mask));
            b1 = _mm256_max_epi32(b1, _mm256_and_si256(_mm256_castps_si256(v1), abs_mask));
            b2 = _mm256_max_epi32(b2, _mm256_and_si256(_mm256_castps_si256(v2), abs_mask));
            b3 = _mm256_max_epi32(b3, _mm256_and_si256(_mm256_castps_si256(v3), abs_mask));
        }
        m0 = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
        b0 = _mm256_max_epi32(_mm256_max_epi32(b0, b1), _mm256_max_epi32(b2, b3));
        float mv[8]; int32_t bv[8];
        _mm256_storeu_ps(mv, m0); _mm256_storeu_si256((__m256i*)bv, b0);
        for (int l = 0; l < 8; l++) {
            if (mv[l] > m) m = mv[l];
            if ((uint32_t)bv[l] > mag) mag = (uint32_t)bv[l];
        }
    }
    for (; i < n; i++) {
        if (x[i] > m) m = x[i];
        if ((u[i] & 0x7fffffffu) > mag) mag = u[i] & 0x7fffffffu;
    }
    if (mag > 0x7f800000u) return first_nan(x, n);
    const __m256 mm = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mm, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++) if (x[i] == m) return i;
    return 0;   /* not reached: m is one of the row's values */
}
#else
static int64_t argmax_row(const float* x, int64_t n) {
    const uint32_t* u = (const uint32_t*)x;
    float m = x[0];
    uint32_t mag = 0;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] > m) m = x[i];
        if ((u[i] & 0x7fffffffu) > mag) mag = u[i] & 0x7fffffffu;
    }
    if (mag > 0x7f800000u) return first_nan(x, n);
    for (int64_t i = 0; i < n; i++) if (x[i] == m) return i;
    return 0;   /* not reached: m is one of the row's values */
}
#endif

void argmax_rows_f32(const float* x, int64_t rows, int64_t n, int64_t stride, int64_t* idx, float* best,
                     int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if(rows * n >= 4 * PAR_MIN) schedule(static)")
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * stride;
        idx[r] = argmax_row(xr, n);
        best[r] = xr[idx[r]];
    }
}
