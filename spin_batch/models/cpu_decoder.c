/* The decode loop's CPU kernels, built once per kind of machine by cpu_decoder.py: float32 and bfloat16 panel
 * GEMMs, the RMS norm, attention over the per-slot KV cache, and spin_decoder (all decoder layers of a
 * forward in one call). Every result of a row is computed alone, in a fixed order (see each part).
 *
 * y = x @ w^T for the decode loop's batch sizes.
 *
 * w is stored in panels of 16 output rows, k-major inside a panel: wp[o / 16][k][o % 16]. A micro-kernel
 * takes a unit of two panels (32 outputs: NV = 2 zmm with AVX-512, 4 ymm with AVX2, 4 NEON register pairs)
 * and up to MR rows of x, broadcasts x[m, k] and adds it times the unit's k-th vectors into NV x MR
 * accumulators. MR fills the register file: 24 of the 32 zmm registers with AVX-512 (MR 12), 12 of the
 * 16 ymm registers with AVX2 (MR 3). Two panels a unit keep two weight runs streaming per thread: one
 * panel a unit (the 6x16 block) left the AVX2 build at 20 GB/s where two panels reach 27.
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
 * multiply-adds overlap: without it each extra row cost its full compute time on top of the memory time.
 */
#include <stdint.h>
#include <limits.h>
#include <omp.h>

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

/* The instruction set this build's GEMM micro-kernel was written for (shown by `spin-batch env`). */
const char *spin_isa(void) { return ISA_NAME; }

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
                            every row's accumulators per block from a large y cost more than it saved (512 rows
                            x 3072 outputs: 5.6 -> 6.4 ms) */

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

/* Int8 weights and int8 activations (a draft's copy of a model, quantize.py): y = x @ q^T * scale with
 * q [O, K] int8 and one float32 scale per output row, and x quantized here, per row, in groups of QG
 * inputs: each group gets its own scale (its largest magnitude over 127) and its values round to the
 * nearest int8. A group's products sum exactly in int32; y[m, o] = scale[o] * sum over groups, in order,
 * of xscale[m, g] * isum[m, g, o] in float32. So a row's result does not depend on M or on the other rows.
 * K is padded with zeros to a multiple of QG (Kp).
 *
 * Layout: panels of 16 output rows by quads of k, wp[o / 16][k / 4][o % 16][k % 4] (64 bytes a quad):
 * one 64-byte vector holds 16 outputs' weights for 4 inputs.
 * - AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes and adds each output's 4 products into its
 *   int32 lane: 64 multiply-adds an instruction, no widening. Its unsigned operand is the weights, stored
 *   as q + 128; the 128 * sum(x group) that adds is taken off per group.
 * - AVX2: vpmaddubsw multiplies |x| (unsigned) by the weights with x's sign moved onto them (vpsignb),
 *   adding pairs into int16 (at most 2 * 127 * 127: no saturation), and vpmaddwd adds the pairs into int32.
 * - Elsewhere: the same sums in plain C.
 * A call takes units of 32 outputs (two panels) and up to Q8_MR rows; the rows' int32 sums of a group sit
 * in registers and are added into y (in L1) once a group. */
#define QG 64
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define Q8_KIND "avx512_vnni"
#define Q8_OFFSET 128
#define Q8_MR 12
#elif defined(__AVX2__)
#define Q8_KIND "avx2"
#define Q8_OFFSET 0
#define Q8_MR 2
#else
#define Q8_KIND "generic"
#define Q8_OFFSET 0
#define Q8_MR 1
#endif
#define Q8_PF 16 /* prefetch distance in quads (64 bytes of each panel a quad) */

/* The instruction set of the int8 GEMM (shown by `spin-batch env`). */
const char *spin_gemm_q8_kind(void) { return Q8_KIND; }

static inline int64_t q8_padded(int64_t K) { return (K + QG - 1) / QG * QG; }

/* Bytes of scratch spin_gemm_q8 needs for M rows of width K. */
int64_t spin_gemm_q8_scratch(int64_t M, int64_t K) { return M * (q8_padded(K) + q8_padded(K) / QG * 8); }

/* w [O, K] int8 row-major -> wp [Op / 16][Kp / 4][16][4] (Op a multiple of 32 >= O); padding is zero. */
void spin_gemm_pack_q8(const int8_t *w, uint8_t *wp, int64_t O, int64_t K, int64_t Op) {
    int64_t Kp = q8_padded(K);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < Op / 16; p++)
        for (int64_t k = 0; k < Kp; k++)
            for (int64_t j = 0; j < 16; j++) {
                int64_t o = p * 16 + j;
                int v = o < O && k < K ? w[o * K + k] : 0;
                wp[((p * (Kp / 4) + k / 4) * 16 + j) * 4 + k % 4] = (uint8_t)(v + Q8_OFFSET);
            }
}

/* x [M, K] float32 -> xq [M, Kp] int8, xs [M, G] float32 group scales, xsum [M, G] int32 group sums. */
static void q8_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xs, int32_t *xsum) {
    int64_t Kp = q8_padded(K), G = Kp / QG;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xr = x + m * K + g * QG;
            int64_t n = K - g * QG < QG ? K - g * QG : QG;
            float amax = 0.0f;
            for (int64_t i = 0; i < n; i++) amax = __builtin_fabsf(xr[i]) > amax ? __builtin_fabsf(xr[i]) : amax;
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t s = 0;
            for (int64_t i = 0; i < QG; i++) {
                int v = i < n ? (int)__builtin_nearbyintf(xr[i] * inv) : 0;
                xq[m * Kp + g * QG + i] = (int8_t)v;
                s += v;
            }
            xs[m * G + g] = amax / 127.0f;
            xsum[m * G + g] = s;
        }
}

/* y [R rows, stride ldy][32] = the unit's outputs, scaled by the weight scales at the end. */
static inline __attribute__((always_inline)) void q8_unit(const int8_t *xq, const float *xs, const int32_t *xsum,
                                                          const uint8_t *wp, const float *scale, float *y, int64_t ldy,
                                                          int64_t Kp, int64_t u, int R) {
    int64_t G = Kp / QG;
    const uint8_t *w0 = wp + 2 * u * Kp * 16, *w1 = w0 + Kp * 16;
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 32; j++) y[m * ldy + j] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
        __m512i a[Q8_MR][2];
        for (int m = 0; m < R; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
        for (int64_t q = g * (QG / 4); q < (g + 1) * (QG / 4); q++) {
            _mm_prefetch((const char *)(w0 + (q + Q8_PF) * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (q + Q8_PF) * 64), _MM_HINT_T0);
            __m512i v0 = _mm512_loadu_si512(w0 + q * 64), v1 = _mm512_loadu_si512(w1 + q * 64);
            for (int m = 0; m < R; m++) {
                int32_t xx;
                __builtin_memcpy(&xx, xq + m * Kp + q * 4, 4);
                __m512i b = _mm512_set1_epi32(xx);
                a[m][0] = _mm512_dpbusd_epi32(a[m][0], v0, b);
                a[m][1] = _mm512_dpbusd_epi32(a[m][1], v1, b);
            }
        }
        for (int m = 0; m < R; m++) {
            __m512i c = _mm512_set1_epi32(Q8_OFFSET * xsum[m * G + g]);
            __m512 s = _mm512_set1_ps(xs[m * G + g]);
            for (int j = 0; j < 2; j++) {
                float *yp = y + m * ldy + 16 * j;
                __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][j], c));
                _mm512_storeu_ps(yp, _mm512_fmadd_ps(f, s, _mm512_loadu_ps(yp)));
            }
        }
