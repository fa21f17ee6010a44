"""jax_dg's own CUDA kernels (kernels/*.cu, compiled where the build finds a CUDA toolkit).

A leaf like `deep_gemm`: it imports nothing of jax_dg. Its functions take torch CUDA tensors
and launch on torch's current stream (XLA's, inside a custom call); they allocate nothing.
Where the module was not built, `available()` is False and jax_dg runs the torch reference
of the same contract (backends.torch_ref.topk).
"""

from __future__ import annotations

import types

import torch

SYMBOLS = frozenset({"topk_rows"})

try:
    from jax_dg.backends import _kernels
except ImportError as e:   # built without a CUDA toolkit
    _kernels, _error = None, f"{type(e).__name__}: {e}"
else:
    _error = None


def available() -> bool:
    return _kernels is not None


def import_error() -> str | None:
    return _error


def max_k() -> int:
    return _kernels.topk_max_k() if _kernels is not None else 0


def topk_rows(logits: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
              out: torch.Tensor, cols: int, sorted: bool = True) -> None:
    """out[r] (int32 [rows, k]) = the columns of row r's k largest logits among columns
    lo[r] <= c < min(hi[r], cols) with logits > -inf; sorted: value descending, index
    ascending on ties (lax.top_k's order), else in column order; -1 past the candidates.
    `logits` is float32 [>= rows, stride], rows contiguous."""
    rows, k = out.shape
    stream = torch._C._cuda_getCurrentRawStream(logits.device.index)
    _kernels.topk_rows(logits.data_ptr(), logits.stride(0), 0 if lo is None else lo.data_ptr(),
                       0 if hi is None else hi.data_ptr(), rows, cols, k, sorted, out.data_ptr(),
                       stream)


def namespace() -> types.SimpleNamespace:
    return types.SimpleNamespace(topk_rows=topk_rows)
