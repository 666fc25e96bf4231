/* The weight products of a decode step on CPU: the step's few rows of x times each weight matrix.
 *
 * A decode step multiplies one row per sequence by every weight matrix: the weights are read once per
 * step and the arithmetic per byte is small, so a product should run at memory speed. MKL's sgemm
 * read the bundled model's output head at a third of that (7.5 GB/s at one row, 2.8 at sixteen, this
 * 2-core EPYC), hence these kernels, for up to MAX_ROWS rows:
 *
 *   skinny_linear     out (M, N) = x (M, K) @ w (N, K)^T, all float32
 *   group_linear      the same against W in groups of 32 along K, as the GGUF stores it:
 *                       W[r, g*32 + j] = (c - offset) * scale[r, g] + zero[r, g]
 *                       bits 4: q (N, K/2) bytes; group g of row r at byte r*K/2 + g*16, its low
 *                               nibbles elements 0..15, its high nibbles 16..31 (GGML's Q4
 *                               payload); offset 8
 *                       bits 8: q (N, K) int8; offset 0
 *                       scale, zero (N, K/32) float32, zero NULL for none
 *   group_linear_x8   group_linear with x quantized to 8 bits per group of 32 and integer dot
 *                     products (llama.cpp's way); selectable, not exact (see below)
 *   group_dequantize  W itself as float32 (N, K), exactly as torch computes it
 *
 * x, out and w are row-major and contiguous; K is a multiple of 32 for the grouped kernels.
 *
 * Widening the codes is what a grouped product costs on this machine (AMD EPYC, Zen 1: a 256-bit
 * operation is two 128-bit ones; the int32 -> float conversion runs on one pipe at two cycles a
 * register, and so does the byte -> int32 widening). `widen_group` spends neither: it interleaves a
 * group's bytes with zeros and then with the exponent bits of 2^23 (two rounds of unpacks, which two
 * pipes run), so each 32-bit lane holds the float 2^23 + byte, and one subtraction of 2^23 + offset
 * gives c - offset exactly. The unpacks work within 128-bit lanes, so the floats come out in LANE
 * ORDER: register u holds elements 4u..4u+3 and 16+4u..16+4u+3. x is copied into that order once per
 * call (`to_lanes`) and every product pairs lane with lane; only group_dequantize puts the elements
 * back in place. Where the build has AVX-512 a group is two 16-lane registers in order instead (see
 * `Group`): the codes are zero-extended to 32 bits by one instruction and ORed into 2^23's bits, the
 * same exact c - offset with fewer instructions. */
#include "cpu_linear.h"

#include <stdlib.h>

/* ---- skinny products: float32 weights ----
 *
 * Each thread takes runs of four weight rows, reads them from memory once, and multiplies them against
 * the M rows of x, two at a time from cache: a 2 x 4 tile of eight-lane accumulators. */
static inline void tile(const float *x0, const float *x1, const float *const w[4], int k, float out0[4],
                        float out1[4]) {
    v8f a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    int j = 0;
    for (; j + 8 <= k; j += 8) {
        const v8f w0 = ld8(w[0] + j), w1 = ld8(w[1] + j), w2 = ld8(w[2] + j), w3 = ld8(w[3] + j);
        const v8f u = ld8(x0 + j), v = ld8(x1 + j);
        a00 += u * w0;
        a01 += u * w1;
        a02 += u * w2;
        a03 += u * w3;
        a10 += v * w0;
        a11 += v * w1;
        a12 += v * w2;
        a13 += v * w3;
    }
    out0[0] = hsum8(a00), out0[1] = hsum8(a01), out0[2] = hsum8(a02), out0[3] = hsum8(a03);
    out1[0] = hsum8(a10), out1[1] = hsum8(a11), out1[2] = hsum8(a12), out1[3] = hsum8(a13);
    for (; j < k; j++)
        for (int r = 0; r < 4; r++) {
            out0[r] += x0[j] * w[r][j];
            out1[r] += x1[j] * w[r][j];
        }
}

#define RUN_ROWS 4
#define RUNS_PER_ITEM 8

