"""Rebuilds an installed DeepGEMM's C++ extension (`deep_gemm._C`) against the torch installed here.

DeepGEMM >= 2.8 wheels ship their C++ sources (deep_gemm/csrc) but are built for one torch
(tokenspeed-deepgemm 2.8.2.post20261020: torch 2.14): with another torch, `import deep_gemm` fails
on missing c10 symbols. The extension is one C++ file; its kernels are compiled at run time by
DeepGEMM itself, so rebuilding it needs g++ >= 13 (C++20 <format>), torch's and CUDA's headers, and
two header sets the wheel does not ship:

- DeepJIT (header-only, MIT): `third-party/deep_jit/include` of the matching `deepinfer-gemm` sdist
  on PyPI. Found in the package (a source install has it), given with --deep-jit, or downloaded.
- elfutils' libdwfl.h (DeepJIT dlopens libdw for stack traces): `apt install libdw-dev`, or give
  a folder holding `elfutils/libdwfl.h` with --elfutils.

It links with -Bsymbolic-functions: torch's libraries export their own instances of libstdc++'s
templates (std::regex among them), built by another compiler; bound to those, DeepGEMM's first
get_num_sms() crashed while compiling a std::regex (seen on torch 2.11 + DeepGEMM 2.8.2).
Its own data (the runtime that holds DeepGEMM's settings) stays exported.

    pip install --no-deps tokenspeed-deepgemm==2.8.2.post20261020   # or any DeepGEMM >= 2.8 wheel
    python scripts/build_deep_gemm.py                                # then: import deep_gemm

The old extension is kept beside the new one as *.so.orig.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request


def package_dir() -> str:
    """The installed deep_gemm package's folder, found without importing it (the import fails
    until the extension is rebuilt)."""
    spec = importlib.util.find_spec("deep_gemm")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("build_deep_gemm: no deep_gemm package is installed (pip install --no-deps "
                 "tokenspeed-deepgemm==2.8.2.post20261020, or another DeepGEMM >= 2.8 wheel)")
    return list(spec.submodule_search_locations)[0]


def package_version(pkg: str) -> str:
    for line in open(os.path.join(pkg, "__init__.py")):
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("'\"")
    sys.exit(f"build_deep_gemm: no __version__ in {pkg}/__init__.py")


def deep_jit_headers(pkg: str, given: str | None, version: str, work: str) -> str:
    """A folder holding deep_jit/ (DeepJIT's headers)."""
    for cand in filter(None, [given, os.environ.get("DEEP_JIT_INCLUDE"), os.path.join(pkg, "include")]):
        if os.path.isfile(os.path.join(cand, "deep_jit", "python_api.hpp")):
            return os.path.abspath(cand)
    public = version.split("+")[0].split(".post")[0]
    name = f"deepinfer_gemm-{public}.tar.gz"
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    print(f"build_deep_gemm: downloading DeepJIT's headers ({name} from {index})", flush=True)
    # pip download refuses this sdist (its metadata names another project): read the index page
    page = urllib.request.urlopen(f"{index}/deepinfer-gemm/").read().decode()
    urls = [u for u, n in re.findall(r'href="([^"#]+)[^"]*"[^>]*>([^<]+)<', page) if n == name]
    if not urls:
        sys.exit(f"build_deep_gemm: {name} is not on {index}; give DeepJIT's headers with --deep-jit")
    urllib.request.urlretrieve(urllib.parse.urljoin(f"{index}/deepinfer-gemm/", urls[0]),
                               os.path.join(work, name))
    (sdist,) = glob.glob(os.path.join(work, "deepinfer*gemm-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/third-party/deep_jit/include/" in m.name]
        tar.extractall(work, members=members, filter="data")
    (found,) = glob.glob(os.path.join(work, "*", "third-party", "deep_jit", "include"))
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deep-jit", help="folder holding deep_jit/ (DeepJIT's include folder)")
    p.add_argument("--elfutils", help="folder holding elfutils/libdwfl.h, where the system has none")
    p.add_argument("--shared-libstdcxx", action="store_true", help="link libstdc++ dynamically "
                   "(the default links it statically, see the module doc)")
    p.add_argument("--opt", default="-O3", help="host-code optimisation (upstream: -O3; -O1 builds "
                   "in about half the time)")
    args = p.parse_args()

    pkg = package_dir()
    src = os.path.join(pkg, "csrc", "python_api.cpp")
    if not os.path.isfile(src):
        sys.exit(f"build_deep_gemm: {pkg} ships no C++ sources (DeepGEMM < 2.8 wheels do not): "
                 "install a wheel built for your torch instead")
    version = package_version(pkg)

    import setuptools
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    if CUDA_HOME is None:
        sys.exit("build_deep_gemm: torch finds no CUDA toolkit (set CUDA_HOME)")

    work = tempfile.mkdtemp(prefix="jax_dg-deep_gemm-")
    t0 = time.time()
    try:
        includes = [os.path.join(CUDA_HOME, "include"), os.path.join(CUDA_HOME, "include", "cccl"),
                    os.path.join(pkg, "include"), deep_jit_headers(pkg, args.deep_jit, version, work)]
        cxx = ["-std=c++20", args.opt, "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
        if args.elfutils:   # the system's copy first, where it has one
            cxx += ["-idirafter", os.path.abspath(args.elfutils)]
        ext = CUDAExtension(name="deep_gemm._C", sources=[src], include_dirs=includes,
                            libraries=["cudart"], library_dirs=[os.path.join(CUDA_HOME, "lib64")],
                            extra_compile_args={"cxx": cxx},
                            extra_link_args=["-Wl,-Bsymbolic-functions"] + (
                                [] if args.shared_libstdcxx else
                                ["-static-libstdc++", "-Wl,--exclude-libs,ALL"]))
        print(f"build_deep_gemm: DeepGEMM {version} at {pkg}, torch {torch.__version__}, "
              f"CUDA {CUDA_HOME}", flush=True)
        here = os.getcwd()
        os.chdir(work)   # setuptools must not look at the caller's project
        try:
            setuptools.setup(name="deep_gemm_c", ext_modules=[ext],
                             cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
                             script_args=["-q", "build_ext", "--build-lib", "lib", "--build-temp", "tmp"])
        finally:
            os.chdir(here)
        (built,) = glob.glob(os.path.join(work, "lib", "deep_gemm", "_C*.so"))
        for old in glob.glob(os.path.join(pkg, "_C*.so")):
            os.replace(old, old + ".orig")
        shutil.copy2(built, pkg)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"build_deep_gemm: built {os.path.basename(built)} in {time.time() - t0:.0f} s", flush=True)
    check = "import deep_gemm, torch; print('deep_gemm', deep_gemm.__version__, 'imports'" \
            " + (f', {deep_gemm.get_num_sms()} SMs' if torch.cuda.is_available() else ''))"
    return subprocess.run([sys.executable, "-c", check]).returncode


if __name__ == "__main__":
    sys.exit(main())
