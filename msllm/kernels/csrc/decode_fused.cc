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
// dtype or shape does not fit. With layers > 0 the weight is stacked over that many layers, (L, out, in)
// (int8's scale (L, out, G)), and wt is layer 0's (StackedWeight::at gives the others).
bool read_weight(int &i, int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes, Weight &wt,
                 int64_t layers = 0) {
  const int lead = layers > 0 ? 1 : 0;   // the leading layer dimension of a stacked weight
  auto fits = [&](int j) { return ndims[j] == 2 + lead && (!lead || shapes[j][0] == layers); };
  if (i >= inputs || !fits(i)) return false;
  wt.w = params[i];
  wt.out = shapes[i][lead];
  wt.in = shapes[i][lead + 1];
  if (f32(dtypes[i]) || is(dtypes[i], "bfloat16")) {
    wt.kind = f32(dtypes[i]) ? Weight::kF32 : Weight::kBf16;
    ++i;
    return true;
  }
  if (!is(dtypes[i], "int8") || i + 2 >= inputs) return false;
  if (!f32(dtypes[i + 1]) || !f32(dtypes[i + 2]) || !fits(i + 1) || shapes[i + 1][lead] != wt.out) return false;
  wt.kind = Weight::kInt8;
  wt.scale = static_cast<const float *>(params[i + 1]);
  wt.groups = shapes[i + 1][lead + 1];
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
  static thread_local std::vector<float> bufs[12];
  if (bufs[slot].size() < n) bufs[slot].resize(n);
  return bufs[slot];
}

// One layer's front weights: the input norm's weight (C,) float32 / bfloat16 and eps, Wq, Wk, Wv.
struct FrontWeights {
  void *norm = nullptr;
  const char *norm_dtype = nullptr;
  float eps = 0.f;
  Weight wq, wk, wv;
};

// One layer's back weights: Wo, the post-attention norm's weight and eps, Wgate, Wup, Wdown.
struct BackWeights {
  Weight wo;
  void *norm = nullptr;
  const char *norm_dtype = nullptr;
  float eps = 0.f;
  Weight wg, wu, wd;
};

// A norm weight (C,) and its eps (1,) float32 at params[i], params[i + 1]; moves i past them. With layers > 0
// the weight is stacked over that many layers, (L, C), and w is layer 0's.
bool read_norm(int &i, int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes, int64_t c,
               void *&w, const char *&dtype, float &eps, int64_t layers = 0) {
  if (i + 2 > inputs || !(f32(dtypes[i]) || is(dtypes[i], "bfloat16")) || !f32(dtypes[i + 1])) return false;
  const int lead = layers > 0 ? 1 : 0;
  if (ndims[i] != 1 + lead || (lead && shapes[i][0] != layers) || shapes[i][lead] != c) return false;
  w = params[i];
  dtype = dtypes[i];
  eps = *static_cast<const float *>(params[i + 1]);
  i += 2;
  return true;
}

// The geometry of a decode step: m rows, width c, h query heads and kv key/value heads of d.
struct Geometry {
  int64_t m, c, h, kv, d;
};

// q (m, h, d) rotated and scaled, k (m, kv, d) rotated, v (m, kv, d) from the layer input x (m, c);
// with kcache / vcache (R, kv, d) k and v also copied into cache rows rows[b] (checked in range).
void front_step(const Geometry &g, const FrontWeights &fw, const float *x, const float *cs, const float *sn,
                float scale, float *q, float *k, float *v, float *kcache, float *vcache, const int32_t *rows) {
  const int64_t m = g.m, c = g.c, h = g.h, kv = g.kv, d = g.d;
  std::vector<float> &nw = buffer(0, 0);
  const float *w = norm_weight(fw.norm, fw.norm_dtype, c, nw);
  float *y = buffer(1, m * c).data(), *rstd = buffer(2, m).data();
  float *qr = buffer(3, m * h * d).data(), *kr = buffer(4, m * kv * d).data();
  rms_norm_forward(x, w, fw.eps, c, m, y, rstd);
  fw.wq.apply(y, qr, m);
  fw.wk.apply(y, kr, m);
  fw.wv.apply(y, v, m);
  rope_forward(qr, cs, sn, q, m, h, d);
  rope_forward(kr, cs, sn, k, m, kv, d);
  for (int64_t j = 0; j < m * h * d; ++j) q[j] *= scale;  // after the rotation, as decode_one's Mul
  if (kcache) {
    const int64_t row = kv * d;                               // one cache row: (K, D)
    for (int64_t b = 0; b < m; ++b) {
      std::memcpy(kcache + rows[b] * row, k + b * row, row * sizeof(float));
      std::memcpy(vcache + rows[b] * row, v + b * row, row * sizeof(float));
    }
  }
}

