"""Torch emulation of DeepGEMM's hyper-connection pre-norm GEMM."""

from __future__ import annotations

from jax_dg.contracts import hc_split_bounds

__all__ = ["tf32_hc_prenorm_gemm"]


def tf32_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits=None) -> None:
    """d = a.float() @ b.T and sqr_sum = sum(a.float()**2, -1), per split of K when num_splits
    is given (split s takes whole 64-wide K blocks, the remainder going to the first splits)."""
    x, w = a.float(), b.float()
    if num_splits is None:
        d.copy_(x @ w.T)
        sqr_sum.copy_(x.square().sum(-1))
        return
    for s, (start, end) in enumerate(hc_split_bounds(a.shape[1], num_splits)):
        d[s].copy_(x[:, start:end] @ w[:, start:end].T)
        sqr_sum[s].copy_(x[:, start:end].square().sum(-1))
