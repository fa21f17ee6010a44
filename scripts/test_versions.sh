#!/usr/bin/env bash
# Runs the CPU test suite against the ends of jax_dg's jax range, each in a venv of its own under
# build/versions/, leaving the main environment as it is:
#   floor   jax/jaxlib 0.10.1, pyproject's lower bound, on $PYTHON (default python3). The venv has
#           --system-site-packages: torch, pytest and the build tools come from the main environment.
#           jax_dg is built WITHOUT build isolation (the route of scripts/install.sh: that venv's
#           jaxlib headers) and installed editable, in a build folder of its own; the script checks
#           that the compiled bridge it loads is that venv's. The leg also builds a wheel from a
#           git URL of the repository's HEAD (`pip wheel git+file://...`, pip's defaults, the CUDA
#           kernels left out for time) and checks its modules.
#   newest  jax/jaxlib 0.12.0.1, the newest release in range. jax >= 0.11 needs Python >= 3.12: this
#           leg runs where one is found ($PYTHON312, a python3.12 on PATH, or pyenv's 3.12), in a
#           plain venv with its own torch $TORCH (PyPI's build: about 5 GB of CUDA wheels, downloaded
#           once, then kept in the venv). Without a Python 3.12 it is skipped, and says so.
#           jax_dg is installed as a user of the sdist gets it: the script builds the sdist, a wheel
#           from it WITH pip's default build isolation (compiled against jaxlib 0.10.1's FFI headers,
#           pyproject.toml), checks the wheel's contents, installs it and runs the suite from a copy
#           of the repository without jax_dg/, so that only the installed package can be imported.
#           Then the same wheel is loaded on jax/jaxlib 0.10.1 (swapped into the venv) and the
#           tests that reach every FFI module run again: the FFI ABI claim (a module built against
#           the oldest headers loads on every jax in range) is tested at both ends.
#           The wheel leg is this one because its venv is plain: through --system-site-packages
#           the main environment's editable finder (first on sys.meta_path) would shadow a wheel.
# Usage: bash scripts/test_versions.sh [floor] [newest] [-- pytest args]   (default: both legs;
# test paths relative to the repository root)
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

install_wheel() {  # install_wheel PY VENV: sdist, a wheel from it with build isolation, check, install
  local py=$1 venv=$2 log=$2/wheel.log
  rm -rf "$venv/dist"
  # The PEP 517 hooks as pip and `python -m build` call them (scikit-build-core is in the venv)
  if ! "$py" -c "import sys, scikit_build_core.build as b; b.build_sdist(sys.argv[1])" "$venv/dist" \
       >"$log" 2>&1 || ! "$py" -m pip wheel -v --no-deps -w "$venv/dist" "$venv"/dist/jax_dg-*.tar.gz \
       >>"$log" 2>&1; then
    tail -n 60 "$log"; echo "== wheel build failed (log: $log)" >&2; return 1
  fi
  sed -n 's/^ *-- \(jax_dg: .*\)/== \1/p' "$log"   # CMake's word on the FFI headers and CUDA kernels
  grep -q -- "-- jax_dg: XLA FFI API .*pip-build-env" "$log" \
    || { echo "== the wheel's FFI headers are not an isolated build environment's" >&2; return 1; }
  echo "== sdist $(basename "$venv"/dist/jax_dg-*.tar.gz): $(( $(stat -c %s "$venv"/dist/jax_dg-*.tar.gz) / 1024 )) KiB"
  local whl
  whl=$(echo "$venv"/dist/jax_dg-*.whl)
  # Exactly the package's sources (its Python, and the C++ of DeepGEMM's native calls, built on
  # first use) and its two FFI modules, plus the metadata: no tests, no build junk.
  "$py" - "$whl" $(find jax_dg \( -name '*.py' -o -name '*.cc' \) -not -path '*/__pycache__/*') <<'PY'
import os, sys, zipfile
whl, sources = sys.argv[1], set(sys.argv[2:])
infos = zipfile.ZipFile(whl).infolist()
names = {i.filename for i in infos if not i.filename.endswith("/")}
meta = {n for n in names if n.split("/")[0].endswith(".dist-info")}
so = {n for n in names - meta if n.endswith(".so")}
mods = sorted(os.path.basename(n).split(".")[0] for n in so)
assert all(n.startswith("jax_dg/core/") for n in so) and mods == ["_bridge", "_native"], so
assert names - meta - so == sources, (sorted(names - meta - so - sources), sorted(sources - names))
print(f"== wheel {os.path.basename(whl)}: {len(sources)} modules, {mods}, {len(meta)} metadata "
      f"files, {os.path.getsize(whl) // 1024} KiB")
PY
  # A non-editable install (an earlier run's editable one goes first); jax_dg's dependencies are in.
  if "$py" -m pip show -q jax_dg 2>/dev/null; then "$py" -m pip uninstall -q -y jax_dg; fi
  "$py" -m pip install -q "$whl"
}

git_url_wheel() {  # git_url_wheel PY VENV: pip's git route, defaults but the CUDA kernels, checked
  local py=$1 venv=$2 log=$2/git-wheel.log t0=$SECONDS
  rm -rf "$venv/git"
  if ! "$py" -m pip wheel -v --no-deps -C cmake.define.JAX_DG_NO_CUDA=ON -w "$venv/git" \
       "git+file://$PWD" >"$log" 2>&1; then
    tail -n 60 "$log"; echo "== wheel from the git URL failed (log: $log)" >&2; return 1
  fi
  "$py" - "$venv"/git/jax_dg-*.whl <<'PY'
import os, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
mods = sorted(os.path.basename(n).split(".")[0] for n in names if n.endswith(".so"))
assert mods == ["_bridge", "_native"], mods
print(f"== wheel from git+file:// (HEAD): {os.path.basename(sys.argv[1])}, {mods}")
PY
  echo "== git URL wheel built in $((SECONDS - t0)) s"
}

