// Next-token cross-entropy over the vocabulary, one row per position, in two passes over the
// logits forward (max, then sum of exp) and one backward, instead of MindSpore's LogSoftmax +
// GatherD forward and GatherD's scatter + LogSoftmaxGrad backward (each a full (N, V) tensor).
//
//   out[i] = (nll_i, lse_i):  lse_i = log sum_v exp(z_iv),  nll_i = lse_i - z_i,y_i  (0 if y_i is
//   ignored, i.e. negative, msllm's ignore_token_id -100)
//   d z_iv = (g_nll_i + g_lse_i) softmax_iv - g_nll_i [v == y_i]   (g_nll_i = 0 for ignored rows)
#include "common.h"

using namespace msllm;

namespace {
bool dtypes_ok(int nparam, const char **dtypes, int int_index) {
  for (int i = 0; i < nparam; ++i) {
    const bool want_int = i == int_index;
    const bool is_int = std::strcmp(dtypes[i], "int32") == 0;
    const bool is_f32 = std::strcmp(dtypes[i], "float32") == 0 || std::strcmp(dtypes[i], "float") == 0;
    if (want_int ? !is_int : !is_f32) return false;
  }
  return true;
}
}  // namespace

// logits (N, V) float32, targets (N,) int32 -> out (N, 2) float32: (nll, lse) per row
MSLLM_AOT(msllm_cross_entropy) {
  if (nparam != 3 || !dtypes_ok(nparam, dtypes, 1)) return 1;
  const float *z = static_cast<const float *>(params[0]);
  const int32_t *y = static_cast<const int32_t *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t n = shapes[0][0], v = shapes[0][1];
  if (numel(ndims[1], shapes[1]) != n) return 2;
  parallel_rows(n, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *row = z + r * v;
      const float m = row_max(row, v);
      const float s = exp_sum(row, v, m);   // vec.h: summed in blocks
      const float lse = m + std::log(s);
      const int32_t t = y[r];
      out[2 * r] = (t >= 0 && t < v) ? lse - row[t] : 0.f;
      out[2 * r + 1] = lse;
    }
  });
  return 0;
}

// dout (N, 2), logits (N, V), targets (N,) int32, out (N, 2) -> dlogits (N, V)
MSLLM_AOT(msllm_cross_entropy_grad) {
  if (nparam != 5 || !dtypes_ok(nparam, dtypes, 2)) return 1;
  const float *g = static_cast<const float *>(params[0]);
  const float *z = static_cast<const float *>(params[1]);
  const int32_t *y = static_cast<const int32_t *>(params[2]);
  const float *out = static_cast<const float *>(params[3]);
  float *dz = static_cast<float *>(params[4]);
  const int64_t n = shapes[1][0], v = shapes[1][1];
  parallel_rows(n, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t t = y[r];
      const bool counted = t >= 0 && t < v;
      const float g_nll = counted ? g[2 * r] : 0.f, scale = g_nll + g[2 * r + 1];
      float *drow = dz + r * v;
      if (scale == 0.f) {
        std::memset(drow, 0, sizeof(float) * v);
      } else {
        // softmax = exp(z - lse), scaled
        exp_shift_sum(z + r * v, drow, v, 1.f, out[2 * r + 1]);
        for (int64_t j = 0; j < v; ++j) drow[j] *= scale;
      }
      if (counted) drow[t] -= g_nll;
    }
  });
  return 0;
}

class AotExtra;
extern "C" __attribute__((visibility("default"))) std::vector<int64_t> msllm_cross_entropyInferShape(
    int *ndims, int64_t **shapes, AotExtra *) {
  return {shapes[0][0], 2};
}

extern "C" __attribute__((visibility("default"))) std::vector<int64_t> msllm_cross_entropy_gradInferShape(
    int *ndims, int64_t **shapes, AotExtra *) {
  return {shapes[1][0], shapes[1][1]};
}
