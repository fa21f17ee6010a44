"""jax_dg's own CUDA kernels (kernels/*.cu, compiled where the build finds a CUDA toolkit).

A leaf like `deep_gemm`: it imports nothing of jax_dg. Its functions take torch CUDA tensors
and launch on torch's current stream (XLA's, inside a custom call); they allocate nothing.
Where the module was not built, `available()` is False and jax_dg runs the torch reference
of the same contract (backends.torch_ref: topk.py, grouped.py, mqa.py).
"""

from __future__ import annotations

import torch

SYMBOLS = frozenset({"topk_rows", "neg_inf_outside", "zero_masked_tail", "zero_padding_rows"})

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


def neg_inf_outside(logits: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor, rows: int,
                    cols: int, relative: bool = False) -> None:
    """logits[r, c] := -inf for r < rows, c < cols outside row r's valid columns, in place:
    [lo[r], hi[r]) (lo None: 0), or with `relative` [0, hi[r] - lo[r]); the valid columns are
    not touched. `logits` is float32 or bfloat16 [>= rows, stride], rows contiguous; lo, hi
    int32 [rows]."""
    assert logits.stride(1) == 1 and logits.element_size() in (2, 4)
    stream = torch._C._cuda_getCurrentRawStream(logits.device.index)
    _kernels.neg_inf_outside(logits.data_ptr(), logits.stride(0), logits.element_size(), rows, cols,
                             0 if lo is None else lo.data_ptr(), hi.data_ptr(), relative, stream)


def _row_bytes(d: torch.Tensor, rows: int) -> int:
    """Bytes per row of a dense d viewed as [rows, ...] (the kernels store 16 bytes at a time)."""
    assert d.is_contiguous() and d.data_ptr() % 16 == 0, "d must be dense and 16-byte aligned"
    row_bytes = d.numel() * d.element_size() // max(rows, 1)
    assert row_bytes % 16 == 0, "rows must be a multiple of 16 bytes"
    return row_bytes


def zero_masked_tail(d: torch.Tensor, masked_m: torch.Tensor) -> None:
    """d [G, Mmax, ...]: rows masked_m[g] <= r < Mmax of each group := 0 (masked_m clamped to
    [0, Mmax]); the other rows are not touched."""
    g, max_m = d.shape[0], d.shape[1]
    stream = torch._C._cuda_getCurrentRawStream(d.device.index)
    _kernels.zero_masked_tail(d.data_ptr(), _row_bytes(d, g * max_m), g, max_m, masked_m.data_ptr(),
                              stream)


def zero_padding_rows(d: torch.Tensor, layout: torch.Tensor, block: int,
                      skip_padding_blocks: bool) -> None:
    """d [M, ...]: rows with layout[r] < 0 := 0, except, with skip_padding_blocks, in blocks of
    `block` rows whose first row has id < 0 (left as they are)."""
    rows = d.shape[0]
    stream = torch._C._cuda_getCurrentRawStream(d.device.index)
    _kernels.zero_padding_rows(d.data_ptr(), _row_bytes(d, rows), rows, block, layout.data_ptr(),
                               skip_padding_blocks, stream)

