"""Shared fixtures. GPU tests (`-m gpu`) need a CUDA jax device and an importable deep_gemm."""

from __future__ import annotations

import hashlib
import os

# Leave room on the GPU for torch/DeepGEMM beside XLA's pool (set before jax starts).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
# The oracles' float32 matmuls come in many shapes (one per expert group); autotuning each costs
# seconds on the GPU and changes nothing the tests assert. Benchmarks keep XLA's default.
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_dg  # noqa: E402

# Set by scripts/sanitize.sh on the sanitized command only.
UNDER_SANITIZER = os.environ.get("JAX_DG_SANITIZER") == "1"


def on_deep_gemm() -> bool:
    """Whether jax_dg's ops run DeepGEMM here (a GPU with deep_gemm), not the torch emulation,
    whose float32 sums are exact: comparisons of FP8 pipelines then use DeepGEMM's thresholds."""
    from jax_dg.core import device
    return device.target().backend == "deep_gemm"


def check_released(ok: bool, message: str) -> None:
    """The landing's "torch released the landed segment at once". Under compute-sanitizer
    (measured on the H200, torch 2.11) torch never releases the segment of a MemPool backed by
    jax_dg's pluggable allocator, not even after torch.cuda.empty_cache(), while a pool on
    torch's own allocator releases at once. There the check is reported, not asserted."""
    if UNDER_SANITIZER:
        if not ok:
            import warnings
            warnings.warn(f"not checked under compute-sanitizer: {message}", stacklevel=2)
        return
    assert ok, message


def pytest_runtest_logreport(report):
    # A sanitized run can be cut off by its time box before pytest's summary: say why a test
    # failed as soon as it does (to the real stderr: the hook runs inside pytest's capture).
    if UNDER_SANITIZER and report.failed:
        import sys
        sys.__stderr__.write(f"\n{report.nodeid} ({report.when}) failed:\n{report.longreprtext[-6000:]}\n")
        sys.__stderr__.flush()


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def has_deep_gemm() -> bool:
    from jax_dg.backends import deep_gemm
    return deep_gemm.module() is not None


def pytest_collection_modifyitems(config, items):
    if has_gpu() and has_deep_gemm():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device for jax and an importable deep_gemm")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def keys():
    """A fresh stream of PRNG keys per test (seeded by the test's name: reproducible)."""
    seed = int(hashlib.sha256(os.environ.get("PYTEST_CURRENT_TEST", "").encode()).hexdigest()[:8], 16)
    key = jax.random.PRNGKey(seed)

    def next_key():
        nonlocal key
        key, sub = jax.random.split(key)
        return sub
    return next_key


@pytest.fixture
def cpu_device():
    """The test runs on the CPU device with the torch emulation (where a GPU is the default):
    tests of one formulation against another, both traced for the CPU."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax_dg.use_backend("torch"):
        yield cpu


def run(backend: str, fn, *args):
    """fn under jax.jit with `backend` (use_backend is part of jit's cache key, so the same fn
    jitted under another backend is traced again)."""
    with jax_dg.use_backend(backend):
        return jax.jit(fn)(*args)


def on_cpu(fn, *args):
    """fn under jax.jit on the CPU device (jax_dg's own kernels: their C++ CPU twin), as numpy:
    the GPU tests' comparison for the native kernels."""
    cpu = jax.devices("cpu")[0]
    args = jax.device_put(args, cpu)
    with jax.default_device(cpu):
        return np.asarray(jax.jit(fn)(*args))


def digest(*arrays) -> str:
    """Hash of the bytes of arrays (pytrees allowed), to prove inputs are never written."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(arrays):
        h.update(np.asarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()


def to_torch(x):
    """Zero-copy torch view of a jax array (FP8 through a uint8 bitcast)."""
    import torch
    import jax.numpy as jnp
    if x.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        t = torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8))
        return t.view(torch.float8_e4m3fn if x.dtype == jnp.float8_e4m3fn else torch.float8_e5m2)
    return torch.from_dlpack(x)


def bits(x) -> bytes:
    return np.asarray(jax.device_get(x)).tobytes()


def _as_uint(x):
    import jax.numpy as jnp
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


@jax.jit
def same_bits(x, y):
    """Bitwise equality of two arrays (pytrees allowed), on their device: for GPU-sized outputs
    that would take seconds to bring to the host and hash."""
    import jax.numpy as jnp
    pairs = zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)
    return jnp.all(jnp.stack([jnp.array_equal(_as_uint(a), _as_uint(b)) for a, b in pairs]))


def device_copies(*arrays):
    """Copies of arrays on their device; `same_bits(copies, arrays)` later proves the originals
    were never written (the GPU tests' cheap form of `digest`)."""
    import jax.numpy as jnp
    return jax.tree.map(jnp.copy, arrays)


def trace_for_gpu(monkeypatch, arch: str) -> None:
    """Traces as for a CUDA device of `arch` with a DeepGEMM that has every kernel and jax_dg's
    own CUDA kernels built (lowering only: nothing may run; the same on a machine without a
    CUDA toolkit), under the backend asked for. jax_dg resolves the DeepGEMM symbols while
    tracing."""
    from jax_dg.backends import deep_gemm
    from jax_dg.core import backend as selection
    from jax_dg.core import device, native

    def lookup(name):
        def kernel(*args, **kwargs):
            raise AssertionError(f"{name} ran while the test only traces")
        kernel.__name__ = name
        return kernel
    def target():
        requested = selection.requested()
        backend = selection.concrete(requested, "cuda")
        api = (deep_gemm.Api.emulating(deep_gemm.version_tuple()) if backend == "deep_gemm"
               else device.Target.api)
        return device.Target(backend, "cuda", arch, 132, api)
    monkeypatch.setattr(device, "target", target)
    monkeypatch.setattr(native, "cuda_built", lambda: True)
    monkeypatch.setattr(deep_gemm, "module", lambda: object())
    monkeypatch.setattr(deep_gemm, "lookup", lookup)
