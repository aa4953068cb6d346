"""Start this server's ranks of a distributed job described by an HCCL rank table, and watch them.

Command-line front: ``scripts/run_distribute.sh``, with MindFormers' argument order
(``scripts/run_distribute.sh`` of MindFormers)::

    bash scripts/run_distribute.sh RANK_TABLE_FILE CONFIG_PATH [START,END] MODE [RANK_SIZE] [extra args...]

``[START,END]`` selects global ranks START..END-1 (END exclusive, as in MindFormers; ``[0,8)`` is
accepted too); MODE is train|finetune|eval|predict and is passed as ``--run_mode``; RANK_SIZE is
the total number of ranks of the job (default END-START, MindFormers' single-machine form) and
must equal the number of devices in the rank table. The extra arguments are passed on verbatim.

Before anything starts, the config is read as the ranks will read it (``msllm.config.load_config``
with ``--run_mode MODE``, ``MSLLM_OUTPUT_DIR`` and, for ``run_msllm.py``, the extra arguments as
overrides): an unknown MODE (``msllm.config.RUN_MODES``), an invalid config, and, for
``run_msllm.py``, what it would refuse on every rank (:func:`check_entry_accepts`) stop the
launch with one error.

For each rank i in START..END-1 one process runs, with the launcher's working directory::

    PYTHON ENTRY --config ABS_CONFIG --run_mode MODE [--output_dir=ABS(MSLLM_OUTPUT_DIR)] [extra args]

where PYTHON is the interpreter running the launcher and ENTRY is ``run_msllm.py`` in the repo
root (env ``MSLLM_ENTRY`` overrides it with another script path). Its stdout and stderr go to
``OUTPUT/log/rank_{i}/msllm.log``; OUTPUT is env ``MSLLM_OUTPUT_DIR`` if set, else the config's
``output_dir`` (relative to the working directory, as the ranks resolve it), printed at start.
With ``only_save_strategy: True`` (``run_msllm.py``) no cluster is formed: no scheduler, and each
rank writes only its own strategy file (:func:`msllm.parallel.strategy.save_strategy_for_run`).
Each process gets its own session (process group), so a Ctrl-C reaches only the launcher, which
then forwards SIGTERM.

Per-rank environment. The device target is the config's ``context.device_target`` (YAML; env
``MSLLM_DEVICE_TARGET`` overrides; default CPU).

* Ascend (MindFormers' rank-table startup): ``RANK_TABLE_FILE`` (absolute path), ``RANK_ID=i``,
  ``RANK_SIZE``, ``DEVICE_ID`` = the table's device_id of rank i, ``DEVICE_NUM`` = END-START.
  Inherited ``MS_ROLE``, ``MS_SCHED_HOST``, ``MS_SCHED_PORT``, ``MS_WORKER_NUM``, ``MS_NODE_ID``
  are removed (with ``MS_ROLE`` set MindSpore would use its dynamic cluster instead of the table).
* CPU / GPU (MindSpore dynamic cluster, "Dynamic Cluster Startup" in the MindSpore tutorials):
  ``MS_ROLE=MS_WORKER``, ``MS_WORKER_NUM=RANK_SIZE``, ``MS_SCHED_HOST`` = server_id of the server
  holding rank 0 (the first server for every table ``hccl_tools``/``merge_hccl`` write),
  ``MS_SCHED_PORT`` = env ``MS_SCHED_PORT`` or 8118, ``MS_NODE_ID=i`` (MindSpore then gives the
  process rank i), plus ``RANK_ID``, ``RANK_SIZE``, ``DEVICE_ID``, ``DEVICE_NUM`` as on Ascend;
  an inherited ``RANK_TABLE_FILE`` is removed. The invocation whose range holds rank 0 also starts
  the scheduler (same command, ``MS_ROLE=MS_SCHED``, no ``MS_NODE_ID``/``RANK_ID``/``DEVICE_ID``),
  logging to ``OUTPUT/log/scheduler/msllm.log``; it first checks that ``MS_SCHED_HOST`` is an
  address of this machine (the scheduler binds it; MindSpore fails at once otherwise) and that
  the port is free. Workers only connect to the scheduler: their own address is the local end of
  that connection, and the scheduler gives each worker a port range (8118+256*k ...).

Then ``OUTPUT/log/pids_{START}_{END}.txt`` lists ``role rank pid log`` per process (scheduler rank
is ``-``) and the launcher waits (env ``MSLLM_NO_WAIT=1``: return at once, as MindFormers does).
If a process exits non-zero, the launcher names it, its exit code and log (with the log's last
lines), sends SIGTERM to the others of this invocation, SIGKILL after ``MSLLM_KILL_TIMEOUT``
seconds (default 30), and exits 1. SIGINT/SIGTERM to the launcher are forwarded the same way
(exit 130/143). Exit 0 only if every process exited 0. Usage errors exit 2 (:func:`cli_main`).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from msllm.cluster.rank_table import RankTable, load_rank_table, parse_device_range
from msllm.config import RUN_MODES, RunConfig, load_config
from msllm.errors import MsllmError, cli_main
from msllm.fileio import atomic_open

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_ENTRY = os.path.join(REPO_ROOT, "run_msllm.py")
DEVICE_TARGETS = {"ascend": "Ascend", "cpu": "CPU", "gpu": "GPU"}
DEFAULT_SCHED_PORT = 8118
DEFAULT_KILL_TIMEOUT = 30.0
TAIL_LINES = 20
LOG_NAME = "msllm.log"
USAGE = ("usage: bash scripts/run_distribute.sh RANK_TABLE_FILE CONFIG_PATH [START,END] "
         f"{'|'.join(RUN_MODES)} [RANK_SIZE] [extra args for run_msllm.py ...]")
#: Variables of MindSpore's dynamic cluster; removed from the environment of Ascend ranks.
DYNAMIC_CLUSTER_VARS = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID")


@dataclass
class ProcessSpec:
    """One process to start: ``role`` is "scheduler" or "worker"; ``rank``/``device_id`` None for the scheduler."""

    role: str
    rank: Optional[int]
    device_id: Optional[int]
    log_path: str
    env: Dict[str, str]

    @property
    def label(self) -> str:
        """``rank N`` or ``scheduler``, for messages."""
        return "scheduler" if self.rank is None else f"rank {self.rank}"


@dataclass
class LaunchPlan:
    """Everything :func:`run_plan` needs, computed and checked by :func:`make_plan` (no side effects)."""

    rank_table_path: str
    table: RankTable
    config_path: str
    start: int
    end: int
    run_mode: str
    rank_size: int
    device_target: str
    command: List[str]
    output_dir: str
    output_dir_source: str = "the config"
    processes: List[ProcessSpec] = field(default_factory=list)
    sched_host: Optional[str] = None
    sched_port: Optional[int] = None
    cluster: bool = True

    @property
    def pid_file(self) -> str:
        """``OUTPUT/log/pids_{START}_{END}.txt``."""
        return os.path.join(self.output_dir, "log", f"pids_{self.start}_{self.end}.txt")


# --------------------------------------------------------------------------- argument checks


def parse_rank_range(text: str, rank_size: int) -> Tuple[int, int]:
    """Parse ``"[START,END]"`` (or ``"[START,END)"``): ranks START..END-1, as MindFormers
    (:func:`msllm.cluster.rank_table.parse_device_range`).

    Raises :class:`MsllmError` if the form is wrong, START >= END, or END > ``rank_size``.
    """
    start, end = parse_device_range(text, "DEVICE_RANGE", "[START,END] (ranks START..END-1, e.g. [0,8])")
    if end > rank_size:
        raise MsllmError(
            f"DEVICE_RANGE '{text}' selects ranks {start}..{end - 1}, outside the ranks 0..{rank_size - 1} "
            f"of RANK_SIZE {rank_size}"
        )
    return start, end


def read_device_target(config_path: str, environ: Mapping[str, str]) -> str:
    """The device target: env ``MSLLM_DEVICE_TARGET``, else the config's ``context.device_target``, else CPU.

    Returns "Ascend", "CPU" or "GPU". Raises :class:`MsllmError` naming the file or variable for an
    unreadable config or an unknown target.
    """
    override = environ.get("MSLLM_DEVICE_TARGET", "").strip()
    if override:
        if override.lower() not in DEVICE_TARGETS:
            raise MsllmError(f"MSLLM_DEVICE_TARGET is '{override}'; expected Ascend, CPU or GPU")
        return DEVICE_TARGETS[override.lower()]
    try:
        with open(config_path, "r", encoding="utf-8") as fh:
            config = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise MsllmError(f"config {config_path}: not valid YAML ({exc})") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise MsllmError(f"config {config_path}: the top level must be a mapping")
    context = config.get("context") or {}
    if not isinstance(context, dict):
        raise MsllmError(f"config {config_path}: 'context' must be a mapping")
    target = context.get("device_target")
    if target is None:
        return "CPU"
    if str(target).lower() not in DEVICE_TARGETS:
        raise MsllmError(f"config {config_path}: context.device_target is '{target}'; expected Ascend, CPU or GPU")
    return DEVICE_TARGETS[str(target).lower()]


def _env_number(environ: Mapping[str, str], name: str, default, kind, low, high):
    """Read a numeric env variable in [low, high]; :class:`MsllmError` naming it if malformed."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise MsllmError(f"{name} is '{raw}'; expected a number in {low}..{high}") from None
    if not low <= value <= high:
        raise MsllmError(f"{name} is {raw}; expected a number in {low}..{high}")
    return value


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


