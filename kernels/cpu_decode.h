/* The exported kernels of cpu_decode.c that other sources of the library call (cpu_forward.c), declared
 * once: cpu_decode.c includes this too, so a signature that drifts fails the build. */
#ifndef STREAMCHAT_CPU_DECODE_H
#define STREAMCHAT_CPU_DECODE_H

#include <stdint.h>

void rms_norm(const float *x, const float *w, float *out, int m, int k, float eps);
void write_kv(const float *key, const float *value, void *kc, void *vc, int dtype, const int64_t *slots,
              const float *cos, const float *sin, int t, int kv_heads, int d, int bs);
void write_kv_int8(const float *key, const float *value, int8_t *kc, int8_t *vc, float *k_scale, float *v_scale,
                   const int64_t *slots, const float *cos, const float *sin, int t, int kv_heads, int d, int bs);
int paged_decode_quantized(const float *q, const void *kc, const void *vc, int dtype, const float *k_scale,
                           const float *v_scale, const int32_t *tables, int64_t table_stride,
                           const int32_t *seq_lens, const float *cos, const float *sin, float *out,
                           float *block_mass, int64_t mass_stride, float *partial, float *stats, int num_seqs,
                           int heads, int kv_heads, int d, int bs, int max_blocks, int chunk, float scale);

#endif
