// Causal self-attention without the (B, H, T, T) score tensor: FlashAttention-2's algorithm
// (Dao 2023, "FlashAttention-2", algorithms 1 and 2: per query block, scores -> softmax ->
// P V in on-chip memory; only the row log-sum-exp L = m + log(l) is saved for the backward pass,
// which recomputes P = exp(S - L)). On a CPU the "on-chip" block is a per-thread buffer of
// BQ x T floats (128 x 1024 x 4 B = 512 KiB, inside a core's 2 MiB L2), so the key dimension is
// not blocked: each query block sees all its keys at once and the online-softmax rescaling is
// not needed. The block products run on oneDNN's sgemm (gemm.h).
//
// Layout: q (B, T, H, D), k and v (B, T, K, D) (the projections' (B*T, heads*D) outputs viewed
// 4-D, no transposes), grouped-query attention with H / K query heads per key/value head
// (query head h uses key/value head h / (H / K)). Scale 1/sqrt(D), causal: query t sees keys
// 0..t; with a sliding window W (the (1,) float input ``window``, 0 = none) keys t-W+1..t, as
// transformers' sliding_window_overlay (Mistral): each query block then multiplies only the key
// range its rows can see, so the work per block is O(BQ (W + BQ)), not O(BQ T).
// Output o (B, T, H, D) and lse (B, H, T).
//
// Packed rows (several documents per row, msllm/data/packing.py): the (B, T) float input
// ``start`` gives each slot's document start, and query t sees keys max(start[t], t-W+1)..t only
// (block-diagonal causal attention, what FlashAttentionScore's actual_seq_qlen / actual_seq_kvlen
// do on Ascend). A query block's key range starts at its first row's document start, so keys of
// earlier documents are never multiplied: the work per block is O(BQ (document + BQ)), not O(BQ T).
#include "common.h"

#include <memory>

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

// Keys a query row sees: [first_key(t), t]; the block of rows q0..q0+nq-1 needs [first_key(q0), q0+nq).
inline int64_t first_key(int64_t t, int64_t window) { return window > 0 ? std::max<int64_t>(0, t - window + 1) : 0; }

int64_t read_window(const void *p) {
  const float w = *static_cast<const float *>(p);
  return w >= 1.f ? static_cast<int64_t>(w) : 0;
}

