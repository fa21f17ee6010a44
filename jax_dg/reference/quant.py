"""DeepGEMM's FP8 quantisers in JAX (deep_gemm/utils/math.py), bitwise equal to DeepGEMM's: the
test oracle (and the backend "xla"'s quantisation inside the references, e.g. jax_dg.reference.mhc).

Scale factor sf = max(amax of the block, 1e-4) / 448; with `use_ue8m0` it is rounded up to a
power of two. Values are x * (1 / sf) cast to float8_e4m3fn. Those element-wise formulas are
jax_dg.numerics (shared with the product); the blocking and the UE8M0 packing here are the
oracle's own. The product's checked quantisers are jax_dg.operands.quant, a separate implementation:
neither imports the other (tests/test_layering.py), tests/operands/test_quant.py compares them bitwise.
These take well-formed input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.contracts import align
from jax_dg.numerics import FP8, FP8_MAX, cast_with_scale, ceil_to_ue8m0, scale_for  # noqa: F401


def pack_ue8m0_to_int(x: jax.Array) -> jax.Array:
    """Packs 4 power-of-two float32 scales (last axis, a multiple of 4) into one int32 of
    exponent bytes."""
    exps = (jax.lax.bitcast_convert_type(x, jnp.int32) >> 23).astype(jnp.uint8)
    exps = exps.reshape(*x.shape[:-1], x.shape[-1] // 4, 4)
    return jax.lax.bitcast_convert_type(exps, jnp.int32)


def per_token_cast_to_fp8(x: jax.Array, use_ue8m0: bool = False, gran_k: int = 128):
    """[m, n] -> (float8 values [m, n], float32 scales [m, ceil(n / gran_k)]), 1 x gran_k blocks."""
    m, n = x.shape
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, align(n, gran_k) - n)))
    xv = xp.reshape(m, align(n, gran_k) // gran_k, gran_k)   # explicit: m may be 0
    sf = scale_for(jnp.abs(xv).max(axis=2), use_ue8m0)
    values = cast_with_scale(xv, sf[:, :, None]).reshape(m, align(n, gran_k))[:, :n]
    return values, sf


def per_block_cast_to_fp8(x: jax.Array, use_ue8m0: bool = False, gran_k: int = 128):
    """[m, n] -> (float8 values [m, n], float32 scales [ceil(m/128), ceil(n/128)]), 128 x 128 blocks."""
    m, n = x.shape
    xp = jnp.pad(x.astype(jnp.float32), ((0, align(m, gran_k) - m), (0, align(n, gran_k) - n)))
    xv = xp.reshape(xp.shape[0] // gran_k, gran_k, xp.shape[1] // gran_k, gran_k)
    sf = scale_for(jnp.abs(xv).max(axis=(1, 3), keepdims=True), use_ue8m0)
    values = cast_with_scale(xv, sf).reshape(xp.shape)[:m, :n]
    return values, sf.reshape(xv.shape[0], xv.shape[2])
