// Shared pieces of msllm's CPU kernels: the MindSpore AOT entry signature, a small persistent
// thread pool, a parallel fp32 GEMM on oneDNN's dnnl_sgemm, and AVX-512 helpers (exp, sums).
//
// Every kernel is an ``extern "C"`` function with the signature MindSpore's ``ops.Custom``
// (func_type="aot", CPU) calls (mindspore/ops/operations/custom_ops.py, docstring of Custom):
//   int f(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
//         void* stream, void* extra)
// params holds the inputs then the outputs (host pointers on CPU); a non-zero return makes
// MindSpore raise. All tensors are contiguous row-major float32.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include <sched.h>
#include <sys/mman.h>
#include <unordered_set>

#include "switches.h"
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

// ---------------------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------------------
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

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// ---------------------------------------------------------------------------------------------
// Thread pool. MindSpore runs its CPU kernels one after another on its actor thread; while one
// of ours runs, MindSpore's own kernel threads sleep, so the pool uses (cores - 1) workers plus
// the calling thread. Workers spin ~50 us after a job (kernels come back to back) and then
// sleep on a futex (std::atomic::wait), so they do not steal cycles from MindSpore's kernels; the
// caller waits for the workers the same way (spin ~50 us, then sleep).
// Size: MSLLM_KERNEL_THREADS if set, else the number of CPUs this process may run on.
class Pool {
 public:
  static Pool &get() {
    static Pool pool;
    return pool;
  }
  int size() const { return n_; }

  // Calls fn(i) for every i in [0, ntasks), tasks handed out dynamically; returns when all ran.
  // A call from inside a task runs its tasks inline (no nesting). Re-entrant: the pool's one
  // job/next/busy state belongs to one caller at a time (owner_); a second thread that launches a
  // kernel meanwhile (MindSpore may run two CPU kernels at once) runs its tasks inline on its own
  // thread instead of waiting. A task that throws (std::bad_alloc from scratch()) stops the hand-out;
  // the exception is rethrown to the caller once every worker is back.
  template <class F>
  void run(int ntasks, F &&fn) {
    if (ntasks <= 0) return;
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (n_ == 1 || ntasks == 1 || in_pool() || !owner.owns_lock()) {
      for (int i = 0; i < ntasks; ++i) fn(i);
      return;
    }
    std::function<void(int)> job(fn);
    job_ = &job;
    ntasks_ = ntasks;
    failed_.store(false, std::memory_order_relaxed);
    next_.store(0, std::memory_order_relaxed);
    busy_.store(n_ - 1, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
    epoch_.notify_all();
    in_pool() = true;
    work();
    in_pool() = false;
    // Wait for the workers: spin briefly (they usually finish within microseconds of the caller),
    // then sleep on the counter. Spinning longer is harmful when runnable threads outnumber cores
    // (two processes on 2 cores: data-parallel ranks on one machine, a test run on 2 workers): a
    // worker descheduled mid-task needs the very core this loop would burn for a whole time slice.
    auto t0 = std::chrono::steady_clock::now();
    for (int b; (b = busy_.load(std::memory_order_acquire)) != 0;) {
      if (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(kSpinMicros)) cpu_relax();
      else busy_.wait(b, std::memory_order_acquire);
    }
    job_ = nullptr;
    if (failed_.load(std::memory_order_acquire)) throw std::bad_alloc();
  }

 private:
  Pool() {
    int n = 1;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    if (const char *e = std::getenv("MSLLM_KERNEL_THREADS"))
      if (std::atoi(e) > 0) n = std::atoi(e);
    n_ = std::max(1, n);
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    stop_.store(true);
    epoch_.fetch_add(1);
    epoch_.notify_all();
    for (auto &t : workers_) t.join();
  }
  static bool &in_pool() {
    static thread_local bool flag = false;
    return flag;
  }
  void work() {
    for (;;) {
      int i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= ntasks_) break;
      try {
        (*job_)(i);
      } catch (...) {  // no exception may leave a worker thread: record it, hand out no more tasks
        failed_.store(true, std::memory_order_release);
        next_.store(ntasks_, std::memory_order_relaxed);
      }
    }
  }
  void loop() {
    in_pool() = true;
    uint32_t seen = 0;  // the epoch at construction (run() may already have moved it on)
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      uint32_t e;
      while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
        cpu_relax();
        if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(kSpinMicros)) epoch_.wait(seen);
      }
      seen = e;
      if (stop_.load()) return;
      work();
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) busy_.notify_one();   // the last one wakes the caller
    }
  }

  static constexpr int kSpinMicros = 50;   // spin this long before sleeping (workers and caller alike)
  int n_ = 1;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int> next_{0}, busy_{0};
  std::atomic<bool> stop_{false}, failed_{false};
  std::mutex owner_;
  std::function<void(int)> *job_ = nullptr;
  int ntasks_ = 0;
};

