"""DeepGEMM called from C++ (calls.cc): built on first use against the installed DeepGEMM.

Why on first use, not at install: the library compiles DeepGEMM's own host sources (shipped by
DeepGEMM >= 2.8 wheels in deep_gemm/csrc) against the installed torch, so it must match the
DeepGEMM and the torch of the process, which a user upgrades independently of jax_dg (and which
an isolated build environment does not have). Built once per (DeepGEMM, torch, jaxlib, compiler,
source) and cached, as DeepGEMM caches its kernels; a failed build leaves the Python path in
place and `why()` says what failed.

What it needs: a DeepGEMM with its C++ sources and DeepJIT's headers (a source install has
both; a 2.8 wheel lacks DeepJIT's: scripts/build_deep_gemm.py or JAX_DG_DEEP_JIT_INCLUDE),
torch with CUDA, a CUDA toolkit (CUDA_HOME), g++ >= 13 (C++20 <format>; $CXX), elfutils'
libdwfl.h (JAX_DG_ELFUTILS_INCLUDE where the system has none). It links as
scripts/build_deep_gemm.py links deep_gemm._C.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from jax_dg.backends import deep_gemm

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.cc")
# Handler symbols in calls.cc, each with its command-buffer twin (name + "Graph").
HANDLERS = {"fp8_gemm_nt": "JaxDgDeepGemmFp8GemmNt", "sm90_mqa_logits": "JaxDgDeepGemmSm90MqaLogits"}
_why: str | None = None


def why() -> str | None:
    """Why the native path is off (None: it is on, or was not asked for yet)."""
    return _why


def _cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else None


def _deep_jit_include(pkg: str) -> str | None:
    for cand in (os.environ.get("JAX_DG_DEEP_JIT_INCLUDE"), os.environ.get("DEEP_JIT_INCLUDE"),
                 os.path.join(pkg, "include")):
        if cand and os.path.isfile(os.path.join(cand, "deep_jit", "python_api.hpp")):
            return os.path.abspath(cand)
    return None


def _compiler() -> tuple[str, str] | str:
    """(path, version) of a C++20 compiler with <format> ($CXX, else g++ >= 13), or why none."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        return "no C++ compiler ($CXX, g++)"
    try:
        text = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        full = subprocess.run([cxx, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"{cxx} --version failed: {e}"
    if "Free Software Foundation" in text and int((full or "0").split(".")[0]) < 13:
        return f"{cxx} is GCC {full}: GCC >= 13 is needed (C++20 <format>; set CXX)"
    return cxx, f"{text.splitlines()[0]} {full}"


def _plan() -> dict | str:
    """The build's inputs, or why it cannot be built here."""
    dg = deep_gemm.module()
    if dg is None:
        return "deep_gemm does not import"
    pkg = os.path.dirname(os.path.abspath(dg.__file__))
    if not os.path.isfile(os.path.join(pkg, "csrc", "apis", "gemm.hpp")):
        return f"deep_gemm {deep_gemm.version()} ships no C++ sources (DeepGEMM < 2.8 wheels)"
    if deep_gemm.version_tuple() < (2, 8):
        return f"calls.cc is written against DeepGEMM 2.8's C++ API; this is {deep_gemm.version()}"
    jit = _deep_jit_include(pkg)
    if jit is None:
        return ("DeepJIT's headers are not installed (a DeepGEMM wheel does not ship them): "
                "python scripts/build_deep_gemm.py, or set JAX_DG_DEEP_JIT_INCLUDE")
    import torch
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA"
    home = _cuda_home()
    if home is None:
        return "no CUDA toolkit (set CUDA_HOME)"
    cxx = _compiler()
    if isinstance(cxx, str):
        return cxx
    import jax
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    includes = [os.path.join(torch_dir, "include"),
                os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
                os.path.join(home, "include"), os.path.join(home, "include", "cccl"),
                os.path.join(pkg, "include"), os.path.join(pkg, "csrc"), jit,
                sysconfig.get_paths()["include"], jax.ffi.include_dir()]
    after = [os.environ["JAX_DG_ELFUTILS_INCLUDE"]] if os.environ.get("JAX_DG_ELFUTILS_INCLUDE") else []
    key = hashlib.sha256("\0".join([
        open(SOURCE).read(), deep_gemm.version() or "", torch.__version__, jax.__version__,
        cxx[1], *includes, *after]).encode()).hexdigest()[:16]
    return dict(cxx=cxx[0], includes=includes, after=after, key=key,
                libs=[os.path.join(torch_dir, "lib"), os.path.join(home, "lib64")],
                abi=int(torch.compiled_with_cxx11_abi()))


def _cache_dir() -> str:
    base = os.environ.get("JAX_DG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jax_dg")
    return os.path.join(base, "deep_gemm_native")


def _build(plan: dict) -> str:
    """The library's path: the cached build, or a new one (about a minute, once)."""
    out = os.path.join(_cache_dir(), plan["key"], "calls.so")
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cmd = [plan["cxx"], "-std=c++20", "-O2", "-fPIC", "-shared", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={plan['abi']}",
           *[f"-I{d}" for d in plan["includes"]], *[x for d in plan["after"] for x in ("-idirafter", d)],
           SOURCE, "-o", None,
           *[f"-L{d}" for d in plan["libs"]], *[f"-Wl,-rpath,{d}" for d in plan["libs"]],
           "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda", "-lcudart",
           # as deep_gemm._C (scripts/build_deep_gemm.py): its own libstdc++, own functions first
           "-static-libstdc++", "-Wl,--exclude-libs,ALL", "-Wl,-Bsymbolic-functions"]
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    cmd[cmd.index(None)] = tmp
    print("jax_dg: building DeepGEMM's native calls against deep_gemm "
          f"{deep_gemm.version()} (once; about a minute)", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {SOURCE} failed:\n" + done.stderr[-4000:])
    os.replace(tmp, out)   # atomic: a concurrent process sees a whole library or none
    return out


def _shared_runtime(lib: ctypes.CDLL) -> bool:
    """Whether the library's DeepGEMM runtime is deep_gemm._C's (one set of settings)."""
    dg = deep_gemm.module()
    so = glob.glob(os.path.join(os.path.dirname(dg.__file__), "_C*.so"))
    if not so:
        return False
    c = ctypes.CDLL(so[0], mode=os.RTLD_NOLOAD)
    try:
        theirs = ctypes.addressof(ctypes.c_char.in_dll(c, "_ZN9deep_gemm7runtimeE"))
    except ValueError:
        return False
    lib.JaxDgDeepGemmRuntime.restype = ctypes.c_void_p
    return lib.JaxDgDeepGemmRuntime() == theirs


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library (built first if needed), or None: then why() says why."""
    global _why
    if os.environ.get("JAX_DG_DEEP_GEMM_NATIVE", "1") == "0":
        _why = "turned off (JAX_DG_DEEP_GEMM_NATIVE=0)"
        return None
    plan = _plan()
    if isinstance(plan, str):
        _why = plan
        return None
    try:
        lib = ctypes.CDLL(_build(plan))
    except (OSError, RuntimeError) as e:
        _why = str(e)
        return None
    if not _shared_runtime(lib):
        # Two runtimes would hold two sets of DeepGEMM's settings (set_num_sms, the JIT cache):
        # the calls would not be deep_gemm's from torch. Keep the Python path.
        _why = "its DeepGEMM runtime is not deep_gemm._C's (settings would diverge)"
        return None
    return lib


def handler(name: str, graph: bool = False):
    """The PyCapsule of handler `name` (HANDLERS) for jax.ffi.register_ffi_target."""
    import jax
    lib = library()
    return jax.ffi.pycapsule(getattr(lib, HANDLERS[name] + ("Graph" if graph else "")))


def calls() -> int:
    """Handler entries so far (0 when not loaded)."""
    lib = library.cache_info().currsize and library()
    if not lib:
        return 0
    lib.JaxDgDeepGemmCalls.restype = ctypes.c_uint64
    return int(lib.JaxDgDeepGemmCalls())
