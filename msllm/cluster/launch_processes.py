"""Start the processes of a launch plan, record their pids, and watch them until they end.

Each process (plan: :mod:`msllm.cluster.launch_plan`) gets its own session (process group) and
writes stdout and stderr to its log, so a Ctrl-C reaches only the launcher, which then forwards
SIGTERM; each also gets SIGTERM when the launcher dies outright (parent-death signal), and a
launch is refused while processes of the previous one (its pids file) still run.
``OUTPUT/log/pids_{START}_{END}.txt`` lists ``role rank pid log`` per process (scheduler
rank is ``-``). If a process exits non-zero, :func:`wait_all` names it, its exit code and log
(with the log's last lines), sends SIGTERM to the others of this invocation, SIGKILL after the
kill timeout (``MSLLM_KILL_TIMEOUT``, default 30 s), and returns 1; except a process killed by
SIGSEGV after it marked its work done (``MSLLM_RANK_DONE_FILE``, :mod:`msllm.cluster.rank_done`:
MindSpore's crash at interpreter exit), which is named in a warning while the others go on; SIGINT/SIGTERM to the launcher
are forwarded the same way (128+signal: 130/143); 0 only if every process exited 0. MindFormers'
``scripts/run_distribute.sh`` starts the ranks in the background and returns at once; the msllm
launcher waits by default (``MSLLM_NO_WAIT=1`` returns at once, see :mod:`msllm.cluster.launch`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Sequence

from msllm.cluster.launch_plan import LaunchPlan, ProcessSpec
from msllm.cluster.rank_done import DONE_ENV, DONE_NAME, crashed_after_done
from msllm.fileio import atomic_open

DEFAULT_KILL_TIMEOUT = 30.0
TAIL_LINES = 20


@dataclass
class Running:
    """A started process and its spec."""

    spec: ProcessSpec
    popen: subprocess.Popen

    @property
    def done_path(self) -> str:
        """Where the process marks its work done (:mod:`msllm.cluster.rank_done`): beside its log."""
        return done_path_of(self.spec)


def done_path_of(spec: ProcessSpec) -> str:
    """The ``MSLLM_RANK_DONE_FILE`` of a process: ``done`` in the directory of its log."""
    return os.path.join(os.path.dirname(spec.log_path), DONE_NAME)


class SignalRecorder:
    """Record SIGINT/SIGTERM to the launcher instead of dying, so children can be stopped first."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._old = {}

    def __enter__(self) -> "SignalRecorder":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


PR_SET_PDEATHSIG = 1   # linux/prctl.h


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux
    ``prctl(PR_SET_PDEATHSIG)``; the trainer saves a checkpoint and exits 143 on SIGTERM)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def still_running(pid_file: str) -> list[tuple[str, int]]:
    """``(role rank, pid)`` of the processes listed in an earlier launch's ``pid_file`` that still
    run the same program (their command line names ``run_msllm.py`` or the entry; a reused pid of
    another program does not count)."""
    if not os.path.isfile(pid_file):
        return []
    alive = []
    with open(pid_file, encoding="utf-8") as fh:
        for line in fh:
            parts = line.split(" ", 3)
            if len(parts) < 3 or not parts[2].isdigit():
                continue
            try:
                with open(f"/proc/{parts[2]}/cmdline", "rb") as cmd:
                    cmdline = cmd.read().decode("utf-8", "replace")
            except OSError:
                continue
            if "--run_mode" in cmdline:
                alive.append((f"{parts[0]} {parts[1]}", int(parts[2])))
    return alive


def start_processes(plan: LaunchPlan, cwd: str, die_with_launcher: bool = True) -> List[Running]:
    """Start every process of ``plan`` (scheduler first), each in its own session, output to its log;
    with ``die_with_launcher`` each gets SIGTERM if the launcher dies, even by SIGKILL (the OOM
    killer, ``kill -9``, a lost terminal), so no rank trains on unsupervised.

    If starting one fails, those already started are terminated and the error propagates.
    """
    running: List[Running] = []
    try:
        for spec in plan.processes:
            os.makedirs(os.path.dirname(spec.log_path), exist_ok=True)
            done = done_path_of(spec)
            if os.path.exists(done):   # an earlier launch's marker must not vouch for this one
                os.remove(done)
            with open(spec.log_path, "wb") as log:
                popen = subprocess.Popen(plan.command, cwd=cwd, env=dict(spec.env, **{DONE_ENV: done}),
                                         stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent if die_with_launcher else None)
            running.append(Running(spec, popen))
    except BaseException:
        terminate(running, DEFAULT_KILL_TIMEOUT)
        raise
    return running


