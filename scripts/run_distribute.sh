#!/usr/bin/env bash
# Start this server's ranks of a distributed msllm job from an HCCL rank table, then wait for them.
#
# Usage (MindFormers' scripts/run_distribute.sh argument order):
#   bash scripts/run_distribute.sh RANK_TABLE_FILE CONFIG_PATH [START,END] MODE [RANK_SIZE] [extra args...]
#     [START,END]  global ranks START..END-1 run here, e.g. [0,8] on server 1, [8,16] on server 2
#     MODE         a run_mode of msllm.config.RUN_MODES (train | finetune ...), passed as --run_mode;
#                  the config is checked first, nothing starts for a mode or config run_msllm.py refuses
#     RANK_SIZE    total ranks of the job = devices in the rank table (default END-START)
#     extra args   passed to run_msllm.py verbatim
# Logs: OUTPUT/log/rank_{i}/msllm.log (scheduler: log/scheduler/msllm.log), pids:
# OUTPUT/log/pids_{START}_{END}.txt; OUTPUT = $MSLLM_OUTPUT_DIR, else the config's output_dir (printed).
# Env: PYTHON (interpreter), MSLLM_ENTRY (script to run instead of run_msllm.py), MSLLM_DEVICE_TARGET,
# MS_SCHED_PORT (default 8118), MSLLM_NO_WAIT=1, MSLLM_KILL_TIMEOUT (s, default 30).
# Logic: msllm/cluster/launch.py (plan: launch_plan.py, processes: launch_processes.py).
set -eu
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO_ROOT/.venv/bin/python" ]; then
    PYTHON="$REPO_ROOT/.venv/bin/python"
  else
    PYTHON=python3
  fi
fi
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# --sim_level: compile this server's ranks with MindSpore's dry-run instead of starting them
module=msllm.cluster.launch
for arg in "$@"; do
  case "$arg" in --sim_level|--sim_level=*) module=msllm.dryrun.launch ;; esac
done
exec "$PYTHON" -m "$module" "$@"
