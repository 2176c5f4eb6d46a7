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