def write_pid_file(plan: LaunchPlan, running: Sequence[Running]) -> None:
    """Write ``role rank pid log`` per process to :attr:`LaunchPlan.pid_file` (atomically)."""
    with atomic_open(plan.pid_file) as fh:
        for r in running:
            rank = "-" if r.spec.rank is None else str(r.spec.rank)
            fh.write(f"{r.spec.role} {rank} {r.popen.pid} {r.spec.log_path}\n")


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of ``popen`` (its own session), ignoring gone processes."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            popen.send_signal(sig)
        except ProcessLookupError:
            pass


def terminate(running: Sequence[Running], kill_timeout: float, signals: Optional[SignalRecorder] = None) -> None:
    """SIGTERM every still-running process group, SIGKILL those alive after ``kill_timeout`` seconds.

    A further SIGINT/SIGTERM to the launcher while waiting (recorded in ``signals``) kills at once.
    """
    alive = [r for r in running if r.popen.poll() is None]
    for r in alive:
        _signal_group(r.popen, signal.SIGTERM)
    first = signals.received if signals else None
    deadline = time.monotonic() + kill_timeout
    while alive and time.monotonic() < deadline:
        if signals is not None and signals.received != first:
            break
        time.sleep(0.1)
        alive = [r for r in alive if r.popen.poll() is None]
    for r in alive:
        if r.popen.poll() is None:
            print(f"{r.spec.label} (pid {r.popen.pid}) still running: SIGKILL", file=sys.stderr, flush=True)
            _signal_group(r.popen, signal.SIGKILL)
    for r in running:
        try:
            r.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def describe_exit(code: int) -> str:
    """``exit code N`` or ``killed by signal NAME (N)`` for a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"killed by signal {name} ({-code})"
    return f"exit code {code}"


def tail(path: str, lines: int = TAIL_LINES) -> List[str]:
    """The last ``lines`` lines of the text file ``path`` (reads at most its last 256 KiB)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return list(deque(text.splitlines(), maxlen=lines))


def wait_all(running: Sequence[Running], kill_timeout: float, poll: float = 0.2) -> int:
    """Wait for every process; on the first failure or a signal stop the rest (see :func:`terminate`).

    Returns 0 if all exited 0, 1 if one failed, 128+signal if the launcher was signalled.
    """
    pending = list(running)
    with SignalRecorder() as signals:
        while pending:
            if signals.received is not None:
                name = signal.Signals(signals.received).name
                print(f"launcher got {name}: sending SIGTERM to {len(pending)} processes "
                      f"(SIGKILL after {kill_timeout:g} s)", file=sys.stderr, flush=True)
                terminate(pending, kill_timeout, signals)
                return 128 + signals.received
            for r in list(pending):
                code = r.popen.poll()
                if code is None:
                    continue
                pending.remove(r)
                if code == 0:
                    print(f"{r.spec.label} finished (exit code 0)", flush=True)
                    continue
                if crashed_after_done(r.done_path, r.popen.pid, code):
                    print(f"warning: {r.spec.label} (pid {r.popen.pid}) marked its work done ({r.done_path}) and "
                          f"then was {describe_exit(code)} while exiting: MindSpore 2.10's crash at interpreter "
                          f"exit (msllm/cluster/rank_done.py), counted as finished; log: {r.spec.log_path}",
                          file=sys.stderr, flush=True)
                    continue
                err = sys.stderr
                print(f"error: {r.spec.label} (pid {r.popen.pid}) failed: {describe_exit(code)}; "
                      f"log: {r.spec.log_path}", file=err)
                lines = tail(r.spec.log_path)
                print(f"---- last {len(lines)} lines of {r.spec.log_path} ----", file=err)
                for line in lines:
                    print(line, file=err)
                print("---- end of log ----", file=err, flush=True)
                others = [x for x in pending if x.popen.poll() is None]
                if others:
                    print(f"stopping {', '.join(x.spec.label for x in others)} of this invocation: SIGTERM, "
                          f"SIGKILL after {kill_timeout:g} s", file=err, flush=True)
                terminate(pending, kill_timeout, signals)
                return 1
            time.sleep(poll)
    print(f"all {len(running)} processes of this invocation finished successfully", flush=True)
    return 0
