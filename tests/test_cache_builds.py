"""Caches built at test (or run) time stay whole when two processes ask for them at the same moment
(two pytest-xdist workers of ``make test``, the ranks of a job): exactly one process builds, the
other waits and then uses that one copy; nothing half-built or left over beside it.

Each case starts two real processes that meet at a barrier and then ask for the same cache in a
fresh ``MSLLM_CACHE``, with the slow build step (downloads, g++) swapped for a fake one that takes
a second and records who ran it: the locking and renaming code under test is msllm's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

CHILD = r'''
import json, os, sys, time
case, cache, barrier, log = sys.argv[1:5]
os.environ["MSLLM_CACHE"] = cache


def built(path):
    with open(log, "a") as f:                    # who built, and when
        f.write(json.dumps([os.getpid(), time.time()]) + "\n")
    time.sleep(1.0)                              # long enough for the other process to arrive
    os.makedirs(path, exist_ok=True)
    for i in range(3):
        with open(os.path.join(path, f"part{i}"), "w") as f:
            f.write(str(os.getpid()))


if case == "fileio":
    from msllm.fileio import build_dir_once
    ask = lambda: build_dir_once(os.path.join(cache, "thing"), built)
elif case == "smollm2":
    from msllm.convert import real_model as rm
    rm.require_libraries = lambda: None
    rm.build = lambda cache_dir, tmp, log_: built(os.path.join(tmp, rm.MODEL_NAME))
    rm.cache_problem = lambda d: None if os.path.isfile(os.path.join(d, "part2")) else "missing"
    ask = rm.ensure_smollm2
elif case == "cann_stub":
    from msllm.cluster import simulation as sim
    sim.check_version = lambda v: None
    sim.find_cann = lambda: None
    sim.plugin_digest = lambda d: "test"

    def stub_tree(root, ms_dir):
        built(root)
        open(os.path.join(root, "MSLLM_STUB"), "w").close()
    sim.build_stub_tree = stub_tree
    ask = lambda: sim.device_layer("2.10.0", "unused").root
open(f"{barrier}.{os.getpid()}", "w").close()   # imported: ready
while not os.path.exists(barrier):
    time.sleep(0.005)
print(json.dumps(ask()))
'''


@pytest.mark.parametrize("case", ["fileio", "smollm2", "cann_stub"])
def test_two_processes_asking_at_once_get_one_build(case, tmp_path):
    cache, barrier, log = tmp_path / "cache", tmp_path / "go", tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, case, str(cache), str(barrier), str(log)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.*"))) < 2:  # both imported msllm and wait at the barrier
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    barrier.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {json.loads(out.strip().splitlines()[-1]) for out, _ in outs}
    assert len(paths) == 1, paths                                   # both got the same directory
    builds = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(builds) == 1, builds                                 # built once
    path = paths.pop()
    writer = str(builds[0][0])
    parts = sorted(p for p in os.listdir(path) if p.startswith("part"))
    assert parts == ["part0", "part1", "part2"]                     # whole, and all from the builder
    assert {open(os.path.join(path, p)).read() for p in parts} == {writer}
    leftovers = [n for _, dirs, _ in os.walk(cache) for n in dirs if n.startswith(".")]
    assert leftovers == []                                          # no temporary directory left beside it
