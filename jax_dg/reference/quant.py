"""DeepGEMM's FP8 quantisers in JAX (deep_gemm/utils/math.py), bitwise equal to DeepGEMM's.

Scale factor sf = max(amax of the block, 1e-4) / 448; with `use_ue8m0` it is rounded up to a
power of two. Values are x * (1 / sf) cast to float8_e4m3fn. The checked public forms are in
jax_dg.quant; these take well-formed input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.contracts import align

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


def ceil_to_ue8m0(x: jax.Array) -> jax.Array:
    """Rounds |x| (float32) up to the next power of two, as DeepGEMM's UE8M0 scales do."""
    bits = jax.lax.bitcast_convert_type(jnp.abs(x).astype(jnp.float32), jnp.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.clip(exp, 1, 254) << 23, jnp.float32)


def pack_ue8m0_to_int(x: jax.Array) -> jax.Array:
    """Packs 4 power-of-two float32 scales (last axis, a multiple of 4) into one int32 of
    exponent bytes."""
    exps = (jax.lax.bitcast_convert_type(x, jnp.int32) >> 23).astype(jnp.uint8)
    exps = exps.reshape(*x.shape[:-1], x.shape[-1] // 4, 4)
    return jax.lax.bitcast_convert_type(exps, jnp.int32)


def scale_for(amax: jax.Array, use_ue8m0: bool = False) -> jax.Array:
    """DeepGEMM's scale factor max(amax, 1e-4) / 448 (rounded up to a power of two with UE8M0)."""
    # Optimisation barriers keep the divisions IEEE divisions, as in torch: XLA's simplifier
    # turns `a / 448` into `a * (1/448)` and `1 / (a / 448)` into `448 / a`, each 1 ulp off
    # in some scales and then in some FP8 values.
    sf = jax.lax.optimization_barrier(
        jnp.maximum(amax, 1e-4) / jax.lax.optimization_barrier(jnp.full_like(amax, FP8_MAX)))
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def cast_with_scale(x: jax.Array, sf: jax.Array) -> jax.Array:
    """x * (1 / sf) cast to float8_e4m3fn (sf broadcast against x), as DeepGEMM computes it."""
    return (x.astype(jnp.float32) * jax.lax.optimization_barrier(1.0 / sf)).astype(FP8)


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
