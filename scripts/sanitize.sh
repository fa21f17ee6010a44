#!/usr/bin/env bash
# The GPU tests under NVIDIA compute-sanitizer (issue 13). On a GPU machine with deep_gemm:
#
#   scripts/sanitize.sh memcheck [pytest args]   memcheck over `-m gpu` tests (default: tests/;
#                                                 pass files or -k to run a part)
#   scripts/sanitize.sh initcheck [pytest args]  initcheck over the ops that promise fully
#                                                 defined outputs and whose stores initcheck
#                                                 sees (default: INITCHECK below)
#   scripts/sanitize.sh threads [pytest args]    memcheck over tests/test_threads.py, without the
#                                                 host backtraces that deadlock it (THREADS_ARGS)
#   scripts/sanitize.sh graphs [pytest args]     memcheck over the CUDA-graph tests
#                                                 (tests/core/test_capture.py), command
#                                                 buffers left on
#   scripts/sanitize.sh racecheck [pytest args]  racecheck (shared-memory races) over jax_dg's
#                                                 top-k tests (default: tests/ops/test_topk.py)
#   scripts/sanitize.sh probe                    initcheck's reports per step of
#                                                 scripts/initcheck_probe.py (what it sees of
#                                                 DeepGEMM's writes)
#   scripts/sanitize.sh main [script args]       memcheck over the main job with its warm-up
#                                                 (examples/indexer_topk.py --warmup)
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
# pool), no CUDA graphs (command buffers; mode `graphs` keeps them), and child processes (DeepGEMM's nvcc JIT) left
# unsanitised. WARM=1 first runs the same tests without the sanitizer, so DeepGEMM's kernels
# are compiled into its JIT cache before the slow run. Logs go to $OUT (the device tool) or
# ./gpu-logs; the exit code is non-zero when the sanitizer reports an error or a test fails.
# Each run is time-boxed (SAN_TIMEOUT, default 570 s): under the sanitizer the whole GPU suite
# (about 520 s without it) needs several runs, one per file or group of files; `sweep` runs
# those groups side by side (the GPU is mostly idle under the sanitizer, which is host-bound).
# The sanitized log names each test as it ends (-v), so a timed-out run shows how far it got;
# a test still running SAN_STACKS_S (default 400) after it started dumps its Python stacks there
# (so keep SAN_STACKS_S below SAN_TIMEOUT). SAN_PRINT_LIMIT (default 2000) reports are printed
# in full; the summary counts their kinds and the kernels they are in. SAN_ARGS passes further
# compute-sanitizer options (e.g. a kernel filter: --kernel-name kns=SUBSTRING, for memcheck or
# racecheck; initcheck needs every kernel, see below);
# SAN_TARGETS=all sanitizes child processes too (default application-only). A test that fails
# says why in the log at once (tests/conftest.py), not only in pytest's final summary.
# JAX_DG_SANITIZER=1 is set on the sanitized command only: the tests' few allowances for it
# (tests/conftest.py) stay out of WARM=1 runs.
set -uf   # no pathname expansion: test ids like test_x[case] are not globs
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_ALLOCATOR=platform

# initcheck's default is tests/test_defined_outputs.py (the ops that promise fully defined
# outputs, every returned element read back in XLA) and the logits/top-k value cases of
# tests/test_values.py (an op on bad indices against the same op on sanitised ones). No test
# with an oracle: torch.topk reports reads of its own workspace (526,336 reports for a topk of
# torch.randn data, no jax_dg or XLA involved), and the GEMMs are out because initcheck does
# not track the TMA stores that write DeepGEMM's GEMM outputs: it reports every sector of them
# uninitialised, also when deep_gemm is called from torch (`probe` shows it); memcheck and the
# tests' sentinel-filled outputs cover those. A kernel filter cannot set such reports aside:
# initcheck then stops tracking the excluded kernels' writes too, and reports every later read
# of them (`SAN_ARGS="--kernel-name kns=..." scripts/sanitize.sh probe` measured it: its XLA
# control step went from 0 to 64 reports). docs/testing.md has what was measured.
INITCHECK_VALUES="indexer_topk mqa_compressed mqa_full paged_block_tables paged_block_tables_32
  paged_indexer_topk paged_schedule topk_indices"
INITCHECK="tests/test_defined_outputs.py"
for c in $INITCHECK_VALUES; do
  INITCHECK+=" tests/test_values.py::test_gpu_out_of_range_values_give_the_documented_result[$c]"
done
# memcheck's default: every GPU test but the capture tests, which assert CUDA-graph replay
# (mode `graphs`), and the threads test (mode `threads`)
MEMCHECK_PATHS="tests --ignore=tests/core/test_capture.py --ignore=tests/test_threads.py"
# The threads test deadlocks under the sanitizer's host backtraces: to record one at a kernel
# launch it takes the GIL inside the driver (XLA's cuLaunchKernelEx), while jax_dg's handler on
# another thread holds the GIL in a driver call of DeepGEMM's (cuda-gdb stacks, docs/testing.md).
THREADS_ARGS="--show-backtrace device"

mode=${1:-memcheck}
shift || true
# mode `graphs` keeps XLA's command buffers (the capture tests assert replays); the rest turn
# them off (perf_facts.md: with them and XLA's pool allocator the sanitizer segfaulted)
[ "$mode" = graphs ] || export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="

gpu_files() {
  grep -l "mark.gpu" -r tests --include "test_*.py" | sort
}

