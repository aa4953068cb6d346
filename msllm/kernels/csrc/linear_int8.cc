// Weight-only int8 linear layer for inference: y = x (q * s)^T with q (out, in) int8 and s (out, G)
// float32 scales, one per output row and group of `group` consecutive inputs (G = ceil(in / group);
// per-output-channel: G = 1, group = in). The int8 weights are widened to float32 in registers and
// multiplied by their group's scale there (the float32 dequantised weight fl(q s)), the products with x
// summed in float32 FMAs; per output channel the sums of x * q are multiplied by the row's scale once
// at the end instead. No float32 copy of W is made for a few rows. This is
// Golden-Stick's weight-only "A16W8" (RoundToNearest) arithmetic with float32 activations, as
// llama.cpp's Q8_0 dot products widen int8 blocks (its block size is 32 with one fp16 scale each).
//
// Paths, chosen per call:
//   * 1-8 rows of x (decoding: one token per sequence): each thread streams its share of W's rows,
//     two at a time (eight with MSLLM_GEMV_ROWS=8: measured slower here, stream_rows_at_once in
//     stream.h), against every row of x held in cache (memory-bound: the read of W is the step);
//     instruction set by the CPU's flags at run time (__builtin_cpu_supports): AVX-512F (16 lanes),
//     else AVX2 + FMA (8 lanes), else plain C++. Both vector variants are compiled into every build
//     with GCC target attributes, so an AVX2-only machine runs the AVX2 one and a test can run either
//     on an AVX-512 machine (MSLLM_INT8_ISA=avx512|avx2|scalar forces one; one the CPU lacks falls
//     back to the next).
//   * more rows (prefill, scoring): W dequantised to float32 (the same fl(q s)) in slabs of at most
//     2^24 weights, each slab by all threads, then the pool's parallel sgemm (gemm.h), as the
//     bfloat16 path of linear.cc does.
#include "common.h"
#include "avx2.h"
#include "parts.h"

#include <immintrin.h>

// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_* placeholders) when they are
// inlined into a target("avx512f") function of a file compiled without -mavx512f (an AVX2 machine's
// -march=native): a false positive in the header, not in this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using namespace msllm;

namespace {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest path this CPU has, or the one MSLLM_INT8_ISA names (switches.h: tests switch it).
Isa int8_isa() {
  static const bool has512 = __builtin_cpu_supports("avx512f");
  static const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  Isa best = has512 ? Isa::kAvx512 : (has2 ? Isa::kAvx2 : Isa::kScalar);
  switch (switches().int8_isa) {
    case IsaChoice::kNone: return Isa::kScalar;
    case IsaChoice::kAvx2: return has2 ? Isa::kAvx2 : Isa::kScalar;
    default: return best;
  }
}

struct Q8 {           // one int8 weight matrix with its scales
  const int8_t *q;    // (out, in)
  const float *s;     // (out, groups)
  int64_t in, out, group, groups;
};

// ---- plain C++ (any x86-64; also the reference order of the vector paths: per-lane sums) -------
template <int M>
void rows_scalar(const float *x, const Q8 &w, float *y, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t *q = w.q + o * w.in;
    float acc[M] = {};
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = w.s[o * w.groups + g];
      const int64_t i1 = std::min(w.in, (g + 1) * w.group);
      for (int64_t i = g * w.group; i < i1; ++i) {
        const float v = static_cast<float>(q[i]) * s;
        for (int r = 0; r < M; ++r) acc[r] += x[r * w.in + i] * v;
      }
    }
    for (int r = 0; r < M; ++r) y[r * w.out + o] = acc[r];
  }
}

// ---- AVX2 + FMA: 8 int8 weights -> 8 float32 lanes (vpmovsxbd, vcvtdq2ps) ------------------------

MSLLM_AVX2 inline __m256 widen8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p))));
}

