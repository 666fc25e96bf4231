/* Paged decode attention on CPU: one query per sequence, read from the pool's blocks where they lie.
 *
 * The torch reference (reference.py `decode`) gathers every sequence's whole
 * context into a workspace per layer and multiplies it there: the copy moves
 * as many bytes as the attention reads, and at 16 sessions x 2,000 tokens it
 * was a third of a decode step. This kernel walks each sequence's block
 * table and reads every key and value row once, in place, with the same
 * layouts and the same position-free rotation (see reference.py's header):
 *
 *   key_cache, value_cache  (num_blocks, block_size, num_kv_heads, head_dim),
 *                           float32, bfloat16 or float16 (`dtype` 0, 1, 2)
 *   q, out                  (B, H, head_dim) float32, unrotated query in, attention out
 *   block_tables            (B, table_stride) int32; seq_lens (B,) int32
 *   cos, sin                (max_pos, head_dim) float32, rotate-half layout
 *   block_mass              (B, mass_stride) float32 or NULL: ADDS each block's
 *                           softmax probability summed over the H heads
 *
 * Work: one item per (sequence, run of `chunk` blocks, chunk x block_size
 * <= RUN_TOKENS), spread over the OpenMP threads of the process (the same
 * libgomp as torch's, which the loader resolves by its soname), each scoring
 * its run for every query head (a key row is loaded once for the G query
 * heads of its KV head), taking one softmax over the run and summing the
 * values (`run_blocks`). A merge then combines a sequence's runs. The runs
 * depend only on the sequence's own length, so a sequence's result is the
 * same in any batch.
 *
 * `partial` holds B * ceil(max_blocks / chunk) items of
 * H * (head_dim + 2) floats; `stats` (only with block_mass) B * num_kv_heads
 * * G * max_blocks * 2 floats: each block's sum of exponentials and the max
 * it is taken against (its run's).
 */
#include "cpu_common.h"

#define MAX_D 256
#define MAX_H 128         /* query heads */
#define MAX_HD 8192       /* query heads x head_dim */

typedef struct {
    const float *q;
    const void *kc, *vc;
    int dtype;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    const float *cos, *sin;
    int heads, kv_heads, d, bs, max_blocks, chunk;
    float scale;
    float *partial, *stats;
} Args;

/* One run of blocks [i0, i1) of sequence b (at most RUN_TOKENS keys), every query head: the run's
 * max, its sum of exponentials and its unnormalised output, in `part` (heads x (d + 2) floats).
 *
 * Two passes, each reading its rows in the order they lie: a block holds its keys (and, in the other
 * pool, its values) for all KV heads as one span, token-major, so the key pass walks each block's
 * span front to back scoring every query head, one softmax then covers the whole run, and the value
 * pass walks the value spans the same way, adding each row into the G outputs of its KV head (kept
 * in L1). Walking a block head by head instead (three strided passes over one span, a softmax per
 * block between them) left the loads waiting on each other: 3.4 GB/s on one core, where reading the
 * same blocks in order runs at 10.8. */
