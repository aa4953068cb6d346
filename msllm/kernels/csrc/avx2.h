// AVX2 + FMA helpers shared by the kernels' run-time-selected AVX2 paths (linear_int8.cc, gemv_avx2.cc):
// compiled with a per-function target attribute, so the library as a whole still builds for any x86-64.
#pragma once

#include <immintrin.h>

#define MSLLM_AVX2 __attribute__((target("avx2,fma")))

namespace msllm {

// the sum of the 8 lanes of v
MSLLM_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace msllm