// acc[0..M) += the rows of x times one weight row's inputs [i, i1) in steps of 8, widened (and times the
// group's scale s unless PerRow); returns where it stopped (fewer than 8 inputs left). A function of its own
// for 5-8 rows of x so that only the M accumulators and the weights are live in its loop: inlined in
// rows_avx2, GCC 12 kept one of 8 accumulators on the stack (a store and a load per 8 weights on that FMA
// chain; perf annotate on AMD EPYC Zen 3, where int8 at batch 8 then ran 1.5x slower than float32)
template <int M, bool PerRow>
MSLLM_AVX2 __attribute__((noinline)) int64_t fma_rows_many(const float *x, int64_t in, const int8_t *q, int64_t i,
                                                          int64_t i1, __m256 s, __m256 *acc_io, StreamPrefetch pf) {
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = acc_io[r];
  for (; i + 8 <= i1; i += 8) {
    prefetch_ahead(q, i, pf);
    __m256 v = widen8(q + i);
    if (!PerRow) v = _mm256_mul_ps(v, s);
    for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * in + i), v, acc[r]);
  }
  for (int r = 0; r < M; ++r) acc_io[r] = acc[r];
  return i;
}

// R output rows at a time (R x M accumulators; AVX2 has 16 vector registers: R = 2 up to 4 rows of
// x, else 1), the tail of each group (fewer than 8 inputs) in scalar code. PerRow (one group): the
// sums are of x * q and the row's scale multiplies them once at the end (one instruction fewer per
// 8 weights); else each group's widened weights are multiplied by its scale first.
template <int M, int R, bool PerRow>
MSLLM_AVX2 void rows_avx2(const float *x, const Q8 &w, float *y, int64_t o0, int64_t o1, StreamPrefetch pf) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    __m256 acc[R][M], acc2[R][M];
    float tail[R][M] = {};
    for (int j = 0; j < R; ++j)
      for (int r = 0; r < M; ++r) acc[j][r] = acc2[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
      const int64_t i0 = g * w.group, i1 = std::min(w.in, i0 + w.group);
      __m256 s[R];
      for (int j = 0; j < R; ++j) s[j] = _mm256_set1_ps(w.s[(o + j) * w.groups + g]);
      int64_t i = i0;
      // two FMA chains per output at 1-2 rows of x (as gemv_avx2.cc): 0.95x SmolLM2's int8 decode step
      // on this path (benchmarks/results/decode_avx2_unroll_ab_int8_intel_xeon.json)
      if constexpr (M <= 2) {   // the same order for every row of a product (R = 2 and an odd last row)
        for (; i + 16 <= i1; i += 16) {
          __m256 v[R], u[R];
          for (int j = 0; j < R; ++j) prefetch_ahead(w.q + (o + j) * w.in, i, pf);   // stream.h stream_prefetch
          for (int j = 0; j < R; ++j) {
            v[j] = widen8(w.q + (o + j) * w.in + i);
            u[j] = widen8(w.q + (o + j) * w.in + i + 8);
            if (!PerRow) {
              v[j] = _mm256_mul_ps(v[j], s[j]);
              u[j] = _mm256_mul_ps(u[j], s[j]);
            }
          }
          for (int r = 0; r < M; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + r * w.in + i), xu = _mm256_loadu_ps(x + r * w.in + i + 8);
            for (int j = 0; j < R; ++j) {
              acc[j][r] = _mm256_fmadd_ps(xv, v[j], acc[j][r]);
              acc2[j][r] = _mm256_fmadd_ps(xu, u[j], acc2[j][r]);
            }
          }
        }
      }
      if constexpr (M > 4 && R == 1) i = fma_rows_many<M, PerRow>(x, w.in, w.q + o * w.in, i, i1, s[0], acc[0], pf);
      for (; i + 8 <= i1; i += 8) {
        __m256 v[R];
        for (int j = 0; j < R; ++j) prefetch_ahead(w.q + (o + j) * w.in, i, pf);
        for (int j = 0; j < R; ++j) {
          v[j] = widen8(w.q + (o + j) * w.in + i);
          if (!PerRow) v[j] = _mm256_mul_ps(v[j], s[j]);
        }
        for (int r = 0; r < M; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * w.in + i);
          for (int j = 0; j < R; ++j) acc[j][r] = _mm256_fmadd_ps(xv, v[j], acc[j][r]);
        }
      }
      for (; i < i1; ++i)
        for (int j = 0; j < R; ++j) {
          const float q = static_cast<float>(w.q[(o + j) * w.in + i]);
          const float v = PerRow ? q : q * w.s[(o + j) * w.groups + g];
          for (int r = 0; r < M; ++r) tail[j][r] += x[r * w.in + i] * v;
        }
    }
    for (int j = 0; j < R; ++j) {
      const float scale = PerRow ? w.s[o + j] : 1.f;
      for (int r = 0; r < M; ++r) y[r * w.out + o + j] = (hsum8(_mm256_add_ps(acc[j][r], acc2[j][r])) + tail[j][r]) * scale;
    }
  }
  if (o < o1) rows_avx2<M, 1, PerRow>(x, w, y, o, o1, pf);
}

