/* Probes for benchmarks/decode_stream.py: plain streaming reads of a decode step's weight bytes with the
 * OpenMP split the low-bit GEMM uses, to tell the memory system's cost from the kernel's.
 *
 * A "call" reads one buffer of nbytes, cut into tiles of tile_bytes (the GEMM's 16-row weight tiles), the tiles
 * shared out over the threads as `omp for schedule(static)` does (thread i: one contiguous run of tiles).
 * Reading = 32-byte loads summed with vpaddq (cheap: the memory side alone).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

static inline __m256i read_tiles(const uint8_t *p, int64_t nbytes, int pf) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int64_t i = 0; i < nbytes; i += 64) {
        if (pf) _mm_prefetch((const char *)p + i + pf, _MM_HINT_T0);
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
    }
    return _mm256_add_epi64(a, b);
}

static inline int64_t hsum(__m256i v) {
    int64_t t[4];
    _mm256_storeu_si256((__m256i *)t, v);
    return t[0] + t[1] + t[2] + t[3];
}

/* mode 0: one parallel region per call (the GEMM's fork/join per call);
 * mode 1: one region for all calls, `omp for` with its barrier between calls (dependent calls);
 * mode 2: one region, `omp for nowait` (no barrier: the ideal for independent calls).
 * Returns the seconds of the whole sequence; *sink gets the sum. */
double probe_calls(const uint8_t **bufs, const int64_t *nbytes, const int64_t *tile_bytes, int n, int mode, int pf,
                   int threads, int64_t *sink) {
    int64_t total = 0;
    const double t0 = omp_get_wtime();
    if (mode == 0) {
        for (int c = 0; c < n; c++) {
            const int64_t nt = nbytes[c] / tile_bytes[c], tb = tile_bytes[c];
            const uint8_t *p = bufs[c];
            int64_t s = 0;
#pragma omp parallel for schedule(static) reduction(+ : s) num_threads(threads)
            for (int64_t t = 0; t < nt; t++) s += hsum(read_tiles(p + t * tb, tb, pf));
            total += s;
        }
    } else {
#pragma omp parallel num_threads(threads) reduction(+ : total)
        for (int c = 0; c < n; c++) {
            const int64_t nt = nbytes[c] / tile_bytes[c], tb = tile_bytes[c];
            const uint8_t *p = bufs[c];
            if (mode == 1) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < nt; t++) total += hsum(read_tiles(p + t * tb, tb, pf));
            } else {
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < nt; t++) total += hsum(read_tiles(p + t * tb, tb, pf));
            }
        }
    }
    const double t1 = omp_get_wtime();
    *sink = total;
    return t1 - t0;
}

/* Seconds per empty parallel region (fork/join) and per barrier inside one region, over iters. */
double probe_forkjoin(int iters, int threads) {
    int64_t x = 0;
    const double t0 = omp_get_wtime();
    for (int i = 0; i < iters; i++) {
#pragma omp parallel num_threads(threads) reduction(+ : x)
        x += omp_get_thread_num();
    }
    return (omp_get_wtime() - t0) / iters + (double)(x & 0) ;
}

double probe_barrier(int iters, int threads) {
    double t0 = 0, t1 = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        for (int i = 0; i < iters; i++) {
#pragma omp barrier
        }
#pragma omp master
        t1 = omp_get_wtime();
    }
    return (t1 - t0) / iters;
}
