/* Interleaved A/B of paged_decode_f32_bf16 from several builds of paged_attention.c, timed from C (no Python or
 * ctypes per call): SmolLM2-135M's attention shape (heads 9/3 x 64, bfloat16 KV, float32 queries, block 16),
 * B requests of ~L cached tokens, 30 layers each with its own pool, and before each layer's call `flushKB` KB of
 * other data read (a decode step's weights between two attentions: without it the 30 pools stay in L3 and the
 * call is compute-bound; with it K/V come from DRAM as in a served step). Builds rotate per repetition; prints
 * the median and best us per call of each and whether every build gave the first build's bits.
 *
 *   gcc -O3 -march=x86-64-v3 -ffast-math -fopenmp -fPIC -Itokenmill/model/csrc -c tokenmill/model/csrc/paged_attention.c -o a.o
 *   gcc -shared -fopenmp a.o -o a.so -lm      (likewise b.so from another checkout's csrc)
 *   gcc -O2 benchmarks/decode_attention_ab.c -o ab -ldl
 *   ./ab THREADS FLUSH_KB L SHUFFLE REPS B ./a.so ./b.so ...
 * SHUFFLE 1: block tables scattered over the pool (j * 37 + 5 mod pool) instead of consecutive blocks.
 * docs/benchmarks/2026-12-03-decode-b1-avx2.md */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef void (*dec_t)(const float*, const uint16_t*, const uint16_t*, float*, const int32_t*, int64_t, const int32_t*,
                      int64_t, int64_t, int64_t, int64_t, int64_t, float, float, float, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmpd(const void* a, const void* b) { double x = *(double*)a, y = *(double*)b; return x < y ? -1 : x > y; }
int main(int argc, char** argv) {
    int threads = atoi(argv[1]), flushkb = atoi(argv[2]), L = atoi(argv[3]), shuffle = atoi(argv[4]), reps = atoi(argv[5]);
    int B = atoi(argv[6]);
    int nl = argc - 7; dec_t fn[8];
    for (int i = 0; i < nl; i++) { void* h = dlopen(argv[7 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { printf("%s\n", dlerror()); return 1; }
        fn[i] = (dec_t)dlsym(h, "paged_decode_f32_bf16"); }
    const int layers = 30, H = 9, KVH = 3, D = 64, bs = 16;
    int nb = (L + bs - 1) / bs, pool = nb * B * 2 + 8;
    uint16_t** kv = malloc(sizeof(void*) * layers);
    srand(1);
    size_t per = (size_t)pool * bs * KVH * D;
    for (int l = 0; l < layers; l++) {
        kv[l] = aligned_alloc(64, per * 2 * 2);
        for (size_t i = 0; i < per * 2; i++) kv[l][i] = 0x3f80 + (rand() & 0x7f) - 0x40 + ((rand() & 1) << 15);
    }
    int32_t* bt = malloc(sizeof(int32_t) * nb * B);
    for (int j = 0; j < nb * B; j++) bt[j] = shuffle ? (int32_t)(((int64_t)j * 37 + 5) % pool) : j;
    float* q = malloc(sizeof(float) * B * H * D); float* out = malloc(sizeof(float) * B * H * D);
    float* ref = malloc(sizeof(float) * B * H * D);
    for (int i = 0; i < B * H * D; i++) q[i] = (rand() % 2000 - 1000) / 1000.f;
    int32_t* sl = malloc(sizeof(int32_t) * B); for (int b = 0; b < B; b++) sl[b] = L - (b % 3);
    size_t fl = (size_t)flushkb * 1024 / 8; uint64_t* fb = fl ? malloc(fl * 8 * layers) : NULL;
    for (size_t i = 0; i < fl * layers; i++) fb[i] = i;
    volatile uint64_t sink = 0;
    double* tot = malloc(sizeof(double) * reps * nl);
    int same = 1;
    for (int r = 0; r < reps + 2; r++)
        for (int i0 = 0; i0 < nl; i0++) {
            int i = (i0 + r) % nl;
            double s = 0;
            for (int l = 0; l < layers; l++) {
                if (fl) { uint64_t a = 0; for (size_t x = 0; x < fl; x++) a += fb[l * fl + x]; sink += a; }
                double t0 = now();
                fn[i](q, kv[l], kv[l] + per, out, bt, nb, sl, B, H, KVH, D, bs, 0.125f, 1.f, 1.f, threads);
                s += now() - t0;
                if (l == 0 && r == 0) { if (i == 0) memcpy(ref, out, sizeof(float) * B * H * D); else same &= !memcmp(ref, out, sizeof(float) * B * H * D); }
            }
            if (r >= 2) tot[i * reps + r - 2] = s;
        }
    printf("threads %d flush %dKB L %d shuffle %d B %d reps %d same_bits %d |", threads, flushkb, L, shuffle, B, reps, same);
    double m0 = 0;
    for (int i = 0; i < nl; i++) {
        qsort(tot + i * reps, reps, sizeof(double), cmpd);
        double m = tot[i * reps + reps / 2] / layers * 1e6; if (i == 0) m0 = m;
        printf(" %s %.2f us/call (min %.2f) x%.3f |", strrchr(argv[7 + i], '/') ? strrchr(argv[7 + i], '/') + 1 : argv[7 + i], m,
               tot[i * reps] / layers * 1e6, m0 / m);
    }
    printf("\n");
    return 0;
}
