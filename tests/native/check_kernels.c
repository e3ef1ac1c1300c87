/* A C check of spin_batch/models/cpu_decoder.c, for builds the Python suite cannot load: another
 * architecture (aarch64 under qemu-user) or another -march. Compiled as one unit with the kernels:
 *   cc -O2 -march=... -fopenmp tests/native/check_kernels.c -o check -lm && ./check
 * It checks the float32, bfloat16 and int8 GEMMs and the int4 head against a double reference, that a row's result is bitwise
 * the same alone and inside a batch (M = 1 vs M = 13), the RMS norm, and attention against a double
 * reference and alone vs inside a verify run, and tree attention (spin_attention_tree) against a double
 * reference. Prints "kernels check (<isa>, ...): N passed, M failed". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../spin_batch/models/cpu_decoder.c"

static int passed, failed;

static void check(int ok, const char *what) {
    if (ok) passed++;
    else {
        failed++;
        printf("FAILED: %s\n", what);
    }
}

static float rnd(void) { return (float)rand() / RAND_MAX * 2.0f - 1.0f; }

static uint16_t bf(float f) { return to_bf16(f); }
static float unbf(uint16_t h) { return bf16_to_float(h); }

static void gemm_f32(void) {
    enum { M = 13, O = 100, K = 300, OP = 128 }; /* K spans three of the GEMM's k-blocks */
    static float w[O * K], wp[OP * K], x[M * K], y[M * OP], y1[OP];
    for (int i = 0; i < O * K; i++) w[i] = rnd();
    for (int i = 0; i < M * K; i++) x[i] = rnd();
    spin_gemm_pack(w, wp, O, K, OP);
    spin_gemm(x, wp, y, M, OP, K);
    int ok = 1, same = 1;
    for (int m = 0; m < M; m++)
        for (int o = 0; o < O; o++) {
            double ref = 0, mag = 0;
            for (int k = 0; k < K; k++) ref += (double)x[m * K + k] * w[o * K + k], mag += fabs((double)x[m * K + k] * w[o * K + k]);
            if (fabs(y[m * OP + o] - ref) > K * 1.2e-7 * mag + 1e-30) ok = 0;
        }
    for (int m = 0; m < M; m++) {
        spin_gemm(x + m * K, wp, y1, 1, OP, K);
        if (memcmp(y1, y + m * OP, O * sizeof(float))) same = 0;
    }
    check(ok, "float32 GEMM matches the double reference");
    check(same, "float32 GEMM: a row alone equals the row in a batch of 13");
}

static void gemm_q8(void) {
    enum { M = 13, O = 100, K = 300, OP = 128, KP = 320, G = KP / 64 }; /* K not a multiple of the group */
    static int8_t w[O * K];
    static uint8_t wp[OP * KP];
    static float scale[OP], x[M * K], y[M * OP], y1[OP];
    static char scratch[M * (KP + G * 8)];
    for (int i = 0; i < O * K; i++) w[i] = (int8_t)(rand() % 255 - 127);
    for (int o = 0; o < OP; o++) scale[o] = o < O ? 0.001f * (1 + o % 7) : 0.0f;
    for (int i = 0; i < M * K; i++) x[i] = rnd() * (i % 61 == 0 ? 20.0f : 1.0f); /* a few large inputs */
    for (int k = 0; k < 64; k++) x[k] = 0.0f; /* row 0's first group is all zero */
    check(spin_gemm_q8_scratch(M, K) <= (int64_t)sizeof scratch, "int8 GEMM scratch fits");
    spin_gemm_pack_q8(w, wp, O, K, OP);
    spin_gemm_q8(x, wp, scale, y, M, OP, K, scratch);
    int ok = 1, same = 1;
    for (int m = 0; m < M; m++)
        for (int o = 0; o < O; o++) {
            double ref = 0, mag = 0;
            for (int g = 0; g < G; g++) { /* x rounded per group of 64 to int8 steps of its largest magnitude / 127 */
                float amax = 0.0f;
                for (int k = g * 64; k < K && k < g * 64 + 64; k++) amax = fmaxf(amax, fabsf(x[m * K + k]));
                float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                long isum = 0;
                for (int k = g * 64; k < K && k < g * 64 + 64; k++) isum += lrintf(x[m * K + k] * inv) * w[o * K + k];
                ref += (double)isum * (amax / 127.0f);
                mag += fabs((double)isum * (amax / 127.0f));
            }
            if (fabs(y[m * OP + o] - ref * scale[o]) > (G + 2) * 1.2e-7 * mag * scale[o] + 1e-30) ok = 0;
        }
    for (int m = 0; m < M; m++) {
        spin_gemm_q8(x + m * K, wp, scale, y1, 1, OP, K, scratch);
        if (memcmp(y1, y + m * OP, O * sizeof(float))) same = 0;
    }
    check(ok, "int8 GEMM matches the double reference");
    check(same, "int8 GEMM: a row alone equals the row in a batch of 13");
}

