"""Torch emulation of DeepGEMM's einsum kernels (same signatures as deep_gemm's)."""

from __future__ import annotations

import torch

from jax_dg.backends.torch_emu.common import dequant

__all__ = ["einsum", "fp8_einsum"]


def einsum(expr, a, b, d, c=None, use_cublaslt=False) -> None:
    """d = einsum(expr, a, b) (+ c), float32 accumulation."""
    out = torch.einsum(expr, a.float(), b.float())
    if c is not None:
        out = out + c.float()
    d.copy_(out)


def fp8_einsum(expr, a, b, d, c=None, recipe=(1, 128, 128)) -> None:
    """'bhr,hdr->bhd' on FP8: x per token (1 x 128 along r), y per 128 x 128 block of each head."""
    out = torch.einsum(expr, dequant(*a, 1, 128), dequant(*b, 128, 128))
    if c is not None:
        out = out + c.float()
    d.copy_(out)
