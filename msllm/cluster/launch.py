"""Start this server's ranks of a distributed job described by an HCCL rank table, and watch them.

Command-line front: ``scripts/run_distribute.sh``, with MindFormers' argument order
(``scripts/run_distribute.sh`` of MindFormers)::

    bash scripts/run_distribute.sh RANK_TABLE_FILE CONFIG_PATH [START,END] MODE [RANK_SIZE] [extra args...]

which runs ``python -m msllm.cluster.launch ARGS``. The job is done in three steps:

1. :func:`msllm.cluster.launch_plan.make_plan` checks the arguments, the rank table and the config
   and builds the command, environment and log path of every process (the argument forms and the
   per-rank environment, Ascend rank table or MindSpore dynamic cluster, are described there).
2. Before starting a scheduler (the invocation whose range holds rank 0, CPU/GPU),
   :func:`check_scheduler_address` checks that ``MS_SCHED_HOST`` is an address of this machine
   (the scheduler binds it; MindSpore fails at once otherwise) and that the port is free.
3. :func:`run_plan` prints what starts where, starts the processes and writes the pid file
   (:mod:`msllm.cluster.launch_processes`), then waits (env ``MSLLM_NO_WAIT=1``: return at once,
   as MindFormers does). If a process exits non-zero the others of this invocation get SIGTERM,
   SIGKILL after ``MSLLM_KILL_TIMEOUT`` seconds (default 30), and the launcher exits 1;
   SIGINT/SIGTERM to the launcher are forwarded the same way (exit 130/143). Exit 0 only if every
   process exited 0. Usage errors exit 2 (:func:`cli_main`).
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from typing import Mapping, Optional, Sequence

from msllm.cluster.launch_plan import LaunchPlan, env_number, make_plan
from msllm.cluster.launch_processes import (
    DEFAULT_KILL_TIMEOUT,
    SignalRecorder,
    start_processes,
    still_running,
    terminate,
    wait_all,
    write_pid_file,
)
from msllm.errors import MsllmError, cli_main


def _truthy(value: Optional[str]) -> bool:
    """Whether an env flag is set to 1/true/yes/on."""
    return str(value or "").strip().lower() in ("1", "true", "yes", "on")


def is_local_address(host: str) -> bool:
    """Whether ``host`` (an IPv4 address) belongs to this machine: can a socket bind to it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError:
            return False
    return True


def is_port_free(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` (bind probe with SO_REUSEADDR, as a server would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def check_scheduler_address(plan: LaunchPlan) -> None:
    """Before starting a scheduler: its host must be local and its port free (else :class:`MsllmError`)."""
    if not any(p.role == "scheduler" for p in plan.processes):
        return
    host, port = plan.sched_host, plan.sched_port
    if not is_local_address(host):
        raise MsllmError(
            f"rank table {plan.rank_table_path}: the scheduler must run on {host} (the server of rank 0, "
            f"MS_SCHED_HOST) but {host} is not an address of this machine; run the invocation whose "
            f"range starts at rank 0 on that server"
        )
    if not is_port_free(host, port):
        raise MsllmError(f"MS_SCHED_PORT {port} is already in use on {host}; set MS_SCHED_PORT to a free port")


def run_plan(plan: LaunchPlan, environ: Mapping[str, str], cwd: str) -> int:
    """Start the processes of ``plan``, record their pids, print them, then wait (unless MSLLM_NO_WAIT)."""
    kill_timeout = env_number(environ, "MSLLM_KILL_TIMEOUT", DEFAULT_KILL_TIMEOUT, float, 0, 86400)
    check_scheduler_address(plan)
    table = plan.table
    where = (f"scheduler {plan.sched_host}:{plan.sched_port}" if plan.sched_host else
             f"RANK_TABLE_FILE {plan.rank_table_path}" if plan.cluster else "no cluster: only_save_strategy")
    print(f"rank table {plan.rank_table_path}: {table.rank_size} ranks on {table.server_count} servers; "
          f"starting ranks {plan.start}..{plan.end - 1} ({plan.device_target}, {where}, run_mode {plan.run_mode})",
          flush=True)
    print(f"logs: {os.path.join(plan.output_dir, 'log')} (output_dir from {plan.output_dir_source})", flush=True)
    alive = still_running(plan.pid_file)
    if alive:
        raise MsllmError(f"the previous launch of these ranks still runs ({plan.pid_file}: "
                         f"{', '.join(f'{who} pid {pid}' for who, pid in alive)}); stop it first "
                         f"(kill {' '.join(str(pid) for _, pid in alive)}) or use another output_dir")
    no_wait = _truthy(environ.get("MSLLM_NO_WAIT"))
    with SignalRecorder() as signals:  # no Ctrl-C between two starts: it would orphan the started ones
        running = start_processes(plan, cwd, die_with_launcher=not no_wait)
        write_pid_file(plan, running)
        for r in running:
            if r.spec.rank is None:
                print(f"scheduler: pid {r.popen.pid}, log {r.spec.log_path}", flush=True)
            else:
                print(f"rank {r.spec.rank}: device {r.spec.device_id}, pid {r.popen.pid}, log {r.spec.log_path}",
                      flush=True)
        print(f"pids: {plan.pid_file}", flush=True)
        if signals.received is not None:
            terminate(running, kill_timeout)
            return 128 + signals.received
    if no_wait:
        print("MSLLM_NO_WAIT is set: not waiting; the processes keep running", flush=True)
        return 0
    return wait_all(running, kill_timeout)


def launch(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> int:
    """Check the arguments, start this invocation's ranks and (by default) wait; return the exit status."""
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    if any(a == "--sim_level" or a.startswith("--sim_level=") for a in argv):
        raise MsllmError("--sim_level is the dry-run, which starts no rank: run it through scripts/run_distribute.sh "
                         "(or python -m msllm.dryrun.launch ARGS)")
    plan = make_plan(argv, environ, cwd)
    return run_plan(plan, environ, cwd)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command-line entry (``python -m msllm.cluster.launch ARGS``, via ``scripts/run_distribute.sh``)."""
    sys.exit(launch(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
