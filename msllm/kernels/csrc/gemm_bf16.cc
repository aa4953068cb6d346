// GEMMs with bfloat16 inputs and float32 accumulation: what ``compute_dtype: bfloat16`` means for
// training on the CPU fast path (msllm/kernels/select.py). The linear layer and its two gradients
// take float32 tensors; each GEMM rounds its two inputs to bfloat16 (round to nearest even), forms
// the products exactly (a product of two bfloat16 values has at most 16 significant bits, so it is
// exact in float32) and sums them in float32; the output is float32. Everything between the GEMMs
// (norms, attention, softmax, loss, the activations themselves) stays float32.
//
// Where the CPU has bfloat16 arithmetic (AMX-BF16, AVX512_BF16, AVX2-VNNI-2) this is oneDNN's
// matmul primitive with ``fpmath_mode`` bf16 (oneDNN "Primitive attributes: floating-point math
// mode": f32 inputs may be down-converted to bf16 internally), or, where oneDNN implements that mode
// with a float32 kernel only (AVX512_BF16 without AMX, e.g. AMD Zen 4), its matmul on bfloat16
// copies of the inputs; from the libdnnl.so.3 of the mindspore wheel, run on msllm's pool through
// the threadpool interop stream. Elsewhere (or when
// oneDNN picks a float32 kernel for a shape) the same arithmetic is emulated: both inputs rounded
// to bfloat16 values held in float32, then the float32 sgemm of gemm.h. The two paths differ only
// in summation order (MSLLM_GEMM_BF16=emulate forces the emulation). The linear operators over it
// are linear.cc's (msllm_linear_bf16math and its gradients). On SmolLM2's training shapes with AMX:
// 2.46x less GEMM time per step than float32 (benchmarks/gemm_bf16_speed.py, BENCHMARKS.md).
#include "common.h"
#include "parts.h"

#include <map>
#include <tuple>
#include <type_traits>

using namespace msllm;

namespace {

// ---- the part of oneDNN's C API used here (oneDNN 3.10 ``include/oneapi/dnnl/dnnl.h``,
// ``dnnl_types.h``, ``dnnl_threadpool.h``), declared so that no oneDNN header is needed; the
// enumerators' values are those of 3.10, and threadpool_gemm_ok() (gemm.h) checks the version.
struct dnnl_engine;
struct dnnl_stream;
struct dnnl_memory_desc;
struct dnnl_memory;
struct dnnl_primitive_desc;
struct dnnl_primitive;
struct dnnl_primitive_attr;
struct dnnl_exec_arg_t {
  int arg;
  dnnl_memory *memory;
};
constexpr int kDnnlBf16 = 2, kDnnlF32 = 3, kDnnlCpu = 1, kFpmathBf16 = 1, kQueryImplInfoStr = 8;
constexpr int kArgSrc = 1, kArgWeights = 33, kArgDst = 17;
using dims_t = int64_t[12];

extern "C" {
int dnnl_engine_create(dnnl_engine **engine, int kind, size_t index);
int dnnl_threadpool_interop_stream_create(dnnl_stream **stream, dnnl_engine *engine, void *threadpool);
int dnnl_stream_wait(dnnl_stream *stream);
int dnnl_memory_desc_create_with_strides(dnnl_memory_desc **md, int ndims, const dims_t dims, int data_type,
                                         const dims_t strides);
int dnnl_memory_desc_destroy(dnnl_memory_desc *md);
int dnnl_primitive_attr_create(dnnl_primitive_attr **attr);
int dnnl_primitive_attr_destroy(dnnl_primitive_attr *attr);
int dnnl_primitive_attr_set_fpmath_mode(dnnl_primitive_attr *attr, int mode);
int dnnl_matmul_primitive_desc_create(dnnl_primitive_desc **pd, dnnl_engine *engine, const dnnl_memory_desc *src,
                                      const dnnl_memory_desc *weights, const dnnl_memory_desc *bias,
                                      const dnnl_memory_desc *dst, const dnnl_primitive_attr *attr);
int dnnl_primitive_desc_query(const dnnl_primitive_desc *pd, int what, int index, void *result);
int dnnl_primitive_desc_destroy(dnnl_primitive_desc *pd);
int dnnl_primitive_create(dnnl_primitive **primitive, const dnnl_primitive_desc *pd);
int dnnl_primitive_destroy(dnnl_primitive *primitive);
int dnnl_memory_create(dnnl_memory **memory, const dnnl_memory_desc *md, dnnl_engine *engine, void *handle);
int dnnl_memory_destroy(dnnl_memory *memory);
int dnnl_memory_set_data_handle(dnnl_memory *memory, void *handle);
int dnnl_primitive_execute(const dnnl_primitive *primitive, dnnl_stream *stream, int nargs,
                           const dnnl_exec_arg_t *args);
}

// One matmul primitive per GEMM shape (with its memory objects, whose buffers are set per call).
struct Matmul {
  dnnl_primitive *prim = nullptr;
  dnnl_memory *a = nullptr, *b = nullptr, *c = nullptr;
  bool bf16 = false;          // oneDNN chose a kernel with bfloat16 arithmetic for it
  bool bf16_inputs = false;   // ... on bfloat16 copies of A and B (contiguous), not on A and B themselves
};

using Key = std::tuple<char, char, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

struct Dnnl {
  dnnl_engine *engine = nullptr;
  dnnl_stream *stream = nullptr;
  msllm::DnnlThreadpool pool;
  std::map<Key, Matmul> cache;   // a few dozen shapes per model; cleared beyond kMaxShapes
  std::mutex mu;
  bool ok = false;
  static constexpr size_t kMaxShapes = 512;