// The first key slot a query may see beyond causality and the window: left padding (one value per
// batch row, stride_t 0) or a packed row's document start (one value per slot, stride_t 1); 0 without.
struct KeyFloor {
  const float *p = nullptr;
  int64_t stride_b = 0, stride_t = 0, t = 0;
  int64_t at(int64_t b, int64_t slot) const {
    if (!p) return 0;
    return std::min<int64_t>(std::max<int64_t>(0, static_cast<int64_t>(p[b * stride_b + slot * stride_t])), t);
  }
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

namespace {
// The forward pass; ``floor`` (KeyFloor): keys before floor.at(b, t) are hidden from query t
// (left padding: query rows before the row's start see no key at all, output 0, lse -inf; packed
// rows: keys of earlier documents). ``lse`` may be null (inference).
void flash_forward(const Dims &dm, const float *q, const float *k, const float *v, int64_t W, const KeyFloor &floor,
                   float *o, float *lse) {
  const int64_t T = dm.t, D = dm.d, BQ = block_rows(T), nqb = (T + BQ - 1) / BQ;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t nbh = dm.b * dm.h;
  // task i: the longest (last) query blocks first, so that dynamic hand-out balances the load
  Pool::get().run(static_cast<int>(nbh * nqb), [&](int i) {
    const int64_t qb = nqb - 1 - i / nbh, bh = i % nbh, b = bh / dm.h, h = bh % dm.h, g = h / dm.rep;
    const int64_t q0 = qb * BQ, nq = std::min(BQ, T - q0), kend = q0 + nq;
    // the block's first key: its first row's floor (floors never decrease along a row)
    const int64_t k0 = std::max(first_key(q0, W), std::min(floor.at(b, q0), kend - 1));
    const int64_t nk = kend - k0;  // keys k0..kend-1
    const float *qp = q + (b * T + q0) * dm.ldq() + h * D;
    const float *kp = k + (b * T + k0) * dm.ldk() + g * D;
    const float *vp = v + (b * T + k0) * dm.ldk() + g * D;
    float *s = scratch(0, BQ * T);
    sgemm('N', 'T', nq, nk, D, scale, qp, dm.ldq(), kp, dm.ldk(), 0.f, s, nk);  // S (nq, nk)
    float inv_l[kMaxBlock];
    for (int64_t r = 0; r < nq; ++r) {
      float *row = s + r * nk;
      const int64_t lo = std::max(first_key(q0 + r, W), floor.at(b, q0 + r)) - k0, valid = q0 + r + 1 - k0;
      if (lo >= valid) {  // a padding row: nothing visible
        std::memset(row, 0, sizeof(float) * nk);
        if (lse) lse[bh * T + q0 + r] = -INFINITY;
        inv_l[r] = 0.f;
        continue;
      }
      const float m = row_max(row + lo, valid - lo);
      const float l = exp_shift_sum(row + lo, row + lo, valid - lo, 1.f, m);
      std::memset(row, 0, sizeof(float) * lo);
      std::memset(row + valid, 0, sizeof(float) * (nk - valid));
      if (lse) lse[bh * T + q0 + r] = m + std::log(l);
      inv_l[r] = 1.f / l;
    }
    float *op = o + (b * T + q0) * dm.ldq() + h * D;
    sgemm('N', 'N', nq, D, nk, 1.f, s, nk, vp, dm.ldk(), 0.f, op, dm.ldq());  // O = P V (nq, D)
    for (int64_t r = 0; r < nq; ++r)
      for (int64_t c = 0; c < D; ++c) op[r * dm.ldq() + c] *= inv_l[r];
  });
}
}  // namespace

// q (B,T,H,D), k (B,T,K,D), v (B,T,K,D), window (1) -> o (B,T,H,D), lse (B,H,T)
MSLLM_AOT(msllm_flash_attention) {
  if (nparam != 6 || !all_f32(nparam, dtypes)) return 1;
  Dims dm;
  if (!read_dims(ndims, shapes, &dm)) return 2;
  flash_forward(dm, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                static_cast<const float *>(params[2]), read_window(params[3]), KeyFloor{}, static_cast<float *>(params[4]),
                static_cast<float *>(params[5]));
  return 0;
}

// Packed rows: q (B,T,H,D), k, v (B,T,K,D), window (1), start (B,T) float32 = each slot's document
// start -> o (B,T,H,D), lse (B,H,T); query t sees keys max(start[t], t - W + 1) .. t.
MSLLM_AOT(msllm_flash_attention_docs) {
  if (nparam != 7 || !all_f32(nparam, dtypes)) return 1;
  Dims dm;
  if (!read_dims(ndims, shapes, &dm)) return 2;
  if (ndims[4] != 2 || shapes[4][0] != dm.b || shapes[4][1] != dm.t) return 2;
  const KeyFloor floor{static_cast<const float *>(params[4]), dm.t, 1, dm.t};
  flash_forward(dm, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                static_cast<const float *>(params[2]), read_window(params[3]), floor, static_cast<float *>(params[5]),
                static_cast<float *>(params[6]));
  return 0;
}

// Left-padded rows (a batched prefill; inference only, no gradient): q (B,T,H,D), k, v (B,T,K,D),
// window (1), start (B,) float32 = each row's first real slot -> o (B,T,H,D); row b's query t
// sees keys max(start[b], t - W + 1) .. t, and rows before start[b] give 0.
MSLLM_AOT(msllm_flash_attention_padded) {
  if (nparam != 6 || !all_f32(nparam, dtypes)) return 1;
  Dims dm;
  if (!read_dims(ndims, shapes, &dm)) return 2;
  if (ndims[4] != 1 || shapes[4][0] != dm.b) return 2;
  const KeyFloor floor{static_cast<const float *>(params[4]), 1, 0, dm.t};
  flash_forward(dm, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                static_cast<const float *>(params[2]), read_window(params[3]), floor,
                static_cast<float *>(params[5]), nullptr);
  return 0;
}

namespace {
// The backward pass (FlashAttention-2, algorithm 2) over the key ranges the forward used.
// Tasks: (batch row, key/value head, chunk of query blocks). A task writes dq of its own query rows
// and sums its dk / dv contributions into a private buffer over the keys its blocks see; a second
// pass adds the chunks' buffers into dk / dv in chunk order (deterministic). Chunks exist because
// (batch row, key/value head) alone is too few tasks at batch 1 with few key/value heads (SmolLM2: 3
// tasks on 2 threads, one thread idle a third of the time).
void flash_backward(const Dims &dm, const float *dout, const float *q, const float *k, const float *v, int64_t W,
                    const KeyFloor &floor, const float *o, const float *lse, float *dq, float *dk, float *dv) {
  const int64_t T = dm.t, D = dm.d, BQ = block_rows(T), nqb = (T + BQ - 1) / BQ, ldq = dm.ldq(), ldk = dm.ldk();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t heads = dm.b * dm.k, threads = Pool::get().size();
  int64_t chunks = std::min<int64_t>(nqb, std::max<int64_t>(1, (4 * threads + heads - 1) / heads));
  int64_t per = (nqb + chunks - 1) / chunks;   // query blocks per chunk
  // task i = (b, g, c) sums dk / dv into a private (rows[i], D) buffer each, at offset off[i], for
  // key rows lo[i] .. lo[i] + rows[i] - 1: from its first block's first visible key (the floors never
  // decrease along a row) to its last block's end. Chunked only while these stay small (64 MiB),
  // else one chunk writing dk / dv directly.
  std::vector<int64_t> lo(static_cast<size_t>(heads * chunks), 0), rows(lo.size(), 0), off(lo.size() + 1, 0);
  for (int64_t i = 0; i < heads * chunks; ++i) {
    const int64_t b = (i / chunks) / dm.k, c = i % chunks, q0 = c * per * BQ;
    if (q0 < T) {   // an empty last chunk keeps 0 rows
      lo[i] = std::max(first_key(q0, W), floor.at(b, q0));
      rows[i] = std::min(T, (c + 1) * per * BQ) - lo[i];
    }
    off[i + 1] = off[i] + 2 * rows[i] * D;
  }
  if (chunks > 1 && off.back() * int64_t(sizeof(float)) > (int64_t(64) << 20)) {
    chunks = 1;
    per = nqb;
  }
  std::unique_ptr<float[]> acc(chunks > 1 ? new float[static_cast<size_t>(off.back())] : nullptr);
  Pool::get().run(static_cast<int>(heads * chunks), [&](int i) {
    const int64_t c = i % chunks, b = (i / chunks) / dm.k, g = (i / chunks) % dm.k;
    const int64_t qb0 = c * per, qb1 = std::min(nqb, qb0 + per);
    if (qb0 >= qb1) return;
    // where this task's dk / dv rows go: key row t at dkb + (t - first_row) * ld
    int64_t first_row = 0, ld = ldk;
    float *dkb, *dvb;
    if (chunks > 1) {
      first_row = lo[i];
      ld = D;
      dkb = acc.get() + off[i];
      dvb = dkb + rows[i] * D;
      std::memset(dkb, 0, sizeof(float) * 2 * rows[i] * D);
    } else {
      dkb = dk + b * T * ldk + g * D;
      dvb = dv + b * T * ldk + g * D;
      for (int64_t t = 0; t < T; ++t) {
        std::memset(dkb + t * ldk, 0, sizeof(float) * D);
        std::memset(dvb + t * ldk, 0, sizeof(float) * D);
      }
    }
    const float *kb = k + b * T * ldk + g * D, *vb = v + b * T * ldk + g * D;
    float *p = scratch(0, BQ * T), *dp = scratch(1, BQ * T), *delta = scratch(2, T);
    for (int64_t h = g * dm.rep; h < (g + 1) * dm.rep; ++h) {
      const float *lrow = lse + (b * dm.h + h) * T;
      const int64_t t0 = qb0 * BQ, t1 = std::min(T, qb1 * BQ);
      for (int64_t t = t0; t < t1; ++t)  // delta_t = dO_t . O_t  (FlashAttention-2, alg. 2 line 4)
        delta[t] = dot(dout + (b * T + t) * ldq + h * D, o + (b * T + t) * ldq + h * D, D);
      for (int64_t qb = qb0; qb < qb1; ++qb) {
        const int64_t q0 = qb * BQ, nq = std::min(BQ, T - q0);
        const int64_t k0 = std::max(first_key(q0, W), floor.at(b, q0)), nk = q0 + nq - k0;
        const float *qp = q + (b * T + q0) * ldq + h * D, *dop = dout + (b * T + q0) * ldq + h * D;
        const float *kp = kb + k0 * ldk, *vp = vb + k0 * ldk;  // keys k0..q0+nq-1
        float *dkp = dkb + (k0 - first_row) * ld, *dvp = dvb + (k0 - first_row) * ld;
        float *dqp = dq + (b * T + q0) * ldq + h * D;
        sgemm('N', 'T', nq, nk, D, scale, qp, ldq, kp, ldk, 0.f, p, nk);  // S
        for (int64_t r = 0; r < nq; ++r) {                                 // P = exp(S - L), causal (band)
          const int64_t first = std::max(first_key(q0 + r, W), floor.at(b, q0 + r)) - k0, valid = q0 + r + 1 - k0;
          float *pr = p + r * nk;
          exp_shift_sum(pr + first, pr + first, valid - first, 1.f, lrow[q0 + r]);
          std::memset(pr, 0, sizeof(float) * first);
          std::memset(pr + valid, 0, sizeof(float) * (nk - valid));
        }
        sgemm('T', 'N', nk, D, nq, 1.f, p, nk, dop, ldq, 1.f, dvp, ld);    // dV += P^T dO
        sgemm('N', 'T', nq, nk, D, 1.f, dop, ldq, vp, ldk, 0.f, dp, nk);   // dP = dO V^T
        for (int64_t r = 0; r < nq; ++r) {                                 // dS = P (dP - delta)
          float *pr = p + r * nk, *dpr = dp + r * nk;
          const float dl = delta[q0 + r];
          for (int64_t j = 0; j < nk; ++j) dpr[j] = pr[j] * (dpr[j] - dl);
        }
        sgemm('N', 'N', nq, D, nk, scale, dp, nk, kp, ldk, 0.f, dqp, ldq);  // dQ = scale dS K
        sgemm('T', 'N', nk, D, nq, scale, dp, nk, qp, ldq, 1.f, dkp, ld);   // dK += scale dS^T Q
      }
    }
  });
  if (chunks == 1) return;
  // dk, dv = the chunks' sums, in chunk order, over the rows each chunk covers (others 0)
  parallel_rows(heads * T, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bg = r / T, t = r % T, b = bg / dm.k, g = bg % dm.k;
      float *dkr = dk + (b * T + t) * ldk + g * D, *dvr = dv + (b * T + t) * ldk + g * D;
      std::memset(dkr, 0, sizeof(float) * D);
      std::memset(dvr, 0, sizeof(float) * D);
      for (int64_t i = bg * chunks; i < (bg + 1) * chunks; ++i) {
        if (t < lo[i] || t >= lo[i] + rows[i]) continue;
        const float *src = acc.get() + off[i] + (t - lo[i]) * D;
        for (int64_t j = 0; j < D; ++j) dkr[j] += src[j];
        for (int64_t j = 0; j < D; ++j) dvr[j] += src[rows[i] * D + j];
      }
    }
  });
}
}  // namespace

