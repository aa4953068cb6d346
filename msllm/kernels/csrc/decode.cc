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

using namespace msllm;

namespace {
constexpr float kHidden = -1e8f;  // mask values at or below this hide the key

// True if one of m[0:n) shows its key (a plain reduction without an early exit, so the compiler
// vectorizes it).
bool any_visible(const float *m, int64_t n) {
  bool any = false;
  for (int64_t k = 0; k < n; ++k) any |= m[k] > kHidden;
  return any;
}

// The slots [first, end) outside of which every one of the ``rows`` mask rows (each ``s`` long) hides
// its key; first = end = 0 when every slot is hidden. A decode step's cache is usually longer than its
// rows' tokens (generation rounds the buffer up, the serving engine to a power of two, chat takes the
// whole context window): the slots after the last token are hidden in every row, and the loops below
// neither visit nor prefetch them. Before, the prefetch ran over the whole buffer: 30 layers' attention
// over 530 visible slots took 1.42 ms in a 1024-slot cache and 2.47 ms in 2048, against 0.93 and 0.91
// ms now (SmolLM2's shapes, outside any framework, benchmarks/decode_stack_kernel.py --slots;
// benchmarks/results/decode_attention_span_ab_intel_xeon.json).
void visible_span(const float *mask, int64_t rows, int64_t s, int64_t &first, int64_t &end) {
  constexpr int64_t kBlock = 64;
  first = s;
  end = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float *m = mask + r * s;
    int64_t e = s;                                  // the row's last visible slot + 1, blocks from the end
    while (e > 0 && !any_visible(m + std::max<int64_t>(e - kBlock, 0), e - std::max<int64_t>(e - kBlock, 0)))
      e = std::max<int64_t>(e - kBlock, 0);
    while (e > 0 && m[e - 1] <= kHidden) --e;
    if (e == 0) continue;                           // the row sees nothing
    int64_t f = 0;                                  // its first visible slot (there is one before e)
    while (!any_visible(m + f, std::min<int64_t>(kBlock, e - f))) f += kBlock;
    while (m[f] <= kHidden) ++f;
    first = std::min(first, f);
    end = std::max(end, e);
  }
  if (first >= end) first = end = 0;
}

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
    int64_t k0 = 0, k1 = 0;                                 // the block's visible keys [k0, k1)
    visible_span(mrows, nq, s, k0, k1);
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

