"""The launcher's reading of how its processes ended (msllm/cluster/launch_processes.py ``wait_all``
with msllm/cluster/rank_done.py): a process killed by SIGSEGV after it marked its work done counts
as finished (MindSpore 2.10's crash at interpreter exit) while the others must still end well; any
other non-zero end fails the launch. Plain Python processes stand in for the ranks (no MindSpore)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from msllm.cluster.launch_plan import ProcessSpec
from msllm.cluster.launch_processes import Running, done_path_of, wait_all
from msllm.cluster.rank_done import DONE_ENV, crashed_after_done, mark_done, marked_done

BODY = {   # what each stand-in process does
    "ok": "pass",
    "fail": "sys.exit(3)",
    "done_then_segv": "mark_done(); os.kill(os.getpid(), signal.SIGSEGV)",
    "segv": "os.kill(os.getpid(), signal.SIGSEGV)",
    "done_then_fail": "mark_done(); sys.exit(1)",
}


def start(tmp_path, name: str, kind: str) -> Running:
    """A stand-in process ``name`` doing ``kind`` (BODY), its log and done marker under tmp_path/name."""
    spec = ProcessSpec("worker", len(os.listdir(tmp_path)), 0, str(tmp_path / name / "msllm.log"), {})
    os.makedirs(tmp_path / name)
    code = ("import os, signal, sys; sys.path.insert(0, %r); from msllm.cluster.rank_done import mark_done; %s"
            % (os.getcwd(), BODY[kind]))
    env = dict(os.environ, **{DONE_ENV: done_path_of(spec)})
    with open(spec.log_path, "wb") as log:
        popen = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=subprocess.STDOUT)
    return Running(spec, popen)


@pytest.mark.parametrize("kinds, expect", [
    (["ok", "done_then_segv"], 0),      # the crash after the work: finished, with a warning
    (["ok", "segv"], 1),                # no marker: a crash during the work
    (["ok", "done_then_fail"], 1),      # an exit code is the program's own verdict
    (["fail", "done_then_segv"], 1),    # the others must still end well
    (["ok", "fail"], 1),
])
def test_only_a_segfault_after_the_marker_counts_as_finished(tmp_path, capsys, kinds, expect):
    running = [start(tmp_path, f"p{i}", k) for i, k in enumerate(kinds)]
    for r in running:    # every one ended before the launcher looks: the verdict does not race
        r.popen.wait()
    assert wait_all(running, kill_timeout=5, poll=0.01) == expect
    err = capsys.readouterr().err
    # the warning names the crash it forgave (a failure seen first ends the wait before it)
    assert ("counted as finished" in err) == (kinds == ["ok", "done_then_segv"]), err


def test_the_marker_holds_the_pid_of_the_process_that_wrote_it(tmp_path):
    path = str(tmp_path / "x" / "done")
    assert mark_done({}) is None                       # not under the launcher: nothing written
    assert mark_done({DONE_ENV: path}) == path
    assert marked_done(path, os.getpid())
    assert not marked_done(path, os.getpid() + 1)       # another process's (a reused directory)
    assert not marked_done(str(tmp_path / "missing"), os.getpid())
    assert crashed_after_done(path, os.getpid(), -11)
    assert not crashed_after_done(path, os.getpid(), -6)   # only SIGSEGV, the crash seen
    assert not crashed_after_done(path, os.getpid(), 1)
