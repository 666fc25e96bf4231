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
 *                           float32, bfloat16 or float16 (`dtype` 0, 1, 2), or int8 / float8
 *                           e4m3fn (3, 4) with their scales (`paged_decode_quantized`):
 *   k_scale, v_scale        (num_blocks, block_size, num_kv_heads) float32, one per stored row
 *                           (token, KV head), which reads as codes.float() * scale (quant.py)
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
 * A quantized row's codes are widened into float32 as they are read
 * (`load_codes`) and its scale applied once: to the key's score, and to the
 * value's softmax weight. The same passes, prefetches (the next block's
 * scales too) and mass as a float pool's; int8 reads a quarter of the bytes. With AVX-512 an int8 pool
 * of head_dim 64 takes passes of its own (`keys_i8_d64`, `values_i8_d64`), widened in registers.
 *
 * `partial` holds B * ceil(max_blocks / chunk) items of
 * H * (head_dim + 2) floats; `stats` (only with block_mass) B * num_kv_heads
 * * G * max_blocks * 2 floats: each block's sum of exponentials and the max
 * it is taken against (its run's).
 */
#include "cpu_common.h"
#include "cpu_decode.h"

#define MAX_D 256
#define MAX_H 128         /* query heads */
#define MAX_HD 8192       /* query heads x head_dim */

typedef struct {
    const float *q;
    const void *kc, *vc;
    int dtype;
    const float *ks, *vs;  /* the rows' scales (quantized pools), else NULL */
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    const float *cos, *sin;
    int heads, kv_heads, d, bs, max_blocks, chunk;
    float scale;
    float *partial, *stats;
} Args;

#if defined(__AVX512F__)
/* ---- int8 pools with head_dim 64 (the bundled model's) under AVX-512: each row of codes widened into four
 * 16-float registers and used from there, four tokens at a time. The generic passes widen a row into a
 * scratch array and read it back once per query head, reduce each score with a horizontal sum of its own,
 * and load, add to and store a head's output for every token (their stores were the value pass's limit).
 * Here four tokens' scores of a query head are reduced together (three shuffles and two adds for four
 * sums) and four tokens' values go into an output held in a register between one load and one store.
 * One layer of 16 sessions x 2,060 tokens, `python bench/cpu_kernels.py --int8 --against OLD.c` on the
 * 2-core EPYC: 1.89 -> 0.98 ms with the blocks scattered over the pool, 1.71 -> 0.82 ms in cache. The
 * sums are taken in another order than the generic passes' (outputs within 5.2e-8 of theirs there), and
 * in the same order in every batch. */

static inline __m512 widen16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The four lane sums of a, b, c, d, in lanes 0, 4, 8 and 12. */
static inline __m512 sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
}

/* Rows t .. t + m - 1 of one block for KV head h, widened to floats (r), and their scales times mul (sc). */
static inline __attribute__((always_inline)) void rows_i8_d64(const void *cache, const float *scales, float mul,
                                                              int64_t base, int kvh, int h, int t, const int m,
                                                              __m512 r[4][4], float sc[4]) {
    for (int u = 0; u < m; u++) {
        const int64_t row = base + (int64_t)(t + u) * kvh + h;
        for (int j = 0; j < 4; j++) r[u][j] = widen16((const int8_t *)cache + row * 64 + 16 * j);
        sc[u] = mul * scales[row];
    }
}

/* Scores of tokens t .. t + m - 1 of one block (m: 4, or 1 for the block's last one to three) for every
 * query head: s[hq * RUN_TOKENS + t] (s offset to the block). */
static inline __attribute__((always_inline)) void keys_i8_d64_pass(const Args *a, const float *qr, int64_t base,
                                                                   int t, const int m, float *s) {
    const int kvh = a->kv_heads, g_n = a->heads / kvh;
    for (int h = 0; h < kvh; h++) {
        __m512 k[4][4];
        float sc[4];
        rows_i8_d64(a->kc, a->ks, a->scale, base, kvh, h, t, m, k, sc);
        for (int g = 0; g < g_n; g++) {
            const float *q = qr + (h * g_n + g) * 64;
            const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
            const __m512 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
            __m512 acc[4];
            for (int u = 0; u < m; u++)
                acc[u] = _mm512_fmadd_ps(q3, k[u][3], _mm512_fmadd_ps(q2, k[u][2], _mm512_fmadd_ps(
                    q1, k[u][1], _mm512_mul_ps(q0, k[u][0]))));
            for (int u = m; u < 4; u++) acc[u] = acc[0];  /* lanes nobody reads */
            float lanes[16];
            _mm512_storeu_ps(lanes, sums4(acc[0], acc[1], acc[2], acc[3]));
            float *out = s + (h * g_n + g) * RUN_TOKENS + t;
            for (int u = 0; u < m; u++) out[u] = lanes[4 * u] * sc[u];
        }
    }
}