namespace {
// One new token per row with a head dimension of a few whole vectors (64 or 128 floats: every LLaMA
// family member msllm serves but Gemma): one (row, query head) at a time over a chunk's slots, its
// query and its output accumulator held in registers while the slots stream past, instead of the
// generic loops' per-slot calls with the accumulator in memory (the generic path took 3x the caches'
// read time on SmolLM2 (d = 64): compute-bound on loop overhead and store-to-load round trips).
// The sums are those of dot() and axpy() in vec.h, term for term and in the same order (per
// lane: the same chains of fused multiply-adds, then the same horizontal reduction; values added
// slot by slot in slot order), so the result is bit for bit the generic path's
// (tests/kernels/test_kernels_ops.py compares them). Only the loop order changes:
// slots inner, heads outer; a chunk's keys and values are read once per query head (a batch row's
// first head from memory, with the prefetch, its other heads from cache). Two ways of doing the same sums
// with fewer instructions: the scores of kLanes slots are reduced by one transposing tree of the very
// additions each slot's reduction makes (reduce_lanes), and the query heads that share a key/value head
// take each slot's values in one pass (head_values<N, G>). Both builds' bits compared, alternated in one
// process (benchmarks/decode_attention_builds.py, AMD EPYC Zen 5, SmolLM2's 30 layers at 544 slots,
// results/decode_attention_builds_tree_sums_amd_zen5.json): caches cold (a decode step's) batch 1 0.95x,
// batch 8 0.90x the time; in the last-level cache 0.97x / 0.84x.
#if defined(MSLLM_VEC_AVX512)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vload(const float *p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline void vstore(float *p, Vec v) { _mm512_storeu_ps(p, v); }
// q . k over N vectors before its reduction: dot()'s one accumulator
template <int N>
inline Vec dot_partial(const Vec *q, const float *k) {
  Vec acc = vzero();
  for (int i = 0; i < N; ++i) acc = vfma(q[i], vload(k + i * kLanes), acc);
  return acc;
}
// q . k over N vectors: dot_partial, then _mm512_reduce_add_ps (dot()'s reduction)
template <int N>
inline float dot_fixed(const Vec *q, const float *k) {
  return _mm512_reduce_add_ps(dot_partial<N>(q, k));
}
#elif defined(MSLLM_VEC_AVX2)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vload(const float *p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline void vstore(float *p, Vec v) { _mm256_storeu_ps(p, v); }
// q . k over N vectors before its reduction: dot()'s two accumulators (even vectors, odd vectors), added
template <int N>
inline Vec dot_partial(const Vec *q, const float *k) {
  Vec acc0 = vzero(), acc1 = vzero();
  for (int i = 0; i + 1 < N; i += 2) {
    acc0 = vfma(q[i], vload(k + i * kLanes), acc0);
    acc1 = vfma(q[i + 1], vload(k + (i + 1) * kLanes), acc1);
  }
  if (N % 2) acc0 = vfma(q[N - 1], vload(k + (N - 1) * kLanes), acc0);
  return _mm256_add_ps(acc0, acc1);
}
// q . k over N vectors: dot_partial, then hsum8 (dot()'s reduction)
template <int N>
inline float dot_fixed(const Vec *q, const float *k) {
  return hsum8(dot_partial<N>(q, k));
}
#endif

#if defined(MSLLM_VEC_AVX512) || defined(MSLLM_VEC_AVX2)
// The dots of kLanes slots at once: lane s of the result = the horizontal sum of a[s] with the very tree of
// additions dot() ends with (AVX-512: _mm512_reduce_add_ps, lanes i + 8, then i + 4, then i + 2, then
// i + 1; AVX2: hsum8, lanes i + 4, i + 2, i + 1), so each lane is bit for bit dot()'s. One transposing tree
// for all kLanes vectors takes ~45 shuffles and adds (AVX-512) where kLanes reductions of their own take ~130,
// and it returns the sums in a vector, ready for the mask's add and compare. The tree's last stage leaves the
// lanes in the order kTreeOrder (an involution), so the inputs are taken in that order.
#if defined(MSLLM_VEC_AVX512)
constexpr int kTreeOrder[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
inline Vec reduce_lanes(const Vec *in) {
  Vec a[16], b[8], c[4], e[2];
  for (int s = 0; s < 16; ++s) a[s] = in[kTreeOrder[s]];
  for (int i = 0; i < 8; ++i)   // 256-bit halves: lanes i + (i + 8); a[i] in blocks 0-1, a[i + 8] in blocks 2-3
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)   // 128-bit blocks: lanes i + (i + 4)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)   // within a block: lanes 0 + 2, 1 + 3
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x44), _mm512_shuffle_ps(e[0], e[1], 0xEE));   // 0 + 1
}
// score lanes = dots + m, -inf where m <= kHidden (the scalar loop's rule)
inline void store_scores(float *score, Vec dots, const float *m) {
  const Vec mv = vload(m);
  const __mmask16 hidden = _mm512_cmp_ps_mask(mv, _mm512_set1_ps(kHidden), _CMP_LE_OQ);
  vstore(score, _mm512_mask_blend_ps(hidden, _mm512_add_ps(dots, mv), _mm512_set1_ps(-INFINITY)));
}
#else
constexpr int kTreeOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
inline Vec reduce_lanes(const Vec *in) {
  Vec a[8], b[4], c[2];
  for (int s = 0; s < 8; ++s) a[s] = in[kTreeOrder[s]];
  for (int i = 0; i < 4; ++i)   // 128-bit halves: lanes i + (i + 4)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
  for (int i = 0; i < 2; ++i)   // lanes 0 + 2, 1 + 3
    c[i] = _mm256_add_ps(_mm256_unpacklo_ps(b[i], b[i + 2]), _mm256_unpackhi_ps(b[i], b[i + 2]));
  return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x44), _mm256_shuffle_ps(c[0], c[1], 0xEE));   // 0 + 1
}
inline void store_scores(float *score, Vec dots, const float *m) {
  const Vec mv = vload(m);
  const Vec hidden = _mm256_cmp_ps(mv, _mm256_set1_ps(kHidden), _CMP_LE_OQ);
  vstore(score, _mm256_blendv_ps(_mm256_add_ps(dots, mv), _mm256_set1_ps(-INFINITY), hidden));
}
#endif

