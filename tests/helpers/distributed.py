"""Runs through ``scripts/run_distribute.sh`` on 2 local CPU ranks (data parallel), started the way
users start them, and what the tests read back: per-rank logs, training summaries, worker pids.

The launcher writes under ``MSLLM_OUTPUT_DIR``: ``log/rank_<r>/msllm.log``, ``log/pids_0_2.txt``
(rows ``worker <rank> <pid>``; the name carries the device range ``[0,2]``) and, for training,
``train_summary_rank_<r>.json`` (the launcher in msllm/cluster; msllm/training/trainer.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

from helpers import REPO

LAUNCHER = os.path.join(REPO, "scripts", "run_distribute.sh")


def free_port() -> int:
    """A TCP port nothing listens on right now (for ``MS_SCHED_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_table(directory) -> str:
    """A rank table of 2 devices on 127.0.0.1 written to ``directory/hccl_2p.json``; its path."""
    from msllm.cluster.rank_table import make_rank_table, save_rank_table

    path = os.path.join(str(directory), "hccl_2p.json")
    save_rank_table(make_rank_table("127.0.0.1", [0, 1], ["10.0.0.1", "10.0.0.2"]), path)
    return path


def start_two_ranks(table: str, config: str, run_mode: str, out, args=(), **env: str) -> subprocess.Popen:
    """``bash scripts/run_distribute.sh TABLE CONFIG [0,2] RUN_MODE 2 ARGS...`` started in the parent
    of ``out`` with its output under ``out`` (``MSLLM_OUTPUT_DIR``), a free scheduler port, the
    surviving ranks stopped 10 s after one fails (``MSLLM_KILL_TIMEOUT``) and MindSpore's C++ log
    quiet; ``env``: more variables (e.g. ``MSLLM_ENTRY``). stdout and stderr merge in ``p.stdout``."""
    env = dict(os.environ, MSLLM_OUTPUT_DIR=str(out), MS_SCHED_PORT=str(free_port()), MSLLM_KILL_TIMEOUT="10",
               GLOG_v="3", **env)
    cmd = ["bash", LAUNCHER, str(table), str(config), "[0,2]", run_mode, "2", *args]
    return subprocess.Popen(cmd, cwd=str(Path(out).parent), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_two_ranks(table: str, config: str, run_mode: str, out, args=(), timeout: float = 600,
                  **env: str) -> tuple[int, str]:
    """:func:`start_two_ranks` run to its end (``timeout`` seconds at most): (exit code, output)."""
    p = start_two_ranks(table, config, run_mode, out, args, **env)
    text, _ = p.communicate(timeout=timeout)
    return p.returncode, text


def successful_run(out: Path, launch: Callable[[Path], tuple[int, str]]) -> Path:
    """``out`` made and ``launch(out)`` (returning (exit code, output)) run: it must exit 0 (else the
    output's tail is the failure message). Returns ``out``."""
    out.mkdir()
    rc, text = launch(out)
    assert rc == 0, text[-3000:]
    return out


def rank_log(out, rank: int) -> str:
    """The text of rank ``rank``'s ``out/log/rank_<rank>/msllm.log`` ("" while it does not exist)."""
    p = Path(out) / "log" / f"rank_{rank}" / "msllm.log"
    return p.read_text() if p.exists() else ""


def train_summary(out, rank: int) -> dict:
    """Rank ``rank``'s ``out/train_summary_rank_<rank>.json`` (steps, losses, start_step, ...)."""
    return json.loads((Path(out) / f"train_summary_rank_{rank}.json").read_text())


def wait_for(pred: Callable[[], bool], timeout: float = 300, proc: subprocess.Popen | None = None) -> bool:
    """Poll ``pred`` every 0.2 s: True once it holds, False after ``timeout`` seconds or once
    ``proc`` (if given) has ended without it holding."""
    t = time.time()
    while not pred():
        if time.time() - t >= timeout or (proc is not None and proc.poll() is not None):
            return False
        time.sleep(0.2)
    return True


def kill_rank(out, rank: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to worker ``rank``'s process, found in the launcher's ``out/log/pids_0_2.txt``
    (rows ``role rank pid log``)."""
    rows = [ln.split() for ln in (Path(out) / "log" / "pids_0_2.txt").read_text().splitlines()]
    pid = [r[2] for r in rows if r[:2] == ["worker", str(rank)]][0]
    os.kill(int(pid), sig)