#elif defined(__AVX2__)
        __m256i a[Q8_MR][4];
        const __m256i ones = _mm256_set1_epi16(1);
        for (int m = 0; m < R; m++)
            for (int j = 0; j < 4; j++) a[m][j] = _mm256_setzero_si256();
        for (int64_t q = g * (QG / 4); q < (g + 1) * (QG / 4); q++) {
            _mm_prefetch((const char *)(w0 + (q + Q8_PF) * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (q + Q8_PF) * 64), _MM_HINT_T0);
            __m256i v[4] = {_mm256_loadu_si256((const __m256i *)(w0 + q * 64)),
                            _mm256_loadu_si256((const __m256i *)(w0 + q * 64 + 32)),
                            _mm256_loadu_si256((const __m256i *)(w1 + q * 64)),
                            _mm256_loadu_si256((const __m256i *)(w1 + q * 64 + 32))};
            for (int m = 0; m < R; m++) {
                int32_t xx;
                __builtin_memcpy(&xx, xq + m * Kp + q * 4, 4);
                __m256i b = _mm256_set1_epi32(xx), ab = _mm256_abs_epi8(b);
                for (int j = 0; j < 4; j++)
                    a[m][j] = _mm256_add_epi32(a[m][j], _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(v[j], b)), ones));
            }
        }
        for (int m = 0; m < R; m++) {
            __m256 s = _mm256_set1_ps(xs[m * G + g]);
            for (int j = 0; j < 4; j++) {
                float *yp = y + m * ldy + 8 * j;
                _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][j]), s, _mm256_loadu_ps(yp)));
            }
        }
#else
        for (int m = 0; m < R; m++)
            for (int j = 0; j < 32; j++) {
                const uint8_t *wj = (j < 16 ? w0 : w1) + (j % 16) * 4;
                int32_t acc = 0;
                for (int64_t q = g * (QG / 4); q < (g + 1) * (QG / 4); q++)
                    for (int t = 0; t < 4; t++) acc += (int32_t)xq[m * Kp + q * 4 + t] * (int32_t)(int8_t)wj[q * 64 + t];
                y[m * ldy + j] = __builtin_fmaf((float)acc, xs[m * G + g], y[m * ldy + j]);
            }
#endif
    }
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 32; j++) y[m * ldy + j] *= scale[32 * u + j];
}

/* Int4 weights, for the LM head of a draft's int8 copy (quantize.py, RescoredHead): a proxy whose largest
 * logits are then recomputed from the int8 head. Weights are int4 values in -8..7 with a float32 scale per
 * output row and group of QG inputs (the activation groups, so one scale product per group and output).
 * The input rounds to int8 per group of QG as in spin_gemm_q8; a group's products sum exactly in int32.
 *
 * Layout: panels of 16 output rows by octets of k, wp[o / 16][k / 8][o % 16][4 bytes] (64 bytes an octet):
 * byte b of an output's 4 holds k = 8q + b in its low nibble and k = 8q + 4 + b in its high nibble, each
 * stored + 8 (0..15). Masking and shifting a 64-byte vector gives two vectors of 16 outputs x 4 unsigned
 * bytes: the layout of spin_gemm_q8 at half the bytes.
 * - AVX512-VNNI: vpdpbusd on each half; 8 x the group's input sum is taken off.
 * - AVX2: vpmaddubsw (unsigned weights by signed inputs: at most 2 x 15 x 128 a pair, two pairs fit int16)
 *   and vpmaddwd; the same offset taken off.
 * - Elsewhere: the same sums in plain C.
 * ws (scales) is [Op / 16][G][16]. y[m, o] = sum over groups, in order, of (isum * xscale[m, g]) * ws[o, g]. */
#define Q4_OFFSET 8

/* w [O, K] int8 (values in -8..7) row-major -> wp [Op / 16][Kp / 8][16][4] (Op a multiple of 32 >= O). */
void spin_gemm_pack_q4(const int8_t *w, uint8_t *wp, int64_t O, int64_t K, int64_t Op) {
    int64_t Kp = q8_padded(K);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < Op / 16; p++)
        for (int64_t q = 0; q < Kp / 8; q++)
            for (int64_t j = 0; j < 16; j++)
                for (int64_t b = 0; b < 4; b++) {
                    int64_t o = p * 16 + j, lo = 8 * q + b, hi = lo + 4;
                    int vl = o < O && lo < K ? w[o * K + lo] : 0, vh = o < O && hi < K ? w[o * K + hi] : 0;
                    wp[((p * (Kp / 8) + q) * 16 + j) * 4 + b] = (uint8_t)((vl + Q4_OFFSET) | ((vh + Q4_OFFSET) << 4));
                }
}

static inline __attribute__((always_inline)) void q4_unit(const int8_t *xq, const float *xs, const int32_t *xsum,
                                                          const uint8_t *wp, const float *ws, float *y, int64_t ldy,
                                                          int64_t Kp, int64_t u, int R) {
    int64_t G = Kp / QG;
    const uint8_t *w0 = wp + 2 * u * Kp * 8, *w1 = w0 + Kp * 8;
    const float *s0 = ws + 2 * u * G * 16, *s1 = s0 + G * 16;
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 32; j++) y[m * ldy + j] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
        __m512i a[Q8_MR][2];
        const __m512i nib = _mm512_set1_epi8(0x0f);
        for (int m = 0; m < R; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
        for (int64_t q = g * (QG / 8); q < (g + 1) * (QG / 8); q++) {
            _mm_prefetch((const char *)(w0 + (q + Q8_PF) * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (q + Q8_PF) * 64), _MM_HINT_T0);
            __m512i v0 = _mm512_loadu_si512(w0 + q * 64), v1 = _mm512_loadu_si512(w1 + q * 64);
            __m512i l0 = _mm512_and_si512(v0, nib), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib);
            __m512i l1 = _mm512_and_si512(v1, nib), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib);
            for (int m = 0; m < R; m++) {
                int32_t xl, xh;
                __builtin_memcpy(&xl, xq + m * Kp + q * 8, 4);
                __builtin_memcpy(&xh, xq + m * Kp + q * 8 + 4, 4);
                __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);
                a[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[m][0], l0, bl), h0, bh);
                a[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[m][1], l1, bl), h1, bh);
            }
        }
        for (int m = 0; m < R; m++) {
            __m512i c = _mm512_set1_epi32(Q4_OFFSET * xsum[m * G + g]);
            __m512 s = _mm512_set1_ps(xs[m * G + g]);
            for (int j = 0; j < 2; j++) {
                float *yp = y + m * ldy + 16 * j;
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][j], c)), s);
                _mm512_storeu_ps(yp, _mm512_fmadd_ps(f, _mm512_loadu_ps((j ? s1 : s0) + g * 16), _mm512_loadu_ps(yp)));
            }
        }
