"""Pure-JAX reference of the hyper-connection pre-norm GEMM."""

from __future__ import annotations

import jax.numpy as jnp

from jax_dg.contracts import hc_split_bounds
from jax_dg.reference.gemm import HIGHEST

def tf32_hc_prenorm_gemm(x, fn, *, num_split):
    xf, fn = x.astype(jnp.float32), fn.astype(jnp.float32)
    if num_split is None:
        return jnp.matmul(xf, fn.T, precision=HIGHEST), jnp.square(xf).sum(-1)
    parts = [(jnp.matmul(xf[:, s:e], fn[:, s:e].T, precision=HIGHEST), jnp.square(xf[:, s:e]).sum(-1))
             for s, e in hc_split_bounds(x.shape[1], num_split)]
    return jnp.stack([d for d, _ in parts]), jnp.stack([q for _, q in parts])
