// Attention of one new token per sequence over the key/value cache (decoding), grouped-query:
// q (B, H, 1, D) (already scaled by 1/sqrt(D)), k / v (S * B, K, D) the cache (slots first, flat:
// row s * B + b is slot s of batch row b, the layout msllm/models/llama/kv_cache.py writes in
// place), mask (B, 1, 1, S)
// additive (0 = visible; at or below -1e8, msllm's -1e9 or -inf = hidden) -> o (B, H, 1, D) =
// softmax(q k^T + mask) v.
// What the composed operators do in four steps (repeat_kv's copy of the cache to H heads, the
// score matmul, the softmax, the value matmul), here in one read of the cache. The slots are
// split into chunks (split-KV, "Flash-Decoding": Dao, Haziza, Massa & Sizov 2023), one task per
// chunk: a slot's keys and values for every row and head are one contiguous (B, K, D) block, so
// each task streams its slots' blocks in memory order (a task per (row, head) instead reads 256
// bytes out of every B K D x 4 bytes: measured 3.4x slower at SmolLM2's batch 8). Per chunk: the
// scores of every (row, query head) with AVX-512 dot products, their max and exp-sum, then the
// probabilities times the values; the chunks' partial results are merged with the usual
// rescaling by exp(chunk max - overall max) (Milakov & Gimelshein 2018). Hidden keys are
// skipped: they contribute exactly 0, as exp(-1e9 - max) does in float32 in the composed
// softmax. Inference only (no gradient).
// With T > 1 queries per row (q (B, H, T, D), mask (B or 1, 1, T, S): a prefill piece over the
// cache, the serving engine's chunked prefill and prefix cache) the work is blocked by queries
// instead, as flash attention is (extend_attention below): the slot-chunk loop would read every
// key once per query.
#include "common.h"
#include "parts.h"

#include <cmath>
#include <memory>

using namespace msllm;

namespace {
constexpr float kHidden = -1e8f;  // mask values at or below this hide the key

}  // namespace

MSLLM_AOT(msllm_decode_attention) {
  if (nparam != 5 || !all_f32(nparam, dtypes)) return 1;
  const float *q = static_cast<const float *>(params[0]);
  const float *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const float *mask = static_cast<const float *>(params[3]);
  float *o = static_cast<float *>(params[4]);
  // the caches are flat (S * B, K, D): cache row s * B + b holds slot s of batch row b.
  // q (B, H, T, D) with mask (B or 1, 1, T, S): T = 1 a decode step, T > 1 new tokens over a
  // cache holding earlier ones (the serving engine's prefill pieces); each query has its own
  // mask row, so (row, head, query) triples are the rows of the computation
  if (ndims[0] != 4 || ndims[1] != 3 || ndims[2] != 3 || ndims[3] != 4) return 2;
  const int64_t b = shapes[0][0], h = shapes[0][1], t = shapes[0][2], d = shapes[0][3];
  if (b <= 0 || t <= 0 || shapes[1][0] % b != 0) return 2;
  const int64_t s = shapes[1][0] / b, kv = shapes[1][1];
  if (shapes[1][2] != d || kv <= 0 || h % kv != 0 || shapes[3][3] != s || shapes[3][2] != t ||
      (shapes[3][0] != b && shapes[3][0] != 1) || shapes[2][0] != s * b || shapes[2][1] != kv || shapes[2][2] != d)
    return 2;
  decode_attention_forward(q, k, v, mask, o, b, h, t, d, s, kv, shapes[3][0]);
  return 0;
}