#elif defined(__AVX2__)
        __m256i a[Q8_MR][4];
        const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0f);
        for (int m = 0; m < R; m++)
            for (int j = 0; j < 4; j++) a[m][j] = _mm256_setzero_si256();
        for (int64_t q = g * (QG / 8); q < (g + 1) * (QG / 8); q++) {
            _mm_prefetch((const char *)(w0 + (q + Q8_PF) * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + (q + Q8_PF) * 64), _MM_HINT_T0);
            __m256i l[4], h[4];
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)((j < 2 ? w0 : w1) + q * 64 + 32 * (j % 2)));
                l[j] = _mm256_and_si256(v, nib);
                h[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            }
            for (int m = 0; m < R; m++) {
                int32_t xl, xh;
                __builtin_memcpy(&xl, xq + m * Kp + q * 8, 4);
                __builtin_memcpy(&xh, xq + m * Kp + q * 8 + 4, 4);
                __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
                for (int j = 0; j < 4; j++) {
                    __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(l[j], bl), _mm256_maddubs_epi16(h[j], bh));
                    a[m][j] = _mm256_add_epi32(a[m][j], _mm256_madd_epi16(t, ones));
                }
            }
        }
        for (int m = 0; m < R; m++) {
            __m256i c = _mm256_set1_epi32(Q4_OFFSET * xsum[m * G + g]);
            __m256 s = _mm256_set1_ps(xs[m * G + g]);
            for (int j = 0; j < 4; j++) {
                float *yp = y + m * ldy + 8 * j;
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[m][j], c)), s);
                const float *sp = (j < 2 ? s0 : s1) + g * 16 + 8 * (j % 2);
                _mm256_storeu_ps(yp, _mm256_fmadd_ps(f, _mm256_loadu_ps(sp), _mm256_loadu_ps(yp)));
            }
        }
#else
        for (int m = 0; m < R; m++)
            for (int j = 0; j < 32; j++) {
                const uint8_t *wj = (j < 16 ? w0 : w1) + (j % 16) * 4;
                int32_t acc = 0;
                for (int64_t q = g * (QG / 8); q < (g + 1) * (QG / 8); q++)
                    for (int b = 0; b < 4; b++) {
                        int v = wj[q * 64 + b];
                        acc += (int32_t)xq[m * Kp + q * 8 + b] * ((v & 15) - Q4_OFFSET);
                        acc += (int32_t)xq[m * Kp + q * 8 + 4 + b] * ((v >> 4) - Q4_OFFSET);
                    }
                float f = (float)acc * xs[m * G + g];
                y[m * ldy + j] = __builtin_fmaf(f, (j < 16 ? s0 : s1)[g * 16 + j % 16], y[m * ldy + j]);
            }
#endif
    }
}

/* An int8-input GEMM (the int8 one, or the int4 head's proxy when int4): x [M, K] rounded into scratch (xq,
 * xs, xsum: spin_gemm_q8_scratch bytes), then every unit of 32 outputs and block of up to Q8_MR rows, with R
 * fixed at compile time in each case so the accumulators stay in registers. scale: per output (int8) or the
 * group scales (int4). */
static inline __attribute__((always_inline)) void q_gemm(const float *x, const uint8_t *wp, const float *scale,
                                                         float *y, int64_t M, int64_t Op, int64_t K, void *scratch,
                                                         int int4) {
    int64_t Kp = q8_padded(K), G = Kp / QG;
    int8_t *xq = (int8_t *)scratch;
    float *xs = (float *)(xq + M * Kp);
    int32_t *xsum = (int32_t *)(xs + M * G);
    q8_rows(x, M, K, xq, xs, xsum);
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < Op / 32; u++)
        for (int64_t m0 = 0; m0 < M; m0 += Q8_MR) {
            int r = M - m0 < Q8_MR ? (int)(M - m0) : Q8_MR;
            const int8_t *xr = xq + m0 * Kp;
            const float *sr = xs + m0 * G;
            const int32_t *cr = xsum + m0 * G;
            float *yr = y + m0 * Op + 32 * u;
            switch (r) {
#define Q_CASE(R)                                                    \
    case R:                                                          \
        if (int4)                                                    \
            q4_unit(xr, sr, cr, wp, scale, yr, Op, Kp, u, R);        \
        else                                                         \
            q8_unit(xr, sr, cr, wp, scale, yr, Op, Kp, u, R);        \
        break;
                Q_CASE(1)
#if Q8_MR >= 2
                Q_CASE(2)
#endif
#if Q8_MR >= 12
                Q_CASE(3) Q_CASE(4) Q_CASE(5) Q_CASE(6) Q_CASE(7) Q_CASE(8) Q_CASE(9) Q_CASE(10) Q_CASE(11) Q_CASE(12)
#endif
#undef Q_CASE
            }
        }
}

/* y [M, Op] float32 = the int8 GEMM of x [M, K] float32 and q packed by spin_gemm_pack_q8 (see above), scale
 * [Op]; scratch of spin_gemm_q8_scratch(M, K) bytes. */
void spin_gemm_q8(const float *x, const uint8_t *wp, const float *scale, float *y, int64_t M, int64_t Op, int64_t K,
                  void *scratch) {
    q_gemm(x, wp, scale, y, M, Op, K, scratch, 0);
}

/* 1 where one of the 16 floats at r is above t. */
static inline int any_above16(const float *r, float t) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(r), _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
    __m256 tt = _mm256_set1_ps(t);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(r), tt, _CMP_GT_OQ),
                                           _mm256_cmp_ps(_mm256_loadu_ps(r + 8), tt, _CMP_GT_OQ))) != 0;
#else
    int any = 0;
    for (int i = 0; i < 16; i++) any |= r[i] > t;
    return any;
#endif
}

/* The indices of the k largest of r [V], largest first (ties: the lower index first), into id [k]; k <= 64
 * and k <= V. Once k are held, blocks of 16 with none above the k-th are skipped whole. */
static void top_k(const float *r, int64_t V, int64_t k, int64_t *id) {
    float val[64];
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) {
        if (n == k && i % 16 == 0 && i + 16 <= V && !any_above16(r + i, val[k - 1])) {
            i += 15;
            continue;
        }
        float v = r[i];
        if (n == k && !(v > val[k - 1])) continue;
        int64_t p = n < k ? n++ : k - 1; /* insertion: the last entry drops out when full */
        while (p > 0 && v > val[p - 1]) {
            val[p] = val[p - 1];
            id[p] = id[p - 1];
            p--;
        }
        val[p] = v;
        id[p] = i;
    }
}

