"""A/B timing of msllm's training step: two versions of ``msllm/models/llama/model.py`` +
``msllm/training/step.py`` in ONE process, steps alternating A, B, A, B ..., so that the
machine's background load hits both alike (used to measure each optimisation).

Version A defaults to the committed files (``git show HEAD:...``, read-only), B to the working
tree (``WORKTREE``). Any version can be a directory holding ``model.py`` and ``step.py``.

    .venv/bin/python benchmarks/ab_step.py --shape tiny --steps 12 [--a DIR] [--b DIR]
        [--variant default|noscale] [--jit_level O0] [--context '{"runtime_num_threads": 2}']

Both start from the same weights and see the same batches; prints per-version median wall and
CPU seconds per step, tokens/s, the paired ratio, and the max |loss difference| between A and B.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness

common.use_repo()


def version_dir(spec: str | None, tmp: str, label: str) -> str:
    if spec == "WORKTREE":
        return os.path.join(common.ROOT, "msllm")
    if spec and spec != "HEAD":
        return spec
    if spec is None and label == "B":
        return os.path.join(common.ROOT, "msllm")  # working tree: model.py under models/llama
    d = os.path.join(tmp, label)
    os.makedirs(d)
    for src, name in (("msllm/models/llama/model.py", "model.py"), ("msllm/training/step.py", "step.py")):
        text = subprocess.run(["git", "-C", common.ROOT, "show", f"HEAD:{src}"], capture_output=True, text=True,
                              check=True).stdout
        with open(os.path.join(d, name), "w") as fh:
            fh.write(text)
    return d


def load_module(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # MindSpore's graph parser imports the module by name
    spec.loader.exec_module(mod)
    return mod


def files_of(d: str) -> tuple[str, str]:
    if os.path.exists(os.path.join(d, "model.py")):
        return os.path.join(d, "model.py"), os.path.join(d, "step.py")
    return os.path.join(d, "models", "llama", "model.py"), os.path.join(d, "training", "step.py")


def main(argv=None):
    p = harness.arg_parser(__doc__, "tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--a", default="HEAD")
    p.add_argument("--b", default=None)
    p.add_argument("--variant", default="default", choices=["default", "noscale"])
    p.add_argument("--jit_level", default="O0")
    p.add_argument("--context", default="{}", help="JSON for ms.set_context")
    p.add_argument("--b_context", default="{}", help="JSON for ms.set_context before building B only")
    p.add_argument("--a_kwargs", default="{}", help="JSON keyword arguments for A's LlamaForCausalLM")
    p.add_argument("--b_kwargs", default="{}", help="JSON keyword arguments for B's LlamaForCausalLM")
    a = p.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE, jit_config={"jit_level": a.jit_level}, **json.loads(a.context))
    s = common.shape(a.shape)
    cfg = common.msllm_model_config(s)
    common.prepare_data(s["seq_length"])
    init = np.load(common.prepare_weights(a.shape))
    data = common.batches(common.data_file(s["seq_length"]), s["batch_size"], a.warmup + a.steps)
    kw = {} if a.variant == "default" else {"loss_scale": "none", "max_grad_norm": None}

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"A": version_dir(a.a, tmp, "A"), "B": version_dir(a.b, tmp, "B")}
        steps = {}
        for label, d in dirs.items():
            if label == "B" and json.loads(a.b_context):
                ms.set_context(**json.loads(a.b_context))
            mfile, sfile = files_of(d)
            model = load_module(mfile, f"model_{label}")
            stepmod = load_module(sfile, f"step_{label}")
            net = model.LlamaForCausalLM(cfg, **json.loads(a.a_kwargs if label == "A" else a.b_kwargs))
            common.set_ms_weights(net.trainable_params(), init)
            opt = common.ms_adamw(net.trainable_params(), a.warmup + a.steps + 1)
            st = stepmod.TrainStep(net, opt, **kw)
            st.set_train()
            steps[label] = st
            print(f"{label}: {mfile}, {sfile}", flush=True)
        res = {k: {"wall": [], "cpu": [], "loss": [], "first": None} for k in steps}
        for i, (ids, lab) in enumerate(data):
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            for label in order:
                x, y = Tensor(ids), Tensor(lab)
                c0, t0 = time.process_time(), time.perf_counter()
                loss = float(steps[label](x, y)[0].asnumpy())
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                r = res[label]
                r["loss"].append(loss)
                if i == 0:
                    r["first"] = wall
                if i >= a.warmup:
                    r["wall"].append(wall)
                    r["cpu"].append(cpu)
            if i >= a.warmup:
                print(f"step {i}: A {res['A']['wall'][-1]:.3f} s (cpu {res['A']['cpu'][-1]:.3f})  "
                      f"B {res['B']['wall'][-1]:.3f} s (cpu {res['B']['cpu'][-1]:.3f})  load {common.loadavg()}",
                      flush=True)
    tokens = s["batch_size"] * s["seq_length"]
    for label, r in res.items():
        w, c = common.median(r["wall"]), common.median(r["cpu"])
        print(f"{label}: first {r['first']:.1f} s, median wall {w:.3f} s ({tokens / w:.0f} tok/s), "
              f"median cpu {c:.3f} s ({tokens / c:.0f} tok/cpu-s)")
    ratios = [x / y for x, y in zip(res["A"]["wall"], res["B"]["wall"])]
    cratios = [x / y for x, y in zip(res["A"]["cpu"], res["B"]["cpu"])]
    print(f"speed-up B over A: wall x{common.median(ratios):.3f} (paired median), cpu x{common.median(cratios):.3f}")
    print(f"max |loss A - loss B| over {len(res['A']['loss'])} steps: "
          f"{max(abs(x - y) for x, y in zip(res['A']['loss'], res['B']['loss'])):.2e}")
    print(f"peak RSS {common.peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
