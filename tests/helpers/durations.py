"""Per-test durations of a full run, written to a file the project commits (issue #31: the slow
tests stay visible as the suite grows). A pytest plugin (registered by tests/conftest.py) that
acts only when ``MSLLM_DURATIONS_FILE`` names the file (``make test`` sets it, so CI's run and
a developer's full run write it; a run of a few tests leaves it alone)."""

from __future__ import annotations

import os
import platform
import time

ENV = "MSLLM_DURATIONS_FILE"


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
    """This (pytest) process's resident memory now, KiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Durations:
    """Collects (seconds, phase, test id, outcome) of every setup / call / teardown, and how much
    the pytest process's resident memory grew across each test (in-process graphs, models and
    caches that stay: the memory the multi-process tests that follow no longer have)."""

    def __init__(self, path: str):
        self.path, self.rows, self.started = path, [], time.time()
        self.rss, self.growth = _rss_kb(), []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.duration >= 0.5:
            self.rows.append((report.duration, report.when, report.nodeid, report.outcome))
        if report.when == "teardown":
            now = _rss_kb()
            self.growth.append((now - self.rss, report.nodeid))
            self.rss = now

    def pytest_sessionfinish(self, session, exitstatus):
        total = time.time() - self.started
        calls = [r for r in self.rows if r[1] == "call"]
        outcomes = {o: sum(1 for r in calls if r[3] == o) for o in ("passed", "failed", "skipped")}
        lines = [f"# msllm test durations, one full run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                 f"{_cpu()}, {os.cpu_count()} cores",
                 f"# wall {total:.0f} s; " + ", ".join(f"{n} {o}" for o, n in outcomes.items()) + f"; exit {int(exitstatus)}",
                 f"# pytest process RSS at the end {self.rss / 1024:.0f} MiB; the 15 tests it grew most across:"]
        lines += [f"#   +{kb / 1024:7.0f} MiB  {nid}" for kb, nid in sorted(self.growth, reverse=True)[:15]]
        lines += ["# seconds  phase     test (calls, and setups/teardowns of 0.5 s or more), slowest first"]
        lines += [f"{d:9.2f}  {w:<8}  {nid}" for d, w, nid, _ in sorted(self.rows, key=lambda r: -r[0])]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, self.path)


def register(config) -> None:
    path = os.environ.get(ENV)
    if path:
        config.pluginmanager.register(Durations(os.path.abspath(path)), "msllm-durations")
