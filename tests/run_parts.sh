#!/usr/bin/env bash
# The whole test suite (what `make test` and CI run) as three parts, one after another.
#
# Why parts: one pytest process grows with every in-process model, graph and cache the tests build
# (the real SmolLM2 references, int8 / packing / serving engines): on 2026-11-27 a single process
# reached 20 GB RSS before the training tests, and the kernel's OOM killer stopped it when the
# DPO-vs-TRL worker (4-5 GB) started beside it on the 24 GiB machine. Each part starts from nothing.
#
# Why two workers per part (issue #31, CI time): most tests are MindSpore graph compiles and
# PyTorch references on one thread, so one pytest process leaves the second core of the 2-core CI
# machine idle (one process: 2396 s, over the 35-minute budget). Each part runs on 2 pytest-xdist
# workers with --dist loadfile: all tests of a module stay on one worker, so a module-scoped fixture
# (a compiled model, a converted checkpoint) is still built once. The files go out slowest first
# (by the committed tests/durations.txt; --no-loadscope-reorder keeps that order), so no long file
# starts last while the other worker idles. Tests marked `serial` (pytest.ini: they cannot share the
# machine with another test) then run in one plain pytest process.
#
# OpenMP (PyTorch's intra-op threads in the transformers / PEFT / TRL references, and what else reads it) runs on
# one thread per process here (OMP_NUM_THREADS=1 unless set): two workers on 2 cores already fill the machine,
# and two spinning OpenMP threads per process beside the other worker's made the references several times
# slower (two concurrent runs of tests/generation/test_generation_beam.py: 29.5 s -> 19.4 s with it, 2026-11-27).
# Child processes inherit it (tests/training/test_dpo_trl.py's TRL side: 84 s with 2 threads, 54 s with 1, beside
# a busy core).
#
# Each pytest process writes its per-test durations (MSLLM_DURATIONS_FILE; the worker of each test,
# and each worker's RSS growth per test); they are joined into tests/durations.txt. Every part runs
# even when an earlier one fails; the exit code is 1 if any failed.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${MSLLM_DURATIONS_FILE:-}
WORKERS=${MSLLM_TEST_WORKERS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
parts=("tests/test_*.py tests/cluster tests/compat tests/convert tests/data tests/eval tests/generation tests/kernels"
       "tests/lora tests/models tests/parallel tests/serving"
       "tests/training")
rc=0
# a test file in no part would never run in CI: refuse
# shellcheck disable=SC2086
missing=$(comm -23 <(find tests -name "test_*.py" | sort) \
                   <("$PY" tests/helpers/durations.py order /dev/null ${parts[*]} | tr " " "\n" | sort))
if [ -n "$missing" ]; then echo "tests/run_parts.sh: in no part: $missing" >&2; rc=1; fi
files=()
started=$SECONDS
run() {  # run NAME PYTEST-ARGS...: one pytest process, its durations into $OUT.NAME; exit code 5 (nothing selected) is fine
  local f=""
  if [ -n "$OUT" ]; then f="$OUT.$1"; files+=("$f"); fi
  shift
  MSLLM_DURATIONS_FILE=$f "$PY" -m pytest "$@"
  local code=$?
  if [ $code -ne 0 ] && [ $code -ne 5 ]; then rc=1; fi
}
for i in "${!parts[@]}"; do
  # shellcheck disable=SC2086
  ordered=$("$PY" tests/helpers/durations.py order tests/durations.txt ${parts[$i]})
  # shellcheck disable=SC2086
  run "part$((i + 1))" $ordered -m "not serial" -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
  # shellcheck disable=SC2086
  serial=$(grep -rl --include="test_*.py" "pytest.mark.serial" ${parts[$i]})
  # shellcheck disable=SC2086
  if [ -n "$serial" ]; then run "part$((i + 1))-serial" $serial -m serial "$@"; fi
done
if [ -n "$OUT" ]; then
  "$PY" tests/helpers/durations.py join "$OUT" $((SECONDS - started)) "${files[@]}"
  for f in "${files[@]}"; do rm -f "$f" "$f.json"; done
fi
exit $rc
