/* AMX-INT8 emulation for the test-only ``amxemu`` kernel variant (tokenmill/model/layers/cpu_build.py).
 *
 * Force-included (``-include emuamx.h``) after csrc/emu512.h, so the sources compile as the ``avx512emu``
 * variant (the avx512 code paths on an AVX2 CPU) plus the AMX-INT8 paths: it defines ``__AMX_TILE__`` and
 * ``__AMX_INT8__`` (as ``-mamx-tile -mamx-int8`` do) and maps every AMX intrinsic to a function written here
 * after the Intel SDM's pseudo-code (LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TILERELEASE, TDPBSSD /
 * TDPBSUD / TDPBUSD / TDPBUUD), on a tile state of this thread (the tile registers and their configuration are
 * per-thread architectural state, as on the hardware). ``TOKENMILL_EMUAMX`` tells the sources that the
 * run-time gate (CPUID's AMX bits, Linux's ARCH_REQ_XCOMP_PERM request) has nothing to ask: it passes.
 *
 * The state and semantics emulated (palette 1: 8 tiles of at most 16 rows x 64 bytes):
 *   - LDTILECFG reads the 64-byte configuration: byte 0 the palette (0: release the tiles; 1: configure;
 *     other: #GP), byte 1 start_row (must be 0 here), bytes 16-31 each tile's bytes per row (uint16),
 *     bytes 48-55 each tile's rows (uint8); the other bytes are reserved and must be 0 (#GP otherwise), as must
 *     the tiles 8-15 entries; a tile with rows > 16 or more than 64 bytes per row is a #GP; a tile is valid
 *     when both its rows and its bytes per row are nonzero. Every tile is zeroed.
 *   - TILELOADD tmm, [base + stride]: row r (r < rows) takes the tile's bytes per row from base + r * stride;
 *     the rest of the tile (rows past rows, bytes past the row's width) is zeroed.
 *   - TILESTORED [base + stride], tmm: row r's bytes per row written to base + r * stride.
 *   - TILEZERO tmm: every byte 0.
 *   - TDPB[SU][SU]D tmm_c, tmm_a, tmm_b: for m < c.rows, n < c.colsb / 4, k < a.colsb / 4:
 *     c.dword[m][n] += a.byte[m][4k+i] * b.byte[k][4n+i] summed over i < 4, each byte signed or unsigned per
 *     the mnemonic (first letter: a, second: b), the dword sum wrapping modulo 2^32; the rest of c zeroed.
 *     #UD unless the three tiles are distinct and valid, c.rows == a.rows, c.colsb == b.colsb and
 *     a.colsb / 4 == b.rows.
 *   - TILERELEASE: back to the initial state (palette 0, tiles zero).
 *   Any AMX instruction but LDTILECFG / TILERELEASE with no configuration (palette 0) or on an invalid tile is a
 *   #UD. A fault (#GP, #UD) aborts the process with its reason on stderr, as the hardware's signal would kill it.
 *
 * It does not model the instructions' speed, XSAVE/XFD (the kernel's lazy tile-state allocation), or the
 * tile configuration's start_row restart protocol. tests/model/test_emuamx.py checks every function here
 * against the same pseudo-code written in numpy (tests/model/csrc/emuamx_selftest.c), and against the real
 * instructions bit for bit on a CPU with AMX (skipped elsewhere). */
#ifndef TOKENMILL_EMUAMX_H
#define TOKENMILL_EMUAMX_H

#if defined(__AMX_TILE__) || defined(__AMX_INT8__)
#error "emuamx.h emulates AMX on CPUs without it: compile the amxemu variant without -mamx-tile / -mamx-int8"
#endif
#if !defined(__x86_64__)
#error "emuamx.h emulates x86-64's AMX"
#endif

/* the system headers the kernels use, before the macros below exist (GCC's <immintrin.h> defines its own
 * _tile_* macros and functions; they are replaced below) */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TM_EMU_AMX static inline __attribute__((always_inline, unused))
#define TM_EMU_AMX_TILES 8
#define TM_EMU_AMX_ROWS 16
#define TM_EMU_AMX_COLSB 64

