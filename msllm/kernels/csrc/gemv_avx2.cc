// The weight-streaming product of linear.cc (y (m, out) = x (m, in) W^T for 1-8 rows of x, W float32
// or bfloat16) with AVX2 + FMA, 8 lanes: the path of a CPU without AVX-512 (linear.cc chooses it at
// run time from the CPU's flags, or MSLLM_GEMV_ISA=avx2 on any AVX2 machine). Compiled into every build
// with a GCC target attribute, as linear_int8.cc's AVX2 variant. Each thread streams its share of W's
// rows, R at a time (2, or 8 at one row of x for float32 weights on AMD cores), against every row of x
// held in cache; sums per 8 lanes (two sets, even and odd blocks of 8 inputs, at 1-2 rows of x), then the
// lanes reduced, the last in % 8 inputs in scalar code (another order than the AVX-512 path: float32
// rounding).
#include "common.h"
#include "avx2.h"
#include "parts.h"

#include <immintrin.h>

#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using namespace msllm;

namespace {


MSLLM_AVX2 inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
MSLLM_AVX2 inline __m256 load8(const uint16_t *p) {   // bfloat16 -> float32: a 16-bit shift, exact
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), 16));
}
inline float widen1(float v) { return v; }
inline float widen1(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// output rows [o0, o1), R at a time (R x M accumulators: AVX2 has 16 vector registers)
template <int M, int R, class W>
MSLLM_AVX2 void rows(const float *x, const W *w, float *y, int64_t in, int64_t out, int64_t o0, int64_t o1,
                     StreamPrefetch pf) {
  const int64_t vec = in / 8 * 8;
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    __m256 acc[R][M];
    for (int j = 0; j < R; ++j)
      for (int r = 0; r < M; ++r) acc[j][r] = _mm256_setzero_ps();
    int64_t i = 0;
    // at 1-2 rows of x, a second set of accumulators for the odd 8-input blocks: two FMA chains per output (FMA
    // latency 4 cycles), 16 inputs per iteration. SmolLM2's decode step on the AVX2 path, with against without
    // (one process, alternated; benchmarks/results/decode_avx2_unroll_ab_{float32,bfloat16}_intel_xeon.json):
    // 0.96x (f32) and 0.96x (bf16) the step
    if constexpr (M <= 2) {   // the same order for every row of a product (R = 2 and an odd last row)
      __m256 acc2[R][M];
      for (int j = 0; j < R; ++j)
        for (int r = 0; r < M; ++r) acc2[j][r] = _mm256_setzero_ps();
      for (; i + 16 <= vec; i += 16) {
        __m256 v[R], u[R];
        for (int j = 0; j < R; ++j) prefetch_ahead(w + (o + j) * in, i, pf);   // stream.h stream_prefetch
        for (int j = 0; j < R; ++j) { v[j] = load8(w + (o + j) * in + i); u[j] = load8(w + (o + j) * in + i + 8); }
        for (int r = 0; r < M; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * in + i), xu = _mm256_loadu_ps(x + r * in + i + 8);
          for (int j = 0; j < R; ++j) {
            acc[j][r] = _mm256_fmadd_ps(xv, v[j], acc[j][r]);
            acc2[j][r] = _mm256_fmadd_ps(xu, u[j], acc2[j][r]);
          }
        }
      }
      for (int j = 0; j < R; ++j)
        for (int r = 0; r < M; ++r) acc[j][r] = _mm256_add_ps(acc[j][r], acc2[j][r]);
    }
    for (; i < vec; i += 8) {
      __m256 v[R];
      for (int j = 0; j < R; ++j) prefetch_ahead(w + (o + j) * in, i, pf);
      for (int j = 0; j < R; ++j) v[j] = load8(w + (o + j) * in + i);
      for (int r = 0; r < M; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * in + i);
        for (int j = 0; j < R; ++j) acc[j][r] = _mm256_fmadd_ps(xv, v[j], acc[j][r]);
      }
    }
    for (int j = 0; j < R; ++j)
      for (int r = 0; r < M; ++r) {
        float s = hsum8(acc[j][r]);
        for (int64_t i = vec; i < in; ++i) s += x[r * in + i] * widen1(w[(o + j) * in + i]);
        y[r * out + o + j] = s;
      }
  }
  if (o < o1) rows<M, 1, W>(x, w, y, in, out, o, o1, pf);
}

template <int M, class W>
void stream(const float *x, const W *w, float *y, int64_t in, int64_t out) {
  // chunks of output rows handed out dynamically: ~64 KiB of W each, at least 4 per thread
  // at one row of x, 8 weight rows at once where stream_rows_at_once says 8 (float32 weights on AMD cores),
  // each output still with its two chains (the same bits as 2 rows; the 16 accumulators spill a little).
  // SmolLM2's float32 batch-1 step on an AMD EPYC Zen 3, alternated in one process (decode_gemv_rows_ab.py,
  // benchmarks/results/decode_avx2_rows8_ab_float32_amd_zen3.json): 0.92x (every round below 1, 0.81-0.98);
  // 4 rows: 0.98x (0.86-1.03, decode_avx2_rows4_ab_float32_amd_zen3.json). Outside any framework 2 threads
  // read the float32 weight set at 32.1 GB/s with 8 rows against 25.4 with 2 (weight_stream_bandwidth.py)
  const int wide = M == 1 && stream_rows_at_once(sizeof(W)) == 8 ? 8 : 2;
  const StreamPrefetch pf = stream_prefetch(wide);
  for_row_chunks(
      in, sizeof(W), out,
      [&](int64_t o0, int64_t o1) {
        if (M == 1 && wide == 8)
          rows<1, 8, W>(x, w, y, in, out, o0, o1, pf);
        else
          rows<M, (M <= 4 ? 2 : 1), W>(x, w, y, in, out, o0, o1, pf);
      },
      wide);
}

template <class W>
void dispatch(const float *x, const W *w, float *y, int64_t m, int64_t in, int64_t out) {
  switch (m) {
    case 1: stream<1>(x, w, y, in, out); break;
    case 2: stream<2>(x, w, y, in, out); break;
    case 3: stream<3>(x, w, y, in, out); break;
    case 4: stream<4>(x, w, y, in, out); break;
    case 5: stream<5>(x, w, y, in, out); break;
    case 6: stream<6>(x, w, y, in, out); break;
    case 7: stream<7>(x, w, y, in, out); break;
    default: stream<8>(x, w, y, in, out); break;
  }
}

}  // namespace

void msllm::gemv_avx2(const float *x, const void *w, bool bf16, float *y, int64_t m, int64_t in, int64_t out) {
  if (bf16)
    dispatch(x, static_cast<const uint16_t *>(w), y, m, in, out);
  else
    dispatch(x, static_cast<const float *>(w), y, m, in, out);
}
