"""Where a full DPO step on SmolLM2 spends its time (issue #33): the train step of ``run_msllm.py
--run_mode finetune`` with a ``dpo`` section (reference = a frozen copy), on the pairs of
benchmarks/dpo_speed.py (seq 256, 2 pairs a step, float32), timed over ``--steps`` steps at width
128 after one compiling step, with msllm's kernel timers (``MSLLM_KERNEL_PROFILE=1``: ms per step
by kernel) and then MindSpore's profiler over 2 more steps (ms per step by operator type).

``--code DIR`` profiles the msllm package of another checkout (its kernels built there, e.g. a
``git worktree`` of an earlier commit with ``python -m msllm.kernels.build`` run inside it), so a
change can be profiled before and after on one machine.

    .venv/bin/python benchmarks/profile_dpo_step.py --out benchmarks/results/profile_dpo_step_<tag>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import profile_step  # noqa: E402  (its op_type_totals; importing it imports no msllm module)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--code", default=None, help="a checkout whose msllm package to profile (default: this one)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ["MSLLM_KERNEL_PROFILE"] = "1"
    os.environ.setdefault("GLOG_v", "3")
    import dpo_speed   # the benchmark's pairs and config (imports no msllm module)

    if a.code:
        sys.path.insert(0, os.path.abspath(a.code))
    else:
        common.use_repo()
    import mindspore as ms

    import msllm
    from msllm.config import load_config
    from msllm.kernels import kernel_stats
    from msllm.training.dpo import cut_pair_batch
    from msllm.training.setup import load_start, prepare

    print(f"profiling {os.path.dirname(msllm.__file__)}", flush=True)
    if a.code and not os.path.abspath(msllm.__file__).startswith(os.path.abspath(a.code)):
        raise SystemExit(f"--code {a.code}: msllm was imported from {msllm.__file__}")
    model_dir = common.hf_dir("smollm2")   # after msllm's import: it imports this checkout's msllm
    tmp = tempfile.mkdtemp(prefix="profile_dpo_")
    _, data = dpo_speed.prepare(model_dir, tmp, 12, 256)
    cfg = load_config(os.path.join(common.ROOT, dpo_speed.CONFIG),
                      dpo_speed.msllm_overrides(model_dir, data, 256, 2, 16, os.path.join(tmp, "out")))
    run = prepare(cfg)
    load_start(run)
    batches = [cut_pair_batch(b, cfg.model_config.ignore_token_id, run.agree)
               for _, b in zip(range(6), run.data.epoch_batches(0))]
    b128 = [b for b in batches if b[0].shape[-1] - 1 == 128]
    if len(b128) < 2:
        raise SystemExit(f"expected at least 2 batches of width 128, got widths {[b[0].shape[-1] - 1 for b in batches]}")
    run.step_cell(*b128[0])[0].asnumpy()                      # compiles
    kernel_stats(reset=True)
    times = []
    for i in range(a.steps):
        b = b128[1 + i % (len(b128) - 1)]
        t = time.perf_counter()
        run.step_cell(*b)[0].asnumpy()
        times.append(time.perf_counter() - t)
    kernels = {k: 1e3 * sec / a.steps for k, (calls, sec) in kernel_stats(reset=True).items()}
    print("step s", [round(t, 3) for t in times])
    for k, ms_ in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"  {k:32s} {ms_:8.1f} ms per step")
    prof_dir = os.path.join(tmp, "profile")
    prof = ms.Profiler(output_path=prof_dir)
    for b in b128[1:3] if len(b128) > 2 else b128[1:2] * 2:
        run.step_cell(*b)[0].asnumpy()
    prof.stop()
    prof.analyse()
    ops_ms = {k: t / 2 for k, (t, _) in profile_step.op_type_totals(prof_dir).items()}
    print("MindSpore profiler, ms per step by operator type:")
    for k, v in list(ops_ms.items())[:12]:
        print(f"  {k:28s} {v:8.1f}")
    if a.out:
        import harness

        harness.write_json(a.out, {"benchmark": "profile_dpo_step", "machine": common.machine(),
                                   "command": " ".join(sys.argv), "code": os.path.dirname(msllm.__file__),
                                   "step_s": times, "kernel_ms_per_step": kernels,
                                   "profiler_ms_per_step_by_op_type": ops_ms})
    return 0


if __name__ == "__main__":
    sys.exit(main())
