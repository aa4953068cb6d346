"""How often a finished CPU cluster rank crashes while its process exits (MindSpore 2.10).

Seen in the full test runs on the AMD EPYC Zen 4 machine (2026-11-28: tests/cluster/test_cluster_launch.py's
4-rank test and tests/lora/test_real_model_finetune.py's 2-rank LoRA run, one each; one in the previous
session's tests/training/test_training_families_dp.py): a rank does all its work (its results written, its last
log line printed), then dies of SIGSEGV during interpreter exit, no Python frame on the stack
(``PYTHONFAULTHANDLER``), after MindSpore has started a TCP client and server ("Event base dispatch success");
the launcher then reports the invocation failed.

This script launches ``--runs`` 2-rank jobs of tests/cluster/cluster_allreduce_worker.py (scheduler + 2 workers
through scripts/run_distribute.sh, an AllReduce, exit), ``--parallel`` jobs at a time (the test suite runs two
pytest workers), and counts the jobs whose launcher exited non-zero and the ranks killed by a signal.
``--destroy``: every rank calls ``mindspore.mint.distributed.destroy_process_group()`` before exiting.
Since the launcher forgives a SIGSEGV after a process marked its work done (``msllm/cluster/rank_done.py``),
such jobs succeed; they are counted apart ("forgiven"), from the launcher's warning.

    .venv/bin/python benchmarks/cluster_teardown_crash.py --runs 20 --parallel 2 [--destroy] --out RESULT.json
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import harness  # noqa: E402

WORKER = os.path.join(common.ROOT, "tests", "cluster", "cluster_allreduce_worker.py")


def one_job(i: int, destroy: bool) -> dict:
    """One 2-rank launch in a fresh directory; its exit code and what the launcher said about each rank."""
    from msllm.cluster.rank_table import save_rank_table
    from msllm.cluster.rank_table_devices import placeholder_device_ips
    from msllm.cluster.rank_table_format import make_rank_table, merge_rank_tables

    d = tempfile.mkdtemp(prefix="teardown_crash_")
    ips = placeholder_device_ips("127.0.0.1", [0, 1])
    save_rank_table(merge_rank_tables([make_rank_table("127.0.0.1", [0, 1], [ips[0], ips[1]])]), f"{d}/t.json")
    with open(f"{d}/cfg.yaml", "w") as fh:
        fh.write(f"context:\n  device_target: CPU\noutput_dir: {d}/output\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "RANK_", "DEVICE_"))}
    env.update(MSLLM_ENTRY=WORKER, GLOG_v="3", MS_SCHED_PORT=str(port), PYTHONFAULTHANDLER="1")
    cmd = ["bash", os.path.join(common.ROOT, "scripts", "run_distribute.sh"), f"{d}/t.json", f"{d}/cfg.yaml", "[0,2]",
           "train", "2", "--result_dir", f"{d}/res"] + (["--destroy"] if destroy else [])
    t0 = time.time()
    r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=600)
    said = r.stdout + r.stderr
    return {"job": i, "dir": d, "exit": r.returncode, "seconds": round(time.time() - t0, 1),
            "killed": re.findall(r"(rank \d+|scheduler) \(pid \d+\) failed: killed by signal (\w+)", said),
            # a crash after the process marked its work done, which the launcher forgives (msllm/cluster/rank_done.py)
            "forgiven": re.findall(r"warning: (rank \d+|scheduler) \(pid \d+\) marked its work done", said),
            "results_written": sorted(os.listdir(f"{d}/res")) if os.path.isdir(f"{d}/res") else []}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--destroy", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    common.use_repo()
    with ThreadPoolExecutor(a.parallel) as pool:
        jobs = list(pool.map(lambda i: one_job(i, a.destroy), range(a.runs)))
    failed = [j for j in jobs if j["exit"] != 0]
    forgiven = [j for j in jobs if j["forgiven"]]
    for j in forgiven:
        print(f"job {j['job']}: exit {j['exit']}, a crash after the work forgiven: {j['forgiven']}, {j['dir']}")
    for j in failed:
        print(f"job {j['job']}: exit {j['exit']}, killed {j['killed']}, results {j['results_written']}, {j['dir']}")
    summary = {"runs": a.runs, "parallel": a.parallel, "destroy": a.destroy, "failed": len(failed),
               "forgiven": len(forgiven),
               "machine": common.machine(), "command": " ".join(sys.argv), "jobs": jobs}
    print(f"{len(failed)} of {a.runs} jobs failed, {len(forgiven)} had a crash after the work forgiven "
          f"(destroy_process_group: {a.destroy})")
    if a.out:
        harness.write_json(a.out, summary)


if __name__ == "__main__":
    main()