void skinny_linear(const float *x, const float *w, float *out, int m, int n, int k) {
    const int runs = (n + RUN_ROWS - 1) / RUN_ROWS;
    const int items = (runs + RUNS_PER_ITEM - 1) / RUNS_PER_ITEM;
#pragma omp parallel for schedule(static)
    for (int it = 0; it < items; it++) {
        const int r_end = (it + 1) * RUNS_PER_ITEM < runs ? (it + 1) * RUNS_PER_ITEM : runs;
        for (int r = it * RUNS_PER_ITEM; r < r_end; r++) {
            const int row = r * RUN_ROWS;
            const float *rows[4];
            for (int i = 0; i < 4; i++) rows[i] = w + (int64_t)(row + i < n ? row + i : n - 1) * k;
            for (int i = 0; i < m; i += 2) {
                const int pair = i + 1 < m;
                float o0[4], o1[4];
                tile(x + (int64_t)i * k, x + (int64_t)(i + pair) * k, rows, k, o0, o1);
                for (int c = 0; c < 4 && row + c < n; c++) {
                    out[(int64_t)i * n + row + c] = o0[c];
                    if (pair) out[(int64_t)(i + 1) * n + row + c] = o1[c];
                }
            }
        }
    }
}

/* ---- grouped weights ---- */

/* A group of 32 weights, or of x, as the products hold it. With AVX-512: two 16-lane registers, the
 * elements in order (a group's codes zero- or sign-extended to 32 bits at once, one instruction each
 * half); a step's products at one row ran 18% faster per group than with the 256-bit widening below
 * (Zen 4, which splits each 512-bit operation in two: the gain is in the instructions saved). Without
 * it: four 8-lane registers in lane order (see the header). */
#if defined(__AVX512F__)
#define GROUP_IN_ORDER 1
typedef struct {
    __m512 h[2];
} Group;
typedef __m512 Acc;
static inline Group load_group(const float *p) { return (Group){{_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}}; }
static inline void store_group(float *p, Group w) {
    _mm512_storeu_ps(p, w.h[0]);
    _mm512_storeu_ps(p + 16, w.h[1]);
}
static inline Acc acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
#else
#define GROUP_IN_ORDER 0
typedef struct {
    v8f u[4];
} Group;
typedef v8f Acc;
static inline Group load_group(const float *p) {
    Group w;
    for (int u = 0; u < 4; u++) w.u[u] = ld8(p + 8 * u);
    return w;
}
static inline void store_group(float *p, Group w) {
    for (int u = 0; u < 4; u++) st8(p + 8 * u, w.u[u]);
}
static inline Acc acc_zero(void) { return (v8f){0}; }
static inline float acc_sum(Acc a) { return hsum8(a); }
#endif

/* Group g of a row as floats c - offset, in the Group's order. */
static inline Group widen_group(const void *q, int bits, int64_t row, int k, int g) {
    Group w;
#if defined(__AVX512F__)
    if (bits == 4) {  /* low nibbles are elements 0..15, high nibbles 16..31; each lane ORed into 2^23 */
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)((const uint8_t *)q + row * (k / 2) + g * 16)));
        const __m512i exponent = _mm512_set1_epi32(0x4B000000);
        const __m512 bias = _mm512_set1_ps(8388608.0f + 8.0f);
        const __m512i low = _mm512_ternarylogic_epi32(v, _mm512_set1_epi32(15), exponent, 0xEA);  /* (v&15)|e */
        w.h[0] = _mm512_sub_ps(_mm512_castsi512_ps(low), bias);
        w.h[1] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(v, 4), exponent)), bias);
    } else {
        const int8_t *p = (const int8_t *)q + row * k + g * 32;
        w.h[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        w.h[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    }
#elif defined(__AVX2__)
    __m256i b;  /* the group's 32 codes as unsigned bytes: [0..15 | 16..31] */
    float bias;
    if (bits == 4) {
        const __m128i p = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + row * (k / 2) + g * 16));
        const __m256i both = _mm256_broadcastsi128_si256(p);  /* low nibbles in lane 0, high in lane 1 */
        b = _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                             _mm256_set1_epi8(15));
        bias = 8388608.0f + 8.0f;
    } else {  /* signed: moved to 0..255 by flipping the sign bit, and back by the bias */
        b = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)((const int8_t *)q + row * k + g * 32)),
                             _mm256_set1_epi8((char)0x80));
        bias = 8388608.0f + 128.0f;
    }
    const __m256i zero = _mm256_setzero_si256(), exponent = _mm256_set1_epi16(0x4B00);  /* 2^23's high half */
    const __m256i h0 = _mm256_unpacklo_epi8(b, zero), h1 = _mm256_unpackhi_epi8(b, zero);
    const __m256 sub = _mm256_set1_ps(bias);
    w.u[0] = (v8f)_mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(h0, exponent)), sub);
    w.u[1] = (v8f)_mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(h0, exponent)), sub);
    w.u[2] = (v8f)_mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(h1, exponent)), sub);
    w.u[3] = (v8f)_mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(h1, exponent)), sub);
