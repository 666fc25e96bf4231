/* 8-bit activations for the grouped products (group_linear_x8, cpu_linear.c): integer dot products, as
 * llama.cpp multiplies its blocks.
 *
 * Each row of x is quantized per group of 32: dx = max|x| / 127, xq = x / dx rounded to nearest (even)
 * into int8. A group's dot product is then taken in integers, 32 multiply-adds in two instructions
 * (`_mm256_maddubs_epi16`: unsigned bytes times signed bytes, adjacent pairs summed to int16; then
 * `_mm256_madd_epi16` against ones: int32), turned into floats once and scaled by scale * dx. 4-bit
 * codes are unsigned as stored (0..15; the offset is the row terms': -8 * dx * sum(xq) per group);
 * 8-bit codes are signed, so their absolute values multiply x carrying the codes' signs
 * (`_mm256_sign_epi8`). Nothing overflows: a 4-bit pair sums to at most 2 * 15 * 127 (lows and highs
 * added: twice that), an 8-bit pair to 2 * 128 * 127 < 32768.
 *
 * Layout of xq: for 8-bit weights a group's 32 codes in order. For 4-bit weights two groups share one
 * 256-bit register: a row's groups g, g + 1 are 32 adjacent bytes whose low nibbles are elements 0..15
 * of each and high nibbles 16..31, so each pair of groups of x is stored
 *
 *     [x_g 0..15 | x_g+1 0..15 | x_g 16..31 | x_g+1 16..31]
 *
 * and an odd last group in order (it goes through 128-bit registers).
 *
 * Cost: x's rounding to 8 bits changes results by about 1e-2 relative per product (not the float
 * path's reordering), so this path is selectable only (--decode-activations int8), never the default,
 * and the served fingerprint names it. */
#include "cpu_linear.h"

#if defined(__AVX2__)
static inline float hmax8(v8f v) {
    float m = v[0];
    for (int j = 1; j < 8; j++) m = v[j] > m ? v[j] : m;
    return m;
}

static inline int hsum8i(__m256i v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(t) + _mm_extract_epi32(t, 1);
}

void quantize_x8(const float *x, int k, int bits, int8_t *q, float *dx, float *a, float *b) {
    const int groups = k / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* undoes the packs' lane interleave */
    for (int g = 0; g < groups; g++) {
        __m256 v[4], mx = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int u = 0; u < 4; u++) {
            v[u] = _mm256_loadu_ps(x + g * 32 + 8 * u);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[u]));
            sum = _mm256_add_ps(sum, v[u]);
        }
        const float amax = hmax8((v8f)mx), d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i c[4];
        for (int u = 0; u < 4; u++) c[u] = _mm256_cvtps_epi32(_mm256_mul_ps(v[u], _mm256_set1_ps(id)));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        int8_t codes[32];
        _mm256_storeu_si256((__m256i *)codes, _mm256_permutevar8x32_epi32(p, order));
        if (bits == 4 && (g | 1) < groups) {  /* one of a pair: its halves to their places */
            int8_t *pair = q + (g & ~1) * 32 + (g & 1) * 16;
            memcpy(pair, codes, 16);
            memcpy(pair + 32, codes + 16, 16);
        } else {
            memcpy(q + g * 32, codes, 32);
        }
        dx[g] = d;
        a[g] = bits == 4 ? -8.0f * d * (float)hsum8i(total) : 0.0f;
        b[g] = hsum8((v8f)sum);
    }
}

