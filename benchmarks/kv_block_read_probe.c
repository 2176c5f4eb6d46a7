/* Read probe for docs/benchmarks/2026-12-03-kv-block-layout-avx2.md: the memory side of a decode step's
 * paged K/V reads alone. 64 requests x 21 blocks of CH bytes (K blocks, then V blocks, per request; two
 * OpenMP threads, requests handed out dynamically) over 30 per-layer pools of NB blocks (K half, V half),
 * the blocks contiguous (request after request) or a seeded random permutation of the pool; optional
 * software prefetch of the block DIST ahead in the request's K-then-V stream (one line per line read; hint
 * 3 = T0, 2 = T1, else NTA); THP 1: the pools madvise(MADV_HUGEPAGE)d before first touch. Best of 7, GB/s.
 *
 *     gcc -O2 -march=x86-64-v3 -fopenmp benchmarks/kv_block_read_probe.c -o /tmp/kvprobe
 *     /tmp/kvprobe CH NB SCATTERED DIST [HINT [THP]]      e.g. /tmp/kvprobe 6144 2912 1 1 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#define L 30
#define B 64
#define NBR 21
static inline __m256i rd(const uint8_t* p, int64_t n, const uint8_t* pf, int hint) {
    __m256i a = _mm256_setzero_si256(), b = a;
    for (int64_t i = 0; i < n; i += 64) {
        if (pf) { if (hint == 3) _mm_prefetch((const char*)pf + i, _MM_HINT_T0); else if (hint == 2) _mm_prefetch((const char*)pf + i, _MM_HINT_T1); else _mm_prefetch((const char*)pf + i, _MM_HINT_NTA); }
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i*)(p + i)));
        b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i*)(p + i + 32)));
    }
    return _mm256_add_epi64(a, b);
}
int main(int argc, char** argv) {
    if (argc < 5) { fprintf(stderr, "usage: CH NB SCATTERED DIST [HINT [THP]]\n"); return 2; }
    int64_t CH = atoi(argv[1]), NB = atoi(argv[2]);
    int scat = atoi(argv[3]), dist = atoi(argv[4]), hint = argc > 5 ? atoi(argv[5]) : 3, thp = argc > 6 ? atoi(argv[6]) : 0;
    if (NB < B * NBR) { fprintf(stderr, "NB must be >= %d\n", B * NBR); return 2; }
    uint8_t* pools[L];
    for (int l = 0; l < L; l++) { int64_t sz = (2 * NB * CH + (2 << 20) - 1) / (2 << 20) * (2 << 20); pools[l] = aligned_alloc(2 << 20, sz); if (thp) madvise(pools[l], sz, MADV_HUGEPAGE); memset(pools[l], l + 1, 2 * NB * CH); }
    int32_t* perm = malloc(sizeof(int32_t) * NB);
    for (int i = 0; i < NB; i++) perm[i] = i;
    srand(1);
    if (scat) for (int i = NB - 1; i > 0; i--) { int j = rand() % (i + 1); int t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    int64_t sink = 0; double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        double t0 = omp_get_wtime();
        for (int l = 0; l < L; l++) {
            const uint8_t* kp = pools[l]; const uint8_t* vp = pools[l] + NB * CH;
            #pragma omp parallel for schedule(dynamic, 1) num_threads(2) reduction(+:sink)
            for (int r = 0; r < B; r++) {
                const int32_t* bt = perm + r * NBR;
                __m256i acc = _mm256_setzero_si256();
                for (int s = 0; s < 2 * NBR; s++) {   /* stream: K blocks then V blocks */
                    const uint8_t* base = s < NBR ? kp : vp;
                    const uint8_t* p = base + (int64_t)bt[s % NBR] * CH;
                    const uint8_t* pf = NULL;
                    if (dist && s + dist < 2 * NBR) pf = (s + dist < NBR ? kp : vp) + (int64_t)bt[(s + dist) % NBR] * CH;
                    acc = _mm256_add_epi64(acc, rd(p, CH, pf, hint));
                }
                int64_t t[4]; _mm256_storeu_si256((__m256i*)t, acc); sink += t[0];
            }
        }
        double dt = omp_get_wtime() - t0;
        if (dt < best) best = dt;
    }
    double bytes = (double)L * B * NBR * CH * 2;
    printf("thp %d CH %ld NB %ld %s dist %d hint %d: %.2f ms  %.1f GB/s (%ld)\n", thp, CH, NB, scat ? "scattered " : "contiguous", dist, hint, best * 1e3, bytes / best / 1e9, sink & 1);
    if (thp) { FILE* f = fopen("/proc/self/smaps_rollup", "r"); char ln[256]; while (fgets(ln, 256, f)) if (strstr(ln, "AnonHuge")) fputs(ln, stdout); fclose(f); }
    return 0;
}
