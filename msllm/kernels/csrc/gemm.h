// Matrix products over the pool: oneDNN's float32 GEMM (sgemm, parallel_sgemm), the bfloat16 GEMMs'
// declarations (gemm_bf16.cc) and bfloat16 weights widened slab by slab for a float32 GEMM.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "pool.h"
#include "scratch.h"
#include "vec.h"

namespace msllm {

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

}  // namespace msllm
