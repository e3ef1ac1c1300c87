/* Float32 y = x @ w^T on CPU for the decode loop's batch sizes, built once per machine by cpu_gemm.py.
 *
 * w is stored in panels of 16 output rows, k-major inside a panel: wp[o / 16][k][o % 16]. One call
 * streams every panel once. A micro-kernel takes two panels (32 outputs) and up to MR rows of x,
 * broadcasts x[m, k] and adds it times the panels' k-th vectors into 2 x MR vector accumulators, so
 * a weight is read from memory once per call for any M <= MR and once from cache per further MR rows.
 *
 * Each output y[m, o] is the sum over k, in order, of x[m, k] * w[o, k] in a single vector lane: no
 * blocking over k and no horizontal sum. So a row's result does not depend on M or on which other
 * rows share the call: a decode step (M = 1) and a verify run (M = 1 + gamma) give bitwise the same
 * outputs for the same input row. Output panels are split across OpenMP threads (the runtime torch loaded).
 */
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#ifdef __AVX512F__
#define MR 12 /* 24 accumulators + 2 panel vectors of the 32 zmm registers */
#else
#define MR 3 /* narrower vectors: a v16 is 2 (AVX2) or 4 (NEON) registers */
#endif

#define MICRO(R)                                                                                         \
    static void micro_##R(const float *x, const float *wp, float *y, int64_t K, int64_t O, int64_t pair) { \
        const float *w0 = wp + 2 * pair * K * 16, *w1 = w0 + K * 16;                                      \
        v16 a0[R], a1[R];                                                                                \
        for (int m = 0; m < R; m++) {                                                                    \
            a0[m] = (v16){0};                                                                            \
            a1[m] = (v16){0};                                                                            \
        }                                                                                                \
        for (int64_t k = 0; k < K; k++) {                                                                \
            v16 u = *(const v16 *)(w0 + k * 16), v = *(const v16 *)(w1 + k * 16);                        \
            for (int m = 0; m < R; m++) {                                                                \
                float s = x[m * K + k];                                                                  \
                a0[m] += s * u;                                                                          \
                a1[m] += s * v;                                                                          \
            }                                                                                            \
        }                                                                                                \
        for (int m = 0; m < R; m++) {                                                                    \
            *(v16 *)(y + m * O + 32 * pair) = a0[m];                                                     \
            *(v16 *)(y + m * O + 32 * pair + 16) = a1[m];                                                \
        }                                                                                                \
    }

MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6) MICRO(7) MICRO(8) MICRO(9) MICRO(10) MICRO(11) MICRO(12)

typedef void (*micro_t)(const float *, const float *, float *, int64_t, int64_t, int64_t);
static const micro_t MICROS[13] = {0,       micro_1, micro_2, micro_3, micro_4,  micro_5, micro_6,
                                   micro_7, micro_8, micro_9, micro_10, micro_11, micro_12};

int spin_gemm_version(void) { return 2; }

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
    int64_t pairs = Op / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int64_t r = M - m0 < MR ? M - m0 : MR;
            MICROS[r](x + m0 * K, wp, y + m0 * Op, K, Op, p);
        }
}

/* Bfloat16 y = x @ w^T, float32 accumulation, where the CPU has AVX512-BF16 (vdpbf16ps); elsewhere
 * spin_gemm_bf16_ok() returns 0 and the caller keeps oneDNN.
 *
 * w is stored in panels of 16 output rows by pairs of k: wp[o / 16][k / 2][o % 16][k % 2], so one
 * 64-byte vector holds 16 outputs' weights for inputs k and k + 1. The micro-kernel broadcasts the pair
 * (x[m, k], x[m, k + 1]) as one 32-bit lane and vdpbf16ps adds both products into each output's float32
 * accumulator: 32 multiply-adds per instruction and no conversion of the weights, which stream at half
 * the bytes of float32. As in the float32 kernel, a row's sum runs over k in order in one lane, so its
 * result does not depend on M or on the other rows of the call. The float32 sums are rounded to
 * bfloat16 once, to nearest even (as torch rounds). K must be even. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <string.h>

#define MICRO_BF16(R)                                                                                    \
    static void microb_##R(const uint16_t *x, const uint16_t *wp, uint16_t *y, int64_t K, int64_t O,      \
                           int64_t pair) {                                                               \
        int64_t K2 = K / 2;                                                                              \
        const uint16_t *w0 = wp + 2 * pair * K * 16, *w1 = w0 + K * 16;                                  \
        __m512 a0[R], a1[R];                                                                             \
        for (int m = 0; m < R; m++) a0[m] = a1[m] = _mm512_setzero_ps();                                 \
        for (int64_t j = 0; j < K2; j++) {                                                               \
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

MICRO_BF16(1) MICRO_BF16(2) MICRO_BF16(3) MICRO_BF16(4) MICRO_BF16(5) MICRO_BF16(6) MICRO_BF16(7)
MICRO_BF16(8) MICRO_BF16(9) MICRO_BF16(10) MICRO_BF16(11) MICRO_BF16(12)

typedef void (*microb_t)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);
static const microb_t MICROS_BF16[13] = {0,        microb_1, microb_2, microb_3,  microb_4,  microb_5, microb_6,
                                         microb_7, microb_8, microb_9, microb_10, microb_11, microb_12};

int spin_gemm_bf16_ok(void) { return 1; }

/* y [M, Op] = x [M, K] @ w^T, all bfloat16 (as uint16), w packed by spin_gemm_pack_bf16. */
void spin_gemm_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *y, int64_t M, int64_t Op, int64_t K) {
    int64_t pairs = Op / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t m0 = 0; m0 < M; m0 += 12) {
            int64_t r = M - m0 < 12 ? M - m0 : 12;
            MICROS_BF16[r](x + m0 * K, wp, y + m0 * Op, K, Op, p);
        }
}
#else
int spin_gemm_bf16_ok(void) { return 0; }
void spin_gemm_bf16(const uint16_t *x, const uint16_t *wp, uint16_t *y, int64_t M, int64_t Op, int64_t K) {
    (void)x, (void)wp, (void)y, (void)M, (void)Op, (void)K;
}
#endif

/* w [O, K] bfloat16 row-major -> wp [Op / 16][K / 2][16][2], Op a multiple of 32 >= O, K even. */
void spin_gemm_pack_bf16(const uint16_t *w, uint16_t *wp, int64_t O, int64_t K, int64_t Op) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < Op / 16; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < 16; j++) {
                int64_t o = p * 16 + j;
                wp[((p * (K / 2) + k / 2) * 16 + j) * 2 + k % 2] = o < O ? w[o * K + k] : 0;
            }
}

/* y [M, C] = x * (1 / sqrt(mean(x^2) + eps)) * w per row, float32: one call instead of torch's
 * half-dozen ops, which cost 17-77 us a call at the loop's sizes. No threads: a row is 2-6 KB. */
void spin_rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * C;
        float *yr = y + m * C;
        v16 acc = (v16){0};
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
            v16 v = *(const v16 *)(xr + c);
            acc += v * v;
        }
        float ss = 0.0f;
        for (int k = 0; k < 16; k++) ss += acc[k];
        for (; c < C; c++) ss += xr[c] * xr[c];
        float r = 1.0f / __builtin_sqrtf(ss / (float)C + eps);
        for (c = 0; c < C; c++) yr[c] = (xr[c] * r) * w[c];
    }
}
