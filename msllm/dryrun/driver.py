"""``--sim_level``: compile the configured Ascend job for some of its ranks on this machine, and
report per rank what MindSpore made of it.

For each rank R of ``data_parallel x model_parallel x pipeline_stage`` ranks, one child process
(:mod:`msllm.dryrun.compile`) runs under MindSpore's simulation
(:func:`msllm.cluster.simulation.simulation_env`) with ``device_target: Ascend``, the YAML's real
shapes and no data; a few ranks at a time (``jobs``, default the machine's cores, so a 2-core
machine is not oversubscribed). Each child's output goes to ``output_dir/log/rank_R/dryrun.log``
and its report to ``output_dir/log/rank_R/dryrun_report.json`` (written atomically):

* ``stage``; ``peak_memory`` (MindSpore's ``Used``/``Actual peak memory usage`` in MiB, level 1);
  ``planner`` (msllm's per-device figure for that stage, :func:`msllm.parallel.planner.plan`, in
  MiB) and ``ratio`` = MindSpore / planner;
* ``collectives`` by kind and group size, in total and per decoder layer, read from the
  compiled graph (:mod:`msllm.dryrun.report`);
* ``strategy_file``: where MindSpore wrote its strategy (``output_dir/strategy/ckpt_strategy_rank_R.ckpt``,
  the name ``--only_save_strategy`` uses);
* ``jit_level`` actually compiled and why, ``device_layer`` (stub or real CANN).

A rank MindSpore rejects ends the run with one error quoting MindSpore's message and naming the
YAML key it concerns. ``context.jit_level: O2`` (GE graph mode) is compiled with O1: GE's graph
compiler is a CANN library, which the stub layer does not provide (MindSpore's parallel passes,
which decide strategies, collectives and stages, run in its frontend before either backend).
On the stub layer ``O1`` is compiled without graph-kernel fusion (``MS_DEV_GRAPH_KERNEL_FLAGS
--opt_level=0``, :func:`fusion_off`): its Ascend kernel generator (DVM, built into MindSpore's
Ascend plugin) reads device facts the stubs do not provide and MindSpore 2.10 stops with a bare
``RuntimeError: stoi`` while building the first fused kernel (measured on the tiny model and the 7B
YAML; with fusion off both compile and run the level-1 step). The report's ``graph_kernel_fusion``
says which ran.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from msllm.dryrun import report as rep
from msllm.dryrun.compile import ERROR, RESULT
from msllm.errors import MsllmError
from msllm.fileio import atomic_open

log = logging.getLogger("msllm")
MIB = 1 << 20


def parse_ranks(spec: str | None, rank_size: int) -> list[int]:
    """``None`` -> every rank; ``"5"`` -> [5]; ``"0,3,7"`` -> [0, 3, 7]; ``"[0,8)"``/``"[0,8]"`` -> 0..7
    (run_distribute.sh's half-open ``[START,END]``). MsllmError names a rank outside 0..rank_size-1."""
    if spec is None or spec == "":
        return list(range(rank_size))
    s = str(spec).strip()
    if s[:1] == "[":
        lo, hi = s.strip("[]()").split(",")
        ranks = list(range(int(lo), int(hi)))
    else:
        ranks = [int(x) for x in s.split(",") if x.strip()]
    bad = [r for r in ranks if not 0 <= r < rank_size]
    if bad or not ranks:
        raise MsllmError(f"--sim_rank_id {spec!r}: expected ranks in 0..{rank_size - 1} (RANK_SIZE {rank_size})")
    return ranks


def planner_mib(cfg, stage: int) -> float | None:
    """msllm's planned bytes of one device of ``stage`` (MiB), or None if the planner refuses."""
    from msllm.lora.layout import lora_plan_inputs
    from msllm.parallel.planner import plan
    from msllm.parallel.stage_split import stage_layers_of

    try:
        split = (stage_layers_of(cfg.model_config, cfg.parallel_config.pipeline_stage)
                 if cfg.model_config.pp_interleave_num == 1 else None)
        layouts, trainable = lora_plan_inputs(cfg, split)
        p = plan(cfg, stage_layers=split, layouts=layouts, trainable=trainable)
    except MsllmError:
        return None
    return round(p["stages"][stage]["total"] / MIB, 1)


def _child_cmd(config: str, overrides: list[str], jit_level: str) -> list[str]:
    return [sys.executable, "-m", "msllm.dryrun.compile", "--config", config, *overrides,
            "--context.device_target=Ascend", f"--context.jit_level={jit_level}"]


def fusion_off(layer, jit_level: str) -> bool:
    """True when this rank's compile turns graph-kernel fusion off: jit_level O1 on the stub layer
    and no ``MS_DEV_GRAPH_KERNEL_FLAGS`` of the user's (module docstring)."""
    return layer.stub and jit_level == "O1" and "MS_DEV_GRAPH_KERNEL_FLAGS" not in os.environ


def compile_rank(cfg, config: str, overrides: list[str], rank: int, level: int, layer, jit_level: str) -> dict:
    """Run one rank's child, parse it, write its report; return the report (``error`` set on failure)."""
    from msllm.cluster.simulation import simulation_env

    pc = cfg.parallel_config
    log_dir = os.path.join(os.path.abspath(cfg.output_dir), "log", f"rank_{rank}")
    os.makedirs(log_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"msllm_dryrun_{rank}_") as graphs:
        env = simulation_env(layer, level, rank, pc.device_num)
        # GLOG_v 2 (warnings): MindSpore prints its memory statistics at exit at that level
        # MS_DEV_DUMP_IR_PASSES: dump only the validate pass's IR (a 13B graph's dumps of every pass
        # are hundreds of MB and slow the compile down)
        env.update(MS_DEV_SAVE_GRAPHS="1", MS_DEV_SAVE_GRAPHS_PATH=graphs, MS_DEV_DUMP_IR_PASSES="validate",
                   GLOG_v=os.environ.get("MSLLM_DRYRUN_GLOG_V", "2"))
        if fusion_off(layer, jit_level):
            env["MS_DEV_GRAPH_KERNEL_FLAGS"] = "--opt_level=0"
        env["PYTHONPATH"] = os.pathsep.join([_repo_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                               if p])
        t0 = time.time()
        proc = subprocess.run(_child_cmd(config, overrides, jit_level), env=env, capture_output=True, text=True,
                              cwd=os.getcwd())
        seconds = round(time.time() - t0, 1)
        text = proc.stdout + "\n" + proc.stderr
        with atomic_open(os.path.join(log_dir, "dryrun.log")) as fh:
            fh.write(text)
        ir = rep.validate_ir(graphs)
        ir_text = open(ir, encoding="utf-8", errors="replace").read() if ir else ""
        nodes = rep.collectives(ir_text)
        size = rep.graph_size(ir_text) if ir else None
        if ir and os.environ.get("MSLLM_DRYRUN_KEEP_IR"):  # the validate IR beside the log, for reading
            shutil.copyfile(ir, os.path.join(log_dir, "validate.ir"))
    facts, error = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            facts = json.loads(line[len(RESULT):])
        elif line.startswith(ERROR):
            error = json.loads(line[len(ERROR):])
    if not facts and error is None and proc.returncode < 0:  # killed: the kernel's OOM killer sends SIGKILL
        error = {"type": f"killed by signal {-proc.returncode}",
                 "message": f"the compile process of rank {rank} was killed by signal {-proc.returncode}"
                            + (" (SIGKILL: most likely this machine ran out of host memory)" if proc.returncode == -9
                               else "")}
    elif not facts and error is None:
        error = {"type": f"exit {proc.returncode}", "message": proc.stderr.strip()[-1500:] or "no output"}
    from msllm.parallel.param_layout import stage_of_rank
    from msllm.parallel.strategy_files import strategy_file_name, strategy_format

    stage = stage_of_rank(rank, pc)
    # level 0 compiles only: MindSpore still prints the two lines at exit, with what little it
    # allocated before any step (937 MiB for a 13B rank against 4329 MiB at level 1, measured):
    # not a peak, so not reported
    mem = rep.parse_peak_memory(text) if level == 1 else None
    planned = planner_mib(cfg, stage)
    report = {
        "rank": rank, "rank_size": pc.device_num, "stage": stage, "sim_level": level,
        "jit_level": jit_level, "yaml_jit_level": cfg.context.jit_level,
        "graph_kernel_fusion": jit_level != "O0" and not fusion_off(layer, jit_level),
        "device_layer": "stub (compile-only simulation)" if layer.stub else f"CANN at {layer.root}",
        "compile_seconds": seconds, "peak_memory": mem, "planner_mib": planned,
        "ratio": round(mem["used_peak_mib"] / planned, 3) if mem and planned and mem["used_peak_mib"] else None,
        "collectives": rep.summarize(nodes), "graph_size": size,
        "strategy_file": os.path.join(os.path.abspath(cfg.output_dir), "strategy",
                                      strategy_file_name(rank, strategy_format(cfg))),
        "log": os.path.join(log_dir, "dryrun.log"), **{k: v for k, v in facts.items() if k not in ("rank", "stage")},
    }
    if error is not None:
        report["error"] = {"mindspore": rep.first_lines(error["message"]), "type": error["type"],
                           "key": rep.key_for_error(error["message"])}
    with atomic_open(os.path.join(log_dir, "dryrun_report.json")) as fh:
        json.dump(report, fh, indent=1)
    return report


# MindSpore's Ascend backend creates its memory-offload directory (default ``offload_path``
# "./offload", mindspore.set_offload_context's documented default; that setter is gone from 2.10's
# Python API) in the working directory at start-up, empty when offload is off, as the dry-run's is
OFFLOAD_DIR = "offload"


def remove_empty_offload_dir() -> bool:
    """Remove ``./offload`` if it is an empty directory (what the compile children leave in the cwd);
    returns whether it did. A non-empty one is left alone."""
    try:
        os.rmdir(OFFLOAD_DIR)  # fails on a non-empty directory: nothing of the user's is lost
        return True
    except OSError:
        return False


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def format_row(r: dict) -> str:
    """One table row: rank, stage, MindSpore peak, planner, ratio, collectives."""
    mem = r.get("peak_memory") or {}
    coll = ", ".join(f"{k}: {v}" for k, v in r["collectives"]["total"].items()) or "-"
    return (f"rank {r['rank']:>3} stage {r['stage']} | MindSpore peak {mem.get('used_peak_mib', '-')} MiB | "
            f"planner {r['planner_mib']} MiB | ratio {r['ratio']} | {coll}"
            + (f" | {r['graph_size']['nodes']} IR nodes" if r.get("graph_size") else ""))


def run_dryrun(config: str, overrides: list[str], level: int, ranks_spec: str | None = None,
               jobs: int | None = None) -> list[dict]:
    """Compile ``config`` (+ ``overrides``, msllm's ``--key=value``) for the named ranks at
    simulation ``level``; print one line per rank and return the reports (rank order).

    Raises:
        MsllmError: an untested MindSpore, no g++/binutils for the stub layer, a bad rank, or a rank
            MindSpore rejects (its message quoted, the YAML key named).
    """
    from msllm.cluster.simulation import device_layer
    from msllm.config import load_config

    cfg = load_config(config, [*overrides, "--context.device_target=Ascend"])
    pc = cfg.parallel_config
    if cfg.parallel.mode_name == "data_parallel" and pc.device_num > 1:
        log.info("dry-run of a data_parallel job: MindSpore compiles it as semi-auto parallel would only "
                 "with parallel.parallel_mode 1; compiling the data-parallel graph as configured")
    from msllm.cluster.context import check_device_support

    from msllm.settings import check_settings

    check_device_support(cfg)  # msllm's own refusals (pipeline split, full_batch) before MindSpore
    check_settings(cfg, cfg.run_mode)  # and every refusal a real launch makes at start
    layer = device_layer()
    jit = "O1" if cfg.context.jit_level == "O2" else cfg.context.jit_level
    # the one start-up line: what this run is (printed: the entry point configures no logging)
    print(f"{layer.describe()}; MS_SIMULATION_LEVEL {level}, RANK_SIZE {pc.device_num}"
          + ("; context.jit_level O2 (GE) is compiled as O1: GE's compiler is part of CANN"
             if jit != cfg.context.jit_level else "")
          + ("; O1 without graph-kernel fusion: its kernel generator needs CANN's device data"
             if fusion_off(layer, jit) else ""), flush=True)
    launcher = os.environ.get("MSLLM_SIM_RANK_SIZE")  # scripts/msrun_launcher.sh's WORKER_NUM
    if launcher and int(launcher) != pc.device_num:
        raise MsllmError(f"WORKER_NUM {launcher}, but the layout of {config} (data_parallel x model_parallel x "
                         f"pipeline_stage) has {pc.device_num} ranks")
    ranks = parse_ranks(ranks_spec, pc.device_num)
    jobs = max(1, jobs or os.cpu_count() or 1)
    offload_existed = os.path.exists(OFFLOAD_DIR)
    try:
        with ThreadPoolExecutor(max_workers=min(jobs, len(ranks))) as pool:
            reports = list(pool.map(lambda r: compile_rank(cfg, config, overrides, r, level, layer, jit), ranks))
    finally:
        if not offload_existed:
            remove_empty_offload_dir()
    for r in reports:
        print(format_row(r), flush=True)
    failed = [r for r in reports if "error" in r]
    if failed and failed[0]["error"]["type"] == "MsllmError":
        raise MsllmError(f"rank {failed[0]['rank']}: {failed[0]['error']['mindspore']}")
    if failed:
        e = failed[0]["error"]
        raise MsllmError(f"MindSpore rejected rank {failed[0]['rank']} of this layout ({len(failed)} of {len(ranks)} "
                         f"rank(s) failed): \"{e['mindspore']}\" ({e['type']}); the YAML key to look at: {e['key']}; "
                         f"full output: {failed[0]['log']}")
    return reports


__all__ = ["OFFLOAD_DIR", "compile_rank", "format_row", "parse_ranks", "planner_mib", "remove_empty_offload_dir",
           "run_dryrun"]

