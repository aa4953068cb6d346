// The entry point of every msllm CPU kernel: MindSpore's AOT signature, the optional per-kernel timing,
// and the argument checks every kernel starts with.
//
// Every kernel is an ``extern "C"`` function with the signature MindSpore's ``ops.Custom``
// (func_type="aot", CPU) calls (mindspore/ops/operations/custom_ops.py, docstring of Custom):
//   int f(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
//         void* stream, void* extra)
// params holds the inputs then the outputs (host pointers on CPU); a non-zero return makes
// MindSpore raise. All tensors are contiguous row-major.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "switches.h"

namespace msllm {

// Optional timing of every kernel call (MSLLM_KERNEL_PROFILE=1): calls and wall time per kernel,
// read from Python with msllm_kernel_stats (benchmarks/profile_step.py).
struct KernelStats {
  std::atomic<int64_t> calls{0}, nanos{0};
  const char *name = nullptr;
};
constexpr int kMaxKernels = 64;
inline KernelStats *stats_table() {
  static KernelStats table[kMaxKernels];
  return table;
}
inline bool profiling() {
  static const bool on = [] {
    const char *e = std::getenv("MSLLM_KERNEL_PROFILE");
    return e != nullptr && e[0] == '1';
  }();
  return on;
}
struct ScopedTimer {
  KernelStats *slot = nullptr;
  std::chrono::steady_clock::time_point t0;
  ScopedTimer(const char *name, int id) {
    if (!profiling()) return;
    slot = stats_table() + id;
    slot->name = name;
    t0 = std::chrono::steady_clock::now();
  }
  ~ScopedTimer() {
    if (!slot) return;
    slot->calls.fetch_add(1);
    slot->nanos.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
};
inline int kernel_id(const char *name) {  // a fixed slot per kernel name (assigned on first use)
  static std::atomic<int> next{0};
  static const char *names[kMaxKernels] = {};
  for (int i = 0; i < next.load(); ++i)
    if (names[i] && std::strcmp(names[i], name) == 0) return i;
  int i = next.fetch_add(1);
  names[i % kMaxKernels] = name;
  return i % kMaxKernels;
}

}  // namespace msllm

// Entry point in MindSpore's AOT signature; the body (written after the macro) gets the same
// arguments except stream/extra, runs with the environment's switches as they are at its start
// (switches.h), and is timed when MSLLM_KERNEL_PROFILE=1.
#define MSLLM_AOT(name)                                                                                     \
  static int name##_body(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes);   \
  extern "C" __attribute__((visibility("default"))) int name(int nparam, void **params, int *ndims,         \
                                                             int64_t **shapes, const char **dtypes,         \
                                                             void *, void *) {                              \
    static const int id = msllm::kernel_id(#name);                                                          \
    msllm::ScopedTimer timer(#name, id);                                                                    \
    msllm::SwitchesScope switches_read_once;                                                                \
    try {                                                                                                   \
      return name##_body(nparam, params, ndims, shapes, dtypes);                                            \
    } catch (const std::bad_alloc &) {                                                                      \
      std::fprintf(stderr, "msllm kernel %s: out of memory for its scratch buffers\n", #name);              \
      return 90;                                                                                            \
    } catch (...) {                                                                                         \
      std::fprintf(stderr, "msllm kernel %s: unexpected C++ exception\n", #name);                           \
      return 91;                                                                                            \
    }                                                                                                       \
  }                                                                                                         \
  static int name##_body(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes)

namespace msllm {

// Argument checks: every tensor float32 (returns false otherwise; the kernel then returns 1).
inline bool all_f32(int nparam, const char **dtypes) {
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0 && std::strcmp(dtypes[i], "float") != 0) return false;
  return true;
}

inline int64_t numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

}  // namespace msllm