// For one (row, head): score[j - j0] = q . k_j + m_j (-inf where m_j hides the slot) for the slots
// [j0, j1) of a chunk, k_j = k + j * stride, kLanes slots at a time (reduce_lanes), the rest one by one;
// ``ahead``: prefetch ``block`` floats from ``base + j * stride`` (the row's (K, D) part of slot j) that far
// ahead (the row's first head's pass only: the other heads find the chunk in cache).
template <int N>
void head_scores(const float *q, const float *k, const float *mrow, int64_t stride, int64_t j0, int64_t j1,
                 float *score, const float *base, int64_t block, int64_t ahead) {
  Vec qv[N];
  for (int i = 0; i < N; ++i) qv[i] = vload(q + i * kLanes);
  int64_t j = j0;
  if constexpr (N <= 8) {   // N query vectors + kLanes partial dots stay in registers (AVX-512)
    for (; j + kLanes <= j1; j += kLanes) {
      Vec part[kLanes];
      for (int s = 0; s < kLanes; ++s) {
        if (ahead) prefetch_block(base + (j + s) * stride, block, ahead);
        part[s] = dot_partial<N>(qv, k + (j + s) * stride);
      }
      store_scores(score + (j - j0), reduce_lanes(part), mrow + j);
    }
  }
  for (; j < j1; ++j) {
    if (ahead) prefetch_block(base + j * stride, block, ahead);
    const float m = mrow[j];
    score[j - j0] = m <= kHidden ? -INFINITY : dot_fixed<N>(qv, k + j * stride) + m;
  }
}