// ---- AVX-512F: 16 int8 weights -> 16 float32 lanes ---------------------------------------------
#define MSLLM_AVX512 __attribute__((target("avx512f,avx2,fma")))

MSLLM_AVX512 inline __m512 widen16(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
}

// the last n < 16 weights of a group: copied to a zeroed block first (no byte-masked load in AVX-512F)
MSLLM_AVX512 inline __m512 widen_tail(const int8_t *p, int64_t n) {
  alignas(16) int8_t buf[16] = {};
  std::memcpy(buf, p, n);
  return widen16(buf);
}

// R output rows at a time (R x M accumulators: R = 2, or 8 at batch 1 and 2 when
// stream_rows_at_once in stream.h says so); PerRow as in rows_avx2. The sums of a row are in the same
// order for every R, so R changes no bit of y; an odd last row runs the plain C++ (its own order).
template <int M, int R, bool PerRow>
MSLLM_AVX512 void rows_avx512(const float *x, const Q8 &w, float *y, int64_t o0, int64_t o1, StreamPrefetch pf) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    const int8_t *q[R];
    __m512 a[R][M];
    for (int j = 0; j < R; ++j) {
      q[j] = w.q + (o + j) * w.in;
      for (int r = 0; r < M; ++r) a[j][r] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < w.groups; ++g) {
      const int64_t i0 = g * w.group, i1 = std::min(w.in, i0 + w.group);
      __m512 s[R];
      if (!PerRow)
        for (int j = 0; j < R; ++j) s[j] = _mm512_set1_ps(w.s[(o + j) * w.groups + g]);
      int64_t i = i0;
      for (; i + 16 <= i1; i += 16) {
        __m512 v[R];
        for (int j = 0; j < R; ++j) prefetch_ahead(q[j], i, pf);   // stream.h stream_prefetch
        for (int j = 0; j < R; ++j) {
          v[j] = widen16(q[j] + i);
          if (!PerRow) v[j] = _mm512_mul_ps(v[j], s[j]);
        }
        for (int r = 0; r < M; ++r) {
          const __m512 xv = _mm512_loadu_ps(x + r * w.in + i);
          for (int j = 0; j < R; ++j) a[j][r] = _mm512_fmadd_ps(xv, v[j], a[j][r]);
        }
      }
      if (i < i1) {
        const __mmask16 k = static_cast<__mmask16>((1u << (i1 - i)) - 1u);
        __m512 v[R];
        for (int j = 0; j < R; ++j) {
          v[j] = widen_tail(q[j] + i, i1 - i);
          if (!PerRow) v[j] = _mm512_mul_ps(v[j], s[j]);
        }
        for (int r = 0; r < M; ++r) {
          const __m512 xv = _mm512_maskz_loadu_ps(k, x + r * w.in + i);
          for (int j = 0; j < R; ++j) a[j][r] = _mm512_fmadd_ps(xv, v[j], a[j][r]);
        }
      }
    }
    for (int j = 0; j < R; ++j) {
      const float c = PerRow ? w.s[o + j] : 1.f;
      for (int r = 0; r < M; ++r) y[r * w.out + o + j] = _mm512_reduce_add_ps(a[j][r]) * c;
    }
  }
  if constexpr (R > 2) {
    if (o < o1) rows_avx512<M, 2, PerRow>(x, w, y, o, o1, pf);
  } else {
    if (o < o1) rows_scalar<M>(x, w, y, o, o1);   // an odd last row
  }
}

