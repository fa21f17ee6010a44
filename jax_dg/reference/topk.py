"""Pure-JAX reference of jax_dg's top-k selection (kernels/topk.cu's contract)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_rows(logits, lo, hi, *, rows: int, cols: int, k: int, sorted: bool = True):
    """int32 [rows, k]: lax.top_k's columns of logits[:rows, :cols] among the candidates
    (lo <= c < hi when given, logits > -inf: NaN is none), in lax.top_k's order or (not
    sorted) in column order, -1 past them."""
    x = logits[:rows, :cols].astype(jnp.float32)
    col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    ok = x > -jnp.inf
    if lo is not None:
        ok &= col >= lo[:, None]
    if hi is not None:
        ok &= col < hi[:, None]
    x = jnp.where(ok, x, -jnp.inf)
    take = min(k, cols)
    values, idx = jax.lax.top_k(x, take)
    idx = jnp.where(values > -jnp.inf, idx, cols).astype(jnp.int32)
    if not sorted:
        idx = jnp.sort(idx, axis=1)
    idx = jnp.where(idx < cols, idx, -1)
    return jnp.pad(idx, ((0, 0), (0, k - take)), constant_values=-1)