// Weights read at every decode step on 2 MiB pages (transparent huge pages): the 2 MiB-aligned
// regions holding [p, p + bytes) are advised MADV_HUGEPAGE and collapsed now (MADV_COLLAPSE,
// Linux 6.1; synchronous), once per region. A decode step streams all weights from memory; on
// 4 KiB pages each page is a TLB miss and the hardware prefetcher restarts at every page
// boundary. Only the page size changes, never the contents. Errors (an older kernel, THP off,
// a region spanning two mappings) are ignored: the pages stay as they were. Measured on SmolLM2's
// float32 batch-1 decode step (Intel Xeon, 3 alternating rounds): 43.4-43.9 ms -> 41.2-42.1 ms.
// MSLLM_NO_HUGE_PAGES=1 turns it off (read once).
inline void huge_pages_for(const void *p, int64_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  constexpr int kMadvCollapse = 25;      // MADV_COLLAPSE (linux/mman.h); older glibc headers lack the name
  static const bool off = env_is("MSLLM_NO_HUGE_PAGES", "1");
  if (off || bytes < int64_t(kHuge) / 4) return;                     // small weights: not worth a region
  static std::mutex mu;
  static std::unordered_set<uintptr_t> done;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), lo = a & ~(kHuge - 1),
                  hi = (a + static_cast<uintptr_t>(bytes) + kHuge - 1) & ~(kHuge - 1);
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert(a).second) return;                                 // this weight already seen
  for (uintptr_t r = lo; r < hi; r += kHuge) {
    if (!done.insert(r | 1).second) continue;                           // region already advised
    madvise(reinterpret_cast<void *>(r), kHuge, MADV_HUGEPAGE);
    madvise(reinterpret_cast<void *>(r), kHuge, kMadvCollapse);
  }
}

// Weight rows the AVX-512 streaming products (linear.cc's float32 / bfloat16, linear_int8.cc's int8)
// read at once at batch 1 and 2, for weights of elem_bytes bytes: 8 for float32 weights on AMD cores,
// else 2. Measured on AMD EPYC Zen 4 (2 cores): outside any framework 8 float32 rows read 27.5 GB/s
// against 24.5 with 2 (benchmarks/weight_stream_bandwidth.py: more streams in flight per core); in
// SmolLM2's decode step, the two alternated in one process (benchmarks/decode_gemv_rows_ab.py,
// results decode_gemv_rows_ab_*_amd_zen4.json), 8 rows over 2: float32 0.93x the step time, bfloat16
// 1.02x, int8 1.08x (their widening instructions, not the reads, set the pace there). On the Intel Xeon
// (family 6 model 167) 4 rows made the decode step slower (ab_decode_gemv_4rows_intel_xeon.json).
// MSLLM_GEMV_ROWS=2|8 forces one for every weight type (switches.h: the A/B above alternates it).
inline int stream_rows_at_once(int64_t elem_bytes) {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  if (const int forced = switches().gemv_rows) return forced;
  return amd && elem_bytes == 4 ? 8 : 2;
}

