"""torch, jax_dg's optional dependency (the `torch` extra), imported where it is used.

torch runs the emulation of DeepGEMM (JAX_DG_BACKEND=torch), carries DeepGEMM itself on a GPU
(deep_gemm is a torch extension) and jax_dg.interop. Everything else (the `xla` backend, the
pure-JAX helpers, jax_dg's own C++/CUDA kernels) runs without it. A path that needs it and
finds none raises `MissingTorchError`, naming the extra.
"""

from __future__ import annotations

import importlib
import importlib.util
import types

EXTRA = "jax_dg[torch]"
HINT = (f"install it with `pip install '{EXTRA}'` (PyPI's Linux torch bundles CUDA, several GB: "
        "for the CPU-only build install torch from PyTorch's CPU wheel index first; on a GPU "
        "machine, the CUDA torch that deep_gemm was built for; docs/install.md)")


class MissingTorchError(ImportError):
    """A torch-backed path was asked for and torch is not installed."""


def torch(what: str) -> types.ModuleType:
    """The torch module, for `what` (e.g. "the torch emulation (JAX_DG_BACKEND=torch)"); without
    torch, MissingTorchError naming the extra."""
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        raise MissingTorchError(f"jax_dg: {what} needs torch, which is not installed "
                                f"({type(e).__name__}: {e}); {HINT}") from e


def has_torch() -> bool:
    """Whether torch can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):   # a finder that refuses it; a half-imported module
        return False
