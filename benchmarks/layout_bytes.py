"""Per-rank parameter bytes of the seed layouts, and what writing their strategy files costs.

For configs/llama/run_llama_{7b,13b,70b}.yaml (7B data_parallel 8; 13B 2 servers x 8,
data_parallel 16; 70B data_parallel 2 x model_parallel 8 x pipeline_stage 4 = 64 ranks), each
read with ``msllm.config.load_config`` as the YAML stands (optimizer_shard on, fp32 weights):

* bytes one rank of each pipeline stage stores: ``msllm.parallel.param_layout.param_layouts`` +
  ``rank_param_bytes`` (weight slices; AdamW moments ``adam_m``/``adam_v`` with their weight's
  layout). These are the numbers ``run_msllm.py --config ... --only_save_strategy True`` writes
  into ``output/strategy/layout_summary.yaml``; the script checks that the file it writes says
  the same;
* writing every rank's strategy file in one process, as ``--only_save_strategy`` does when
  started by hand (``msllm.parallel.strategy.save_strategy_for_run(cfg, rank=None)``, protobuf
  ``.ckpt`` files) into a temporary ``output_dir``: the first call (it imports MindSpore's
  protobuf module), the best and median of ``--repeats`` later calls (wall seconds), and the
  peak of Python allocations traced by ``tracemalloc`` in one further call.

    .venv/bin/python benchmarks/layout_bytes.py [--repeats 5] [--out benchmarks/results/layout_bytes.json]

Nothing is trained and no weight is allocated: the layout numbers do not depend on the load;
the seconds do (the load average is recorded beside them).
"""

from __future__ import annotations

import os
import tempfile
import time
import tracemalloc

import common  # benchmarks/common.py: this script's directory is on sys.path
import harness

common.use_repo()

import yaml  # noqa: E402

from msllm.config import load_config  # noqa: E402
from msllm.parallel.param_layout import param_layouts, rank_param_bytes  # noqa: E402
from msllm.parallel.strategy import SUMMARY_NAME, save_strategy_for_run  # noqa: E402

SEEDS = {"7b": "7B, dp 8", "13b": "13B, 2 servers x 8, dp 16", "70b": "70B, dp 2 x mp 8 x pp 4 (64 ranks)"}
GIB = 2 ** 30


def layout_row(name: str, repeats: int) -> dict:
    path = os.path.join(common.ROOT, "configs", "llama", f"run_llama_{name}.yaml")
    with tempfile.TemporaryDirectory(prefix=f"layout_{name}_") as tmp:
        cfg = load_config(path, [f"--output_dir={tmp}"])
        mc, pc = cfg.model_config, cfg.parallel_config
        layouts = param_layouts(mc, pc)
        per_stage = pc.data_parallel * pc.model_parallel
        stages = [{"stage": s, "ranks": [s * per_stage, (s + 1) * per_stage - 1],
                   **rank_param_bytes(layouts, s * per_stage, pc)} for s in range(pc.pipeline_stage)]
        # every rank of a stage holds the same bytes (the splits are even): check it, not assume it
        for st in stages:
            for r in range(st["ranks"][0], st["ranks"][1] + 1):
                assert rank_param_bytes(layouts, r, pc)["total"] == st["total"], (name, r)

        t = time.perf_counter()
        out = save_strategy_for_run(cfg, rank=None)
        cold = time.perf_counter() - t
        warm, loads = [], [common.loadavg()]
        for _ in range(repeats):
            t = time.perf_counter()
            save_strategy_for_run(cfg, rank=None)
            warm.append(time.perf_counter() - t)
        loads.append(common.loadavg())
        tracemalloc.start()
        save_strategy_for_run(cfg, rank=None)
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        files = sorted(f for f in os.listdir(out) if f.startswith("ckpt_strategy_rank_"))
        with open(os.path.join(out, SUMMARY_NAME), encoding="utf-8") as fh:
            written = yaml.safe_load(fh)["rank_bytes_by_stage"]
        for st in stages:  # the summary run_msllm.py writes says the same
            w = written[st["stage"]]
            assert (w["weights"], w["optimizer_states"], w["total"]) == (
                st["weights"], st["optimizer_states"], st["total"]), (name, st, w)
        return {
            "config": os.path.relpath(path, common.ROOT), "label": SEEDS[name],
            "params": mc.num_params(), "num_layers": mc.num_layers, "hidden_size": mc.hidden_size,
            "param_init_type": mc.param_init_type,
            "layout": {"data_parallel": pc.data_parallel, "model_parallel": pc.model_parallel,
                       "pipeline_stage": pc.pipeline_stage, "optimizer_shard": pc.optimizer_shard,
                       "device_num": pc.device_num},
            "stages": stages, "strategy_files": len(files),
            "strategy_bytes_per_file": os.path.getsize(os.path.join(out, files[0])),
            "write_seconds_first": cold, "write_seconds_best": min(warm), "write_seconds_median": common.median(warm),
            "write_seconds_all": warm, "tracemalloc_peak_bytes": traced_peak, "loads": loads,
        }


def markdown(rows: dict) -> str:
    lines = ["| config / layout | ranks | stage | weights per rank | AdamW moments per rank | total per rank |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows.values():
        for st in r["stages"]:
            lines.append(f"| {r['label']} | {st['ranks'][0]}-{st['ranks'][1]} | {st['stage']} "
                         f"| {st['weights'] / GIB:.2f} GiB | {st['optimizer_states'] / GIB:.2f} GiB "
                         f"| {st['total'] / GIB:.2f} GiB |")
    lines += ["", "| config / layout | strategy files | first write s | best s | median s | tracemalloc peak MiB "
              "| load |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows.values():
        lines.append(f"| {r['label']} | {r['strategy_files']} | {r['write_seconds_first']:.2f} "
                     f"| {r['write_seconds_best']:.2f} | {r['write_seconds_median']:.2f} "
                     f"| {r['tracemalloc_peak_bytes'] / 2 ** 20:.1f} | {' / '.join(r['loads'])} |")
    return "\n".join(lines)


def main(argv=None):
    p = harness.arg_parser(__doc__)
    p.add_argument("--configs", default="7b,13b,70b")
    p.add_argument("--repeats", type=int, default=5, help="timed strategy writes per config after the first")
    p.add_argument("--out", default=os.path.join(common.HERE, "results", "layout_bytes.json"))
    a = p.parse_args(argv)
    t0 = time.time()
    info = common.machine()
    rows = {name: layout_row(name, a.repeats) for name in a.configs.split(",")}
    harness.finish(a.out, {"machine": info, "command": harness.command_line(), "configs": rows}, markdown(rows), t0)


if __name__ == "__main__":
    main()
