"""Dequantisation helpers shared by the torch emulation kernels."""

from __future__ import annotations

import torch


def expand_scales(sf: torch.Tensor, rows: int, cols: int, gran_rows: int, gran_cols: int):
    """A per-block scale grid blown up to one scale per element ([rows, cols])."""
    sf = sf.float()
    if gran_rows > 1:
        sf = sf.repeat_interleave(gran_rows, dim=-2)
    if gran_cols > 1:
        sf = sf.repeat_interleave(gran_cols, dim=-1)
    return sf[..., :rows, :cols]


def dequant(x: torch.Tensor, sf: torch.Tensor, gran_rows: int, gran_cols: int) -> torch.Tensor:
    """float32 values of an FP8 tensor whose last two dims carry block scales."""
    return x.float() * expand_scales(sf, x.shape[-2], x.shape[-1], gran_rows, gran_cols)


def matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y summed in float64, returned as float32. Products of float32 values are exact in
    float64 and their sums nearly so, so the result does not depend on how the BLAS splits the
    work by shape and thread count: a shard's rows equal the whole's, as on the GPU."""
    return (x.double() @ y.double()).float()


def check_dims(compiled_dims) -> None:
    """DeepGEMM's bindings take compiled_dims as a string: anything else (None too) is a
    TypeError there, so it is one here."""
    if not isinstance(compiled_dims, str):
        raise TypeError(f"compiled_dims: expected str (as deep_gemm's binding), got {compiled_dims!r}")