def run_config_of(config_path: str, entry_args: Sequence[str]) -> RunConfig:
    """The :class:`RunConfig` the ranks will run: ``config_path`` with the entry's overrides
    (``--run_mode``, ``--output_dir``, and for ``run_msllm.py`` the extra ``--section.key=value``
    arguments, parsed as :func:`msllm.cli.split_overrides` does). Raises the config's own
    :class:`MsllmError` (unknown key, wrong type, unknown run_mode ...)."""
    from msllm.cli import parse_entry_args

    _, overrides = parse_entry_args(list(entry_args), config_required=False)
    return load_config(config_path, overrides)


def check_entry_accepts(cfg: RunConfig, config_path: str, rank_size: int) -> None:
    """Refuse before starting anything what ``run_msllm.py`` would refuse on every rank: a
    training layout whose device count differs from RANK_SIZE, ``finetune`` without
    ``load_checkpoint``, a layout the device cannot train (:func:`check_device_support`)."""
    from msllm.cluster.context import check_device_support

    pc = cfg.parallel_config
    training = cfg.run_mode in ("train", "finetune")
    if (training or cfg.only_save_strategy) and pc.device_num != rank_size:
        raise MsllmError(f"config {config_path}: parallel_config data_parallel x model_parallel x pipeline_stage = "
                         f"{pc.data_parallel} x {pc.model_parallel} x {pc.pipeline_stage} = {pc.device_num} "
                         f"rank(s), but RANK_SIZE is {rank_size}; change the layout (e.g. "
                         f"--parallel_config.data_parallel=...) or the rank table")
    if cfg.only_save_strategy:
        return
    if cfg.run_mode == "finetune" and not cfg.load_checkpoint:
        raise MsllmError(f"config {config_path}: run_mode finetune needs load_checkpoint (the pretrained "
                         "weights to start from)")
    if training:
        check_device_support(cfg)