// out (m, c) = h + down(silu(gate(n)) * up(n)), h = x + o(attention(q over the caches (s * m, kv, d),
// mask (mask_rows, 1, 1, s))), n = rmsnorm(h). ``out`` may be ``x``: x is read (by the residual
// add) before out is written.
void back_step(const Geometry &g, const BackWeights &bw, const float *x, const float *q, const float *kcache,
               const float *vcache, const float *mask, int64_t mask_rows, int64_t s, float *out) {
  const int64_t m = g.m, c = g.c, h = g.h, kv = g.kv, d = g.d, f = bw.wg.out;
  std::vector<float> &nw = buffer(0, 0);
  const float *w = norm_weight(bw.norm, bw.norm_dtype, c, nw);
  float *attn = buffer(1, m * h * d).data(), *o = buffer(2, m * c).data(), *hs = buffer(3, m * c).data();
  float *n = buffer(4, m * c).data(), *rstd = buffer(5, m).data();
  float *gt = buffer(6, m * f).data(), *u = buffer(7, m * f).data();
  decode_attention_forward(q, kcache, vcache, mask, attn, m, h, 1, d, s, kv, mask_rows);
  bw.wo.apply(attn, o, m);
  add_rms_norm_forward(x, o, w, bw.eps, c, m, hs, n, rstd);
  bw.wg.apply(n, gt, m);
  bw.wu.apply(n, u, m);
  swiglu_forward(gt, u, gt, m * f);   // in place: each element read before it is written
  bw.wd.apply(gt, o, m);
  for (int64_t j = 0; j < m * c; ++j) out[j] = hs[j] + o[j];
}

// The front weights at params[i..] (norm, eps, Wq, Wk, Wv) for width c; false if one does not fit.
bool read_front(int &i, int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes, int64_t c,
                FrontWeights &fw) {
  return read_norm(i, inputs, params, ndims, shapes, dtypes, c, fw.norm, fw.norm_dtype, fw.eps) &&
         read_weight(i, inputs, params, ndims, shapes, dtypes, fw.wq) &&
         read_weight(i, inputs, params, ndims, shapes, dtypes, fw.wk) &&
         read_weight(i, inputs, params, ndims, shapes, dtypes, fw.wv);
}

// The back weights at params[i..] (Wo, norm, eps, Wgate, Wup, Wdown); false if one does not fit.
bool read_back(int &i, int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes, int64_t c,
               BackWeights &bw) {
  return read_weight(i, inputs, params, ndims, shapes, dtypes, bw.wo) &&
         read_norm(i, inputs, params, ndims, shapes, dtypes, c, bw.norm, bw.norm_dtype, bw.eps) &&
         read_weight(i, inputs, params, ndims, shapes, dtypes, bw.wg) &&
         read_weight(i, inputs, params, ndims, shapes, dtypes, bw.wu) &&
         read_weight(i, inputs, params, ndims, shapes, dtypes, bw.wd);
}

bool front_fits(const Geometry &g, const FrontWeights &fw) {
  const Weight &q = fw.wq, &k = fw.wk, &v = fw.wv;
  return q.in == g.c && k.in == g.c && v.in == g.c && q.out == g.h * g.d && k.out == g.kv * g.d && v.out == k.out;
}

bool back_fits(const Geometry &g, const BackWeights &bw) {
  const int64_t f = bw.wg.out;
  return bw.wo.in == g.h * g.d && bw.wo.out == g.c && bw.wg.in == g.c && bw.wu.in == g.c && bw.wu.out == f &&
         bw.wd.in == f && bw.wd.out == g.c;
}