static void run_blocks(const Args *a, int b, int i0, int i1, float *part) {
    const int g_n = a->heads / a->kv_heads, d = a->d, half = a->d / 2, bs = a->bs, kvh = a->kv_heads;
    const int heads = a->heads, len = a->seq_lens[b], qpos = len - 1;
    const int64_t row_stride = d + 2, span = (int64_t)kvh * d * (a->dtype == 0 ? 4 : 2);  /* a token's rows */
    float qr[MAX_HD], s[MAX_H * RUN_TOKENS], tmp[MAX_D];
    const int32_t *table = a->tables + (int64_t)b * a->table_stride;
    /* keys: s[hq][n] = scale * (R(p - start) q_hq) . k_n */
    int n = 0;
    for (int i = i0; i < i1; i++) {
        const int start = i * bs, valid = len - start < bs ? len - start : bs;
        const float *c = a->cos + (int64_t)(qpos - start) * d, *sn = a->sin + (int64_t)(qpos - start) * d;
        for (int hq = 0; hq < heads; hq++) {  /* the query as this block sees it */
            const float *qv = a->q + ((int64_t)b * heads + hq) * d;
            float *o = qr + hq * d;
#pragma omp simd
            for (int j = 0; j < half; j++) {
                o[j] = qv[j] * c[j] - qv[j + half] * sn[j];
                o[j + half] = qv[j + half] * c[j + half] + qv[j] * sn[j];
            }
        }
        const int64_t base = (int64_t)table[i] * bs * kvh;
        const char *ahead = i + 1 < i1 ? row_addr(a->kc, a->dtype, (int64_t)table[i + 1] * bs * kvh, d) : NULL;
        for (int t = 0; t < valid; t++) {
            if (ahead) prefetch_span(ahead + (int64_t)t * span, span);
            for (int h = 0; h < kvh; h++) {
                const float *k = load_row(a->kc, a->dtype, base + t * kvh + h, d, tmp);
                int g = 0;
                for (; g + 2 <= g_n; g += 2) {
                    const float *q0 = qr + (h * g_n + g) * d, *q1 = q0 + d;
                    v8f a0 = {0}, a1 = {0};
                    for (int j = 0; j < d; j += 8) {
                        const v8f kj = ld8(k + j);
                        a0 += ld8(q0 + j) * kj;
                        a1 += ld8(q1 + j) * kj;
                    }
                    s[(h * g_n + g) * RUN_TOKENS + n + t] = hsum8(a0) * a->scale;
                    s[(h * g_n + g + 1) * RUN_TOKENS + n + t] = hsum8(a1) * a->scale;
                }
                if (g < g_n) {
                    const float *q0 = qr + (h * g_n + g) * d;
                    v8f a0 = {0};
                    for (int j = 0; j < d; j += 8) a0 += ld8(q0 + j) * ld8(k + j);
                    s[(h * g_n + g) * RUN_TOKENS + n + t] = hsum8(a0) * a->scale;
                }
            }
        }
        n += valid;
    }
    run_softmax(s, n, heads, d, part, a->stats, b, i0, i1, len, bs, a->max_blocks);
    /* values: out_hq += p_hq[n] * v_n, two tokens at a time */
    n = 0;
    for (int i = i0; i < i1; i++) {
        const int start = i * bs, valid = len - start < bs ? len - start : bs;
        const int64_t base = (int64_t)table[i] * bs * kvh;
        const char *ahead = i + 1 < i1 ? row_addr(a->vc, a->dtype, (int64_t)table[i + 1] * bs * kvh, d) : NULL;
        int t = 0;
        for (; t + 2 <= valid; t += 2) {
            if (ahead) prefetch_span(ahead + (int64_t)t * span, 2 * span);
            for (int h = 0; h < kvh; h++) {
                float tmp1[MAX_D];
                const float *v0 = load_row(a->vc, a->dtype, base + t * kvh + h, d, tmp);
                const float *v1 = load_row(a->vc, a->dtype, base + (t + 1) * kvh + h, d, tmp1);
                for (int g = 0; g < g_n; g++) {
                    const int hq = h * g_n + g;
                    const float w0 = s[hq * RUN_TOKENS + n + t], w1 = s[hq * RUN_TOKENS + n + t + 1];
                    float *o = part + hq * row_stride + 2;
                    for (int j = 0; j < d; j += 8) st8(o + j, ld8(o + j) + (w0 * ld8(v0 + j) + w1 * ld8(v1 + j)));
                }
            }
        }
        for (; t < valid; t++) {
            for (int h = 0; h < kvh; h++) {
                const float *v0 = load_row(a->vc, a->dtype, base + t * kvh + h, d, tmp);
                for (int g = 0; g < g_n; g++) {
                    const int hq = h * g_n + g;
                    const float w0 = s[hq * RUN_TOKENS + n + t];
                    float *o = part + hq * row_stride + 2;
                    for (int j = 0; j < d; j += 8) st8(o + j, ld8(o + j) + w0 * ld8(v0 + j));
                }
            }
        }
        n += valid;
    }
}

static void run_item(const void *args, int b, int i0, int i1, float *part) {
    run_blocks((const Args *)args, b, i0, i1, part);
}

