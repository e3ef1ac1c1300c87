/* The decode loop's CPU kernels, built once per kind of machine by cpu_decoder.py as one translation unit:
 * this file includes its parts (csrc/), then holds the RMS norm and spin_decoder, all decoder layers of a
 * forward in one call. Every result of a row is computed alone, in a fixed order (see each part), so a
 * row's output does not depend on the batch, segment or prefill chunk it arrives in.
 *
 *   csrc/common.h       vector types and the build's instruction set, bfloat16 conversion, vector helpers
 *   csrc/gemm.c         float32 and bfloat16 panel GEMMs (spin_gemm, spin_gemm_bf16)
 *   csrc/gemm_quant.c   int8 and int4 GEMMs (spin_gemm_q8, spin_gemm_pack_q4)
 *   csrc/argmax.c       argmax of rows, the int4 LM head rescored in int8 (spin_argmax_rows, spin_head_q4)
 *   csrc/attention.c    attention over the per-slot KV cache, token trees too (spin_attention, _tree)
 *
 * Only this file is compiled, the parts in this order (a part may use what an earlier one defines): one
 * unit, so the decoder inlines the kernels it calls (the tree branch of its attention folds away in
 * spin_decoder). tests/native/check_kernels.c includes this file the same way. */
#include "csrc/common.h"
#include "csrc/gemm.c"
#include "csrc/gemm_quant.c"
#include "csrc/argmax.c"
#include "csrc/attention.c"

/* The instruction set this build's GEMM micro-kernel was written for (shown by `spin-batch env`). */
const char *spin_isa(void) { return ISA_NAME; }

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

/* y [M, C] = x * (1 / sqrt(mean(x^2) + eps)) * w per row, float32: torch's half-dozen ops in one call. */
void spin_rms_norm(const float *x, const float *w, float *y, int64_t M, int64_t C, float eps) {
    norm_rows(x, w, y, M, C, eps, 4);
}

/* ---- The decoder layers in one call ---------------------------------------------------------------
 *
 * For a forward on CPU, every layer's norm, QKV GEMM, rotary embedding, attention, output GEMM, residual
 * add, norm, gate/up GEMM, SiLU-times-up and down GEMM run here, one call for all layers, instead of a
 * dozen torch calls and four GEMM calls a layer from Python. The arithmetic is the kernels' of the parts; the residual stream h
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
                 int es, void *q8_scratch, float *wide) {
    if (scale && es == 2) { /* int8 weights in a bfloat16 model: its rows widened to float32, the result rounded back */
        float *xf = wide, *yf = wide + M * K;
        for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_float(((const uint16_t *)x)[i]);
        spin_gemm_q8(xf, (const uint8_t *)wp, scale, yf, M, Op, K, q8_scratch);
        for (int64_t i = 0; i < M * Op; i++) ((uint16_t *)y)[i] = to_bf16(yf[i]);
    } else if (scale) /* int8 weights, float32 rows (es 4) */
        spin_gemm_q8((const float *)x, (const uint8_t *)wp, scale, (float *)y, M, Op, K, q8_scratch);
    else if (es == 4)
        spin_gemm((const float *)x, (const float *)wp, (float *)y, M, Op, K);
    else
        spin_gemm_bf16((const uint16_t *)x, (const uint16_t *)wp, (uint16_t *)y, M, Op, K);
}

#define ALIGN64(n) (((n) + 63) / 64 * 64)

/* The widest input and output of the layers' GEMMs. */
static inline int64_t gemm_in(int64_t C, int64_t H, int64_t D, int64_t I) {
    int64_t widest = C > I ? C : I;
    return widest > H * D ? widest : H * D;
}
static inline int64_t gemm_out(const spin_widths_t *w) {
    int64_t o = w->qkv > w->gate_up ? w->qkv : w->gate_up;
    return o > w->out ? o : w->out;
}

/* Bytes of scratch spin_decoder needs: the rows of each stage, then the int8 GEMM's (int8 weights), then
 * for int8 weights in a bfloat16 model, one GEMM's input and output rows in float32. */
int64_t spin_decoder_scratch(int64_t N, int64_t C, int64_t H, int64_t D, int64_t I, const spin_widths_t *w, int es) {
    int64_t widest = C > I ? C : I, k = gemm_in(C, H, D, I);
    return ALIGN64(N * (widest + w->qkv + H * D + w->gate_up + w->out) * es) + ALIGN64(spin_gemm_q8_scratch(N, k))
           + (es == 2 ? N * (k + gemm_out(w)) * 4 : 0);
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
    float *wide = (float *)((char *)q8 + ALIGN64(spin_gemm_q8_scratch(N, gemm_in(C, H, D, I)))); /* see gemm */
    for (int64_t li = 0; li < L; li++) {
        const spin_layer_t *lw = &layers[li];
        norm_rows(h, lw->attn_norm, xn, N, C, eps, es);
        gemm(xn, lw->qkv, lw->qkv_s, qkv, N, qkv_w, C, es, q8, wide);
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
        gemm(att, lw->o, lw->o_s, y, N, Cp, H * D, es, q8, wide);
        add_rows(h, y, N, C, Cp, es);
        norm_rows(h, lw->mlp_norm, xn, N, C, eps, es);
        gemm(xn, lw->gate_up, lw->gate_up_s, gu, N, gu_w, C, es, q8, wide);
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
        gemm(xn, lw->down, lw->down_s, y, N, Cp, I, es, q8, wide);
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
