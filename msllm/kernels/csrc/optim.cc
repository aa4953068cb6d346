// The optimizer's end of a CPU train step, each a single pass over memory: AdamW's update with the
// gradient clipping multiply folded in, and the per-gradient sum of squares the global norm needs.
//
// Why: on SmolLM2's 135M float32 parameters (Intel Xeon, 2 cores) the step's end as MindSpore 2.10
// runs it (per gradient a squaring Mul and ReduceSum, a clipping Mul, then AdamWeightDecay's kernel)
// took 384 ms; these two kernels take 157 ms, 27 GB/s of memory traffic (read g twice, p, m, v;
// write p, m, v: 32 bytes per parameter). benchmarks/optimizer_step.py,
// benchmarks/results/optimizer_step_intel_xeon.json (a full DPO step: benchmarks/profile_dpo_step.py).
//
// The update is MindSpore's ``nn.AdamWeightDecay`` rule (its docstring; no bias correction),
// on the gradient times ``coef`` (the train step's 1 / loss scale * clip factor):
//   g = grad * coef; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//   p = p - lr (m / (sqrt(v) + eps) + wd p)
// The parameter and both moments are written in place: the train step passes the Parameters
// themselves, and orders this operator after every reader of the parameters through its
// ``hyper`` input (msllm/training/adamw.py says how).
#include "common.h"

using namespace msllm;

namespace {

// GCC vector extensions: 16 float lanes, lowered to one zmm register with AVX-512 and two ymm
// with AVX2, so the summation order is the same on every x86 machine.
typedef float v16 __attribute__((vector_size(64)));

inline void load16(v16 &r, const float *p) { std::memcpy(&r, p, sizeof r); }

constexpr int64_t kChunk = int64_t(1) << 15;   // elements per task: 4 arrays x 128 KiB stay in L2

void adamw_range(float *__restrict p, float *__restrict m, float *__restrict v, const float *__restrict g,
                 int64_t i0, int64_t i1, float lr, float b1, float b2, float eps, float wd, float coef) {
  const float c1 = 1.f - b1, c2 = 1.f - b2;
#pragma GCC ivdep
  for (int64_t i = i0; i < i1; ++i) {
    const float gi = g[i] * coef;
    const float mi = b1 * m[i] + c1 * gi;
    const float vi = b2 * v[i] + c2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    p[i] -= lr * (mi / (std::sqrt(vi) + eps) + wd * p[i]);
  }
}

// sum of x[i]^2 over [i0, i1) in a fixed order: 4 x 16 lanes, then the lanes, then the tail
float sum_squares_range(const float *x, int64_t i0, int64_t i1) {
  v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = i0;
  for (; i + 64 <= i1; i += 64) {
    v16 x0, x1, x2, x3;
    load16(x0, x + i);
    load16(x1, x + i + 16);
    load16(x2, x + i + 32);
    load16(x3, x + i + 48);
    a0 += x0 * x0;
    a1 += x1 * x1;
    a2 += x2 * x2;
    a3 += x3 * x3;
  }
  const v16 a = (a0 + a1) + (a2 + a3);
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += a[l];
  for (; i < i1; ++i) s += x[i] * x[i];
  return s;
}

}  // namespace

// msllm_adamw(param (N) f32, m (N) f32, v (N) f32, grad (N) f32, hyper (8,) f32) -> (1,) f32 (0)
// hyper = [lr, beta1, beta2, eps, weight_decay, coef, skip, unused]; skip != 0: nothing is written
// (an overflowed step: parameter and moments keep their bits). param, m and v are updated in place.
MSLLM_AOT(msllm_adamw) {
  if (nparam != 6 || !all_f32(nparam, dtypes)) return 1;
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int k = 1; k < 4; ++k)
    if (numel(ndims[k], shapes[k]) != n) return 2;
  if (numel(ndims[4], shapes[4]) != 8) return 2;
  float *p = static_cast<float *>(params[0]), *m = static_cast<float *>(params[1]),
        *v = static_cast<float *>(params[2]);
  const float *g = static_cast<const float *>(params[3]), *h = static_cast<const float *>(params[4]);
  static_cast<float *>(params[5])[0] = 0.f;
  if (h[6] != 0.f) return 0;
  const int64_t tasks = (n + kChunk - 1) / kChunk;
  Pool::get().run(static_cast<int>(tasks), [&](int t) {
    const int64_t i0 = t * kChunk, i1 = std::min(n, i0 + kChunk);
    adamw_range(p, m, v, g, i0, i1, h[0], h[1], h[2], h[3], h[4], h[5]);
  });
  return 0;
}

// msllm_sum_squares(x (...) f32) -> (1,) f32: sum of x^2 in float32 per chunk of 2^15 elements,
// the chunks added in order in double (the same bits for any thread count); inf or NaN in x
// gives inf or NaN, which the train step reads as an overflow.
MSLLM_AOT(msllm_sum_squares) {
  if (nparam != 2 || !all_f32(nparam, dtypes)) return 1;
  const int64_t n = numel(ndims[0], shapes[0]);
  const float *x = static_cast<const float *>(params[0]);
  const int64_t tasks = (n + kChunk - 1) / kChunk;
  std::vector<float> part(static_cast<size_t>(std::max<int64_t>(tasks, 1)), 0.f);
  Pool::get().run(static_cast<int>(tasks), [&](int t) {
    const int64_t i0 = t * kChunk, i1 = std::min(n, i0 + kChunk);
    part[t] = sum_squares_range(x, i0, i1);
  });
  double s = 0.0;
  for (float q : part) s += q;
  static_cast<float *>(params[1])[0] = static_cast<float>(s);
  return 0;
}
