"""Per-test durations of a full run, written to a file the project commits (issue #31: the slow
tests stay visible as the suite grows). A pytest plugin (registered by tests/conftest.py) that
acts only when ``MSLLM_DURATIONS_FILE`` names the file (``make test`` sets it, so CI's run and
a developer's full run write it; a run of a few tests leaves it alone).

Under pytest-xdist (``tests/run_parts.sh`` runs each part on 2 workers) the tests run in worker
processes: each worker measures its own resident memory around each test (before setup, after
teardown) and sends it with the teardown report; the controller, which sees every report, writes
the one file with the worker of each test (``gw0``, ``gw1``; ``main`` without xdist). Besides the
text file it writes ``<file>.json`` (the same rows), which ``python tests/helpers/durations.py join``
merges across the parts of a run into the committed tests/durations.txt.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time

import pytest

ENV = "MSLLM_DURATIONS_FILE"
RSS = "msllm_rss_kb"        # user property of a teardown report: (KiB before setup, KiB after teardown)
WORKER = "msllm_worker"     # user property: the process that ran the test


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _rss_kb() -> int:
    """This process's resident memory now, KiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


class Probe:
    """In the process that runs the tests (an xdist worker, or pytest itself): its RSS before each
    test's setup and after its teardown, attached to the teardown report (user properties travel
    with the report from a worker to the controller)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        item._msllm_rss0 = _rss_kb()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "teardown":
            before = getattr(item, "_msllm_rss0", 0)
            report.user_properties = list(report.user_properties) + [(RSS, (before, _rss_kb())), (WORKER, _worker())]


class Durations:
    """Collects (seconds, phase, test id, outcome, worker) of every setup / call / teardown, and how
    much the memory of the process that ran each test grew across it (in-process graphs, models
    and caches that stay: the memory the multi-process tests that follow no longer have)."""

    def __init__(self, path: str):
        self.path, self.rows, self.started = path, [], time.time()
        self.growth, self.last_rss, self.workers = [], {}, set()
        self.cpu_start = _cpu_times()

    def pytest_runtest_logreport(self, report):
        props = dict(report.user_properties)
        node = getattr(report, "node", None)           # xdist: the worker the report came from
        worker = props.get(WORKER) or (node.gateway.id if node is not None else _worker())
        self.workers.add(worker)
        if report.when == "call" or report.duration >= 0.5:
            self.rows.append((report.duration, report.when, report.nodeid, report.outcome, worker))
        if report.when == "teardown" and RSS in props:
            before, after = props[RSS]
            self.growth.append((after - before, report.nodeid, worker))
            self.last_rss[worker] = after

    def pytest_sessionfinish(self, session, exitstatus):
        args = list(session.config.invocation_params.args)
        files = [a for a in args if a.endswith(".py") and os.path.isfile(a)]   # tests/run_parts.sh lists a part's files
        if len(files) > 3:
            args = [a for a in args if a not in files] + [f"({len(files)} test files)"]
        part = {"args": args, "wall": time.time() - self.started,
                "exit": int(exitstatus), "workers": sorted(self.workers), "rows": self.rows, "growth": self.growth,
                "rss_end": self.last_rss, "finished": time.time(), "cpu_busy": _busy_share(self.cpu_start, _cpu_times())}
        _write(self.path + ".json", json.dumps(part) + "\n")
        _write(self.path, render([part], part["wall"]))


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _cpu_times():
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat's ``cpu`` line (None
    where there is no /proc/stat): busy = total - idle - iowait."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(fields[:8])            # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total


def _busy_share(start, end):
    """The share of the machine's CPU time that was busy between two :func:`_cpu_times` readings
    (every process, not only the tests'): below 1, cores stood idle (tests waiting on sockets,
    timeouts, a worker with nothing left to take)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def render(parts: list, wall: float) -> str:
    """The text of tests/durations.txt for one or more pytest processes (the parts of one run)."""
    rows = [r for p in parts for r in p["rows"]]
    calls = [r for r in rows if r[1] == "call"]
    outcomes = {o: sum(1 for r in calls if r[3] == o) for o in ("passed", "failed", "skipped")}
    exit_codes = ",".join(str(p["exit"]) for p in parts)
    end = max((p.get("finished", time.time()) for p in parts), default=time.time())
    lines = [f"# msllm test durations, one full run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(end))}, "
             f"{_cpu()}, {os.cpu_count()} cores",
             f"# wall {wall:.0f} s; " + ", ".join(f"{n} {o}" for o, n in outcomes.items()) + f"; exit {exit_codes}"]
    for i, p in enumerate(parts, 1):
        rss = ", ".join(f"{w} {kb / 1024:.0f} MiB" for w, kb in sorted(p["rss_end"].items()))
        busy = p.get("cpu_busy")
        lines.append(f"# {p.get('name', f'part {i}')}: {p['wall']:.0f} s on {len(p['workers'])} worker(s), exit {p['exit']} "
                     f"({' '.join(p['args'])}); "
                     f"CPU busy {'%.0f%%' % (100 * busy) if busy is not None else 'not measured'} (whole machine); "
                     f"RSS at the end: {rss or 'not measured'}")
    growth = [g for p in parts for g in p["growth"]]
    lines.append("# the 15 tests the RSS of the process that ran them grew most across:")
    lines += [f"#   +{kb / 1024:7.0f} MiB  {w:<17}  {nid}" for kb, nid, w in sorted(growth, reverse=True)[:15]]
    lines.append("# seconds  phase     worker             test (calls, and setups/teardowns of 0.5 s or more), slowest first")
    lines += [f"{d:9.2f}  {when:<8}  {w:<17}  {nid}" for d, when, nid, _, w in sorted(rows, key=lambda r: -r[0])]
    return "\n".join(lines) + "\n"


