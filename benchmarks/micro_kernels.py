"""msllm's CPU kernels (msllm/kernels) against the MindSpore operators they replace, on the
benchmark shapes' own tensors: each case forward + backward in one compiled cell (GRAPH_MODE),
the variants timed in alternation (so background load hits both alike), best and median of
``--repeats``. FLOP rates count the useful work (2 m n k per GEMM; causal attention counts the
lower triangle only).

  linear     every projection shape of the model plus the output head: x W^T with dx and dW
             (MindSpore MatMul(transpose_b) vs msllm linear on oneDNN sgemm)
  attention  causal attention on (B, T, H, D): MindSpore's composed path (BatchMatMul, mask add,
             softmax, BatchMatMul, with the 2-D softmax view) vs msllm flash attention
  norm       RMSNorm with the residual add before it: composed (flat 2-D view) vs fused
  swiglu     silu(g) * u: Sigmoid + Mul + Mul vs fused
  rope       rotary embedding of q: composed (slices, Neg, Concat, Mul, Mul, Add) vs fused

    .venv/bin/python benchmarks/micro_kernels.py --shape medium [--which linear,attention] [--repeats 7]

Also ``--gemm_only``: the raw GEMM rates of oneDNN (through msllm's kernel, 1 and 2 threads),
MindSpore MatMul and torch on the same shapes (no graph, no gradients).
"""

from __future__ import annotations

import os
import time

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness

common.use_repo()


