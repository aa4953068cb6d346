// Linear layer y = x W^T (torch.nn.Linear's layout, W (out, in)) and its two gradients, on
// oneDNN's sgemm split over the pool (common.h). x may have any leading dimensions.
#include "common.h"

using namespace msllm;

// x (..., in), w (out, in) -> y (..., out)
MSLLM_AOT(msllm_linear) {
  if (nparam != 3 || !all_f32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  int64_t in = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(in, 1);
  int64_t out = shapes[1][0];
  if (shapes[1][1] != in) return 2;
  parallel_sgemm('N', 'T', m, out, in, 1.f, x, in, w, in, 0.f, y, out);
  return 0;
}

// dy (..., out), w (out, in) -> dx = dy W (..., in)
MSLLM_AOT(msllm_linear_dx) {
  if (nparam != 3 || !all_f32(nparam, dtypes)) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  float *dx = static_cast<float *>(params[2]);
  int64_t out = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(out, 1);
  int64_t in = shapes[1][1];
  if (shapes[1][0] != out) return 2;
  parallel_sgemm('N', 'N', m, in, out, 1.f, dy, out, w, in, 0.f, dx, in);
  return 0;
}

// dy (..., out), x (..., in) -> dW = dy^T x (out, in), summed over the leading dimensions
MSLLM_AOT(msllm_linear_dw) {
  if (nparam != 3 || !all_f32(nparam, dtypes)) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *x = static_cast<const float *>(params[1]);
  float *dw = static_cast<float *>(params[2]);
  int64_t out = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(out, 1);
  int64_t in = shapes[1][ndims[1] - 1];
  if (numel(ndims[1], shapes[1]) != m * in) return 2;
  parallel_sgemm('T', 'N', out, in, m, 1.f, dy, out, x, in, 0.f, dw, in);
  return 0;
}

// Shape inference in C++ (MindSpore's aot protocol, tutorial "Custom operators, aot type":
// ``extern "C" std::vector<int64_t> <func>InferShape(int *ndims, int64_t **shapes, AotExtra *)``):
// MindSpore calls it again whenever an input shape is only known at run time (the output head
// over the positions that have a target, msllm's compact loss).
class AotExtra;
#define MSLLM_INFER(name) \
  extern "C" __attribute__((visibility("default"))) std::vector<int64_t> name##InferShape(int *ndims, int64_t **shapes, AotExtra *)

MSLLM_INFER(msllm_linear) {  // (..., in), (out, in) -> (..., out)
  std::vector<int64_t> s(shapes[0], shapes[0] + ndims[0]);
  s.back() = shapes[1][0];
  return s;
}

MSLLM_INFER(msllm_linear_dx) {  // (..., out), (out, in) -> (..., in)
  std::vector<int64_t> s(shapes[0], shapes[0] + ndims[0]);
  s.back() = shapes[1][1];
  return s;
}

MSLLM_INFER(msllm_linear_dw) {  // (..., out), (..., in) -> (out, in)
  return {shapes[0][ndims[0] - 1], shapes[1][ndims[1] - 1]};
}

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

// Which parallel GEMM the kernels run (Python: msllm.kernels.gemm_path): 1 = oneDNN's threadpool
// interop (oneDNN 3.10, the layout common.h copies), 0 = the "slabs" fallback (any other oneDNN
// version, or MSLLM_GEMM=slabs). The version found is written to major/minor/patch.
extern "C" __attribute__((visibility("default"))) int msllm_gemm_interop(int *major, int *minor, int *patch) {
  const dnnl_abi::version_t *v = dnnl_version();
  *major = v ? v->major : -1;
  *minor = v ? v->minor : -1;
  *patch = v ? v->patch : -1;
  return msllm::threadpool_gemm_ok() ? 1 : 0;
}
