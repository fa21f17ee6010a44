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


def fp8_gemm_nt_skip_head_mid(a, sfa, b, sfb, d, *, head_splits, recipe):
    """fp8_gemm_nt's d = a @ b.T, (left + right) columns per head, written into each head of
    d [M, N + N / (left + right) * mid] around its `mid` columns, which keep d's values."""
    left, mid, right = head_splits
    out = fp8_gemm_nt(a, sfa, b, sfb, None, out_dtype=d.dtype, recipe=recipe)
    m, n = out.shape
    heads = n // (left + right)
    out = out.reshape(m, heads, left + right)
    full = d.reshape(m, heads, left + mid + right)
    full = full.at[:, :, :left].set(out[:, :, :left]).at[:, :, left + mid:].set(out[:, :, left:])
    return full.reshape(d.shape)


def bf16_gemm_nt(a, b, c, *, out_dtype: str):
    """a [M, K] @ b[N, K].T (+ c), float32 accumulation."""
    d = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32).T, precision=HIGHEST)
    if c is not None:
        d = d + c.astype(jnp.float32)
    return d.astype(out_dtype)
