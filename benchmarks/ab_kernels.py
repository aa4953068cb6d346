"""A/B timing of msllm's kernel choices: two models from the working tree in ONE process, built
with different ``model_config`` settings (``cpu_kernels``, ``use_flash_attention``,
``fused_rms_norm``, ``compact_loss`` ...), their training steps alternating A, B, B, A, ... from
the same weights on the same batches, so the machine's background load hits both alike. Used
to decide which kernel to keep (docs/kernels.md).

    .venv/bin/python benchmarks/ab_kernels.py --shape medium --a '{"cpu_kernels": false}' --b '{}'
    .venv/bin/python benchmarks/ab_kernels.py --shape medium --a '{"use_flash_attention": false}' --b '{}'
    .venv/bin/python benchmarks/ab_kernels.py --shape tiny --threads 1     # one core: CPU time = work

``--a`` / ``--b``: JSON of model_config attributes (set on a LlamaConfig, also fields it does not
declare yet) plus the optional builder argument ``compact_loss``. Prints per-variant median wall
and CPU seconds per step, the paired ratios and the max |loss A - loss B|.
"""

from __future__ import annotations

import json
import os
import time

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness

common.use_repo()


def main(argv=None):
    p = harness.arg_parser(__doc__, "tiny")
    p.add_argument("--a", default='{"cpu_kernels": false}')
    p.add_argument("--b", default="{}")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="1: MindSpore and msllm kernels on one thread")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    if a.threads:
        os.environ["MSLLM_KERNEL_THREADS"] = str(a.threads)
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor

    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.step import TrainStep

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE, **({"runtime_num_threads": a.threads} if a.threads else {}))
    s = common.shape(a.shape)
    common.prepare_data(s["seq_length"])
    init = np.load(common.prepare_weights(a.shape))
    data = common.batches(common.data_file(s["seq_length"]), s["batch_size"], a.warmup + a.steps)
    steps, described = {}, {}
    for label, spec in (("A", json.loads(a.a)), ("B", json.loads(a.b))):
        cfg = common.msllm_model_config(s)
        compact = spec.pop("compact_loss", None)
        for key, value in spec.items():
            setattr(cfg, key, value)
        net = LlamaForCausalLM(cfg, compact_loss=compact, fast_paths=True)
        common.set_ms_weights(net.trainable_params(), init)
        opt = common.ms_adamw(net.trainable_params(), a.warmup + a.steps + 1)
        st = TrainStep(net, opt, loss_scale="none", max_grad_norm=None)
        st.set_train()
        steps[label] = st
        described[label] = f"{spec} compact_loss={net.compact_loss}: {net.kernels.describe()}"
        print(f"{label}: {described[label]}", flush=True)
    res = {k: {"wall": [], "cpu": [], "loss": []} for k in steps}
    for i, (ids, lab) in enumerate(data):
        for label in (("A", "B") if i % 2 == 0 else ("B", "A")):
            x, y = Tensor(ids), Tensor(lab)
            c0, t0 = time.process_time(), time.perf_counter()
            loss = float(steps[label](x, y)[0].asnumpy())
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            res[label]["loss"].append(loss)
            if i >= a.warmup:
                res[label]["wall"].append(wall)
                res[label]["cpu"].append(cpu)
        if i >= a.warmup:
            print(f"step {i}: A {res['A']['wall'][-1]:.3f} s (cpu {res['A']['cpu'][-1]:.3f})  B "
                  f"{res['B']['wall'][-1]:.3f} s (cpu {res['B']['cpu'][-1]:.3f})  load {common.loadavg()}", flush=True)
    tokens = s["batch_size"] * s["seq_length"]
    out = {"shape": a.shape, "threads": a.threads, "variants": described, "results": res}
    for label, r in res.items():
        w, c = common.median(r["wall"]), common.median(r["cpu"])
        print(f"{label}: median wall {w:.3f} s ({tokens / w:.0f} tok/s), median cpu {c:.3f} s, min cpu "
              f"{min(r['cpu']):.3f} s")
    ratio = common.median([x / y for x, y in zip(res["A"]["wall"], res["B"]["wall"])])
    cratio = common.median([x / y for x, y in zip(res["A"]["cpu"], res["B"]["cpu"])])
    diff = max(abs(x - y) for x, y in zip(res["A"]["loss"], res["B"]["loss"]))
    print(f"B over A: wall x{ratio:.3f} (paired median), cpu x{cratio:.3f}; max |loss A - loss B| {diff:.2e}")
    out.update(wall_ratio=ratio, cpu_ratio=cratio, max_loss_diff=diff)
    if a.json:
        harness.write_json(a.json, out)


if __name__ == "__main__":
    main()