/* Returns 0, or -1 when a shape is past this kernel's fixed limits (the caller falls back). */
int paged_decode(const float *q, const void *kc, const void *vc, int dtype, const int32_t *tables,
                 int64_t table_stride, const int32_t *seq_lens, const float *cos, const float *sin,
                 float *out, float *block_mass, int64_t mass_stride, float *partial, float *stats,
                 int num_seqs, int heads, int kv_heads, int d, int bs, int max_blocks, int chunk,
                 float scale) {
    if (heads > MAX_H || heads * d > MAX_HD || d > MAX_D || d % 8 || chunk < 1 || chunk * bs > RUN_TOKENS ||
        heads % kv_heads)
        return -1;
    Args a = {q, kc, vc, dtype, tables, table_stride, seq_lens, cos, sin, heads, kv_heads, d, bs,
              max_blocks, chunk, scale, partial, block_mass ? stats : NULL};
    const int runs_max = (max_blocks + chunk - 1) / chunk;
    /* waking the other threads costs more than a few dozen blocks of work (OMP_WAIT_POLICY=passive) */
    const int parallel = blocks_in(seq_lens, num_seqs, bs) * kv_heads >= 96;
    run_items(run_item, &a, seq_lens, num_seqs, bs, chunk, runs_max, (int64_t)heads * (d + 2), partial, parallel);
#pragma omp parallel for schedule(static) if (parallel && num_seqs > 1)
    for (int b = 0; b < num_seqs; b++)
        merge_runs(b, seq_lens, heads, d, bs, chunk, runs_max, max_blocks, partial, stats, out, block_mass,
                   mass_stride);
    return 0;
}

/* ---- skinny products: out (M, N) = x (M, K) @ w (N, K)^T for the few rows of a decode step ----
 *
 * A decode step multiplies one row per sequence by every weight matrix: the weights are read once
 * per step and the arithmetic is small, so the product should run at memory speed. MKL's sgemm
 * reached 7.5 GB/s on the bundled model's output head at one row and 2.8 GB/s at sixteen (this
 * 2-core EPYC: `bench/step.py`), a third of what the machine streams. Here each thread takes runs
 * of four weight rows, reads them from memory once (prefetching the next run), and multiplies them
 * against the M rows of x, two at a time from cache: a 2 x 4 tile of eight-lane accumulators. */
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

/* ---- grouped-integer products: the 4-bit (and 8-bit) weights as stored, for a decode step's rows ----
 *
 * W[r, g*32 + j] = (c - offset) * scale[r, g] + zero[r, g], groups of 32 along K:
 *   bits 4: q (N, K/2) bytes, group g of row r at byte r*K/2 + g*16, low nibbles = elements 0..15,
 *           high nibbles = 16..31 (GGML's Q4 payload), offset 8;
 *   bits 8: q (N, K) int8, offset 0, zero NULL.
 * Each group's codes are widened to floats once and used for all M rows of x. */
#define MAX_ROWS 32

static inline void unpack_group(const void *q, int bits, int64_t row, int k, int g, v8f w[4]) {
    const v8f eight = {8, 8, 8, 8, 8, 8, 8, 8};
#if defined(__AVX2__)
    /* GCC widens bytes to floats one lane at a time through the vector extensions: AVX2 directly */
    if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + row * (k / 2) + g * 16));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        w[0] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)) - eight;
        w[1] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))) - eight;
        w[2] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)) - eight;
        w[3] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))) - eight;
    } else {
        const int8_t *p = (const int8_t *)q + row * k + g * 32;
        for (int u = 0; u < 4; u++)
            w[u] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * u))));
    }
#else
    float f[32];
    if (bits == 4) {
        const uint8_t *p = (const uint8_t *)q + row * (k / 2) + g * 16;
        for (int j = 0; j < 16; j++) {
            f[j] = (float)(p[j] & 15);
            f[j + 16] = (float)(p[j] >> 4);
        }
    } else {
        const int8_t *p = (const int8_t *)q + row * k + g * 32;
        for (int j = 0; j < 32; j++) f[j] = (float)p[j];
    }
    for (int u = 0; u < 4; u++) w[u] = ld8(f + 8 * u) - (bits == 4 ? eight : (v8f){0});
#endif
}

/* Returns -1 when m > MAX_ROWS or k is not a multiple of 32 (the caller falls back).
 *
 * Each thread takes panels of PANEL weight rows and walks K in chunks of KCHUNK: it widens the panel's
 * chunk to floats, (c - offset) * scale + zero, into a buffer that stays in L1, then multiplies it
 * against every pair of x rows with skinny_linear's 2 x 4 tile. x is read once per panel rather than
 * once per weight row: at sixteen rows x is 36 KB (more than L1) for a 576-wide matrix, and walking it
 * per weight row made the products wait on L2. */
