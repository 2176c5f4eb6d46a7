/* Shared by every tokenmill CPU kernel: headers and bfloat16 <-> float32 conversion with torch's
 * rounding (round to nearest even; NaN stays NaN). */
#ifndef TOKENMILL_COMMON_H
#define TOKENMILL_COMMON_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c; c.u = ((uint32_t)x) << 16; return c.f;
}
static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch */
    union { uint32_t u; float f; } c; c.f = f;
    if ((c.u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(c.u >> 16) | ((c.u & 0xffff) ? 0x40 : 0);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

#endif
