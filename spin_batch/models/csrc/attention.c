#include "common.h"

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
