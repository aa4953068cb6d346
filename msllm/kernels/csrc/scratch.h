// Per-thread scratch buffers kept between kernel calls.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>

namespace msllm {

// Per-thread scratch buffer of at least n floats (kept between calls, 64-byte aligned). Slots: 0-2
// inside attention tasks (attention.cc, decode.cc extend_attention, gemm_bf16.cc), 3 the weight slabs
// of the caller (linear_int8.cc, bf16_sgemm below), 4 decode attention's per-chunk partials
// (decode.cc, the caller's). A kernel that allocated per call instead paid for it in glibc's malloc:
// in SmolLM2's int8 decode step ~4% of the calling thread's time went to _int_malloc, half of it for
// those partials (a `perf` profile with call stacks, Intel Xeon, 2026-11-29).
inline float *scratch(int slot, int64_t n) {
  struct Buf {
    float *p = nullptr;
    int64_t n = 0;
    ~Buf() { std::free(p); }
  };
  static thread_local Buf bufs[5];
  Buf &b = bufs[slot];
  if (b.n < n) {
    std::free(b.p);
    int64_t bytes = ((n * 4 + 63) / 64) * 64;
    b.p = static_cast<float *>(std::aligned_alloc(64, bytes));
    b.n = b.p ? n : 0;
    if (!b.p) throw std::bad_alloc();  // caught by MSLLM_AOT: the kernel returns an error code
  }
  return b.p;
}

}  // namespace msllm