#else
    float f[32];
    if (bits == 4) {
        const uint8_t *p = (const uint8_t *)q + row * (k / 2) + g * 16;
        for (int j = 0; j < 16; j++) {
            f[j] = (float)(p[j] & 15) - 8.0f;
            f[j + 16] = (float)(p[j] >> 4) - 8.0f;
        }
    } else {
        const int8_t *p = (const int8_t *)q + row * k + g * 32;
        for (int j = 0; j < 32; j++) f[j] = (float)p[j];
    }
    for (int u = 0; u < 4; u++)
        for (int j = 0; j < 4; j++) {
            w.u[u][j] = f[4 * u + j];
            w.u[u][4 + j] = f[16 + 4 * u + j];
        }
#endif
    return w;
}

/* m rows of x (k floats each) into lane order, group by group (the 256-bit Groups' order). */
static void to_lanes(const float *x, float *lanes, int m, int k) {
    for (int64_t g = 0; g < (int64_t)m * k / 32; g++)
        for (int u = 0; u < 4; u++) {
            memcpy(lanes + g * 32 + 8 * u, x + g * 32 + 4 * u, 4 * sizeof(float));
            memcpy(lanes + g * 32 + 8 * u + 4, x + g * 32 + 16 + 4 * u, 4 * sizeof(float));
        }
}

/* The next rows' codes, scales and zeros, ahead of the reads. A row of the
 * bundled model is 288 or 576 bytes of codes; DIRECT_ROWS rows read together are as many short
 * streams, too short for the hardware prefetcher, which read the output head at 4 GB/s without this. */
static inline void prefetch_rows(const Grouped *w, int64_t r, int64_t rows) {
    const int64_t row_bytes = w->bits == 4 ? w->k / 2 : w->k, groups = w->k / 32;
    prefetch_span((const char *)w->q + r * row_bytes, rows * row_bytes);
    prefetch_span((const char *)(w->scale + r * groups), rows * groups * 4);
    if (w->zero) prefetch_span((const char *)(w->zero + r * groups), rows * groups * 4);
}

/* ---- the rows of x a decode step has: straight from the codes ----
 *
 * For one or two rows (a single session) each group is widened and multiplied where it lies, one weight
 * row a pass (`rows_per_pass`; four of the output head's 576-byte rows read side by side ran at two
 * thirds of the speed of one), and a row's product is
 *
 *   sum_j W[r, j] x_j = sum_g scale_g * ((c_g - offset) . x_g)  +  sum_g zero_g * xsum_g
 *
 * the second term one short dot product per row (`row_terms`), not a scalar step per group. Threads
 * take runs of CHUNK_ROWS rows, guided: each takes half of what is left, then less and less, down to one
 * run. A worker that wakes late (OMP_WAIT_POLICY=passive) or is descheduled on a busy host still leaves
 * the smaller runs to the other, and each thread reads long stretches of the codes, scales and zeros:
 * with runs of 32 rows handed out one at a time (as before) the hardware prefetchers started over at
 * every run, and a step's products at one row read the weights at about half the machine's bandwidth
 * (10.4-10.8 ms against 7.9-8.1 guided; the head 1.86 -> 1.2-1.3 ms; one busy loop beside it: 17.0-17.8
 * against 13.8-17.4 ms; this Zen 4 EPYC, 2 threads). */
#define CHUNK_ROWS 16

/* acc + s * (w . x) over one group (lane order), the only arithmetic a grouped product does per group:
 * every path calls it, with the fused multiply-adds spelled out where the target has them, so a row's
 * result is the same bits whether it is multiplied alone, beside one other row or in a batch (the
 * compiler is not left to contract two copies of the expression differently). */