  Dnnl() {
    ok = msllm::threadpool_gemm_ok() && dnnl_engine_create(&engine, kDnnlCpu, 0) == 0 &&
         dnnl_threadpool_interop_stream_create(&stream, engine, &pool) == 0;
  }
  static Dnnl &get() {
    static Dnnl d;
    return d;
  }
  void clear() {
    for (auto &kv : cache) destroy(kv.second);
    cache.clear();
  }
  // m's primitive for C (M, N) = op(A) op(B) with A, B of data type ab at strides as / bs (op(A) (M, K),
  // op(B) (K, N)), C float32 at cs; fpmath: allow oneDNN to down-convert float32 inputs to bfloat16.
  // False when oneDNN cannot make it; m.bf16 says whether its kernel has bfloat16 arithmetic.
  bool make(Matmul &m, int64_t M, int64_t N, int64_t K, int ab, const dims_t as, const dims_t bs, const dims_t cs,
            bool fpmath) {
    const dims_t ad = {M, K}, bd = {K, N}, cd = {M, N};
    dnnl_memory_desc *amd = nullptr, *bmd = nullptr, *cmd = nullptr;
    dnnl_primitive_attr *attr = nullptr;
    dnnl_primitive_desc *pd = nullptr;
    bool good = dnnl_memory_desc_create_with_strides(&amd, 2, ad, ab, as) == 0 &&
                dnnl_memory_desc_create_with_strides(&bmd, 2, bd, ab, bs) == 0 &&
                dnnl_memory_desc_create_with_strides(&cmd, 2, cd, kDnnlF32, cs) == 0 &&
                dnnl_primitive_attr_create(&attr) == 0 &&
                (!fpmath || dnnl_primitive_attr_set_fpmath_mode(attr, kFpmathBf16) == 0) &&
                dnnl_matmul_primitive_desc_create(&pd, engine, amd, bmd, nullptr, cmd, attr) == 0;
    if (good) {
      const char *impl = nullptr;
      if (dnnl_primitive_desc_query(pd, kQueryImplInfoStr, 0, &impl) == 0 && impl)
        m.bf16 = std::strstr(impl, "amx") || std::strstr(impl, "bf16") || std::strstr(impl, "vnni_2");
      good = dnnl_primitive_create(&m.prim, pd) == 0 && dnnl_memory_create(&m.a, amd, engine, nullptr) == 0 &&
             dnnl_memory_create(&m.b, bmd, engine, nullptr) == 0 && dnnl_memory_create(&m.c, cmd, engine, nullptr) == 0;
    }
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (attr) dnnl_primitive_attr_destroy(attr);
    for (dnnl_memory_desc *md : {amd, bmd, cmd})
      if (md) dnnl_memory_desc_destroy(md);
    return good;
  }
  static void destroy(Matmul &m) {
    if (m.a) dnnl_memory_destroy(m.a);
    if (m.b) dnnl_memory_destroy(m.b);
    if (m.c) dnnl_memory_destroy(m.c);
    if (m.prim) dnnl_primitive_destroy(m.prim);
    m = Matmul();
  }
  // the primitive for C (M, N) = op(A) op(B), row-major with leading dimensions lda / ldb / ldc;
  // nullptr when oneDNN cannot make one. First float32 inputs with fpmath_mode bf16 (AMX: oneDNN
  // converts tiles as it goes); where oneDNN's kernel for that is a float32 one (oneDNN 3.10 on
  // AVX512_BF16 without AMX, e.g. AMD Zen 4), bfloat16 inputs instead: gemm_bf16 then hands it
  // contiguous bfloat16 copies (the same rounding), on which oneDNN has AVX512_BF16 kernels.
  Matmul *matmul(char ta, char tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
    const Key key{ta, tb, M, N, K, lda, ldb, ldc};
    auto it = cache.find(key);
    if (it != cache.end()) return &it->second;
    if (cache.size() >= kMaxShapes) clear();
    // op(A) (M, K): stored (M, K) with strides (lda, 1), or stored (K, M) read transposed: (1, lda)
    const dims_t as = {ta == 'N' ? lda : 1, ta == 'N' ? 1 : lda};
    const dims_t bs = {tb == 'N' ? ldb : 1, tb == 'N' ? 1 : ldb};
    const dims_t cs = {ldc, 1};
    Matmul m;
    bool good = make(m, M, N, K, kDnnlF32, as, bs, cs, true);
    if (good && !m.bf16) {   // the copies: A (M, K) or (K, M) and B (K, N) or (N, K), contiguous
      Matmul c;
      const dims_t cas = {ta == 'N' ? K : 1, ta == 'N' ? 1 : M};
      const dims_t cbs = {tb == 'N' ? N : 1, tb == 'N' ? 1 : K};
      if (make(c, M, N, K, kDnnlBf16, cas, cbs, cs, false) && c.bf16) {
        destroy(m);
        m = c;
        m.bf16_inputs = true;
      } else {
        destroy(c);
      }
    }
    if (!good) {
      destroy(m);
      return nullptr;
    }
    return &cache.emplace(key, m).first->second;
  }
};

// float32 -> the nearest bfloat16 value (ties to even), held in a float32 (low 16 bits zero): the
// rounding of vcvtneps2bf16; NaN stays NaN.
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    u |= 0x00400000u;
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
  }
  u &= 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// dst (rows, cols) contiguous = src (rows, cols with leading dimension ld) rounded to bfloat16 (round_bf16):
