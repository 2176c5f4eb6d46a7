/* One float32 vector type for every instruction-set variant, so each kernel is written once.
 *
 *   variant   predefined macro   VW (floats per vector)   type
 *   avx512    __AVX512F__        16                       __m512
 *   avx2      __AVX2__ + __FMA__  8                       __m256
 *   scalar    (neither)           1                       float
 *
 * Loads widen the cache's element types to float32 on the fly:
 *   f32, bf16 (shift into the high half), int8 (sign-extend, convert),
 *   fp8 e5m2 (the high byte of an IEEE half: shift, then the half -> float conversion),
 *   fp8 e4m3fn (sign and the 7 exponent/mantissa bits placed in a half whose exponent bias is
 *   8 too large, so the loaded value is the true value / 256: callers fold E4M3_RAW_MUL into
 *   their scale; subnormals come out exact, NaN (0x7f) is never stored by tokenmill's writer).
 * The scalar loads compute bit-identical values, so every variant dequantises alike. */
#ifndef TOKENMILL_VEC_H
#define TOKENMILL_VEC_H

#include "common.h"

#define E4M3_RAW_MUL 256.f

/* IEEE half -> float32 (any value, subnormals included), for the scalar loads. */
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0) {                                   /* zero or subnormal: man * 2^-24 */
        const float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    c.u = exp == 0x1f ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
    return c.f;
}
static inline uint16_t e4m3_to_half_bits(uint8_t b) { return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)); }

/* scalar loads of one element -> float32 (e4m3: value / E4M3_RAW_MUL) */
static inline float sld_f32(const float* p) { return *p; }
static inline float sld_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
static inline float sld_i8(const int8_t* p) { return (float)*p; }
static inline float sld_e5m2(const uint8_t* p) { return half_to_f32((uint16_t)(*p << 8)); }
static inline float sld_e4m3(const uint8_t* p) { return half_to_f32(e4m3_to_half_bits(*p)); }
static inline void sst_f32(float* p, float x) { *p = x; }
static inline void sst_bf16(uint16_t* p, float x) { *p = f32_to_bf16(x); }

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#define VISA "avx512"
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vhsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline void vst(float* p, vf a) { _mm512_storeu_ps(p, a); }
/* vtsum(a)[u] = vhsum(a[u]) for the VW = 16 vectors a[0..15], with the same pairwise sums in the same tree as
 * vhsum (_mm512_reduce_add_ps: lane i + lane i+8, then i + i+4, i + i+2, i + i+1), 15 adds for 16 sums
 * instead of 4 shuffle-add steps each: every level adds the same two lanes of each source vector as vhsum
 * does, only several vectors share one add (float addition is commutative, so the bits are vhsum's). */
static inline vf vtsum(const vf* a) {
    __m512 x[8], z[4], w[2];
    for (int p = 0; p < 8; p++)         /* [a[2p] lo + hi (8) | a[2p+1] lo + hi (8)] */
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++)         /* 4 lanes per source vector: i + i+4 */
        z[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++)         /* 2 lanes per source vector: i + i+2 */
        w[p] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * p], z[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(z[2 * p], z[2 * p + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);    /* lane u <- the sum of a[u] */
}
static inline vf vld_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vld_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vf vld_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline vf vld_e5m2(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8));
}
static inline vf vld_e4m3(const uint8_t* p) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
#define VISA "avx2"
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vhsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vhmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void vst(float* p, vf a) { _mm256_storeu_ps(p, a); }
/* vtsum(a)[u] = vhsum(a[u]) for the VW = 8 vectors a[0..7], the same tree as vhsum (i + i+4, i + i+2,
 * i + i+1) with several vectors per add (see the AVX-512 version). */
static inline vf vtsum(const vf* a) {
    __m256 x[4], z[2];
    for (int p = 0; p < 4; p++)
        x[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
    for (int p = 0; p < 2; p++)
        z[p] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * p], x[2 * p + 1], 0x44),
                             _mm256_shuffle_ps(x[2 * p], x[2 * p + 1], 0xEE));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], 0x88), _mm256_shuffle_ps(z[0], z[1], 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline vf vld_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vld_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vf vld_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf vld_e5m2(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p)), 8));
}
static inline vf vld_e4m3(const uint8_t* p) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
}

#else
#define VW 1
#define VISA "scalar"
typedef float vf;
static inline vf vzero(void) { return 0.f; }
static inline vf vset1(float x) { return x; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline float vhsum(vf a) { return a; }
static inline float vhmax(vf a) { return a; }
static inline void vst(float* p, vf a) { *p = a; }
static inline vf vtsum(const vf* a) { return a[0]; }
static inline vf vld_f32(const float* p) { return *p; }
static inline vf vld_bf16(const uint16_t* p) { return sld_bf16(p); }
static inline vf vld_i8(const int8_t* p) { return sld_i8(p); }
static inline vf vld_e5m2(const uint8_t* p) { return sld_e5m2(p); }
static inline vf vld_e4m3(const uint8_t* p) { return sld_e4m3(p); }
#endif

/* Report which variant this library was compiled as (1 scalar, 2 avx2, 3 avx512). */
static inline int vec_isa_level(void) { return VW == 16 ? 3 : VW == 8 ? 2 : 1; }

#endif
