/* Every AVX-512 intrinsic csrc/emu512.h emulates, one case per (intrinsic, immediate), on byte buffers, for
 * tests/model/test_emu512.py. Compiled twice: as the real avx512 variant (the instructions) and as avx512emu
 * (the emulation); the test compares the two on a CPU with AVX-512, and the emulation with the SDM's
 * pseudo-code (written in Python there) everywhere.
 *   a, b, c: 64 bytes each; k: a mask; out: 64 bytes (a mask or a float in its first bytes). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define LPS(p) _mm512_loadu_ps(p)
#define LSI(p) _mm512_loadu_si512(p)
#define SPS(v) _mm512_storeu_ps(out, v)
#define SSI(v) do { __m512i v_ = (v); memcpy(out, &v_, 64); } while (0)

static const char *const NAMES[] = {
    "abs_epi8", "add_epi16", "add_epi32", "add_ps", "and_si512", "castps_si512", "castsi512_ps",
    "cmpeq_epi32_mask", "cvtepi32_epi16", "cvtepi32_ps", "cvtepi8_epi32", "cvtepu16_epi32", "cvtepu8_epi32",
    "cvtph_ps", "dpbf16_ps", "dpbusd_epi32", "fmadd_ps", "loadu_storeu_ps", "loadu_si512", "madd_epi16",
    "maddubs_epi16", "mask_mov_epi32", "mask_or_epi32", "mask_sub_epi8", "max_ps", "movepi8_mask", "mul_ps",
    "or_si512", "permutexvar_epi16", "permutexvar_ps", "reduce_add_ps", "reduce_max_ps", "set1_epi16",
    "set1_epi32", "set1_epi8", "set1_ps", "set_epi16", "setr_epi32", "setzero_ps", "setzero_si512",
    "shuffle_f32x4_44", "shuffle_f32x4_ee", "shuffle_f32x4_88", "shuffle_f32x4_dd", "shuffle_f32x4_1b",
    "shuffle_ps_44", "shuffle_ps_ee", "shuffle_ps_88", "shuffle_ps_dd", "shuffle_ps_1b",
    "slli_epi32_0", "slli_epi32_12", "slli_epi32_16", "slli_epi32_31", "slli_epi32_32",
    "srli_epi16_0", "srli_epi16_4", "srli_epi16_15", "srli_epi16_16",
    "srli_epi32_0", "srli_epi32_16", "srli_epi32_31", "srli_epi32_32", "sub_ps",
    "ternarylogic_epi32_f8", "ternarylogic_epi32_96", "ternarylogic_epi32_ca", "ternarylogic_epi32_00",
    "ternarylogic_epi32_ff", "test_epi32_mask"};

int tm_selftest_count(void) { return (int)(sizeof NAMES / sizeof *NAMES); }
const char *tm_selftest_name(int op) { return NAMES[op]; }

/* the AVX512-BF16 / -VNNI instructions (their own target: -march=x86-64-v4 has neither; call these only on a CPU
 * that has them; emu512.h makes the attribute a no-op) */
__attribute__((target("avx512bf16"))) static void dpbf16(const void *a, const void *b, const void *c, void *out) {
    SPS(_mm512_dpbf16_ps(LPS(c), (__m512bh)LSI(a), (__m512bh)LSI(b)));
}
__attribute__((target("avx512vnni"))) static void dpbusd(const void *a, const void *b, const void *c, void *out) {
    SSI(_mm512_dpbusd_epi32(LSI(c), LSI(a), LSI(b)));
}