/* Scores of one block's `valid` tokens for every query head. */
static void keys_i8_d64(const Args *a, const float *qr, int64_t base, int valid, const char *ahead, int64_t span,
                        float *s) {
    int t = 0;
    for (; t + 4 <= valid; t += 4) {
        if (ahead) prefetch_span(ahead + (int64_t)t * span, 4 * span);
        keys_i8_d64_pass(a, qr, base, t, 4, s);
    }
    for (; t < valid; t++) {
        if (ahead) prefetch_span(ahead + (int64_t)t * span, span);
        keys_i8_d64_pass(a, qr, base, t, 1, s);
    }
}

/* Every query head's output (part rows, after their max and sum) += its softmax weights (s, offset to the
 * block) times one block's `valid` value rows: four tokens a pass, then the block's last one to three. */
static inline __attribute__((always_inline)) void values_i8_d64_pass(const Args *a, int64_t base, int t,
                                                                     const int m, const float *s, float *part) {
    const int kvh = a->kv_heads, g_n = a->heads / kvh;
    for (int h = 0; h < kvh; h++) {
        __m512 v[4][4];
        float vs[4];
        rows_i8_d64(a->vc, a->vs, 1.0f, base, kvh, h, t, m, v, vs);  /* 1 x scale: the same bits */
        for (int g = 0; g < g_n; g++) {
            const int hq = h * g_n + g;
            const float *p = s + hq * RUN_TOKENS + t;
            __m512 w[4];
            for (int u = 0; u < m; u++) w[u] = _mm512_set1_ps(p[u] * vs[u]);
            float *o = part + hq * (64 + 2) + 2;
            for (int j = 0; j < 4; j++) {
                __m512 acc = _mm512_loadu_ps(o + 16 * j);
                for (int u = 0; u < m; u++) acc = _mm512_fmadd_ps(w[u], v[u][j], acc);
                _mm512_storeu_ps(o + 16 * j, acc);
            }
        }
    }
}

static void values_i8_d64(const Args *a, int64_t base, int valid, const char *ahead, int64_t span, const float *s,
                          float *part) {
    int t = 0;
    for (; t + 4 <= valid; t += 4) {
        if (ahead) prefetch_span(ahead + (int64_t)t * span, 4 * span);
        values_i8_d64_pass(a, base, t, 4, s, part);
    }
    for (; t < valid; t++) {
        if (ahead) prefetch_span(ahead + (int64_t)t * span, span);
        values_i8_d64_pass(a, base, t, 1, s, part);
    }
}
#define I8_D64(a) ((a)->dtype == 3 && (a)->d == 64)
#else
#define I8_D64(a) 0
#endif

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
    const int64_t row_stride = d + 2, span = (int64_t)kvh * d * elem_bytes(a->dtype);  /* a token's rows */
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
        if (ahead && a->ks) prefetch_span((const char *)(a->ks + (int64_t)table[i + 1] * bs * kvh), bs * kvh * 4);
#if defined(__AVX512F__)
        if (I8_D64(a)) {
            keys_i8_d64(a, qr, base, valid, ahead, span, s + n);
            n += valid;
            continue;
        }
