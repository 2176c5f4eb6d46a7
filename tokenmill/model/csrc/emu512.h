/* AVX-512 emulation for the test-only ``avx512emu`` kernel variant (tokenmill/model/layers/cpu_build.py).
 *
 * Force-included (``-include emu512.h``) before each kernel source, which is otherwise compiled exactly as the
 * ``avx2`` variant (``-march=x86-64-v3``). It defines the x86-64-v4 feature macros (``__AVX512F__``, BW, CD,
 * DQ, VL), so every ``#if defined(__AVX512F__)`` path of the sources is compiled, and maps each AVX-512
 * intrinsic those paths use to a function written here with the instruction's semantics, so the AVX-512 code
 * paths (lane order, masks, shuffles, tails, row-count dispatch, the AVX512-BF16 / AVX512-VNNI run-time
 * paths) run on a CPU with AVX2 only.  It is not tuned for speed (the point is correctness) and never chosen on its
 * own: tests select it explicitly where the CPU lacks AVX-512 (docs/guide/cpu_kernels.md, "Emulated AVX-512").
 *
 * How each intrinsic is emulated:
 *   - GCC's <immintrin.h> declares the AVX-512 types (__m512, __m512i, __m512bh, __mmask16, __mmask64) even
 *     without -mavx512f; only its functions need the instructions. So the types are GCC's (64-byte generic
 *     vectors, lowered by the compiler to two 256-bit halves), and every intrinsic the sources use is renamed by
 *     a macro (#define _mm512_add_ps tm_emu_mm512_add_ps) to a function below;
 *   - where GCC's own header defines an intrinsic as a generic vector expression (_mm512_add_ps, _sub_ps,
 *     _mul_ps: ``(__v16sf)A + (__v16sf)B``), the emulation uses the same expression, so -ffast-math's
 *     contractions (mul + add -> FMA) apply to it as they do to the real build;
 *   - _mm512_reduce_add_ps / _reduce_max_ps repeat GCC 12's avx512fintrin.h tree step by step (upper 256 bits
 *     op lower, then upper 128 op lower, then lanes {2,3,0,1}, then lane 0 op lane 1 (add) / lanes {1,0,1,0}
 *     (max));
 *   - lane-wise IEEE operations whose AVX/F16C instruction is the same one on fewer lanes (FMA, max, int32 ->
 *     float, half -> float) run that instruction on each 256-bit half (VFMADD is fused; VMAXPS keeps its
 *     operand order: NaN and +-0 give the second operand);
 *   - everything else is portable C per lane after the Intel SDM's pseudo-code: VPMADDUBSW (unsigned x signed
 *     bytes, pair sums saturated to int16), VPMADDWD, VPDPBUSD (four unsigned x signed byte products added to
 *     the int32 lane, wrapping), VDPBF16PS (per float32 lane: acc += odd pair, then acc += even pair, each an
 *     FMA with denormal inputs read as zero, denormal results flushed to zero, round to nearest even),
 *     VPERMW / VPERMPS (index bits 4:0 / 3:0), VSHUFF32X4, VSHUFPS, VPTERNLOGD, masked moves/ors/subtracts,
 *     mask compares, shifts (a count above the element width gives 0), VPABSB (-128 stays 0x80), VPMOVDW
 *     (truncation), sign/zero extensions, sets and loads/stores;
 *   - the ``target("avx512bf16")`` / ``target("avx512vnni")`` function attributes become no-ops (a function with
 *     them would let the compiler emit real AVX-512 instructions), and __builtin_cpu_supports reports the
 *     AVX-512 features it emulates (AVX512F/BW/CD/DQ/VL/BF16/VNNI) as present, so the run-time dispatch takes the
 *     BF16 and VNNI paths exactly as on a CPU that has them (the kernels' own switches still turn them off).
 *
 * What it does not reproduce: the compiler's auto-vectorisation of the sources' plain C loops, which the real
 * build does 16 floats wide and this one 8 wide (a float reduction there may sum in another order), the
 * instructions' speed, and VDPBF16PS's independence from MXCSR (the emulation rounds with MXCSR's mode, the
 * default round-to-nearest-even in tokenmill's processes). tests/model/test_emu512.py checks every function
 * here against its pseudo-code here, and against the real instruction on a CPU with AVX-512. */