typedef struct {
    uint8_t palette;                                   /* 0: not configured */
    uint8_t rows[TM_EMU_AMX_TILES];
    uint16_t colsb[TM_EMU_AMX_TILES];
    uint8_t t[TM_EMU_AMX_TILES][TM_EMU_AMX_ROWS][TM_EMU_AMX_COLSB];
} tm_emu_amx_state;

/* this thread's tile registers and configuration (one copy per translation unit: each kernel library is one) */
static __thread tm_emu_amx_state tm_emu_amx;

static void __attribute__((noreturn, unused)) tm_emu_amx_fault(const char *fault, const char *insn,
                                                               const char *why) {
    fprintf(stderr, "emuamx.h: %s in %s: %s\n", fault, insn, why);
    fflush(stderr);
    abort();
}

/* #UD unless configured and tile i exists and is valid */
TM_EMU_AMX void tm_emu_amx_check_tile(const char *insn, int i) {
    if (!tm_emu_amx.palette) tm_emu_amx_fault("#UD", insn, "tiles not configured (palette 0)");
    if (i < 0 || i >= TM_EMU_AMX_TILES) tm_emu_amx_fault("#UD", insn, "no such tile register");
    if (!tm_emu_amx.rows[i] || !tm_emu_amx.colsb[i]) tm_emu_amx_fault("#UD", insn, "tile not configured (0 rows)");
}

TM_EMU_AMX void tm_emu_tile_release(void) { memset(&tm_emu_amx, 0, sizeof tm_emu_amx); }

TM_EMU_AMX void tm_emu_tile_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    tm_emu_amx_state s;
    memset(&s, 0, sizeof s);
    if (c[0] == 0) {                                   /* palette 0: the initial state */
        tm_emu_amx = s;
        return;
    }
    if (c[0] != 1) tm_emu_amx_fault("#GP", "ldtilecfg", "unsupported palette");
    if (c[1] != 0) tm_emu_amx_fault("#GP", "ldtilecfg", "start_row must be 0 (no restart is emulated)");
    for (int b = 2; b < 16; b++)
        if (c[b]) tm_emu_amx_fault("#GP", "ldtilecfg", "reserved bytes 2-15 not zero");
    for (int b = 32; b < 48; b++)
        if (c[b]) tm_emu_amx_fault("#GP", "ldtilecfg", "tiles 8-15 bytes per row not zero");
    for (int b = 56; b < 64; b++)
        if (c[b]) tm_emu_amx_fault("#GP", "ldtilecfg", "tiles 8-15 rows not zero");
    s.palette = 1;
    for (int i = 0; i < TM_EMU_AMX_TILES; i++) {
        const uint16_t colsb = (uint16_t)(c[16 + 2 * i] | c[17 + 2 * i] << 8);
        const uint8_t rows = c[48 + i];
        if (colsb > TM_EMU_AMX_COLSB) tm_emu_amx_fault("#GP", "ldtilecfg", "more than 64 bytes per row");
        if (rows > TM_EMU_AMX_ROWS) tm_emu_amx_fault("#GP", "ldtilecfg", "more than 16 rows");
        s.colsb[i] = colsb;
        s.rows[i] = rows;
    }
    tm_emu_amx = s;
}

TM_EMU_AMX void tm_emu_tile_loadd(int dst, const void *base, long stride) {
    tm_emu_amx_check_tile("tileloadd", dst);
    uint8_t(*t)[TM_EMU_AMX_COLSB] = tm_emu_amx.t[dst];
    memset(t, 0, sizeof tm_emu_amx.t[dst]);
    for (int r = 0; r < tm_emu_amx.rows[dst]; r++)
        memcpy(t[r], (const uint8_t *)base + (long)r * stride, tm_emu_amx.colsb[dst]);
}

TM_EMU_AMX void tm_emu_tile_stored(int src, void *base, long stride) {
    tm_emu_amx_check_tile("tilestored", src);
    for (int r = 0; r < tm_emu_amx.rows[src]; r++)
        memcpy((uint8_t *)base + (long)r * stride, tm_emu_amx.t[src][r], tm_emu_amx.colsb[src]);
}

