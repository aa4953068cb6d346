"""Test worker: one data-parallel training step of every LLaMA-family case, in one process group.

Started by ``scripts/run_distribute.sh`` (``MSLLM_ENTRY`` pointing here, 2 ranks) or alone (one
process on the whole batch), with the launcher's ``--config C --run_mode M`` plus:

* ``--cases DIR``: one Hugging Face directory per case (``DIR/<case>/``, written by the test) and
  ``DIR/batch.npy``, the whole batch (B, T + 1) int32; rank r of W takes rows ``r*B/W ..``.
* ``--result_dir DIR``: each rank writes ``DIR/<case>_rank<r>.npz``: ``loss`` (the step's loss on
  its rows), ``stats`` (a mixture of experts' router stats, else empty) and ``delta/<param>``
  (the parameter after the step minus before).

The network, train step and optimizer come from msllm's own builders
(:func:`msllm.training.setup.build_network`, ``build_optimizer``, ``build_train_step``: the
gradient all-reduce and, for experts, the global-batch router counts), on the weights of the HF
directory as a ``load_checkpoint`` of ``run_msllm.py`` would load them.
"""

import argparse
import os
import sys

import numpy as np


def one_step(config: str, case_dir: str, batch: np.ndarray, rt) -> dict:
    """Build case ``case_dir``'s training network on this rank, run one step on ``batch`` (this
    rank's rows), return {"loss", "stats", "delta/<name>"} as numpy."""
    from mindspore import Tensor

    from msllm.config import load_config
    from msllm.convert.starting import load_base_into
    from msllm.training.setup import build_network, build_optimizer, build_train_step
    from msllm.training.sources import adopt_hf_model_config

    t = batch.shape[1] - 1
    cfg = load_config(config, [f"--load_checkpoint={case_dir}", "--run_mode=finetune",
                               f"--parallel_config.data_parallel={rt.world_size}",
                               f"--model.model_config.seq_length={t}", "--runner_wrapper.loss_scale=none",
                               "--runner_wrapper.use_clip_grad=False", "--optimizer.weight_decay=0.0",
                               # eps 1: the update m / (sqrt(v) + 1) is smooth in the gradient, so the
                               # parameter change compares gradients (Adam's sign-like first step would not)
                               "--optimizer.eps=1.0", "--recompute_config.recompute=False",
                               "--recompute_config.select_recompute=False"])
    cfg = adopt_hf_model_config(cfg)
    network, _ = build_network(cfg, rt, sharded=False)
    load_base_into(network, case_dir, rt.rank)
    before = {p.name: p.asnumpy().copy() for p in network.trainable_params()}
    optimizer = build_optimizer(network, cfg, np.full(1, 0.1, np.float32))
    step = build_train_step(network, optimizer, cfg, rt)
    out = step(Tensor(batch), Tensor(batch))
    result = {"loss": out[0].asnumpy(), "stats": out[4].asnumpy() if len(out) > 4 else np.zeros(0, np.float32)}
    for p in network.trainable_params():
        result["delta/" + p.name] = p.asnumpy() - before[p.name]
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--run_mode", required=True)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--result_dir", required=True)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if os.environ.get("MS_ROLE") == "MS_SCHED":   # the CPU cluster's scheduler: join, no model work
        import mindspore as ms
        from mindspore.communication import init

        ms.set_device("CPU")
        init()
        return 0
    from msllm.cluster.context import setup_runtime
    from msllm.config import load_config

    world = int(os.environ.get("MS_WORKER_NUM", "1"))
    rt = setup_runtime(load_config(args.config, [f"--parallel_config.data_parallel={world}", "--deterministic=True"]))
    batch = np.load(os.path.join(args.cases, "batch.npy"))
    rows = batch.shape[0] // rt.world_size
    mine = batch[rt.rank * rows:(rt.rank + 1) * rows]
    os.makedirs(args.result_dir, exist_ok=True)
    for case in sorted(os.listdir(args.cases)):
        case_dir = os.path.join(args.cases, case)
        if not os.path.isdir(case_dir):
            continue
        result = one_step(args.config, case_dir, mine, rt)
        path = os.path.join(args.result_dir, f"{case}_rank{rt.rank}.npz")
        np.savez(path + ".tmp.npz", **result)
        os.replace(path + ".tmp.npz", path)
        print(f"rank {rt.rank} {case}: loss {float(result['loss']):.6f}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if code == 0:   # the last step, as run_msllm.py's (msllm/cluster/rank_done.py)
        from msllm.cluster.rank_done import mark_done

        mark_done()
    sys.exit(code)
