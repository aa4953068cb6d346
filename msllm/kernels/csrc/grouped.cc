// Grouped linear layer for the mixture of experts' dropless dispatch: rows sorted by expert, group
// g = rows off[g] .. off[g+1]-1, y_g = x_g W_g^T (W (E, out, in), torch.nn.Linear's layout per
// expert), and its two gradients. One GEMM per non-empty group on oneDNN's sgemm over the pool
// (stream.h), so the work is the rows' (k N in total), whatever the number of experts E: what
// MindSpore's GroupedMatmul does on Ascend and Megablocks' / torch's grouped_mm on GPUs. The
// offsets come as float32 (E + 1,) (exact below 2^24 rows) so that every operand is float32.
#include "common.h"

using namespace msllm;

namespace {

// offsets (E + 1,) float32 -> ints; false unless 0 = off[0] <= ... <= off[E] = rows
bool read_offsets(const float *f, int64_t n, int64_t rows, std::vector<int64_t> &off) {
  off.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    off[i] = static_cast<int64_t>(f[i]);
    if (i > 0 && off[i] < off[i - 1]) return false;
  }
  return n > 0 && off[0] == 0 && off[n - 1] == rows;
}

}  // namespace

// x (M, in), w (E, out, in), offsets (E + 1,) -> y (M, out)
MSLLM_AOT(msllm_grouped_linear) {
  if (nparam != 4 || !all_f32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[3]);
  const int64_t m = shapes[0][0], in = shapes[0][1], e = shapes[1][0], out = shapes[1][1];
  if (shapes[1][2] != in || shapes[2][0] != e + 1) return 2;
  std::vector<int64_t> off;
  if (!read_offsets(static_cast<const float *>(params[2]), e + 1, m, off)) return 3;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t rows = off[g + 1] - off[g];
    if (rows > 0)
      parallel_sgemm('N', 'T', rows, out, in, 1.f, x + off[g] * in, in, w + g * out * in, in, 0.f, y + off[g] * out,
                     out);
  }
  return 0;
}

// dy (M, out), w (E, out, in), offsets -> dx (M, in) = dy_g W_g per group
MSLLM_AOT(msllm_grouped_linear_dx) {
  if (nparam != 4 || !all_f32(nparam, dtypes)) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  float *dx = static_cast<float *>(params[3]);
  const int64_t m = shapes[0][0], out = shapes[0][1], e = shapes[1][0], in = shapes[1][2];
  if (shapes[1][1] != out || shapes[2][0] != e + 1) return 2;
  std::vector<int64_t> off;
  if (!read_offsets(static_cast<const float *>(params[2]), e + 1, m, off)) return 3;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t rows = off[g + 1] - off[g];
    if (rows > 0)
      parallel_sgemm('N', 'N', rows, in, out, 1.f, dy + off[g] * out, out, w + g * out * in, in, 0.f,
                     dx + off[g] * in, in);
  }
  return 0;
}

// dy (M, out), x (M, in), offsets (E + 1,) -> dW (E, out, in), dW_g = dy_g^T x_g (zero for an empty group)
MSLLM_AOT(msllm_grouped_linear_dw) {
  if (nparam != 4 || !all_f32(nparam, dtypes)) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *x = static_cast<const float *>(params[1]);
  float *dw = static_cast<float *>(params[3]);
  const int64_t m = shapes[0][0], out = shapes[0][1], in = shapes[1][1], e = shapes[2][0] - 1;
  if (shapes[1][0] != m) return 2;
  std::vector<int64_t> off;
  if (!read_offsets(static_cast<const float *>(params[2]), e + 1, m, off)) return 3;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t rows = off[g + 1] - off[g];
    float *dst = dw + g * out * in;
    if (rows > 0)
      parallel_sgemm('T', 'N', out, in, rows, 1.f, dy + off[g] * out, out, x + off[g] * in, in, 0.f, dst, in);
    else
      std::fill(dst, dst + out * in, 0.f);
  }
  return 0;
}