// Software prefetch distances of the weight-streaming products (bytes ahead of the read, in the same
// weight array; 0 = none): every loop over a weight row issues, once per 64-byte line it reads, a
// prefetch of the line `near` bytes further on into L1 (prefetcht0) and one of the line `far` bytes
// further on into L2 (prefetcht2) (past a row's end that is the next rows: a product's rows are
// contiguous).
// - near (8 KiB; MSLLM_GEMV_PREFETCH): the hardware prefetcher alone let the reads fall behind wherever
//   the loop does more than a load and an FMA per weight. Outside any framework, SmolLM2's decoder
//   weights on 2 threads (Intel Xeon family 6 model 167; benchmarks/gemv_prefetch.py,
//   results/gemv_prefetch_intel_xeon.json), GB/s without -> with, batch 1: int8 13.4 -> 30.2 (AVX-512)
//   and 11.7 -> 25.0 (AVX2), bfloat16 17.6 -> 25.2 / 15.0 -> 24.6, float32 27.6 -> 29.1 / 24.6 -> 29.5;
//   batch 8: 7.8 -> 11.3 / 5.7 -> 7.4, 9.7 -> 16.5 / 8.2 -> 13.1, 13.6 -> 20.7 / 12.7 -> 17.5; 16 KiB
//   ahead read less than 8 everywhere.
// - far (32 KiB; MSLLM_GEMV_PREFETCH_FAR): a prefetch into L1 holds one of the core's few L1 fill
//   buffers until its line arrives, so the near distance alone cannot keep enough lines in flight
//   while the core also widens int8 weights; a second, further prefetch into L2 starts each line's trip
//   from memory earlier. SmolLM2's decode step, 0 against 32 KiB alternated in one process (Intel Xeon,
//   benchmarks/decode_gemv_rows_ab.py --var MSLLM_GEMV_PREFETCH_FAR, results
//   decode_prefetch_far_ab_*_intel_xeon.json), batch 1: int8 0.90x (AVX-512) / 0.92x (AVX2), bfloat16
//   0.92x / 0.91x, float32 0.99x / 0.99x; batch 8: int8 1.00x, float32 0.96x.
// Both distances are switches (switches.h: their defaults; benchmarks/decode_gemv_rows_ab.py alternates
// them in one process), MSLLM_GEMV_PREFETCH for decode attention's cache reads too (prefetch_block);
// msllm.kernels refuses a value that is not a non-negative integer.
struct StreamPrefetch {   // bytes ahead of the read: into L1 (near) and into L2 (far); 0 = none
  int64_t near = 0, far = 0;
};
inline StreamPrefetch stream_prefetch() {
  const Switches s = switches();
  return {s.prefetch_near, s.prefetch_far};
}

// Prefetches the lines pf.near and pf.far bytes past row + i when offset i (in elements of W) starts a
// 64-byte line of the row. Always inlined: GCC 12 finds a function whose only effect is a prefetch free
// of side effects and drops calls to it.
template <class W>
__attribute__((always_inline)) inline void prefetch_ahead(const W *row, int64_t i, StreamPrefetch pf) {
  if (((i * int64_t(sizeof(W))) & 63) == 0) {
    const char *at = reinterpret_cast<const char *>(row + i);
    if (pf.near) __builtin_prefetch(at + pf.near, 0, 3);
    if (pf.far) __builtin_prefetch(at + pf.far, 0, 1);
  }
}