under() {   # under TOOL NAME COMMAND...: COMMAND under the sanitizer, time-boxed, logs NAME.*
  local tool=$1 name=$2
  shift 2
  # shellcheck disable=SC2086   # SAN_ARGS: extra sanitizer options, e.g. a kernel filter
  JAX_DG_SANITIZER=1 timeout "${SAN_TIMEOUT:-570}" compute-sanitizer --tool "$tool" --target-processes "${SAN_TARGETS:-application-only}" \
    --error-exitcode 99 --print-limit "${SAN_PRINT_LIMIT:-2000}" ${SAN_ARGS:-} \
    --log-file "$out/$name.sanitizer.log" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$tool $name: rc=$rc (99: the sanitizer reported errors; 124: timed out)"
  grep -E "(ERROR|RACECHECK) SUMMARY" "$out/$name.sanitizer.log" | tail -2
  grep -E "^========= (Invalid|Uninitialized|Program hit|Out of|Address|Error|Warning)" "$out/$name.sanitizer.log" \
    | sort | uniq -c | sort -rn | head -10
  # which kernels the printed reports are in (the first SAN_PRINT_LIMIT of them)
  grep -E "^=========     at " "$out/$name.sanitizer.log" | sed -E 's/^=========     at //; s/\+0x[0-9a-f]+( in .*)?$//' \
    | cut -c1-160 | sort | uniq -c | sort -rn | head -10
  return $rc
}

sanitize() {   # sanitize TOOL NAME PYTEST-ARGS...: the -m gpu tests named
  local tool=$1 name=$2 rc
  shift 2
  if [ "${WARM:-0}" = 1 ]; then
    timeout "${SAN_TIMEOUT:-570}" "$py" -m pytest -q -m gpu -p no:cacheprovider "$@" \
      > "$out/$name.warm.log" 2>&1
    echo "warm-up (no sanitizer): rc=$?"; grep -E "passed|failed" "$out/$name.warm.log" | tail -1
  fi
  # a test still running after SAN_STACKS_S dumps every thread's stack into the log (a hang
  # and a slow test look the same from outside)
  under "$tool" "$name" "$py" -m pytest -v -m gpu -p no:cacheprovider \
    -o faulthandler_timeout="${SAN_STACKS_S:-400}" "$@"
  rc=$?
  grep -E "passed|failed|error" "$out/$name.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$out/$name.log" | head -20
  return $rc
}

sweep() {   # sweep TOOL: TOOL's default tests, dealt one by one over JOBS concurrent runs
  local tool=$1 i=0 j rc=0 id
  local -a groups=() pids=() paths
  if [ "$tool" = memcheck ]; then read -ra paths <<< "$MEMCHECK_PATHS"; else read -ra paths <<< "$INITCHECK"; fi
  # test by test, not file by file: the heavy GEMM tests spread over all runs
  while read -r id; do
    groups[$((i % ${JOBS:-3}))]+=" $id"; i=$((i + 1))
  done < <("$py" -m pytest --collect-only -q -m gpu -p no:cacheprovider "${paths[@]}" 2>/dev/null | grep "::")
  if [ "$i" -eq 0 ]; then
    echo "sweep $tool: collected no tests from ${paths[*]}" >&2
    return 2
  fi
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

probe() {   # initcheck's reports per step of the probe (every report printed); fails when a
            # control step gives the wrong count or the probe did not reach its end (its own
            # checks). SAN_ARGS passes a kernel filter, to see what it does to initcheck.
  # shellcheck disable=SC2086   # SAN_ARGS: extra sanitizer options
  timeout "${SAN_TIMEOUT:-570}" compute-sanitizer --tool initcheck --target-processes application-only \
    --show-backtrace no --print-limit 100000 ${SAN_ARGS:-} "$py" scripts/initcheck_probe.py > "$out/probe.log" 2>&1
  echo "initcheck probe: rc=$? (reports per step; each is one 32-byte sector)"
  grep -E "calc_diff|Error" "$out/probe.log"
  awk 'BEGIN { step = "(before the first step)"; order[++n] = step }
       /^=== STEP/ { step = substr($0, 10); if (step == "end") ended = 1; else order[++n] = step; next }
       /Uninitialized/ { count[step]++ }
       END {
         for (i = 1; i <= n; i++) {
           printf "%6d  %s\n", count[order[i]], order[i]
           if (order[i] ~ /expect 0\)/ && count[order[i]] > 0) bad = 1
           if (order[i] ~ /expect > 0/ && count[order[i]] == 0) bad = 1
         }
         if (!ended) { print "the probe did not reach its end"; bad = 1 }
         exit bad
       }' "$out/probe.log"
}

case $mode in
  # shellcheck disable=SC2086   # the default lists are word lists
  memcheck)  [ $# -gt 0 ] || set -- $MEMCHECK_PATHS
             sanitize memcheck memcheck "$@" ;;
  initcheck) [ $# -gt 0 ] || set -- $INITCHECK
             sanitize initcheck initcheck "$@" ;;
  graphs)    sanitize memcheck graphs tests/core/test_capture.py "$@" ;;
  threads)   SAN_ARGS="${SAN_ARGS:-} $THREADS_ARGS"
             sanitize memcheck threads tests/test_threads.py "$@" ;;
  racecheck) [ $# -gt 0 ] || set -- tests/ops/test_topk.py
             sanitize racecheck racecheck "$@" ;;
  values)    sanitize memcheck values tests/test_values.py "$@" ;;
  probe)     probe ;;
  main)      under memcheck main "$py" examples/indexer_topk.py --warmup "$@"
             rc=$?; tail -5 "$out/main.log"; exit $rc ;;
  files)     gpu_files ;;
  sweep)     sweep "${1:-memcheck}" ;;
  *) echo "usage: $0 memcheck|initcheck|graphs|racecheck|threads|values|probe|main|files [args] | sweep memcheck|initcheck" >&2; exit 2 ;;
esac