// do (B,T,H,D), q, k, v, window (1), o, lse (B,H,T) -> dq (B,T,H,D), dk (B,T,K,D), dv (B,T,K,D).
MSLLM_AOT(msllm_flash_attention_grad) {
  if (nparam != 10 || !all_f32(nparam, dtypes)) return 1;
  Dims dm;
  if (!read_dims(ndims + 1, shapes + 1, &dm)) return 2;
  flash_backward(dm, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                 static_cast<const float *>(params[2]), static_cast<const float *>(params[3]), read_window(params[4]),
                 KeyFloor{}, static_cast<const float *>(params[5]), static_cast<const float *>(params[6]),
                 static_cast<float *>(params[7]), static_cast<float *>(params[8]), static_cast<float *>(params[9]));
  return 0;
}

// Packed rows: do, q, k, v, window (1), start (B,T), o, lse -> dq, dk, dv (as above, keys of each
// slot's own document only).
MSLLM_AOT(msllm_flash_attention_docs_grad) {
  if (nparam != 11 || !all_f32(nparam, dtypes)) return 1;
  Dims dm;
  if (!read_dims(ndims + 1, shapes + 1, &dm)) return 2;
  if (ndims[5] != 2 || shapes[5][0] != dm.b || shapes[5][1] != dm.t) return 2;
  const KeyFloor floor{static_cast<const float *>(params[5]), dm.t, 1, dm.t};
  flash_backward(dm, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                 static_cast<const float *>(params[2]), static_cast<const float *>(params[3]), read_window(params[4]),
                 floor, static_cast<const float *>(params[6]), static_cast<const float *>(params[7]),
                 static_cast<float *>(params[8]), static_cast<float *>(params[9]), static_cast<float *>(params[10]));
  return 0;
}
