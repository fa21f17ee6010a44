#!/usr/bin/env bash
# Runs the CPU test suite against the ends of jax_dg's jax range, each in a venv of its own under
# build/versions/, leaving the main environment as it is:
#   floor   jax/jaxlib 0.10.1, pyproject's lower bound, on $PYTHON (default python3). The venv has
#           --system-site-packages: torch, pytest and the build tools come from the main environment.
#   newest  jax/jaxlib 0.12.0.1, the newest release in range. jax >= 0.11 needs Python >= 3.12: this
#           leg runs where one is found ($PYTHON312, a python3.12 on PATH, or pyenv's 3.12), in a
#           plain venv with its own torch $TORCH (PyPI's build: about 5 GB of CUDA wheels, downloaded
#           once, then kept in the venv). Without a Python 3.12 it is skipped, and says so.
# In each venv jax_dg is built without build isolation (the FFI module must be compiled against that
# venv's jaxlib headers), editable, in a build folder of its own, and the script checks that the
# compiled bridge it loads is that venv's.
# Usage: bash scripts/test_versions.sh [floor] [newest] [-- pytest args]   (default: both legs)
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR_JAX=0.10.1
NEWEST_JAX=0.12.0.1
TORCH=${TORCH:-2.13.0}

legs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do legs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#legs[@]} -gt 0 ] || legs=(floor newest)

find_python312() {
  local c
  for c in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
           /root/.pyenv/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null \
      && { echo "$c"; return 0; }
  done
  return 1
}

leg() {  # leg NAME BASE_PYTHON JAX_VERSION VENV_FLAGS... -- PYTEST_ARGS...
  local name=$1 base=$2 jaxv=$3; shift 3
  local flags=()
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  local venv=build/versions/$name t0=$SECONDS
  echo "== $name: jax $jaxv on $("$base" --version 2>&1) ($venv)"
  [ -x "$venv/bin/python" ] || "$base" -m venv "${flags[@]}" "$venv"
  local py=$venv/bin/python
  if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q "torch==$TORCH"
  fi
  "$py" -m pip install -q -r requirements/build.txt "jax==$jaxv" "jaxlib==$jaxv" "pytest>=8" flatbuffers
  "$py" -m pip install -q --no-build-isolation --no-deps -C "build-dir=$venv/cmake" -e .
  # The bridge must be this venv's build, not the main environment's (seen through the system site).
  "$py" - "$jaxv" "$venv" <<'EOF'
import os, sys
import jax, jaxlib
import jax_dg.core._bridge as bridge
jaxv, venv = sys.argv[1], os.path.abspath(sys.argv[2])
assert jax.__version__ == jaxlib.__version__ == jaxv, (jax.__version__, jaxlib.__version__)
assert os.path.abspath(bridge.__file__).startswith(venv), bridge.__file__
print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, bridge {bridge.__file__}")
EOF
  echo "== $name: installed in $((SECONDS - t0)) s"
  "$py" -m pytest -q -p no:cacheprovider tests "$@"
  echo "== $name: done in $((SECONDS - t0)) s"
}

for l in "${legs[@]}"; do
  case $l in
    floor) leg floor "${PYTHON:-python3}" "$FLOOR_JAX" --system-site-packages -- "$@" ;;
    newest)
      if py312=$(find_python312); then
        leg newest "$py312" "$NEWEST_JAX" -- "$@"
      else
        echo "== newest: skipped: jax $NEWEST_JAX needs Python >= 3.12 and none was found" \
             "(set PYTHON312)"
      fi ;;
    *) echo "unknown leg $l (floor, newest)" >&2; exit 2 ;;
  esac
done
