#!/usr/bin/env bash
# Installs jax_dg and what it builds against into the current Python environment.
#
# Build dependencies first, then the package WITHOUT build isolation: the FFI module must be
# compiled against the XLA FFI headers of the jaxlib that will load it (jax.ffi.include_dir()),
# not against some other jaxlib that an isolated build environment would download.
# torch is pinned to the CPU build that machines without a GPU take (an unpinned torch pulls
# several GB of CUDA wheels); on a GPU machine install your CUDA torch and deep_gemm first.
set -euo pipefail
PY=${PYTHON:-python3}
extra=${1:-}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -r requirements/build.txt
"$PY" -m pip install -q --no-build-isolation -e ".${extra}"
