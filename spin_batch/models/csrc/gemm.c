#include "common.h"

/* The float32 and bfloat16 panel GEMMs: y = x @ w^T for the decode loop's batch sizes.
 *
 * w is stored in panels of 16 output rows, k-major inside a panel: wp[o / 16][k][o % 16]. A micro-kernel
 * takes a unit of two panels (32 outputs: NV = 2 zmm with AVX-512, 4 ymm with AVX2, 4 NEON register pairs)
 * and up to MR rows of x, broadcasts x[m, k] and adds it times the unit's k-th vectors into NV x MR
 * accumulators. MR fills the register file: 24 of the 32 zmm registers with AVX-512 (MR 12), 12 of the
 * 16 ymm registers with AVX2 (MR 3). Two panels a unit keep two weight runs streaming per thread.
 *
 * A call walks K in blocks of KB steps; in each block every group of MR rows passes over the unit's
 * block of weights while it sits in L1, so the weights stream from memory once for any M. A row's
 * accumulators are stored and reloaded between blocks exactly: each output y[m, o] is the sum over k, in
 * order, of x[m, k] * w[o, k] in a single vector lane, with no horizontal sum. So a row's result does not
 * depend on M or on which other rows share the call: a decode step (M = 1) and a verify run (M = 1 +
 * gamma) give bitwise the same outputs for the same input row. Units are split across OpenMP threads
 * (the runtime torch loaded).
 *
 * The unit's weights are software-prefetched PF k-steps ahead, so the weight stream and the
 * multiply-adds overlap.
 */

/* Where vector j of unit u sits at step k: panel 2u + j / (16 / VW), at lane offset (j % (16 / VW)) * VW. */
static inline int64_t unit_at(int64_t u, int64_t K, int64_t k, int j) {
    return (2 * u + j / (16 / VW)) * K * 16 + k * 16 + (j % (16 / VW)) * VW;
}

#ifndef PF
#define PF 64 /* prefetch distance in k-steps: 64 bytes of each panel per step */
#endif
#define KB 128 /* k-steps per block: a unit's block of weights (16 KB in float32) stays in L1 while each group
                  of MR rows passes over it, so the weights stream from memory once for a few row groups */
#define BLOCKED_GROUPS 4 /* above this many row groups (a prefill chunk) a group takes the whole of K: reloading
                            every row's accumulators per block from a large y costs more than it saves */

/* acc [R rows, stride lda][UNIT] (+)= x [R, K] (k0..k1) @ unit u's weights^T; zeroed first where k0 == 0.
 * A row's accumulators are stored and reloaded between blocks exactly, so its sum still runs over k in
 * order in one lane, whatever M is. WT / XT: the weights' and x's storage; LOADW / LOADX widen them. */
#define MICRO_T(NAME, R, WT, XT, LOADW, LOADX)                                                           \
    static void NAME##_##R(const XT *x, const WT *wp, float *acc, int64_t lda, int64_t K, int64_t k0,    \
                           int64_t k1, int64_t u) {                                                      \
        vw a[R][NV];                                                                                     \
        for (int m = 0; m < R; m++)                                                                      \
            for (int j = 0; j < NV; j++) a[m][j] = k0 ? *(const vw *)(acc + m * lda + j * VW) : (vw){0}; \
        for (int64_t k = k0; k < k1; k++) {                                                              \
            if (((k - k0) & (64 / (16 * (int)sizeof(WT)) - 1)) == 0) { /* once per 64-byte line */     \
                __builtin_prefetch(wp + unit_at(u, K, k + PF, 0), 0, 3);                                 \
                __builtin_prefetch(wp + unit_at(u, K, k + PF, NV - 1), 0, 3);                            \
            }                                                                                            \
            vw w[NV];                                                                                    \
            for (int j = 0; j < NV; j++) w[j] = LOADW(wp + unit_at(u, K, k, j));                         \
            for (int m = 0; m < R; m++) {                                                                \
                float s = LOADX(x[m * K + k]);                                                           \
                for (int j = 0; j < NV; j++) a[m][j] += s * w[j];                                        \
            }                                                                                            \
        }                                                                                                \
        for (int m = 0; m < R; m++)                                                                      \
            for (int j = 0; j < NV; j++) *(vw *)(acc + m * lda + j * VW) = a[m][j];                      \
    }