// as float32 values (T = float: the emulation's inputs) or as their bfloat16 bits (T = uint16_t: oneDNN's)
template <class T>
void rounded_copy(const float *src, int64_t ld, int64_t rows, int64_t cols, T *dst) {
  msllm::parallel_rows(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        const float x = round_bf16(src[r * ld + j]);
        if constexpr (std::is_same_v<T, float>) {
          dst[r * cols + j] = x;
        } else {
          uint32_t u;
          std::memcpy(&u, &x, 4);
          dst[r * cols + j] = static_cast<uint16_t>(u >> 16);
        }
      }
  });
}

}  // namespace

namespace msllm {

void gemm_bf16(char ta, char tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
               int64_t ldb, float *C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.f);
    return;
  }
  Dnnl &d = Dnnl::get();
  // A and B as stored: (ar, ac) and (br, bc) with leading dimensions lda / ldb
  const int64_t ar = ta == 'N' ? M : K, ac = ta == 'N' ? K : M;
  const int64_t br = tb == 'N' ? K : N, bc = tb == 'N' ? N : K;
  if (d.ok && !switches().gemm_bf16_emulate) {   // MSLLM_GEMM_BF16=emulate: the tests' switch (switches.h)
    std::lock_guard<std::mutex> lock(d.mu);   // one MindSpore actor thread calls kernels, but be safe
    Matmul *m = d.matmul(ta, tb, M, N, K, lda, ldb, ldc);
    if (m && m->bf16) {
      if (m->bf16_inputs) {   // contiguous bfloat16 copies of A and B (scratch slots 0 and 1)
        uint16_t *a = reinterpret_cast<uint16_t *>(scratch(0, (ar * ac + 1) / 2));
        uint16_t *b = reinterpret_cast<uint16_t *>(scratch(1, (br * bc + 1) / 2));
        rounded_copy(A, lda, ar, ac, a);
        rounded_copy(B, ldb, br, bc, b);
        dnnl_memory_set_data_handle(m->a, a);
        dnnl_memory_set_data_handle(m->b, b);
      } else {
        dnnl_memory_set_data_handle(m->a, const_cast<float *>(A));
        dnnl_memory_set_data_handle(m->b, const_cast<float *>(B));
      }
      dnnl_memory_set_data_handle(m->c, C);
      const dnnl_exec_arg_t args[3] = {{kArgSrc, m->a}, {kArgWeights, m->b}, {kArgDst, m->c}};
      if (dnnl_primitive_execute(m->prim, d.stream, 3, args) == 0 && dnnl_stream_wait(d.stream) == 0) return;
    }
  }
  // emulation: the inputs rounded to bfloat16 values (float32 storage), then the float32 GEMM
  float *a = scratch(0, ar * ac), *b = scratch(1, br * bc);
  rounded_copy(A, lda, ar, ac, a);
  rounded_copy(B, ldb, br, bc, b);
  parallel_sgemm(ta, tb, M, N, K, 1.f, a, ac, b, bc, 0.f, C, ldc);
}

