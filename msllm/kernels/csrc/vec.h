// Arithmetic helpers of the kernels: the float32 mode for denormals, bfloat16 widening, exp, and the
// vectorised row max / exp-sum / dot / axpy in their AVX-512, AVX2 and plain C++ forms.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "avx2.h"   // hsum8
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace msllm {

// Flush denormal results and inputs to zero on this thread for the scope (MXCSR FTZ | DAZ), then
// restore the caller's mode: attention over a long cache multiplies values by probabilities down
// to ~1e-38, whose denormal products run ~25x slower (measured on decode_attention with widely
// spread scores: 3.3 ms vs 0.13 ms per call); a value below 1.2e-38 changes nothing at float32's
// relative precision.
struct FlushDenormals {
#if defined(__SSE__)
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// dst[0:n) = src[0:n) widened from bfloat16 (the upper 16 bits of a float32: exact).
inline void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

// exp(x) for float: Cephes expf (range reduction x = n ln2 + r, degree-6 polynomial on r; about
// 1 ulp on [-87, 88]). Its constants, used by the scalar form (tails) and the AVX-512 and AVX2 forms below:
// the input range, log2(e), ln 2 in two parts (high, then the low correction) and the polynomial's
// coefficients from the highest power down.
namespace cephes_exp {
constexpr float kLo = -87.3365478515625f, kHi = 88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kP[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                         4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
}  // namespace cephes_exp

inline float exp_scalar(float x) {
  using namespace cephes_exp;
  x = std::min(std::max(x, kLo), kHi);
  float n = std::floor(x * kLog2e + 0.5f);
  float r = x - n * kLn2Hi + n * kLn2Lo;
  float p = kP[0];
  for (int k = 1; k < 6; ++k) p = p * r + kP[k];
  p = p * r * r + r + 1.0f;
  return std::ldexp(p, (int)n);
}

// The vector helpers below have three forms, chosen when the library is compiled (-march=native, or
// MSLLM_KERNELS_MARCH): AVX-512F (16 lanes, masked tails), AVX2 + FMA (8 lanes, scalar tails: AMD Zen 3,
// Intel before Skylake-SP) and plain C++. The forms sum in different orders, so results differ by float32
// rounding between the paths, never within one; msllm_vector_isa() says which one this build has.
#if defined(__AVX512F__)
#define MSLLM_VEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MSLLM_VEC_AVX2 1
#endif

#if defined(MSLLM_VEC_AVX512)
inline __m512 exp512(__m512 x) {
  using namespace cephes_exp;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLo)), _mm512_set1_ps(kHi));
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int k = 1; k < 6; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[k]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
#elif defined(MSLLM_VEC_AVX2)
// 2^n for integral n in [-126, 128] as two factors 2^(n/2) 2^(n - n/2), each a normal float built from
// its exponent bits (AVX2 has no scalef; one factor 2^128 would overflow where exp(88.37) does not)
inline __m256 exp256(__m256 x) {
  using namespace cephes_exp;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLo)), _mm256_set1_ps(kHi));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int k = 1; k < 6; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[k]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
