// Attention of one new token per sequence over the key/value cache (decoding), grouped-query:
// q (B, H, 1, D) (already scaled by 1/sqrt(D)), k / v (B, K, S, D) the cache, mask (B, 1, 1, S)
// additive (0 = visible, -1e9 = not) -> o (B, H, 1, D) = softmax(q k^T + mask) v.
// What the composed operators do in four steps (repeat_kv's copy of the cache to H heads, the
// score matmul, the softmax, the value matmul), here in one pass over the cache: each task takes
// one (row, key/value head) and its H / K query heads, reads each cached key and value once, and
// keeps an online softmax (Milakov & Gimelshein 2018: running max, rescaled sum and output).
// Inference only (no gradient).
#include "common.h"

#include <cmath>

using namespace msllm;

MSLLM_AOT(msllm_decode_attention) {
  if (nparam != 5 || !all_f32(nparam, dtypes)) return 1;
  const float *q = static_cast<const float *>(params[0]);
  const float *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const float *mask = static_cast<const float *>(params[3]);
  float *o = static_cast<float *>(params[4]);
  if (ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 4) return 2;
  const int64_t b = shapes[0][0], h = shapes[0][1], t = shapes[0][2], d = shapes[0][3];
  const int64_t kv = shapes[1][1], s = shapes[1][2];
  if (t != 1 || shapes[1][0] != b || shapes[1][3] != d || kv <= 0 || h % kv != 0 || shapes[3][3] != s ||
      (shapes[3][0] != b && shapes[3][0] != 1))
    return 2;
  const int64_t group = h / kv;
  const int64_t mask_rows = shapes[3][0];
  Pool::get().run(static_cast<int>(b * kv), [&](int task) {
    const int64_t bi = task / kv, ki = task % kv;
    const float *kb = k + (bi * kv + ki) * s * d;
    const float *vb = v + (bi * kv + ki) * s * d;
    const float *mb = mask + (mask_rows == 1 ? 0 : bi) * s;
    const float *qg = q + (bi * h + ki * group) * d;        // the group's query heads, consecutive
    float *og = o + (bi * h + ki * group) * d;
    std::vector<float> acc(group * d, 0.f), mx(group, -INFINITY), sum(group, 0.f);
    for (int64_t j = 0; j < s; ++j) {
      const float m = mb[j];
      if (m <= -1e30f) continue;                            // -inf: contributes exactly nothing
      const float *kj = kb + j * d, *vj = vb + j * d;
      for (int64_t g = 0; g < group; ++g) {
        const float *qv = qg + g * d;
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * kj[i];
        const float x = dot + m;
        float *a = acc.data() + g * d;
        if (x > mx[g]) {
          const float c = std::exp(mx[g] - x);            // rescale what was summed so far
          sum[g] *= c;
          for (int64_t i = 0; i < d; ++i) a[i] *= c;
          mx[g] = x;
        }
        const float p = std::exp(x - mx[g]);
        sum[g] += p;
        for (int64_t i = 0; i < d; ++i) a[i] += p * vj[i];
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
      for (int64_t i = 0; i < d; ++i) og[g * d + i] = acc[g * d + i] * inv;
    }
  });
  return 0;
}