static void head_q4(void) {
    /* K not a multiple of the group; more ids than outputs a unit; k = 8 of V = 100 (padded to 128) */
    enum { M = 13, V = 100, K = 300, OP = 128, KP = 320, G = KP / 64, TOPK = 8 };
    static int8_t w4[V * K], w8[V * K];
    static uint8_t wp4[OP * KP / 2], wp8[OP * KP];
    static float ws[OP / 16 * G * 16], sc8[OP], x[M * K], y[M * OP], y8[M * OP], y1[OP];
    static int64_t idx[M * TOPK], idx1[TOPK];
    static double proxy[M * V];
    static char scratch[M * (KP + G * 8)];
    for (int i = 0; i < V * K; i++) w4[i] = (int8_t)(rand() % 15 - 7), w8[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < OP / 16 * G * 16; i++) ws[i] = 0.01f * (1 + i % 5);
    for (int o = 0; o < OP; o++) sc8[o] = o < V ? 0.001f * (1 + o % 7) : 0.0f;
    for (int i = 0; i < M * K; i++) x[i] = rnd() * (i % 61 == 0 ? 20.0f : 1.0f);
    for (int k = 0; k < 64; k++) x[k] = 0.0f; /* row 0's first group is all zero */
    spin_gemm_pack_q4(w4, wp4, V, K, OP);
    spin_gemm_pack_q8(w8, wp8, V, K, OP);
    spin_head_q4(x, wp4, ws, w8, sc8, y, idx, M, OP, K, V, TOPK, scratch);
    spin_gemm_q8(x, wp8, sc8, y8, M, OP, K, scratch);
    int ok = 1, exact = 1, top = 1, same = 1;
    for (int m = 0; m < M; m++) {
        double mag = 0;
        for (int o = 0; o < V; o++) { /* the proxy: x rounded per group as in the int8 GEMM, int4 weights */
            double ref = 0;
            for (int g = 0; g < G; g++) {
                float amax = 0.0f;
                for (int k = g * 64; k < K && k < g * 64 + 64; k++) amax = fmaxf(amax, fabsf(x[m * K + k]));
                float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                long isum = 0;
                for (int k = g * 64; k < K && k < g * 64 + 64; k++) isum += lrintf(x[m * K + k] * inv) * w4[o * K + k];
                double t = (double)isum * (amax / 127.0f) * ws[((o / 16) * G + g) * 16 + o % 16];
                ref += t, mag += fabs(t);
            }
            proxy[m * V + o] = ref;
        }
        for (int o = 0; o < V; o++) {
            int rescored = 0;
            for (int t = 0; t < TOPK; t++) rescored |= idx[m * TOPK + t] == o;
            if (rescored && y[m * OP + o] != y8[m * OP + o]) exact = 0;
            if (!rescored && fabs(y[m * OP + o] - proxy[m * V + o]) > (G + 2) * 1.2e-7 * mag + 1e-30) ok = 0;
            /* no id left out scores clearly above a chosen one under the proxy */
            for (int t = 0; t < TOPK && !rescored; t++)
                if (proxy[m * V + o] > proxy[m * V + idx[m * TOPK + t]] + (G + 2) * 2.4e-7 * mag) top = 0;
        }
        for (int t = 0; t < TOPK; t++)
            for (int u = 0; u < t; u++) top &= idx[m * TOPK + t] != idx[m * TOPK + u] && idx[m * TOPK + t] < V;
        spin_head_q4(x + m * K, wp4, ws, w8, sc8, y1, idx1, 1, OP, K, V, TOPK, scratch);
        if (memcmp(y1, y + m * OP, V * sizeof(float)) || memcmp(idx1, idx + m * TOPK, sizeof idx1)) same = 0;
    }
    check(ok, "int4 head: the proxy logits match the double reference");
    check(top, "int4 head: the rescored ids are the proxy's 8 best, distinct");
    check(exact, "int4 head: a rescored id's logit is the int8 GEMM's, bit for bit");
    check(same, "int4 head: a row alone equals the row in a batch of 13");
}

