#!/usr/bin/env bash
# Installs jax_dg with its test dependencies and runs the test suite.
# GPU tests run where jax sees a CUDA device and deep_gemm imports; elsewhere they are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh "[test]"
echo "== test.sh: the test suite (CPU: about 8 minutes on 2 cores; the GPU tests skip without a GPU)"
exec "${PYTHON:-python3}" -m pytest -q tests "$@"
