/* What every part of the C decoder shares (cpu_decoder.c includes the parts into one translation unit):
 * the vector types of the build's register width, the instruction set it was written for, the panel
 * width of the GEMMs, bfloat16 <-> float32 conversion, and the vector helpers of the norm, attention and
 * decoder. */
#ifndef SPIN_CPU_COMMON_H
#define SPIN_CPU_COMMON_H

#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

#ifdef __AVX512F__
typedef v16 vw; /* one register of floats */
typedef u16x16 hw; /* as many bfloat16 */
typedef u32x16 uw;
#define VW 16
#define MR 12
#define ISA_NAME "avx512"
#else
typedef v8 vw;
typedef u16x8 hw;
typedef u32x8 uw;
#define VW 8
#define MR 3
#if defined(__AVX2__) && defined(__FMA__)
#define ISA_NAME "avx2"
#elif defined(__aarch64__)
#define ISA_NAME "neon"
#else
#define ISA_NAME "generic"
#endif
#endif
#define UNIT 32 /* outputs per micro-kernel call: two panels */
#define NV (UNIT / VW) /* vectors per row of a unit: 2 zmm, or 4 ymm / NEON pairs */

/* bfloat16 (as uint16) -> float32, exactly. */
static inline float bf16_to_float(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t b;
    __builtin_memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* One float32 stored as float32 or bfloat16 (ES 4 or 2). */
static inline void store1(void *p, int64_t i, float f, int es) {
    if (es == 4)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = to_bf16(f);
}

#ifdef __AVX512F__
typedef int32_t iw __attribute__((vector_size(64)));
#else
typedef int32_t iw __attribute__((vector_size(32)));
#endif

/* VW floats from float32 or bfloat16 storage (ES 4 or 2). */
static inline vw loadw(const void *p, int es) {
    if (es == 4) return *(const vw *)p;
    return (vw)(__builtin_convertvector(*(const hw *)p, uw) << 16);
}

/* The norm, attention and decoder work on vectors of the build's register width (vw: 16 floats with AVX-512, else 8):
 * without AVX-512, GCC spills 64-byte vectors through memory and turns their compares into scalar code.
 * A lane's sums run in a fixed order in either width, so a row's
 * result never depends on its batch; the two widths may round differently from each other. */

/* e^x for x <= 0, to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor
 * polynomial, 2^n put into the exponent bits. Below -87 it returns 0. */
static inline vw expw(vw x) {
    const vw lo = (vw){0} - 87.0f;
    iw under = x < lo;
    x = (vw)((iw)x & ~under) + (vw)((iw)lo & under);
    vw t = x * 1.44269504088896341f + 12582912.0f; /* round to nearest integer, in the low bits */
    vw n = t - 12582912.0f;
    vw r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    vw p = (vw){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    iw e = (__builtin_convertvector(n, iw) + 127) << 23;
    return (vw)((iw)(p * (vw)e) & ~under);
}

#endif
