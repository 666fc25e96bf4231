/* What the CPU kernels (cpu_decode.c, cpu_mla.c) share: eight-float vectors, a vector e^x, reading a
 * pool row as float32, and the decode kernels' work split (runs of blocks per sequence, then a merge).
 * Included by each kernel source; everything here is static. */
#ifndef STREAMCHAT_CPU_COMMON_H
#define STREAMCHAT_CPU_COMMON_H

#include <float.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Eight floats, as GCC and Clang vector extensions spell them: one AVX register on x86-64, two NEON
 * registers on arm64. Written out because the auto-vectorizer kept every reduction below as an
 * in-order chain of scalar adds (no reassociation without -ffast-math, which this library must not
 * use: it would set flush-to-zero for the whole process). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f ld8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

typedef int32_t v8i __attribute__((vector_size(32)));

/* e^x lane by lane for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, e^r by its
 * Taylor series to r^6 (relative error under 2e-7), times 2^n put into the exponent bits. Lanes
 * below -87 give 0. glibc's expf is scalar here (it vectorizes only under -ffast-math). */
static inline v8f exp8(v8f x) {
    const v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const v8i under = x < lo;
    x = (v8f)(((v8i)x & ~under) | ((v8i)lo & under));
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    const v8f n = (x * 1.44269504088896341f + magic) - magic;
    const v8f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  /* ln2 in two parts */
    v8f p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v8i e = (v8i)p + (__builtin_convertvector(n, v8i) << 23);
    return (v8f)(e & ~under);
}

static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* Pool storage (`dtype`): 0 float32, 1 bfloat16, 2 float16; and, with one float32 scale per row (per
 * token per KV head), 3 int8, 4 float8 e4m3fn (`load_codes`).
 *
 * A row of head_dim values as float32: the pool's own memory when it is float32, else widened into
 * `tmp` (eight at a time: bf16 by a shift into the high half, fp16 by the F16C conversion). */
static inline const float *load_row(const void *pool, int dtype, int64_t row, int d, float *tmp) {
    if (dtype == 0) return (const float *)pool + row * d;
    if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)pool + row * d;
#if defined(__AVX2__)
        for (int j = 0; j < d; j += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + j)));
            _mm256_storeu_si256((__m256i *)(tmp + j), _mm256_slli_epi32(w, 16));
        }
#else
        for (int j = 0; j < d; j++) tmp[j] = bf16_to_float(p[j]);
#endif
    } else {
        const uint16_t *p = (const uint16_t *)pool + row * d;
#if defined(__F16C__)
        for (int j = 0; j < d; j += 8)
            _mm256_storeu_ps(tmp + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + j))));
#else
        const _Float16 *h = (const _Float16 *)p;
        for (int j = 0; j < d; j++) tmp[j] = (float)h[j];
#endif
    }
    return tmp;
}

/* A row's codes as float32 (`load_row` for a float pool), each widened exactly: the caller applies the
 * row's scale once to what it computes from the row (a score, a softmax weight) instead of to each of
 * its d values. int8 (dtype 3) by sign extension; float8 e4m3fn (dtype 4) by its bits: the exponent
 * and mantissa shifted into a float's (e4m3's bias 7 against float's 127: times 2^120, which also gives
 * its subnormals exactly), the sign to the top, and 0x7F / 0xFF NaN as torch has them. */
static inline const float *load_codes(const void *pool, int dtype, int64_t row, int d, float *tmp) {
    if (dtype < 3) return load_row(pool, dtype, row, d, tmp);
    const uint8_t *p = (const uint8_t *)pool + row * d;
#if defined(__AVX2__)
    for (int j = 0; j < d; j += 8) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(p + j));
        __m256 x;
        if (dtype == 3) {
            x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        } else {
            const __m256i u = _mm256_cvtepu8_epi32(b);
            const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7F));
            const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(mag, 20),
                                                 _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24));
            x = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
            const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
            x = _mm256_blendv_ps(x, _mm256_set1_ps(NAN), nan);
        }
        _mm256_storeu_ps(tmp + j, x);
    }
#else
    for (int j = 0; j < d; j++) {
        float x;
        if (dtype == 3) {
            x = (float)(int8_t)p[j];
        } else {
            const uint32_t mag = p[j] & 0x7F, bits = (mag << 20) | ((uint32_t)(p[j] & 0x80) << 24);
            memcpy(&x, &bits, 4);
            x = mag == 0x7F ? NAN : x * 0x1p120f;
        }
        tmp[j] = x;
    }
#endif
    return tmp;
}

/* Bytes of one stored value: float32, 16-bit floats, or an 8-bit code. */
static inline int elem_bytes(int dtype) { return dtype == 0 ? 4 : dtype <= 2 ? 2 : 1; }

static inline const char *row_addr(const void *pool, int dtype, int64_t row, int d) {
    return (const char *)pool + row * d * elem_bytes(dtype);
}

/* The same token's rows in the next block, one block ahead of the reads: the hardware prefetcher
 * stays within a block's span, and each block starts wherever the pool put it. */
