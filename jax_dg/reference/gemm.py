"""Pure-JAX references of the GEMM family."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def dequant(x: jax.Array, sf: jax.Array, gran_rows: int, gran_cols: int) -> jax.Array:
    """float32 values of an FP8 array whose last two dims carry block scales."""
    sf = sf.astype(jnp.float32)
    if gran_rows > 1:
        sf = jnp.repeat(sf, gran_rows, axis=-2)
    if gran_cols > 1:
        sf = jnp.repeat(sf, gran_cols, axis=-1)
    rows, cols = x.shape[-2:]
    return x.astype(jnp.float32) * sf[..., :rows, :cols]


def fp8_gemm_nt(a, sfa, b, sfb, c, *, out_dtype: str, recipe):
    gm, gn, gk = recipe
    d = jnp.matmul(dequant(a, sfa, gm, gk), dequant(b, sfb, gn, gk).T, precision=HIGHEST)
    if c is not None:
        d = d + c.astype(jnp.float32)
    return d.astype(out_dtype)


def bf16_gemm_nt(a, b, c, *, out_dtype: str):
    """a [M, K] @ b[N, K].T (+ c), float32 accumulation."""
    d = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=HIGHEST)
    if c is not None:
        d = d + c.astype(jnp.float32)
    return d.astype(out_dtype)
