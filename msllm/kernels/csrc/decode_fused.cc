// A decoder layer's decode step (T = 1 new token per row) in two operators instead of ~15:
// MindSpore's CPU runtime spends tens of microseconds launching each operator, more than the
// work of most of them at batch 1 (benchmarks/decode_profile.py: a 30-layer graph with hidden 64
// took ~18 ms per step of which 2 ms in the kernels).
//
//   msllm_decode_front: x (B, 1, C) -> RMSNorm -> q, k, v projections -> rotary of q and k (row b
//     with its own table row) -> q times the attention scale;
//     = Attention.decode_one's front plus DecoderLayer's input_layernorm (model.py). Given the
//     layer's caches and the new tokens' cache rows as three more inputs, it also writes k and v
//     into those rows, in place: what the model's two ScatterUpdates did between the operators
//     (60 operators fewer per SmolLM2 step; about 1 ms of the hidden-64 graph's step in a trial).
//     The caches are Parameters that MindSpore passes by their own buffers (on CPU a Parameter's
//     device memory is its data: the next step, and asnumpy(), see the rows;
//     tests/models/test_llama_decode_fused.py checks both against the ScatterUpdate path), and
//     only decode_back of the same layer reads them, after this operator (it takes q from it).
//     No MindSpore operator may write the caches in the same graph: after an assign MindSpore
//     hands later readers the assigned value, not the Parameter's buffer, and these writes would
//     miss the cache (beam search's reorder therefore runs as a graph of its own:
//     msllm/generation/decode.py ReorderCaches).
//   msllm_decode_back: (x, q, the caches written) -> decode attention -> o projection -> residual
//     add + RMSNorm -> gate / up projections -> SwiGLU -> down projection -> residual add;
//     = decode_one's back plus DecoderLayer.feed_forward with the SwiGLU MLP.
//
// Every part runs the same C++ as its own operator (parts.h: the same functions, the same
// summation order), so the fused step equals the unfused one bit for bit, and each part keeps its
// instruction-set choice (int8: AVX-512 / AVX2 / C++ at run time, linear_int8.cc). A weight is
// one input (float32 or bfloat16 (out, in)) or three for weight-only int8: q (out, in) int8,
// scale (out, G) float32, group (1,) float32 (Linear.use_int8); each projection may be either.
// Inference only (no gradient).
#include "common.h"
#include "parts.h"

using namespace msllm;

namespace {

// One projection's weight as the kernel inputs give it.
struct Weight {
  enum Kind { kF32, kBf16, kInt8 } kind = kF32;
  const void *w = nullptr;
  const float *scale = nullptr;
  int64_t out = 0, in = 0, groups = 1, group = 1;

  void apply(const float *x, float *y, int64_t m) const {  // y (m, out) = x (m, in) W^T
    if (kind == kInt8)
      linear_int8_forward(x, static_cast<const int8_t *>(w), scale, groups, group, y, m, in, out);
    else
      linear_forward(x, w, kind == kBf16, y, m, in, out);
  }
};

bool is(const char *dtype, const char *name) { return std::strcmp(dtype, name) == 0; }
bool f32(const char *dtype) { return is(dtype, "float32") || is(dtype, "float"); }

// Reads the weight at params[i] (one input, or three for int8) and moves i past it; false if a
// dtype or shape does not fit.
bool read_weight(int &i, int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes, Weight &wt) {
  if (i >= inputs || ndims[i] != 2) return false;
  wt.w = params[i];
  wt.out = shapes[i][0];
  wt.in = shapes[i][1];
  if (f32(dtypes[i]) || is(dtypes[i], "bfloat16")) {
    wt.kind = f32(dtypes[i]) ? Weight::kF32 : Weight::kBf16;
    ++i;
    return true;
  }
  if (!is(dtypes[i], "int8") || i + 2 >= inputs) return false;
  if (!f32(dtypes[i + 1]) || !f32(dtypes[i + 2]) || ndims[i + 1] != 2 || shapes[i + 1][0] != wt.out) return false;
  wt.kind = Weight::kInt8;
  wt.scale = static_cast<const float *>(params[i + 1]);
  wt.groups = shapes[i + 1][1];
  wt.group = static_cast<int64_t>(*static_cast<const float *>(params[i + 2]));
  i += 3;
  return wt.groups >= 1 && wt.group >= 1 && (wt.in + wt.group - 1) / wt.group == wt.groups;
}

// A norm weight (C,) float32 or bfloat16 as float32 (widening bf16 is exact: the cast the model
// does before the unfused norm operator).
const float *norm_weight(void *p, const char *dtype, int64_t c, std::vector<float> &buf) {
  if (f32(dtype)) return static_cast<const float *>(p);
  buf.resize(c);
  widen_bf16(static_cast<const uint16_t *>(p), buf.data(), c);
  return buf.data();
}

// Per-thread scratch of the fused step (MindSpore may run two kernels at once on two threads).
std::vector<float> &buffer(int slot, size_t n) {
  static thread_local std::vector<float> bufs[8];
  if (bufs[slot].size() < n) bufs[slot].resize(n);
  return bufs[slot];
}

}  // namespace