/* The index of the first maximum of r [V], a NaN counting as above every number (torch.argmax's rule). */
static int64_t argmax1(const float *r, int64_t V) {
    float m = -__builtin_inff();
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= V; i += 16) {
        __m512 v = _mm512_loadu_ps(r + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        mv = _mm512_max_ps(mv, v);
    }
    m = _mm512_reduce_max_ps(mv);
#elif defined(__AVX2__)
    __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_loadu_ps(r + i);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
        mv = _mm256_max_ps(mv, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < V; i++) {
        nan |= r[i] != r[i];
        m = r[i] > m ? r[i] : m;
    }
    i = 0;
#if defined(__AVX512F__)
    for (__m512 mm = _mm512_set1_ps(m); !nan && i + 16 <= V; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), mm, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    for (__m256 mm = _mm256_set1_ps(m); !nan && i + 8 <= V; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), mm, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < V; i++) /* the first index holding it (or the first NaN) */
        if (nan ? r[i] != r[i] : r[i] == m) return i;
    return 0;
}

/* out [M] = per row of y [M, ldy] the index of its first maximum among the first V (see argmax1). */
void spin_argmax_rows(const float *y, int64_t M, int64_t V, int64_t ldy, int64_t *out) {
#pragma omp parallel for schedule(static) if (M >= 4)
    for (int64_t m = 0; m < M; m++) out[m] = argmax1(y + m * ldy, V);
}

/* An int8 copy's LM head (quantize.py, RescoredHead): y [M, Op] = the int4 proxy logits of x [M, K] (wp4, ws
 * packed by spin_gemm_pack_q4), then, per row, the k ids with the largest proxy logits among the first V get
 * the int8 head's logit instead: q8 [V, K] int8 row-major with scale8 [V], computed as spin_gemm_q8 computes it
 * (the same rounding, sums and order), so those entries equal that GEMM's output bit for bit. idx [M, k] gets the
 * rescored ids. scratch: spin_gemm_q8_scratch(M, K) bytes. A row's result does not depend on the others. */
void spin_head_q4(const float *x, const uint8_t *wp4, const float *ws, const int8_t *q8, const float *scale8,
                  float *y, int64_t *idx, int64_t M, int64_t Op, int64_t K, int64_t V, int64_t k, void *scratch) {
    int64_t Kp = q8_padded(K), G = Kp / QG;
    q_gemm(x, wp4, ws, y, M, Op, K, scratch, 1);
    const int8_t *xq = (const int8_t *)scratch; /* x as q_gemm rounded it */
    const float *xs = (const float *)(xq + M * Kp);
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        top_k(y + m * Op, V, k, idx + m * k);
        for (int64_t t = 0; t < k; t++) {
            int64_t o = idx[m * k + t];
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t isum = 0;
                for (int64_t i = g * QG; i < (g + 1) * QG && i < K; i++) isum += (int32_t)xq[m * Kp + i] * q8[o * K + i];
                acc = __builtin_fmaf((float)isum, xs[m * G + g], acc);
            }
            y[m * Op + o] = acc * scale8[o];
        }
    }
}

static inline uint16_t to_bf16(float f);

static inline float bf16_to_float(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
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
#include <immintrin.h>
#include <string.h>
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

/* 1: this build has a bfloat16 GEMM (every build now: vdpbf16ps where the CPU has it, else widening). */
int spin_gemm_bf16_ok(void) { return 1; }

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

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t b;
    __builtin_memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

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

/* Everything below works on vectors of the build's register width (vw: 16 floats with AVX-512, else 8):
 * without AVX-512, GCC spills 64-byte vectors through memory and turns their compares into scalar code
 * (a 4-6x slower attention with AVX2). A lane's sums run in a fixed order in either width, so a row's
 * result never depends on its batch; the two widths may round differently from each other. */

/* out [N, C] (weights' dtype) = rms_norm(h [N, C] float32) * w */
static void norm_rows(const float *h, const float *w, void *out, int64_t N, int64_t C, float eps, int es) {
#pragma omp parallel for schedule(static) if (N >= 16)
    for (int64_t m = 0; m < N; m++) {
        const float *xr = h + m * C;
        vw acc = (vw){0};
        int64_t c = 0;
        for (; c + VW <= C; c += VW) {
            vw v = *(const vw *)(xr + c);
            acc += v * v;
        }
        float ss = 0.0f;
        for (int k = 0; k < VW; k++) ss += acc[k];
        for (; c < C; c++) ss += xr[c] * xr[c];
        float r = 1.0f / __builtin_sqrtf(ss / (float)C + eps);
        for (c = 0; c < C; c++) store1(out, m * C + c, (xr[c] * r) * w[c], es);
    }
}

/* y [M, C] = x * (1 / sqrt(mean(x^2) + eps)) * w per row, float32: one call instead of torch's
 * half-dozen ops, which cost 17-77 us a call at the loop's sizes. */
void spin_rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    norm_rows(x, w, y, M, C, eps, 4);
}

/* ---- Attention over the per-slot KV cache, one layer, every row of a packed forward ----------------
 *
 * Row i (slot s, absolute position p) first has its new K/V written at (s, p); then each of its H query
 * heads attends to its slot's keys 0..p: softmax(q k^T / sqrt(D)) v, the softmax over blocks of keys with
 * a running maximum (one pass over the keys). A (rows, KV head) task owns its G = H / KV query heads, so
 * it reads each key and value once. Every row is computed alone, the keys in order, the same way
 * whatever segment, batch or prefill chunk it arrives in: a decode step, a verify run and a prefill
 * give bitwise the same output for the same row and cache. Storage is float32 or bfloat16 (ES 4 or 2),
 * arithmetic float32; D a multiple of 16, at most 256. */

typedef int32_t perm16 __attribute__((vector_size(64)));
typedef int32_t perm8 __attribute__((vector_size(32)));

