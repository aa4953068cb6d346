"""Effect of ``recompute_config`` on training memory and speed in data_parallel mode on CPU.

Variants: none, full (``recompute: True``: whole decoder layers) and selective
(``select_recompute: True``: attention core + SwiGLU element-wise ops). Each variant runs in its
own process (peak RSS = ``ru_maxrss`` of that process), same weights seed and batches, GRAPH_MODE,
the trainer's own model/optimizer/train-step builders; variants alternate over ``--rounds``.

    .venv/bin/python benchmarks/recompute_effect.py --shape medium --steps 6 --rounds 2

Writes ``benchmarks/results/recompute_effect_{shape}.json`` (every run, plus the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from msllm.fileio import write_json_atomic  # noqa: E402

SHAPES = {  # benchmarks/common.py shapes (hidden, layers, heads, ffn, seq, batch)
    "tiny": (256, 4, 4, 688, 256, 8),
    "medium": (512, 8, 8, 1376, 512, 4),
}
VARIANTS = {"none": [], "full": ["--recompute_config.recompute=True"],
            "selective": ["--recompute_config.select_recompute=True"]}


def worker(shape: str, variant: str, steps: int) -> dict:
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor

    from msllm.config import load_config
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.parallel.apply import apply_recompute
    from msllm.training.step import TrainStep
    from msllm.training.setup import build_optimizer

    c, layers, heads, ffn, seq, batch = SHAPES[shape]
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"), [
        "--parallel_config.data_parallel=1", f"--model.model_config.hidden_size={c}",
        f"--model.model_config.num_layers={layers}", f"--model.model_config.num_heads={heads}",
        "--model.model_config.n_kv_heads=null", f"--model.model_config.intermediate_size={ffn}",
        f"--model.model_config.seq_length={seq}", *VARIANTS[variant]])
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    net = LlamaForCausalLM(cfg.model_config, fast_paths=cfg.fast_paths)
    apply_recompute(net, cfg.recompute_config)
    opt = build_optimizer(net, cfg, np.full(steps, 1e-4, np.float32))
    step = TrainStep(net, opt, loss_scale="none", max_grad_norm=1.0)
    step.set_train()
    rng = np.random.default_rng(0)
    times, losses = [], []
    for _ in range(steps):
        ids = Tensor(rng.integers(3, 32000, (batch, seq + 1)).astype(np.int32))
        t0 = time.perf_counter()
        losses.append(float(step(ids, ids)[0].asnumpy()))
        times.append(time.perf_counter() - t0)
    timed = times[1:]
    return {"shape": shape, "variant": variant, "steps": steps, "losses": losses,
            "first_step_s": times[0], "mean_step_s": sum(timed) / len(timed),
            "tokens_per_s": batch * seq / (sum(timed) / len(timed)),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="medium", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", choices=sorted(VARIANTS))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.shape, args.worker, args.steps)))
        return
    runs = []
    env = dict(os.environ, GLOG_v="3")
    for r in range(args.rounds):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--steps", str(args.steps),
                                  "--worker", variant], capture_output=True, text=True, env=env, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            run["round"] = r
            runs.append(run)
            print(f"round {r} {variant:9s}: {run['tokens_per_s']:8.1f} tokens/s, "
                  f"peak RSS {run['peak_rss_mib']:7.0f} MiB, first loss {run['losses'][0]:.5f}")
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "load_avg_at_end": os.getloadavg()},
              "command": " ".join(sys.argv), "runs": runs}
    path = os.path.join(HERE, "results", f"recompute_effect_{args.shape}.json")
    write_json_atomic(path, result, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