/* MICRO_T for 1..MR rows, and TABLE[r]: the kernel for r rows. */
#if MR > 3
#define MICRO_SET(NAME, TABLE, WT, XT, LOADW, LOADX)                                                       \
    MICRO_T(NAME, 1, WT, XT, LOADW, LOADX) MICRO_T(NAME, 2, WT, XT, LOADW, LOADX)                          \
    MICRO_T(NAME, 3, WT, XT, LOADW, LOADX) MICRO_T(NAME, 4, WT, XT, LOADW, LOADX)                          \
    MICRO_T(NAME, 5, WT, XT, LOADW, LOADX) MICRO_T(NAME, 6, WT, XT, LOADW, LOADX)                          \
    MICRO_T(NAME, 7, WT, XT, LOADW, LOADX) MICRO_T(NAME, 8, WT, XT, LOADW, LOADX)                          \
    MICRO_T(NAME, 9, WT, XT, LOADW, LOADX) MICRO_T(NAME, 10, WT, XT, LOADW, LOADX)                         \
    MICRO_T(NAME, 11, WT, XT, LOADW, LOADX) MICRO_T(NAME, 12, WT, XT, LOADW, LOADX)                        \
    static void (*const TABLE[MR + 1])(const XT *, const WT *, float *, int64_t, int64_t, int64_t, int64_t, \
                                       int64_t) = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5,     \
                                                   NAME##_6, NAME##_7, NAME##_8, NAME##_9, NAME##_10,      \
                                                   NAME##_11, NAME##_12};
#else
#define MICRO_SET(NAME, TABLE, WT, XT, LOADW, LOADX)                                                       \
    MICRO_T(NAME, 1, WT, XT, LOADW, LOADX) MICRO_T(NAME, 2, WT, XT, LOADW, LOADX)                          \
    MICRO_T(NAME, 3, WT, XT, LOADW, LOADX)                                                                 \
    static void (*const TABLE[MR + 1])(const XT *, const WT *, float *, int64_t, int64_t, int64_t, int64_t, \
                                       int64_t) = {0, NAME##_1, NAME##_2, NAME##_3};
#endif

#define LOAD_F32(p) (*(const vw *)(p))
#define AS_FLOAT(v) (v)
MICRO_SET(micro, MICROS, float, float, LOAD_F32, AS_FLOAT)

/* Every unit u of the call, block by block: MICRO_FN(r rows, x row m0, acc row m0, k0, k1, u). */
#define FOR_BLOCKS(M, K, MICRO_FN)                                                                       \
    for (int64_t kb = ((M) + MR - 1) / MR <= BLOCKED_GROUPS ? KB : (K), k0 = 0; k0 < (K); k0 += kb)        \
        for (int64_t m0 = 0; m0 < (M); m0 += MR) {                                                       \
            int64_t r = (M) - m0 < MR ? (M) - m0 : MR, k1 = k0 + kb < (K) ? k0 + kb : (K);               \
            MICRO_FN;                                                                                    \
        }

/* w [O, K] row-major -> wp [Op / 16][K][16], Op a multiple of 32 >= O; rows O..Op-1 are zero. */
void spin_gemm_pack(const float *w, float *wp, int64_t O, int64_t K, int64_t Op) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < Op / 16; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < 16; j++) {
                int64_t o = p * 16 + j;
                wp[(p * K + k) * 16 + j] = o < O ? w[o * K + k] : 0.0f;
            }
}

/* y [M, Op] = x [M, K] @ w^T, w packed by spin_gemm_pack. */
void spin_gemm(const float *x, const float *wp, float *y, int64_t M, int64_t Op, int64_t K) {
    if (K == 0) {
        for (int64_t i = 0; i < M * Op; i++) y[i] = 0.0f;
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < Op / UNIT; u++)
        FOR_BLOCKS(M, K, MICROS[r](x + m0 * K, wp, y + m0 * Op + UNIT * u, Op, K, k0, k1, u))
}

/* Bfloat16 y = x @ w^T, float32 accumulation, float32 sums rounded to bfloat16 once, to nearest even
 * (as torch rounds). K must be even.
 *
 * Where the CPU has AVX512-BF16 (vdpbf16ps), w is stored in panels of 16 output rows by pairs of k:
 * wp[o / 16][k / 2][o % 16][k % 2], so one 64-byte vector holds 16 outputs' weights for inputs k and
 * k + 1. The micro-kernel broadcasts the pair (x[m, k], x[m, k + 1]) as one 32-bit lane and vdpbf16ps
 * adds both products into each output's float32 accumulator: 32 multiply-adds per instruction and no
 * conversion of the weights.
 *
 * Elsewhere (AVX2, AVX-512 without BF16, NEON) w is stored as in the float32 GEMM, wp[o / 16][k][o % 16]
 * in bfloat16, and the micro-kernel widens each weight vector to float32 exactly (a 16-bit shift) before
 * the float32 multiply-adds of the kernel above: the weights still stream at half the bytes of float32.
 *
 * As in the float32 kernel, a row's sum runs over k in order in one lane, so its result does not depend
 * on M or on the other rows of the call. */
#if defined(__AVX512BF16__)
#define BF16_PAIRS 1