def join(out: str, wall: float, paths: list) -> None:
    """Writes ``out`` from the ``.json`` records of the parts ``paths`` (missing ones skipped)."""
    parts = []
    for path in paths:
        if os.path.exists(path + ".json"):
            with open(path + ".json", encoding="utf-8") as fh:
                part = json.load(fh)
            # workers of different pytest processes are different processes: part1.gw0, part1-serial.main
            n = os.path.basename(path).rsplit(".", 1)[-1] if "." in os.path.basename(path) else f"p{len(parts) + 1}"
            part["name"] = n
            part["rows"] = [r[:4] + [f"{n}.{r[4]}"] for r in part["rows"]]
            part["growth"] = [g[:2] + [f"{n}.{g[2]}"] for g in part["growth"]]
            parts.append(part)
    _write(out, render(parts, wall))


def slowest_first(paths: list, previous: str) -> list:
    """The test files under ``paths`` (files or folders), those that took longest in ``previous``
    (a durations file) first, files it does not list (new ones) before all: with ``--dist
    loadfile --no-loadscope-reorder`` xdist hands files out in this order, so the long ones start
    early and no long file starts last while the other worker idles."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            for d, _, names in sorted(os.walk(path)):
                files += [os.path.join(d, n) for n in sorted(names) if n.startswith("test_") and n.endswith(".py")]
        else:
            files.append(path)
    seconds = {}
    if os.path.exists(previous):
        with open(previous, encoding="utf-8") as fh:
            for line in fh:
                m = re.match(r"\s*([0-9.]+)\s.*?(tests/\S+?\.py)::", line)
                if m:
                    seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    return sorted(files, key=lambda f: -seconds.get(os.path.normpath(f), float("inf")))


def register(config) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    config.pluginmanager.register(Probe(), "msllm-durations-probe")
    if not hasattr(config, "workerinput"):       # pytest itself, or xdist's controller: writes the file
        config.pluginmanager.register(Durations(os.path.abspath(path)), "msllm-durations")


if __name__ == "__main__":
    # python tests/helpers/durations.py join OUT WALL_SECONDS PART_FILE...   (tests/run_parts.sh)
    # python tests/helpers/durations.py order PREVIOUS_DURATIONS PATH...
    if len(sys.argv) >= 4 and sys.argv[1] == "join":
        join(sys.argv[2], float(sys.argv[3]), sys.argv[4:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "order":
        print(" ".join(slowest_first(sys.argv[3:], sys.argv[2])))
    else:
        sys.exit("usage: durations.py join OUT WALL_SECONDS PART_FILE... | order PREVIOUS_DURATIONS PATH...")
