/* Paged MLA decode on CPU: one absorbed query per sequence, read from the latent pool where it lies.
 *
 * What mla_reference.py `decode` computes, without its gather of every sequence's rows into a workspace
 * per layer. Layouts (the reference's):
 *
 *   cache           (num_blocks, block_size, C + R) float32, bfloat16 or float16 (`dtype` 0, 1, 2):
 *                   a token's row [c | R(offset) k_r]
 *   q               (B, H, C + R) float32: [q_c | q_r], q_r unrotated
 *   out             (B, H, C) float32: attention over c (the caller applies W_UV)
 *   block_tables    (B, table_stride) int32; seq_lens (B,) int32
 *   cos, sin        (max_pos, R) float32, rotate-half layout
 *   block_mass      (B, mass_stride) float32 or NULL: ADDS each block's probability summed over heads
 *
 * Work: one item per (sequence, run of `chunk` blocks, chunk x block_size <= RUN_TOKENS), over the
 * process's OpenMP threads. Every head reads the same row a token; sixteen heads' queries (37 KB at
 * C + R = 576) and outputs (33 KB) do not fit a 32 KB L1 beside the rows, so each block is walked once per
 * group of four heads: the score pass takes two rows a pass against the group's queries (eight independent
 * sums), with q_r rotated per block by (query position - block start); one softmax per head covers the
 * run; the value pass adds p x c into the group's four outputs, two rows a pass. Walking each row against
 * all sixteen heads (two at a time) took 46 ms where this takes 34 (16 x 2048 tokens, measured).
 * The split into runs and their merge are cpu_decode.c's (cpu_common.h). `partial` holds
 * B * ceil(max_blocks / chunk) items of H * (C + 2) floats; `stats` (only with block_mass)
 * B * H * max_blocks * 2 floats.
 */
#include "cpu_common.h"

#include <stdlib.h>

#define MLA_MAX_H 128      /* query heads */
#define MLA_MAX_W 1024     /* C + R */
#define MLA_MAX_R 128      /* rotary dims */

typedef struct {
    const float *q;
    const void *cache;
    int dtype;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    const float *cos, *sin;
    int heads, c, r, bs, max_blocks, chunk;
    float scale;
    float *stats;
} MlaArgs;

/* q_r of every head rotated by `delta` (rotate-half), into qr (heads x R). */
static void rotate_queries(const MlaArgs *a, int b, int delta, float *qr) {
    const int w = a->c + a->r, half = a->r / 2;
    const float *cs = a->cos + (int64_t)delta * a->r, *sn = a->sin + (int64_t)delta * a->r;
    for (int h = 0; h < a->heads; h++) {
        const float *qv = a->q + ((int64_t)b * a->heads + h) * w + a->c;
        float *o = qr + h * a->r;
#pragma omp simd
        for (int j = 0; j < half; j++) {
            o[j] = qv[j] * cs[j] - qv[j + half] * sn[j];
            o[j + half] = qv[j + half] * cs[j + half] + qv[j] * sn[j];
        }
    }
}

/* A block's rows as float32: the pool's own when it is float32, else widened into `buf` (bs x (C + R)). */
static void block_rows(const MlaArgs *a, int64_t first, int valid, float *buf, const float **rows) {
    const int w = a->c + a->r;
    for (int t = 0; t < valid; t++) rows[t] = load_row(a->cache, a->dtype, first + t, w, buf + (int64_t)t * w);
}

/* Scores of a block's rows against four heads q[0..3] (their q_c, and q_r as this block sees it): two rows
 * a pass, eight independent sums (fewer leave the adds waiting on each other's latency); four heads' queries
 * (9 KB at C + R = 576) stay in L1 while the rows stream past. out[k * RUN_TOKENS + t]. */
static void score_block(const MlaArgs *a, const float *const q[4], const float *const r[4], const float **rows,
                        int valid, float *out) {
    for (int t = 0; t < valid; t += 2) {
        const int two = t + 1 < valid;
        const float *x0 = rows[t], *x1 = two ? rows[t + 1] : rows[t];
        v8f acc[4][2] = {{{0}}};
        for (int j = 0; j < a->c; j += 8) {
            const v8f c0 = ld8(x0 + j), c1 = ld8(x1 + j);
            for (int k = 0; k < 4; k++) {
                const v8f qk = ld8(q[k] + j);
                acc[k][0] += qk * c0;
                acc[k][1] += qk * c1;
            }
        }
        for (int j = 0; j < a->r; j += 8) {
            const v8f k0 = ld8(x0 + a->c + j), k1 = ld8(x1 + a->c + j);
            for (int k = 0; k < 4; k++) {
                const v8f rk = ld8(r[k] + j);
                acc[k][0] += rk * k0;
                acc[k][1] += rk * k1;
            }
        }
        for (int k = 0; k < 4; k++) {
            out[k * RUN_TOKENS + t] = hsum8(acc[k][0]) * a->scale;
            if (two) out[k * RUN_TOKENS + t + 1] = hsum8(acc[k][1]) * a->scale;
        }
    }
}

