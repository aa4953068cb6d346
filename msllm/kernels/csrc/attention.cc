// Causal self-attention without the (B, H, T, T) score tensor: FlashAttention-2's algorithm
// (Dao 2023, "FlashAttention-2", algorithms 1 and 2: per query block, scores -> softmax ->
// P V in on-chip memory; only the row log-sum-exp L = m + log(l) is saved for the backward pass,
// which recomputes P = exp(S - L)). On a CPU the "on-chip" block is a per-thread buffer of
// BQ x T floats (128 x 1024 x 4 B = 512 KiB, inside a core's 2 MiB L2), so the key dimension is
// not blocked: each query block sees all its keys at once and the online-softmax rescaling is
// not needed. The block products run on oneDNN's sgemm (common.h).
//
// Layout: q (B, T, H, D), k and v (B, T, K, D) (the projections' (B*T, heads*D) outputs viewed
// 4-D, no transposes), grouped-query attention with H / K query heads per key/value head
// (query head h uses key/value head h / (H / K)). Scale 1/sqrt(D), causal: query t sees keys
// 0..t. Output o (B, T, H, D) and lse (B, H, T).
#include "common.h"

using namespace msllm;

namespace {
// Query rows per block: bigger blocks make bigger (more efficient) GEMMs but waste more of the
// causal diagonal block. Per-core throughput of forward + backward (benchmarks, docs/kernels.md):
// T = 1024: 128 rows 15% faster than 64; T = 256-512: 64 as fast or faster.
constexpr int64_t kMaxBlock = 128;
inline int64_t block_rows(int64_t t) { return t >= 768 ? 128 : 64; }

struct Dims {
  int64_t b, t, h, k, d, rep;
  int64_t ldq() const { return h * d; }
  int64_t ldk() const { return k * d; }
};

bool read_dims(int *ndims, int64_t **shapes, Dims *out) {
  if (ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4) return false;
  Dims d{shapes[0][0], shapes[0][1], shapes[0][2], shapes[1][2], shapes[0][3], 1};
  for (int i = 1; i < 3; ++i)
    if (shapes[i][0] != d.b || shapes[i][1] != d.t || shapes[i][2] != d.k || shapes[i][3] != d.d) return false;
  if (d.k <= 0 || d.h % d.k) return false;
  d.rep = d.h / d.k;
  *out = d;
  return true;
}
}  // namespace

// q (B,T,H,D), k (B,T,K,D), v (B,T,K,D) -> o (B,T,H,D), lse (B,H,T)
MSLLM_AOT(msllm_flash_attention) {
  if (nparam != 5 || !all_f32(nparam, dtypes)) return 1;
  Dims dm;
  if (!read_dims(ndims, shapes, &dm)) return 2;
  const float *q = static_cast<const float *>(params[0]);
  const float *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  float *o = static_cast<float *>(params[3]);
  float *lse = static_cast<float *>(params[4]);
  const int64_t T = dm.t, D = dm.d, BQ = block_rows(T), nqb = (T + BQ - 1) / BQ;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t nbh = dm.b * dm.h;
  // task i: the longest (last) query blocks first, so that dynamic hand-out balances the load
  Pool::get().run(static_cast<int>(nbh * nqb), [&](int i) {
    const int64_t qb = nqb - 1 - i / nbh, bh = i % nbh, b = bh / dm.h, h = bh % dm.h, g = h / dm.rep;
    const int64_t q0 = qb * BQ, nq = std::min(BQ, T - q0), kend = q0 + nq;  // keys 0..kend-1
    const float *qp = q + (b * T + q0) * dm.ldq() + h * D;
    const float *kp = k + b * T * dm.ldk() + g * D;
    const float *vp = v + b * T * dm.ldk() + g * D;
    float *s = scratch(0, BQ * T);
    sgemm('N', 'T', nq, kend, D, scale, qp, dm.ldq(), kp, dm.ldk(), 0.f, s, kend);  // S (nq, kend)
    float inv_l[kMaxBlock];
    for (int64_t r = 0; r < nq; ++r) {
      float *row = s + r * kend;
      const int64_t valid = q0 + r + 1;  // causal
      const float m = row_max(row, valid);
      const float l = exp_shift_sum(row, row, valid, 1.f, m);
      std::memset(row + valid, 0, sizeof(float) * (kend - valid));
      lse[bh * T + q0 + r] = m + std::log(l);
      inv_l[r] = 1.f / l;
    }
    float *op = o + (b * T + q0) * dm.ldq() + h * D;
    sgemm('N', 'N', nq, D, kend, 1.f, s, kend, vp, dm.ldk(), 0.f, op, dm.ldq());  // O = P V (nq, D)
    for (int64_t r = 0; r < nq; ++r)
      for (int64_t c = 0; c < D; ++c) op[r * dm.ldq() + c] *= inv_l[r];
  });
  return 0;
}

