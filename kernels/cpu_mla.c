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
 * process's OpenMP threads. Every head reads the same row a token, so an item reads each row once for
 * all H heads: the score pass walks the run's rows scoring two heads at a time against the row (in L1),
 * with q_r rotated per block by (query position - block start); one softmax per head covers the run;
 * the value pass walks the rows again, two tokens at a time, adding p x c into each head's output.
 * The split into runs and their merge are cpu_decode.c's (cpu_common.h). `partial` holds
 * B * ceil(max_blocks / chunk) items of H * (C + 2) floats; `stats` (only with block_mass)
 * B * H * max_blocks * 2 floats.
 */
#include "cpu_common.h"

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

/* Scores of one row against every head: s[h * RUN_TOKENS + n] = scale (q_c . c + q_r' . k_r). */
static void score_row(const MlaArgs *a, const float *qc, const float *qr, const float *row, float *s, int n) {
    const int w = a->c + a->r;
    const float *kr = row + a->c;
    for (int h = 0; h < a->heads; h += 2) {
        const int two = h + 1 < a->heads;
        const float *q0 = qc + (int64_t)h * w, *q1 = two ? q0 + w : q0;
        v8f a0 = {0}, a1 = {0};
        for (int j = 0; j < a->c; j += 8) {
            const v8f x = ld8(row + j);
            a0 += ld8(q0 + j) * x;
            a1 += ld8(q1 + j) * x;
        }
        const float *r0 = qr + h * a->r, *r1 = two ? r0 + a->r : r0;
        for (int j = 0; j < a->r; j += 8) {
            const v8f x = ld8(kr + j);
            a0 += ld8(r0 + j) * x;
            a1 += ld8(r1 + j) * x;
        }
        s[h * RUN_TOKENS + n] = hsum8(a0) * a->scale;
        if (two) s[(h + 1) * RUN_TOKENS + n] = hsum8(a1) * a->scale;
    }
}

/* One run of blocks [i0, i1) of sequence b, every head: max, sum and unnormalised output in `part`. */
static void mla_run(const MlaArgs *a, int b, int i0, int i1, float *part) {
    const int w = a->c + a->r, len = a->seq_lens[b], bs = a->bs;
    const int64_t span = (int64_t)w * (a->dtype == 0 ? 4 : 2);  /* a row's bytes */
    float qr[MLA_MAX_H * MLA_MAX_R], s[MLA_MAX_H * RUN_TOKENS], tmp[MLA_MAX_W], tmp1[MLA_MAX_W];
    const int32_t *table = a->tables + (int64_t)b * a->table_stride;
    const float *qc = a->q + (int64_t)b * a->heads * w;
    int n = 0;
    for (int i = i0; i < i1; i++) {
        const int start = i * bs, valid = len - start < bs ? len - start : bs;
        rotate_queries(a, b, len - 1 - start, qr);  /* the query as this block sees it */
        const int64_t base = (int64_t)table[i] * bs;
        const char *ahead = i + 1 < i1 ? row_addr(a->cache, a->dtype, (int64_t)table[i + 1] * bs, w) : NULL;
        for (int t = 0; t < valid; t++) {
            if (ahead) prefetch_span(ahead + t * span, span);
            score_row(a, qc, qr, load_row(a->cache, a->dtype, base + t, w, tmp), s, n + t);
        }
        n += valid;
    }
    run_softmax(s, n, a->heads, a->c, part, a->stats, b, i0, i1, len, bs, a->max_blocks);
    n = 0;  /* values: out_h += p_h[t] c_t, two rows at a time */
    for (int i = i0; i < i1; i++) {
        const int valid = len - i * bs < bs ? len - i * bs : bs;
        const int64_t base = (int64_t)table[i] * bs;
        for (int t = 0; t < valid; t += 2) {
            const int two = t + 1 < valid;
            const float *c0 = load_row(a->cache, a->dtype, base + t, w, tmp);
            const float *c1 = two ? load_row(a->cache, a->dtype, base + t + 1, w, tmp1) : c0;
            for (int h = 0; h < a->heads; h++) {
                const float w0 = s[h * RUN_TOKENS + n + t], w1 = two ? s[h * RUN_TOKENS + n + t + 1] : 0.0f;
                float *o = part + (int64_t)h * (a->c + 2) + 2;
                for (int j = 0; j < a->c; j += 8) st8(o + j, ld8(o + j) + (w0 * ld8(c0 + j) + w1 * ld8(c1 + j)));
            }
        }
        n += valid;
    }
}

static void mla_item(const void *args, int b, int i0, int i1, float *part) {
    mla_run((const MlaArgs *)args, b, i0, i1, part);
}

/* Returns 0, or -1 when a shape is past this kernel's fixed limits (the caller falls back). */
int mla_decode(const float *q, const void *cache, int dtype, const int32_t *tables, int64_t table_stride,
               const int32_t *seq_lens, const float *cos, const float *sin, float *out, float *block_mass,
               int64_t mass_stride, float *partial, float *stats, int num_seqs, int heads, int c, int r, int bs,
               int max_blocks, int chunk, float scale) {
    if (heads > MLA_MAX_H || c + r > MLA_MAX_W || r > MLA_MAX_R || c % 8 || r % 8 || chunk < 1 ||
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
