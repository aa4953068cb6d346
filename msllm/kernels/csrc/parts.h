// The forward computations of msllm's inference kernels as C++ functions, defined in the files
// that hold their MindSpore entry points and called by those entries and by the fused decode
// step (decode_fused.cc), so both run exactly the same code (the same sums in the same order:
// a fused step equals its unfused operators bit for bit). All tensors contiguous row-major.
#pragma once

#include <cstdint>

namespace msllm {

// linear.cc: y (m, out) = x (m, in) w^T, w (out, in) float32, or bfloat16 when ``bf16``
void linear_forward(const float *x, const void *w, bool bf16, float *y, int64_t m, int64_t in, int64_t out);

// gemv_avx2.cc: the same for 1 <= m <= 8 rows on the AVX2 + FMA streaming path (linear.cc picks it)
void gemv_avx2(const float *x, const void *w, bool bf16, float *y, int64_t m, int64_t in, int64_t out);

// linear_int8.cc: y (m, out) = x (m, in) (q * s)^T, q (out, in) int8, s (out, groups) float32, each
// scale covering ``group`` consecutive inputs
void linear_int8_forward(const float *x, const int8_t *q, const float *s, int64_t groups, int64_t group, float *y,
                         int64_t m, int64_t in, int64_t out);

// decode.cc: o (b, h, t, d) = softmax(q k^T + mask) v over the flat (s * b, kv, d) caches, mask
// (mask_rows = b or 1, 1, t, s) additive, q already scaled
void decode_attention_forward(const float *q, const float *k, const float *v, const float *mask, float *o,
                              int64_t b, int64_t h, int64_t t, int64_t d, int64_t s, int64_t kv, int64_t mask_rows);

// norm.cc: RMSNorm of n rows of c: y = x rstd w; the add variant first h = a + b
void rms_norm_forward(const float *x, const float *w, float eps, int64_t c, int64_t n, float *y, float *rstd);
void add_rms_norm_forward(const float *a, const float *b, const float *w, float eps, int64_t c, int64_t n,
                          float *h, float *y, float *rstd);

// elementwise.cc: a[0:n) = silu(g) u; rotary (rotate_half layout) of x (rows, heads, d), row r
// with table row r of cos / sin (rows, d)
void swiglu_forward(const float *g, const float *u, float *a, int64_t n);
void rope_forward(const float *x, const float *cs, const float *sn, float *y, int64_t rows, int64_t heads, int64_t d);

}  // namespace msllm