#ifndef TOKENMILL_EMU512_H
#define TOKENMILL_EMU512_H

#if defined(__AVX512F__)
#error "emu512.h emulates AVX-512 on CPUs without it: compile the avx512emu variant with -march=x86-64-v3"
#endif
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "emu512.h needs AVX2, FMA and F16C (-march=x86-64-v3)"
#endif

/* the system headers the kernels use, before the macros below exist */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#pragma GCC diagnostic ignored "-Wpsabi"

#define TM_EMU static inline __attribute__((always_inline, unused))

typedef union {
    __m512 ps;
    __m512i si;
    __m512bh bh;
    __m256 h[2];
    __m256i hi[2];
    __m128 q[4];
    __m128i qi[4];
    float f32[16];
    int32_t i32[16];
    uint32_t u32[16];
    int16_t i16[32];
    uint16_t u16[32];
    int8_t i8[64];
    uint8_t u8[64];
} tm_emu_512;

typedef union {
    __m256i v;
    int16_t i16[16];
    uint16_t u16[16];
} tm_emu_256;

typedef union {
    __m128i v;
    int8_t i8[16];
    uint8_t u8[16];
} tm_emu_128;

typedef union { float f; uint32_t u; } tm_emu_f32;

/* ---------------------------------------------------------------- set, load, store, casts */
TM_EMU __m512 tm_emu_mm512_setzero_ps(void) { tm_emu_512 r; memset(&r, 0, sizeof r); return r.ps; }
TM_EMU __m512i tm_emu_mm512_setzero_si512(void) { tm_emu_512 r; memset(&r, 0, sizeof r); return r.si; }
TM_EMU __m512 tm_emu_mm512_set1_ps(float x) { tm_emu_512 r; for (int i = 0; i < 16; i++) r.f32[i] = x; return r.ps; }
TM_EMU __m512i tm_emu_mm512_set1_epi32(int x) { tm_emu_512 r; for (int i = 0; i < 16; i++) r.i32[i] = x; return r.si; }
TM_EMU __m512i tm_emu_mm512_set1_epi16(short x) { tm_emu_512 r; for (int i = 0; i < 32; i++) r.i16[i] = x; return r.si; }
TM_EMU __m512i tm_emu_mm512_set1_epi8(char x) { tm_emu_512 r; for (int i = 0; i < 64; i++) r.i8[i] = (int8_t)x; return r.si; }
/* arguments from the highest lane (e31) to the lowest (e0), as _mm512_set_epi16 */
TM_EMU __m512i tm_emu_mm512_set_epi16(short e31, short e30, short e29, short e28, short e27, short e26, short e25,
                                      short e24, short e23, short e22, short e21, short e20, short e19, short e18,
                                      short e17, short e16, short e15, short e14, short e13, short e12, short e11,
                                      short e10, short e9, short e8, short e7, short e6, short e5, short e4,
                                      short e3, short e2, short e1, short e0) {
    const short e[32] = {e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15, e16, e17, e18, e19,
                         e20, e21, e22, e23, e24, e25, e26, e27, e28, e29, e30, e31};
    tm_emu_512 r;
    for (int i = 0; i < 32; i++) r.i16[i] = e[i];
    return r.si;
}
/* arguments from the lowest lane (e0) to the highest (e15), as _mm512_setr_epi32 */
TM_EMU __m512i tm_emu_mm512_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8,
                                       int e9, int e10, int e11, int e12, int e13, int e14, int e15) {
    const int e[16] = {e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
    tm_emu_512 r;
    for (int i = 0; i < 16; i++) r.i32[i] = e[i];
    return r.si;
}
TM_EMU __m512 tm_emu_mm512_loadu_ps(const void *p) { tm_emu_512 r; memcpy(&r, p, 64); return r.ps; }
TM_EMU __m512i tm_emu_mm512_loadu_si512(const void *p) { tm_emu_512 r; memcpy(&r, p, 64); return r.si; }
TM_EMU void tm_emu_mm512_storeu_ps(void *p, __m512 a) { memcpy(p, &a, 64); }
TM_EMU __m512i tm_emu_mm512_castps_si512(__m512 a) { tm_emu_512 r; r.ps = a; return r.si; }
TM_EMU __m512 tm_emu_mm512_castsi512_ps(__m512i a) { tm_emu_512 r; r.si = a; return r.ps; }

/* ---------------------------------------------------------------- float32 arithmetic */
/* as GCC's avx512fintrin.h: generic vector expressions (the same -ffast-math contractions apply) */
TM_EMU __m512 tm_emu_mm512_add_ps(__m512 a, __m512 b) { return a + b; }
TM_EMU __m512 tm_emu_mm512_sub_ps(__m512 a, __m512 b) { return a - b; }
TM_EMU __m512 tm_emu_mm512_mul_ps(__m512 a, __m512 b) { return a * b; }
/* VFMADD...PS: a * b + c rounded once; the same instruction on each 256-bit half */
TM_EMU __m512 tm_emu_mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    tm_emu_512 x, y, z, r;
    x.ps = a; y.ps = b; z.ps = c;
    for (int h = 0; h < 2; h++) r.h[h] = _mm256_fmadd_ps(x.h[h], y.h[h], z.h[h]);
    return r.ps;
}
/* VMAXPS: a > b ? a : b per lane (NaN or +-0 on both: the second operand); the same instruction per half */
TM_EMU __m512 tm_emu_mm512_max_ps(__m512 a, __m512 b) {
    tm_emu_512 x, y, r;
    x.ps = a; y.ps = b;
    for (int h = 0; h < 2; h++) r.h[h] = _mm256_max_ps(x.h[h], y.h[h]);
    return r.ps;
}
/* GCC 12's __MM512_REDUCE_OP(+) for floats, step by step (generic vector adds, as there) */
TM_EMU float tm_emu_mm512_reduce_add_ps(__m512 a) {
    tm_emu_512 x;
    x.ps = a;
    const __m256 t3 = x.h[1] + x.h[0];
    const __m128 t6 = _mm256_extractf128_ps(t3, 1) + _mm256_extractf128_ps(t3, 0);
    const __m128 t8 = t6 + _mm_shuffle_ps(t6, t6, 0x4E);       /* lanes {2, 3, 0, 1} */
    return t8[0] + t8[1];
}
/* GCC 12's __MM512_REDUCE_OP(max_ps): _mm256_max_ps(upper, lower), _mm_max_ps(upper, lower),
 * then with lanes {2, 3, 0, 1}, then with lanes {1, 0, 1, 0}; lane 0 */