inline float hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// max over x[0:n)
inline float row_max(const float *x, int64_t n) {
  int64_t j = 0;
  float m = -INFINITY;
#if defined(MSLLM_VEC_AVX512)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= n; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + j));
  m = _mm512_reduce_max_ps(vm);
#elif defined(MSLLM_VEC_AVX2)
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
  m = hmax256(vm);
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// Sums of exponentials over long rows (a vocabulary of 49k-150k logits, a decode row of up to 131k cached
// slots) are taken in blocks of kExpSumBlock terms: each block summed in its own vector, then added to the
// total. One running float32 sum per lane instead lost every term below half a unit in the last place of
// that lane's sum, always downwards: SmolLM2's log-sum-exp came out ~1e-5 low on AVX2, whose 8 lanes each
// summed 6144 of its 49152 logits (AVX-512's 16 lanes, half that). tests/kernels/test_kernels_exp_sum.py.
constexpr int64_t kExpSumBlock = 256;

// y[j] = exp(alpha * x[j] - shift) for j < n when kStore; returns the sum (y may alias x)
template <bool kStore>
inline float exp_shift_sum_blocked(const float *x, float *y, int64_t n, float alpha, float shift) {
  int64_t j = 0;
  float s = 0.f;
#if defined(MSLLM_VEC_AVX512)
  __m512 va = _mm512_set1_ps(alpha), vs = _mm512_set1_ps(shift), total = _mm512_setzero_ps();
  while (j < n) {   // kExpSumBlock is a multiple of 16: only the last vector is partial
    const int64_t end = std::min(n, j + kExpSumBlock);
    __m512 acc = _mm512_setzero_ps();
    for (; j < end; j += 16) {
      __mmask16 k = tail_mask(end - j);
      __m512 e = exp512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, x + j), va, vs));
      e = _mm512_maskz_mov_ps(k, e);
      if constexpr (kStore) _mm512_mask_storeu_ps(y + j, k, e);
      acc = _mm512_add_ps(acc, e);
    }
    total = _mm512_add_ps(total, acc);
  }
  s = _mm512_reduce_add_ps(total);
#else
#if defined(MSLLM_VEC_AVX2)
  __m256 va = _mm256_set1_ps(alpha), vs = _mm256_set1_ps(shift), total = _mm256_setzero_ps();
  const int64_t vec = n / 8 * 8;
  while (j < vec) {
    const int64_t end = std::min(vec, j + kExpSumBlock);
    __m256 acc = _mm256_setzero_ps();
    for (; j < end; j += 8) {
      const __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), va, vs));
      if constexpr (kStore) _mm256_storeu_ps(y + j, e);
      acc = _mm256_add_ps(acc, e);
    }
    total = _mm256_add_ps(total, acc);
  }
  s = hsum8(total);
#endif
  float block = 0.f;
  for (int64_t b = 0; j < n; ++j) {
    const float e = exp_scalar(alpha * x[j] - shift);
    if constexpr (kStore) y[j] = e;
    block += e;
    if (++b == kExpSumBlock) s += block, block = 0.f, b = 0;
  }
  s += block;
#endif
  return s;
}

// y[j] = exp(alpha * x[j] - shift) for j < n; returns the sum (y may alias x)
inline float exp_shift_sum(const float *x, float *y, int64_t n, float alpha, float shift) {
  return exp_shift_sum_blocked<true>(x, y, n, alpha, shift);
}

// sum_j exp(x[j] - shift) for j < n
inline float exp_sum(const float *x, int64_t n, float shift) {
  return exp_shift_sum_blocked<false>(x, nullptr, n, 1.f, shift);
}

// sum_j a[j] * b[j]
inline float dot(const float *a, const float *b, int64_t n) {
  int64_t j = 0;
  float s = 0.f;
#if defined(MSLLM_VEC_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(MSLLM_VEC_AVX2)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), acc1);
  }
  if (j + 8 <= n) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
    j += 8;
  }
  s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// acc[0:d) += p * v[0:d)
inline void axpy(float *acc, const float *v, float p, int64_t d) {
  int64_t i = 0;
#if defined(MSLLM_VEC_AVX512)
  const __m512 pv = _mm512_set1_ps(p);
  for (; i < d; i += 16) {
    const __mmask16 m = tail_mask(d - i);
    _mm512_mask_storeu_ps(acc + i, m, _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, v + i), _mm512_maskz_loadu_ps(m, acc + i)));
  }
#elif defined(MSLLM_VEC_AVX2)
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < d; ++i) acc[i] += p * v[i];
}

// 2 = AVX-512F, 1 = AVX2 + FMA, 0 = plain C++: the form of the helpers above in this build
constexpr int vector_isa() {
#if defined(MSLLM_VEC_AVX512)
  return 2;
#elif defined(MSLLM_VEC_AVX2)
  return 1;
#else
  return 0;
#endif
}

}  // namespace msllm
