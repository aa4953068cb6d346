// The kernels' switches from the environment, in one place (docs/kernels.md, "Switches"). They exist
// to measure one path against another within one process (benchmarks/decode_gemv_rows_ab.py alternates
// them between blocks of decode steps) and for the tests that compare two paths' bits, so they are
// read at run time, not once per process.
//
// They are read at most once per top-level kernel call, not once per product: every MindSpore entry
// point (MSLLM_AOT, aot.h) opens a SwitchesScope, and the first switches() call under it reads them
// into this thread's copy, which later calls return (a kernel that consults none, a norm or the rotary,
// reads nothing). SmolLM2's decode step is one such call making ~210 weight-streaming products, each of
// which read several variables with getenv before. Outside a scope
// (the pool's worker threads, the library's query functions such as msllm_gemv_isa) switches() reads
// the environment at each call. Read once per process instead, where they are used (pool.h, aot.h, stream.h, gemm.h):
// MSLLM_KERNEL_THREADS, MSLLM_KERNEL_PROFILE, MSLLM_NO_HUGE_PAGES, MSLLM_GEMM.
//
// msllm.kernels.check_environment refuses a malformed value by name before the library is loaded
// (one table there lists every variable below with its accepted values); here a value that is not
// one of them leaves the default.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace msllm {

// Which vector path a product takes: the widest the CPU has, AVX2 + FMA, or none (oneDNN's sgemm for
// float32 / bfloat16 weights, plain C++ for int8).
enum class IsaChoice : int8_t { kBest, kAvx2, kNone };

struct Switches {
  // MSLLM_GEMV_PREFETCH / MSLLM_GEMV_PREFETCH_FAR: bytes ahead of its reads a weight-streaming loop
  // prefetches into L1 / into L2, 0 = none, -1 = unset: by the rows the loop streams at once (stream.h
  // stream_prefetch); the first also for decode attention's cache reads (prefetch_block)
  int64_t prefetch_near = -1, prefetch_far = -1;
  bool split_chunks = false;        // MSLLM_GEMV_SPLIT=chunks: chunks handed out one by one (for_row_chunks)
  int gemv_rows = 0;                // MSLLM_GEMV_ROWS=2|8: weight rows streamed at once; 0 = by CPU
  int gemv_max_rows = 8;            // MSLLM_GEMV_MAX_ROWS=4: float32 weights streamed up to 4 rows of x
  IsaChoice gemv_isa = IsaChoice::kBest;   // MSLLM_GEMV_ISA=avx2|none (MSLLM_NO_GEMV=1: none)
  IsaChoice int8_isa = IsaChoice::kBest;   // MSLLM_INT8_ISA=avx2|scalar (scalar: kNone)
  bool attention_generic = false;   // MSLLM_DECODE_ATTENTION=generic: decode attention's generic loops
  bool gemm_bf16_emulate = false;   // MSLLM_GEMM_BF16=emulate: bfloat16 GEMMs as rounded copies + sgemm
};

// True when the environment variable `name` is exactly `value`.
inline bool env_is(const char *name, const char *value) {
  const char *e = std::getenv(name);
  return e && std::strcmp(e, value) == 0;
}

namespace switches_detail {
// a non-negative decimal integer, else `unset`
inline int64_t env_bytes(const char *name, int64_t unset) {
  const char *e = std::getenv(name);
  if (e && *e) {
    char *end = nullptr;
    const long long v = std::strtoll(e, &end, 10);
    if (end && *end == 0 && v >= 0) return v;
  }
  return unset;
}
struct Slot {
  Switches s;
  bool open = false;   // a scope is open on this thread
  bool read = false;   // and `s` holds the environment's switches as read under it
};
inline Slot &slot() {
  static thread_local Slot x;
  return x;
}
}  // namespace switches_detail

// The switches as the environment holds them now.
inline Switches read_switches() {
  using switches_detail::env_bytes;
  Switches s;
  s.prefetch_near = env_bytes("MSLLM_GEMV_PREFETCH", s.prefetch_near);
  s.prefetch_far = env_bytes("MSLLM_GEMV_PREFETCH_FAR", s.prefetch_far);
  s.split_chunks = env_is("MSLLM_GEMV_SPLIT", "chunks");
  s.gemv_rows = env_is("MSLLM_GEMV_ROWS", "8") ? 8 : env_is("MSLLM_GEMV_ROWS", "2") ? 2 : 0;
  s.gemv_max_rows = env_is("MSLLM_GEMV_MAX_ROWS", "4") ? 4 : 8;
  if (env_is("MSLLM_NO_GEMV", "1") || env_is("MSLLM_GEMV_ISA", "none")) s.gemv_isa = IsaChoice::kNone;
  else if (env_is("MSLLM_GEMV_ISA", "avx2")) s.gemv_isa = IsaChoice::kAvx2;
  if (env_is("MSLLM_INT8_ISA", "scalar")) s.int8_isa = IsaChoice::kNone;
  else if (env_is("MSLLM_INT8_ISA", "avx2")) s.int8_isa = IsaChoice::kAvx2;
  s.attention_generic = env_is("MSLLM_DECODE_ATTENTION", "generic");
  s.gemm_bf16_emulate = env_is("MSLLM_GEMM_BF16", "emulate");
  return s;
}

// For the scope's lifetime this thread's switches() are the environment's as the first of them read it.
// Nested scopes (an entry point calling another) keep the outermost one's.
class SwitchesScope {
 public:
  SwitchesScope() : outer_(!switches_detail::slot().open) {
    if (!outer_) return;
    switches_detail::slot().open = true;
    switches_detail::slot().read = false;
  }
  ~SwitchesScope() {
    if (outer_) switches_detail::slot().open = false;
  }
  SwitchesScope(const SwitchesScope &) = delete;
  SwitchesScope &operator=(const SwitchesScope &) = delete;

 private:
  bool outer_;
};

// This thread's switches: read once under its open SwitchesScope, or outside one the environment's now.
inline Switches switches() {
  switches_detail::Slot &x = switches_detail::slot();
  if (!x.open) return read_switches();
  if (!x.read) {
    x.s = read_switches();
    x.read = true;
  }
  return x.s;
}

}  // namespace msllm