void gemm_bf16_weights(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, float *y) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    std::fill(y, y + M * N, 0.f);
    return;
  }
  if (M <= 8) {
    // a few rows (the prompt's last-token head; decoding outside the fused step, e.g. with LoRA): x
    // rounded, then linear.cc's weight-streaming product on w's bits (a product of two bfloat16
    // values is exact in float32, so the same arithmetic up to summation order)
    float *xr = scratch(0, M * K);
    rounded_copy(x, K, M, K, xr);
    linear_forward(xr, w, true, y, M, K, N);
    return;
  }
  Dnnl &d = Dnnl::get();
  if (d.ok && !switches().gemm_bf16_emulate) {
    std::lock_guard<std::mutex> lock(d.mu);
    Matmul *m = d.matmul('N', 'T', M, N, K, K, K, N);
    if (m && m->bf16 && m->bf16_inputs) {   // x rounded into a bfloat16 copy; w as it is
      uint16_t *a = reinterpret_cast<uint16_t *>(scratch(0, (M * K + 1) / 2));
      rounded_copy(x, K, M, K, a);
      dnnl_memory_set_data_handle(m->a, a);
      dnnl_memory_set_data_handle(m->b, const_cast<uint16_t *>(w));
      dnnl_memory_set_data_handle(m->c, y);
      const dnnl_exec_arg_t args[3] = {{kArgSrc, m->a}, {kArgWeights, m->b}, {kArgDst, m->c}};
      if (dnnl_primitive_execute(m->prim, d.stream, 3, args) == 0 && dnnl_stream_wait(d.stream) == 0) return;
    }
  }
  // oneDNN's float32-input kernels (AMX: fpmath mode bf16) and the emulation take float32 inputs:
  // w widened (exact) slab by slab, then gemm_bf16 on each (which rounds x and leaves w's values as
  // they are) into columns o0.. of y
  for_widened_bf16_slabs(w, N, K, [&](const float *slab, int64_t o0, int64_t n) {
    gemm_bf16('N', 'T', M, n, K, x, K, slab, K, y + o0, N);
  });
}

}  // namespace msllm

// 1 when oneDNN runs a bfloat16-input GEMM of a training shape (512 x 512 x 512) with bfloat16
// arithmetic on this CPU, 0 when msllm emulates it (the same results up to summation order,
// slower than float32): for the start-up log line of compute_dtype bfloat16.
extern "C" __attribute__((visibility("default"))) int msllm_gemm_bf16_native() {
  Dnnl &d = Dnnl::get();
  if (!d.ok) return 0;
  std::lock_guard<std::mutex> lock(d.mu);
  Matmul *m = d.matmul('N', 'T', 512, 512, 512, 512, 512, 512);
  return m && m->bf16 ? 1 : 0;
}
