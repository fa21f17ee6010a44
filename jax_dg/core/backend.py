"""Backend selection: which implementation runs an op (the backends themselves live in
jax_dg/backends/, the pure-JAX references in jax_dg/reference/).

`JAX_DG_BACKEND` (read when a function is traced):
  auto       DeepGEMM on CUDA devices, the torch reference on CPU (default)
  deep_gemm  DeepGEMM only; an error on CPU
  torch      the torch reference through the FFI bridge, on any device
  xla        no custom call: the pure-JAX reference is traced in place of the op
"""

from __future__ import annotations

import contextlib
import os

import jax

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


@contextlib.contextmanager
def use_backend(name: str):
    """Selects the backend for functions traced (or called through jit) inside the block.

    The choice is part of jit's cache key, so a function jitted once runs with the backend of
    the block it is called in.
    """
    with _context(_check(name)):
        yield


def concrete(backend: str, platform: str, strict: bool = True) -> str:
    """The backend that runs on a platform ("cpu" or "cuda"): "deep_gemm" or "torch".

    deep_gemm on a non-CUDA platform raises (strict) or is returned as asked (the call reports it).
    """
    if backend == "auto":
        return "deep_gemm" if platform == "cuda" else "torch"
    if backend == "deep_gemm" and platform != "cuda" and strict:
        raise RuntimeError(f"{ENV}=deep_gemm needs a CUDA device; this call runs on {platform}. "
                           f"Use {ENV}=auto (torch reference on CPU).")
    return backend


class _TorchNamespace:
    """The torch reference resolved as DeepGEMM's namespace is: any DeepGEMM name, but jax_dg's
    own kernels only when declared (on the GPU an undeclared one is looked for in DeepGEMM and
    not found: fail here too, not first there). Looked up at each use, like the module."""

    def __init__(self, module, undeclared: frozenset):
        self._module, self._undeclared = module, undeclared

    def __getattr__(self, name: str):
        if name in self._undeclared:
            raise AttributeError(f"jax_dg: `{name}` (jax_dg's own kernel) is not in the op's symbols")
        return getattr(self._module, name)


def namespace(backend: str, platform: str, symbols: tuple[str, ...]):
    """The kernel namespace an op's run function receives as `dg`: the resolved DeepGEMM
    symbols plus jax_dg's own kernels (their torch references where those were not built),
    or the torch reference (which implements both APIs), resolving names the same way."""
    from jax_dg.backends import kernels, torch_ref
    if concrete(backend, platform) == "torch":
        return _TorchNamespace(torch_ref, kernels.SYMBOLS - frozenset(symbols))
    from jax_dg.backends import deep_gemm
    own = [s for s in symbols if s in kernels.SYMBOLS]
    ns = deep_gemm.namespace(tuple(s for s in symbols if s not in kernels.SYMBOLS))
    for name in own:
        setattr(ns, name, getattr(kernels if kernels.available() else torch_ref, name))
    return ns