static void argmax_rows(void) {
    enum { M = 5, V = 1003, LD = 1010 };
    static float y[M * LD];
    int64_t out[M];
    for (int i = 0; i < M * LD; i++) y[i] = rnd();
    y[0 * LD + 7] = y[0 * LD + 900] = 5.0f;             /* a tie: the first */
    y[1 * LD + 1002] = 5.0f;                             /* the last, in the tail */
    y[2 * LD + 999] = NAN, y[2 * LD + 30] = NAN;         /* the first NaN */
    for (int i = 0; i < V; i++) y[3 * LD + i] = -INFINITY;
    y[4 * LD + 1004] = 9.0f;                             /* past V: not read */
    y[4 * LD + 500] = 2.0f;
    spin_argmax_rows(y, M, V, LD, out);
    check(out[0] == 7 && out[1] == 1002 && out[2] == 30 && out[3] == 0 && out[4] == 500, "argmax: first maximum, NaN first");
}

static void gemm_bf16(void) {
    enum { M = 13, O = 100, K = 300, OP = 128 }; /* K spans three of the GEMM's k-blocks */
    static uint16_t w[O * K], wp[OP * K], x[M * K], y[M * OP], y1[OP];
    for (int i = 0; i < O * K; i++) w[i] = bf(rnd());
    for (int i = 0; i < M * K; i++) x[i] = bf(rnd());
    spin_gemm_pack_bf16(w, wp, O, K, OP);
    spin_gemm_bf16(x, wp, y, M, OP, K);
    int ok = 1, same = 1;
    for (int m = 0; m < M; m++)
        for (int o = 0; o < O; o++) {
            double ref = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                double t = (double)unbf(x[m * K + k]) * unbf(w[o * K + k]);
                ref += t, mag += fabs(t);
            }
            if (fabs(unbf(y[m * OP + o]) - ref) > K * 1.2e-7 * mag * 1.01 + fabs(ref) / 256 + 1e-30) ok = 0;
        }
    for (int m = 0; m < M; m++) {
        spin_gemm_bf16(x + m * K, wp, y1, 1, OP, K);
        if (memcmp(y1, y + m * OP, O * sizeof(uint16_t))) same = 0;
    }
    check(ok, "bfloat16 GEMM matches the double reference");
    check(same, "bfloat16 GEMM: a row alone equals the row in a batch of 13");
}

static void norm(void) {
    enum { M = 5, C = 70 };
    static float x[M * C], w[C], y[M * C];
    for (int i = 0; i < M * C; i++) x[i] = 3 * rnd();
    for (int i = 0; i < C; i++) w[i] = rnd();
    spin_rms_norm(x, w, y, M, C, 1e-5f);
    int ok = 1;
    for (int m = 0; m < M; m++) {
        double ss = 0;
        for (int c = 0; c < C; c++) ss += (double)x[m * C + c] * x[m * C + c];
        double r = 1 / sqrt(ss / C + 1e-5);
        for (int c = 0; c < C; c++)
            if (fabs(y[m * C + c] - x[m * C + c] * r * w[c]) > 2e-6 * (1 + fabs(x[m * C + c] * r * w[c]))) ok = 0;
    }
    check(ok, "RMS norm matches the double reference");
}

/* One slot, H = 6 query heads on KV = 2, D = 64: a verify run of 4 rows at positions 90..93 over a cache
 * holding 90 keys, against a double reference; then the first row alone gives the same bits. */
static void attention(void) {
    enum { H = 6, KV = 2, D = 64, L = 128, N = 4, CTX = 90 };
    static float kc[KV * L * D], vc[KV * L * D], q[N * H * D], kn[N * KV * D], vn[N * KV * D], out[N * H * D], one[H * D];
    int64_t slot[N], pos[N];
    for (int i = 0; i < KV * L * D; i++) kc[i] = rnd(), vc[i] = rnd();
    for (int i = 0; i < N * H * D; i++) q[i] = rnd();
    for (int i = 0; i < N * KV * D; i++) kn[i] = rnd(), vn[i] = rnd();
    for (int i = 0; i < N; i++) slot[i] = 0, pos[i] = CTX + i;
    int rc = spin_attention(q, H * D, kn, KV * D, vn, KV * D, kc, vc, out, slot, pos, N, H, KV, D, L, 4);
    int ok = rc == 0;
    for (int i = 0; i < N && ok; i++)
        for (int h = 0; h < H; h++) {
            int g = h / (H / KV);
            double s[L], mx = -1e300, sum = 0;
            for (int t = 0; t <= pos[i]; t++) {
                double d = 0;
                for (int j = 0; j < D; j++) d += (double)q[(i * H + h) * D + j] * kc[(g * L + t) * D + j];
                s[t] = d / sqrt((double)D);
                mx = s[t] > mx ? s[t] : mx;
            }
            for (int t = 0; t <= pos[i]; t++) s[t] = exp(s[t] - mx), sum += s[t];
            for (int j = 0; j < D; j++) {
                double o = 0;
                for (int t = 0; t <= pos[i]; t++) o += s[t] / sum * vc[(g * L + t) * D + j];
                if (fabs(out[(i * H + h) * D + j] - o) > 1e-5) ok = 0;
            }
        }
    check(ok, "attention matches the double reference");
    rc = spin_attention(q, H * D, kn, KV * D, vn, KV * D, kc, vc, one, slot, pos, 1, H, KV, D, L, 4);
    check(rc == 0 && !memcmp(one, out, sizeof one), "attention: a row alone equals the row in a verify run");
}

