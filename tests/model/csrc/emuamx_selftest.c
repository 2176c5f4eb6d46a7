/* The AMX-INT8 instructions csrc/emuamx.h emulates, on byte buffers, for tests/model/test_emuamx.py. Compiled
 * twice: as the real avx512 variant (-mamx-tile -mamx-int8: the instructions; run only on a CPU with AMX) and
 * as amxemu (the emulation). The test compares the emulation with the SDM's pseudo-code (in Python) everywhere,
 * and with the instructions where the CPU has them.
 *   tm_amx_selftest(op, a, b, c, m, k, n, out): tiles 0 (C: m rows x n dwords), 1 (A: m x k dwords), 2 (B:
 *   k rows x n dwords) configured; C, A, B loaded from c, a, b (rows 64 bytes apart); then
 *     op 0-3: TDPBSSD / TDPBSUD / TDPBUSD / TDPBUUD C, A, B; op 4: TILEZERO C; op 5: nothing (load / store);
 *     op 6: two TDPBSSD into C in a row (accumulation);
 *   C stored to out (rows 64 bytes apart; bytes past n dwords untouched: out is zeroed first); tiles released.
 *   tm_amx_selftest_ready(): 1 when the tiles may be used (the emulation; or Linux granted the permission). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#if !defined(TOKENMILL_EMUAMX) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

int tm_amx_selftest_ready(void) {
#if defined(TOKENMILL_EMUAMX)
    return 1;
#elif defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

void tm_amx_selftest(int op, const void *a, const void *b, const void *c, int m, int k, int n, void *out) {
    uint8_t cfg[64];
    memset(cfg, 0, sizeof cfg);
    memset(out, 0, 16 * 64);
    cfg[0] = 1;
    cfg[16] = (uint8_t)(4 * n); cfg[48] = (uint8_t)m;        /* tile 0: C */
    cfg[18] = (uint8_t)(4 * k); cfg[49] = (uint8_t)m;        /* tile 1: A */
    cfg[20] = (uint8_t)(4 * n); cfg[50] = (uint8_t)k;        /* tile 2: B */
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(cfg);
    _tile_loadd(0, c, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    switch (op) {
        case 0: _tile_dpbssd(0, 1, 2); break;
        case 1: _tile_dpbsud(0, 1, 2); break;
        case 2: _tile_dpbusd(0, 1, 2); break;
        case 3: _tile_dpbuud(0, 1, 2); break;
        case 4: _tile_zero(0); break;
        case 6: _tile_dpbssd(0, 1, 2); _tile_dpbssd(0, 1, 2); break;
        default: break;
    }
    _tile_stored(0, out, 64);
    _tile_release();
}
