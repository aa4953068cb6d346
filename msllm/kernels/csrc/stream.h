// How the weight-streaming products (linear.cc, linear_int8.cc, gemv_avx2.cc, gemm_bf16.cc) and decode
// attention read from memory: weights on 2 MiB pages, rows read at once, software prefetch distances,
// and each thread's contiguous share of a product's rows (for_row_chunks).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_set>

#include "pool.h"
#include "switches.h"

namespace msllm {

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

// Weight rows the streaming products (linear.cc's float32 / bfloat16 on AVX-512 at batch 1 and 2,
// gemv_avx2.cc's at batch 1, linear_int8.cc's int8 on AVX-512) read at once, for weights of elem_bytes
// bytes: 8 for float32 weights on AMD cores, else 2. On AMD EPYC Zen 3 (AVX2 only) 8 rows made the float32
// batch-1 step 0.92x (gemv_avx2.cc says where measured). Measured on AMD EPYC Zen 4 (2 cores): outside
// any framework 8 float32 rows read 27.5 GB/s against 24.5 with 2 (benchmarks/weight_stream_bandwidth.py: more streams in flight per core); in
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
// - none at all for a loop that streams 8 rows at once (float32 weights on AMD cores, stream_rows_at_once):
//   its 8 streams x 8 KiB ahead put 64 KiB of lines in flight into an L1 of 32 KiB (Zen 3 / Zen 4) or 48 KiB
//   (Zen 5), which evicts lines before they are read, and a loop of only a load and an FMA per weight keeps
//   the hardware prefetcher ahead on its own (float32's small gains on the Intel Xeon above). SmolLM2's
//   float32 batch-1 step on an AMD EPYC Zen 5 (family 26 model 2, 2 cores), alternated in one process
//   (benchmarks/decode_gemv_rows_ab.py --var MSLLM_GEMV_PREFETCH,MSLLM_GEMV_PREFETCH_FAR --values 8192,32768 ,):
//   0.85x the step (every one of 8 rounds below 1, 0.79-0.96) on the AVX-512 path, 0.96x on the AVX2 path
//   (decode_prefetch_rows8_ab_float32{,_avx2path}_amd_zen5.json); bfloat16 and int8 stream 2 rows and keep
//   both prefetches (8 rows without them: 1.03x / 1.26x their steps, decode_rows8_nopf_ab_*_amd_zen5.json).
// Both distances are switches (switches.h; benchmarks/decode_gemv_rows_ab.py alternates them in one
// process): set, they apply to every loop whatever its rows; MSLLM_GEMV_PREFETCH for decode attention's
// cache reads too (prefetch_block); msllm.kernels refuses a value that is not a non-negative integer.
struct StreamPrefetch {   // bytes ahead of the read: into L1 (near) and into L2 (far); 0 = none
  int64_t near = 0, far = 0;
};
// The distances for a loop streaming `rows` weight rows at once (the defaults above unless set).
inline StreamPrefetch stream_prefetch(int rows) {
  const Switches s = switches();
  const bool wide = rows >= 8;
  return {s.prefetch_near >= 0 ? s.prefetch_near : (wide ? 0 : 8192),
          s.prefetch_far >= 0 ? s.prefetch_far : (wide ? 0 : 32768)};
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
// as the weight-streaming products read weights, with the same distance (stream_prefetch(2).near). In
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

}  // namespace msllm