// For G heads of one row that share a key/value head (grouped-query attention): out + g * d = sum over the
// visible slots j of [j0, j1), in slot order, p[g * plen + j - j0] v_j (axpy()'s fused multiply-adds into a
// zeroed accumulator, each head's the same chain as on its own), v_j = v + j * stride. Each slot's values are
// loaded once for the G heads, and G x N independent accumulator chains keep the FMA units busy where one
// head's N chains wait on their own latency.
template <int N, int G>
void head_values(const float *p, int64_t plen, const float *v, const float *mrow, int64_t stride, int64_t j0,
                 int64_t j1, float *out, int64_t d, const float *base, int64_t block, int64_t ahead) {
  Vec acc[G][N];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < N; ++i) acc[g][i] = vzero();
  for (int64_t j = j0; j < j1; ++j) {
    if (ahead) prefetch_block(base + j * stride, block, ahead);
    if (mrow[j] <= kHidden) continue;
    const float *vj = v + j * stride;
    for (int g = 0; g < G; ++g) {
      const Vec pv = vset1(p[g * plen + j - j0]);
      for (int i = 0; i < N; ++i) acc[g][i] = vfma(pv, vload(vj + i * kLanes), acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < N; ++i) vstore(out + g * d + i * kLanes, acc[g][i]);
}

using ValuesKernel = decltype(&head_values<1, 1>);
struct HeadKernels {
  decltype(&head_scores<1>) scores = nullptr;
  ValuesKernel values[4] = {};   // values[G - 1]: G heads at once, G <= at_once
  int at_once = 0;
};
// Heads whose accumulators (G x N vectors) fit the registers with room for the loads: AVX-512's 32, AVX2's 16.
template <int N>
HeadKernels kernels_for() {
  constexpr int kAtOnce = std::max(1, std::min(4, (kLanes == 16 ? 16 : 8) / N));
  HeadKernels h{head_scores<N>, {head_values<N, 1>, head_values<N, 2>, head_values<N, 3>, head_values<N, 4>}, kAtOnce};
  return h;
}
// The fixed-width kernels for head dimension d, or none (the generic loops then serve d).
// MSLLM_DECODE_ATTENTION=generic picks the generic loops for every d (switches.h: the kernel
// tests compare the two paths' bits in one process).
inline HeadKernels head_kernels(int64_t d) {
  if (switches().attention_generic) return {};
  switch (d) {
    case 4 * kLanes: return kernels_for<4>();
    case 8 * kLanes: return kernels_for<8>();
#if defined(MSLLM_VEC_AVX512)
    case 16 * kLanes: return kernels_for<16>();
#endif
    default: return {};
  }
}
#else
struct HeadKernels {
  void *scores = nullptr;
};
inline HeadKernels head_kernels(int64_t) { return {}; }
#endif
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
  // the slots some row sees, [first, end), in chunks of at least 32 slots, about 4 per thread so the pool
  // can balance them
  int64_t first = 0, end = 0;
  visible_span(mask, mask_rows, s, first, end);
  const int64_t want = 4 * static_cast<int64_t>(Pool::get().size());
  const int64_t len = std::max<int64_t>(32, (end - first + want - 1) / want);
  const int64_t chunks = (end - first + len - 1) / len;
  // per chunk: scores (B*H*T, len), then max (B*H*T), sum (B*H*T), acc (B*H*T, D)
  const int64_t per = bh * len + 2 * bh + bh * d;
  float *const work = scratch(4, chunks * per);            // every element written before it is read
  const int64_t ahead = stream_prefetch(2).near;            // the cache is read in slot order (stream.h prefetch_block)
  const HeadKernels fixed = head_kernels(d);
  Pool::get().run(static_cast<int>(chunks), [&](int c) {
    FlushDenormals ftz;
    const int64_t j0 = first + c * len, j1 = std::min<int64_t>(end, j0 + len), n = j1 - j0;
    float *score = work + c * per, *mx = score + bh * len, *sum = mx + bh, *acc = sum + bh;
#if defined(MSLLM_VEC_AVX512) || defined(MSLLM_VEC_AVX2)
    if (fixed.scores) {                                     // t == 1 here: row r = (batch row, head)
      for (int64_t r = 0; r < bh; ++r) {
        const int64_t bi = r / h, hi = r % h;
        const float *mrow = mask + (mask_rows == 1 ? 0 : bi) * s;
        fixed.scores(q + r * d, k + (bi * kv + hi / group) * d, mrow, stride, j0, j1, score + r * len, k + bi * kv * d, kv * d,
                     hi == 0 ? ahead : 0);
      }
      for (int64_t r = 0; r < bh; ++r) {
        float *sr = score + r * len;
        mx[r] = row_max(sr, n);
        sum[r] = mx[r] == -INFINITY ? 0.f : exp_shift_sum(sr, sr, n, 1.f, mx[r]);
      }
      for (int64_t r = 0; r < bh;) {                         // the heads of a key/value head, up to at_once together
        const int64_t bi = r / h, hi = r % h;
        const int heads = static_cast<int>(std::min<int64_t>(fixed.at_once, group - hi % group));
        const float *mrow = mask + (mask_rows == 1 ? 0 : bi) * s;
        fixed.values[heads - 1](score + r * len, len, v + (bi * kv + hi / group) * d, mrow, stride, j0, j1, acc + r * d,
                                d, v + bi * kv * d, kv * d, hi == 0 ? ahead : 0);
        r += heads;
      }
      return;
    }
#endif
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
      const float *mc = work + c * per + bh * len;
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