def main(argv=None):
    p = harness.arg_parser(__doc__, "medium")
    p.add_argument("--which", default="linear,attention,norm,swiglu,rope")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from msllm.kernels import cpu_kernels

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    K = cpu_kernels()  # noqa: N806
    s = common.shape(a.shape)
    b, t, c, h, f, v = (s["batch_size"], s["seq_length"], s["hidden_size"], s["num_heads"],
                        s["intermediate_size"], s["vocab_size"])
    d = c // h
    n = b * t
    rng = np.random.default_rng(0)
    results = {"shape": a.shape, "load_start": common.loadavg(), "cases": {}}
    print(f"shape {a.shape}: {s}; load {common.loadavg()}", flush=True)

    def rand(*shape, scale=1.0):
        return Tensor((rng.standard_normal(shape) * scale).astype(np.float32))

    class Grad(nn.Cell):
        """sum(f(*xs) * dy) -> gradients of all inputs (forward + backward in one graph)."""

        def __init__(self, fn):
            super().__init__()
            self.fn = fn
            self.g = ops.GradOperation(get_all=True, sens_param=True)

        def construct(self, *xs):
            return self.g(self.fn)(*xs)

    def bench(name, variants: dict, args, flops):
        cells = {k: Grad(fn) for k, fn in variants.items()}
        outs = {}
        for k, cell in cells.items():
            outs[k] = [o.asnumpy() for o in cell(*args)]
        ref = outs[next(iter(outs))]
        diffs = {k: max(float(np.abs(x - y).max() / (np.abs(y).max() + 1e-30)) for x, y in zip(o, ref))
                 for k, o in outs.items()}
        times = {k: [] for k in cells}
        for _ in range(a.repeats):
            for k, cell in cells.items():
                t0 = time.perf_counter()
                out = cell(*args)
                out[0].asnumpy()
                times[k].append(time.perf_counter() - t0)
        row = {}
        for k, ts in times.items():
            best, med = min(ts), common.median(ts)
            row[k] = {"best_ms": best * 1e3, "median_ms": med * 1e3, "gflops_best": flops / best / 1e9,
                      "max_rel_diff_vs_first": diffs[k]}
        first = next(iter(row))
        for k in row:
            row[k]["speedup_best"] = row[first]["best_ms"] / row[k]["best_ms"]
        results["cases"][name] = row
        text = "  ".join(f"{k} {r['best_ms']:.1f} ms ({r['gflops_best']:.0f} GF/s, x{r['speedup_best']:.2f}, "
                         f"diff {r['max_rel_diff_vs_first']:.1e})" for k, r in row.items())
        print(f"{name:34s} {text}   load {common.loadavg()}", flush=True)

    if "linear" in a.which:
        mm = ops.MatMul(transpose_b=True)

        def ms_linear(x, w):
            return mm(x, w)

        def msllm_linear(x, w):
            return K.linear(x, w)
        # (name, rows, in, out) of every matmul in one layer, and the head over ~45% of the positions
        shapes = [("q/k/v/o proj", n, c, c), ("gate/up proj", n, c, f), ("down proj", n, f, c),
                  ("head (45% of positions)", int(0.45 * n), c, v)]
        for name, m, i, o in shapes:
            x, w, dy = rand(m, i), rand(o, i, scale=0.02), rand(m, o)
            bench(f"linear {name} {m}x{i}->{o}", {"mindspore": ms_linear, "msllm": msllm_linear},
                  (x, w, dy), 3 * 2.0 * m * i * o)

    if "attention" in a.which:
        mask = Tensor(np.triu(np.full((t, t), -1e9, np.float32), 1))
        scale = 1.0 / np.sqrt(d)

        def composed(q, k, v):  # msllm's composed CPU path: (B, T, H, D) in, (B, T, H, D) out
            qq = ops.transpose(q, (0, 2, 1, 3)) * scale
            kk = ops.transpose(k, (0, 2, 1, 3))
            vv = ops.transpose(v, (0, 2, 1, 3))
            sc = ops.BatchMatMul(transpose_b=True)(qq, kk) + mask
            pr = ops.reshape(ops.softmax(ops.reshape(sc, (-1, t)), -1), (b, h, t, t))
            return ops.transpose(ops.BatchMatMul()(pr, vv), (0, 2, 1, 3))

        def flash(q, k, v):
            return K.flash_attention(q, k, v, K.window_tensor(None))[0]

        q, k_, v_, dy = rand(b, t, h, d), rand(b, t, h, d), rand(b, t, h, d), rand(b, t, h, d)
        # causal useful work: QK^T and PV forward, 4 matmuls backward, each over the lower triangle
        flops = 6 * 2.0 * b * h * d * t * (t + 1) / 2
        bench(f"attention B{b} T{t} H{h} D{d}", {"mindspore": composed, "msllm": flash}, (q, k_, v_, dy), flops)

    if "norm" in a.which:
        eps = K.eps_tensor(1e-5)

        def add_norm_composed(x, r, w):
            hh = x + r
            h2 = ops.reshape(hh, (-1, c))
            y = h2 * ops.rsqrt(ops.mean(h2 * h2, -1, keep_dims=True) + 1e-5) * w
            return hh + ops.reshape(y, (b, t, c))

        def add_norm_fused(x, r, w):
            hh, y, _ = K.add_rms_norm(x, r, w, eps)
            return hh + y

        x, r, w, dy = rand(b, t, c), rand(b, t, c), rand(c), rand(b, t, c)
        bench(f"residual add + RMSNorm {b}x{t}x{c}", {"mindspore": add_norm_composed, "msllm": add_norm_fused},
              (x, r, w, dy), 0.0)

    if "swiglu" in a.which:
        def swiglu_composed(g, u):
            return g * ops.sigmoid(g) * u

        def swiglu_fused(g, u):
            return K.swiglu(g, u)

        g, u, dy = rand(n, f), rand(n, f), rand(n, f)
        bench(f"SwiGLU {n}x{f}", {"mindspore": swiglu_composed, "msllm": swiglu_fused}, (g, u, dy), 0.0)

    if "rope" in a.which:
        ang = rng.standard_normal((t, d // 2)).astype(np.float32)
        ang = np.concatenate([ang, ang], -1)
        cs, sn = Tensor(np.cos(ang)), Tensor(np.sin(ang))

        def rope_composed(x):  # (B, T, H, D) -> the model's composed rotary on (B, H, T, D)
            xx = ops.transpose(x, (0, 2, 1, 3))
            rot = ops.concat((-xx[..., d // 2:], xx[..., :d // 2]), -1)
            return ops.transpose(xx * cs + rot * sn, (0, 2, 1, 3))

        def rope_fused(x):
            return K.rope(x, cs, sn)

        x, dy = rand(b, t, h, d), rand(b, t, h, d)
        bench(f"rotary {b}x{t}x{h}x{d}", {"mindspore": rope_composed, "msllm": rope_fused}, (x, dy), 0.0)

    results["load_end"] = common.loadavg()
    if a.json:
        harness.write_json(a.json, results)


if __name__ == "__main__":
    main()
