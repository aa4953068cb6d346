// Element-wise chains of the LLaMA block in one pass each (memory-bound: one read and one write
// per element instead of one per primitive): SwiGLU's silu(g) * u and rotary embedding, with
// their gradients.
#include "common.h"
#include "parts.h"

using namespace msllm;

namespace {
inline float sigmoid_scalar(float x) { return 1.f / (1.f + exp_scalar(-x)); }

// a = silu(g) * u over [i0, i1)
void swiglu_range(const float *g, const float *u, float *a, int64_t i0, int64_t i1) {
  int64_t i = i0;
#if defined(MSLLM_VEC_AVX512)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= i1; i += 16) {
    __m512 gv = _mm512_loadu_ps(g + i);
    __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
  }
#elif defined(MSLLM_VEC_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= i1; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < i1; ++i) a[i] = g[i] * sigmoid_scalar(g[i]) * u[i];
}

// dg = da * u * sig * (1 + g * (1 - sig)),  du = da * g * sig
void swiglu_grad_range(const float *da, const float *g, const float *u, float *dg, float *du, int64_t i0, int64_t i1) {
  int64_t i = i0;
#if defined(MSLLM_VEC_AVX512)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= i1; i += 16) {
    __m512 gv = _mm512_loadu_ps(g + i), dav = _mm512_loadu_ps(da + i);
    __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    __m512 silu = _mm512_mul_ps(gv, sig);
    _mm512_storeu_ps(du + i, _mm512_mul_ps(dav, silu));
    __m512 dsilu = _mm512_mul_ps(sig, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, sig), one));
    _mm512_storeu_ps(dg + i, _mm512_mul_ps(_mm512_mul_ps(dav, _mm512_loadu_ps(u + i)), dsilu));
  }
#elif defined(MSLLM_VEC_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= i1; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i), dav = _mm256_loadu_ps(da + i);
    __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    __m256 silu = _mm256_mul_ps(gv, sig);
    _mm256_storeu_ps(du + i, _mm256_mul_ps(dav, silu));
    __m256 dsilu = _mm256_mul_ps(sig, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, sig), one));
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(dav, _mm256_loadu_ps(u + i)), dsilu));
  }
#endif
  for (; i < i1; ++i) {
    const float sig = sigmoid_scalar(g[i]);
    du[i] = da[i] * g[i] * sig;
    dg[i] = da[i] * u[i] * sig * (1.f + g[i] * (1.f - sig));
  }
}

// Rotary embedding, Hugging Face "rotate_half" layout (transformers/models/llama/
// modeling_llama.py, apply_rotary_pos_emb): y = x cos + rotate_half(x) sin with
// rotate_half([x1, x2]) = [-x2, x1]. Its gradient applies the transposed rotation:
// dx1 = dy1 cos1 + dy2 sin2, dx2 = dy2 cos2 - dy1 sin1  (sign = -1 below).
void rope_rows(const float *x, const float *cs, const float *sn, float *y, int64_t t_len, int64_t heads, int64_t d,
               int64_t r0, int64_t r1, float sign) {
  const int64_t half = d / 2;
  for (int64_t r = r0; r < r1; ++r) {  // r indexes (b, t)
    const int64_t t = r % t_len;
    const float *c = cs + t * d, *s = sn + t * d;
    for (int64_t n = 0; n < heads; ++n) {
      const float *xr = x + (r * heads + n) * d;
      float *yr = y + (r * heads + n) * d;
      if (sign > 0) {
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = xr[j], x2 = xr[j + half];
          yr[j] = x1 * c[j] - x2 * s[j];
          yr[j + half] = x2 * c[j + half] + x1 * s[j + half];
        }
      } else {
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = xr[j], x2 = xr[j + half];
          yr[j] = x1 * c[j] + x2 * s[j + half];
          yr[j + half] = x2 * c[j + half] - x1 * s[j];
        }
      }
    }
  }
}

int rope_common(void **params, int *ndims, int64_t **shapes, float sign) {
  if (ndims[0] != 4 || ndims[1] != 2 || ndims[2] != 2) return 2;
  const int64_t b = shapes[0][0], t = shapes[0][1], heads = shapes[0][2], d = shapes[0][3];
  if (shapes[1][1] != d || shapes[2][1] != d || shapes[1][0] < t || shapes[2][0] < t || d % 2) return 2;
  const float *x = static_cast<const float *>(params[0]);
  const float *cs = static_cast<const float *>(params[1]), *sn = static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  parallel_rows(b * t, 8, [&](int64_t r0, int64_t r1) { rope_rows(x, cs, sn, y, t, heads, d, r0, r1, sign); });
  return 0;
}
}  // namespace

void msllm::swiglu_forward(const float *g, const float *u, float *a, int64_t n) {
  parallel_rows(n, 4096, [&](int64_t i0, int64_t i1) { swiglu_range(g, u, a, i0, i1); });
}

void msllm::rope_forward(const float *x, const float *cs, const float *sn, float *y, int64_t rows, int64_t heads,
                         int64_t d) {
  parallel_rows(rows, 8, [&](int64_t r0, int64_t r1) { rope_rows(x, cs, sn, y, rows, heads, d, r0, r1, 1.f); });
}

// g (..., F), u (..., F) -> silu(g) * u
MSLLM_AOT(msllm_swiglu) {
  if (nparam != 3 || !all_f32(nparam, dtypes)) return 1;
  const int64_t n = numel(ndims[0], shapes[0]);
  if (numel(ndims[1], shapes[1]) != n) return 2;
  const float *g = static_cast<const float *>(params[0]), *u = static_cast<const float *>(params[1]);
  float *a = static_cast<float *>(params[2]);
  swiglu_forward(g, u, a, n);
  return 0;
}

// da, g, u (..., F) -> dg, du
MSLLM_AOT(msllm_swiglu_grad) {
  if (nparam != 5 || !all_f32(nparam, dtypes)) return 1;
  const int64_t n = numel(ndims[0], shapes[0]);
  const float *da = static_cast<const float *>(params[0]), *g = static_cast<const float *>(params[1]);
  const float *u = static_cast<const float *>(params[2]);
  float *dg = static_cast<float *>(params[3]), *du = static_cast<float *>(params[4]);
  parallel_rows(n, 4096, [&](int64_t i0, int64_t i1) { swiglu_grad_range(da, g, u, dg, du, i0, i1); });
  return 0;
}

// x (B, T, N, D), cos (P, D), sin (P, D) with P >= T (rows 0..T-1 used) -> y (B, T, N, D)
MSLLM_AOT(msllm_rope) {
  if (nparam != 4 || !all_f32(nparam, dtypes)) return 1;
  return rope_common(params, ndims, shapes, 1.f);
}

// dy (B, T, N, D), cos, sin -> dx (B, T, N, D)
MSLLM_AOT(msllm_rope_grad) {
  if (nparam != 4 || !all_f32(nparam, dtypes)) return 1;
  return rope_common(params, ndims, shapes, -1.f);
}