TM_EMU float tm_emu_mm512_reduce_max_ps(__m512 a) {
    tm_emu_512 x;
    x.ps = a;
    const __m256 t3 = _mm256_max_ps(x.h[1], x.h[0]);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_extractf128_ps(t3, 0));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, 0x4E));
    const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, 0x11));   /* lanes {1, 0, 1, 0} */
    return _mm_cvtss_f32(t10);
}

/* ---------------------------------------------------------------- conversions */
/* VCVTDQ2PS: rounds with MXCSR's mode, as a C int -> float conversion; the same instruction per half */
TM_EMU __m512 tm_emu_mm512_cvtepi32_ps(__m512i a) {
    tm_emu_512 x, r;
    x.si = a;
    for (int h = 0; h < 2; h++) r.h[h] = _mm256_cvtepi32_ps(x.hi[h]);
    return r.ps;
}
/* VCVTPH2PS: 16 IEEE halves -> float32 (exact); F16C's instruction on each 8-lane half */
TM_EMU __m512 tm_emu_mm512_cvtph_ps(__m256i a) {
    tm_emu_512 r;
    r.h[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(a));
    r.h[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
    return r.ps;
}
TM_EMU __m512i tm_emu_mm512_cvtepi8_epi32(__m128i a) {
    tm_emu_128 x; tm_emu_512 r;
    x.v = a;
    for (int i = 0; i < 16; i++) r.i32[i] = x.i8[i];
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_cvtepu8_epi32(__m128i a) {
    tm_emu_128 x; tm_emu_512 r;
    x.v = a;
    for (int i = 0; i < 16; i++) r.u32[i] = x.u8[i];
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_cvtepu16_epi32(__m256i a) {
    tm_emu_256 x; tm_emu_512 r;
    x.v = a;
    for (int i = 0; i < 16; i++) r.u32[i] = x.u16[i];
    return r.si;
}
/* VPMOVDW: the low 16 bits of each int32 lane (truncation, no saturation) */
TM_EMU __m256i tm_emu_mm512_cvtepi32_epi16(__m512i a) {
    tm_emu_512 x; tm_emu_256 r;
    x.si = a;
    for (int i = 0; i < 16; i++) r.u16[i] = (uint16_t)x.u32[i];
    return r.v;
}

/* ---------------------------------------------------------------- integer lanes */
TM_EMU __m512i tm_emu_mm512_add_epi32(__m512i a, __m512i b) {
    tm_emu_512 x, y, r;
    x.si = a; y.si = b;
    for (int i = 0; i < 16; i++) r.u32[i] = x.u32[i] + y.u32[i];
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_add_epi16(__m512i a, __m512i b) {
    tm_emu_512 x, y, r;
    x.si = a; y.si = b;
    for (int i = 0; i < 32; i++) r.u16[i] = (uint16_t)(x.u16[i] + y.u16[i]);
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_and_si512(__m512i a, __m512i b) {
    tm_emu_512 x, y, r;
    x.si = a; y.si = b;
    for (int i = 0; i < 16; i++) r.u32[i] = x.u32[i] & y.u32[i];
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_or_si512(__m512i a, __m512i b) {
    tm_emu_512 x, y, r;
    x.si = a; y.si = b;
    for (int i = 0; i < 16; i++) r.u32[i] = x.u32[i] | y.u32[i];
    return r.si;
}
/* shifts by an immediate: a count above the element width gives 0 */
TM_EMU __m512i tm_emu_mm512_slli_epi32(__m512i a, unsigned int n) {
    tm_emu_512 x, r;
    x.si = a;
    for (int i = 0; i < 16; i++) r.u32[i] = n > 31 ? 0 : x.u32[i] << n;
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_srli_epi32(__m512i a, unsigned int n) {
    tm_emu_512 x, r;
    x.si = a;
    for (int i = 0; i < 16; i++) r.u32[i] = n > 31 ? 0 : x.u32[i] >> n;
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_srli_epi16(__m512i a, unsigned int n) {
    tm_emu_512 x, r;
    x.si = a;
    for (int i = 0; i < 32; i++) r.u16[i] = n > 15 ? 0 : (uint16_t)(x.u16[i] >> n);
    return r.si;
}
/* VPABSB: |a| per byte; -128 has no positive int8 and stays 0x80 (read as unsigned: 128) */
TM_EMU __m512i tm_emu_mm512_abs_epi8(__m512i a) {
    tm_emu_512 x, r;
    x.si = a;
    for (int i = 0; i < 64; i++) r.u8[i] = x.i8[i] < 0 ? (uint8_t)(0u - x.u8[i]) : x.u8[i];
    return r.si;
}
/* VPTERNLOGD: bit j of each result = bit (a_j << 2 | b_j << 1 | c_j) of imm */
TM_EMU __m512i tm_emu_mm512_ternarylogic_epi32(__m512i a, __m512i b, __m512i c, int imm) {
    tm_emu_512 x, y, z, r;
    x.si = a; y.si = b; z.si = c;
    for (int i = 0; i < 16; i++) {
        uint32_t v = 0;
        for (int j = 0; j < 32; j++) {
            const unsigned idx = ((x.u32[i] >> j) & 1u) << 2 | ((y.u32[i] >> j) & 1u) << 1 | ((z.u32[i] >> j) & 1u);
            v |= (uint32_t)((imm >> idx) & 1) << j;
        }
        r.u32[i] = v;
    }
    return r.si;
}

/* ---------------------------------------------------------------- masks */
TM_EMU __mmask64 tm_emu_mm512_movepi8_mask(__m512i a) {
    tm_emu_512 x;
    x.si = a;
    __mmask64 m = 0;
    for (int i = 0; i < 64; i++) m |= (__mmask64)(x.u8[i] >> 7) << i;
    return m;
}
TM_EMU __mmask16 tm_emu_mm512_cmpeq_epi32_mask(__m512i a, __m512i b) {
    tm_emu_512 x, y;
    x.si = a; y.si = b;
    unsigned m = 0;
    for (int i = 0; i < 16; i++) m |= (unsigned)(x.u32[i] == y.u32[i]) << i;
    return (__mmask16)m;
}
TM_EMU __mmask16 tm_emu_mm512_test_epi32_mask(__m512i a, __m512i b) {
    tm_emu_512 x, y;
    x.si = a; y.si = b;
    unsigned m = 0;
    for (int i = 0; i < 16; i++) m |= (unsigned)((x.u32[i] & y.u32[i]) != 0) << i;
    return (__mmask16)m;
}
/* merge-masked forms: lane i = bit i of k ? the operation : src */
TM_EMU __m512i tm_emu_mm512_mask_mov_epi32(__m512i src, __mmask16 k, __m512i a) {
    tm_emu_512 s, x, r;
    s.si = src; x.si = a;
    for (int i = 0; i < 16; i++) r.u32[i] = (k >> i) & 1 ? x.u32[i] : s.u32[i];
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_mask_or_epi32(__m512i src, __mmask16 k, __m512i a, __m512i b) {
    tm_emu_512 s, x, y, r;
    s.si = src; x.si = a; y.si = b;
    for (int i = 0; i < 16; i++) r.u32[i] = (k >> i) & 1 ? x.u32[i] | y.u32[i] : s.u32[i];
    return r.si;
}
TM_EMU __m512i tm_emu_mm512_mask_sub_epi8(__m512i src, __mmask64 k, __m512i a, __m512i b) {
    tm_emu_512 s, x, y, r;
    s.si = src; x.si = a; y.si = b;
    for (int i = 0; i < 64; i++) r.u8[i] = (k >> i) & 1 ? (uint8_t)(x.u8[i] - y.u8[i]) : s.u8[i];
    return r.si;
}

/* ---------------------------------------------------------------- shuffles and permutes */
/* VSHUFF32X4: result 128-bit lanes 0, 1 from a, lanes 2, 3 from b, each chosen by 2 bits of imm */
TM_EMU __m512 tm_emu_mm512_shuffle_f32x4(__m512 a, __m512 b, int imm) {
    tm_emu_512 x, y, r;
    x.ps = a; y.ps = b;
    r.q[0] = x.q[imm & 3];
    r.q[1] = x.q[(imm >> 2) & 3];
    r.q[2] = y.q[(imm >> 4) & 3];
    r.q[3] = y.q[(imm >> 6) & 3];
    return r.ps;
}
/* VSHUFPS: in each 128-bit lane, elements 0, 1 from a and 2, 3 from b, each chosen by 2 bits of imm */
TM_EMU __m512 tm_emu_mm512_shuffle_ps(__m512 a, __m512 b, int imm) {
    tm_emu_512 x, y, r;
    x.ps = a; y.ps = b;
    for (int l = 0; l < 4; l++) {
        r.f32[4 * l + 0] = x.f32[4 * l + (imm & 3)];
        r.f32[4 * l + 1] = x.f32[4 * l + ((imm >> 2) & 3)];
        r.f32[4 * l + 2] = y.f32[4 * l + ((imm >> 4) & 3)];
        r.f32[4 * l + 3] = y.f32[4 * l + ((imm >> 6) & 3)];
    }
    return r.ps;
}
/* VPERMPS: lane i = a[idx[i] & 15] */
TM_EMU __m512 tm_emu_mm512_permutexvar_ps(__m512i idx, __m512 a) {
    tm_emu_512 ix, x, r;
    ix.si = idx; x.ps = a;
    for (int i = 0; i < 16; i++) r.u32[i] = x.u32[ix.u32[i] & 15u];
    return r.ps;
}
/* VPERMW: word i = a[idx[i] & 31] */
TM_EMU __m512i tm_emu_mm512_permutexvar_epi16(__m512i idx, __m512i a) {
    tm_emu_512 ix, x, r;
    ix.si = idx; x.si = a;
    for (int i = 0; i < 32; i++) r.u16[i] = x.u16[ix.u16[i] & 31u];
    return r.si;
}

/* ---------------------------------------------------------------- integer multiply-adds */
/* VPMADDUBSW: int16 lane i = saturate(a_u8[2i] * b_s8[2i] + a_u8[2i+1] * b_s8[2i+1]) (a unsigned, b signed) */
TM_EMU __m512i tm_emu_mm512_maddubs_epi16(__m512i a, __m512i b) {
    tm_emu_512 x, y, r;
    x.si = a; y.si = b;
    for (int i = 0; i < 32; i++) {
        int32_t s = (int32_t)x.u8[2 * i] * y.i8[2 * i] + (int32_t)x.u8[2 * i + 1] * y.i8[2 * i + 1];
        r.i16[i] = (int16_t)(s > 32767 ? 32767 : s < -32768 ? -32768 : s);
    }
    return r.si;
}
/* VPMADDWD: int32 lane i = a[2i] * b[2i] + a[2i+1] * b[2i+1] (int16 products; the one overflowing sum,
 * 2 * (-32768)^2, wraps to INT32_MIN) */
TM_EMU __m512i tm_emu_mm512_madd_epi16(__m512i a, __m512i b) {
    tm_emu_512 x, y, r;
    x.si = a; y.si = b;
    for (int i = 0; i < 16; i++)
        r.u32[i] = (uint32_t)((int32_t)x.i16[2 * i] * y.i16[2 * i]) + (uint32_t)((int32_t)x.i16[2 * i + 1] * y.i16[2 * i + 1]);
    return r.si;
}
/* VPDPBUSD (AVX512-VNNI): int32 lane i = acc[i] + sum_j a_u8[4i+j] * b_s8[4i+j] (wrapping, no saturation) */
TM_EMU __m512i tm_emu_mm512_dpbusd_epi32(__m512i acc, __m512i a, __m512i b) {
    tm_emu_512 s, x, y, r;
    s.si = acc; x.si = a; y.si = b;
    for (int i = 0; i < 16; i++) {
        uint32_t v = s.u32[i];
        for (int j = 0; j < 4; j++) v += (uint32_t)((int32_t)x.u8[4 * i + j] * y.i8[4 * i + j]);
        r.u32[i] = v;
    }
    return r.si;
}

/* ---------------------------------------------------------------- AVX512-BF16 */
/* denormal -> zero of the same sign (DAZ on the inputs, FTZ on the results of VDPBF16PS) */
TM_EMU float tm_emu_flush(float x) {
    tm_emu_f32 c;
    c.f = x;
    if ((c.u & 0x7f800000u) == 0 && (c.u & 0x007fffffu) != 0) c.u &= 0x80000000u;
    return c.f;
}
/* One FMA of VDPBF16PS: acc + a * b rounded to nearest even, denormal inputs read as zero, a tiny result
 * flushed to zero with its sign. x86 detects tininess after rounding (the result rounded to 24 bits with an
 * unbounded exponent is below 2^-126): a denormal fmaf result is tiny; one that rounded up to exactly 2^-126
 * in the denormal format may still be tiny, decided by the same FMA scaled by 2^48 (exact: when the result is
 * near 2^-126, |acc| < 2^-102 and the smaller factor is below 1, so nothing overflows or underflows). */
TM_EMU float tm_emu_bf16_fma(float a, float b, float acc) {
    a = tm_emu_flush(a); b = tm_emu_flush(b); acc = tm_emu_flush(acc);
    tm_emu_f32 r, z;
    r.f = fmaf(a, b, acc);
    z.u = r.u & 0x80000000u;                        /* zero with the result's sign */
    const uint32_t mag = r.u & 0x7fffffffu;
    if (mag < 0x00800000u) return z.f;              /* denormal (or zero) */
    if (mag == 0x00800000u) {                       /* exactly 2^-126 after denormal rounding */
        const float big = fabsf(a) <= fabsf(b) ? fmaf(a * 0x1p48f, b, acc * 0x1p48f)
                                               : fmaf(a, b * 0x1p48f, acc * 0x1p48f);
        if (fabsf(big) < 0x1p-78f) return z.f;
    }
    return r.f;
}
/* VDPBF16PS: per float32 lane i, acc += a.bf16[2i+1] * b.bf16[2i+1], then acc += a.bf16[2i] * b.bf16[2i]
 * (Intel SDM; each step an FMA as above; the products of two bfloat16 values are exact in float32) */
TM_EMU __m512 tm_emu_mm512_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    tm_emu_512 s, x, y, r;
    s.ps = acc; x.bh = a; y.bh = b;
    for (int i = 0; i < 16; i++) {
        tm_emu_f32 a1, b1, a0, b0;
        a1.u = (uint32_t)x.u16[2 * i + 1] << 16; b1.u = (uint32_t)y.u16[2 * i + 1] << 16;
        a0.u = (uint32_t)x.u16[2 * i] << 16; b0.u = (uint32_t)y.u16[2 * i] << 16;
        float v = tm_emu_bf16_fma(a1.f, b1.f, s.f32[i]);
        r.f32[i] = tm_emu_bf16_fma(a0.f, b0.f, v);
    }
    return r.ps;
}

/* ---------------------------------------------------------------- run-time feature checks */
/* The features this header emulates count as present; the rest are the CPU's own (x86-64-v3's at least). */
TM_EMU int tm_emu_cpu_supports(const char *f) {
    static const char *const emulated[] = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                                           "avx512bf16", "avx512vnni", "avx2", "fma", "f16c", "avx", "bmi",
                                           "bmi2", "sse4.2", "sse4.1", "ssse3", "sse3", "sse2", "sse"};
    for (size_t i = 0; i < sizeof emulated / sizeof *emulated; i++)
        if (strcmp(f, emulated[i]) == 0) return 1;
    return 0;
}

/* ---------------------------------------------------------------- the renames */
#undef _mm512_abs_epi8
#define _mm512_abs_epi8 tm_emu_mm512_abs_epi8
#undef _mm512_add_epi16
#define _mm512_add_epi16 tm_emu_mm512_add_epi16
#undef _mm512_add_epi32
#define _mm512_add_epi32 tm_emu_mm512_add_epi32
#undef _mm512_add_ps
#define _mm512_add_ps tm_emu_mm512_add_ps
#undef _mm512_and_si512
#define _mm512_and_si512 tm_emu_mm512_and_si512
#undef _mm512_castps_si512
#define _mm512_castps_si512 tm_emu_mm512_castps_si512
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps tm_emu_mm512_castsi512_ps
#undef _mm512_cmpeq_epi32_mask
#define _mm512_cmpeq_epi32_mask tm_emu_mm512_cmpeq_epi32_mask
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 tm_emu_mm512_cvtepi32_epi16
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps tm_emu_mm512_cvtepi32_ps
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 tm_emu_mm512_cvtepi8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 tm_emu_mm512_cvtepu16_epi32
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 tm_emu_mm512_cvtepu8_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps tm_emu_mm512_cvtph_ps
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps tm_emu_mm512_dpbf16_ps
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 tm_emu_mm512_dpbusd_epi32
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps tm_emu_mm512_fmadd_ps
#undef _mm512_loadu_ps
#define _mm512_loadu_ps tm_emu_mm512_loadu_ps
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 tm_emu_mm512_loadu_si512
#undef _mm512_madd_epi16
#define _mm512_madd_epi16 tm_emu_mm512_madd_epi16
#undef _mm512_maddubs_epi16
#define _mm512_maddubs_epi16 tm_emu_mm512_maddubs_epi16
#undef _mm512_mask_mov_epi32
#define _mm512_mask_mov_epi32 tm_emu_mm512_mask_mov_epi32
#undef _mm512_mask_or_epi32
#define _mm512_mask_or_epi32 tm_emu_mm512_mask_or_epi32
#undef _mm512_mask_sub_epi8
#define _mm512_mask_sub_epi8 tm_emu_mm512_mask_sub_epi8
#undef _mm512_max_ps
#define _mm512_max_ps tm_emu_mm512_max_ps
#undef _mm512_movepi8_mask
#define _mm512_movepi8_mask tm_emu_mm512_movepi8_mask
#undef _mm512_mul_ps
#define _mm512_mul_ps tm_emu_mm512_mul_ps
#undef _mm512_or_si512
#define _mm512_or_si512 tm_emu_mm512_or_si512
#undef _mm512_permutexvar_epi16
#define _mm512_permutexvar_epi16 tm_emu_mm512_permutexvar_epi16
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps tm_emu_mm512_permutexvar_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps tm_emu_mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps tm_emu_mm512_reduce_max_ps
#undef _mm512_set1_epi16
#define _mm512_set1_epi16 tm_emu_mm512_set1_epi16
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 tm_emu_mm512_set1_epi32
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 tm_emu_mm512_set1_epi8
#undef _mm512_set1_ps
#define _mm512_set1_ps tm_emu_mm512_set1_ps
#undef _mm512_set_epi16
#define _mm512_set_epi16 tm_emu_mm512_set_epi16
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 tm_emu_mm512_setr_epi32
#undef _mm512_setzero_ps
#define _mm512_setzero_ps tm_emu_mm512_setzero_ps
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 tm_emu_mm512_setzero_si512
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4 tm_emu_mm512_shuffle_f32x4
#undef _mm512_shuffle_ps
#define _mm512_shuffle_ps tm_emu_mm512_shuffle_ps
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 tm_emu_mm512_slli_epi32
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 tm_emu_mm512_srli_epi16
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 tm_emu_mm512_srli_epi32
#undef _mm512_storeu_ps
#define _mm512_storeu_ps tm_emu_mm512_storeu_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps tm_emu_mm512_sub_ps
#undef _mm512_ternarylogic_epi32
#define _mm512_ternarylogic_epi32 tm_emu_mm512_ternarylogic_epi32
#undef _mm512_test_epi32_mask
#define _mm512_test_epi32_mask tm_emu_mm512_test_epi32_mask

/* the x86-64-v4 feature macros (as -march=x86-64-v4 defines them; not BF16 / VNNI, which the sources
 * check at run time, as the real avx512 build does) */
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512CD__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#define TOKENMILL_EMU512 1

/* target("avx512bf16") and the like: no-ops (the attribute list keeps an empty entry, which GCC accepts) */
#define target(...)
#define __builtin_cpu_supports(f) tm_emu_cpu_supports(f)

#endif
