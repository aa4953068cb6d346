"""Micro-benchmarks of the MindSpore CPU kernels that the step profile shows as expensive, each
against the alternatives tried (GRAPH_MODE, one compiled cell per variant, the variants timed
in alternation, median of ``--repeats``):

  gradnorm   sum of squares + finite check of the gradients (TrainStep) on the real parameter
             shapes of a benchmark model
  loss       next-token cross-entropy over the vocabulary (forward + backward) on (B*T, V) logits
  matmul     the output head (B*T, C) x (V, C)^T forward + both gradients
  head       output head + loss (forward + gradients), dense over all B*T positions vs only the
             positions with a target (msllm's compact_loss), on real Alpaca targets
  norm       msllm's RMSNorm cell (forward + gradients of input and weight) on (B, T, C), with
             the statistics on the 3-D input or on its 2-D (B*T, C) view
  softmax    the attention softmax (forward + gradient) on (B, H, T, T) vs its (B*H*T, T) view
  reduce     ReduceSum / ReduceMean patterns on 3-D and 2-D views of the same (B*T, C) values

    .venv/bin/python benchmarks/micro_ops.py --shape tiny [--which gradnorm,loss,matmul] [--repeats 7]
"""

from __future__ import annotations

import os
import time

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness


def main(argv=None):
    p = harness.arg_parser(__doc__, "tiny")
    p.add_argument("--which", default="gradnorm,loss,matmul,head,norm,softmax,reduce")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    s = common.shape(a.shape)
    n_tok = s["batch_size"] * s["seq_length"]
    rng = np.random.default_rng(0)
    print(f"shape {a.shape}, load {common.loadavg()}", flush=True)

    def bench(cases: dict, args):
        cells = {}
        for name, fn in cases.items():
            class C(nn.Cell):
                def __init__(self, f):
                    super().__init__()
                    self.f = f

                def construct(self, *xs):
                    return self.f(*xs)

            c = C(fn)
            t = time.perf_counter()
            out = c(*args)
            (out[0] if isinstance(out, (tuple, list)) else out).asnumpy()
            cells[name] = c
            print(f"  {name}: compiled+first {time.perf_counter() - t:.2f} s", flush=True)
        times = {k: [] for k in cells}
        for _ in range(a.repeats):
            for name, c in cells.items():
                t = time.perf_counter()
                out = c(*args)
                (out[0] if isinstance(out, (tuple, list)) else out).asnumpy()
                times[name].append(time.perf_counter() - t)
        for name, ts in times.items():
            print(f"  {name:40s} {1e3 * common.median(ts):8.1f} ms (min {1e3 * min(ts):.1f})", flush=True)
        return {k: common.median(v) for k, v in times.items()}

    if "gradnorm" in a.which:
        c, f, v, l_ = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_layers"]
        shapes = [(v, c), (v, c), (c,)] + l_ * [(c, c)] * 4 + l_ * [(f, c), (f, c), (c, f), (c,), (c,)]
        grads = tuple(Tensor(rng.standard_normal(sh, dtype=np.float32)) for sh in shapes)
        print(f"gradnorm over {len(grads)} tensors, {sum(int(np.prod(x)) for x in shapes) / 1e6:.1f}M values",
              flush=True)

        def current(*g):  # msllm TrainStep before optimisation
            finite = ops.stack([ops.isfinite(x).all() for x in g]).all()
            sq = ops.stack([ops.square(ops.cast(x, ms.float32)).sum() for x in g])
            return ops.sqrt(sq.sum()), finite

        def sumsq_only(*g):
            sq = ops.stack([ops.square(x).sum() for x in g])
            n = ops.sqrt(sq.sum())
            return n, ops.isfinite(n)

        def mul_reduce(*g):
            sq = ops.stack([ops.ReduceSum()(x * x) for x in g])
            n = ops.sqrt(sq.sum())
            return n, ops.isfinite(n)

        def flat_reduce(*g):
            sq = ops.stack([ops.ReduceSum()(ops.reshape(x * x, (-1,))) for x in g])
            n = ops.sqrt(sq.sum())
            return n, ops.isfinite(n)

        def last_axis_then_all(*g):
            sq = ops.stack([ops.ReduceSum()(ops.ReduceSum()(x * x, -1)) if x.ndim > 1 else ops.ReduceSum()(x * x)
                            for x in g])
            n = ops.sqrt(sq.sum())
            return n, ops.isfinite(n)

        def dot(*g):
            mm = ops.MatMul(transpose_b=True)
            sq = ops.stack([mm(ops.reshape(x, (1, -1)), ops.reshape(x, (1, -1))).reshape(()) for x in g])
            n = ops.sqrt(sq.sum())
            return n, ops.isfinite(n)

        def dot_rows(*g):
            # (1, C) x (N, C)^T per tensor is a GEMV; here: reshape to (k, 4096) and sum(x*x) by a
            # batched dot over rows
            sq = ops.stack([ops.ReduceSum()(ops.BatchMatMul(transpose_b=True)(
                ops.reshape(x, (-1, 1, x.shape[-1])), ops.reshape(x, (-1, 1, x.shape[-1]))))
                if x.ndim > 1 else ops.ReduceSum()(x * x) for x in g])
            n = ops.sqrt(sq.sum())
            return n, ops.isfinite(n)

        def norm_op(*g):
            sq = ops.stack([ops.norm(x) for x in g])
            n = ops.sqrt((sq * sq).sum())
            return n, ops.isfinite(n)

        bench({"current (isfinite.all + square.sum)": current, "square.sum only": sumsq_only,
               "ReduceSum(x*x)": mul_reduce, "ReduceSum(flat x*x)": flat_reduce,
               "ReduceSum(ReduceSum(x*x,-1))": last_axis_then_all, "MatMul dot": dot, "ops.norm": norm_op},
              grads)

    if "loss" in a.which:
        v = s["vocab_size"]
        logits = Tensor(rng.standard_normal((n_tok, v), dtype=np.float32))
        tgt = rng.integers(0, v, (n_tok,)).astype(np.int32)
        tgt[: n_tok // 3] = -100
        tgt = Tensor(tgt)
        print(f"loss over ({n_tok}, {v}) logits, forward + backward", flush=True)

        def grad_of(fn):
            g = ops.GradOperation()

            def run(z, y):
                return g(fn)(z, y)
            return run

        def current(z, y):  # log_softmax + GatherD (msllm CausalMLLoss before optimisation)
            y2 = ops.reshape(y, (-1, 1))
            mask = ops.cast(y2 != -100, ms.float32)
            nll = -ops.GatherD()(ops.LogSoftmax(-1)(z), 1, ops.maximum(y2, 0))
            return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)

        def lse(z, y):  # logsumexp - z[y]
            y2 = ops.reshape(y, (-1, 1))
            mask = ops.cast(y2 != -100, ms.float32)
            m = ops.stop_gradient(ops.ReduceMax(keep_dims=True)(z, -1))
            lse_ = ops.log(ops.ReduceSum(keep_dims=True)(ops.exp(z - m), -1)) + m
            nll = lse_ - ops.GatherD()(z, 1, ops.maximum(y2, 0))
            return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)

        def nll_loss(z, y):
            mask = ops.cast(y != -100, ms.float32)
            total = ops.nll_loss(ops.log_softmax(z, -1), y, ignore_index=-100, reduction="sum")
            return total / ops.maximum(mask.sum(), 1.0)

        def cross_entropy(z, y):
            mask = ops.cast(y != -100, ms.float32)
            total = ops.cross_entropy(z, y, ignore_index=-100, reduction="sum")
            return total / ops.maximum(mask.sum(), 1.0)

        def softmax_ce_dense(z, y):  # fused per-row loss + gradient, dense one-hot labels
            mask = ops.cast(y != -100, ms.float32)
            onehot = ops.one_hot(ops.maximum(y, 0), z.shape[-1], Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
            rows, _ = ops.SoftmaxCrossEntropyWithLogits()(z, onehot)
            return (rows * mask).sum() / ops.maximum(mask.sum(), 1.0)

        cases = {"current LogSoftmax+GatherD": grad_of(current), "logsumexp - gather": grad_of(lse),
                 "nll_loss(log_softmax)": grad_of(nll_loss), "ops.cross_entropy": grad_of(cross_entropy),
                 "SoftmaxCrossEntropyWithLogits (one-hot)": grad_of(softmax_ce_dense)}
        bench(cases, (logits, tgt))

    if "matmul" in a.which:
        c, v = s["hidden_size"], s["vocab_size"]
        h = Tensor(rng.standard_normal((n_tok, c), dtype=np.float32))
        w = Tensor(rng.standard_normal((v, c), dtype=np.float32) * 0.02)
        wt = Tensor(rng.standard_normal((c, v), dtype=np.float32) * 0.02)
        print(f"head matmul ({n_tok}, {c}) x ({v}, {c})^T, forward + grads of both inputs", flush=True)

        def g_all(fn):
            g = ops.GradOperation(get_all=True)

            def run(x, y):
                return g(fn)(x, y)
            return run

        def mm_tb(x, y):
            return ops.MatMul(transpose_b=True)(x, y).sum()

        def mm_plain(x, y):
            return ops.MatMul()(x, y).sum()

        def bmm_tb(x, y):
            return ops.BatchMatMul(transpose_b=True)(x.reshape(1, *x.shape), y.reshape(1, *y.shape)).sum()

        bench({"MatMul(transpose_b) W(V,C)": g_all(mm_tb), "BatchMatMul(transpose_b)": g_all(bmm_tb)}, (h, w))
        bench({"MatMul W^T stored (C,V)": g_all(mm_plain)}, (h, wt))

    b, t, c, nh = s["batch_size"], s["seq_length"], s["hidden_size"], s["num_heads"]
    if "head" in a.which:
        common.use_repo()
        from msllm.models.llama.config import LlamaConfig
        from msllm.models.llama.model import LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=c, num_layers=1, num_heads=nh, vocab_size=s["vocab_size"], seq_length=t,
                          intermediate_size=s["intermediate_size"])
        common.prepare_data(t)
        _, lab = common.batches(common.data_file(t), b, 1)[0]
        y = Tensor(lab[:, 1:].reshape(-1).astype(np.int32))
        h = Tensor(rng.standard_normal((b * t, c), dtype=np.float32))
        k = int((lab[:, 1:] != -100).sum())
        print(f"head + loss forward + gradients: {b * t} positions, {k} with a target", flush=True)

        class HeadLoss(nn.Cell):
            """The head/loss part of LlamaForCausalLM.construct, on given hidden states."""

            def __init__(self, net, compact):
                super().__init__()
                self.net, self.compact = net, compact

            def construct(self, hh, yy):
                n = self.net
                if not self.compact:
                    return n.loss(n.head(hh), yy)
                keep = n.reshape(ops.nonzero(yy != -100), (-1,))
                rows = n.concat_rows((keep, n.extra_row))
                tt = n.concat_rows((n.gather_rows(yy, keep, 0), n.extra_target))
                return n.loss(n.head(n.gather_rows(hh, rows, 0)), tt)

        class Grad(nn.Cell):
            def __init__(self, cell):
                super().__init__()
                self.cell = cell
                self.g = ops.GradOperation(get_all=True, get_by_list=True)
                self.w = ms.ParameterTuple([cell.net.lm_head.weight])

            def construct(self, hh, yy):
                return self.g(self.cell, self.w)(hh, yy)[1][0]

        net = LlamaForCausalLM(cfg)
        bench({"dense (all positions)": Grad(HeadLoss(net, False)),
               "compact (positions with a target)": Grad(HeadLoss(net, True))}, (h, y))

    if "norm" in a.which:
        common.use_repo()
        from msllm.models.llama.config import LlamaConfig
        from msllm.models.llama.model import RMSNorm

        cfg = LlamaConfig(hidden_size=c, num_layers=1, num_heads=nh, vocab_size=s["vocab_size"], seq_length=t)
        x = Tensor(rng.standard_normal((b, t, c), dtype=np.float32))
        print(f"RMSNorm forward + d/dx + d/dweight on ({b}, {t}, {c})", flush=True)
        class NormGrad(nn.Cell):
            def __init__(self, n):
                super().__init__()
                self.n = n
                self.g = ops.GradOperation(get_all=True, get_by_list=True)
                self.w = ms.ParameterTuple(n.trainable_params())

            def construct(self, xx):
                return self.g(self.n, self.w)(xx)[1][0]

        cases = {}
        for flat in (False, True):
            norm = RMSNorm(c, 1e-5, cfg)
            norm.flat = flat
            cases["2-D view (N, C)" if flat else "3-D (B, T, C)"] = NormGrad(norm)
        bench(cases, (x,))

    if "softmax" in a.which:
        sc = Tensor(rng.standard_normal((b, nh, t, t), dtype=np.float32))
        print(f"softmax forward + gradient on ({b}, {nh}, {t}, {t})", flush=True)

        def sm4_loss(z):
            return (ops.Softmax(-1)(z) * z).sum()

        def sm2_loss(z):
            return (ops.Softmax(-1)(z.reshape(-1, z.shape[-1])).reshape(z.shape) * z).sum()

        def sm4(z):
            return ops.GradOperation()(sm4_loss)(z)

        def sm2(z):
            return ops.GradOperation()(sm2_loss)(z)
        bench({"4-D": sm4, "2-D view": sm2}, (sc,))

    if "reduce" in a.which:
        x3 = Tensor(rng.standard_normal((b, t, c), dtype=np.float32))
        x2 = Tensor(rng.standard_normal((b * t, c), dtype=np.float32))
        print(f"reductions of ({b}, {t}, {c}) vs ({b * t}, {c})", flush=True)

        def r3_lead(x):
            return ops.ReduceSum()(x, (0, 1))

        def r2_lead(x):
            return ops.ReduceSum()(x, 0)

        def r3_last(x):
            return ops.ReduceMean(keep_dims=True)(x, -1)

        def r2_last(x):
            return ops.ReduceMean(keep_dims=True)(x, -1)
        bench({"ReduceSum over (B, T) of 3-D": r3_lead, "ReduceMean(-1) of 3-D": r3_last}, (x3,))
        bench({"ReduceSum over axis 0 of 2-D": r2_lead, "ReduceMean(-1) of 2-D": r2_last}, (x2,))


if __name__ == "__main__":
    main()
