/* What the grouped-weight products share (cpu_linear.c, and cpu_linear_x8.c for 8-bit activations):
 * the matrix, the direct paths' shape, and the 8-bit path's internal calls. Included by those two. */
#ifndef STREAMCHAT_CPU_LINEAR_H
#define STREAMCHAT_CPU_LINEAR_H

#include "cpu_common.h"

#define MAX_ROWS 32    /* rows of x at most (a decode step's) */
#define FEW_ROWS 2     /* rows of x per pass of the direct paths */
#define DIRECT_ROWS 4  /* weight rows per pass over a group of x in a batch; else one at a time */

/* Weight rows per pass for a product of m rows of x (8-bit x when x8). Only a batch (more than FEW_ROWS
 * rows: each pass goes over several pairs of x rows) gains from sharing x's registers among weight rows;
 * for one or two rows, one weight row a pass ran 16% faster (the bundled model's layers, this Zen 4
 * EPYC: four rows side by side are four short streams, and the passes' longer dependency chains). A
 * float batch takes four 8-bit rows too (the output head at 16 rows: 15 ms against 19-22); the 8-bit
 * path's 8-bit rows go one at a time. Each row's arithmetic is the same whatever shares its pass, so a
 * row's result does not depend on this. */
static inline int rows_per_pass(int bits, int m, int x8) {
    return m > FEW_ROWS && (bits == 4 || !x8) ? DIRECT_ROWS : 1;
}

/* A matrix in groups, as group_linear takes it (cpu_linear.c's header): n rows of k. */
typedef struct {
    const void *q;
    int bits;
    const float *scale, *zero;
    int n, k;
} Grouped;

/* The M <= FEW_ROWS rows of x of one pass, quantized: codes (M, k) in the order the weights' width
 * wants (see cpu_linear_x8.c) and a scale per group (M, k / 32). */
typedef struct {
    const int8_t *q;
    const float *dx;
} X8;

/* The products, exported (cpu_linear.c's header says what they compute); cpu_forward.c calls them. */
int group_linear(const float *x, const void *q, int bits, const float *scale, const float *zero, float *out,
                 int m, int n, int k);
int group_linear_x8(const float *x, const void *q, int bits, const float *scale, const float *zero, float *out,
                    int m, int n, int k);

/* Row x into codes, scales and the row terms' multipliers a (of the scales) and b (of the zeros), per
 * group: the product of a row is sum_g scale_g * dx_g * (c_g . xq_g) + scale_g * a_g + zero_g * b_g. */
__attribute__((visibility("hidden"))) void quantize_x8(const float *x, int k, int bits, int8_t *q, float *dx,
                                                       float *a, float *b);

/* res[c][i] = sum_g scale_g * dx_g * (c_g . xq_i,g) for weight rows r .. r + R - 1 (clamped to n - 1; R
 * is 1 or DIRECT_ROWS, and 1 for 8-bit weights) and the M rows of x. */
__attribute__((visibility("hidden"))) void x8_rows(const X8 *x, int M, const Grouped *w, int64_t r, int R,
                                                   float res[DIRECT_ROWS][FEW_ROWS]);

#endif
