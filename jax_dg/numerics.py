"""DeepGEMM's FP8 quantisation arithmetic in jax.numpy: the one piece of math that both the
product (jax_dg.operands.quant, jax_dg.operands.paged, jax_dg.operands.indexer, jax_dg.ops.linear) and the pure-JAX
reference (jax_dg.reference.quant, the test oracle) need.

Per block, DeepGEMM (deep_gemm/utils/math.py) computes

    sf     = max(amax of the block, 1e-4) * fl(1/448)  (torch's CUDA `/ 448.0`; UE8M0: rounded
                                                         up to a power of two)
    values = (x * (1 / sf)) cast to float8_e4m3fn

Only these element-wise formulas live here; how blocks are formed (padding, reshapes, which
axes a scale covers) and how scales are stored is each side's own code, so the product and the
oracle stay two implementations that the tests compare bitwise (and both against DeepGEMM's
torch formulas, tests/operands/test_quant.py).

Layer: below everything but jax_dg.contracts; it imports jax and nothing of jax_dg. The torch
reference (jax_dg.backends.torch_emu) does not use it: it states the formulas in torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0      # largest finite float8_e4m3fn
SF_FLOOR = 1e-4      # amax floor: an all-zero block gets sf = 1e-4 / 448, not 0
INV_FP8_MAX = 1.0 / 448.0   # as float32 0x3b124925: what torch's CUDA division by 448.0 multiplies by


def ceil_to_ue8m0(x: jax.Array) -> jax.Array:
    """Rounds |x| (as float32) up to the next power of two, as DeepGEMM's UE8M0 scales do
    (exponent clamped to [1, 254]: zero gives 2^-126, infinity 2^127). Unchecked."""
    bits = jax.lax.bitcast_convert_type(jnp.abs(x).astype(jnp.float32), jnp.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.clip(exp, 1, 254) << 23, jnp.float32)


def scale_for(amax: jax.Array, use_ue8m0: bool = False) -> jax.Array:
    """DeepGEMM's scale factor max(amax, 1e-4) / 448 (rounded up to a power of two with UE8M0),
    as its torch code computes it on the GPU: torch's CUDA division by a Python scalar is a
    multiplication by the float reciprocal (ATen's div_true_kernel_cuda), so sf is
    max(amax, 1e-4) * fl(1/448) (its CPU kernel divides: 1 ulp apart in some scales)."""
    # The barrier keeps 1 / sf (cast_with_scale) a division of sf: XLA's simplifier would
    # fold `1 / (a * c)` into another expression, off in some scales and then FP8 values.
    sf = jax.lax.optimization_barrier(jnp.maximum(amax, SF_FLOOR) * jnp.float32(INV_FP8_MAX))
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def cast_with_scale(x: jax.Array, sf: jax.Array) -> jax.Array:
    """x * (1 / sf) cast to float8_e4m3fn (sf broadcast against x), as DeepGEMM computes it."""
    return (x.astype(jnp.float32) * jax.lax.optimization_barrier(1.0 / sf)).astype(FP8)