#define FEW_ROWS 2 /* up to here group_linear_direct */
#define MAX_K 65536
/* A few rows (a single session's decode): each thread takes whole weight rows and multiplies every
 * group straight from its widened codes, with no buffer: at one row the panel's L1 buffer and the
 * tile's pairs of rows only add work. The zero term is the zero times the row's group sum. */
static void group_linear_direct(const float *x, const void *q, int bits, const float *scale, const float *zero,
                                float *out, const float *xsum, int m, int n, int k) {
    const int groups = k / 32;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; r++) {
        v8f acc[FEW_ROWS];
        float zs[FEW_ROWS];
        for (int i = 0; i < m; i++) {
            acc[i] = (v8f){0};
            zs[i] = 0.0f;
        }
        for (int g = 0; g < groups; g++) {
            v8f w[4];
            unpack_group(q, bits, r, k, g, w);
            const float sc = scale[(int64_t)r * groups + g];
            for (int i = 0; i < m; i++) {
                const float *xi = x + (int64_t)i * k + g * 32;
                acc[i] += sc * (ld8(xi) * w[0] + ld8(xi + 8) * w[1] + ld8(xi + 16) * w[2] + ld8(xi + 24) * w[3]);
            }
            if (zero) {
                const float z = zero[(int64_t)r * groups + g];
                for (int i = 0; i < m; i++) zs[i] += z * xsum[i * groups + g];
            }
        }
        for (int i = 0; i < m; i++) out[(int64_t)i * n + r] = hsum8(acc[i]) + zs[i];
    }
}

#define PANEL 8
#define KCHUNK 512
int group_linear(const float *x, const void *q, int bits, const float *scale, const float *zero, float *out,
                 int m, int n, int k) {
    if (m > MAX_ROWS || k % 32 || (bits != 4 && bits != 8)) return -1;
    const int groups = k / 32, panels = (n + PANEL - 1) / PANEL;
    if (m <= FEW_ROWS) {
        float xsum[FEW_ROWS * (MAX_K / 32)];
        if (k > MAX_K) return -1;
        if (zero)
            for (int i = 0; i < m; i++)
                for (int g = 0; g < groups; g++) {
                    const float *xi = x + (int64_t)i * k + g * 32;
                    xsum[i * groups + g] = hsum8(ld8(xi) + ld8(xi + 8) + ld8(xi + 16) + ld8(xi + 24));
                }
        group_linear_direct(x, q, bits, scale, zero, out, xsum, m, n, k);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        const int r0 = p * PANEL;
        float wbuf[PANEL][KCHUNK], acc[MAX_ROWS][PANEL];
        memset(acc, 0, sizeof acc);
        for (int k0 = 0; k0 < k; k0 += KCHUNK) {
            const int kc = k - k0 < KCHUNK ? k - k0 : KCHUNK;
            for (int c = 0; c < PANEL; c++) {
                const int r = r0 + c < n ? r0 + c : n - 1;  /* past n: a copy of the last row, not written */
                for (int g = k0 / 32; g < (k0 + kc) / 32; g++) {
                    v8f w[4];
                    unpack_group(q, bits, r, k, g, w);
                    const float sc = scale[(int64_t)r * groups + g], z = zero ? zero[(int64_t)r * groups + g] : 0.0f;
                    for (int u = 0; u < 4; u++) st8(&wbuf[c][g * 32 - k0 + 8 * u], w[u] * sc + z);
                }
            }
            for (int half = 0; half < PANEL; half += 4) {
                const float *rows[4] = {wbuf[half], wbuf[half + 1], wbuf[half + 2], wbuf[half + 3]};
                for (int i = 0; i < m; i += 2) {
                    const int pair = i + 1 < m;
                    float o0[4], o1[4];
                    tile(x + (int64_t)i * k + k0, x + (int64_t)(i + pair) * k + k0, rows, kc, o0, o1);
                    for (int c = 0; c < 4; c++) {
                        acc[i][half + c] += o0[c];
                        if (pair) acc[i + 1][half + c] += o1[c];
                    }
                }
            }
        }
        for (int i = 0; i < m; i++)
            for (int c = 0; c < PANEL && r0 + c < n; c++) out[(int64_t)i * n + r0 + c] = acc[i][c];
    }
    return 0;
}

