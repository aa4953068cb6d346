// Linear layer y = x W^T (torch.nn.Linear's layout, W (out, in)) and its two gradients, on
// oneDNN's sgemm split over the pool (gemm.h). x may have any leading dimensions.
#include "common.h"
#include "parts.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

using namespace msllm;

namespace {

// Up to this many rows of x a float32 product streams W (bfloat16 weights always up to 8): 8, or 4 with
// MSLLM_GEMV_MAX_ROWS=4 (switches.h, for the A/B). SmolLM2's decode step at batch 8 on an Intel Xeon
// (family 6 model 167), 8 against 4, the two alternated in one process (benchmarks/decode_gemv_rows_ab.py
// --batch 8 --var MSLLM_GEMV_MAX_ROWS --values 4 8): 0.92x the step on the AVX-512 path, 0.79x on the AVX2
// path with oneDNN capped at AVX2 (benchmarks/results/decode_gemv_max_rows_ab_float32_b8{,_avx2}_intel_xeon.json).
inline int64_t gemv_max_rows() { return switches().gemv_max_rows; }

#if defined(__AVX512F__)
// Weights as float32 or as bfloat16 (the upper 16 bits of a float32: widening is a shift, exact),
// 16 at a time into float32 lanes; the arithmetic is float32 either way.
inline __m512 load_w(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load_w(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16));
}
inline __m512 load_w(__mmask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_w(__mmask16 m, const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// y (m, out) = x (m, in) w^T for a few rows m: decoding's shape (one token per sequence). A
// GEMM library packs W for reuse across many rows; with a handful of rows the step is the read
// of W itself (memory-bound: every weight is used m times), so each thread streams its share of
// W's rows once, R rows at a time, against all m rows of x held in cache, with m x R AVX-512
// accumulators. Sum order per output: 16 lanes in input order, then the lanes reduced (differs
// from a GEMM's in the last bits; the same for every R, so R changes no bit of y).
template <int M, int R, class W>
inline void gemv_block(const float *x, const W *w, float *y, int64_t in, int64_t out, int64_t o, int64_t vec,
                       __mmask16 tail, StreamPrefetch pf) {
  const W *wr[R];
  __m512 a[R][M];
  for (int j = 0; j < R; ++j) {
    wr[j] = w + (o + j) * in;
    for (int r = 0; r < M; ++r) a[j][r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < vec; i += 16) {
    __m512 v[R];
    for (int j = 0; j < R; ++j) prefetch_ahead(wr[j], i, pf);   // stream.h stream_prefetch
    for (int j = 0; j < R; ++j) v[j] = load_w(wr[j] + i);
    for (int r = 0; r < M; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * in + i);
      for (int j = 0; j < R; ++j) a[j][r] = _mm512_fmadd_ps(xv, v[j], a[j][r]);
    }
  }
  if (tail) {
    __m512 v[R];
    for (int j = 0; j < R; ++j) v[j] = load_w(tail, wr[j] + vec);
    for (int r = 0; r < M; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * in + vec);
      for (int j = 0; j < R; ++j) a[j][r] = _mm512_fmadd_ps(xv, v[j], a[j][r]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < R; ++j) y[r * out + o + j] = _mm512_reduce_add_ps(a[j][r]);
}

template <int M, class W>
void gemv_rows(const float *x, const W *w, float *y, int64_t in, int64_t out, int64_t o0, int64_t o1, int wide,
               StreamPrefetch pf) {
  const int64_t vec = in / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (in - vec)) - 1u);
  int64_t o = o0;
  if constexpr (M <= 2) {   // m x 8 accumulators + 8 weight vectors fit the 32 zmm registers
    if (wide == 8)
      for (; o + 8 <= o1; o += 8) gemv_block<M, 8>(x, w, y, in, out, o, vec, tail, pf);
  }
  for (; o + 2 <= o1; o += 2) gemv_block<M, 2>(x, w, y, in, out, o, vec, tail, pf);
  if (o < o1) gemv_block<M, 1>(x, w, y, in, out, o, vec, tail, pf);   // an odd last row
}

template <int M, class W>
void gemv_parallel(const float *x, const W *w, float *y, int64_t in, int64_t out) {
  // chunks of output rows handed out dynamically: ~64 KiB of W each, at least 4 per thread, a
  // multiple of the rows streamed at once
  const int wide = M <= 2 ? stream_rows_at_once(sizeof(W)) : 2;
  const StreamPrefetch pf = stream_prefetch(wide);
  for_row_chunks(in, sizeof(W), out, [&](int64_t o0, int64_t o1) { gemv_rows<M, W>(x, w, y, in, out, o0, o1, wide, pf); },
                 wide);
}

template <class W>
bool gemv512(const float *x, const W *w, float *y, int64_t m, int64_t in, int64_t out) {
  switch (m) {
    case 1: gemv_parallel<1>(x, w, y, in, out); return true;
    case 2: gemv_parallel<2>(x, w, y, in, out); return true;
    case 3: gemv_parallel<3>(x, w, y, in, out); return true;
    case 4: gemv_parallel<4>(x, w, y, in, out); return true;
    case 5: gemv_parallel<5>(x, w, y, in, out); return true;
    case 6: gemv_parallel<6>(x, w, y, in, out); return true;
    case 7: gemv_parallel<7>(x, w, y, in, out); return true;
    case 8: gemv_parallel<8>(x, w, y, in, out); return true;
    default: return false;
  }
}
#endif

enum class GemvIsa { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

// The streaming path for this CPU: AVX-512 when the build has it and the CPU too, else AVX2 + FMA
// (gemv_avx2.cc, compiled into every build), else none (oneDNN's sgemm serves every row count).
// MSLLM_GEMV_ISA=avx2|none forces one (switches.h: tests switch it); MSLLM_NO_GEMV as none.
GemvIsa gemv_isa() {
  static const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if defined(__AVX512F__)
  static const bool has512 = __builtin_cpu_supports("avx512f");
  const GemvIsa best = has512 ? GemvIsa::kAvx512 : (has2 ? GemvIsa::kAvx2 : GemvIsa::kNone);
#else
  const GemvIsa best = has2 ? GemvIsa::kAvx2 : GemvIsa::kNone;
#endif
  switch (switches().gemv_isa) {
    case IsaChoice::kNone: return GemvIsa::kNone;
    case IsaChoice::kAvx2: return has2 ? GemvIsa::kAvx2 : GemvIsa::kNone;
    default: return best;
  }
}

// y (m, out) = x w^T on the streaming path for 1 <= m <= 8; false: not taken (the caller's sgemm)
template <class W>
bool gemv(const float *x, const W *w, float *y, int64_t m, int64_t in, int64_t out) {
  if (m < 1 || m > 8) return false;
  huge_pages_for(w, in * out * int64_t(sizeof(W)));
  switch (gemv_isa()) {
#if defined(__AVX512F__)
    case GemvIsa::kAvx512: return gemv512(x, w, y, m, in, out);
#endif
    case GemvIsa::kAvx2: gemv_avx2(x, w, sizeof(W) == 2, y, m, in, out); return true;
    default: return false;
  }
}

// y (m, out) = x (m, in) w^T with bfloat16 w, for more rows than the streaming path takes (a
// prefill, scoring): W widened to float32 (exact) in slabs of at most 2^24 weights (64 MiB), each
// slab by all threads, then times x on the pool's parallel sgemm as for float32 weights. One
// widening pass over W per call, small beside the m x out x in product (measured on SmolLM2's
// 512-token prefill: per-slab single-thread sgemm instead cost 15% over float32 weights).
void bf16_sgemm(const float *x, const uint16_t *w, float *y, int64_t m, int64_t in, int64_t out) {
  for_widened_bf16_slabs(w, out, in, [&](const float *slab, int64_t o0, int64_t n) {
    parallel_sgemm('N', 'T', m, n, in, 1.f, x, in, slab, in, 0.f, y + o0, out);  // columns o0.. of y
  });
}

}  // namespace

// y (m, out) = x (m, in) w^T, w float32 or (bf16) bfloat16 (parts.h). Float32 w: up to gemv_max_rows() rows
// of x on the weight-streaming path above (AVX-512, or AVX2 in gemv_avx2.cc: gemv_isa), more on
// oneDNN's sgemm. Bfloat16 w (inference with param_init_type bfloat16: half the bytes per token): up
// to 8 rows streamed, more through bf16_sgemm; float32 arithmetic throughout.
void msllm::linear_forward(const float *x, const void *w, bool bf16, float *y, int64_t m, int64_t in, int64_t out) {
  if (bf16) {
    const uint16_t *wb = static_cast<const uint16_t *>(w);
    if (m >= 1 && m <= 8 && in > 0 && gemv(x, wb, y, m, in, out)) return;
    bf16_sgemm(x, wb, y, m, in, out);
    return;
  }
  const float *wf = static_cast<const float *>(w);
  if (m >= 1 && m <= gemv_max_rows() && in > 0 && gemv(x, wf, y, m, in, out)) return;
  parallel_sgemm('N', 'T', m, out, in, 1.f, x, in, wf, in, 0.f, y, out);
}

namespace {
// The linear operators' shapes from MindSpore's arguments: m rows, in, out; false if they disagree.
// forward: x (..., in), w (out, in); dx: dy (..., out), w (out, in); dw: dy (..., out), x (..., in)
bool forward_dims(const int *ndims, int64_t **shapes, int64_t *m, int64_t *in, int64_t *out) {
  *in = shapes[0][ndims[0] - 1];
  *m = numel(ndims[0], shapes[0]) / std::max<int64_t>(*in, 1);
  *out = shapes[1][0];
  return shapes[1][1] == *in;
}
bool dx_dims(const int *ndims, int64_t **shapes, int64_t *m, int64_t *in, int64_t *out) {
  *out = shapes[0][ndims[0] - 1];
  *m = numel(ndims[0], shapes[0]) / std::max<int64_t>(*out, 1);
  *in = shapes[1][1];
  return shapes[1][0] == *out;
}
bool dw_dims(const int *ndims, int64_t **shapes, int64_t *m, int64_t *in, int64_t *out) {
  *out = shapes[0][ndims[0] - 1];
  *m = numel(ndims[0], shapes[0]) / std::max<int64_t>(*out, 1);
  *in = shapes[1][ndims[1] - 1];
  return numel(ndims[1], shapes[1]) == *m * *in;
}

// C (M, N) = op(A) op(B) on the pool: float32 (oneDNN's sgemm), or ``bf16math`` with inputs rounded
// to bfloat16 and float32 sums (compute_dtype bfloat16: gemm_bf16.cc)
void gemm(bool bf16math, char ta, char tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
          const float *B, int64_t ldb, float *C, int64_t ldc) {
  if (bf16math)
    gemm_bf16(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
  else
    parallel_sgemm(ta, tb, M, N, K, 1.f, A, lda, B, ldb, 0.f, C, ldc);
}

// dy (..., out), w (out, in) -> dx = dy W (..., in)
int linear_dx(bool bf16math, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  int64_t m, in, out;
  if (nparam != 3 || !all_f32(nparam, dtypes)) return 1;
  if (!dx_dims(ndims, shapes, &m, &in, &out)) return 2;
  gemm(bf16math, 'N', 'N', m, in, out, static_cast<const float *>(params[0]), out,
       static_cast<const float *>(params[1]), in, static_cast<float *>(params[2]), in);
  return 0;
}

// dy (..., out), x (..., in) -> dW = dy^T x (out, in), summed over the leading dimensions
int linear_dw(bool bf16math, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  int64_t m, in, out;
  if (nparam != 3 || !all_f32(nparam, dtypes)) return 1;
  if (!dw_dims(ndims, shapes, &m, &in, &out)) return 2;
  gemm(bf16math, 'T', 'N', out, in, m, static_cast<const float *>(params[0]), out,
       static_cast<const float *>(params[1]), in, static_cast<float *>(params[2]), in);
  return 0;
}
}  // namespace

// x (..., in) float32, w (out, in) float32 or bfloat16 -> y (..., out) float32 (linear_forward).
MSLLM_AOT(msllm_linear) {
  const char *f32[] = {dtypes[0], dtypes[2]};
  if (nparam != 3 || !all_f32(2, f32)) return 1;
  const bool bf16 = std::strcmp(dtypes[1], "bfloat16") == 0;
  if (!bf16 && !all_f32(1, dtypes + 1)) return 1;
  int64_t m, in, out;
  if (!forward_dims(ndims, shapes, &m, &in, &out)) return 2;
  linear_forward(static_cast<const float *>(params[0]), params[1], bf16, static_cast<float *>(params[2]), m, in, out);
  return 0;
}

MSLLM_AOT(msllm_linear_dx) { return linear_dx(false, nparam, params, ndims, shapes, dtypes); }
MSLLM_AOT(msllm_linear_dw) { return linear_dw(false, nparam, params, ndims, shapes, dtypes); }

// x (..., in) float32, w (L, out, in) float32 or bfloat16, layer (1,) int32 -> y (..., out) float32 = x w[layer]^T:
// linear_forward on one slice of a weight stacked over the decoder layers, read where it lies (no copy). The
// model's projections run this once their weights are stacked for msllm_decode_stack (inference only, no
// gradient; msllm/models/llama/stacked.py). Returns 1 for other dtypes, 2 for inconsistent shapes or a layer
// out of [0, L).
namespace {
// y (m, out) = x (m, in) w^T with x rounded to bfloat16, sums in float32 (compute_dtype bfloat16): w bfloat16 as
// stored (gemm_bf16_weights: up to 8 rows streamed, more on oneDNN's bf16 matmul) or float32 (gemm_bf16).
// msllm_linear_bf16math's and msllm_linear_layer_bf16math's arithmetic, so the two give the same bits.
void linear_bf16math_forward(const float *x, const void *w, bool bf16, float *y, int64_t m, int64_t in, int64_t out) {
  if (bf16)
    gemm_bf16_weights(m, out, in, x, static_cast<const uint16_t *>(w), y);
  else
    gemm_bf16('N', 'T', m, out, in, x, in, static_cast<const float *>(w), in, y, out);
}

// msllm_linear_layer's product y = x w[layer]^T on the checked slice, in float32 arithmetic (bf16math false:
// linear_forward) or as msllm_linear_bf16math computes it (linear_bf16math_forward).
int linear_layer(bool bf16math, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 4 || !all_f32(1, dtypes) || !all_f32(1, dtypes + 3) || std::strcmp(dtypes[2], "int32") != 0) return 1;
  const bool bf16 = std::strcmp(dtypes[1], "bfloat16") == 0;
  if (!bf16 && !all_f32(1, dtypes + 1)) return 1;
  if (ndims[1] != 3 || numel(ndims[2], shapes[2]) != 1) return 2;
  const int64_t in = shapes[0][ndims[0] - 1], out = shapes[1][1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(in, 1);
  const int32_t layer = *static_cast<const int32_t *>(params[2]);
  if (shapes[1][2] != in || layer < 0 || layer >= shapes[1][0] || numel(ndims[3], shapes[3]) != m * out) return 2;
  const char *w = static_cast<const char *>(params[1]) + layer * out * in * (bf16 ? 2 : 4);
  (bf16math ? linear_bf16math_forward : linear_forward)(static_cast<const float *>(params[0]), w, bf16,
                                                        static_cast<float *>(params[3]), m, in, out);
  return 0;
}
}  // namespace

MSLLM_AOT(msllm_linear_layer) { return linear_layer(false, nparam, params, ndims, shapes, dtypes); }

// compute_dtype bfloat16: the same three operators with bfloat16-input GEMMs, float32 tensors (no
// streaming path for float32 w: every row count takes the GEMM, so the rounding is the same); the
// forward also takes bfloat16 w for inference (param_init_type and compute_dtype bfloat16): the same
// arithmetic on w's values (gemm_bf16_weights: w as stored, x rounded; up to 8 rows streamed)
MSLLM_AOT(msllm_linear_bf16math) {  // x (..., in), w (out, in) -> y = x w^T (..., out)
  int64_t m, in, out;
  if (nparam != 3 || !all_f32(1, dtypes) || !all_f32(1, dtypes + 2)) return 1;
  const bool bf16w = std::strcmp(dtypes[1], "bfloat16") == 0;
  if (!bf16w && !all_f32(1, dtypes + 1)) return 1;
  if (!forward_dims(ndims, shapes, &m, &in, &out)) return 2;
  linear_bf16math_forward(static_cast<const float *>(params[0]), params[1], bf16w, static_cast<float *>(params[2]), m,
                          in, out);
  return 0;
}
// the stacked weights' slice product (msllm_linear_layer) for compute_dtype bfloat16: a prefill through
// stacked layers rounds x as the layers' own msllm_linear_bf16math does (the same bits)
MSLLM_AOT(msllm_linear_layer_bf16math) { return linear_layer(true, nparam, params, ndims, shapes, dtypes); }
MSLLM_AOT(msllm_linear_dx_bf16math) { return linear_dx(true, nparam, params, ndims, shapes, dtypes); }
MSLLM_AOT(msllm_linear_dw_bf16math) { return linear_dw(true, nparam, params, ndims, shapes, dtypes); }

// Shape inference in C++ (MindSpore's aot protocol, tutorial "Custom operators, aot type":
// ``extern "C" std::vector<int64_t> <func>InferShape(int *ndims, int64_t **shapes, AotExtra *)``):
// MindSpore calls it again whenever an input shape is only known at run time (the output head
// over the positions that have a target, msllm's compact loss). The bf16math operators' shapes are
// their float32 twins'.
class AotExtra;
#define MSLLM_INFER(name) \
  extern "C" __attribute__((visibility("default"))) std::vector<int64_t> name##InferShape(int *ndims, int64_t **shapes, AotExtra *)

namespace {
std::vector<int64_t> forward_shape(const int *ndims, int64_t **shapes) {  // (..., in), (out, in) -> (..., out)
  std::vector<int64_t> s(shapes[0], shapes[0] + ndims[0]);
  s.back() = shapes[1][0];
  return s;
}
std::vector<int64_t> dx_shape(const int *ndims, int64_t **shapes) {  // (..., out), (out, in) -> (..., in)
  std::vector<int64_t> s(shapes[0], shapes[0] + ndims[0]);
  s.back() = shapes[1][1];
  return s;
}
std::vector<int64_t> dw_shape(const int *ndims, int64_t **shapes) {  // (..., out), (..., in) -> (out, in)
  return {shapes[0][ndims[0] - 1], shapes[1][ndims[1] - 1]};
}
}  // namespace

MSLLM_INFER(msllm_linear) { return forward_shape(ndims, shapes); }
MSLLM_INFER(msllm_linear_dx) { return dx_shape(ndims, shapes); }
MSLLM_INFER(msllm_linear_dw) { return dw_shape(ndims, shapes); }
MSLLM_INFER(msllm_linear_bf16math) { return forward_shape(ndims, shapes); }
MSLLM_INFER(msllm_linear_dx_bf16math) { return dx_shape(ndims, shapes); }
MSLLM_INFER(msllm_linear_dw_bf16math) { return dw_shape(ndims, shapes); }

// Kernel timing (MSLLM_KERNEL_PROFILE=1): "name calls total_ns" lines into buf; returns the length.
extern "C" __attribute__((visibility("default"))) int msllm_kernel_stats(char *buf, int cap, int reset) {
  int len = 0;
  for (int i = 0; i < msllm::kMaxKernels; ++i) {
    msllm::KernelStats &s = msllm::stats_table()[i];
    if (!s.name) continue;
    // never form a pointer past the buffer: once it is full, only count the length
    char *dst = len < cap ? buf + len : nullptr;
    len += std::snprintf(dst, len < cap ? cap - len : 0, "%s %lld %lld\n", s.name, (long long)s.calls.load(),
                         (long long)s.nanos.load());
    if (reset) {
      s.calls = 0;
      s.nanos = 0;
    }
  }
  return len;
}

// Which streaming path msllm_linear takes now for 1-8 rows: 2 = AVX-512F, 1 = AVX2 + FMA, 0 = none.
extern "C" __attribute__((visibility("default"))) int msllm_gemv_isa() { return static_cast<int>(gemv_isa()); }
// The form of the vector helpers (softmax, norms, SwiGLU, loss, attention's dots) this build was compiled
// with: 2 = AVX-512F, 1 = AVX2 + FMA, 0 = plain C++ (vec.h vector_isa).
extern "C" __attribute__((visibility("default"))) int msllm_vector_isa() { return vector_isa(); }
// The weight rows the streaming path in use reads at once at batch 1 for float32 weights
// (stream_rows_at_once: the AVX-512 path also at batch 2; 2 without a streaming path).
extern "C" __attribute__((visibility("default"))) int msllm_gemv_rows() {
  return gemv_isa() == GemvIsa::kNone ? 2 : stream_rows_at_once(4);
}

// Which parallel GEMM the kernels run (Python: msllm.kernels.gemm_path): 1 = oneDNN's threadpool
// interop (oneDNN 3.10, the layout gemm.h copies), 0 = the "slabs" fallback (any other oneDNN
// version, or MSLLM_GEMM=slabs). The version found is written to major/minor/patch.
extern "C" __attribute__((visibility("default"))) int msllm_gemm_interop(int *major, int *minor, int *patch) {
  const dnnl_abi::version_t *v = dnnl_version();
  *major = v ? v->major : -1;
  *minor = v ? v->minor : -1;
  *patch = v ? v->patch : -1;
  return msllm::threadpool_gemm_ok() ? 1 : 0;
}
