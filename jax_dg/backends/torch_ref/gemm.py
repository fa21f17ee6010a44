"""Torch reference of DeepGEMM's GEMM kernels (same signatures as deep_gemm's)."""

from __future__ import annotations

import torch

from jax_dg.backends.torch_ref.common import dequant

__all__ = ["fp8_gemm_nt"]

_DEFAULT_RECIPE = (1, 128, 128)


def _fp8_operands(a, b, recipe):
    (av, sfa), (bv, sfb) = a, b
    gm, gn, gk = recipe or _DEFAULT_RECIPE
    return dequant(av, sfa, gm, gk), dequant(bv, sfb, gn, gk)


def fp8_gemm_nt(a, b, d, c=None, recipe=None, **_unused) -> None:
    """d = a @ b.T (+ c), FP8 operands with block scales, fp32 accumulation."""
    x, w = _fp8_operands(a, b, recipe)
    out = x @ w.T
    if c is not None:
        out = out + c.float()
    d.copy_(out)
