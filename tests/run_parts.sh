#!/usr/bin/env bash
# The whole test suite (what `make test` and CI run) as three pytest processes, one after another.
#
# Why: one pytest process grows with every in-process model, graph and cache the tests build (the
# real SmolLM2 references, int8 / packing / serving engines): on 2026-11-27 a single process reached
# 20 GB RSS before the training tests, and the kernel's OOM killer stopped it when the DPO-vs-TRL
# worker (4-5 GB) started beside it on the 24 GiB machine. Three processes start from nothing.
# Each part writes its per-test durations (MSLLM_DURATIONS_FILE); they are joined into
# tests/durations.txt. Every part runs even when an earlier one fails; the exit code is 1 if any failed.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${MSLLM_DURATIONS_FILE:-}
parts=("tests/test_bad_inputs.py tests/test_benchmark_ratios.py tests/test_cli.py tests/test_config.py tests/test_config_schema.py tests/test_import_graph.py tests/test_settings.py tests/cluster tests/compat tests/convert tests/data tests/eval tests/generation tests/kernels"
       "tests/lora tests/models tests/parallel tests/serving"
       "tests/training")
rc=0
files=()
for i in "${!parts[@]}"; do
  f=""
  if [ -n "$OUT" ]; then f="$OUT.part$((i + 1))"; files+=("$f"); fi
  # shellcheck disable=SC2086
  MSLLM_DURATIONS_FILE=$f "$PY" -m pytest ${parts[$i]} "$@" || rc=1
done
if [ -n "$OUT" ]; then
  cat "${files[@]}" > "$OUT.tmp" 2>/dev/null && mv "$OUT.tmp" "$OUT"
  rm -f "${files[@]}"
fi
exit $rc
