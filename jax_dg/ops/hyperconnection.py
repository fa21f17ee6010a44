"""Hyper-connection pre-norm GEMM (DeepGEMM tf32_hc_prenorm_gemm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.core.checks import Checker
from jax_dg.core.op import REQUIRED, Op, exposes
from jax_dg.reference import hyperconnection as ref

__all__ = ["tf32_hc_prenorm_gemm"]

F32 = jnp.float32


def _shapes(x, fn, *, num_split):
    ck = Checker("tf32_hc_prenorm_gemm")
    ck.ndim(x, "x", 2, "[M, K]")
    ck.dtype(x, "x", jnp.bfloat16)
    ck.ndim(fn, "fn", 2, "[N, K]")
    ck.dtype(fn, "fn", F32)
    m, k = x.shape
    n = fn.shape[0]
    ck.that(fn.shape[1] == k, "fn", f"must be [N, K] with x's K = {k}", tuple(fn.shape))
    ck.that(0 < n <= 32 and n % 8 == 0, "fn", "must have 0 < N <= 32 and N % 8 == 0", n)
    ck.that(k > 0 and k % 64 == 0, "x", "must have K a positive multiple of 64", k)
    if num_split is None:
        return [jax.ShapeDtypeStruct((m, n), F32), jax.ShapeDtypeStruct((m,), F32)]
    s = ck.static_int(num_split, "num_split", 1)
    ck.that(s <= k // 64, "num_split", f"must be <= K / 64 = {k // 64} (a split takes whole "
            "64-wide K blocks)", s)
    return [jax.ShapeDtypeStruct((s, m, n), F32), jax.ShapeDtypeStruct((s, m), F32)]


def _run(rt, x, fn, d, sqr_sum, *, num_split):
    rt.dg.tf32_hc_prenorm_gemm(x, fn, d, sqr_sum, num_split)


TF32_HC_PRENORM_GEMM = Op(
    name="tf32_hc_prenorm_gemm",
    args=("x", "fn"),
    statics={"num_split": REQUIRED},
    shapes=_shapes,
    run=_run,
    reference=ref.tf32_hc_prenorm_gemm,
    symbols=("tf32_hc_prenorm_gemm",),
)


@exposes(TF32_HC_PRENORM_GEMM)
def tf32_hc_prenorm_gemm(x, fn, num_split: int | None = None) -> tuple[jax.Array, jax.Array]:
    """out = x.float() @ fn.T (TF32 tensor cores) and sqrsum = x.float().square().sum(-1).

    x: bfloat16 [M, K], K % 64 == 0; fn: float32 [N, K], N <= 32, N % 8 == 0.
    num_split: static int S >= 1 (<= K / 64): K is cut into S ranges of whole 64-wide blocks
    (the remainder to the first ranges) and partials come back per range: out float32
    [S, M, N], sqrsum float32 [S, M]; sum over axis 0 for the totals. None: out [M, N],
    sqrsum [M].
    """
    d, sqr_sum = TF32_HC_PRENORM_GEMM(x, fn, num_split=num_split)
    return d, sqr_sum