/* A 64-token binary tree over a 40-row prefix (bit 63 in use) against a double reference over the prefix
 * plus each token's ancestors and itself; then ordinary rows (anc 0) through spin_attention_tree, bitwise
 * as through spin_attention. */
static void tree_attention(void) {
    enum { H = 6, KV = 2, D = 64, L = 128, N = 64, CTX = 40 };
    static float kc[KV * L * D], vc[KV * L * D], q[N * H * D], kn[N * KV * D], vn[N * KV * D], out[N * H * D],
        ref[N * H * D];
    int64_t slot[N], pos[N];
    uint64_t anc[N], plain[N];
    for (int i = 0; i < KV * L * D; i++) kc[i] = rnd(), vc[i] = rnd();
    for (int i = 0; i < N * H * D; i++) q[i] = rnd();
    for (int i = 0; i < N * KV * D; i++) kn[i] = rnd(), vn[i] = rnd();
    for (int i = 0; i < N; i++) {
        slot[i] = 0, pos[i] = CTX + i, plain[i] = 0;
        anc[i] = (1ull << i) | (i ? anc[(i - 1) / 2] : 0);
    }
    int rc = spin_attention_tree(q, H * D, kn, KV * D, vn, KV * D, kc, vc, out, slot, pos, anc, N, H, KV, D, L, 4);
    int ok = rc == 0;
    for (int i = 0; i < N && ok; i++)
        for (int h = 0; h < H; h++) {
            int g = h / (H / KV);
            double s[L], mx = -1e300, sum = 0;
            int keys[L], nk = 0;
            for (int t = 0; t < CTX + N; t++)
                if (t < CTX || (t <= pos[i] && (anc[i] >> (t - CTX) & 1))) keys[nk++] = t;
            for (int u = 0; u < nk; u++) {
                double d = 0;
                for (int j = 0; j < D; j++) d += (double)q[(i * H + h) * D + j] * kc[(g * L + keys[u]) * D + j];
                s[u] = d / sqrt((double)D);
                mx = s[u] > mx ? s[u] : mx;
            }
            for (int u = 0; u < nk; u++) s[u] = exp(s[u] - mx), sum += s[u];
            for (int j = 0; j < D; j++) {
                double o = 0;
                for (int u = 0; u < nk; u++) o += s[u] / sum * vc[(g * L + keys[u]) * D + j];
                if (fabs(out[(i * H + h) * D + j] - o) > 1e-5) ok = 0;
            }
        }
    check(ok, "tree attention matches the double reference (prefix plus ancestors)");
    rc = spin_attention_tree(q, H * D, kn, KV * D, vn, KV * D, kc, vc, out, slot, pos, plain, 4, H, KV, D, L, 4);
    rc |= spin_attention(q, H * D, kn, KV * D, vn, KV * D, kc, vc, ref, slot, pos, 1, H, KV, D, L, 4);
    check(rc == 0 && !memcmp(out, ref, H * D * sizeof(float)), "tree attention: an ordinary row as in spin_attention");
}

int main(void) {
    srand(1);
    gemm_f32();
    gemm_q8();
    head_q4();
    argmax_rows();
    gemm_bf16();
    norm();
    attention();
    tree_attention();
    printf("kernels check (%s, bfloat16 %s, int8 %s): %d passed, %d failed\n", spin_isa(),
           spin_gemm_bf16_native() ? "dot products" : "widened", spin_gemm_q8_kind(), passed, failed);
    return failed != 0;
}