// Prefetches the lines of the block [p, p + n floats) shifted ``ahead`` bytes on (nothing when ahead is
// 0): batch decode attention (decode.cc) reads the key and value caches slot by slot in memory order,
// as the weight-streaming products read weights, with the same distance (stream_prefetch().near). In
// SmolLM2's decode step at 512 tokens of context, 8 KiB ahead against none, alternated in one process
// (Intel Xeon; a trial switch since removed; benchmarks/results/decode_attention_prefetch_ab_*_intel_xeon.json):
// int8 0.92x the step (AVX-512) and 0.93x (AVX2), float32 0.96x.
__attribute__((always_inline)) inline void prefetch_block(const float *p, int64_t n, int64_t ahead) {
  if (!ahead) return;
  const char *c = reinterpret_cast<const char *>(p) + ahead;
  for (int64_t off = 0; off < n * int64_t(sizeof(float)); off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Output rows per task of a weight-streaming product (y = x W^T, W (out, in), elem_bytes per weight):
// ~64 KiB of W each, at least 4 tasks per thread, a multiple of ``multiple`` (the rows a kernel
// streams at once: 2 or 8), at least ``multiple``.
inline int64_t stream_chunk_rows(int64_t in, int64_t elem_bytes, int64_t out, int64_t multiple = 2) {
  int64_t rows = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(in * elem_bytes, 1));
  rows = std::min<int64_t>(rows, std::max<int64_t>(multiple, out / (4 * Pool::get().size())));
  return (rows + multiple - 1) / multiple * multiple;
}

// How the weight-streaming products split a product's rows between the threads (for_row_chunks): true =
// contiguous shares (the default), false = MSLLM_GEMV_SPLIT=chunks, the chunks handed out one by one from a
// shared counter (before 2026-11-29; kept to measure the two against each other; switches.h).
inline bool stream_split_ranges() { return !switches().split_chunks; }

// One thread's share of a product's chunks, [lo, hi) packed in one word: its owner takes chunks from
// the front, a thread done with its own share takes them from the back (so the owner's stream goes
// on unbroken).
struct alignas(64) ChunkRange {
  std::atomic<uint64_t> lohi;
  void set(uint32_t lo, uint32_t hi) { lohi.store((uint64_t(hi) << 32) | lo, std::memory_order_relaxed); }
  // the next chunk from the front (owner) or the back (thief); -1 when none is left
  int64_t take(bool front) {
    uint64_t v = lohi.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t lo = static_cast<uint32_t>(v), hi = static_cast<uint32_t>(v >> 32);
      if (lo >= hi) return -1;
      const uint64_t next = front ? v + 1 : (uint64_t(hi - 1) << 32) | lo;
      if (lohi.compare_exchange_weak(v, next, std::memory_order_relaxed)) return front ? lo : hi - 1;
    }
  }
};

// Runs fn(o0, o1) over chunks [o0, o1) of the output rows of a weight-streaming product (sizes of
// stream_chunk_rows). Each of the pool's threads owns a contiguous share of the chunks and reads it
// front to back; one that finishes early takes the others' remaining chunks from their backs. A
// thread's reads are thus one long stream, not a chunk every ~64 KiB wherever the shared counter
// points: the hardware prefetcher and the software prefetch 8 KiB ahead (stream_prefetch) stay
// on the lines the thread reads next. Which thread computes an output row changes no bit of it. SmolLM2's
// decode step, the two splits alternated in one process (Intel Xeon; benchmarks/decode_gemv_rows_ab.py
// --var MSLLM_GEMV_SPLIT, results decode_gemv_split_ab_*_intel_xeon.json): batch 1 0.92x (float32),
// 0.90x (bfloat16), 0.95x (int8) on the AVX-512 path, 0.94x / 0.87x / 0.93x on the AVX2 one; batch 8
// 0.94x (float32), 1.00x (int8).
template <class F>
inline void for_row_chunks(int64_t in, int64_t elem_bytes, int64_t out, F &&fn, int64_t multiple = 2) {
  const int64_t rows = stream_chunk_rows(in, elem_bytes, out, multiple);
  const int64_t tasks = (out + rows - 1) / rows;
  auto chunk = [&](int64_t t) {
    const int64_t o0 = t * rows;
    fn(o0, std::min<int64_t>(out, o0 + rows));
  };
  constexpr int kMaxShares = 64;
  const int n = Pool::get().size();
  if (!stream_split_ranges() || n < 2 || n > kMaxShares || tasks < 2 * n) {
    Pool::get().run(static_cast<int>(tasks), [&](int t) { chunk(t); });
    return;
  }
  ChunkRange share[kMaxShares];
  for (int t = 0; t < n; ++t) share[t].set(static_cast<uint32_t>(tasks * t / n), static_cast<uint32_t>(tasks * (t + 1) / n));
  Pool::get().run(n, [&](int t) {
    for (int64_t c; (c = share[t].take(true)) >= 0;) chunk(c);
    for (int k = 1; k < n; ++k)
      for (int64_t c; (c = share[(t + k) % n].take(false)) >= 0;) chunk(c);
  });
}

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

// ---------------------------------------------------------------------------------------------
// GEMM. oneDNN's C API (dnnl.h, "dnnl_sgemm": row-major C = alpha op(A) op(B) + beta C) from
// the libdnnl.so.3 that the mindspore wheel ships (oneDNN 3.10, THREADPOOL runtime: called
// without a threadpool it runs on the calling thread). Declared here so that no oneDNN header
// is needed to build.
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
                          const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                          int64_t ldc);