// Inputs: x (B, 1, C) float32, norm weight (C,) float32 / bfloat16, eps (1,), Wq (H*D, C), Wk (K*D, C),
// Wv (K*D, C) (each one input, or three for int8), cos (B, .., D), sin (B, .., D) (row b's position),
// scale (1,) (1/sqrt(D)), and optionally k cache, v cache (R, K, D) float32 with index (1, B) int32 (row
// b's cache row, in [0, R)). Outputs: q (B, H, 1, D) rotated and scaled, k (1, B, K, D) rotated,
// v (1, B, K, D); with the caches, k and v also written into their rows.
MSLLM_AOT(msllm_decode_front) {
  const int all = nparam - 3;
  if (all < 9) return 1;
  // the three cache inputs are there when the last input is the int32 row index
  const bool write = all >= 12 && is(dtypes[all - 1], "int32");
  const int inputs = write ? all - 3 : all;
  if (!f32(dtypes[0]) || !f32(dtypes[2])) return 1;
  const int64_t c = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(c, 1);
  if (!f32(dtypes[1]) && !is(dtypes[1], "bfloat16")) return 1;
  if (ndims[1] != 1 || shapes[1][0] != c) return 2;
  Weight wq, wk, wv;
  int i = 3;
  auto next = [&](Weight &wt) { return read_weight(i, inputs, params, ndims, shapes, dtypes, wt); };
  if (!next(wq) || !next(wk) || !next(wv)) return 1;
  if (i + 3 != inputs || !f32(dtypes[i]) || !f32(dtypes[i + 1]) || !f32(dtypes[i + 2])) return 1;
  const int64_t d = shapes[i][ndims[i] - 1];
  if (d <= 0 || d % 2 || numel(ndims[i], shapes[i]) != m * d || numel(ndims[i + 1], shapes[i + 1]) != m * d) return 2;
  if (wq.in != c || wk.in != c || wv.in != c || wq.out % d || wk.out % d || wk.out != wv.out) return 2;
  const int64_t h = wq.out / d, kv = wk.out / d;
  for (int o = 0; o < 3; ++o)
    if (!f32(dtypes[all + o]) || numel(ndims[all + o], shapes[all + o]) != m * (o ? kv : h) * d) return 2;
  float *kcache = nullptr, *vcache = nullptr;
  const int32_t *rows = nullptr;
  int64_t cache_rows = 0;
  if (write) {
    const int kc = inputs, vc = inputs + 1, ix = inputs + 2;
    if (!f32(dtypes[kc]) || !f32(dtypes[vc]) || ndims[kc] != 3 || ndims[vc] != 3) return 1;
    cache_rows = shapes[kc][0];
    for (int c : {kc, vc})
      if (shapes[c][0] != cache_rows || shapes[c][1] != kv || shapes[c][2] != d) return 2;
    if (numel(ndims[ix], shapes[ix]) != m) return 2;
    kcache = static_cast<float *>(params[kc]);
    vcache = static_cast<float *>(params[vc]);
    rows = static_cast<const int32_t *>(params[ix]);
    for (int64_t b = 0; b < m; ++b)
      if (rows[b] < 0 || rows[b] >= cache_rows) return 2;     // checked before anything is written
  }
  const float *x = static_cast<const float *>(params[0]);
  const float *cs = static_cast<const float *>(params[i]), *sn = static_cast<const float *>(params[i + 1]);
  const float scale = *static_cast<const float *>(params[i + 2]);
  float *q = static_cast<float *>(params[all]), *k = static_cast<float *>(params[all + 1]);
  float *v = static_cast<float *>(params[all + 2]);
  if (m <= 0) return 0;

  std::vector<float> &nw = buffer(0, 0);
  const float *w = norm_weight(params[1], dtypes[1], c, nw);
  float *y = buffer(1, m * c).data(), *rstd = buffer(2, m).data();
  float *qr = buffer(3, m * h * d).data(), *kr = buffer(4, m * kv * d).data();
  rms_norm_forward(x, w, *static_cast<const float *>(params[2]), c, m, y, rstd);
  wq.apply(y, qr, m);
  wk.apply(y, kr, m);
  wv.apply(y, v, m);
  rope_forward(qr, cs, sn, q, m, h, d);
  rope_forward(kr, cs, sn, k, m, kv, d);
  for (int64_t j = 0; j < m * h * d; ++j) q[j] *= scale;  // after the rotation, as decode_one's Mul
  if (write) {
    const int64_t row = kv * d;                               // one cache row: (K, D)
    for (int64_t b = 0; b < m; ++b) {
      std::memcpy(kcache + rows[b] * row, k + b * row, row * sizeof(float));
      std::memcpy(vcache + rows[b] * row, v + b * row, row * sizeof(float));
    }
  }
  return 0;
}

