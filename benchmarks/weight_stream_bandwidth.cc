// How fast can 2 threads stream SmolLM2-135M's float32 weights through batch-1 matrix-vector
// products, outside any framework? (issue #32: msllm's decode kernels read ~15 GB/s where a
// 1 GiB torch.mv reads ~30.) Built and run by benchmarks/weight_stream_bandwidth.py.
//
// The weight set: 30 layers of q (576x576), k, v (192x576), o (576x576), gate, up (1536x576),
// down (576x1536), then the tied head (49152x576): 538 MB, each matrix its own allocation (or
// carved from one arena on 2 MiB pages), read in model order once per pass, y = W x with one x.
// Two threads per product, then a barrier before the next product (a framework's operator
// boundary): a futex barrier (std::barrier: a thread that arrives first sleeps) or a spinning one.
// Split of a product's output rows: "dynamic" = chunks of ~64 KiB of W handed out by an atomic
// counter (msllm's for_row_chunks), "halves" = each thread one contiguous half. Rows per inner
// loop: 2 (msllm's gemv_rows) or 8. "read" = a plain sum of the thread's half (no x).
//
//   weight_stream_bandwidth SPLIT ROWS BARRIER PAGES PASSES
//     SPLIT dynamic|halves|read, ROWS 2|8, BARRIER futex|spin, PAGES small|huge
// Prints one line per pass: "pass <i> ms <t> gbs <GB/s>".
// Vectors of 16 floats on an AVX-512 machine, of 8 (AVX2 + FMA) on one without (AMD Zen 3): -march=native.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {
#if defined(__AVX512F__)
using V = __m512;
constexpr int kLanes = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float *p) { return _mm512_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
#else
using V = __m256;
constexpr int kLanes = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float *p) { return _mm256_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

struct Mat {
  float *w;
  long out, in;
};

template <int R>
void rows(const float *x, const float *w, float *y, long in, long o0, long o1) {
  long o = o0;
  for (; o + R <= o1; o += R) {
    V a[R];
    for (int r = 0; r < R; ++r) a[r] = vzero();
    for (long i = 0; i < in; i += kLanes) {
      const V xv = vload(x + i);
      for (int r = 0; r < R; ++r) a[r] = vfma(xv, vload(w + (o + r) * in + i), a[r]);
    }
    for (int r = 0; r < R; ++r) y[o + r] = vsum(a[r]);
  }
  for (; o < o1; ++o) {
    V a = vzero();
    for (long i = 0; i < in; i += kLanes) a = vfma(vload(x + i), vload(w + o * in + i), a);
    y[o] = vsum(a);
  }
}

float read_sum(const float *p, long n) {
  V a = vzero(), b = a, c = a, d = a;
  long i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    a = vadd(a, vload(p + i));
    b = vadd(b, vload(p + i + kLanes));
    c = vadd(c, vload(p + i + 2 * kLanes));
    d = vadd(d, vload(p + i + 3 * kLanes));
  }
  float s = vsum(vadd(vadd(a, b), vadd(c, d)));
  for (; i < n; ++i) s += p[i];
  return s;
}

struct SpinBarrier {
  std::atomic<long> n{0};
  void arrive_and_wait() {
    const long gen = n.fetch_add(1) / 2;
    while (n.load(std::memory_order_acquire) / 2 == gen) _mm_pause();
  }
};
}  // namespace

int main(int argc, char **argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s dynamic|halves|read 2|8 futex|spin small|huge PASSES\n", argv[0]);
    return 2;
  }
  const std::string split = argv[1], barrier_kind = argv[3], pages = argv[4];
  const int nrows = std::atoi(argv[2]), passes = std::atoi(argv[5]);
  std::vector<Mat> mats;
  char *arena = nullptr;
  long used = 0;
  const long arena_bytes = 600L << 20;
  if (pages == "huge") {
    arena = static_cast<char *>(std::aligned_alloc(1L << 21, arena_bytes));
    madvise(arena, arena_bytes, MADV_HUGEPAGE);
  }
  auto add = [&](long out, long in) {
    const long bytes = (out * in * 4 + 63) / 64 * 64;
    float *w = arena ? reinterpret_cast<float *>(arena + used) : static_cast<float *>(std::aligned_alloc(64, bytes));
    used += arena ? bytes : 0;
    for (long j = 0; j < out * in; ++j) w[j] = static_cast<float>(j % 7) * 0.01f;
    mats.push_back({w, out, in});
  };
  for (int l = 0; l < 30; ++l) {
    add(576, 576), add(192, 576), add(192, 576), add(576, 576), add(1536, 576), add(1536, 576), add(576, 1536);
  }
  add(49152, 576);
  long total = 0;
  for (auto &m : mats) total += m.out * m.in * 4;
  std::vector<float> x(1536), y(49152);
  for (int i = 0; i < 1536; ++i) x[i] = 0.001f * static_cast<float>(i);
  std::atomic<long> next{0};
  std::barrier<> futex_barrier(2);
  SpinBarrier spin_barrier;
  auto sync = [&] {
    if (barrier_kind == "spin") spin_barrier.arrive_and_wait();
    else futex_barrier.arrive_and_wait();
  };
  auto product = [&](const Mat &m, int tid) {
    if (split == "dynamic") {
      const long chunk = std::max(16L, 65536 / 4 / m.in) / 2 * 2;
      for (;;) {
        const long o0 = next.fetch_add(chunk);
        if (o0 >= m.out) break;
        const long o1 = std::min(m.out, o0 + chunk);
        nrows == 8 ? rows<8>(x.data(), m.w, y.data(), m.in, o0, o1) : rows<2>(x.data(), m.w, y.data(), m.in, o0, o1);
      }
      return;
    }
    const long half = m.out / 2 / 8 * 8, o0 = tid ? half : 0, o1 = tid ? m.out : half;
    if (split == "read") y[tid] += read_sum(m.w + o0 * m.in, (o1 - o0) * m.in);
    else if (nrows == 8) rows<8>(x.data(), m.w, y.data(), m.in, o0, o1);
    else rows<2>(x.data(), m.w, y.data(), m.in, o0, o1);
  };
  auto worker = [&](int tid) {
    for (int pass = 0; pass < passes; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (auto &m : mats) {
        if (split == "dynamic") {
          if (tid == 0) next.store(0);
          sync();
        }
        product(m, tid);
        sync();
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (tid == 0) std::printf("pass %d ms %.3f gbs %.2f\n", pass, s * 1e3, static_cast<double>(total) / s / 1e9);
    }
  };
  std::thread other(worker, 1);
  worker(0);
  other.join();
  return 0;
}