/* 4-bit codes: a pair of groups per 256-bit register, an odd last group in 128 bits. */
static inline __attribute__((always_inline)) void rows_q4(const X8 *x, const int M, const Grouped *w, const int R,
                                                          const int64_t rows[DIRECT_ROWS],
                                                          float res[DIRECT_ROWS][FEW_ROWS]) {
    const int k = w->k, groups = k / 32, pairs = groups / 2;
    const uint8_t *q = w->q;
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[DIRECT_ROWS][FEW_ROWS];
    for (int c = 0; c < R; c++)
        for (int i = 0; i < M; i++) acc[c][i] = _mm256_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        __m256i xl[FEW_ROWS], xh[FEW_ROWS];
        __m256 dxv[FEW_ROWS];
        for (int i = 0; i < M; i++) {
            const int8_t *xi = x->q + (int64_t)i * k + p * 64;
            xl[i] = _mm256_loadu_si256((const __m256i *)xi);
            xh[i] = _mm256_loadu_si256((const __m256i *)(xi + 32));
            const float *d = x->dx + i * groups + 2 * p;
            dxv[i] = _mm256_blend_ps(_mm256_broadcast_ss(d), _mm256_broadcast_ss(d + 1), 0xF0);
        }
        for (int c = 0; c < R; c++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(q + rows[c] * (k / 2) + p * 32));
            const __m256i lo = _mm256_and_si256(b, mask), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
            const float *s = w->scale + rows[c] * groups + 2 * p;
            const __m256 sv = _mm256_blend_ps(_mm256_broadcast_ss(s), _mm256_broadcast_ss(s + 1), 0xF0);
            for (int i = 0; i < M; i++) {
                const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[i]), _mm256_maddubs_epi16(hi, xh[i]));
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                acc[c][i] = _mm256_fmadd_ps(f, _mm256_mul_ps(sv, dxv[i]), acc[c][i]);
            }
        }
    }
    for (int c = 0; c < R; c++)
        for (int i = 0; i < M; i++) res[c][i] = hsum8((v8f)acc[c][i]);
    if (!(groups & 1)) return;
    const int g = groups - 1;
    const __m128i mask1 = _mm_set1_epi8(15), ones1 = _mm_set1_epi16(1);
    for (int c = 0; c < R; c++) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + rows[c] * (k / 2) + g * 16));
        const __m128i lo = _mm_and_si128(b, mask1), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask1);
        for (int i = 0; i < M; i++) {
            const __m128i *xi = (const __m128i *)(x->q + (int64_t)i * k + g * 32);
            const __m128i s16 = _mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128(xi)),
                                              _mm_maddubs_epi16(hi, _mm_loadu_si128(xi + 1)));
            const __m128i s32 = _mm_madd_epi16(s16, ones1);
            const __m128i t = _mm_add_epi32(s32, _mm_unpackhi_epi64(s32, s32));
            const int sum = _mm_cvtsi128_si32(t) + _mm_extract_epi32(t, 1);
            res[c][i] += (float)sum * (w->scale[rows[c] * groups + g] * x->dx[i * groups + g]);
        }
    }
}

/* 8-bit codes: one group a register, one weight row a pass. */
static inline __attribute__((always_inline)) void rows_q8(const X8 *x, const int M, const Grouped *w, int64_t row,
                                                          float res[DIRECT_ROWS][FEW_ROWS]) {
    const int k = w->k, groups = k / 32;
    const int8_t *q = (const int8_t *)w->q + row * k;
    const float *scale = w->scale + row * groups;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[FEW_ROWS];
    for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(q + g * 32));
        const __m256i aw = _mm256_abs_epi8(wv);
        for (int i = 0; i < M; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + (int64_t)i * k + g * 32));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale[g] * x->dx[i * groups + g]), acc[i]);
        }
    }
    for (int i = 0; i < M; i++) res[0][i] = hsum8((v8f)acc[i]);
}

void x8_rows(const X8 *x, int M, const Grouped *w, int64_t r, int R, float res[DIRECT_ROWS][FEW_ROWS]) {
    if (w->bits == 8) {
        if (M == 1) rows_q8(x, 1, w, r, res);
        else rows_q8(x, 2, w, r, res);
        return;
    }
    int64_t rows[DIRECT_ROWS];
    for (int c = 0; c < DIRECT_ROWS; c++) rows[c] = r + c < w->n ? r + c : w->n - 1;
    if (R == 1) {
        if (M == 1) rows_q4(x, 1, w, 1, rows, res);
        else rows_q4(x, 2, w, 1, rows, res);
    } else {
        if (M == 1) rows_q4(x, 1, w, DIRECT_ROWS, rows, res);
        else rows_q4(x, 2, w, DIRECT_ROWS, rows, res);
    }
}
#else
/* Without AVX2 group_linear_x8 refuses every call; these are never reached. */
void quantize_x8(const float *x, int k, int bits, int8_t *q, float *dx, float *a, float *b) {
    (void)x, (void)k, (void)bits, (void)q, (void)dx, (void)a, (void)b;
}

void x8_rows(const X8 *x, int M, const Grouped *w, int64_t r, int R, float res[DIRECT_ROWS][FEW_ROWS]) {
    (void)x, (void)M, (void)w, (void)r, (void)R, (void)res;
}
#endif
