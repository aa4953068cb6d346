// The clock the cores run vector FMAs at, measured: a register-only loop of independent FMA chains
// on every thread (no loads, no stores), so its rate divided by the FLOPs one core can issue per
// cycle is the clock. msllm's CPU peak (msllm/training/throughput.py) uses it when it is above the
// clock the CPU describes (a KVM guest's /proc/cpuinfo gives the TSC rate, below the turbo clock),
// so that MFU cannot exceed 100%. Built alone (not part of libmsllm_kernels.so) and measured once by
// msllm/kernels/clock_probe.py, which ``python -m msllm.kernels.build`` runs first.
//
// Each thread's loop is timed by the CPU time that thread ran (CLOCK_THREAD_CPUTIME_ID), not by the wall
// clock: `make install` may run while other work shares the cores (a compile, a test run), and a thread
// descheduled half the time would halve the clock measured. On the AMD EPYC Zen 3 (2 cores), with a
// 2-thread llama.cpp compile running beside it, the wall-clock probe read 80.2 GFLOP/s against 196.2 idle,
// which would have made every MFU figure 2.4x too high.
#include <ctime>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// seconds of CPU time the calling thread has run
double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// 12 independent accumulators: enough to cover a 4-cycle FMA latency on two pipes.
constexpr int kChains = 12;

double fma_loop_seconds(long iters) {
#if defined(__AVX512F__)
  using V = __m512;
  auto set = [](float x) { return _mm512_set1_ps(x); };
  auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  auto sum = [](V a) { return _mm512_reduce_add_ps(a); };
#elif defined(__AVX2__) && defined(__FMA__)
  using V = __m256;
  auto set = [](float x) { return _mm256_set1_ps(x); };
  auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  auto sum = [](V a) {
    alignas(32) float t[8];
    _mm256_store_ps(t, a);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
  };
#else
  using V = float;
  auto set = [](float x) { return x; };
  auto fma = [](V a, V b, V c) { return a * b + c; };
  auto sum = [](V a) { return a; };
#endif
  V acc[kChains];
  for (int i = 0; i < kChains; i++) acc[i] = set(1.0f + i * 1e-7f);
  const V b = set(0.999999f), c = set(1e-7f);
  const double t0 = thread_cpu_seconds();
  for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
    for (int j = 0; j < kChains; j++) acc[j] = fma(acc[j], b, c);
  }
  const double dt = thread_cpu_seconds() - t0;
  volatile float keep = 0;
  for (int j = 0; j < kChains; j++) keep = keep + sum(acc[j]);
  return dt;
}

}  // namespace

// fp32 lanes per FMA instruction of the loop above (16 AVX-512, 8 AVX2, 1 scalar).
extern "C" __attribute__((visibility("default"))) int msllm_fma_lanes() {
#if defined(__AVX512F__)
  return 16;
#elif defined(__AVX2__) && defined(__FMA__)
  return 8;
#else
  return 1;
#endif
}

// GFLOP/s of ``threads`` threads each running the loop at once for about ``seconds`` of CPU time (the
// slowest thread's CPU time counts): threads x iterations x chains x lanes x 2 FLOPs / seconds.
extern "C" __attribute__((visibility("default"))) double msllm_fma_gflops(int threads, double seconds) {
  const long probe = 1 << 20;
  double per_iter = fma_loop_seconds(probe) / probe;
  long iters = per_iter > 0 ? static_cast<long>(seconds / per_iter) : probe;
  if (iters < probe) iters = probe;
  std::vector<double> dts(threads);
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; k++) pool.emplace_back([&, k] { dts[k] = fma_loop_seconds(iters); });
  for (auto &t : pool) t.join();
  double worst = 0;
  for (double d : dts) worst = d > worst ? d : worst;
  return threads * double(iters) * kChains * msllm_fma_lanes() * 2.0 / worst / 1e9;
}