// A (R, kv, d) float32 cache at params[i] for geometry g: its row count, or -1.
int64_t cache_rows_of(int i, int *ndims, int64_t **shapes, const char **dtypes, const Geometry &g) {
  if (!f32(dtypes[i]) || ndims[i] != 3 || shapes[i][1] != g.kv || shapes[i][2] != g.d) return -1;
  return shapes[i][0];
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
  if (!f32(dtypes[0])) return 1;
  const int64_t c = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(c, 1);
  FrontWeights fw;
  int i = 1;
  if (!read_front(i, inputs, params, ndims, shapes, dtypes, c, fw)) return 1;
  if (i + 3 != inputs || !f32(dtypes[i]) || !f32(dtypes[i + 1]) || !f32(dtypes[i + 2])) return 1;
  const int64_t d = shapes[i][ndims[i] - 1];
  if (d <= 0 || d % 2 || numel(ndims[i], shapes[i]) != m * d || numel(ndims[i + 1], shapes[i + 1]) != m * d) return 2;
  if (fw.wq.out % d || fw.wk.out % d) return 2;
  const Geometry g{m, c, fw.wq.out / d, fw.wk.out / d, d};
  if (!front_fits(g, fw)) return 2;
  for (int o = 0; o < 3; ++o)
    if (!f32(dtypes[all + o]) || numel(ndims[all + o], shapes[all + o]) != m * (o ? g.kv : g.h) * d) return 2;
  float *kcache = nullptr, *vcache = nullptr;
  const int32_t *rows = nullptr;
  if (write) {
    const int kc = inputs, vc = inputs + 1, ix = inputs + 2;
    const int64_t cache_rows = cache_rows_of(kc, ndims, shapes, dtypes, g);
    if (cache_rows < 0 || cache_rows_of(vc, ndims, shapes, dtypes, g) != cache_rows) return 2;
    if (numel(ndims[ix], shapes[ix]) != m) return 2;
    kcache = static_cast<float *>(params[kc]);
    vcache = static_cast<float *>(params[vc]);
    rows = static_cast<const int32_t *>(params[ix]);
    for (int64_t b = 0; b < m; ++b)
      if (rows[b] < 0 || rows[b] >= cache_rows) return 2;     // checked before anything is written
  }
  if (m <= 0) return 0;
  front_step(g, fw, static_cast<const float *>(params[0]), static_cast<const float *>(params[i]),
             static_cast<const float *>(params[i + 1]), *static_cast<const float *>(params[i + 2]),
             static_cast<float *>(params[all]), static_cast<float *>(params[all + 1]),
             static_cast<float *>(params[all + 2]), kcache, vcache, rows);
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
  const Geometry g{m, c, shapes[1][1], shapes[2][1], shapes[1][3]};
  if (shapes[1][0] != m || shapes[1][2] != 1 || m <= 0 || shapes[2][0] % m) return 2;
  const int64_t s = shapes[2][0] / m;
  if (shapes[2][2] != g.d || g.kv <= 0 || g.h % g.kv || shapes[3][0] != s * m || shapes[3][1] != g.kv ||
      shapes[3][2] != g.d || shapes[4][3] != s || shapes[4][2] != 1 || (shapes[4][0] != m && shapes[4][0] != 1))
    return 2;
  BackWeights bw;
  int i = 5;
  if (!read_back(i, inputs, params, ndims, shapes, dtypes, c, bw) || i != inputs) return 1;
  if (!back_fits(g, bw)) return 2;
  if (!f32(dtypes[inputs]) || numel(ndims[inputs], shapes[inputs]) != m * c) return 2;
  back_step(g, bw, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
            static_cast<const float *>(params[2]), static_cast<const float *>(params[3]),
            static_cast<const float *>(params[4]), shapes[4][0], s, static_cast<float *>(params[inputs]));
  return 0;
}

