"""The parent side of the benchmarks: command-line parser, running a worker in its own
interpreter, progress lines, Markdown rows, and writing the result file atomically.

Used by the benchmark scripts in this directory (main venv); the workers use common.py and
workers/worker_common.py only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common

WORKERS = os.path.join(common.HERE, "workers")


def arg_parser(doc: str, default_shape: str | None = None) -> argparse.ArgumentParser:
    """A benchmark script's parser: ``doc``'s first paragraph as description and, with
    ``default_shape``, a ``--shape`` flag over :data:`common.SHAPES`."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if default_shape:
        p.add_argument("--shape", default=default_shape, choices=sorted(common.SHAPES))
    return p


# set by scripts/run_distribute.sh; a worker inheriting them would try to join a cluster
LAUNCHER_ENV = ("MS_WORKER_NUM", "RANK_SIZE", "MS_ROLE", "RANK_TABLE_FILE")


def run_worker(name: str, script: str, args: dict, timeout: float, py: str = common.MAIN_PY,
               env_extra: dict | None = None, cwd: str | None = None) -> dict:
    """Run ``benchmarks/workers/{script} '{json args + spawn_time}'`` with interpreter ``py`` in
    a fresh temporary directory (or ``cwd``; MindSpore and MindFormers write ./rank_0, ./output)
    and return its ``BENCH_RESULT`` dict plus ``framework=name``, ``wall_s`` (spawn to exit) and
    the load average before and after; on a failure or timeout ``{"framework", "error",
    "load_before"}`` with the output's tail."""
    args = dict(args, spawn_time=time.time())
    env = dict(os.environ, GLOG_v="3", PYTHONUNBUFFERED="1", **(env_extra or {}))
    if py == common.MAIN_PY:
        # msllm from this checkout (a git worktree of another commit included), not from wherever
        # the venv's editable install points
        env["PYTHONPATH"] = common.ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in LAUNCHER_ENV:
        env.pop(k, None)
    load_before = common.loadavg()
    with tempfile.TemporaryDirectory(prefix=f"bench_{name}_") as tmp:
        t = time.time()
        try:
            p = subprocess.run([py, os.path.join(WORKERS, script), json.dumps(args)], cwd=cwd or tmp, env=env,
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"framework": name, "error": f"timeout after {timeout:.0f} s", "load_before": load_before}
        wall = time.time() - t
    res = common.parse_result(p.stdout)
    if res is None:
        tail = (p.stdout[-1500:] + "\n" + p.stderr[-2500:]).strip()
        return {"framework": name, "error": f"rc={p.returncode}: {tail}", "load_before": load_before}
    res.update(framework=name, wall_s=wall, load_before=load_before, load_after=common.loadavg())
    return res


def ok_runs(runs: list[dict], name: str, key: str = "framework") -> tuple[list[dict], str | None]:
    """The successful runs whose ``key`` is ``name``, and the first failed one's error (or None)."""
    mine = [r for r in runs if r[key] == name]
    errors = [r["error"] for r in mine if "error" in r]
    return [r for r in mine if "error" not in r], (errors[0] if errors else None)


def show_cmd(cmd: list[str]) -> str:
    """A subprocess command as text, paths inside the repository relative to it."""
    return " ".join(os.path.relpath(c, common.ROOT) if c.startswith(common.ROOT) else c for c in cmd)


def log_run(runs: list, r: dict, label: str, line) -> None:
    """Keep run ``r`` in ``runs`` and print its progress line: ``{label} {line(r)}``, or the tail
    of its error."""
    runs.append(r)
    print(f"{label}: ERROR {r['error'][-800:]}" if "error" in r else f"{label} {line(r)}", flush=True)


def md_rows(table: dict, row, prefix: str = "") -> list[str]:
    """Markdown table rows, one per entry of ``table``: ``row(name, entry)``, or for an entry
    holding an ``error``, ``| {prefix}{name} | error: ... |``."""
    return [f"| {prefix}{n} | error: {r['error'][:200]} |" if "error" in r else row(n, r) for n, r in table.items()]


def command_line() -> str:
    """This invocation as a command to put beside its results (interpreter relative to the repo)."""
    return " ".join([os.path.relpath(sys.executable, common.ROOT)] + sys.argv)


def write_json(path: str, obj) -> None:
    """Write a result file atomically (msllm.fileio: temporary name, then rename)."""
    common.use_repo()
    from msllm.fileio import write_json_atomic

    write_json_atomic(path, obj, indent=1)


def finish(out: str, result: dict, table: str, t0: float) -> None:
    """Write ``result`` to ``out``, print the Markdown ``table`` and the total time."""
    write_json(out, result)
    print()
    print(table)
    print(f"\n{time.time() - t0:.0f} s in total; results in {out}")
