"""Pure-JAX references of DeepGEMM's einsum kernels (BF16, and FP8 'bhr,hdr->bhd')."""

from __future__ import annotations

import jax.numpy as jnp

from jax_dg.reference.gemm import HIGHEST, dequant


def einsum(a, b, c, *, expr: str, out_dtype: str):
    d = jnp.einsum(expr, a.astype(jnp.float32), b.astype(jnp.float32), precision=HIGHEST)
    if c is not None:
        d = d + c.astype(jnp.float32)
    return d.astype(out_dtype)


def fp8_einsum(a, sfa, b, sfb, *, expr: str):
    x, y = dequant(a, sfa, 1, 128), dequant(b, sfb, 128, 128)
    return jnp.einsum(expr, x, y, precision=HIGHEST).astype(jnp.bfloat16)