namespace {

// The weights of every layer stacked over the layers, as msllm_decode_stack's second layout takes them:
// a weight (L, out, in) float32 / bfloat16 in one input, or int8 q (L, out, in), scale (L, out, G) and group
// (1,) in three; layer l's is slice l, read where it lies.
struct StackedWeight {
  Weight first;                       // layer 0's
  int64_t w_bytes = 0, s_elems = 0;   // one layer's weight bytes and scale elements
  Weight at(int64_t l) const {
    Weight w = first;
    w.w = static_cast<const char *>(first.w) + l * w_bytes;
    if (w.scale) w.scale = first.scale + l * s_elems;
    return w;
  }
};

bool read_stacked_weight(int &i, int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                         int64_t layers, StackedWeight &sw) {
  Weight &wt = sw.first;
  if (!read_weight(i, inputs, params, ndims, shapes, dtypes, wt, layers)) return false;
  sw.w_bytes = wt.out * wt.in * (wt.kind == Weight::kF32 ? 4 : wt.kind == Weight::kBf16 ? 2 : 1);
  sw.s_elems = wt.kind == Weight::kInt8 ? wt.out * wt.groups : 0;
  return true;
}

// A norm weight stacked over the layers, (L, C) float32 / bfloat16, and its eps (1,) float32.
struct StackedNorm {
  void *w = nullptr;
  const char *dtype = nullptr;
  int64_t bytes = 0;                  // one layer's
  float eps = 0.f;
  void *at(int64_t l) const { return static_cast<char *>(w) + l * bytes; }
};

bool read_stacked_norm(int &i, int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                       int64_t layers, int64_t c, StackedNorm &sn) {
  if (!read_norm(i, inputs, params, ndims, shapes, dtypes, c, sn.w, sn.dtype, sn.eps, layers)) return false;
  sn.bytes = c * (f32(sn.dtype) ? 4 : 2);
  return true;
}

// One layer of msllm_decode_stack: its weights and its caches.
struct StackLayer {
  FrontWeights fw;
  BackWeights bw;
  float *kcache, *vcache;
};

// msllm_decode_stack's layers from inputs [6, inputs) given one layer after another (norm weight, eps, Wq, Wk,
// Wv, k cache, v cache, Wo, norm weight, eps, Wgate, Wup, Wdown); 0, or the kernel's error code.
int layers_one_by_one(int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes, Geometry &g,
                      int64_t cache_rows, std::vector<StackLayer> &layers) {
  for (int i = 6; i < inputs;) {
    StackLayer l;
    if (!read_front(i, inputs, params, ndims, shapes, dtypes, g.c, l.fw) || i + 2 > inputs) return 1;
    if (l.fw.wq.out % g.d || l.fw.wk.out % g.d) return 2;
    if (layers.empty()) g = Geometry{g.m, g.c, l.fw.wq.out / g.d, l.fw.wk.out / g.d, g.d};
    if (g.kv <= 0 || g.h % g.kv || !front_fits(g, l.fw)) return 2;
    for (int cache : {i, i + 1})
      if (cache_rows_of(cache, ndims, shapes, dtypes, g) != cache_rows) return 2;
    l.kcache = static_cast<float *>(params[i]);
    l.vcache = static_cast<float *>(params[i + 1]);
    i += 2;
    if (!read_back(i, inputs, params, ndims, shapes, dtypes, g.c, l.bw)) return 1;
    if (!back_fits(g, l.bw)) return 2;
    layers.push_back(l);
  }
  return layers.empty() ? 1 : 0;
}

// msllm_decode_stack's layers from inputs [6, inputs) stacked over the L layers: norm weight (L, C), eps,
// Wq, Wk, Wv, Wo (L, out, in) each, norm weight (L, C), eps, Wgate, Wup, Wdown, then the caches k 0, v 0,
// k 1, v 1, ...; 0, or the kernel's error code.
int layers_stacked(int inputs, void **params, int *ndims, int64_t **shapes, const char **dtypes, Geometry &g,
                   int64_t cache_rows, std::vector<StackLayer> &layers) {
  const int64_t nl = shapes[6][0];
  StackedNorm n1, n2;
  StackedWeight wq, wk, wv, wo, wg, wu, wd;
  int i = 6;
  if (!read_stacked_norm(i, inputs, params, ndims, shapes, dtypes, nl, g.c, n1)) return 1;
  for (StackedWeight *w : {&wq, &wk, &wv, &wo})
    if (!read_stacked_weight(i, inputs, params, ndims, shapes, dtypes, nl, *w)) return 1;
  if (!read_stacked_norm(i, inputs, params, ndims, shapes, dtypes, nl, g.c, n2)) return 1;
  for (StackedWeight *w : {&wg, &wu, &wd})
    if (!read_stacked_weight(i, inputs, params, ndims, shapes, dtypes, nl, *w)) return 1;
  if (nl <= 0 || i + 2 * nl != inputs) return 1;
  if (wq.first.out % g.d || wk.first.out % g.d) return 2;
  g = Geometry{g.m, g.c, wq.first.out / g.d, wk.first.out / g.d, g.d};
  // every layer's slices have layer 0's shapes: one check
  const FrontWeights f0{n1.at(0), n1.dtype, n1.eps, wq.first, wk.first, wv.first};
  const BackWeights b0{wo.first, n2.at(0), n2.dtype, n2.eps, wg.first, wu.first, wd.first};
  if (g.kv <= 0 || g.h % g.kv || !front_fits(g, f0) || !back_fits(g, b0)) return 2;
  for (int64_t l = 0; l < nl; ++l, i += 2) {
    StackLayer s;
    s.fw = FrontWeights{n1.at(l), n1.dtype, n1.eps, wq.at(l), wk.at(l), wv.at(l)};
    s.bw = BackWeights{wo.at(l), n2.at(l), n2.dtype, n2.eps, wg.at(l), wu.at(l), wd.at(l)};
    for (int cache : {i, i + 1})
      if (cache_rows_of(cache, ndims, shapes, dtypes, g) != cache_rows) return 2;
    s.kcache = static_cast<float *>(params[i]);
    s.vcache = static_cast<float *>(params[i + 1]);
    layers.push_back(s);
  }
  return 0;
}

}  // namespace

