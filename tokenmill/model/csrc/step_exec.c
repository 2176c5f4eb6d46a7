/* A step executor: runs a prepared list of kernel calls (tokenmill/model/step_graph.py) in one C loop, so a
 * decode step is one call from Python instead of ~300 (each ~2-3 us of Python and ctypes on the 2-core AVX2
 * EPYC, docs/benchmarks/2026-12-02-roofline-avx2.md).
 *
 * Each call is a row of TM_EXEC_ROW int64 values: [0] the C function's address, [1] its signature id (an index
 * into SIGS: the argument types as letters, p = pointer, i = int, l = int64_t, f = float, as the kernels'
 * ctypes argtypes declare them), [2..] the arguments in order (a pointer or integer as its value, a float as its
 * IEEE bits in the low 32 bits). The functions are called exactly as ctypes would call them -- same function,
 * same arguments with the same C types, same order, one after the other on the calling thread -- so each kernel
 * opens its own OpenMP region as before and the results are the per-call path's bits.
 *
 * Only the call mechanics live here: no arithmetic, no OpenMP, nothing ISA-specific (the same build serves
 * every kernel variant's functions). */
#include <stdint.h>
#include <string.h>

#define TM_EXEC_ROW 24
#define TM_EXEC_MAX_ARGS (TM_EXEC_ROW - 2)

/* signature ids: the order of SIGS */
enum { SIG_GEMM, SIG_NORM, SIG_ROPE, SIG_SILU, SIG_KV_WRITE, SIG_DECODE, SIG_RAGGED, SIG_COUNT };

static const char *const SIGS[SIG_COUNT] = {
    "pilllliplppppil",      /* tm_lowbit_gemm, _i8, _i8_h */
    "pppppllfi",            /* rms_norm_* */
    "plllllppi",            /* rope_* */
    "pplli",                /* silu_mul_* */
    "pppllllppff",          /* kv_write_* */
    "ppppplplllllfffi",     /* paged_decode_* */
    "ppppplppplllllfffi",   /* paged_rows_*, paged_prefill_* */
};

typedef void (*fn_gemm)(void *, int, int64_t, int64_t, int64_t, int64_t, int, void *, int64_t, void *, void *,
                        void *, void *, int, int64_t);
typedef void (*fn_norm)(void *, void *, void *, void *, void *, int64_t, int64_t, float, int);
typedef void (*fn_rope)(void *, int64_t, int64_t, int64_t, int64_t, int64_t, void *, void *, int);
typedef void (*fn_silu)(void *, void *, int64_t, int64_t, int);
typedef void (*fn_kv_write)(void *, void *, void *, int64_t, int64_t, int64_t, int64_t, void *, void *, float,
                            float);
typedef void (*fn_decode)(void *, void *, void *, void *, void *, int64_t, void *, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, float, float, int);
typedef void (*fn_ragged)(void *, void *, void *, void *, void *, int64_t, void *, void *, void *, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float, float, int);

/* The signature id of an argument-type string (see SIGS), or -1 when the executor cannot make that call. */
int tm_exec_sig(const char *codes) {
    for (int s = 0; s < SIG_COUNT; s++)
        if (strcmp(codes, SIGS[s]) == 0) return s;
    return -1;
}

/* The row width (int64 values per call). */
int tm_exec_row(void) { return TM_EXEC_ROW; }

static inline float f32_bits(int64_t v) {
    const uint32_t u = (uint32_t)v;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define P(k) ((void *)(intptr_t)a[k])
#define L(k) (a[k])
#define I(k) ((int)a[k])
#define F(k) (f32_bits(a[k]))

/* Run calls[0 .. n) in order. Returns the number of calls made: n, or the index of the first row whose
 * signature id is unknown (nothing from that row on is called). */
int64_t tm_exec_run(const int64_t *calls, int64_t n) {
    for (int64_t k = 0; k < n; k++) {
        const int64_t *c = calls + k * TM_EXEC_ROW;
        const int64_t *a = c + 2;
        void *fn = (void *)(intptr_t)c[0];
        switch (c[1]) {
        case SIG_GEMM:
            ((fn_gemm)fn)(P(0), I(1), L(2), L(3), L(4), L(5), I(6), P(7), L(8), P(9), P(10), P(11), P(12), I(13),
                          L(14));
            break;
        case SIG_NORM:
            ((fn_norm)fn)(P(0), P(1), P(2), P(3), P(4), L(5), L(6), F(7), I(8));
            break;
        case SIG_ROPE:
            ((fn_rope)fn)(P(0), L(1), L(2), L(3), L(4), L(5), P(6), P(7), I(8));
            break;
        case SIG_SILU:
            ((fn_silu)fn)(P(0), P(1), L(2), L(3), I(4));
            break;
        case SIG_KV_WRITE:
            ((fn_kv_write)fn)(P(0), P(1), P(2), L(3), L(4), L(5), L(6), P(7), P(8), F(9), F(10));
            break;
        case SIG_DECODE:
            ((fn_decode)fn)(P(0), P(1), P(2), P(3), P(4), L(5), P(6), L(7), L(8), L(9), L(10), L(11), F(12), F(13),
                            F(14), I(15));
            break;
        case SIG_RAGGED:
            ((fn_ragged)fn)(P(0), P(1), P(2), P(3), P(4), L(5), P(6), P(7), P(8), L(9), L(10), L(11), L(12), L(13),
                            F(14), F(15), F(16), I(17));
            break;
        default:
            return k;
        }
    }
    return n;
}
