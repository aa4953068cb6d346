"""A process of a launch says it finished its work, so the launcher can tell MindSpore's crash at
interpreter exit from a real failure.

MindSpore 2.10 on CPU clusters: now and then a process that finished everything (results written,
last log line printed, ``main`` returned 0) dies of SIGSEGV while the interpreter exits, in
MindSpore's own teardown, with no Python frame on the stack (``PYTHONFAULTHANDLER``); leaving the
cluster first (``mindspore.mint.distributed.destroy_process_group``) does not prevent it. Measured in
``benchmarks/cluster_teardown_crash.py`` (about 1 in 20 two-rank jobs in one loop, 0 in 24 in
another) and seen in full test runs; msrun workers show the same (mindspore-ai/hyper-parallel issues
#397 / #510: "segfault at process exit after the body passed").

The launcher (:mod:`msllm.cluster.launch_processes`) gives every process ``MSLLM_RANK_DONE_FILE``, a
path beside its log; :func:`mark_done` writes this process's pid there (atomically) as the last thing
``main`` does after success. A process killed by SIGSEGV whose marker holds its pid finished its
work before the crash: the launcher names it in a warning and keeps waiting for the others, which
must still exit 0 on their own. That is the open question this can only partly answer: MindSpore's
scheduler waits for every node's goodbye, sent in MindSpore's own teardown; a rank killed before
that (simulated: ``tests/cluster/cluster_allreduce_worker.py --crash_after_done 1``, an ``atexit``
SIGSEGV, with or without ``destroy_process_group`` first) makes the scheduler report the node timed
out and exit 1 about 30 s later, and the launch fails as before. The real crash comes after the
goodbye (the rank's log shows MindSpore's TCP client and server starting just before it) and leaves
the scheduler well: in 36 two-rank jobs, three at a time (``benchmarks/cluster_teardown_crash.py
--runs 36 --parallel 3``, ``benchmarks/results/cluster_teardown_crash_launcher_amd_zen4.json``), one
rank crashed so after marking its work done, and its job succeeded with the warning. Any other exit,
or a SIGSEGV without the marker, is a failure.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from msllm.fileio import atomic_open

DONE_ENV = "MSLLM_RANK_DONE_FILE"
DONE_NAME = "done"   # the marker's file name, in the directory of the process's log
TOLERATED_SIGNAL = signal.SIGSEGV


def mark_done(environ=None) -> Optional[str]:
    """Write this process's pid to the file ``MSLLM_RANK_DONE_FILE`` names (no-op when unset);
    returns the path written or None."""
    path = (os.environ if environ is None else environ).get(DONE_ENV, "").strip()
    if not path:
        return None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_open(path) as fh:
        fh.write(f"{os.getpid()}\n")
    return path


def marked_done(path: Optional[str], pid: int) -> bool:
    """True if ``path`` holds ``pid``: that process called :func:`mark_done`."""
    if not path:
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() == str(pid)
    except OSError:
        return False


def crashed_after_done(path: Optional[str], pid: int, returncode: int) -> bool:
    """True for a process (``pid``, Popen ``returncode``) killed by SIGSEGV after it marked itself
    done: MindSpore's crash at interpreter exit (module doc), not a failure of its work."""
    return returncode == -int(TOLERATED_SIGNAL) and marked_done(path, pid)
