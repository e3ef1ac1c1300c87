/* The largest logits: the argmax of rows (spin_argmax_rows), and the int4 LM head whose top-k proxy logits
 * are rescored by the int8 head (spin_head_q4, after the quantized GEMMs of gemm_quant.c). */
#include "common.h"

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