// The whole decoder stack's decode step in one operator: MindSpore launches 2 operators per layer
// above (60 for SmolLM2, each launch costing tens of microseconds: benchmarks/decode_profile.py
// --tiny), this one per step. Each layer runs front_step then back_step, the code of the two
// operators above in the same order, so the result and the caches are bit for bit those of the
// per-layer operators (tests/models/test_llama_decode_fused.py).
// Inputs: x (B, 1, C) float32, cos, sin (B, .., D) float32, scale (1,), mask (B or 1, 1, 1, S) additive
// (one for every layer: no per-layer window), index (1, B) int32 (row b's cache row), then the layers in
// one of two layouts:
// - one after another: per layer norm weight, eps, Wq, Wk, Wv, k cache, v cache (S * B, K, D) float32, Wo,
//   norm weight, eps, Wgate, Wup, Wdown (each weight one input, or three for int8);
// - stacked (the first norm weight has two dimensions): each kind of weight once for all L layers, norm
//   weight (L, C), eps, Wq, Wk, Wv, Wo (L, out, in) (or int8's three: q (L, out, in), scale (L, out, G),
//   group), norm weight (L, C), eps, Wgate, Wup, Wdown, then the caches k 0, v 0, ..., k L-1, v L-1.
//   MindSpore's runtime spends microseconds per operator input at every launch: 17 + 2L inputs (int8: 31 + 2L)
//   instead of 6 + 13 L (int8: 6 + 27 L) (msllm/models/llama/stacked.py).
// Output: (B, 1, C) the last layer's output. The caches are written in place, as decode_front writes them.
MSLLM_AOT(msllm_decode_stack) {
  const int inputs = nparam - 1;
  if (inputs < 7) return 1;
  for (int j = 0; j < 5; ++j)
    if (!f32(dtypes[j])) return 1;
  if (!is(dtypes[5], "int32") || ndims[4] != 4) return 1;
  const int64_t c = shapes[0][ndims[0] - 1], m = numel(ndims[0], shapes[0]) / std::max<int64_t>(c, 1);
  const int64_t d = shapes[1][ndims[1] - 1];
  if (m <= 0 || d <= 0 || d % 2 || numel(ndims[1], shapes[1]) != m * d || numel(ndims[2], shapes[2]) != m * d)
    return 2;
  if (numel(ndims[5], shapes[5]) != m || (shapes[4][0] != m && shapes[4][0] != 1) || shapes[4][2] != 1) return 2;
  const int64_t s = shapes[4][3], cache_rows = s * m;
  if (!f32(dtypes[inputs]) || numel(ndims[inputs], shapes[inputs]) != m * c) return 2;
  const int32_t *rows = static_cast<const int32_t *>(params[5]);
  for (int64_t b = 0; b < m; ++b)
    if (rows[b] < 0 || rows[b] >= cache_rows) return 2;
  // every layer's inputs are read and checked before anything is computed or written; the list is kept
  // between calls (per thread: MindSpore may run two kernels at once): a list grown per call cost a few
  // reallocations every step in glibc's malloc (scratch.h)
  static thread_local std::vector<StackLayer> layers;
  layers.clear();
  Geometry g{m, c, 0, 0, d};
  const int err = ndims[6] == 2 ? layers_stacked(inputs, params, ndims, shapes, dtypes, g, cache_rows, layers)
                                : layers_one_by_one(inputs, params, ndims, shapes, dtypes, g, cache_rows, layers);
  if (err) return err;
  const float *cs = static_cast<const float *>(params[1]), *sn = static_cast<const float *>(params[2]);
  const float scale = *static_cast<const float *>(params[3]), *mask = static_cast<const float *>(params[4]);
  float *x = static_cast<float *>(params[inputs]);            // the running hidden state, (B, 1, C)
  std::memcpy(x, params[0], m * c * sizeof(float));
  float *q = buffer(8, m * g.h * d).data(), *k = buffer(9, m * g.kv * d).data(), *v = buffer(10, m * g.kv * d).data();
  for (const StackLayer &l : layers) {
    front_step(g, l.fw, x, cs, sn, scale, q, k, v, l.kcache, l.vcache, rows);
    back_step(g, l.bw, x, q, l.kcache, l.vcache, mask, shapes[4][0], s, x);
  }
  return 0;
}