// do (B,T,H,D), q, k, v, o, lse (B,H,T) -> dq (B,T,H,D), dk (B,T,K,D), dv (B,T,K,D).
// One task per (batch row, key/value head): it owns dk and dv of that head, so no two threads
// write the same gradient rows.
MSLLM_AOT(msllm_flash_attention_grad) {
  if (nparam != 9 || !all_f32(nparam, dtypes)) return 1;
  Dims dm;
  if (!read_dims(ndims + 1, shapes + 1, &dm)) return 2;
  const float *dout = static_cast<const float *>(params[0]);
  const float *q = static_cast<const float *>(params[1]);
  const float *k = static_cast<const float *>(params[2]);
  const float *v = static_cast<const float *>(params[3]);
  const float *o = static_cast<const float *>(params[4]);
  const float *lse = static_cast<const float *>(params[5]);
  float *dq = static_cast<float *>(params[6]);
  float *dk = static_cast<float *>(params[7]);
  float *dv = static_cast<float *>(params[8]);
  const int64_t T = dm.t, D = dm.d, BQ = block_rows(T), nqb = (T + BQ - 1) / BQ, ldq = dm.ldq(), ldk = dm.ldk();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  Pool::get().run(static_cast<int>(dm.b * dm.k), [&](int i) {
    const int64_t b = i / dm.k, g = i % dm.k;
    const float *kp = k + b * T * ldk + g * D, *vp = v + b * T * ldk + g * D;
    float *dkp = dk + b * T * ldk + g * D, *dvp = dv + b * T * ldk + g * D;
    for (int64_t t = 0; t < T; ++t) {
      std::memset(dkp + t * ldk, 0, sizeof(float) * D);
      std::memset(dvp + t * ldk, 0, sizeof(float) * D);
    }
    float *p = scratch(0, BQ * T), *dp = scratch(1, BQ * T), *delta = scratch(2, T);
    for (int64_t h = g * dm.rep; h < (g + 1) * dm.rep; ++h) {
      const float *lrow = lse + (b * dm.h + h) * T;
      for (int64_t t = 0; t < T; ++t)  // delta_t = dO_t . O_t  (FlashAttention-2, alg. 2 line 4)
        delta[t] = dot(dout + (b * T + t) * ldq + h * D, o + (b * T + t) * ldq + h * D, D);
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const int64_t q0 = qb * BQ, nq = std::min(BQ, T - q0), kend = q0 + nq;
        const float *qp = q + (b * T + q0) * ldq + h * D, *dop = dout + (b * T + q0) * ldq + h * D;
        float *dqp = dq + (b * T + q0) * ldq + h * D;
        sgemm('N', 'T', nq, kend, D, scale, qp, ldq, kp, ldk, 0.f, p, kend);  // S
        for (int64_t r = 0; r < nq; ++r) {                                     // P = exp(S - L), causal
          const int64_t valid = q0 + r + 1;
          exp_shift_sum(p + r * kend, p + r * kend, valid, 1.f, lrow[q0 + r]);
          std::memset(p + r * kend + valid, 0, sizeof(float) * (kend - valid));
        }
        sgemm('T', 'N', kend, D, nq, 1.f, p, kend, dop, ldq, 1.f, dvp, ldk);   // dV += P^T dO
        sgemm('N', 'T', nq, kend, D, 1.f, dop, ldq, vp, ldk, 0.f, dp, kend);   // dP = dO V^T
        for (int64_t r = 0; r < nq; ++r) {                                     // dS = P (dP - delta)
          float *pr = p + r * kend, *dpr = dp + r * kend;
          const float dl = delta[q0 + r];
          for (int64_t c = 0; c < kend; ++c) dpr[c] = pr[c] * (dpr[c] - dl);
        }
        sgemm('N', 'N', nq, D, kend, scale, dp, kend, kp, ldk, 0.f, dqp, ldq);  // dQ = scale dS K
        sgemm('T', 'N', kend, D, nq, scale, dp, kend, qp, ldq, 1.f, dkp, ldk);  // dK += scale dS^T Q
      }
    }
  });
  return 0;
}