TM_EMU_AMX void tm_emu_tile_zero(int dst) {
    tm_emu_amx_check_tile("tilezero", dst);
    memset(tm_emu_amx.t[dst], 0, sizeof tm_emu_amx.t[dst]);
}

/* TDPB<a_signed ? S : U><b_signed ? S : U>D c, a, b */
TM_EMU_AMX void tm_emu_tile_dp(const char *insn, int c, int a, int b, int a_signed, int b_signed) {
    tm_emu_amx_check_tile(insn, c);
    tm_emu_amx_check_tile(insn, a);
    tm_emu_amx_check_tile(insn, b);
    if (c == a || c == b || a == b) tm_emu_amx_fault("#UD", insn, "tile operands not distinct");
    const int M = tm_emu_amx.rows[c], N = tm_emu_amx.colsb[c] / 4, K = tm_emu_amx.colsb[a] / 4;
    if (tm_emu_amx.rows[a] != M) tm_emu_amx_fault("#UD", insn, "rows of the accumulator and of a differ");
    if (tm_emu_amx.colsb[b] != tm_emu_amx.colsb[c]) tm_emu_amx_fault("#UD", insn, "b's row width is not c's");
    if (tm_emu_amx.rows[b] != K) tm_emu_amx_fault("#UD", insn, "a's dwords per row are not b's rows");
    uint8_t(*ta)[TM_EMU_AMX_COLSB] = tm_emu_amx.t[a], (*tb)[TM_EMU_AMX_COLSB] = tm_emu_amx.t[b];
    uint8_t(*tc)[TM_EMU_AMX_COLSB] = tm_emu_amx.t[c];
    uint8_t out[TM_EMU_AMX_ROWS][TM_EMU_AMX_COLSB];
    memset(out, 0, sizeof out);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            uint32_t acc;
            memcpy(&acc, &tc[m][4 * n], 4);
            for (int k = 0; k < K; k++)
                for (int i = 0; i < 4; i++) {
                    const int32_t x = a_signed ? (int32_t)(int8_t)ta[m][4 * k + i] : (int32_t)ta[m][4 * k + i];
                    const int32_t y = b_signed ? (int32_t)(int8_t)tb[k][4 * n + i] : (int32_t)tb[k][4 * n + i];
                    acc += (uint32_t)(x * y);              /* |x y| <= 2^16: exact; the sum wraps */
                }
            memcpy(&out[m][4 * n], &acc, 4);
        }
    memcpy(tc, out, sizeof out);                           /* rows past M, bytes past N dwords: zero */
}

/* ---------------------------------------------------------------- the renames */
#undef _tile_loadconfig
#define _tile_loadconfig(config) tm_emu_tile_loadconfig(config)
#undef _tile_release
#define _tile_release() tm_emu_tile_release()
#undef _tile_loadd
#define _tile_loadd(dst, base, stride) tm_emu_tile_loadd(dst, base, stride)
#undef _tile_stored
#define _tile_stored(src, base, stride) tm_emu_tile_stored(src, base, stride)
#undef _tile_zero
#define _tile_zero(dst) tm_emu_tile_zero(dst)
#undef _tile_dpbssd
#define _tile_dpbssd(c, a, b) tm_emu_tile_dp("tdpbssd", c, a, b, 1, 1)
#undef _tile_dpbsud
#define _tile_dpbsud(c, a, b) tm_emu_tile_dp("tdpbsud", c, a, b, 1, 0)
#undef _tile_dpbusd
#define _tile_dpbusd(c, a, b) tm_emu_tile_dp("tdpbusd", c, a, b, 0, 1)
#undef _tile_dpbuud
#define _tile_dpbuud(c, a, b) tm_emu_tile_dp("tdpbuud", c, a, b, 0, 0)

/* the feature macros -mamx-tile -mamx-int8 define; TOKENMILL_EMUAMX: the run-time gate has nothing to ask */
#define __AMX_TILE__ 1
#define __AMX_INT8__ 1
#define TOKENMILL_EMUAMX 1

#endif