static inline Acc group_fma(Acc acc, float s, const Group *w, const Group *x) {
#if defined(__AVX512F__)
    const __m512 t = _mm512_fmadd_ps(w->h[1], x->h[1], _mm512_mul_ps(w->h[0], x->h[0]));
    return _mm512_fmadd_ps(_mm512_set1_ps(s), t, acc);
#elif defined(__FMA__)
    __m256 t = _mm256_mul_ps((__m256)w->u[0], (__m256)x->u[0]);
    t = _mm256_fmadd_ps((__m256)w->u[1], (__m256)x->u[1], t);
    t = _mm256_fmadd_ps((__m256)w->u[2], (__m256)x->u[2], t);
    t = _mm256_fmadd_ps((__m256)w->u[3], (__m256)x->u[3], t);
    return (v8f)_mm256_fmadd_ps(_mm256_set1_ps(s), t, (__m256)acc);
#else
    return acc + s * (((w->u[0] * x->u[0] + w->u[1] * x->u[1]) + w->u[2] * x->u[2]) + w->u[3] * x->u[3]);
#endif
}

/* The R weight rows' groups come widened on the fly from the codes (wide NULL) or from `wide`, the same
 * rows widened once into a buffer (R rows of k floats, lane order) for a batch's pairs of x rows. */
static inline __attribute__((always_inline)) void rows_f32(const float *x, const int M, const Grouped *w,
                                                           const int bits, const int R,
                                                           const int64_t rows[DIRECT_ROWS], const float *wide,
                                                           float res[DIRECT_ROWS][FEW_ROWS]) {
    const int k = w->k, groups = k / 32;
    Acc acc[DIRECT_ROWS][FEW_ROWS];
    for (int c = 0; c < R; c++)
        for (int i = 0; i < M; i++) acc[c][i] = acc_zero();
    for (int g = 0; g < groups; g++) {
        Group xv[FEW_ROWS];
        for (int i = 0; i < M; i++) xv[i] = load_group(x + (int64_t)i * k + g * 32);
        for (int c = 0; c < R; c++) {
            const Group wv = wide ? load_group(wide + (int64_t)c * k + g * 32) : widen_group(w->q, bits, rows[c], k, g);
            const float s = w->scale[rows[c] * groups + g];
            for (int i = 0; i < M; i++) acc[c][i] = group_fma(acc[c][i], s, &wv, &xv[i]);
        }
    }
    for (int c = 0; c < R; c++)
        for (int i = 0; i < M; i++) res[c][i] = acc_sum(acc[c][i]);
}

/* res[c][i] = sum_g scale_g * ((c_g - offset) . x_i,g) for weight rows r .. r + R - 1 (clamped to n - 1;
 * R from rows_per_pass) and the M rows of x (lane order); `wide` as rows_f32's. */
static void f32_rows(const float *x, int M, const Grouped *w, int64_t r, int R, const float *wide,
                     float res[DIRECT_ROWS][FEW_ROWS]) {
    int64_t rows[DIRECT_ROWS];
    for (int c = 0; c < DIRECT_ROWS; c++) rows[c] = r + c < w->n ? r + c : w->n - 1;
    if (w->bits == 4 && R == DIRECT_ROWS) {
        if (M == 1) rows_f32(x, 1, w, 4, DIRECT_ROWS, rows, wide, res);
        else rows_f32(x, 2, w, 4, DIRECT_ROWS, rows, wide, res);
    } else if (w->bits == 4) {
        if (M == 1) rows_f32(x, 1, w, 4, 1, rows, wide, res);
        else rows_f32(x, 2, w, 4, 1, rows, wide, res);
    } else if (R == DIRECT_ROWS) {
        if (M == 1) rows_f32(x, 1, w, 8, DIRECT_ROWS, rows, wide, res);
        else rows_f32(x, 2, w, 8, DIRECT_ROWS, rows, wide, res);
    } else {
        if (M == 1) rows_f32(x, 1, w, 8, 1, rows, wide, res);
        else rows_f32(x, 2, w, 8, 1, rows, wide, res);
    }
}

/* Weight rows r .. r + R - 1 (clamped) widened into `wide` (R rows of k, in the Groups' order). */
static void widen_rows(const Grouped *w, int64_t r, int R, float *wide) {
    const int groups = w->k / 32;
    for (int c = 0; c < R; c++) {
        const int64_t row = r + c < w->n ? r + c : w->n - 1;
        for (int g = 0; g < groups; g++)
            store_group(wide + (int64_t)c * w->k + g * 32, widen_group(w->q, w->bits, row, w->k, g));
    }
}