// y (m, out) = x (m, in) W^T for 1 <= m <= 8 on the pool: chunks of output rows (~64 KiB of W, at
// least 4 chunks per thread) handed out dynamically, as linear.cc's float32 streaming path.
template <int M>
void stream(const float *x, const Q8 &w, float *y, Isa isa) {
  const int wide = isa == Isa::kAvx512 && M <= 2 ? stream_rows_at_once(1) : 2;
  const StreamPrefetch pf = stream_prefetch(wide);
  for_row_chunks(w.in, 1, w.out, [&](int64_t o0, int64_t o1) {
    const bool per_row = w.groups == 1;
    if (isa == Isa::kAvx512 && wide == 8)
      per_row ? rows_avx512<M, 8, true>(x, w, y, o0, o1, pf) : rows_avx512<M, 8, false>(x, w, y, o0, o1, pf);
    else if (isa == Isa::kAvx512)
      per_row ? rows_avx512<M, 2, true>(x, w, y, o0, o1, pf) : rows_avx512<M, 2, false>(x, w, y, o0, o1, pf);
    else if (isa == Isa::kAvx2)
      per_row ? rows_avx2<M, (M <= 4 ? 2 : 1), true>(x, w, y, o0, o1, pf) : rows_avx2<M, (M <= 4 ? 2 : 1), false>(x, w, y, o0, o1, pf);
    else
      rows_scalar<M>(x, w, y, o0, o1);
  }, wide);
}

void stream_rows(const float *x, const Q8 &w, float *y, int64_t m, Isa isa) {
  switch (m) {
    case 1: stream<1>(x, w, y, isa); break;
    case 2: stream<2>(x, w, y, isa); break;
    case 3: stream<3>(x, w, y, isa); break;
    case 4: stream<4>(x, w, y, isa); break;
    case 5: stream<5>(x, w, y, isa); break;
    case 6: stream<6>(x, w, y, isa); break;
    case 7: stream<7>(x, w, y, isa); break;
    default: stream<8>(x, w, y, isa); break;
  }
}

// W rows [o0, o0 + n) dequantised: dst (n, in) = fl(q * s) in float32
void dequantise(const Q8 &w, int64_t o0, int64_t n, float *dst) {
  parallel_rows(n, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(w.in, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t *q = w.q + (o0 + r) * w.in;
      const float *s = w.s + (o0 + r) * w.groups;
      float *d = dst + r * w.in;
      for (int64_t g = 0; g < w.groups; ++g) {
        const int64_t i1 = std::min(w.in, (g + 1) * w.group);
        for (int64_t i = g * w.group; i < i1; ++i) d[i] = static_cast<float>(q[i]) * s[g];
      }
    }
  });
}

// more than 8 rows: slabs of W dequantised, then the parallel sgemm (columns o0.. of y per slab)
void slab_sgemm(const float *x, const Q8 &w, float *y, int64_t m) {
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(w.out, (int64_t(1) << 24) / std::max<int64_t>(w.in, 1)));
  float *slab = scratch(3, rows * w.in);
  for (int64_t o0 = 0; o0 < w.out; o0 += rows) {
    const int64_t n = std::min(rows, w.out - o0);
    dequantise(w, o0, n, slab);
    parallel_sgemm('N', 'T', m, n, w.in, 1.f, x, w.in, slab, w.in, 0.f, y + o0, w.out);
  }
}

}  // namespace