/* out_k += sum_t p_k[t] c_t for four heads' outputs (8 KB, in L1) over a block's rows, two rows a pass. */
static void values_block(const MlaArgs *a, const float *const p[4], float *const o[4], const float **rows,
                         int valid) {
    for (int t = 0; t < valid; t += 2) {
        const int two = t + 1 < valid;
        const float *c0 = rows[t], *c1 = two ? rows[t + 1] : rows[t];
        float w0[4], w1[4];
        for (int k = 0; k < 4; k++) {
            w0[k] = p[k][t];
            w1[k] = two ? p[k][t + 1] : 0.0f;
        }
        for (int j = 0; j < a->c; j += 8) {
            const v8f x0 = ld8(c0 + j), x1 = ld8(c1 + j);
            for (int k = 0; k < 4; k++) st8(o[k] + j, ld8(o[k] + j) + (w0[k] * x0 + w1[k] * x1));
        }
    }
}

/* Head group g's pointers (four heads from 4g; past the last head: the last again, its results dropped
 * into `spare` rows, so every pass takes four). */
static int group_heads(const MlaArgs *a, int g, int *hk) {
    const int last = a->heads - 1;
    for (int k = 0; k < 4; k++) hk[k] = 4 * g + k < last ? 4 * g + k : last;
    return a->heads - 4 * g < 4 ? a->heads - 4 * g : 4;
}

/* One run of blocks [i0, i1) of sequence b, every head: max, sum and unnormalised output in `part`. */
static void mla_run(const MlaArgs *a, int b, int i0, int i1, float *part) {
    const int w = a->c + a->r, len = a->seq_lens[b], bs = a->bs, groups = (a->heads + 3) / 4;
    float qr[MLA_MAX_H * MLA_MAX_R], s[(MLA_MAX_H + 4) * RUN_TOKENS], spare[4 * MLA_MAX_W];
    /* bf16/fp16 rows widened once a block; a malloc of bs x (C + R) floats (at most 256 KB) that fails means
     * the process is out of memory, where torch would fail as well */
    float *buf = a->dtype == 0 ? NULL : malloc(sizeof(float) * (size_t)bs * w);
    const float *rows[RUN_TOKENS];
    const int32_t *table = a->tables + (int64_t)b * a->table_stride;
    const float *qc = a->q + (int64_t)b * a->heads * w;
    int n = 0, hk[4];
    for (int i = i0; i < i1; i++) {  /* scores: s[h * RUN_TOKENS + token] */
        const int valid = len - i * bs < bs ? len - i * bs : bs;
        rotate_queries(a, b, len - 1 - i * bs, qr);  /* the query as this block sees it */
        block_rows(a, (int64_t)table[i] * bs, valid, buf, rows);
        for (int g = 0; g < groups; g++) {
            const int used = group_heads(a, g, hk);
            const float *q[4], *r[4];
            for (int k = 0; k < 4; k++) {
                q[k] = qc + (int64_t)hk[k] * w;
                r[k] = qr + (int64_t)hk[k] * a->r;
            }
            float out[4 * RUN_TOKENS];
            score_block(a, q, r, rows, valid, out);
            for (int k = 0; k < used; k++) memcpy(s + (4 * g + k) * RUN_TOKENS + n, out + k * RUN_TOKENS,
                                                  sizeof(float) * valid);
        }
        n += valid;
    }
    run_softmax(s, n, a->heads, a->c, part, a->stats, b, i0, i1, len, bs, a->max_blocks);
    n = 0;  /* values: out_h += p_h[t] c_t */
    for (int i = i0; i < i1; i++) {
        const int valid = len - i * bs < bs ? len - i * bs : bs;
        block_rows(a, (int64_t)table[i] * bs, valid, buf, rows);
        for (int g = 0; g < groups; g++) {
            const int used = group_heads(a, g, hk);
            const float *p[4];
            float *o[4];
            for (int k = 0; k < 4; k++) {
                p[k] = s + hk[k] * RUN_TOKENS + n;
                o[k] = k < used ? part + (int64_t)hk[k] * (a->c + 2) + 2 : spare + k * MLA_MAX_W;
            }
            values_block(a, p, o, rows, valid);
        }
        n += valid;
    }
    free(buf);
}

static void mla_item(const void *args, int b, int i0, int i1, float *part) {
    mla_run((const MlaArgs *)args, b, i0, i1, part);
}

/* Returns 0, or -1 when a shape is past this kernel's fixed limits (the caller falls back). */
int mla_decode(const float *q, const void *cache, int dtype, const int32_t *tables, int64_t table_stride,
               const int32_t *seq_lens, const float *cos, const float *sin, float *out, float *block_mass,
               int64_t mass_stride, float *partial, float *stats, int num_seqs, int heads, int c, int r, int bs,
               int max_blocks, int chunk, float scale) {
    if (heads > MLA_MAX_H || c + r > MLA_MAX_W || r > MLA_MAX_R || c % 16 || r % 8 || chunk < 1 ||
        chunk * bs > RUN_TOKENS)
        return -1;
    MlaArgs a = {q, cache, dtype, tables, table_stride, seq_lens, cos, sin, heads, c, r, bs, max_blocks, chunk,
                 scale, block_mass ? stats : NULL};
    const int runs_max = (max_blocks + chunk - 1) / chunk;
    /* waking the other threads costs more than a few blocks of work (OMP_WAIT_POLICY=passive) */
    const int parallel = blocks_in(seq_lens, num_seqs, bs) * heads >= 96;
    run_items(mla_item, &a, seq_lens, num_seqs, bs, chunk, runs_max, (int64_t)heads * (c + 2), partial, parallel);
#pragma omp parallel for schedule(static) if (parallel && num_seqs > 1)
    for (int b = 0; b < num_seqs; b++)
        merge_runs(b, seq_lens, heads, c, bs, chunk, runs_max, max_blocks, partial, stats, out, block_mass,
                   mass_stride);
    return 0;
}