/* sum_g s[g] * a[g] + z[g] * b[g] over a row's groups; a pair whose multiplier (a, or z) is NULL is 0. */
static inline float row_terms(const float *s, const float *a, const float *z, const float *b, int groups) {
    v8f acc = {0};
    float tail = 0.0f;
    int g = 0;
    for (; g + 8 <= groups; g += 8) {
        if (a) acc += ld8(s + g) * ld8(a + g);
        if (z) acc += ld8(z + g) * ld8(b + g);
    }
    for (; g < groups; g++) tail += (a ? s[g] * a[g] : 0.0f) + (z ? z[g] * b[g] : 0.0f);
    return hsum8(acc) + tail;
}

/* The products of weight rows r .. r + R - 1 (those below r1) and x rows i .. i + M - 1 (M <= FEW_ROWS;
 * lane order, or quantized in x8) into out, each sum plus its row terms (a, b: the x rows' multipliers,
 * NULL when they are all 0); `wide` as rows_f32's. */
static void run_rows(const float *x, const X8 *x8, int i, int M, const Grouped *w, int64_t r, int64_t r1, int R,
                     const float *wide, const float *a, const float *b, float *out) {
    const int k = w->k, groups = k / 32;
    float res[DIRECT_ROWS][FEW_ROWS];
    if (x8) {
        const X8 xi = {x8->q + (int64_t)i * k, x8->dx + i * groups};
        x8_rows(&xi, M, w, r, R, res);
    } else {
        f32_rows(x + (int64_t)i * k, M, w, r, R, wide, res);
    }
    for (int c = 0; c < R && r + c < r1; c++) {
        const float *s = w->scale + (r + c) * groups, *z = w->zero ? w->zero + (r + c) * groups : NULL;
        for (int j = i; j < i + M; j++)
            out[(int64_t)j * w->n + r + c] = res[c][j - i] + (a || z ? row_terms(s, a ? a + j * groups : NULL,
                                                                                 z, b + j * groups, groups) : 0.0f);
    }
}

/* Weight rows [r0, r1) against the m rows of x into out. Up to FEW_ROWS rows (or 8-bit x) multiply each
 * group where it lies; more rows widen each run of R weight rows once into `wide` (L1-sized: R * k floats)
 * and take it against every pair of x rows, with the same arithmetic in the same order, so a row's
 * result does not depend on how many rows share the step (a batch equals each session alone). */
static void direct_chunk(const float *x, const X8 *x8, int m, const Grouped *w, int64_t r0, int64_t r1,
                         float *wide, const float *a, const float *b, float *out) {
    /* wide: the caller's buffer when the rows are a float batch (m > FEW_ROWS), else NULL */
    const int R = rows_per_pass(w->bits, m, x8 != NULL);
    for (int64_t r = r0; r < r1; r += R) {
        if (r + R < r1) prefetch_rows(w, r + R, r1 - r - R < R ? r1 - r - R : R);
        if (wide) widen_rows(w, r, R, wide);
        for (int i = 0; i < m; i += FEW_ROWS)
            run_rows(x, x8, i, m - i < FEW_ROWS ? m - i : FEW_ROWS, w, r, r1, R, wide, a, b, out);
    }
}

/* out = x @ W^T straight from the codes, m rows of x (float32, or quantized to 8 bits when x8): x's
 * lanes or codes and the row terms' multipliers first, then chunks of CHUNK_ROWS weight rows over the
 * threads (`direct_chunk`), each thread with its own widened-rows buffer when a float batch wants one.
 * -1: no memory. */
