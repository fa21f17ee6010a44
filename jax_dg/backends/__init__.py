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


# A jit-cache-sensitive context: a function traced under one backend is traced again under
# another instead of reusing the cached trace. (The environment variable is read at trace time
# only; change it before tracing.)
import jax  # noqa: E402

_context = jax.make_user_context(default_value=None)


def _check(value: str) -> str:
    value = value.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"jax_dg backend {value!r}: choose one of {', '.join(CHOICES)}")
    return value


def requested() -> str:
    """The backend asked for now: the innermost `use_backend`, else $JAX_DG_BACKEND."""
    value = _context.value
    return value if value is not None else _check(os.environ.get(ENV, "auto"))


@contextlib.contextmanager
def use_backend(name: str):
    """Selects the backend for functions traced (or called through jit) inside the block.

    The choice is part of jit's cache key, so a function jitted once runs with the backend of
    the block it is called in.
    """
    with _context(_check(name)):
        yield


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