# --------------------------------------------------------------------------- planning


def make_plan(argv: Sequence[str], environ: Mapping[str, str], cwd: str) -> LaunchPlan:
    """Check the arguments and build the plan: commands, environments and log paths of every process.

    ``argv``: ``RANK_TABLE CONFIG [START,END] MODE [RANK_SIZE] [extra...]``; ``environ``: the
    launcher's environment; ``cwd``: where relative paths are resolved. Raises
    :class:`MsllmError` with one clear message for the first problem found.
    """
    argv = list(argv)
    if len(argv) < 4:
        raise MsllmError(f"expected at least 4 arguments, got {len(argv)}\n{USAGE}")
    table_arg, config_arg, range_arg, run_mode = argv[:4]
    rest = argv[4:]
    if run_mode not in RUN_MODES:
        raise MsllmError(f"MODE '{run_mode}' must be one of {', '.join(RUN_MODES)}\n{USAGE}")
    rank_size: Optional[int] = None
    if rest and not rest[0].startswith("-"):
        if not re.fullmatch(r"\d+", rest[0]) or int(rest[0]) < 1:
            raise MsllmError(f"RANK_SIZE '{rest[0]}' must be a positive integer\n{USAGE}")
        rank_size = int(rest.pop(0))
    extra = rest

    table_path = os.path.abspath(os.path.join(cwd, table_arg))
    table = load_rank_table(table_path)
    if rank_size is None:  # MindFormers' single-machine form: RANK_SIZE = END - START
        try:
            first, last = parse_device_range(range_arg)
            rank_size = last - first
        except MsllmError:  # reported with the launcher's wording by parse_rank_range below
            rank_size = table.rank_size
    if table.rank_size != rank_size:
        raise MsllmError(f"rank table {table_path} has {table.rank_size} devices but RANK_SIZE is {rank_size}")
    start, end = parse_rank_range(range_arg, rank_size)

    config_path = os.path.abspath(os.path.join(cwd, config_arg))
    if not os.path.isfile(config_path):
        raise MsllmError(f"config file {config_path} does not exist (CONFIG_PATH '{config_arg}')")
    device_target = read_device_target(config_path, environ)

    entry = environ.get("MSLLM_ENTRY", "").strip() or DEFAULT_ENTRY
    entry = os.path.abspath(os.path.join(cwd, entry))
    if not os.path.isfile(entry):
        raise MsllmError(f"entry program {entry} does not exist (set MSLLM_ENTRY to the script to run)")

    out_env = environ.get("MSLLM_OUTPUT_DIR", "").strip()
    entry_args = ["--run_mode", run_mode] + ([f"--output_dir={os.path.abspath(os.path.join(cwd, out_env))}"]
                                             if out_env else [])
    is_msllm = entry == DEFAULT_ENTRY
    config = run_config_of(config_path, entry_args + extra if is_msllm else entry_args)
    if is_msllm:
        check_entry_accepts(config, config_path, rank_size)
    output_dir = os.path.abspath(os.path.join(cwd, config.output_dir))
    command = [sys.executable, entry, "--config", config_path] + entry_args + extra

    base = dict(environ)
    paths = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        base["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + paths)
    common = {"RANK_SIZE": str(rank_size), "DEVICE_NUM": str(end - start)}

    plan = LaunchPlan(rank_table_path=table_path, table=table, config_path=config_path, start=start, end=end,
                      run_mode=run_mode, rank_size=rank_size, device_target=device_target, command=command,
                      output_dir=output_dir, output_dir_source="MSLLM_OUTPUT_DIR" if out_env else "the config")
    log_dir = os.path.join(output_dir, "log")
    if device_target == "Ascend":
        for var in DYNAMIC_CLUSTER_VARS:
            base.pop(var, None)
        for rank in range(start, end):
            device = table.device_of_rank(rank)
            env = dict(base, RANK_TABLE_FILE=table_path, RANK_ID=str(rank), DEVICE_ID=str(device.device_id), **common)
            plan.processes.append(ProcessSpec("worker", rank, device.device_id,
                                              os.path.join(log_dir, f"rank_{rank}", LOG_NAME), env))
        return plan

    base.pop("RANK_TABLE_FILE", None)
    if is_msllm and config.only_save_strategy:  # no process joins a cluster: no scheduler
        plan.cluster = False
        for var in DYNAMIC_CLUSTER_VARS:
            base.pop(var, None)
        for rank in range(start, end):
            device = table.device_of_rank(rank)
            env = dict(base, RANK_ID=str(rank), DEVICE_ID=str(device.device_id), **common)
            plan.processes.append(ProcessSpec("worker", rank, device.device_id,
                                              os.path.join(log_dir, f"rank_{rank}", LOG_NAME), env))
        return plan
    plan.sched_host = table.server_of_rank(0).server_id
    plan.sched_port = _env_number(environ, "MS_SCHED_PORT", DEFAULT_SCHED_PORT, int, 1024, 65535)
    cluster = {"MS_WORKER_NUM": str(rank_size), "MS_SCHED_HOST": plan.sched_host,
               "MS_SCHED_PORT": str(plan.sched_port)}
    if start == 0:
        env = dict(base, MS_ROLE="MS_SCHED", **cluster, **common)
        for var in ("MS_NODE_ID", "RANK_ID", "DEVICE_ID"):
            env.pop(var, None)
        plan.processes.append(ProcessSpec("scheduler", None, None, os.path.join(log_dir, "scheduler", LOG_NAME), env))
    for rank in range(start, end):
        device = table.device_of_rank(rank)
        env = dict(base, MS_ROLE="MS_WORKER", MS_NODE_ID=str(rank), RANK_ID=str(rank),
                   DEVICE_ID=str(device.device_id), **cluster, **common)
        plan.processes.append(ProcessSpec("worker", rank, device.device_id,
                                          os.path.join(log_dir, f"rank_{rank}", LOG_NAME), env))
    return plan


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


# --------------------------------------------------------------------------- running


@dataclass
class Running:
    """A started process and its spec."""

    spec: ProcessSpec
    popen: subprocess.Popen


class _Signals:
    """Record SIGINT/SIGTERM to the launcher instead of dying, so children can be stopped first."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._old = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def start_processes(plan: LaunchPlan, cwd: str) -> List[Running]:
    """Start every process of ``plan`` (scheduler first), each in its own session, output to its log.

    If starting one fails, those already started are terminated and the error propagates.
    """
    running: List[Running] = []
    try:
        for spec in plan.processes:
            os.makedirs(os.path.dirname(spec.log_path), exist_ok=True)
            with open(spec.log_path, "wb") as log:
                popen = subprocess.Popen(plan.command, cwd=cwd, env=spec.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


def terminate(running: Sequence[Running], kill_timeout: float, signals: Optional[_Signals] = None) -> None:
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
    with _Signals() as signals:
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


def run_plan(plan: LaunchPlan, environ: Mapping[str, str], cwd: str) -> int:
    """Start the processes of ``plan``, record their pids, print them, then wait (unless MSLLM_NO_WAIT)."""
    kill_timeout = _env_number(environ, "MSLLM_KILL_TIMEOUT", DEFAULT_KILL_TIMEOUT, float, 0, 86400)
    check_scheduler_address(plan)
    table = plan.table
    where = (f"scheduler {plan.sched_host}:{plan.sched_port}" if plan.sched_host else
             f"RANK_TABLE_FILE {plan.rank_table_path}" if plan.cluster else "no cluster: only_save_strategy")
    print(f"rank table {plan.rank_table_path}: {table.rank_size} ranks on {table.server_count} servers; "
          f"starting ranks {plan.start}..{plan.end - 1} ({plan.device_target}, {where}, run_mode {plan.run_mode})",
          flush=True)
    print(f"logs: {os.path.join(plan.output_dir, 'log')} (output_dir from {plan.output_dir_source})", flush=True)
    with _Signals() as signals:  # no Ctrl-C between two starts: it would orphan the started ones
        running = start_processes(plan, cwd)
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
    if _truthy(environ.get("MSLLM_NO_WAIT")):
        print("MSLLM_NO_WAIT is set: not waiting; the processes keep running", flush=True)
        return 0
    return wait_all(running, kill_timeout)


def launch(argv: Sequence[str], environ: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> int:
    """Check the arguments, start this invocation's ranks and (by default) wait; return the exit status."""
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    plan = make_plan(argv, environ, cwd)
    return run_plan(plan, environ, cwd)


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command-line entry (``python -m msllm.cluster.launch ARGS``, via ``scripts/run_distribute.sh``)."""
    sys.exit(launch(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