/* W as float32 (N, K), exactly as torch computes (c - offset) * scale + zero: a product, then a sum,
 * each rounded (no fused multiply-add), so a prefill through it matches the dense weights bit for bit. */
__attribute__((optimize("fp-contract=off"))) void group_dequantize(const void *q, int bits, const float *scale,
                                                                   const float *zero, float *out, int n, int k) {
    const int groups = k / 32;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < n; r++)
        for (int g = 0; g < groups; g++) {
            v8f w[4];
            unpack_group(q, bits, r, k, g, w);
            const float s = scale[(int64_t)r * groups + g], z = zero ? zero[(int64_t)r * groups + g] : 0.0f;
            for (int u = 0; u < 4; u++) {
                v8f t = w[u] * s;
                if (zero) t = t + z;
                st8(out + (int64_t)r * k + g * 32 + 8 * u, t);
            }
        }
}

/* ---- the small per-token operations of a decode step, without a parallel region each ---- */

/* out (m, k) = w * x / sqrt(mean(x^2) + eps), row by row (x and out may be the same). */
void rms_norm(const float *x, const float *w, float *out, int m, int k, float eps) {
    for (int i = 0; i < m; i++) {
        const float *xi = x + (int64_t)i * k;
        float *oi = out + (int64_t)i * k;
        v8f acc = {0};
        int j = 0;
        for (; j + 8 <= k; j += 8) {
            const v8f v = ld8(xi + j);
            acc += v * v;
        }
        float ss = hsum8(acc);
        for (; j < k; j++) ss += xi[j] * xi[j];
        const float inv = 1.0f / sqrtf(ss / (float)k + eps);
        for (j = 0; j < k; j++) oi[j] = w[j] * (xi[j] * inv);
    }
}

/* Scatter t tokens' keys and values (t, kv_heads, d) float32 into their slots of a float pool
 * (dtype 0/1/2 as paged_decode's), each key rotated by its offset in its block (slot % bs) as
 * reference.write_kv does: x * cos, then each half takes its partner times sin. */
__attribute__((optimize("fp-contract=off"))) void write_kv(const float *key, const float *value, void *kc,
                                                           void *vc, int dtype, const int64_t *slots,
                                                           const float *cos, const float *sin, int t, int kv_heads,
                                                           int d, int bs) {
    const int half = d / 2;
    float rot[MAX_D];
    for (int i = 0; i < t; i++) {
        const int64_t slot = slots[i];
        const float *c = cos + (slot % bs) * d, *s = sin + (slot % bs) * d;
        for (int h = 0; h < kv_heads; h++) {
            const float *k = key + ((int64_t)i * kv_heads + h) * d, *v = value + ((int64_t)i * kv_heads + h) * d;
            for (int j = 0; j < half; j++) {
                rot[j] = k[j] * c[j] - k[j + half] * s[j];
                rot[j + half] = k[j + half] * c[j + half] + k[j] * s[j];
            }
            const int64_t at = (slot * kv_heads + h) * d;
            if (dtype == 0) {
                memcpy((float *)kc + at, rot, sizeof(float) * d);
                memcpy((float *)vc + at, v, sizeof(float) * d);
            } else if (dtype == 1) {  /* round to nearest even, as torch's float -> bfloat16 */
                uint16_t *kb = (uint16_t *)kc + at, *vb = (uint16_t *)vc + at;
                for (int j = 0; j < d; j++) {
                    uint32_t u, w;
                    memcpy(&u, rot + j, 4);
                    memcpy(&w, v + j, 4);
                    kb[j] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
                    vb[j] = (uint16_t)((w + 0x7FFF + ((w >> 16) & 1)) >> 16);
                }
            } else {
                _Float16 *kh = (_Float16 *)kc + at, *vh = (_Float16 *)vc + at;
                for (int j = 0; j < d; j++) {
                    kh[j] = (_Float16)rot[j];
                    vh[j] = (_Float16)v[j];
                }
            }
        }
    }
}
