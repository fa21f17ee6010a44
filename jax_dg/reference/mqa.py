"""Pure-JAX references of the MQA-logits family (the DeepSeek V3.2 lightning indexer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def weighted_relu_logits(q: jax.Array, k: jax.Array, weights: jax.Array) -> jax.Array:
    """`logits[m, n] = sum_h relu(q[m, h] . k[n]) * weights[m, h]` in float32.

    q float32 [M, H, D], k float32 [N, D] (already dequantised), weights float32 [M, H] -> [M, N].
    """
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    s = jnp.einsum("mhd,nd->mhn", q, k, precision=HIGHEST)
    return jnp.einsum("mhn,mh->mn", jnp.maximum(s, 0.0), weights.astype(jnp.float32), precision=HIGHEST)
