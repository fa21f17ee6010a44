#!/usr/bin/env bash
# On a GPU machine with deep_gemm: the GPU tests, then every benchmark (or the parts named:
# `tests`, `bench`, or benchmark names). Logs go to $OUT (the device tool) or ./gpu-logs.
# Each step is time-boxed so one hang cannot eat the whole lease.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
parts=${*:-tests bench}
for part in $parts; do
  case $part in
    tests)
      timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider tests ${PYTEST_ARGS:-} \
        > "$out/gpu_tests.log" 2>&1
      echo "gpu tests: rc=$?"; grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -3
      grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -30 ;;
    bench)
      for b in benchmarks/bench_*.py; do
        timeout "${BENCH_TIMEOUT:-240}" python3 "$b" > "$out/$(basename "$b" .py).log" 2>&1
        echo "$b: rc=$?"; tail -12 "$out/$(basename "$b" .py).log"
      done ;;
    *)
      timeout "${BENCH_TIMEOUT:-240}" python3 "benchmarks/$part.py" > "$out/$part.log" 2>&1
      echo "$part: rc=$?"; tail -12 "$out/$part.log" ;;
  esac
done
