"""``scripts/run_distribute.sh RANK_TABLE CONFIG [START,END] MODE [RANK_SIZE] ... --sim_level L``:
compile this server's ranks START..END-1 with MindSpore's dry-run instead of starting them (no
cluster is formed, no process waits for another). The arguments are checked as for a real launch:
the rank table must hold RANK_SIZE devices and RANK_SIZE must be the layout's device count. The
ranks compile a few at a time (``--sim_jobs N`` or env ``MSLLM_SIM_JOBS``, default the CPU cores):
:func:`msllm.dryrun.driver.run_dryrun`.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from msllm.cli_args import parse_entry_args
from msllm.cluster.launch_plan import USAGE, parse_rank_range
from msllm.cluster.rank_table import load_rank_table
from msllm.config import TRAINING_MODES, load_config
from msllm.dryrun.driver import run_dryrun
from msllm.errors import MsllmError, cli_main


def launch_dryrun(argv: Sequence[str], cwd: Optional[str] = None) -> int:
    """Run the dry-run for a ``run_distribute.sh`` command line (see the module docstring); 0 on
    success. Raises MsllmError for bad arguments or a rank MindSpore rejects."""
    cwd = cwd or os.getcwd()
    argv = list(argv)
    if len(argv) < 4:
        raise MsllmError(f"expected at least 4 arguments, got {len(argv)}\n{USAGE}")
    table_arg, config, range_arg, mode, *rest = argv
    if mode not in TRAINING_MODES:
        raise MsllmError(f"MODE {mode!r} with --sim_level: the dry-run compiles a training job ({', '.join(TRAINING_MODES)})")
    rank_size = int(rest.pop(0)) if rest and rest[0].isdigit() else None
    table = load_rank_table(os.path.abspath(os.path.join(cwd, table_arg)))
    rank_size = rank_size or table.rank_size
    if table.rank_size != rank_size:
        raise MsllmError(f"rank table {table_arg} has {table.rank_size} devices but RANK_SIZE is {rank_size}")
    start, end = parse_rank_range(range_arg, rank_size)
    config = os.path.abspath(os.path.join(cwd, config))
    args, overrides = parse_entry_args(["--config", config, *rest])
    overrides = [*overrides, f"--run_mode={mode}"]
    want = load_config(config, [*overrides, "--context.device_target=Ascend"]).parallel_config.device_num
    if want != rank_size:
        raise MsllmError(f"RANK_SIZE {rank_size}, but the layout of {config} (data_parallel x model_parallel x "
                         f"pipeline_stage) has {want} ranks")
    jobs = args.sim_jobs or int(os.environ.get("MSLLM_SIM_JOBS", "0") or 0) or None
    run_dryrun(config, overrides, args.sim_level, f"[{start},{end})", jobs)
    return 0


@cli_main
def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m msllm.dryrun.launch ARGS``: what ``scripts/run_distribute.sh`` runs when its
    arguments hold ``--sim_level`` (otherwise it runs :mod:`msllm.cluster.launch`)."""
    sys.exit(launch_dryrun(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()


__all__ = ["launch_dryrun", "main"]
