"""Backend selection: which implementation runs an op (the backends themselves live in
jax_dg/backends/, the pure-JAX references in jax_dg/reference/).

`JAX_DG_BACKEND` (read when a function is traced):
  auto       DeepGEMM on CUDA devices; on CPU the torch emulation where torch is installed,
             else the pure-JAX reference (default)
  deep_gemm  DeepGEMM only; an error on CPU
  torch      the torch emulation through the FFI bridge, on any device
  xla        no custom call: the pure-JAX reference is traced in place of the op
"""

from __future__ import annotations

import contextlib
import os

import jax

from jax_dg.backends import optional

ENV = "JAX_DG_BACKEND"
CHOICES = ("auto", "deep_gemm", "torch", "xla")

# A jit-cache-sensitive context: a function traced under one backend is traced again under
# another instead of reusing the cached trace. (The environment variable is read at trace time
# only; change it before tracing.)
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


def asked_by(backend: str | None = None) -> str:
    """How `backend` (default: the one asked for now) was chosen, as a user would write it."""
    backend = requested() if backend is None else backend
    return f"use_backend({backend!r})" if _context.value == backend else f"{ENV}={backend}"


@contextlib.contextmanager
def use_backend(name: str):
    """Selects the backend for functions traced (or called through jit) inside the block.

    The choice is part of jit's cache key, so a function jitted once runs with the backend of
    the block it is called in.
    """
    with _context(_check(name)):
        yield


def concrete(backend: str, platform: str) -> str:
    """The backend asked for, made concrete for a platform ("cpu" or "cuda"): "auto" is
    "deep_gemm" on CUDA; elsewhere "torch" (the same program as on the GPU, through the bridge)
    where torch is installed, else "xla" (docs/install.md, "Backends", says why). Every other
    choice is itself (deep_gemm on a CPU is the resolver's to refuse, jax_dg.core.dispatch)."""
    if backend == "auto":
        if platform == "cuda":
            return "deep_gemm"
        return "torch" if optional.has_torch() else "xla"
    return backend