// Inputs: x (B, 1, C) float32 (the layer's input, the residual), q (B, H, 1, D) from the front,
// k / v caches (S * B, K, D) float32 (written by ScatterUpdate), mask (B or 1, 1, 1, S) additive,
// Wo (C, H*D), post-attention norm weight (C,) float32 / bfloat16, eps (1,), Wgate (F, C),
// Wup (F, C), Wdown (C, F) (each one input, or three for int8). Output: (B, 1, C) the layer's output
// h + down(silu(gate(n)) * up(n)) with h = x + o(attention), n = rmsnorm(h).
MSLLM_AOT(msllm_decode_back) {
  const int inputs = nparam - 1;
  if (inputs < 11) return 1;
  for (int j = 0; j < 5; ++j)
    if (!f32(dtypes[j])) return 1;
  if (ndims[1] != 4 || ndims[2] != 3 || ndims[3] != 3 || ndims[4] != 4) return 2;
  const int64_t c = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(c, 1);
  const int64_t h = shapes[1][1], d = shapes[1][3], kv = shapes[2][1];
  if (shapes[1][0] != m || shapes[1][2] != 1 || m <= 0 || shapes[2][0] % m) return 2;
  const int64_t s = shapes[2][0] / m;
  if (shapes[2][2] != d || kv <= 0 || h % kv || shapes[3][0] != s * m || shapes[3][1] != kv || shapes[3][2] != d ||
      shapes[4][3] != s || shapes[4][2] != 1 || (shapes[4][0] != m && shapes[4][0] != 1))
    return 2;
  Weight wo, wg, wu, wd;
  int i = 5;
  auto next = [&](Weight &wt) { return read_weight(i, inputs, params, ndims, shapes, dtypes, wt); };
  if (!next(wo)) return 1;
  if (i + 2 > inputs || !(f32(dtypes[i]) || is(dtypes[i], "bfloat16")) || !f32(dtypes[i + 1])) return 1;
  if (ndims[i] != 1 || shapes[i][0] != c) return 2;
  const int norm_at = i;
  i += 2;
  if (!next(wg) || !next(wu) || !next(wd) || i != inputs) return 1;
  const int64_t f = wg.out;
  if (wo.in != h * d || wo.out != c || wg.in != c || wu.in != c || wu.out != f || wd.in != f || wd.out != c) return 2;
  if (!f32(dtypes[inputs]) || numel(ndims[inputs], shapes[inputs]) != m * c) return 2;
  const float *x = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[inputs]);

  std::vector<float> &nw = buffer(0, 0);
  const float *w = norm_weight(params[norm_at], dtypes[norm_at], c, nw);
  float *attn = buffer(1, m * h * d).data(), *o = buffer(2, m * c).data(), *hs = buffer(3, m * c).data();
  float *n = buffer(4, m * c).data(), *rstd = buffer(5, m).data();
  float *g = buffer(6, m * f).data(), *u = buffer(7, m * f).data();
  decode_attention_forward(static_cast<const float *>(params[1]), static_cast<const float *>(params[2]),
                           static_cast<const float *>(params[3]), static_cast<const float *>(params[4]), attn, m, h,
                           1, d, s, kv, shapes[4][0]);
  wo.apply(attn, o, m);
  add_rms_norm_forward(x, o, w, *static_cast<const float *>(params[norm_at + 1]), c, m, hs, n, rstd);
  wg.apply(n, g, m);
  wu.apply(n, u, m);
  swiglu_forward(g, u, g, m * f);   // in place: each element read before it is written
  wd.apply(g, o, m);
  for (int64_t j = 0; j < m * c; ++j) out[j] = hs[j] + o[j];
  return 0;
}
