#!/usr/bin/env bash
# Installs jax_dg and what it builds against into the current Python environment, saying what it
# does as it goes (on 2 cores the C++/CUDA build takes a few minutes).
#
# Build dependencies first, then the package WITHOUT build isolation: the FFI modules are
# compiled against the XLA FFI headers of the jaxlib installed here (jax.ffi.include_dir()), and
# the editable install keeps its CMake folder for incremental rebuilds. (`pip install .` with
# pip's defaults works too: it compiles against the oldest jaxlib in range, pyproject.toml.)
# torch (the `torch` extra: the emulation and the test suite) is installed where missing, pinned
# (an unpinned torch from PyPI is several GB of CUDA wheels, and so is this pin on Linux unless
# a CPU build is found first: docs/install.md); on a GPU machine install your CUDA torch and
# deep_gemm first.
set -euo pipefail
PY=${PYTHON:-python3}
extra=${1:-}
step() { echo "== install.sh: $*"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  step "torch==2.13.0 (none installed; install your own torch first to keep it)"
  "$PY" -m pip install "torch==2.13.0"
fi
step "build tools (requirements/build.txt)"
"$PY" -m pip install -q -r requirements/build.txt
step "jax_dg${extra}, built without isolation: C++ FFI modules, and the CUDA kernels where nvcc" \
     "is found (one line per compiled file)"
log=$(mktemp "${TMPDIR:-/tmp}/jax_dg-install.XXXXXX")
set +e
"$PY" -m pip install -v --no-build-isolation -e ".${extra}" 2>&1 | tee "$log" \
  | grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] |-- jax_dg: |^ *(Collecting|Downloading|Successfully installed) '
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  tail -n 60 "$log"
  echo "== install.sh: pip failed (exit $status); its whole log: $log" >&2
  exit "$status"
fi
rm -f "$log"
step "done"