namespace {
// T > 1 queries per row (a prefill piece over the cache): blocked like flash attention
// (attention.cc) instead of query by query. One task per (batch row, query head, block of up to
// 64 queries): the block's visible key range [k0, k1) from its mask rows, S = Q K^T and O = P V
// as two oneDNN GEMMs reading the keys and values of the row's head straight from the flat cache
// (leading dimension B K D), the mask added and each row's softmax in between. Each slot's keys
// are read once per block, not once per query: the query-by-query loop below took 194 ms per
// SmolLM2 layer for 512 queries over 2048 slots, this 21 ms (benchmarks/extend_attention.py,
// benchmarks/results/extend_attention_intel_xeon.json).
constexpr int64_t kExtendBlock = 64;

void extend_attention(const float *q, const float *k, const float *v, const float *mask, float *o, int64_t b,
                      int64_t h, int64_t t, int64_t d, int64_t s, int64_t kv, int64_t mask_rows) {
  const int64_t group = h / kv, stride = b * kv * d, nqb = (t + kExtendBlock - 1) / kExtendBlock, nbh = b * h;
  Pool::get().run(static_cast<int>(nbh * nqb), [&](int i) {
    FlushDenormals ftz;
    const int64_t qb = i / nbh, bh = i % nbh, bi = bh / h, hi = bh % h;
    const int64_t q0 = qb * kExtendBlock, nq = std::min(kExtendBlock, t - q0);
    const float *mrows = mask + ((mask_rows == 1 ? 0 : bi) * t + q0) * s;  // (nq, s)
    float *op = o + (bh * t + q0) * d;
    int64_t k0 = s, k1 = 0;                                 // the block's visible keys [k0, k1)
    for (int64_t r = 0; r < nq; ++r) {
      const float *mr = mrows + r * s;
      int64_t lo = 0, hi_ = s;
      while (lo < s && mr[lo] <= kHidden) ++lo;
      if (lo == s) continue;
      while (mr[hi_ - 1] <= kHidden) --hi_;
      k0 = std::min(k0, lo);
      k1 = std::max(k1, hi_);
    }
    if (k0 >= k1) {                                          // nothing visible: output 0
      std::fill(op, op + nq * d, 0.f);
      return;
    }
    const int64_t nk = k1 - k0;
    const float *kp = k + k0 * stride + (bi * kv + hi / group) * d;
    const float *vp = v + k0 * stride + (bi * kv + hi / group) * d;
    float *sc = scratch(0, kExtendBlock * s);
    sgemm('N', 'T', nq, nk, d, 1.f, q + (bh * t + q0) * d, d, kp, stride, 0.f, sc, nk);  // S (nq, nk)
    float inv[kExtendBlock];
    for (int64_t r = 0; r < nq; ++r) {
      float *row = sc + r * nk;
      const float *mr = mrows + r * s + k0;
      for (int64_t j = 0; j < nk; ++j) row[j] = mr[j] <= kHidden ? -INFINITY : row[j] + mr[j];
      const float mx = row_max(row, nk);
      if (mx == -INFINITY) {                                 // this query sees nothing: output 0
        std::fill(row, row + nk, 0.f);
        inv[r] = 0.f;
        continue;
      }
      inv[r] = 1.f / exp_shift_sum(row, row, nk, 1.f, mx);
    }
    sgemm('N', 'N', nq, d, nk, 1.f, sc, nk, vp, stride, 0.f, op, d);                      // O = P V (nq, d)
    for (int64_t r = 0; r < nq; ++r)
      for (int64_t c = 0; c < d; ++c) op[r * d + c] *= inv[r];
  });
}
}  // namespace

