/* A Llama-family decode step's layers in one call: what `LlamaModel.forward` does layer by layer from
 * Python, for a float32 model on the CPU whose projections are grouped weights (cpu_linear.c).
 *
 *   decode_stack(h, m, stack, step)   h (m, hidden) float32, the rows' embeddings, becomes the last
 *                                     layer's output (before the final norm); each layer's keys and
 *                                     values are written into its pool as `write_kv` writes them
 *
 * Per layer, with the same kernels and in the same order as the Python path:
 *
 *   x = rms_norm(h); qkv = x @ Wqkv^T; keys and values into the pool; o = paged decode attention
 *   h += o @ Wo^T; x = rms_norm(h); g, u = x @ Wgate_up^T; h += (silu(g) * u) @ Wdown^T
 *
 * Why: a step of one session spent about as long in Python between the kernels (a dozen calls and
 * small tensors a layer, thirty layers) as in the kernels themselves (bench/step.py). The only sums
 * computed here rather than by torch are the residual adds (one rounding each, as torch's) and SwiGLU's
 * silu(g) * u (expf against torch's vectorized exp: within an ulp or two). */
#include <stdlib.h>

#include "cpu_decode.h"
#include "cpu_linear.h"

typedef struct {
    const float *input_norm, *post_norm;  /* (hidden,) */
    Grouped qkv, o, gate_up, down;        /* q, k, v fused; gate, up fused */
    void *key, *value;                    /* the layer's pool (num_blocks, bs, kv_heads, head_dim) */
    float *k_scale, *v_scale;             /* an int8 pool's scale per row; NULL for a float pool */
} DecodeLayer;

enum { X8_QKV = 1, X8_O = 2, X8_GATE_UP = 4, X8_DOWN = 8 };  /* cpu_forward.py X8_BITS */

typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int pool_dtype; /* 0 float32, 1 bfloat16, 2 float16, 3 int8 with scales */
    int x8;         /* which products take activations rounded to 8 bits (group_linear_x8): X8_* bits */
    const DecodeLayer *layers;
} DecodeStack;

typedef struct {
    const int64_t *slots;   /* (m,) where each row's key and value go */
    const int32_t *tables;  /* (m, max_blocks), rows table_stride apart */
    int64_t table_stride;
    const int32_t *seq_lens;  /* (m,) */
    const float *cos, *sin;   /* rope tables, head_dim wide, covering max_blocks * bs positions */
    int bs, max_blocks, chunk;
} DecodeStep;

static int linear(const float *x, const Grouped *w, float *out, int m, int x8) {
    if (x8 && group_linear_x8(x, w->q, w->bits, w->scale, w->zero, out, m, w->n, w->k) == 0) return 0;
    return group_linear(x, w->q, w->bits, w->scale, w->zero, out, m, w->n, w->k);
}

static int fits(const Grouped *w, int n, int k) {
    return w->n == n && w->k == k && k % 32 == 0 && (w->bits == 4 || w->bits == 8);
}

/* 0; -1 when a shape is not one this takes (nothing written); -2 when memory ran out or the attention
 * kernel refused a layer part-way (the step's keys and values are then partly written). */
int decode_stack(float *h, int m, const DecodeStack *s, const DecodeStep *st) {
    const int hd = s->hidden, d = s->head_dim, qn = s->heads * d, kvn = s->kv_heads * d, qkvn = qn + 2 * kvn;
    if (m < 1 || m > MAX_ROWS || s->pool_dtype < 0 || s->pool_dtype > 3) return -1;
    for (int l = 0; l < s->num_layers; l++) {
        const DecodeLayer *L = &s->layers[l];
        if (!fits(&L->qkv, qkvn, hd) || !fits(&L->o, hd, qn) || !fits(&L->gate_up, 2 * s->inter, hd) ||
            !fits(&L->down, hd, s->inter) || (s->pool_dtype == 3 && (!L->k_scale || !L->v_scale)))
            return -1;
    }
    const int runs = (st->max_blocks + st->chunk - 1) / st->chunk;
    const size_t floats = (size_t)m * (2 * hd + qkvn + 2 * kvn + 2 * qn + 3 * s->inter) +
                          (size_t)m * runs * s->heads * (d + 2);
    float *buf = malloc(sizeof(float) * floats);
    if (!buf) return -2;
    float *x = buf, *tmp = x + (size_t)m * hd, *qkv = tmp + (size_t)m * hd, *k = qkv + (size_t)m * qkvn,
          *v = k + (size_t)m * kvn, *q = v + (size_t)m * kvn, *att = q + (size_t)m * qn,
          *gu = att + (size_t)m * qn, *act = gu + (size_t)m * 2 * s->inter, *partial = act + (size_t)m * s->inter;
    int rc = 0;
    for (int l = 0; l < s->num_layers && rc == 0; l++) {
        const DecodeLayer *L = &s->layers[l];
        rms_norm(h, L->input_norm, x, m, hd, s->eps);
        if (linear(x, &L->qkv, qkv, m, s->x8 & X8_QKV)) { rc = -2; break; }
        for (int i = 0; i < m; i++) {
            const float *row = qkv + (size_t)i * qkvn;
            memcpy(q + (size_t)i * qn, row, sizeof(float) * qn);
            memcpy(k + (size_t)i * kvn, row + qn, sizeof(float) * kvn);
            memcpy(v + (size_t)i * kvn, row + qn + kvn, sizeof(float) * kvn);
        }
        if (s->pool_dtype == 3)
            write_kv_int8(k, v, L->key, L->value, L->k_scale, L->v_scale, st->slots, st->cos, st->sin, m,
                          s->kv_heads, d, st->bs);
        else
            write_kv(k, v, L->key, L->value, s->pool_dtype, st->slots, st->cos, st->sin, m, s->kv_heads, d, st->bs);
        if (paged_decode_quantized(q, L->key, L->value, s->pool_dtype, L->k_scale, L->v_scale, st->tables,
                                   st->table_stride, st->seq_lens, st->cos, st->sin, att, NULL, 0, partial, NULL,
                                   m, s->heads, s->kv_heads, d, st->bs, st->max_blocks, st->chunk, s->scale)) {
            rc = -2;
            break;
        }
        if (linear(att, &L->o, tmp, m, s->x8 & X8_O)) { rc = -2; break; }
        for (size_t j = 0; j < (size_t)m * hd; j++) h[j] += tmp[j];
        rms_norm(h, L->post_norm, x, m, hd, s->eps);
        if (linear(x, &L->gate_up, gu, m, s->x8 & X8_GATE_UP)) { rc = -2; break; }
        for (int i = 0; i < m; i++) {
            const float *g = gu + (size_t)i * 2 * s->inter, *u = g + s->inter;
            float *a = act + (size_t)i * s->inter;
            for (int j = 0; j < s->inter; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        }
        if (linear(act, &L->down, tmp, m, s->x8 & X8_DOWN)) { rc = -2; break; }
        for (size_t j = 0; j < (size_t)m * hd; j++) h[j] += tmp[j];
    }
    free(buf);
    return rc;
}
