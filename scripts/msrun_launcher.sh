#!/usr/bin/env bash
# msllm's scripts/msrun_launcher.sh: MindFormers' launcher name and positional arguments, around
# MindSpore's msrun (MindFormers scripts/msrun_launcher.sh: the same four forms).
#
#   bash scripts/msrun_launcher.sh EXECUTE_ORDER                                   8 workers here
#   bash scripts/msrun_launcher.sh EXECUTE_ORDER WORKER_NUM
#   bash scripts/msrun_launcher.sh EXECUTE_ORDER WORKER_NUM MASTER_PORT LOG_DIR JOIN CLUSTER_TIME_OUT
#   bash scripts/msrun_launcher.sh EXECUTE_ORDER WORKER_NUM LOCAL_WORKER MASTER_ADDR MASTER_PORT NODE_RANK \
#        LOG_DIR JOIN CLUSTER_TIME_OUT
#   EXECUTE_ORDER e.g. "run_msllm.py --config configs/llama/run_llama_13b.yaml --run_mode train"
#
# Dry-run: an EXECUTE_ORDER with --sim_level 0|1 [--sim_rank_id R] is not given to msrun: run_msllm.py
# compiles the ranks itself under MindSpore's simulation, a few at a time (docs/dryrun.md), and
# WORKER_NUM must equal the layout's device count (checked). Env: PYTHON (interpreter).
set -eu
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO_ROOT/.venv/bin/python" ]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
WORKER_NUM=8; LOCAL_WORKER=8; MASTER_ADDR="127.0.0.1"; MASTER_PORT=8118; NODE_RANK=0
LOG_DIR="output/msrun_log"; JOIN="False"; CLUSTER_TIME_OUT=7200
case $# in
  1) ;;
  2) WORKER_NUM=$2; LOCAL_WORKER=$2 ;;
  6) WORKER_NUM=$2; LOCAL_WORKER=$2; MASTER_PORT=$3; LOG_DIR=$4; JOIN=$5; CLUSTER_TIME_OUT=$6 ;;
  9) WORKER_NUM=$2; LOCAL_WORKER=$3; MASTER_ADDR=$4; MASTER_PORT=$5; NODE_RANK=$6; LOG_DIR=$7; JOIN=$8
     CLUSTER_TIME_OUT=$9 ;;
  *) sed -n '4,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 1 ;;
esac
if [[ ! $WORKER_NUM =~ ^[0-9]+$ ]]; then echo "error: WORKER_NUM=$WORKER_NUM is not a number" >&2; exit 1; fi
read -r -a ORDER <<< "$1"
if [[ " $1 " == *" --sim_level"* ]]; then
  # compile-only: no msrun, no cluster; the dry-run checks WORKER_NUM against the layout
  export MSLLM_SIM_RANK_SIZE=$WORKER_NUM
  exec "$PYTHON" "${ORDER[@]}"
fi
export PATH="$(dirname "$PYTHON"):$PATH"   # msrun lives beside the interpreter
exec msrun --worker_num="$WORKER_NUM" --local_worker_num="$LOCAL_WORKER" --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" --join="$JOIN" \
  --cluster_time_out="$CLUSTER_TIME_OUT" "${ORDER[@]}"
