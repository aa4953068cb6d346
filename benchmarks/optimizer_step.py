"""The optimizer's end of a train step on SmolLM2's 135M float32 parameters: the gradients' global
norm, the clip factor, and AdamW's update, as msllm's train step runs it (msllm/training/step.py):

  mindspore  per gradient a Mul and ReduceSum for the norm, a Mul by the clip factor, then
             MindSpore's fused AdamWeightDecay kernel (``nn.AdamWeightDecay``; msllm's AdamW without
             CPU kernels)
  msllm      per gradient msllm's sum-of-squares kernel, then ``AdamW.cpu_update``: one pass per
             parameter with the clip factor folded in (csrc/optim.cc)

Each is one compiled GRAPH_MODE cell over its own parameters and moments, fed the same gradients
(random normal, fixed seed); both in one process, alternating call by call (``--rounds`` rounds of
``--calls`` calls each, after one compiling call). Reported: median ms per call, and the memory
traffic of the msllm pass (read g twice, p, m, v; write p, m, v: 32 bytes per parameter) over its
time. Parameter shapes from SmolLM2's config.json (``tools/fetch_model.py`` builds the model directory).

    .venv/bin/python benchmarks/optimizer_step.py --rounds 3 --out benchmarks/results/optimizer_step_<machine>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

SEED = 20261128


def smollm2_shapes() -> list[tuple]:
    """The trainable parameters' shapes of SmolLM2-135M (tied embedding), from its config.json."""
    import json

    with open(os.path.join(common.hf_dir("smollm2"), "config.json")) as fh:
        c = json.load(fh)
    h, f, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    return [(c["vocab_size"], h)] + layer * c["num_hidden_layers"] + [(h,)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    common.use_repo()
    import numpy as np

    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops

    from msllm.kernels import cpu_kernels
    from msllm.training.adamw import AdamW

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    kern = cpu_kernels()
    # the optimizer's parameter order (its groups: matrices with weight decay, then the vectors),
    # which is the gradients' order in a train step
    shapes = sorted(smollm2_shapes(), key=lambda s: len(s) < 2)
    n = sum(int(np.prod(s)) for s in shapes)
    rng = np.random.default_rng(SEED)
    print(f"seed {SEED}; {len(shapes)} parameters, {n / 1e6:.1f}M elements", flush=True)
    grads = tuple(Tensor(rng.standard_normal(s).astype(np.float32) * 1e-3) for s in shapes)
    steps = 2 + a.rounds * a.calls

    def optimizer(tag, kernels):
        params = [Parameter(Tensor(rng.standard_normal(s).astype(np.float32) * 0.02), name=f"{tag}{i}")
                  for i, s in enumerate(shapes)]
        groups = [{"params": [q for q in params if q.ndim >= 2], "weight_decay": 0.1},
                  {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}]
        return AdamW(groups, learning_rate=Tensor(np.full(steps, 1e-4, np.float32)), beta1=0.9, beta2=0.95,
                     eps=1e-8, cpu_kernels=kernels)

    class MindSporeEnd(nn.Cell):
        def __init__(self):
            super().__init__()
            self.opt = optimizer("a", None)

        def construct(self, gs):
            sq = ops.stack([(g * g).sum(-1).sum() if g.ndim > 1 else (g * g).sum() for g in gs]).sum()
            norm = ops.sqrt(sq)
            coef = ops.minimum(1.0 / (norm + 1e-6), 1.0)
            return ops.depend(norm, self.opt(tuple([g * coef for g in gs])))

    class MsllmEnd(nn.Cell):
        def __init__(self):
            super().__init__()
            self.opt = optimizer("b", kern)
            self.sum_squares = kern.sum_squares

        def construct(self, gs):
            norm = ops.sqrt(ops.concat([self.sum_squares(g) for g in gs]).sum())
            coef = ops.minimum(1.0 / (norm + 1e-6), 1.0)
            return ops.depend(norm, self.opt.cpu_update(gs, Tensor(False), coef))

    cells = {"mindspore": MindSporeEnd(), "msllm": MsllmEnd()}
    for name, cell in cells.items():
        t = time.perf_counter()
        cell(grads).asnumpy()
        print(f"{name}: first call (compiles) {time.perf_counter() - t:.1f} s", flush=True)
    runs = {name: [] for name in cells}
    for r in range(a.rounds):
        per = {name: [] for name in cells}
        for c in range(a.calls):
            for name in (list(cells) if (r + c) % 2 == 0 else list(cells)[::-1]):
                t = time.perf_counter()
                cells[name](grads).asnumpy()
                per[name].append(time.perf_counter() - t)
        for name in cells:
            runs[name].append(1e3 * statistics.median(per[name]))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = [a_ / b_ for a_, b_ in zip(runs["mindspore"], runs["msllm"])]
    gbs = 32 * n / (med["msllm"] / 1e3) / 1e9
    print(f"median ms per call: mindspore {med['mindspore']:.1f}, msllm {med['msllm']:.1f}; mindspore / msllm "
          f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}); msllm moves {gbs:.1f} GB/s")
    if a.out:
        import harness

        harness.write_json(a.out, {"benchmark": "optimizer_step", "machine": common.machine(),
                                   "command": " ".join(sys.argv), "seed": SEED, "parameters": n,
                                   "ms_per_call_median": med, "ms_per_call_by_round": runs,
                                   "mindspore_over_msllm_by_round": ratio, "msllm_gb_per_s": gbs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