static int group_direct(const float *x, const Grouped *w, float *out, int m, int x8) {
    const int k = w->k, groups = k / 32;
    const size_t terms = (size_t)m * groups;
    float *buf = malloc(sizeof(float) * terms * 3 + (x8 ? (size_t)m * k : sizeof(float) * (size_t)m * k));
    if (!buf) return -1;
    float *a = buf, *b = a + terms, *dx = b + terms, *lanes = dx + terms;
    int8_t *codes = (int8_t *)lanes;
    for (int i = 0; i < m; i++) {
        const float *xi = x + (int64_t)i * k;
        if (x8) {
            quantize_x8(xi, k, w->bits, codes + (int64_t)i * k, dx + i * groups, a + i * groups, b + i * groups);
            continue;
        }
        for (int g = 0; g < groups; g++) {
            const float *xg = xi + g * 32;
            b[i * groups + g] = hsum8(ld8(xg) + ld8(xg + 8) + ld8(xg + 16) + ld8(xg + 24));
        }
    }
    if (!x8 && !GROUP_IN_ORDER) to_lanes(x, lanes, m, k);
    const float *xf = GROUP_IN_ORDER ? x : lanes;  /* x as the Groups hold it: in order, or in lanes */
    const X8 q8 = {codes, dx};
    const float *row_a = x8 && w->bits == 4 ? a : NULL;  /* the float path's offset is in its widening */
    const int chunks = (w->n + CHUNK_ROWS - 1) / CHUNK_ROWS, widen = !x8 && m > FEW_ROWS;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *wide = widen ? malloc(sizeof(float) * DIRECT_ROWS * (size_t)k) : NULL;
        failed = widen && !wide;
#pragma omp for schedule(guided)
        for (int ch = 0; ch < chunks; ch++) {
            const int64_t r0 = (int64_t)ch * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS < w->n ? r0 + CHUNK_ROWS : w->n;
            if (!failed) direct_chunk(xf, x8 ? &q8 : NULL, m, w, r0, r1, wide, row_a, b, out);
        }
        free(wide);
    }
    free(buf);
    return failed ? -1 : 0;
}

/* out (m, n) = x @ W^T for m <= MAX_ROWS, straight from the codes (`group_direct`): a row's result is
 * the same bits at any m. Returns -1 when m > MAX_ROWS, k is not a multiple of 32, bits is not 4 or 8,
 * or scratch memory cannot be had (the caller falls back). */
int group_linear(const float *x, const void *q, int bits, const float *scale, const float *zero, float *out,
                 int m, int n, int k) {
    if (m > MAX_ROWS || k % 32 || (bits != 4 && bits != 8)) return -1;
    const Grouped wg = {q, bits, scale, zero, n, k};
    return group_direct(x, &wg, out, m, 0);
}

/* group_linear with x quantized to 8 bits per group of 32 (`quantize_x8`), for every m <= MAX_ROWS
 * alike: a row's result does not depend on the rows beside it. -1 as group_linear's, and where the
 * build has no AVX2. */
int group_linear_x8(const float *x, const void *q, int bits, const float *scale, const float *zero, float *out,
                    int m, int n, int k) {
    if (m > MAX_ROWS || k % 32 || (bits != 4 && bits != 8)) return -1;
#if defined(__AVX2__)
    const Grouped wg = {q, bits, scale, zero, n, k};
    return group_direct(x, &wg, out, m, 1);
#else
    (void)x, (void)q, (void)scale, (void)zero, (void)out, (void)n;
    return -1;
#endif
}

/* W as float32 (N, K), exactly as torch computes (c - offset) * scale + zero: a product, then a sum,
 * each rounded (no fused multiply-add), so a prefill through it matches the dense weights bit for bit. */
__attribute__((optimize("fp-contract=off"))) void group_dequantize(const void *q, int bits, const float *scale,
                                                                   const float *zero, float *out, int n, int k) {
    const int groups = k / 32;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; r++)
        for (int g = 0; g < groups; g++) {
            const Group w = widen_group(q, bits, r, k, g);
            const float s = scale[(int64_t)r * groups + g], z = zero ? zero[(int64_t)r * groups + g] : 0.0f;
            float *o = out + (int64_t)r * k + g * 32;
#if GROUP_IN_ORDER
            for (int h = 0; h < 2; h++) {
                __m512 t = _mm512_mul_ps(w.h[h], _mm512_set1_ps(s));
                if (zero) t = _mm512_add_ps(t, _mm512_set1_ps(z));
                _mm512_storeu_ps(o + 16 * h, t);
            }
#else
            for (int u = 0; u < 4; u++) {
                v8f t = w.u[u] * s;
                if (zero) t = t + z;
                memcpy(o + 4 * u, &t, 4 * sizeof(float));  /* lane order back to place */
                memcpy(o + 16 + 4 * u, (const float *)&t + 4, 4 * sizeof(float));
            }
#endif
        }
}