void tm_selftest(int op, const void *a, const void *b, const void *c, uint64_t k, void *out) {
    const float *fa = (const float *)a;
    const int16_t *ha = (const int16_t *)a;
    const int32_t *ia = (const int32_t *)a;
    memset(out, 0, 64);
    switch (op) {
        case 0: SSI(_mm512_abs_epi8(LSI(a))); break;
        case 1: SSI(_mm512_add_epi16(LSI(a), LSI(b))); break;
        case 2: SSI(_mm512_add_epi32(LSI(a), LSI(b))); break;
        case 3: SPS(_mm512_add_ps(LPS(a), LPS(b))); break;
        case 4: SSI(_mm512_and_si512(LSI(a), LSI(b))); break;
        case 5: SSI(_mm512_castps_si512(LPS(a))); break;
        case 6: SPS(_mm512_castsi512_ps(LSI(a))); break;
        case 7: { __mmask16 m = _mm512_cmpeq_epi32_mask(LSI(a), LSI(b)); memcpy(out, &m, sizeof m); } break;
        case 8: { __m256i r = _mm512_cvtepi32_epi16(LSI(a)); memcpy(out, &r, 32); } break;
        case 9: SPS(_mm512_cvtepi32_ps(LSI(a))); break;
        case 10: SSI(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)a))); break;
        case 11: SSI(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)a))); break;
        case 12: SSI(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)a))); break;
        case 13: SPS(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)a))); break;
        case 14: dpbf16(a, b, c, out); break;
        case 15: dpbusd(a, b, c, out); break;
        case 16: SPS(_mm512_fmadd_ps(LPS(a), LPS(b), LPS(c))); break;
        case 17: SPS(LPS(a)); break;
        case 18: SSI(LSI(a)); break;
        case 19: SSI(_mm512_madd_epi16(LSI(a), LSI(b))); break;
        case 20: SSI(_mm512_maddubs_epi16(LSI(a), LSI(b))); break;
        case 21: SSI(_mm512_mask_mov_epi32(LSI(c), (__mmask16)k, LSI(a))); break;
        case 22: SSI(_mm512_mask_or_epi32(LSI(c), (__mmask16)k, LSI(a), LSI(b))); break;
        case 23: SSI(_mm512_mask_sub_epi8(LSI(c), (__mmask64)k, LSI(a), LSI(b))); break;
        case 24: SPS(_mm512_max_ps(LPS(a), LPS(b))); break;
        case 25: { __mmask64 m = _mm512_movepi8_mask(LSI(a)); memcpy(out, &m, sizeof m); } break;
        case 26: SPS(_mm512_mul_ps(LPS(a), LPS(b))); break;
        case 27: SSI(_mm512_or_si512(LSI(a), LSI(b))); break;
        case 28: SSI(_mm512_permutexvar_epi16(LSI(a), LSI(b))); break;
        case 29: SPS(_mm512_permutexvar_ps(LSI(a), LPS(b))); break;
        case 30: { float r = _mm512_reduce_add_ps(LPS(a)); memcpy(out, &r, 4); } break;
        case 31: { float r = _mm512_reduce_max_ps(LPS(a)); memcpy(out, &r, 4); } break;
        case 32: SSI(_mm512_set1_epi16(ha[0])); break;
        case 33: SSI(_mm512_set1_epi32(ia[0])); break;
        case 34: SSI(_mm512_set1_epi8(((const char *)a)[0])); break;
        case 35: SPS(_mm512_set1_ps(fa[0])); break;
        case 36: SSI(_mm512_set_epi16(ha[31], ha[30], ha[29], ha[28], ha[27], ha[26], ha[25], ha[24], ha[23], ha[22],
                                      ha[21], ha[20], ha[19], ha[18], ha[17], ha[16], ha[15], ha[14], ha[13], ha[12],
                                      ha[11], ha[10], ha[9], ha[8], ha[7], ha[6], ha[5], ha[4], ha[3], ha[2], ha[1],
                                      ha[0])); break;
        case 37: SSI(_mm512_setr_epi32(ia[0], ia[1], ia[2], ia[3], ia[4], ia[5], ia[6], ia[7], ia[8], ia[9], ia[10],
                                       ia[11], ia[12], ia[13], ia[14], ia[15])); break;
        case 38: SPS(_mm512_setzero_ps()); break;
        case 39: SSI(_mm512_setzero_si512()); break;
        case 40: SPS(_mm512_shuffle_f32x4(LPS(a), LPS(b), 0x44)); break;
        case 41: SPS(_mm512_shuffle_f32x4(LPS(a), LPS(b), 0xEE)); break;
        case 42: SPS(_mm512_shuffle_f32x4(LPS(a), LPS(b), 0x88)); break;
        case 43: SPS(_mm512_shuffle_f32x4(LPS(a), LPS(b), 0xDD)); break;
        case 44: SPS(_mm512_shuffle_f32x4(LPS(a), LPS(b), 0x1B)); break;
        case 45: SPS(_mm512_shuffle_ps(LPS(a), LPS(b), 0x44)); break;
        case 46: SPS(_mm512_shuffle_ps(LPS(a), LPS(b), 0xEE)); break;
        case 47: SPS(_mm512_shuffle_ps(LPS(a), LPS(b), 0x88)); break;
        case 48: SPS(_mm512_shuffle_ps(LPS(a), LPS(b), 0xDD)); break;
        case 49: SPS(_mm512_shuffle_ps(LPS(a), LPS(b), 0x1B)); break;
        case 50: SSI(_mm512_slli_epi32(LSI(a), 0)); break;
        case 51: SSI(_mm512_slli_epi32(LSI(a), 12)); break;
        case 52: SSI(_mm512_slli_epi32(LSI(a), 16)); break;
        case 53: SSI(_mm512_slli_epi32(LSI(a), 31)); break;
        case 54: SSI(_mm512_slli_epi32(LSI(a), 32)); break;
        case 55: SSI(_mm512_srli_epi16(LSI(a), 0)); break;
        case 56: SSI(_mm512_srli_epi16(LSI(a), 4)); break;
        case 57: SSI(_mm512_srli_epi16(LSI(a), 15)); break;
        case 58: SSI(_mm512_srli_epi16(LSI(a), 16)); break;
        case 59: SSI(_mm512_srli_epi32(LSI(a), 0)); break;
        case 60: SSI(_mm512_srli_epi32(LSI(a), 16)); break;
        case 61: SSI(_mm512_srli_epi32(LSI(a), 31)); break;
        case 62: SSI(_mm512_srli_epi32(LSI(a), 32)); break;
        case 63: SPS(_mm512_sub_ps(LPS(a), LPS(b))); break;
        case 64: SSI(_mm512_ternarylogic_epi32(LSI(a), LSI(b), LSI(c), 0xF8)); break;
        case 65: SSI(_mm512_ternarylogic_epi32(LSI(a), LSI(b), LSI(c), 0x96)); break;
        case 66: SSI(_mm512_ternarylogic_epi32(LSI(a), LSI(b), LSI(c), 0xCA)); break;
        case 67: SSI(_mm512_ternarylogic_epi32(LSI(a), LSI(b), LSI(c), 0x00)); break;
        case 68: SSI(_mm512_ternarylogic_epi32(LSI(a), LSI(b), LSI(c), 0xFF)); break;
        case 69: { __mmask16 m = _mm512_test_epi32_mask(LSI(a), LSI(b)); memcpy(out, &m, sizeof m); } break;
        default: break;
    }
}
