"""Data-parallel scaling on this machine: 1 process vs 2 data-parallel processes, msllm's trainer
end to end (MindRecord data pipeline included), and the data-loading stall it records.

* 1 process:  ``run_msllm.py --config configs/llama/run_llama_tiny.yaml --parallel_config.data_parallel=1``
* 2 processes: ``tools/hccl_tools.py --device_num "[0,2)" --server_ip 127.0.0.1`` writes the rank
  table, then ``scripts/run_distribute.sh TABLE configs/llama/run_llama_tiny.yaml "[0,2]" train 2``
  with a free ``MS_SCHED_PORT`` (what ``scripts/run_demo.sh`` does).

Model: the benchmark's ``tiny`` shape (hidden 256, 4 layers, 4 heads, FFN 688, vocab 32000,
seq 256) by default, or the demo config's own shape with ``--model demo`` (hidden 128, GQA 4/2).
Work: the same global batch (``--global_batch``, default 8) split over the ranks (strong scaling),
``--steps`` steps, on the bundled Alpaca data tokenized by msllm's preprocessing. The numbers are
each rank's ``train_summary_rank_{r}.json``: tgs (tokens/s/device over the steps after the
first), the first (compile) step and ``data_wait_share`` (time waiting for the next batch over
step + wait time). Runs alternate (1, 2, 1, 2 ...) for ``--rounds`` rounds.

    .venv/bin/python benchmarks/dp_scaling.py [--rounds 2] [--steps 30] [--model tiny|demo]

Writes benchmarks/results/dp_scaling.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402

TINY_YAML = os.path.join(common.ROOT, "configs", "llama", "run_llama_tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mindrecord(seq: int) -> str:
    out = os.path.join(common.CACHE, f"alpaca_{seq}.mindrecord")
    if os.path.exists(out):
        return out
    subprocess.run([common.MAIN_PY, os.path.join(common.ROOT, "data_preprocess", "llama_preprocess.py"),
                    "--input_glob", common.alpaca_conversation(), "--dataset_type", "qa", "--model_file",
                    os.path.join(common.EXAMPLES, "tokenizer.model"), "--seq_length", str(seq),
                    "--output_file", out, "--no_progress"], check=True, capture_output=True,
                   env=dict(os.environ, GLOG_v="3"))
    return out


def model_overrides(model: str) -> list[str]:
    return [] if model == "demo" else common.model_overrides(common.shape("tiny"))


def run(world: int, data: str, out: str, steps: int, global_batch: int, model: str, timeout: float) -> dict:
    common_args = [f"--train_dataset_dir={data}", f"--runner_config.batch_size={global_batch // world}",
                   f"--runner_config.train_steps={steps}", "--callbacks.checkpoint.save_checkpoint_steps=100000",
                   "--callbacks.checkpoint.save_at_end=False", "--callbacks.loss_monitor.per_print_times=10",
                   *model_overrides(model)]
    env = dict(os.environ, GLOG_v="3")
    for k in harness.LAUNCHER_ENV:
        env.pop(k, None)
    os.makedirs(out, exist_ok=True)
    load = common.loadavg()
    t = time.time()
    if world == 1:
        cmd = [common.MAIN_PY, os.path.join(common.ROOT, "run_msllm.py"), "--config", TINY_YAML,
               "--run_mode", "train", "--parallel_config.data_parallel=1", f"--output_dir={out}", *common_args]
    else:
        subprocess.run([common.MAIN_PY, os.path.join(common.ROOT, "tools", "hccl_tools.py"), "--device_num",
                        f"[0,{world})", "--server_ip", "127.0.0.1", "--output_dir", out], check=True,
                       capture_output=True)
        table = [f for f in os.listdir(out) if f.startswith("hccl_")][0]
        env.update(MSLLM_OUTPUT_DIR=out, MS_SCHED_PORT=str(free_port()))
        cmd = ["bash", os.path.join(common.ROOT, "scripts", "run_distribute.sh"), os.path.join(out, table),
               TINY_YAML, f"[0,{world}]", "train", str(world), *common_args]
    p = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t
    if p.returncode != 0:
        logs = ""
        for r in range(world):
            f = os.path.join(out, "log", f"rank_{r}", "msllm.log")
            if os.path.exists(f):
                logs += open(f).read()[-1500:]
        raise RuntimeError(f"world {world} failed rc={p.returncode}: {p.stdout[-1500:]} {p.stderr[-2000:]} {logs}")
    ranks = [json.load(open(os.path.join(out, f"train_summary_rank_{r}.json"))) for r in range(world)]
    res = {"world_size": world, "batch_per_rank": global_batch // world, "wall_s": wall, "load": load,
           "cmd": harness.show_cmd(cmd),
           "per_rank": [{"rank": i, "tgs": s["tgs"], "mean_step_seconds": s["mean_step_seconds"],
                         "compile_first_step_seconds": s["compile_first_step_seconds"],
                         "data_wait_share": s["data_wait_share"], "mfu": s["mfu"], "peak_tflops": s["peak_tflops"],
                         "first_avg_loss": s["first_avg_loss"], "last_avg_loss": s["last_avg_loss"]}
                        for i, s in enumerate(ranks)]}
    res["total_tgs"] = sum(r["tgs"] for r in res["per_rank"])
    return res


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--model", choices=["tiny", "demo"], default="tiny")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(HERE, "results", "dp_scaling.json"))
    a = p.parse_args(argv)
    info = common.machine()
    print(f"# {info}", flush=True)
    seq = 256
    data = mindrecord(seq)
    runs = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dp_bench_") as tmp:
        for rnd in range(a.rounds):
            for world in (1, 2):
                r = run(world, data, os.path.join(tmp, f"r{rnd}_w{world}"), a.steps, a.global_batch, a.model,
                        a.timeout)
                r["round"] = rnd
                runs.append(r)
                ranks = ", ".join(f"rank {x['rank']}: {x['tgs']:.0f} tok/s, step {x['mean_step_seconds']:.2f} s, "
                                  f"first {x['compile_first_step_seconds']:.1f} s, data wait "
                                  f"{100 * x['data_wait_share']:.2f}%" for x in r["per_rank"])
                print(f"round {rnd} world {world}: total {r['total_tgs']:.0f} tokens/s ({ranks}); "
                      f"wall {r['wall_s']:.0f} s; load {r['load']}", flush=True)
    table = {}
    for world in (1, 2):
        rs = [r for r in runs if r["world_size"] == world]
        table[world] = {
            "total_tgs": common.median([r["total_tgs"] for r in rs]),
            "per_rank_tgs": common.median([x["tgs"] for r in rs for x in r["per_rank"]]),
            "step_s": common.median([x["mean_step_seconds"] for r in rs for x in r["per_rank"]]),
            "first_step_s": common.median([x["compile_first_step_seconds"] for r in rs for x in r["per_rank"]]),
            "data_wait_share": common.median([x["data_wait_share"] for r in rs for x in r["per_rank"]]),
            "wall_s": common.median([r["wall_s"] for r in rs]),
        }
    pairs = [(b["total_tgs"] / a_["total_tgs"]) for a_, b in zip([r for r in runs if r["world_size"] == 1],
                                                                  [r for r in runs if r["world_size"] == 2])]
    summary = {"machine": info, "command": harness.command_line(), "model": a.model, "steps": a.steps,
               "global_batch": a.global_batch, "seq_length": seq, "runs": runs, "table": table,
               "speedup_2_vs_1": common.median(pairs), "speedups": pairs, "total_seconds": time.time() - t0}
    harness.write_json(a.out, summary)
    print("\n| processes | batch/rank | total tokens/s | per-rank tokens/s | step s | first step s | data wait |")
    print("|---|---|---|---|---|---|---|")
    for world, row in table.items():
        print(f"| {world} | {a.global_batch // world} | {row['total_tgs']:.0f} | {row['per_rank_tgs']:.0f} "
              f"| {row['step_s']:.2f} | {row['first_step_s']:.1f} | {100 * row['data_wait_share']:.2f}% |")
    print(f"\n2 vs 1 process: x{summary['speedup_2_vs_1']:.2f} (paired by round: "
          f"{', '.join(f'{x:.2f}' for x in pairs)}); {summary['total_seconds']:.0f} s; results in {a.out}")


if __name__ == "__main__":
    main()
