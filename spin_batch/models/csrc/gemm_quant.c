#include "common.h"

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
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define Q8_KIND "avx512_vnni"
#define Q8_OFFSET 128
#define Q8_MR 8 /* 16 accumulators, 2 weight vectors and the broadcasts fit the 32 registers; 12 rows spill */
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
#if Q8_MR >= 8
                Q_CASE(3) Q_CASE(4) Q_CASE(5) Q_CASE(6) Q_CASE(7) Q_CASE(8)
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
