/* The decode loop's CPU kernels, built once per kind of machine by cpu_gemm.py: float32 and bfloat16 panel
 * GEMMs, the RMS norm, attention over the per-slot KV cache, and spin_decoder (all decoder layers of a
 * forward in one call). Every result of a row is computed alone, in a fixed order (see each part).
 *
 * Float32 y = x @ w^T for the decode loop's batch sizes.
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
 *
 * Both panels of a pair are software-prefetched PF k-steps (4 KB) ahead. Without it the weight stream
 * and the multiply-adds did not overlap: each extra row cost its full compute time on top of the memory
 * time (the float32 decoder linears, 30 layers of gate_up and down on a 2-core AVX-512 CPU: 12.1 ms at
 * one row, 14.4 at five, 20.4 at sixteen; with the prefetch 12.1, 13.0 and 16.8; bfloat16 at five rows
 * 11.2 -> 7.3 ms). That extra-row cost is what a verify run pays over a decode step.
 */
#include <stdint.h>
#include <limits.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#ifdef __AVX512F__
#define MR 12 /* 24 accumulators + 2 panel vectors of the 32 zmm registers */
#else
#define MR 3 /* narrower vectors: a v16 is 2 (AVX2) or 4 (NEON) registers */
#endif

#define PF 64 /* prefetch distance in k-steps: 64 bytes of each panel per step */
#define MICRO(R)                                                                                         \
    static void micro_##R(const float *x, const float *wp, float *y, int64_t K, int64_t O, int64_t pair) { \
        const float *w0 = wp + 2 * pair * K * 16, *w1 = w0 + K * 16;                                      \
        v16 a0[R], a1[R];                                                                                \
        for (int m = 0; m < R; m++) {                                                                    \
            a0[m] = (v16){0};                                                                            \
            a1[m] = (v16){0};                                                                            \
        }                                                                                                \
        for (int64_t k = 0; k < K; k++) {                                                                \
            __builtin_prefetch(w0 + (k + PF) * 16, 0, 3);                                                \
            __builtin_prefetch(w1 + (k + PF) * 16, 0, 3);                                                \
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


/* out [N, C] (weights' dtype) = rms_norm(h [N, C] float32) * w */
static void norm_rows(const float *h, const float *w, void *out, int64_t N, int64_t C, float eps, int es) {
#pragma omp parallel for schedule(static) if (N >= 16)
    for (int64_t m = 0; m < N; m++) {
        const float *xr = h + m * C;
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

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline v16 load16(const void *p, int es) {
    if (es == 4) return *(const v16 *)p;
    u32x16 w = __builtin_convertvector(*(const u16x16 *)p, u32x16) << 16;
    return (v16)w;
}


typedef int32_t perm16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

static inline v8 fold8(v16 d) { /* lanes j + j^8 */
    return __builtin_shufflevector(d, d, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(d, d, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* r[t] = the sum of a[t]'s 16 lanes, for t < 16, by a transposing tree of shuffles and adds: every key's
 * lanes are added in the same order (j + j^8, then j^4, j^2, j^1), wherever it sits in the block. */
static inline v16 reduce16(const v8 a[16]) { /* a[t]: key t's 16 lanes already folded to 8 (j + j^8) */
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
    return __builtin_shuffle(f, (perm16){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}

/* e^x for x <= 0, to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor
 * polynomial, 2^n put into the exponent bits. Below -87 it returns 0. */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.0f;
    i32x16 under = x < lo;
    x = (v16)((i32x16)x & ~under) + (v16)((i32x16)lo & under);
    v16 t = x * 1.44269504088896341f + 12582912.0f; /* round to nearest integer, in the low bits */
    v16 n = t - 12582912.0f;
    v16 r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    v16 p = (v16){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
    return (v16)((i32x16)(p * (v16)e) & ~under);
}

#define KEY_BLOCK 64
static const v16 LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define MAX_Q 16 /* query vectors per task: rows of one slot times the G query heads of one KV head */

/* Rows of one slot (positions pos[r]), the G query heads of one KV head: they share every key and value
 * load. Each query's keys, blocks, sums and their order are those it would have alone. */
static inline __attribute__((always_inline)) void attend_rows(const char *q, int64_t q_rs, const char *kc, const char *vc, char *out, int64_t out_rs,
                        const int64_t *pos, int64_t nr, int64_t G, int64_t D, float scale, int es) {
    int64_t nv = D / 16, Q = nr * G, last = 0;
    v16 qv[MAX_Q][16], acc[MAX_Q][16];
    float m[MAX_Q], s[MAX_Q][KEY_BLOCK];
    v16 l[MAX_Q];
    int64_t qpos[MAX_Q];
    for (int64_t r = 0; r < nr; r++)
        for (int64_t g = 0; g < G; g++) {
            int64_t qi = r * G + g;
            for (int64_t j = 0; j < nv; j++) {
                qv[qi][j] = load16(q + (r * q_rs + g * D + j * 16) * es, es) * scale;
                acc[qi][j] = (v16){0};
            }
            m[qi] = -__builtin_inff();
            l[qi] = (v16){0};
            qpos[qi] = pos[r];
            last = pos[r] > last ? pos[r] : last;
        }
    for (int64_t t0 = 0; t0 <= last; t0 += KEY_BLOCK) {
        int64_t n = last + 1 - t0 < KEY_BLOCK ? last + 1 - t0 : KEY_BLOCK;
        for (int64_t t = 0; t < n; t += 16) { /* scores of 16 keys at a time */
            v8 part[MAX_Q][16];
            for (int64_t u = 0; u < 16; u++) {
                v16 kv[16];
                int have = t + u < n;
                if (have)
                    for (int64_t j = 0; j < nv; j++) kv[j] = load16(kc + ((t0 + t + u) * D + j * 16) * es, es);
                for (int64_t qi = 0; qi < Q; qi++) {
                    if (!have || t0 + t + u > qpos[qi]) { /* past the query's last key: zeros, never read */
                        part[qi][u] = (v8){0};
                        continue;
                    }
                    v16 d = qv[qi][0] * kv[0];
                    for (int64_t j = 1; j < nv; j++) d += qv[qi][j] * kv[j];
                    part[qi][u] = fold8(d);
                }
            }
            for (int64_t qi = 0; qi < Q; qi++)
                if (t0 + t <= qpos[qi]) {
                    v16 r = reduce16(part[qi]);
                    __builtin_memcpy(&s[qi][t], &r, 64);
                }
        }
        for (int64_t qi = 0; qi < Q; qi++) {
            int64_t nq = qpos[qi] + 1 - t0 < n ? qpos[qi] + 1 - t0 : n; /* the query's keys in this block */
            if (nq <= 0) continue;
            v16 mx = (v16){0} - __builtin_inff(); /* the block's maximum, 16 lanes at a time (max is exact) */
            for (int64_t t = 0; t < nq; t += 16) {
                v16 x = *(const v16 *)&s[qi][t];
                i32x16 take = (x > mx) & (LANES < (float)(nq - t));
                mx = (v16)(((i32x16)x & take) | ((i32x16)mx & ~take));
            }
            float bm = m[qi];
            for (int j = 0; j < 16; j++) bm = mx[j] > bm ? mx[j] : bm;
            if (bm > m[qi]) { /* rescale what the earlier blocks summed */
                float f = m[qi] == -__builtin_inff() ? 0.0f : exp16((v16){0} + (m[qi] - bm))[0];
                l[qi] *= f;
                for (int64_t j = 0; j < nv; j++) acc[qi][j] *= f;
                m[qi] = bm;
            }
            for (int64_t t = 0; t < nq; t += 16) { /* p = e^(s - max); lanes past the last key give exactly 0 */
                i32x16 in = LANES < (float)(nq - t);
                v16 x = (v16)(((i32x16)(*(const v16 *)&s[qi][t] - bm) & in) | ((i32x16)((v16){0} - 1000.0f) & ~in));
                v16 e = exp16(x);
                __builtin_memcpy(&s[qi][t], &e, 64);
                l[qi] += e; /* lane j sums keys j, j + 16, ... in order */
            }
        }
        for (int64_t q0 = 0; q0 < Q; q0 += 4) { /* 4 queries' accumulators in registers, sharing each value load */
            int64_t qn = Q - q0 < 4 ? Q - q0 : 4;
            v16 a[4][16];
            for (int64_t qq = 0; qq < qn; qq++)
                for (int64_t j = 0; j < nv; j++) a[qq][j] = acc[q0 + qq][j];
            for (int64_t t = 0; t < n; t++) {
                v16 vv[16];
                for (int64_t j = 0; j < nv; j++) vv[j] = load16(vc + ((t0 + t) * D + j * 16) * es, es);
                for (int64_t qq = 0; qq < qn; qq++) {
                    if (t0 + t > qpos[q0 + qq]) continue;
                    float p = s[q0 + qq][t];
                    for (int64_t j = 0; j < nv; j++) a[qq][j] += p * vv[j];
                }
            }
            for (int64_t qq = 0; qq < qn; qq++)
                for (int64_t j = 0; j < nv; j++) acc[q0 + qq][j] = a[qq][j];
        }
    }
    for (int64_t qi = 0; qi < Q; qi++) {
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += l[qi][j];
        float inv = 1.0f / sum;
        char *o_row = out + ((qi / G) * out_rs + (qi % G) * D) * es;
        for (int64_t j = 0; j < nv; j++) {
            v16 o = acc[qi][j] * inv;
            if (es == 4) {
                __builtin_memcpy(o_row + j * 16 * 4, &o, 64);
            } else {
                uint16_t *ob = (uint16_t *)o_row + j * 16;
                for (int c = 0; c < 16; c++) ob[c] = to_bf16(o[c]);
            }
        }
    }
}

/* Copies of attend_rows with the head size and storage fixed at compile time (the common models), so its
 * loops unroll and its loads do not branch; the same arithmetic in the same order as the generic one. */
#define ATTEND_FIXED(NAME, DD, ES)                                                                            \
    static void NAME(const char *q, int64_t q_rs, const char *kc, const char *vc, char *out, int64_t out_rs,  \
                     const int64_t *pos, int64_t nr, int64_t G, float scale) {                                \
        attend_rows(q, q_rs, kc, vc, out, out_rs, pos, nr, G, DD, scale, ES);                                 \
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
    else attend_rows(q, q_rs, kc, vc, out, out_rs, pos, nr, G, D, scale, es);
}

int spin_attention_max_head_dim(void) { return 256; }

/* q [N, H, D] (row stride q_rs elements), k_new / v_new [N, KV, D] (row strides), kc / vc this layer's
 * cache [slots, KV, max_len, D], out [N, H, D] contiguous; slot / pos [N] per row. Returns 0, or -1 when
 * out of memory. */
int spin_attention(const void *q, int64_t q_rs, const void *k_new, int64_t k_rs, const void *v_new, int64_t v_rs,
                    void *kc, void *vc, void *out, const int64_t *slot, const int64_t *pos, int64_t N, int64_t H,
                    int64_t KV, int64_t D, int64_t max_len, int es) {
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
     * is the same in any split. */
    int64_t *chunk = (int64_t *)__builtin_malloc((N + 1) * sizeof(int64_t));
    if (!chunk) return -1;
    int64_t nc = 0;
    for (int64_t per = MAX_Q / G;; per = 1) {
        nc = 0;
        for (int64_t i = 0; i < N; i++)
            if (i == 0 || slot[i] != slot[i - 1] || i - chunk[nc - 1] == per) chunk[nc++] = i;
        if (per == 1 || nc == N || nc * KV >= 4 * (int64_t)omp_get_max_threads()) break;
    }
    chunk[nc] = N;
    float scale = 1.0f / __builtin_sqrtf((float)D);
#pragma omp parallel for schedule(dynamic, 1) if (nc * KV > 1)
    for (int64_t task = 0; task < nc * KV; task++) {
        int64_t c = task / KV, h = task % KV, i = chunk[c], base = slot[i] * slot_size + h * head;
        attend_any((const char *)q + (i * q_rs + h * G * D) * es, q_rs, (const char *)kc + base,
                    (const char *)vc + base, (char *)out + (i * H + h * G) * D * es, H * D, pos + i,
                    chunk[c + 1] - i, G, D, scale, es);
    }
    __builtin_free(chunk);
    return 0;
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
    const void *qkv, *o, *gate_up, *down;       /* packed by spin_gemm_pack or spin_gemm_pack_bf16 */
    const void *qkv_bias;                       /* [(H + 2 KV) D] in the weights' dtype, or NULL */
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


static void gemm(const void *x, const void *wp, void *y, int64_t M, int64_t Op, int64_t K, int es) {
    if (es == 4)
        spin_gemm((const float *)x, (const float *)wp, (float *)y, M, Op, K);
    else
        spin_gemm_bf16((const uint16_t *)x, (const uint16_t *)wp, (uint16_t *)y, M, Op, K);
}

int64_t spin_decoder_scratch(int64_t N, int64_t C, int64_t H, int64_t D, int64_t I, const spin_widths_t *w, int es) {
    return N * ((C > I ? C : I) + w->qkv + H * D + w->gate_up + w->out) * es;
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
                 char *cache_v, int64_t layer_bytes, char *scratch) {
    int64_t QKV = (H + 2 * KV) * D, half = D / 2, widest = C > I ? C : I;
    int64_t qkv_w = w->qkv, gu_w = w->gate_up, Cp = w->out;
    void *xn = scratch;                                     /* [N, max(C, I)] norm output, SiLU output */
    void *qkv = (char *)xn + N * widest * es;               /* [N, qkv_w] */
    void *att = (char *)qkv + N * qkv_w * es;               /* [N, H D] */
    void *gu = (char *)att + N * H * D * es;                /* [N, gu_w] */
    void *y = (char *)gu + N * gu_w * es;                   /* [N, Cp] */
    for (int64_t li = 0; li < L; li++) {
        const spin_layer_t *lw = &layers[li];
        norm_rows(h, lw->attn_norm, xn, N, C, eps, es);
        gemm(xn, lw->qkv, qkv, N, qkv_w, C, es);
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
        if (spin_attention((char *)qkv, qkv_w, (char *)qkv + H * D * es, qkv_w, (char *)qkv + (H + KV) * D * es,
                           qkv_w, cache_k + li * layer_bytes, cache_v + li * layer_bytes, att, slot, pos, N, H, KV, D, max_len, es))
            return -1;
        gemm(att, lw->o, y, N, Cp, H * D, es);
        add_rows(h, y, N, C, Cp, es);
        norm_rows(h, lw->mlp_norm, xn, N, C, eps, es);
        gemm(xn, lw->gate_up, gu, N, gu_w, C, es);
#pragma omp parallel for schedule(static) if (N >= 16)
        for (int64_t m = 0; m < N; m++) /* silu(gate) * up; silu(g) = g / (1 + e^-g), e^-|g| never overflows */
            for (int64_t c0 = 0; c0 < I; c0 += 16) {
                v16 g, u;
                int64_t n = I - c0 < 16 ? I - c0 : 16;
                if (n == 16) { /* whole vectors (I is a multiple of 16 in the common models) */
                    g = load16((const char *)gu + (m * gu_w + c0) * es, es);
                    u = load16((const char *)gu + (m * gu_w + I + c0) * es, es);
                } else
                    for (int j = 0; j < 16; j++) {
                        g[j] = j < n ? load1(gu, m * gu_w + c0 + j, es) : 0.0f;
                        u[j] = j < n ? load1(gu, m * gu_w + I + c0 + j, es) : 0.0f;
                    }
                i32x16 neg = g < 0;
                v16 e = exp16((v16)((i32x16)g | ((i32x16){0} + INT32_MIN))); /* e^-|g| */
                v16 num = (v16)(((i32x16)g & ~neg) | ((i32x16)(g * e) & neg));
                v16 r = num / (1.0f + e) * u;
                if (n == 16 && es == 4)
                    __builtin_memcpy((float *)xn + m * I + c0, &r, 64);
                else
                    for (int j = 0; j < n; j++) store1(xn, m * I + c0 + j, r[j], es);
            }
        gemm(xn, lw->down, y, N, Cp, I, es);
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
                       cache_v, layer_bytes, scratch);
    return decoder(h, N, layers, L, slot, pos, cos, sin_signed, C, H, KV, D, I, w, max_len, eps, 2, cache_k, cache_v,
                   layer_bytes, scratch);
}