#endif
        for (int t = 0; t < valid; t++) {
            if (ahead) prefetch_span(ahead + (int64_t)t * span, span);
            for (int h = 0; h < kvh; h++) {
                const int64_t row = base + t * kvh + h;
                const float *k = load_codes(a->kc, a->dtype, row, d, tmp);
                const float sc = a->ks ? a->scale * a->ks[row] : a->scale;
                int g = 0;
                for (; g + 2 <= g_n; g += 2) {
                    const float *q0 = qr + (h * g_n + g) * d, *q1 = q0 + d;
                    v8f a0 = {0}, a1 = {0};
                    for (int j = 0; j < d; j += 8) {
                        const v8f kj = ld8(k + j);
                        a0 += ld8(q0 + j) * kj;
                        a1 += ld8(q1 + j) * kj;
                    }
                    s[(h * g_n + g) * RUN_TOKENS + n + t] = hsum8(a0) * sc;
                    s[(h * g_n + g + 1) * RUN_TOKENS + n + t] = hsum8(a1) * sc;
                }
                if (g < g_n) {
                    const float *q0 = qr + (h * g_n + g) * d;
                    v8f a0 = {0};
                    for (int j = 0; j < d; j += 8) a0 += ld8(q0 + j) * ld8(k + j);
                    s[(h * g_n + g) * RUN_TOKENS + n + t] = hsum8(a0) * sc;
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
        if (ahead && a->vs) prefetch_span((const char *)(a->vs + (int64_t)table[i + 1] * bs * kvh), bs * kvh * 4);
#if defined(__AVX512F__)
        if (I8_D64(a)) {
            values_i8_d64(a, base, valid, ahead, span, s + n, part);
            n += valid;
            continue;
        }
#endif
        int t = 0;
        for (; t + 2 <= valid; t += 2) {
            if (ahead) prefetch_span(ahead + (int64_t)t * span, 2 * span);
            for (int h = 0; h < kvh; h++) {
                float tmp1[MAX_D];
                const int64_t r0 = base + t * kvh + h, r1 = r0 + kvh;
                const float *v0 = load_codes(a->vc, a->dtype, r0, d, tmp);
                const float *v1 = load_codes(a->vc, a->dtype, r1, d, tmp1);
                const float s0 = a->vs ? a->vs[r0] : 1.0f, s1 = a->vs ? a->vs[r1] : 1.0f;
                for (int g = 0; g < g_n; g++) {
                    const int hq = h * g_n + g;
                    const float w0 = s[hq * RUN_TOKENS + n + t] * s0, w1 = s[hq * RUN_TOKENS + n + t + 1] * s1;
                    float *o = part + hq * row_stride + 2;
                    for (int j = 0; j < d; j += 8) st8(o + j, ld8(o + j) + (w0 * ld8(v0 + j) + w1 * ld8(v1 + j)));
                }
            }
        }
        for (; t < valid; t++) {
            for (int h = 0; h < kvh; h++) {
                const int64_t r0 = base + t * kvh + h;
                const float *v0 = load_codes(a->vc, a->dtype, r0, d, tmp), s0 = a->vs ? a->vs[r0] : 1.0f;
                for (int g = 0; g < g_n; g++) {
                    const int hq = h * g_n + g;
                    const float w0 = s[hq * RUN_TOKENS + n + t] * s0;
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

/* Returns 0, or -1 when a shape is past this kernel's fixed limits, or a quantized pool comes without
 * its scales (the caller falls back). */
int paged_decode_quantized(const float *q, const void *kc, const void *vc, int dtype, const float *k_scale,
                           const float *v_scale, const int32_t *tables, int64_t table_stride,
                           const int32_t *seq_lens, const float *cos, const float *sin, float *out,
                           float *block_mass, int64_t mass_stride, float *partial, float *stats, int num_seqs,
                           int heads, int kv_heads, int d, int bs, int max_blocks, int chunk, float scale) {
    if (heads > MAX_H || heads * d > MAX_HD || d > MAX_D || d % 8 || chunk < 1 || chunk * bs > RUN_TOKENS ||
        heads % kv_heads || dtype < 0 || dtype > 4 || (dtype >= 3 && (!k_scale || !v_scale)))
        return -1;
    Args a = {q, kc, vc, dtype, k_scale, v_scale, tables, table_stride, seq_lens, cos, sin, heads, kv_heads, d,
              bs, max_blocks, chunk, scale, partial, block_mass ? stats : NULL};
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

/* A float pool (dtype 0, 1, 2): the entry point before quantized pools, kept for its callers. */
int paged_decode(const float *q, const void *kc, const void *vc, int dtype, const int32_t *tables,
                 int64_t table_stride, const int32_t *seq_lens, const float *cos, const float *sin,
                 float *out, float *block_mass, int64_t mass_stride, float *partial, float *stats,
                 int num_seqs, int heads, int kv_heads, int d, int bs, int max_blocks, int chunk,
                 float scale) {
    if (dtype > 2) return -1;
    return paged_decode_quantized(q, kc, vc, dtype, NULL, NULL, tables, table_stride, seq_lens, cos, sin, out,
                                  block_mass, mass_stride, partial, stats, num_seqs, heads, kv_heads, d, bs,
                                  max_blocks, chunk, scale);
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

/* A key rotated by its block offset's rope row (c, s): x * cos, then each half takes its partner times
 * sin, each product rounded (no fused multiply-add), as reference.rotate computes it. */
__attribute__((optimize("fp-contract=off"))) static inline void rotate_key(const float *k, const float *c,
                                                                          const float *s, int d, float *rot) {
    const int half = d / 2;
    for (int j = 0; j < half; j++) {
        rot[j] = k[j] * c[j] - k[j + half] * s[j];
        rot[j + half] = k[j + half] * c[j + half] + k[j] * s[j];
    }
}

/* One row into int8 codes and its scale, exactly as quant.quantize computes them: scale = max|x| / 127
 * (1 for a row of zeros), codes x / scale rounded half away from zero, clamped to +-127. */
static inline void quantize_row_int8(const float *x, int d, int8_t *q, float *scale) {
    float amax = 0.0f;
    for (int j = 0; j < d; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float sc = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int j = 0; j < d; j++) {
        const float y = x[j] / sc, r = y >= 0.0f ? floorf(y + 0.5f) : ceilf(y - 0.5f);
        q[j] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    *scale = sc;
}

/* A pool row (`row`: slot * kv_heads + head) of d values stored as the pool's dtype (0/1/2, or 3: int8
 * with its scale at ks[row]). */
static inline void store_row(void *pool, int dtype, float *ks, int64_t row, const float *x, int d) {
    const int64_t at = row * d;
    if (dtype == 0) {
        memcpy((float *)pool + at, x, sizeof(float) * d);
    } else if (dtype == 1) {  /* round to nearest even, as torch's float -> bfloat16 */
        uint16_t *p = (uint16_t *)pool + at;
        for (int j = 0; j < d; j++) {
            uint32_t u;
            memcpy(&u, x + j, 4);
            p[j] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
        }
    } else if (dtype == 2) {
        _Float16 *p = (_Float16 *)pool + at;
        for (int j = 0; j < d; j++) p[j] = (_Float16)x[j];
    } else {
        quantize_row_int8(x, d, (int8_t *)pool + at, ks + row);
    }
}

/* Scatter t tokens' keys and values (t, kv_heads, d) float32 into their slots, each key rotated by its
 * offset in its block (slot % bs) as reference.write_kv does. */
static void write_rows(const float *key, const float *value, void *kc, void *vc, int dtype, float *ks, float *vs,
                       const int64_t *slots, const float *cos, const float *sin, int t, int kv_heads, int d,
                       int bs) {
    float rot[MAX_D];
    for (int i = 0; i < t; i++) {
        const int64_t slot = slots[i];
        const float *c = cos + (slot % bs) * d, *s = sin + (slot % bs) * d;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t row = slot * kv_heads + h, in = ((int64_t)i * kv_heads + h) * d;
            rotate_key(key + in, c, s, d, rot);
            store_row(kc, dtype, ks, row, rot, d);
            store_row(vc, dtype, vs, row, value + in, d);
        }
    }
}

/* Into a float pool (dtype 0/1/2 as paged_decode's). */
void write_kv(const float *key, const float *value, void *kc, void *vc, int dtype, const int64_t *slots,
              const float *cos, const float *sin, int t, int kv_heads, int d, int bs) {
    if (dtype < 0 || dtype > 2) return;
    write_rows(key, value, kc, vc, dtype, NULL, NULL, slots, cos, sin, t, kv_heads, d, bs);
}

/* Into an int8 pool with one float32 scale per row (k_scale, v_scale: (num_blocks, bs, kv_heads)),
 * each row quantized as reference.write_kv quantizes it, bit for bit. The torch reference took about
 * ten times as long for 16 tokens (a dozen small ops per layer). */
void write_kv_int8(const float *key, const float *value, int8_t *kc, int8_t *vc, float *k_scale, float *v_scale,
                   const int64_t *slots, const float *cos, const float *sin, int t, int kv_heads, int d, int bs) {
    write_rows(key, value, kc, vc, 3, k_scale, v_scale, slots, cos, sin, t, kv_heads, d, bs);
}