static inline void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* ---- decode attention's work split: one item per (sequence, run of `chunk` blocks), each writing one row
 * of (d + 2) floats per query head (the run's max, its sum of exponentials, its unnormalised output);
 * then a merge per sequence. A sequence's runs depend only on its own length: its result is the same in
 * any batch. ---- */

#define RUN_TOKENS 256 /* keys per work item at most: chunk x block_size */

typedef void (*RunFn)(const void *args, int b, int i0, int i1, float *part);

/* One softmax over a run of n scores per query head: row hq of s (RUN_TOKENS floats each) becomes
 * exp(s - max); part[hq] = (max, sum, d zeros). With stats, each block's sum against the run's max, at
 * stats[((b * heads + hq) * max_blocks + i) * 2] for the run's blocks i0 .. i1 - 1 (len: the sequence's). */
static inline void run_softmax(float *s, int n, int heads, int d, float *part, float *stats, int b, int i0, int i1,
                        int len, int bs, int max_blocks) {
    const int n8 = (n + 7) & ~7;
    for (int hq = 0; hq < heads; hq++) {
        float *sh = s + hq * RUN_TOKENS, *ph = part + (int64_t)hq * (d + 2);
        for (int t = n; t < n8; t++) sh[t] = -FLT_MAX;  /* exp8 gives these 0 */
        float mx = -FLT_MAX;
        for (int t = 0; t < n; t++) mx = sh[t] > mx ? sh[t] : mx;
        v8f acc = {0};
        for (int t = 0; t < n8; t += 8) {
            const v8f e = exp8(ld8(sh + t) - mx);
            st8(sh + t, e);
            acc += e;
        }
        ph[0] = mx;
        ph[1] = hsum8(acc);
        memset(ph + 2, 0, sizeof(float) * d);
        if (!stats) continue;
        float *st = stats + (((int64_t)b * heads + hq) * max_blocks + i0) * 2;
        for (int i = i0, t0 = 0; i < i1; i++, st += 2) {
            const int t1 = t0 + (len - i * bs < bs ? len - i * bs : bs);
            float sum = 0.0f;
            for (int t = t0; t < t1; t++) sum += sh[t];
            st[0] = mx;
            st[1] = sum;
            t0 = t1;
        }
    }
}

static inline int64_t blocks_in(const int32_t *seq_lens, int num_seqs, int bs) {
    int64_t total = 0;
    for (int b = 0; b < num_seqs; b++) total += (seq_lens[b] + bs - 1) / bs;
    return total;
}

/* Every item's run over the OpenMP threads (in the caller's thread when not `parallel`). */
static inline void run_items(RunFn run, const void *args, const int32_t *seq_lens, int num_seqs, int bs, int chunk,
                      int runs_max, int64_t item_floats, float *partial, int parallel) {
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int it = 0; it < num_seqs * runs_max; it++) {
        const int r = it % runs_max, b = it / runs_max;
        const int blocks = (seq_lens[b] + bs - 1) / bs;
        if (r * chunk >= blocks) continue;
        const int i1 = (r + 1) * chunk < blocks ? (r + 1) * chunk : blocks;
        run(args, b, r * chunk, i1, partial + (int64_t)it * item_floats);
    }
}

/* Sequence b's runs merged per query head into out (B, heads, d), normalised; with block_mass, each block's
 * probability (from `stats`: per (b, head, block) its sum of exponentials and the max it is taken against)
 * added, summed over the heads. */
static inline void merge_runs(int b, const int32_t *seq_lens, int heads, int d, int bs, int chunk, int runs_max,
                       int max_blocks, const float *partial, const float *stats, float *out, float *block_mass,
                       int64_t mass_stride) {
    const int blocks = (seq_lens[b] + bs - 1) / bs, runs = (blocks + chunk - 1) / chunk;
    const int64_t run_stride = (int64_t)heads * (d + 2);
    for (int hq = 0; hq < heads; hq++) {
        const float *first = partial + ((int64_t)b * runs_max * heads + hq) * (d + 2);  /* run 0's row */
        float mx = -FLT_MAX, total = 0.0f;
        for (int r = 0; r < runs; r++) {
            const float mr = first[r * run_stride];
            mx = mr > mx ? mr : mx;
        }
        float *o = out + ((int64_t)b * heads + hq) * d;
        memset(o, 0, sizeof(float) * d);
        for (int r = 0; r < runs; r++) {
            const float *pr = first + r * run_stride;
            const float w = expf(pr[0] - mx);
            total += pr[1] * w;
#pragma omp simd
            for (int j = 0; j < d; j++) o[j] += w * pr[2 + j];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int j = 0; j < d; j++) o[j] *= inv;
        if (block_mass) {
            const float *st = stats + ((int64_t)b * heads + hq) * max_blocks * 2;
            float *mass = block_mass + (int64_t)b * mass_stride;
            for (int i = 0; i < blocks; i++) mass[i] += st[2 * i + 1] * expf(st[2 * i] - mx) * inv;
        }
    }
}

#endif
