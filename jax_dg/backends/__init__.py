"""Which implementation runs an op: DeepGEMM, the torch reference, or the pure-JAX reference.

`JAX_DG_BACKEND` (read when a function is traced):
  auto       DeepGEMM on CUDA devices, the torch reference on CPU (default)
  deep_gemm  DeepGEMM only; an error on CPU
  torch      the torch reference through the FFI bridge, on any device
  xla        no custom call: the pure-JAX reference is traced in place of the op
"""

from __future__ import annotations

import contextlib
import os

ENV = "JAX_DG_BACKEND"
CHOICES = ("auto", "deep_gemm", "torch", "xla")


_override: list[str] = []


def _check(value: str) -> str:
    value = value.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"jax_dg backend {value!r}: choose one of {', '.join(CHOICES)}")
    return value


def requested() -> str:
    """The backend asked for now: the innermost `use_backend`, else $JAX_DG_BACKEND."""
    return _override[-1] if _override else _check(os.environ.get(ENV, "auto"))


@contextlib.contextmanager
def use_backend(name: str):
    """Selects the backend for functions traced inside the block.

    A jitted function keeps the backend it was traced with: jit a fresh function (or clear
    its cache) to switch.
    """
    _override.append(_check(name))
    try:
        yield
    finally:
        _override.pop()


def resolve(backend: str, platform: str) -> str:
    """The concrete backend for a platform ("cpu" or "cuda")."""
    if backend == "auto":
        return "deep_gemm" if platform == "cuda" else "torch"
    if backend == "deep_gemm" and platform != "cuda":
        raise RuntimeError(f"{ENV}=deep_gemm needs a CUDA device; this call runs on {platform}. "
                           f"Use {ENV}=auto (torch reference on CPU).")
    return backend


def kernels(backend: str, platform: str, op):
    """The kernel namespace `op.call` receives."""
    backend = resolve(backend, platform)
    if backend == "torch":
        from jax_dg.backends import torch_ref
        return torch_ref
    from jax_dg.backends import deep_gemm
    return deep_gemm.kernels_for(op)
