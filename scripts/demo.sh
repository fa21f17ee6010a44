#!/usr/bin/env bash
# Installs jax_dg and runs the main job: a jitted DeepSeek-V3.2 indexer step (MQA logits -> top-k),
# on DeepGEMM when there is a GPU, on the torch emulation through the same FFI bridge otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
echo "== demo.sh: the jitted indexer step (examples/indexer_topk.py)"
exec "${PYTHON:-python3}" examples/indexer_topk.py "$@"
