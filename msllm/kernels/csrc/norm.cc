// RMSNorm (Zhang & Sennrich 2019): y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps), one
// pass per row, rstd saved for the backward pass; and the same fused with the residual add that
// precedes it in a pre-norm block (h = a + b; y = rmsnorm(h)).
//
// Gradients, per row with xh = x * rstd and C the row length:
//   dx = rstd * (dy * w - xh * mean(dy * w * xh)),   dw = sum over rows of dy * xh.
// dw is summed per thread and then across threads (deterministic for a fixed thread count).
#include "common.h"
#include "parts.h"

using namespace msllm;

namespace {
// sum_j a[j] * b[j] * c[j]
inline float dot3(const float *a, const float *b, const float *c, int64_t n) {
  int64_t j = 0;
  float s = 0.f;
#if defined(MSLLM_VEC_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16)
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j)), _mm512_loadu_ps(c + j), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(MSLLM_VEC_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8)
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j)), _mm256_loadu_ps(c + j), acc);
  s = hsum8(acc);
#endif
  for (; j < n; ++j) s += a[j] * b[j] * c[j];
  return s;
}

void norm_rows(const float *h, const float *w, float eps, int64_t c, int64_t r0, int64_t r1, float *y, float *rstd) {
  for (int64_t r = r0; r < r1; ++r) {
    const float *x = h + r * c;
    float *yr = y + r * c;
    const float rs = 1.f / std::sqrt(dot(x, x, c) / static_cast<float>(c) + eps);
    rstd[r] = rs;
    for (int64_t j = 0; j < c; ++j) yr[j] = x[j] * rs * w[j];
  }
}

// dx (= dres + norm gradient when dres is given) and this thread's dw partial for rows [r0, r1)
void grad_rows(const float *dy, const float *x, const float *w, const float *rstd, const float *dres, int64_t c,
               int64_t r0, int64_t r1, float *dx, float *dw_part) {
  const float inv_c = 1.f / static_cast<float>(c);
  for (int64_t r = r0; r < r1; ++r) {
    const float *dyr = dy + r * c, *xr = x + r * c;
    float *dxr = dx + r * c;
    const float rs = rstd[r];
    const float k = dot3(dyr, w, xr, c) * rs * rs * rs * inv_c;  // rstd * mean(dy w xh) / ... folded
    if (dres) {
      const float *dr = dres + r * c;
      for (int64_t j = 0; j < c; ++j) dxr[j] = dr[j] + rs * dyr[j] * w[j] - k * xr[j];
    } else {
      for (int64_t j = 0; j < c; ++j) dxr[j] = rs * dyr[j] * w[j] - k * xr[j];
    }
    for (int64_t j = 0; j < c; ++j) dw_part[j] += dyr[j] * xr[j] * rs;
  }
}

void grad_all(const float *dy, const float *x, const float *w, const float *rstd, const float *dres, int64_t n,
              int64_t c, float *dx, float *dw) {
  Pool &pool = Pool::get();
  const int nt = pool.size();
  std::vector<float> parts(static_cast<size_t>(nt) * c, 0.f);
  const int64_t step = (n + nt - 1) / nt;
  pool.run(nt, [&](int i) {
    const int64_t r0 = i * step, r1 = std::min(n, r0 + step);
    if (r1 > r0) grad_rows(dy, x, w, rstd, dres, c, r0, r1, dx, parts.data() + i * c);
  });
  for (int64_t j = 0; j < c; ++j) dw[j] = 0.f;
  for (int i = 0; i < nt; ++i)
    for (int64_t j = 0; j < c; ++j) dw[j] += parts[i * c + j];
}

int64_t rows_of(int nd, const int64_t *shape) { return numel(nd, shape) / std::max<int64_t>(shape[nd - 1], 1); }
}  // namespace

// x (..., C), w (C), eps (1) -> y (..., C), rstd (N) with N the product of the leading dims
MSLLM_AOT(msllm_rms_norm) {
  if (nparam != 5 || !all_f32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]), *rstd = static_cast<float *>(params[4]);
  const int64_t c = shapes[0][ndims[0] - 1], n = rows_of(ndims[0], shapes[0]);
  if (shapes[1][0] != c) return 2;
  rms_norm_forward(x, w, eps, c, n, y, rstd);
  return 0;
}

void msllm::rms_norm_forward(const float *x, const float *w, float eps, int64_t c, int64_t n, float *y, float *rstd) {
  parallel_rows(n, 16, [&](int64_t r0, int64_t r1) { norm_rows(x, w, eps, c, r0, r1, y, rstd); });
}

void msllm::add_rms_norm_forward(const float *a, const float *b, const float *w, float eps, int64_t c, int64_t n,
                                 float *h, float *y, float *rstd) {
  parallel_rows(n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * c; i < r1 * c; ++i) h[i] = a[i] + b[i];
    norm_rows(h, w, eps, c, r0, r1, y, rstd);
  });
}

// dy (..., C), x (..., C), w (C), rstd (N) -> dx (..., C), dw (C)
MSLLM_AOT(msllm_rms_norm_grad) {
  if (nparam != 6 || !all_f32(nparam, dtypes)) return 1;
  const float *dy = static_cast<const float *>(params[0]), *x = static_cast<const float *>(params[1]);
  const float *w = static_cast<const float *>(params[2]), *rstd = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]), *dw = static_cast<float *>(params[5]);
  const int64_t c = shapes[0][ndims[0] - 1], n = rows_of(ndims[0], shapes[0]);
  grad_all(dy, x, w, rstd, nullptr, n, c, dx, dw);
  return 0;
}

// a (..., C), b (..., C), w (C), eps (1) -> h = a + b (..., C), y = rmsnorm(h) (..., C), rstd (N)
MSLLM_AOT(msllm_add_rms_norm) {
  if (nparam != 7 || !all_f32(nparam, dtypes)) return 1;
  const float *a = static_cast<const float *>(params[0]), *b = static_cast<const float *>(params[1]);
  const float *w = static_cast<const float *>(params[2]);
  const float eps = *static_cast<const float *>(params[3]);
  float *h = static_cast<float *>(params[4]), *y = static_cast<float *>(params[5]);
  float *rstd = static_cast<float *>(params[6]);
  const int64_t c = shapes[0][ndims[0] - 1], n = rows_of(ndims[0], shapes[0]);
  if (shapes[2][0] != c || numel(ndims[1], shapes[1]) != n * c) return 2;
  add_rms_norm_forward(a, b, w, eps, c, n, h, y, rstd);
  return 0;
}

// dh (..., C) (gradient reaching h from the residual path), dy (..., C), h (..., C), w (C),
// rstd (N) -> dx = dh + d rmsnorm (..., C) (the gradient of both a and b), dw (C)
MSLLM_AOT(msllm_add_rms_norm_grad) {
  if (nparam != 7 || !all_f32(nparam, dtypes)) return 1;
  const float *dh = static_cast<const float *>(params[0]), *dy = static_cast<const float *>(params[1]);
  const float *h = static_cast<const float *>(params[2]), *w = static_cast<const float *>(params[3]);
  const float *rstd = static_cast<const float *>(params[4]);
  float *dx = static_cast<float *>(params[5]), *dw = static_cast<float *>(params[6]);
  const int64_t c = shapes[1][ndims[1] - 1], n = rows_of(ndims[1], shapes[1]);
  grad_all(dy, h, w, rstd, dh, n, c, dx, dw);
  return 0;
}