// The computation of msllm_decode_attention on checked shapes (parts.h).
void msllm::decode_attention_forward(const float *q, const float *k, const float *v, const float *mask, float *o,
                                     int64_t b, int64_t h, int64_t t, int64_t d, int64_t s, int64_t kv,
                                     int64_t mask_rows) {
  if (t > 1) {
    extend_attention(q, k, v, mask, o, b, h, t, d, s, kv, mask_rows);
    return;
  }
  const int64_t group = h / kv, bh = b * h * t;             // rows: (batch row, head, query)
  const int64_t stride = b * kv * d;                        // from one slot to the next
  // chunks of at least 32 slots, about 4 per thread so the pool can balance them
  const int64_t want = 4 * static_cast<int64_t>(Pool::get().size());
  const int64_t len = std::max<int64_t>(32, (s + want - 1) / want);
  const int64_t chunks = (s + len - 1) / len;
  // per chunk: scores (B*H*T, len), then max (B*H*T), sum (B*H*T), acc (B*H*T, D)
  const int64_t per = bh * len + 2 * bh + bh * d;
  std::unique_ptr<float[]> work(new float[chunks * per]);   // every element written before it is read
  const int64_t ahead = stream_prefetch_bytes();            // the cache is read in slot order (common.h prefetch_block)
  Pool::get().run(static_cast<int>(chunks), [&](int c) {
    FlushDenormals ftz;
    const int64_t j0 = c * len, j1 = std::min<int64_t>(s, j0 + len), n = j1 - j0;
    float *score = work.get() + c * per, *mx = score + bh * len, *sum = mx + bh, *acc = sum + bh;
    for (int64_t j = j0; j < j1; ++j) {                     // keys: slot j's (B, K, D) block
      const float *kj = k + j * stride;
      prefetch_block(kj, stride, ahead);
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t ti = 0; ti < t; ++ti) {
          const float m = mask[((mask_rows == 1 ? 0 : bi) * t + ti) * s + j];
          for (int64_t hi = 0; hi < h; ++hi) {
            const int64_t r = (bi * h + hi) * t + ti;
            score[r * len + (j - j0)] = m <= kHidden ? -INFINITY : dot(q + r * d, kj + (bi * kv + hi / group) * d, d) + m;
          }
        }
    }
    for (int64_t r = 0; r < bh; ++r) {                      // softmax numerators of the chunk
      float *sr = score + r * len;
      mx[r] = row_max(sr, n);
      sum[r] = mx[r] == -INFINITY ? 0.f : exp_shift_sum(sr, sr, n, 1.f, mx[r]);
    }
    std::fill(acc, acc + bh * d, 0.f);
    for (int64_t j = j0; j < j1; ++j) {                     // values: slot j's (B, K, D) block
      const float *vj = v + j * stride;
      prefetch_block(vj, stride, ahead);
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t ti = 0; ti < t; ++ti) {
          if (mask[((mask_rows == 1 ? 0 : bi) * t + ti) * s + j] <= kHidden) continue;
          for (int64_t hi = 0; hi < h; ++hi) {
            const int64_t r = (bi * h + hi) * t + ti;
            axpy(acc + r * d, vj + (bi * kv + hi / group) * d, score[r * len + (j - j0)], d);
          }
        }
    }
  });
  for (int64_t r = 0; r < bh; ++r) {                        // merge the chunks
    float top = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, work[c * per + bh * len + r]);
    float *out = o + r * d;
    std::fill(out, out + d, 0.f);
    if (top == -INFINITY) continue;                         // nothing visible: output 0
    float total = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float *mc = work.get() + c * per + bh * len;
      if (mc[r] == -INFINITY) continue;
      const float w = std::exp(mc[r] - top);
      total += w * mc[bh + r];
      axpy(out, mc + 2 * bh + r * d, w, d);
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < d; ++i) out[i] *= inv;
  }
}

// Embedding lookup from a float32 or bfloat16 table (V, C) -> float32 rows: ids (...) int32 ->
// (..., C). MindSpore 2.10's CPU Gather has no bfloat16 kernel, and a table kept in bfloat16 for
// the output head (tied embeddings, inference with param_init_type bfloat16) would otherwise need
// a float32 copy of the whole table per call. Widening bf16 -> f32 is exact. Ids outside [0, V)
// give zero rows (nn.Embedding's CPU Gather does the same). Inference only (no gradient).
MSLLM_AOT(msllm_embedding) {
  if (nparam != 3 || std::strcmp(dtypes[1], "int32") != 0 || !all_f32(1, dtypes + 2)) return 1;
  const bool bf16 = std::strcmp(dtypes[0], "bfloat16") == 0;
  if (!bf16 && !all_f32(1, dtypes)) return 1;
  if (ndims[0] != 2) return 2;
  const int64_t v = shapes[0][0], c = shapes[0][1], n = numel(ndims[1], shapes[1]);
  const int32_t *ids = static_cast<const int32_t *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  parallel_rows(n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float *row = out + r * c;
      const int64_t id = ids[r];
      if (id < 0 || id >= v) {
        std::fill(row, row + c, 0.f);
      } else if (bf16) {
        widen_bf16(static_cast<const uint16_t *>(params[0]) + id * c, row, c);
      } else {
        const float *src = static_cast<const float *>(params[0]) + id * c;
        std::copy(src, src + c, row);
      }
    }
  });
  return 0;
}