/* A key's dot-product lanes folded to 8: with 16 lanes, j + j^8. */
static inline v8 fold8(vw d) {
#if VW == 16
    return __builtin_shufflevector(d, d, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(d, d, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return d;
#endif
}

/* dst[t] = the sum of a[t]'s 8 lanes, for t < 16, by a transposing tree of shuffles and adds: every key's
 * lanes are added in the same order (j + j^4, then j^2, then j^1), wherever it sits in the block. */
#if VW == 16
static inline void reduce16(float *dst, const v8 a[16]) { /* with 16-lane shuffles: one instruction each */
    v16 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < 4; i++)
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], (perm16){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
               __builtin_shuffle(c[2 * i], c[2 * i + 1], (perm16){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shuffle(d[2 * i], d[2 * i + 1], (perm16){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
               __builtin_shuffle(d[2 * i], d[2 * i + 1], (perm16){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    v16 f = __builtin_shuffle(e[0], e[1], (perm16){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
            __builtin_shuffle(e[0], e[1], (perm16){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
    /* lane L of f holds key bitreverse4(L) */
    v16 r = __builtin_shuffle(f, (perm16){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
    __builtin_memcpy(dst, &r, 64);
}
#else
static inline v8 reduce8(const v8 *a) { /* keys 0..7 -> lanes 0..7, by 8-lane shuffles (AVX2: one each) */
    v8 b[4], c[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: key 2i's j + j^4; lanes 4-7: key 2i + 1's */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], (perm8){0, 1, 2, 3, 8, 9, 10, 11}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1], (perm8){4, 5, 6, 7, 12, 13, 14, 15});
    for (int i = 0; i < 2; i++) /* then + j^2: keys 4i, 4i + 2, 4i + 1, 4i + 3, two lanes each */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], (perm8){0, 1, 8, 9, 4, 5, 12, 13}) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1], (perm8){2, 3, 10, 11, 6, 7, 14, 15});
    v8 d = __builtin_shuffle(c[0], c[1], (perm8){0, 2, 8, 10, 4, 6, 12, 14}) + /* then + j^1 */
           __builtin_shuffle(c[0], c[1], (perm8){1, 3, 9, 11, 5, 7, 13, 15});
    return __builtin_shuffle(d, (perm8){0, 4, 1, 5, 2, 6, 3, 7}); /* d holds keys 0, 2, 4, 6, 1, 3, 5, 7 */
}

static inline void reduce16(float *dst, const v8 a[16]) {
    v8 lo = reduce8(a), hi = reduce8(a + 8);
    __builtin_memcpy(dst, &lo, 32);
    __builtin_memcpy(dst + 8, &hi, 32);
}
#endif

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

#define KEY_BLOCK 64
#if VW == 16
static const vw LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define QB 4   /* queries whose value sums share each value load */
#define DCH 16 /* vectors of a query's sum held in registers at once: all of them (D <= 256) */
#else
static const vw LANES = {0, 1, 2, 3, 4, 5, 6, 7};
#define QB 2
#define DCH 4 /* 2 queries x 4 vectors + 4 value vectors of the 16 ymm registers */
#endif
#define MAX_Q 16 /* query vectors per task: rows of one slot times the G query heads of one KV head */
#define MAX_V (256 / VW) /* vectors of the largest head */

/* Rows of one slot (positions pos[r]), the G query heads of one KV head: they share every key and value
 * load. Each query's keys, blocks, sums and their order are those it would have alone.
 * tail (a token-tree row; nr is 1): the query's keys are cache rows 0..base-1 then tail[0..pos - base], its
 * root-to-itself path, read in that order as keys base..pos: the very arithmetic of a row at position pos
 * whose cache holds that path in place (the row autoregressive decoding would compute). NULL: rows 0..pos. */
#define KEY_ROW(t) (tail && (t) >= base ? tail[(t) - base] : (t))
static inline __attribute__((always_inline)) void attend_rows(const char *q, int64_t q_rs, const char *kc, const char *vc, char *out, int64_t out_rs,
                        const int64_t *pos, int64_t nr, int64_t G, int64_t D, float scale, int es,
                        int64_t base, const int64_t *tail) {
    int64_t nv = D / VW, Q = nr * G, last = 0;
    vw qv[MAX_Q][MAX_V], acc[MAX_Q][MAX_V];
    float m[MAX_Q], s[MAX_Q][KEY_BLOCK];
    vw l[MAX_Q];
    int64_t qpos[MAX_Q];
    for (int64_t r = 0; r < nr; r++)
        for (int64_t g = 0; g < G; g++) {
            int64_t qi = r * G + g;
            for (int64_t j = 0; j < nv; j++) {
                qv[qi][j] = loadw(q + (r * q_rs + g * D + j * VW) * es, es) * scale;
                acc[qi][j] = (vw){0};
            }
            m[qi] = -__builtin_inff();
            l[qi] = (vw){0};
            qpos[qi] = pos[r];
            last = pos[r] > last ? pos[r] : last;
        }
    for (int64_t t0 = 0; t0 <= last; t0 += KEY_BLOCK) {
        int64_t n = last + 1 - t0 < KEY_BLOCK ? last + 1 - t0 : KEY_BLOCK;
        for (int64_t t = 0; t < n; t += 16) { /* scores of 16 keys at a time */
            v8 part[MAX_Q][16];
            for (int64_t u = 0; u < 16; u++) {
                vw kv[MAX_V];
                int have = t + u < n;
                if (have)
                    for (int64_t j = 0; j < nv; j++) kv[j] = loadw(kc + (KEY_ROW(t0 + t + u) * D + j * VW) * es, es);
                for (int64_t qi = 0; qi < Q; qi++) {
                    if (!have || t0 + t + u > qpos[qi]) { /* past the query's last key: zeros, never read */
                        part[qi][u] = (v8){0};
                        continue;
                    }
                    vw d = qv[qi][0] * kv[0];
                    for (int64_t j = 1; j < nv; j++) d += qv[qi][j] * kv[j];
                    part[qi][u] = fold8(d);
                }
            }
            for (int64_t qi = 0; qi < Q; qi++)
                if (t0 + t <= qpos[qi]) reduce16(&s[qi][t], part[qi]);
        }
        for (int64_t qi = 0; qi < Q; qi++) {
            int64_t nq = qpos[qi] + 1 - t0 < n ? qpos[qi] + 1 - t0 : n; /* the query's keys in this block */
            if (nq <= 0) continue;
            vw mx = (vw){0} - __builtin_inff(); /* the block's maximum, VW lanes at a time (max is exact) */
            for (int64_t t = 0; t < nq; t += VW) {
                vw x = *(const vw *)&s[qi][t];
                iw take = (x > mx) & (LANES < (float)(nq - t));
                mx = (vw)(((iw)x & take) | ((iw)mx & ~take));
            }
            float bm = m[qi];
            for (int j = 0; j < VW; j++) bm = mx[j] > bm ? mx[j] : bm;
            if (bm > m[qi]) { /* rescale what the earlier blocks summed */
                float f = m[qi] == -__builtin_inff() ? 0.0f : expw((vw){0} + (m[qi] - bm))[0];
                l[qi] *= f;
                for (int64_t j = 0; j < nv; j++) acc[qi][j] *= f;
                m[qi] = bm;
            }
            for (int64_t t = 0; t < nq; t += VW) { /* p = e^(s - max); lanes past the last key give exactly 0 */
                iw in = LANES < (float)(nq - t);
                vw x = (vw)(((iw)(*(const vw *)&s[qi][t] - bm) & in) | ((iw)((vw){0} - 1000.0f) & ~in));
                vw e = expw(x);
                __builtin_memcpy(&s[qi][t], &e, sizeof e);
                l[qi] += e; /* lane j sums keys j, j + VW, ... in order */
            }
        }
        for (int64_t q0 = 0; q0 < Q; q0 += QB) /* QB queries' sums, DCH vectors at a time, in registers */
            for (int64_t j0 = 0; j0 < nv; j0 += DCH) {
                int64_t qn = Q - q0 < QB ? Q - q0 : QB, jn = nv - j0 < DCH ? nv - j0 : DCH;
                vw a[QB][DCH];
                for (int64_t qq = 0; qq < qn; qq++)
                    for (int64_t j = 0; j < jn; j++) a[qq][j] = acc[q0 + qq][j0 + j];
                for (int64_t t = 0; t < n; t++) {
                    vw vv[DCH];
                    for (int64_t j = 0; j < jn; j++) vv[j] = loadw(vc + (KEY_ROW(t0 + t) * D + (j0 + j) * VW) * es, es);
                    for (int64_t qq = 0; qq < qn; qq++) {
                        if (t0 + t > qpos[q0 + qq]) continue;
                        float p = s[q0 + qq][t];
                        for (int64_t j = 0; j < jn; j++) a[qq][j] += p * vv[j];
                    }
                }
                for (int64_t qq = 0; qq < qn; qq++)
                    for (int64_t j = 0; j < jn; j++) acc[q0 + qq][j0 + j] = a[qq][j];
            }
    }
    for (int64_t qi = 0; qi < Q; qi++) {
        float sum = 0.0f;
        for (int j = 0; j < VW; j++) sum += l[qi][j];
        float inv = 1.0f / sum;
        char *o_row = out + ((qi / G) * out_rs + (qi % G) * D) * es;
        for (int64_t j = 0; j < nv; j++) {
            vw o = acc[qi][j] * inv;
            if (es == 4) {
                __builtin_memcpy(o_row + j * VW * 4, &o, sizeof o);
            } else {
                uint16_t *ob = (uint16_t *)o_row + j * VW;
                for (int c = 0; c < VW; c++) ob[c] = to_bf16(o[c]);
            }
        }
    }
}

/* Copies of attend_rows with the head size and storage fixed at compile time (the common models), so its
 * loops unroll and its loads do not branch; the same arithmetic in the same order as the generic one. */
#define ATTEND_FIXED(NAME, DD, ES)                                                                            \
    static void NAME(const char *q, int64_t q_rs, const char *kc, const char *vc, char *out, int64_t out_rs,  \
                     const int64_t *pos, int64_t nr, int64_t G, float scale) {                                \
        attend_rows(q, q_rs, kc, vc, out, out_rs, pos, nr, G, DD, scale, ES, 0, (const int64_t *)0);          \
    }                                                                                                         \
    static void NAME##_tree(const char *q, int64_t q_rs, const char *kc, const char *vc, char *out,           \
                            int64_t out_rs, const int64_t *pos, int64_t G, float scale, int64_t base,         \
                            const int64_t *tail) {                                                            \
        attend_rows(q, q_rs, kc, vc, out, out_rs, pos, 1, G, DD, scale, ES, base, tail);                      \
    }
ATTEND_FIXED(attend_64_f32, 64, 4)
ATTEND_FIXED(attend_64_bf16, 64, 2)
ATTEND_FIXED(attend_128_f32, 128, 4)
ATTEND_FIXED(attend_128_bf16, 128, 2)

static void attend_any(const char *q, int64_t q_rs, const char *kc, const char *vc, char *out, int64_t out_rs,
                       const int64_t *pos, int64_t nr, int64_t G, int64_t D, float scale, int es) {
    if (D == 64 && es == 4) attend_64_f32(q, q_rs, kc, vc, out, out_rs, pos, nr, G, scale);
    else if (D == 64) attend_64_bf16(q, q_rs, kc, vc, out, out_rs, pos, nr, G, scale);
    else if (D == 128 && es == 4) attend_128_f32(q, q_rs, kc, vc, out, out_rs, pos, nr, G, scale);
    else if (D == 128) attend_128_bf16(q, q_rs, kc, vc, out, out_rs, pos, nr, G, scale);
    else attend_rows(q, q_rs, kc, vc, out, out_rs, pos, nr, G, D, scale, es, 0, (const int64_t *)0);
}

/* attend_any for one token-tree row (see attend_rows: base, tail). */
static void attend_any_tree(const char *q, int64_t q_rs, const char *kc, const char *vc, char *out, int64_t out_rs,
                            const int64_t *pos, int64_t G, int64_t D, float scale, int es, int64_t base,
                            const int64_t *tail) {
    if (D == 64 && es == 4) attend_64_f32_tree(q, q_rs, kc, vc, out, out_rs, pos, G, scale, base, tail);
    else if (D == 64) attend_64_bf16_tree(q, q_rs, kc, vc, out, out_rs, pos, G, scale, base, tail);
    else if (D == 128 && es == 4) attend_128_f32_tree(q, q_rs, kc, vc, out, out_rs, pos, G, scale, base, tail);
    else if (D == 128) attend_128_bf16_tree(q, q_rs, kc, vc, out, out_rs, pos, G, scale, base, tail);
    else attend_rows(q, q_rs, kc, vc, out, out_rs, pos, 1, G, D, scale, es, base, tail);
}

int spin_attention_max_head_dim(void) { return 256; }

/* ---- Token trees (opt-in: spin_attention_tree) -------------------------------------------------------
 *
 * A tree segment's token i sits at cache row cache_len + i (pos[i]) and attends rows [0, cache_len) plus
 * its ancestors and itself: anc[i] bit j is whether row cache_len + j is one of them (bit i, itself, is its
 * highest bit, since a parent precedes its children; so cache_len = pos[i] - i). anc[i] == 0 marks an
 * ordinary row, which attends keys 0..pos[i] as in spin_attention. A tree row runs alone, through
 * attend_rows with its path as the tail of its keys: the arithmetic of the same token decoded
 * autoregressively, bit for bit, so a token tree's accepted path is what a chain would have computed. */

/* spin_attention, and spin_attention_tree when anc is not NULL. */
static int attend_batch(const void *q, int64_t q_rs, const void *k_new, int64_t k_rs, const void *v_new, int64_t v_rs,
                     void *kc, void *vc, void *out, const int64_t *slot, const int64_t *pos, const uint64_t *anc,
                     int64_t N, int64_t H, int64_t KV, int64_t D, int64_t max_len, int es) {
    int64_t G = H / KV, head = max_len * D * es, slot_size = KV * head;
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < KV; h++) {
            int64_t at = slot[i] * slot_size + h * head + pos[i] * D * es;
            __builtin_memcpy((char *)kc + at, (const char *)k_new + (i * k_rs + h * D) * es, D * es);
            __builtin_memcpy((char *)vc + at, (const char *)v_new + (i * v_rs + h * D) * es, D * es);
        }
    /* tasks: runs of up to `per` consecutive rows of one slot (a decode token, a verify run, a piece of a
     * prefill chunk), times the KV heads; a task takes its G query heads, which share every key and value
     * load. Runs of MAX_Q / G rows share the most loads, but at one slot they make only KV tasks, so a
     * thread waits on another's second task; there a task takes one row (at one slot, G = 3, a 3-row
     * verify's attention over 600 keys went from 97 to 72 us a layer on 2 cores). A query's arithmetic
     * is the same in any split. A tree row is a run of its own. */
    int64_t *chunk = (int64_t *)__builtin_malloc((N + 1) * sizeof(int64_t));
    if (!chunk) return -1;
    int64_t nc = 0;
    for (int64_t per = MAX_Q / G;; per = 1) {
        nc = 0;
        for (int64_t i = 0; i < N; i++)
            if (i == 0 || slot[i] != slot[i - 1] || i - chunk[nc - 1] == per || (anc && (anc[i] || anc[i - 1])))
                chunk[nc++] = i;
        if (per == 1 || nc == N || nc * KV >= 4 * (int64_t)omp_get_max_threads()) break;
    }
    chunk[nc] = N;
    float scale = 1.0f / __builtin_sqrtf((float)D);
#pragma omp parallel for schedule(dynamic, 1) if (nc * KV > 1)
    for (int64_t task = 0; task < nc * KV; task++) {
        int64_t c = task / KV, h = task % KV, i = chunk[c], base = slot[i] * slot_size + h * head;
        const char *qi = (const char *)q + (i * q_rs + h * G * D) * es;
        char *oi = (char *)out + (i * H + h * G) * D * es;
        if (anc && anc[i]) {
            int64_t self = 63 - __builtin_clzll(anc[i]), root = pos[i] - self, path[64], n = 0;
            for (int64_t j = 0; j <= self; j++)
                if (anc[i] >> j & 1) path[n++] = root + j;
            int64_t last = root + n - 1; /* its position: the keys before the root, then its path */
            attend_any_tree(qi, q_rs, (const char *)kc + base, (const char *)vc + base, oi, H * D, &last, G, D,
                            scale, es, root, path);
        } else {
            attend_any(qi, q_rs, (const char *)kc + base, (const char *)vc + base, oi, H * D, pos + i,
                       chunk[c + 1] - i, G, D, scale, es);
        }
    }
    __builtin_free(chunk);
    return 0;
}

/* q [N, H, D] (row stride q_rs elements), k_new / v_new [N, KV, D] (row strides), kc / vc this layer's
 * cache [slots, KV, max_len, D], out [N, H, D] contiguous; slot / pos [N] per row. Returns 0, or -1 when
 * out of memory. */
int spin_attention(const void *q, int64_t q_rs, const void *k_new, int64_t k_rs, const void *v_new, int64_t v_rs,
                   void *kc, void *vc, void *out, const int64_t *slot, const int64_t *pos, int64_t N, int64_t H,
                   int64_t KV, int64_t D, int64_t max_len, int es) {
    return attend_batch(q, q_rs, k_new, k_rs, v_new, v_rs, kc, vc, out, slot, pos, (const uint64_t *)0, N, H, KV, D,
                     max_len, es);
}

/* spin_attention's arguments plus anc [N] (see above). Returns 0, or -1 when out of memory. */
int spin_attention_tree(const void *q, int64_t q_rs, const void *k_new, int64_t k_rs, const void *v_new, int64_t v_rs,
                        void *kc, void *vc, void *out, const int64_t *slot, const int64_t *pos, const uint64_t *anc,
                        int64_t N, int64_t H, int64_t KV, int64_t D, int64_t max_len, int es) {
    return attend_batch(q, q_rs, k_new, k_rs, v_new, v_rs, kc, vc, out, slot, pos, anc, N, H, KV, D, max_len, es);
}

/* ---- The decoder layers in one call ---------------------------------------------------------------
 *
 * For a forward on CPU, every layer's norm, QKV GEMM, rotary embedding, attention, output GEMM, residual
 * add, norm, gate/up GEMM, SiLU-times-up and down GEMM run here, one call for all layers, instead of a
 * dozen torch calls and four GEMM calls a layer from Python: at one slot that glue cost about as much
 * time as the attention and norms together. The arithmetic is the kernels' above; the residual stream h
 * stays float32, the GEMM inputs and outputs are in the weights' dtype (ES 4 float32, 2 bfloat16), and
 * each row is computed alone, so a row's result still does not depend on its batch. */

typedef struct {
    const float *attn_norm, *mlp_norm;          /* [C] float32 */
    const void *qkv, *o, *gate_up, *down;       /* packed by spin_gemm_pack, _bf16 or _q8 */
    const void *qkv_bias;                       /* [(H + 2 KV) D] in the weights' dtype, or NULL */
    const float *qkv_s, *o_s, *gate_up_s, *down_s; /* int8 weights (spin_gemm_pack_q8): the scales; else NULL */
} spin_layer_t;

typedef struct { /* the packed weights' padded output widths, the same in every layer */
    int64_t qkv, gate_up, out; /* out: of o and down (the hidden size, padded) */
} spin_widths_t;

static inline float load1(const void *p, int64_t i, int es) {
    if (es == 4) return ((const float *)p)[i];
    uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
}


static void gemm(const void *x, const void *wp, const float *scale, void *y, int64_t M, int64_t Op, int64_t K,
                 int es, void *q8_scratch) {
    if (scale) /* int8 weights, float32 rows (es 4) */
        spin_gemm_q8((const float *)x, (const uint8_t *)wp, scale, (float *)y, M, Op, K, q8_scratch);
    else if (es == 4)
        spin_gemm((const float *)x, (const float *)wp, (float *)y, M, Op, K);
    else
        spin_gemm_bf16((const uint16_t *)x, (const uint16_t *)wp, (uint16_t *)y, M, Op, K);
}

#define ALIGN64(n) (((n) + 63) / 64 * 64)

/* Bytes of scratch spin_decoder needs: the rows of each stage, then the int8 GEMM's (int8 weights). */
int64_t spin_decoder_scratch(int64_t N, int64_t C, int64_t H, int64_t D, int64_t I, const spin_widths_t *w, int es) {
    int64_t widest = C > I ? C : I, k = widest > H * D ? widest : H * D;
    return ALIGN64(N * (widest + w->qkv + H * D + w->gate_up + w->out) * es) + spin_gemm_q8_scratch(N, k);
}

/* h [N, C] += y [N, Cp] (the weights' dtype; its first C columns) */
static inline void add_rows(float *h, const void *y, int64_t N, int64_t C, int64_t Cp, int es) {
    for (int64_t m = 0; m < N; m++)
        for (int64_t c = 0; c < C; c++) h[m * C + c] += load1(y, m * Cp + c, es);
}

/* h [N, C] float32 residual, updated in place through layers 0..L-1; slot / pos [N]; cos / sin_signed
 * [N, D] float32 per row (see apply_rope in llama.py); cache_k / cache_v [layers, slots, KV, max_len, D]
 * with layer_bytes between layers; scratch of spin_decoder_scratch(...) bytes. Returns 0, or -1 when out
 * of memory. */
static inline __attribute__((always_inline)) int decoder(float *h, int64_t N, const spin_layer_t *layers, int64_t L, const int64_t *slot,
                 const int64_t *pos, const float *cos, const float *sin_signed, int64_t C, int64_t H, int64_t KV,
                 int64_t D, int64_t I, const spin_widths_t *w, int64_t max_len, float eps, int es, char *cache_k,
                 char *cache_v, int64_t layer_bytes, char *scratch, const uint64_t *anc) {
    int64_t QKV = (H + 2 * KV) * D, half = D / 2, widest = C > I ? C : I;
    int64_t qkv_w = w->qkv, gu_w = w->gate_up, Cp = w->out;
    void *xn = scratch;                                     /* [N, max(C, I)] norm output, SiLU output */
    void *qkv = (char *)xn + N * widest * es;               /* [N, qkv_w] */
    void *att = (char *)qkv + N * qkv_w * es;               /* [N, H D] */
    void *gu = (char *)att + N * H * D * es;                /* [N, gu_w] */
    void *y = (char *)gu + N * gu_w * es;                   /* [N, Cp] */
    void *q8 = scratch + ALIGN64(N * (widest + qkv_w + H * D + gu_w + Cp) * es); /* the int8 GEMM's */
    for (int64_t li = 0; li < L; li++) {
        const spin_layer_t *lw = &layers[li];
        norm_rows(h, lw->attn_norm, xn, N, C, eps, es);
        gemm(xn, lw->qkv, lw->qkv_s, qkv, N, qkv_w, C, es, q8);
#pragma omp parallel for schedule(static) if (N >= 16)
        for (int64_t m = 0; m < N; m++) { /* bias, then rotary embedding of the H + KV q/k heads */
            float x[256];
            if (lw->qkv_bias)
                for (int64_t c = 0; c < QKV; c++)
                    store1(qkv, m * qkv_w + c, load1(qkv, m * qkv_w + c, es) + load1(lw->qkv_bias, c, es), es);
            const float *cs = cos + m * D, *sn = sin_signed + m * D;
            for (int64_t hd = 0; hd < H + KV; hd++) {
                int64_t at = m * qkv_w + hd * D;
                for (int64_t d = 0; d < D; d++) x[d] = load1(qkv, at + d, es);
                for (int64_t d = 0; d < D; d++)
                    store1(qkv, at + d, x[d] * cs[d] + x[d < half ? d + half : d - half] * sn[d], es);
            }
        }
        char *ck = cache_k + li * layer_bytes, *cv = cache_v + li * layer_bytes;
        if (anc ? spin_attention_tree((char *)qkv, qkv_w, (char *)qkv + H * D * es, qkv_w, (char *)qkv + (H + KV) * D * es,
                                      qkv_w, ck, cv, att, slot, pos, anc, N, H, KV, D, max_len, es)
                : spin_attention((char *)qkv, qkv_w, (char *)qkv + H * D * es, qkv_w, (char *)qkv + (H + KV) * D * es,
                                 qkv_w, ck, cv, att, slot, pos, N, H, KV, D, max_len, es))
            return -1;
        gemm(att, lw->o, lw->o_s, y, N, Cp, H * D, es, q8);
        add_rows(h, y, N, C, Cp, es);
        norm_rows(h, lw->mlp_norm, xn, N, C, eps, es);
        gemm(xn, lw->gate_up, lw->gate_up_s, gu, N, gu_w, C, es, q8);
#pragma omp parallel for schedule(static) if (N >= 16)
        for (int64_t m = 0; m < N; m++) /* silu(gate) * up; silu(g) = g / (1 + e^-g), e^-|g| never overflows */
            for (int64_t c0 = 0; c0 < I; c0 += VW) {
                vw g, u;
                int64_t n = I - c0 < VW ? I - c0 : VW;
                if (n == VW) { /* whole vectors (I is a multiple of 16 in the common models) */
                    g = loadw((const char *)gu + (m * gu_w + c0) * es, es);
                    u = loadw((const char *)gu + (m * gu_w + I + c0) * es, es);
                } else
                    for (int j = 0; j < VW; j++) {
                        g[j] = j < n ? load1(gu, m * gu_w + c0 + j, es) : 0.0f;
                        u[j] = j < n ? load1(gu, m * gu_w + I + c0 + j, es) : 0.0f;
                    }
                iw neg = g < 0;
                vw e = expw((vw)((iw)g | ((iw){0} + INT32_MIN))); /* e^-|g| */
                vw num = (vw)(((iw)g & ~neg) | ((iw)(g * e) & neg));
                vw r = num / (1.0f + e) * u;
                if (n == VW && es == 4)
                    __builtin_memcpy((float *)xn + m * I + c0, &r, sizeof r);
                else
                    for (int j = 0; j < n; j++) store1(xn, m * I + c0 + j, r[j], es);
            }
        gemm(xn, lw->down, lw->down_s, y, N, Cp, I, es, q8);
        add_rows(h, y, N, C, Cp, es);
    }
    return 0;
}

/* The storage size fixed at compile time in each copy, so the per-element loads and stores do not branch. */
int spin_decoder(float *h, int64_t N, const spin_layer_t *layers, int64_t L, const int64_t *slot,
                 const int64_t *pos, const float *cos, const float *sin_signed, int64_t C, int64_t H, int64_t KV,
                 int64_t D, int64_t I, const spin_widths_t *w, int64_t max_len, float eps, int es, char *cache_k,
                 char *cache_v, int64_t layer_bytes, char *scratch) {
    if (es == 4)
        return decoder(h, N, layers, L, slot, pos, cos, sin_signed, C, H, KV, D, I, w, max_len, eps, 4, cache_k,
                       cache_v, layer_bytes, scratch, (const uint64_t *)0);
    return decoder(h, N, layers, L, slot, pos, cos, sin_signed, C, H, KV, D, I, w, max_len, eps, 2, cache_k, cache_v,
                   layer_bytes, scratch, (const uint64_t *)0);
}

/* spin_decoder with token trees: pos [N] is each row's cache row (cos / sin_signed are already at the
 * rows' RoPE positions), anc [N] as in spin_attention_tree. Apart from the tree rows, the same arithmetic. */
int spin_decoder_tree(float *h, int64_t N, const spin_layer_t *layers, int64_t L, const int64_t *slot,
                      const int64_t *pos, const float *cos, const float *sin_signed, int64_t C, int64_t H, int64_t KV,
                      int64_t D, int64_t I, const spin_widths_t *w, int64_t max_len, float eps, int es, char *cache_k,
                      char *cache_v, int64_t layer_bytes, char *scratch, const uint64_t *anc) {
    return decoder(h, N, layers, L, slot, pos, cos, sin_signed, C, H, KV, D, I, w, max_len, eps, es, cache_k, cache_v,
                   layer_bytes, scratch, anc);
}