inline void sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                  const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // C = beta C
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// oneDNN's threadpool interface (oneDNN ``include/oneapi/dnnl/dnnl_threadpool_iface.hpp``): the
// library parallelises a GEMM itself over a user thread pool, sharing its packed operands
// between the threads. The virtual-function layout below is the one of oneDNN 3.10 (the
// version in the mindspore 2.10 wheel, checked at run time by threadpool_gemm_ok()); a later
// oneDNN may add virtual functions, so any other version falls back to slabs (below).
namespace dnnl_abi {
struct threadpool_iface {
  virtual int get_num_threads() const = 0;
  virtual bool get_in_parallel() const = 0;
  virtual void parallel_for(int n, const std::function<void(int, int)> &fn) = 0;
  virtual uint64_t get_flags() const = 0;
  virtual void wait() = 0;
  virtual ~threadpool_iface() = default;
};
struct version_t {
  int major, minor, patch;
  const char *hash;
  unsigned cpu_runtime, gpu_runtime;
};
}  // namespace dnnl_abi

extern "C" int dnnl_threadpool_interop_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
                                             const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                                             float *C, int64_t ldc, void *threadpool);
extern "C" const dnnl_abi::version_t *dnnl_version();

class DnnlThreadpool final : public dnnl_abi::threadpool_iface {
 public:
  int get_num_threads() const override { return Pool::get().size(); }
  bool get_in_parallel() const override { return inside(); }
  void parallel_for(int n, const std::function<void(int, int)> &fn) override {
    Pool::get().run(n, [&](int i) {
      const bool was = inside();
      inside() = true;
      fn(i, n);
      inside() = was;
    });
  }
  uint64_t get_flags() const override { return 0; }  // synchronous
  void wait() override {}
  static bool &inside() {
    static thread_local bool flag = false;
    return flag;
  }
};

// oneDNN 3.10 with the THREADPOOL runtime, and not disabled with MSLLM_GEMM=slabs
inline bool threadpool_gemm_ok() {
  static const bool ok = [] {
    const char *e = std::getenv("MSLLM_GEMM");
    if (e && std::strcmp(e, "slabs") == 0) return false;
    const dnnl_abi::version_t *v = dnnl_version();
    return v && v->major == 3 && v->minor == 10 && v->cpu_runtime == 8;  // 8 = DNNL_RUNTIME_THREADPOOL
  }();
  return ok;
}

// The same GEMM over the pool's threads. Preferred: oneDNN partitions it itself over the pool
// (threadpool interop), sharing packed panels between the threads. Fallback ("slabs"): C is cut
// into equal slabs of rows (or of columns when C is wide and short), two per thread, handed out
// dynamically, each one single-threaded dnnl_sgemm; cutting rows repacks B once per slab and
// cutting columns repacks A, so the cut goes along the larger of M and N. Measured on the
// model's shapes (benchmarks/micro_kernels.py, docs/kernels.md): the interop is as fast or
// faster (up to 1.3x on the down projection's weight gradient, where slabs repack A).
inline void parallel_sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                           int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  Pool &pool = Pool::get();
  const int nt = pool.size();
  if (nt == 1 || M * N * K < (int64_t)1 << 20) {
    sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (threadpool_gemm_ok() && M > 0 && N > 0 && K > 0) {
    static DnnlThreadpool tp;
    if (dnnl_threadpool_interop_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, &tp) == 0) return;
  }
  const bool rows = M >= N;
  const int64_t len = rows ? M : N, align = rows ? 16 : 64;
  int64_t parts = std::min<int64_t>(2 * nt, std::max<int64_t>(1, len / align));
  const int64_t step = ((len + parts - 1) / parts + align - 1) / align * align;
  parts = (len + step - 1) / step;
  pool.run(static_cast<int>(parts), [&](int i) {
    const int64_t b0 = i * step, b1 = std::min(len, b0 + step);
    if (b1 <= b0) return;
    if (rows) {
      const float *a = ta == 'N' ? A + b0 * lda : A + b0;
      sgemm(ta, tb, b1 - b0, N, K, alpha, a, lda, B, ldb, beta, C + b0 * ldc, ldc);
    } else {
      const float *b = tb == 'N' ? B + b0 : B + b0 * ldb;
      sgemm(ta, tb, M, b1 - b0, K, alpha, A, lda, b, ldb, beta, C + b0, ldc);
    }
  });
}