#define MICRO_BF16(R)                                                                                    \
    static void microb_##R(const uint16_t *x, const uint16_t *wp, uint16_t *y, int64_t K, int64_t O,      \
                           int64_t pair) {                                                               \
        int64_t K2 = K / 2;                                                                              \
        const uint16_t *w0 = wp + 2 * pair * K * 16, *w1 = w0 + K * 16;                                  \
        __m512 a0[R], a1[R];                                                                             \
        for (int m = 0; m < R; m++) a0[m] = a1[m] = _mm512_setzero_ps();                                 \
        for (int64_t j = 0; j < K2; j++) {                                                               \
            __builtin_prefetch(w0 + (j + PF) * 32, 0, 3);                                                \
            __builtin_prefetch(w1 + (j + PF) * 32, 0, 3);                                                \
            __m512bh u = (__m512bh)_mm512_loadu_si512(w0 + j * 32);                                      \
            __m512bh v = (__m512bh)_mm512_loadu_si512(w1 + j * 32);                                      \
            for (int m = 0; m < R; m++) {                                                                \
                int32_t xy;                                                                              \
                memcpy(&xy, x + m * K + 2 * j, 4);                                                       \
                __m512bh s = (__m512bh)_mm512_set1_epi32(xy);                                            \
                a0[m] = _mm512_dpbf16_ps(a0[m], u, s);                                                   \
                a1[m] = _mm512_dpbf16_ps(a1[m], v, s);                                                   \
            }                                                                                            \
        }                                                                                                \
        for (int m = 0; m < R; m++) {                                                                    \
            _mm256_storeu_si256((__m256i *)(y + m * O + 32 * pair), (__m256i)_mm512_cvtneps_pbh(a0[m]));      \
            _mm256_storeu_si256((__m256i *)(y + m * O + 32 * pair + 16), (__m256i)_mm512_cvtneps_pbh(a1[m])); \
        }                                                                                                \
    }
#else
#define BF16_PAIRS 0

static inline vw widen(hw h) { return (vw)(__builtin_convertvector(h, uw) << 16); }
#define LOAD_BF16(p) widen(*(const hw *)(p))
#endif

#if BF16_PAIRS
MICRO_BF16(1) MICRO_BF16(2) MICRO_BF16(3) MICRO_BF16(4) MICRO_BF16(5) MICRO_BF16(6) MICRO_BF16(7) MICRO_BF16(8)
MICRO_BF16(9) MICRO_BF16(10) MICRO_BF16(11) MICRO_BF16(12)
typedef void (*microb_t)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);
static const microb_t MICROS_BF16[13] = {0,        microb_1, microb_2, microb_3,  microb_4,  microb_5, microb_6,
                                         microb_7, microb_8, microb_9, microb_10, microb_11, microb_12};
#else
MICRO_SET(microb, MICROS_BF16, uint16_t, uint16_t, LOAD_BF16, bf16_to_float)
#endif

/* 1: the bfloat16 GEMM uses AVX512-BF16's dot products (shown by `spin-batch env`). */
int spin_gemm_bf16_native(void) { return BF16_PAIRS; }

#define ACC_ROWS 240 /* a multiple of every MR */

/* y [M, Op] = x [M, K] @ w^T, all bfloat16 (as uint16), w packed by spin_gemm_pack_bf16. */
void spin_gemm_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *y, int64_t M, int64_t Op, int64_t K) {
    if (M == 0) return;
#if BF16_PAIRS
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < Op / 32; u++)
        for (int64_t m0 = 0; m0 < M; m0 += 12) {
            int64_t r = M - m0 < 12 ? M - m0 : 12;
            MICROS_BF16[r](x + m0 * K, wp, y + m0 * Op, K, Op, u);
        }
#else
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < Op / UNIT; u++)
        for (int64_t c0 = 0; c0 < M; c0 += ACC_ROWS) { /* rows in chunks: the buffer stays 30 KB on any stack */
            int64_t mc = M - c0 < ACC_ROWS ? M - c0 : ACC_ROWS;
            const uint16_t *xc = x + c0 * K;
            float acc[ACC_ROWS * UNIT]; /* the chunk's float32 sums, rounded to bfloat16 once at the end */
            for (int64_t i = 0; K == 0 && i < mc * UNIT; i++) acc[i] = 0.0f;
            FOR_BLOCKS(mc, K, MICROS_BF16[r](xc + m0 * K, wp, acc + m0 * UNIT, UNIT, K, k0, k1, u))
            for (int64_t m = 0; m < mc; m++)
                for (int64_t j = 0; j < UNIT; j++) y[(c0 + m) * Op + UNIT * u + j] = to_bf16(acc[m * UNIT + j]);
        }
#endif
}

/* w [O, K] bfloat16 row-major -> the layout above, Op a multiple of 32 >= O, K even. */
void spin_gemm_pack_bf16(const uint16_t *w, uint16_t *wp, int64_t O, int64_t K, int64_t Op) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < Op / 16; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < 16; j++) {
                int64_t o = p * 16 + j;
                uint16_t v = o < O ? w[o * K + k] : 0;
                if (BF16_PAIRS)
                    wp[((p * (K / 2) + k / 2) * 16 + j) * 2 + k % 2] = v;
                else
                    wp[(p * K + k) * 16 + j] = v;
            }
}
