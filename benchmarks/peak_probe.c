/* Instruction-peak probes for benchmarks/lowbit_kernel_ab.py --peak: the AVX2 low-bit GEMM's inner instruction mix
 * alone, registers only (no loads, no epilogue), 8 independent accumulator chains per thread, the OpenMP threads
 * each running their own copy. Returns the seconds of `iters` iterations per thread (the best of 3).
 *
 *   mix 4: 4-bit path, per iteration 8 x (VPMADDUBSW + VPADDW into an int16 accumulator);
 *   mix 8: 8-bit path, per iteration 8 x (VPSIGNB + VPMADDUBSW + VPMADDWD + VPADDD into an int32 accumulator).
 *
 * One VPMADDUBSW = 32 int8 multiply-adds (MACs); the caller converts. The lead's probe of 2026-12-03 (the same
 * 4-bit mix) read 5.16 VPMADDUBSW/ns per thread on the AVX2 EPYC.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CH(OPS) OPS(a0, w0) OPS(a1, w1) OPS(a2, w0) OPS(a3, w1) OPS(a4, w0) OPS(a5, w1) OPS(a6, w0) OPS(a7, w1)
#define M4(A, W) "vpmaddubsw %[x], %[" #W "], %%ymm14\n\t vpaddw %%ymm14, %[" #A "], %[" #A "]\n\t"
#define M8(A, W) "vpsignb %[" #W "], %[x], %%ymm15\n\t vpmaddubsw %%ymm15, %[" #W "], %%ymm14\n\t" \
                 "vpmaddwd %[ones], %%ymm14, %%ymm14\n\t vpaddd %%ymm14, %[" #A "], %[" #A "]\n\t"

double peak_probe(int mix, long iters, int threads) {
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        long sink = 0;
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            __m256i w0 = _mm256_set1_epi8((char)(7 + omp_get_thread_num())), w1 = _mm256_set1_epi8(3);
            const __m256i x = _mm256_set1_epi8(-5), ones = _mm256_set1_epi16(1);
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (long i = 0; i < iters; i++) {
                if (mix == 4)
                    __asm__ volatile(CH(M4)
                                     : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4),
                                       [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7)
                                     : [x] "x"(x), [w0] "x"(w0), [w1] "x"(w1) : "xmm14", "xmm15");
                else
                    __asm__ volatile(CH(M8)
                                     : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4),
                                       [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7)
                                     : [x] "x"(x), [w0] "x"(w0), [w1] "x"(w1), [ones] "x"(ones) : "xmm14", "xmm15");
            }
            const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                                               _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
            sink += _mm256_extract_epi32(s, 0);
        }
        const double t = omp_get_wtime() - t0;
        if (t < best) best = t;
        if (sink == 42) best *= 1.0;   /* keep the sums live */
    }
    return best;
}