# What reaches every FFI module (bridge, native kernels, the compiled check) and the wheel's own
# checks: run on the floor jax against the wheel built for the newest leg.
ABI_TESTS="tests/test_installed.py tests/core/test_native.py tests/core/test_bridge.py tests/test_values.py"

stage_tests() {  # stage_tests DIR: the repository's files but jax_dg/ (tests, docs, examples, ...)
  git ls-files -z -co --exclude-standard -- ':!jax_dg' | while IFS= read -r -d '' f; do
    if [ -e "$f" ]; then printf '%s\0' "$f"; fi   # skip files deleted in the work tree
  done | tar -c --null -T - -f - | tar -x -C "$1" -f -
}

leg() {  # leg NAME BASE_PYTHON JAX_VERSION editable|wheel VENV_FLAGS... -- PYTEST_ARGS...
  local name=$1 base=$2 jaxv=$3 mode=$4; shift 4
  local flags=()
  while [ "$1" != "--" ]; do flags+=("$1"); shift; done
  shift
  local venv=build/versions/$name t0=$SECONDS
  echo "== $name: jax $jaxv on $("$base" --version 2>&1) ($venv, $mode)"
  [ -x "$venv/bin/python" ] || "$base" -m venv "${flags[@]}" "$venv"
  local py=$PWD/$venv/bin/python
  if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q "torch==$TORCH"
  fi
  "$py" -m pip install -q -r requirements/build.txt "jax==$jaxv" "jaxlib==$jaxv" "pytest>=8" flatbuffers
  if [ "$mode" = wheel ]; then
    install_wheel "$py" "$venv"
  else
    "$py" -m pip install -q --no-build-isolation --no-deps -C "build-dir=$venv/cmake" -e .
  fi
  # The bridge must be this venv's build, not the main environment's (seen through the system site);
  # a wheel's modules must load from site-packages, its native one with the CUDA kernels where
  # the build found a CUDA toolkit. Run from the venv: the repository's jax_dg/ would shadow a wheel.
  local cuda=0
  if [ "$mode" = wheel ] && grep -q -- "-- jax_dg: building its CUDA kernels" "$venv/wheel.log"; then
    cuda=1
  fi
  (cd "$venv" && "$py" - "$jaxv" "$mode" "$cuda") <<'PY'
import os, sys, sysconfig
import jax, jaxlib
import jax_dg
import jax_dg.core._bridge as bridge
import jax_dg.core._native as native_ext
from jax_dg.core import native
jaxv, mode, cuda, venv = sys.argv[1], sys.argv[2], sys.argv[3] == "1", os.path.realpath(".")
assert jax.__version__ == jaxlib.__version__ == jaxv, (jax.__version__, jaxlib.__version__)
assert os.path.realpath(bridge.__file__).startswith(venv), bridge.__file__
if mode == "wheel":
    site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    for f in (jax_dg.__file__, bridge.__file__, native_ext.__file__):
        assert any(os.path.realpath(f).startswith(s + os.sep) for s in site), (f, site)
    assert native.cuda_built() == cuda, (native.cuda_built(), cuda)
print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, jax_dg {jax_dg.__file__}, "
      f"bridge {bridge.__file__}, CUDA kernels built: {native.cuda_built()}")
PY
  echo "== $name: installed in $((SECONDS - t0)) s"
  if [ "$mode" = wheel ]; then
    local stage
    stage=$(mktemp -d "${TMPDIR:-/tmp}/jax_dg-tests.XXXXXX")
    stage_tests "$stage"
    (cd "$stage" && JAX_DG_EXPECT_INSTALLED=1 "$py" -m pytest -q -p no:cacheprovider tests "$@") \
      || { rm -rf "$stage"; return 1; }
    echo "== $name: the same wheel on jax $FLOOR_JAX"
    "$py" -m pip install -q "jax==$FLOOR_JAX" "jaxlib==$FLOOR_JAX"
    # shellcheck disable=SC2086   # a word list of test files
    (cd "$stage" && "$py" -c "import jax, jax_dg.core._bridge, jax_dg.core._native; \
print('== loaded on jax', jax.__version__)" && JAX_DG_EXPECT_INSTALLED=1 "$py" -m pytest -q \
      -p no:cacheprovider $ABI_TESTS) || { rm -rf "$stage"; return 1; }
    rm -rf "$stage"
  else
    "$py" -m pytest -q -p no:cacheprovider tests "$@"
    git_url_wheel "$py" "$venv"
  fi
  echo "== $name: done in $((SECONDS - t0)) s"
}

for l in "${legs[@]}"; do
  case $l in
    floor) leg floor "${PYTHON:-python3}" "$FLOOR_JAX" editable --system-site-packages -- "$@" ;;
    newest)
      if py312=$(find_python312); then
        leg newest "$py312" "$NEWEST_JAX" wheel -- "$@"
      else
        echo "== newest: skipped: jax $NEWEST_JAX needs Python >= 3.12 and none was found" \
             "(set PYTHON312); the wheel is not tested"
      fi ;;
    *) echo "unknown leg $l (floor, newest)" >&2; exit 2 ;;
  esac
done
