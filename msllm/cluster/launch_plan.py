"""Turn the launcher's arguments into a checked plan: the command, environment and log of every process.

Arguments, in MindFormers' order (``scripts/run_distribute.sh`` of MindFormers)::

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
  logging to ``OUTPUT/log/scheduler/msllm.log``. Workers only connect to the scheduler: their own
  address is the local end of that connection, and the scheduler gives each worker a port range
  (8118+256*k ...).

Nothing here starts a process or opens a socket: :func:`make_plan` only reads the rank table and
the config. Starting and watching the processes: :mod:`msllm.cluster.launch_processes`; the
entry that ties both together: :mod:`msllm.cluster.launch`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from msllm.cluster.rank_table import load_rank_table
from msllm.cluster.rank_table_devices import parse_device_range
from msllm.cluster.rank_table_format import RankTable
from msllm.config import RUN_MODES, TRAINING_MODES, RunConfig, load_config
from msllm.errors import MsllmError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_ENTRY = os.path.join(REPO_ROOT, "run_msllm.py")
DEVICE_TARGETS = {"ascend": "Ascend", "cpu": "CPU", "gpu": "GPU"}
DEFAULT_SCHED_PORT = 8118
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
    """Everything :func:`msllm.cluster.launch.run_plan` needs, computed and checked by :func:`make_plan`
    (no side effects)."""

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


def env_number(environ: Mapping[str, str], name: str, default, kind, low, high):
    """Read a numeric env variable as ``kind`` (int or float) in [low, high]; ``default`` if unset or empty.

    Raises :class:`MsllmError` naming the variable if it is malformed or out of range.
    """
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


def run_config_of(config_path: str, entry_args: Sequence[str]) -> RunConfig:
    """The :class:`RunConfig` the ranks will run: ``config_path`` with the entry's overrides
    (``--run_mode``, ``--output_dir``, and for ``run_msllm.py`` the extra ``--section.key=value``
    arguments, parsed as :func:`msllm.cli_args.split_overrides` does). Raises the config's own
    :class:`MsllmError` (unknown key, wrong type, unknown run_mode ...)."""
    from msllm.cli_args import parse_entry_args

    _, overrides = parse_entry_args(list(entry_args), config_required=False)
    return load_config(config_path, overrides)


def check_entry_accepts(cfg: RunConfig, config_path: str, rank_size: int) -> None:
    """Refuse before starting anything what ``run_msllm.py`` would refuse on every rank: a
    training layout whose device count differs from RANK_SIZE, ``finetune`` without
    ``load_checkpoint``, a setting the run mode refuses (:func:`msllm.settings.check_settings`), a
    layout the device cannot train (:func:`msllm.cluster.context.check_device_support`)."""
    from msllm.cluster.context import check_device_support
    from msllm.settings import check_settings

    pc = cfg.parallel_config
    training = cfg.run_mode in TRAINING_MODES
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
    try:
        check_settings(cfg, cfg.run_mode)
    except MsllmError as e:
        raise MsllmError(f"config {config_path}: {e}") from None
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
    plan.sched_port = env_number(environ, "MS_SCHED_PORT", DEFAULT_SCHED_PORT, int, 1024, 65535)
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