// x (..., in) float32, w (out, in) int8, scale (out, G) float32, group (1,) float32 -> y (..., out)
// float32 with y = x (w * scale)^T, scale[o, g] applying to inputs g*group .. (g+1)*group - 1 (the
// last group may be shorter; msllm/models/llama/quantization.py makes them); G = 1 with group = in:
// one scale per output row. Returns 1 for other dtypes, 2 for inconsistent shapes.
MSLLM_AOT(msllm_linear_int8) {
  if (nparam != 5) return 1;
  const char *f32[] = {dtypes[0], dtypes[2], dtypes[3], dtypes[4]};
  if (!all_f32(4, f32) || std::strcmp(dtypes[1], "int8") != 0) return 1;
  if (ndims[1] != 2 || ndims[2] != 2) return 2;
  Q8 w;
  w.in = shapes[0][ndims[0] - 1];
  w.out = shapes[1][0];
  w.groups = shapes[2][1];
  w.group = static_cast<int64_t>(*static_cast<const float *>(params[3]));
  if (shapes[1][1] != w.in || shapes[2][0] != w.out || w.groups < 1 || w.group < 1) return 2;
  if ((w.in + w.group - 1) / w.group != w.groups && w.in > 0) return 2;   // G = ceil(in / group)
  w.q = static_cast<const int8_t *>(params[1]);
  w.s = static_cast<const float *>(params[2]);
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[4]);
  const int64_t m = numel(ndims[0], shapes[0]) / std::max<int64_t>(w.in, 1);
  linear_int8_forward(x, w.q, w.s, w.groups, w.group, y, m, w.in, w.out);
  return 0;
}

// x (..., in) float32, q (L, out, in) int8, scale (L, out, G) float32, group (1,) float32, layer (1,) int32 ->
// y (..., out) float32: msllm_linear_int8 on slice ``layer`` of weights stacked over the decoder layers, read
// where they lie (msllm_linear_layer says when; inference only). Returns 1 for other dtypes, 2 for inconsistent
// shapes or a layer out of [0, L).
MSLLM_AOT(msllm_linear_int8_layer) {
  if (nparam != 6) return 1;
  const char *f32[] = {dtypes[0], dtypes[2], dtypes[3], dtypes[5]};
  if (!all_f32(4, f32) || std::strcmp(dtypes[1], "int8") != 0 || std::strcmp(dtypes[4], "int32") != 0) return 1;
  if (ndims[1] != 3 || ndims[2] != 3 || numel(ndims[4], shapes[4]) != 1) return 2;
  const int64_t layers = shapes[1][0], in = shapes[0][ndims[0] - 1], out = shapes[1][1], groups = shapes[2][2];
  const int64_t group = static_cast<int64_t>(*static_cast<const float *>(params[3]));
  const int32_t layer = *static_cast<const int32_t *>(params[4]);
  if (shapes[1][2] != in || shapes[2][0] != layers || shapes[2][1] != out || groups < 1 || group < 1) return 2;
  if ((in + group - 1) / group != groups && in > 0) return 2;
  if (layer < 0 || layer >= layers) return 2;
  const int64_t m = numel(ndims[0], shapes[0]) / std::max<int64_t>(in, 1);
  if (numel(ndims[5], shapes[5]) != m * out) return 2;
  linear_int8_forward(static_cast<const float *>(params[0]), static_cast<const int8_t *>(params[1]) + layer * out * in,
                      static_cast<const float *>(params[2]) + layer * out * groups, groups, group,
                      static_cast<float *>(params[5]), m, in, out);
  return 0;
}

// y (m, out) = x (m, in) (q * s)^T (parts.h): 1-8 rows streamed, more through dequantised slabs.
void msllm::linear_int8_forward(const float *x, const int8_t *q, const float *s, int64_t groups, int64_t group,
                                float *y, int64_t m, int64_t in, int64_t out) {
  if (m <= 0 || out <= 0) return;
  if (in <= 0) {
    std::fill(y, y + m * out, 0.f);
    return;
  }
  Q8 w{q, s, in, out, group, groups};
  if (m <= 8) {
    huge_pages_for(q, in * out);     // decoding streams the weights: 2 MiB pages (stream.h)
    stream_rows(x, w, y, m, int8_isa());
  } else {
    slab_sgemm(x, w, y, m);
  }
}

// Which streaming path msllm_linear_int8 takes now: 2 = AVX-512F, 1 = AVX2 + FMA, 0 = plain C++.
extern "C" __attribute__((visibility("default"))) int msllm_linear_int8_isa() {
  return static_cast<int>(int8_isa());
}
