#!/usr/bin/env bash
# The GPU tests under NVIDIA compute-sanitizer (issue 13). On a GPU machine with deep_gemm:
#
#   scripts/sanitize.sh memcheck [pytest args]   memcheck over `-m gpu` tests (default: tests/;
#                                                 pass files or -k to run a part)
#   scripts/sanitize.sh initcheck [pytest args]  initcheck over the ops that promise fully
#                                                 defined outputs (default: the files below)
#   scripts/sanitize.sh values [pytest args]     memcheck over the out-of-range value cases only
#                                                 (tests/test_values.py, small shapes)
#   scripts/sanitize.sh files                    the GPU test files, one a line (to split a run)
#   scripts/sanitize.sh sweep memcheck|initcheck  the tool's default tests dealt over JOBS
#                                                 (default 3) sanitizer processes at once on
#                                                 the one GPU (logs TOOL.0 ... TOOL.<JOBS-1>;
#                                                 6 at once ran an H200 out of memory)
#
# e.g. scripts/sanitize.sh memcheck tests/ops/test_grouped.py -k masked
# Settings (perf_facts.md: with XLA's defaults the sanitizer segfaults at start-up): XLA's
# platform allocator (each buffer its own cudaMalloc, so memcheck sees buffer bounds, not one
# pool), no CUDA graphs (command buffers), and child processes (DeepGEMM's nvcc JIT) left
# unsanitised. WARM=1 first runs the same tests without the sanitizer, so DeepGEMM's kernels
# are compiled into its JIT cache before the slow run. Logs go to $OUT (the device tool) or
# ./gpu-logs; the exit code is non-zero when the sanitizer reports an error or a test fails.
# Each run is time-boxed (SAN_TIMEOUT, default 570 s): under the sanitizer the whole GPU suite
# (about 520 s without it) needs several runs, one per file or group of files; `sweep` runs
# those groups side by side (the GPU is mostly idle under the sanitizer, which is host-bound).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="

# Ops whose outputs are fully defined (no position left unwritten for the caller): the GEMMs,
# the grouped GEMMs (clean), top-k, the schedule metadata and the value cases. The logits ops'
# view masks positions DeepGEMM leaves unwritten with a select, which reads them (a discarded
# read initcheck would report): they are left to memcheck, as are the psum and nn grouped forms
# (tests/ops/test_grouped_layouts.py, test_compiled_dims.py), which clean the same way.
INITCHECK_FILES="tests/ops/test_gemm.py tests/ops/test_grouped.py tests/ops/test_einsum.py
  tests/ops/test_hyperconnection.py tests/ops/test_topk.py tests/test_values.py"
# memcheck's default: every GPU test but the capture tests, which assert CUDA-graph replay
# (the sanitizer's settings turn command buffers off)
MEMCHECK_PATHS="tests --ignore=tests/core/test_capture.py"

mode=${1:-memcheck}
shift || true

gpu_files() {
  grep -l "mark.gpu" -r tests --include "test_*.py" | sort
}

sanitize() {   # sanitize TOOL NAME PYTEST-ARGS...
  local tool=$1 name=$2
  shift 2
  if [ "${WARM:-0}" = 1 ]; then
    timeout "${SAN_TIMEOUT:-570}" "$py" -m pytest -q -m gpu -p no:cacheprovider "$@" \
      > "$out/$name.warm.log" 2>&1
    echo "warm-up (no sanitizer): rc=$?"; grep -E "passed|failed" "$out/$name.warm.log" | tail -1
  fi
  timeout "${SAN_TIMEOUT:-570}" compute-sanitizer --tool "$tool" --target-processes application-only \
    --error-exitcode 99 --print-limit 50 --log-file "$out/$name.sanitizer.log" \
    "$py" -m pytest -q -m gpu -p no:cacheprovider "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$tool $*: rc=$rc (99: the sanitizer reported errors; 124: timed out)"
  grep -E "passed|failed|error" "$out/$name.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$out/$name.log" | head -20
  grep -E "ERROR SUMMARY" "$out/$name.sanitizer.log" | tail -1
  grep -E "^========= (Invalid|Uninitialized|Program hit|Out of|Address)" "$out/$name.sanitizer.log" \
    | sort | uniq -c | sort -rn | head -10
  return $rc
}

sweep() {   # sweep TOOL: TOOL's default tests, dealt one by one over JOBS concurrent runs
  local tool=$1 i=0 j rc=0 id
  local -a groups=() pids=() paths
  if [ "$tool" = memcheck ]; then read -ra paths <<< "$MEMCHECK_PATHS"; else read -ra paths <<< "$INITCHECK_FILES"; fi
  # test by test, not file by file: the heavy GEMM tests spread over all runs
  while read -r id; do
    groups[$((i % ${JOBS:-3}))]+=" $id"; i=$((i + 1))
  done < <("$py" -m pytest --collect-only -q -m gpu -p no:cacheprovider "${paths[@]}" 2>/dev/null | grep "::")
  for j in "${!groups[@]}"; do
    # shellcheck disable=SC2086   # the group is a list of test ids
    sanitize "$tool" "$tool.$j" ${groups[$j]} > "$out/$tool.$j.summary" 2>&1 &
    pids+=($!)
  done
  for j in "${!pids[@]}"; do wait "${pids[$j]}" || rc=1; done
  for j in "${!groups[@]}"; do
    echo "--- $tool.$j: $(wc -w <<< "${groups[$j]}") tests"; cat "$out/$tool.$j.summary"
  done
  return $rc
}

case $mode in
  # shellcheck disable=SC2086   # the default lists are word lists
  memcheck)  [ $# -gt 0 ] || set -- $MEMCHECK_PATHS
             sanitize memcheck memcheck "$@" ;;
  initcheck) [ $# -gt 0 ] || set -- $INITCHECK_FILES
             sanitize initcheck initcheck "$@" ;;
  values)    sanitize memcheck values tests/test_values.py "$@" ;;
  files)     gpu_files ;;
  sweep)     sweep "${1:-memcheck}" ;;
  *) echo "usage: $0 memcheck|initcheck|values|files [pytest args] | sweep memcheck|initcheck" >&2; exit 2 ;;
esac