// C (M, N) = op(A) op(B) with both inputs rounded to bfloat16 and float32 sums, row-major, over the
// pool (gemm_bf16.cc: compute_dtype bfloat16); op(A) is (M, K): A stored (M, K) when ta == 'N',
// (K, M) when 'T'; op(B) (K, N) likewise with tb.
void gemm_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
               int64_t ldb, float *C, int64_t ldc);

// y (M, N) = x w^T with x (M, K) float32, rounded to bfloat16, and w (N, K) already bfloat16 (its bits):
// the same arithmetic as gemm_bf16('N', 'T', ...) on w's values, without a rounded copy of w where
// oneDNN takes bfloat16 inputs, up to 8 rows on the weight-streaming product (gemm_bf16.cc: inference
// with param_init_type and compute_dtype bfloat16).
void gemm_bf16_weights(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, float *y);

// Split [0, n) into the pool's threads: fn(begin, end) per chunk (chunks of `grain` multiples).
template <class F>
inline void parallel_rows(int64_t n, int64_t grain, F &&fn) {
  Pool &pool = Pool::get();
  int nt = pool.size();
  int64_t chunks = std::min<int64_t>(nt * 4, (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(int64_t(0), n);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
  pool.run((int)chunks, [&](int i) {
    int64_t b = i * step, e = std::min(n, b + step);
    if (e > b) fn(b, e);
  });
}

// fn(slab, o0, n) for consecutive slabs of the rows of w (out, in) bfloat16: rows o0 .. o0 + n - 1
// widened to float32 (exact) in slab (n, in), at most 2^24 weights (64 MiB) per slab, each widened by
// all threads (scratch slot 3). For the float32 GEMMs over bfloat16 weights (linear.cc bf16_sgemm,
// gemm_bf16.cc gemm_bf16_weights).
template <class F>
inline void for_widened_bf16_slabs(const uint16_t *w, int64_t out, int64_t in, F &&fn) {
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(out, (int64_t(1) << 24) / std::max<int64_t>(in, 1)));
  float *slab = scratch(3, rows * in);
  for (int64_t o0 = 0; o0 < out; o0 += rows) {
    const int64_t n = std::min(rows, out - o0);
    const uint16_t *src = w + o0 * in;
    parallel_rows(n * in, 1 << 14, [&](int64_t i0, int64_t i1) { widen_bf16(src + i0, slab + i0, i1 - i0); });
    fn(static_cast<const float *>(slab), o0, n);
  }
}

// ---------------------------------------------------------------------------------------------
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

// y[j] = exp(alpha * x[j] - shift) for j < n; returns the sum (y may alias x)
inline float exp_shift_sum(const float *x, float *y, int64_t n, float alpha, float shift) {
  int64_t j = 0;
  float s = 0.f;
#if defined(MSLLM_VEC_AVX512)
  __m512 va = _mm512_set1_ps(alpha), vs = _mm512_set1_ps(shift), acc = _mm512_setzero_ps();
  for (; j < n; j += 16) {
    __mmask16 k = tail_mask(n - j);
    __m512 e = exp512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, x + j), va, vs));
    e = _mm512_maskz_mov_ps(k, e);
    _mm512_mask_storeu_ps(y + j, k, e);
    acc = _mm512_add_ps(acc, e);
  }
  s = _mm512_reduce_add_ps(acc);
#else
#if defined(MSLLM_VEC_AVX2)
  __m256 va = _mm256_set1_ps(alpha), vs = _mm256_set1_ps(shift), acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(x + j), va, vs));
    _mm256_storeu_ps(y + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = hsum8(acc);
#endif
  for (; j < n; ++j) {
    y[j] = exp_scalar(alpha * x[j] - shift);
    s += y[j];
  }
#endif
  return s;
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
