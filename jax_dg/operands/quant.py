"""FP8 quantisation in XLA (DeepGEMM's formulas, bitwise) and the test metric: the product's one
implementation of the blockings, whose formulas jax_dg.operands.paged and
jax_dg.operands.indexer use too. The public quantisers (per_token_cast_to_fp8,
per_block_cast_to_fp8, jax_dg.ops.cast) run jax_dg's fused cast where it takes the input
(float32 / bfloat16, gran_k 128: bitwise these formulas, one kernel) and `per_token` /
`per_block` below otherwise. XLA's GPU code of the formulas was measured 1 FP8 value in 6600
apart from deep_gemm's own quantisers (tests/operands/test_quant.py, float32 [33, 200], before
the padding sent that shape to the kernel).

Scale factor sf = max(amax of the block, 1e-4) / 448 (as torch computes it on the GPU: times the
float reciprocal, jax_dg.numerics); with `use_ue8m0` it is rounded up to a
power of two. Values are x * (1 / sf) cast to float8_e4m3fn. The element-wise formulas are
jax_dg.numerics (shared with the oracle); the blocking, the UE8M0 packing and the checks are
this module's. It never imports the pure-JAX reference jax_dg.reference.quant (the test
oracle): tests/operands/test_quant.py compares the two bitwise, and both with DeepGEMM's torch code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dg.contracts import align
from jax_dg.core.checks import Checker
from jax_dg.numerics import FP8, FP8_MAX, cast_with_scale, scale_for  # noqa: F401
from jax_dg.operands.scales import ceil_to_ue8m0, pack_ue8m0_to_int  # noqa: F401  (public here too)

__all__ = ["FP8", "FP8_MAX", "ceil_to_ue8m0", "pack_ue8m0_to_int", "scale_for", "cast_with_scale",
           "per_token", "per_block", "calc_diff"]


def check_cast(name: str, x, use_ue8m0, gran_k) -> tuple[bool, int]:
    """The quantisers' checks: x a floating [m, n]; (use_ue8m0, gran_k) as static values."""
    ck = Checker(name)
    ck.floating(x, "x")
    ck.that(len(getattr(x, "shape", ())) != 3, "x",
            f"must be 2-D [m, n]: for grouped operands ([G, m, n], e.g. experts' weights) map it "
            f"over the groups, jax.vmap(jax_dg.{name})(x), which gives values [G, m, n] and scales "
            f"with a leading G (docs/api.md, \"Grouped operands\")", getattr(x, "shape", None))
    ck.ndim(x, "x", 2, "[m, n]")
    return ck.static_bool(use_ue8m0, "use_ue8m0"), ck.static_int(gran_k, "gran_k", minimum=1)


def per_token(x: jax.Array, use_ue8m0: bool, gran_k: int):
    """[m, n] -> (values, scales [m, ceil(n / gran_k)]): 1 x gran_k blocks, in XLA."""
    m, n = x.shape
    kp = align(n, gran_k)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kp - n)))   # zero columns: amax unchanged
    blocks = xp.reshape(m, kp // gran_k, gran_k)                  # explicit sizes: m may be 0
    sf = scale_for(jnp.abs(blocks).max(axis=2), use_ue8m0)
    return cast_with_scale(blocks, sf[:, :, None]).reshape(m, kp)[:, :n], sf


def per_block(x: jax.Array, use_ue8m0: bool, gran_k: int):
    """[m, n] -> (values, scales [ceil(m/gran_k), ceil(n/gran_k)]): gran_k x gran_k blocks, in
    XLA."""
    m, n = x.shape
    mp, kp = align(m, gran_k), align(n, gran_k)
    xp = jnp.pad(x.astype(jnp.float32), ((0, mp - m), (0, kp - n)))
    blocks = xp.reshape(mp // gran_k, gran_k, kp // gran_k, gran_k)
    sf = scale_for(jnp.abs(blocks).max(axis=(1, 3), keepdims=True), use_ue8m0)
    values = cast_with_scale(blocks, sf).reshape(mp, kp)[:m, :n]
    return values, sf.reshape(mp // gran_k, kp // gran_k)


def calc_diff(x, y):
    """DeepGEMM's test metric, 1 - 2*sum(x*y) / sum(x^2 + y^2), computed in float64.

    Concrete arrays are reduced on the host in float64 (a Python float comes back, as from
    DeepGEMM's). Inside a trace it is a jnp expression, float64 only with jax_enable_x64.
    """
    if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
        dt = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        x, y = jnp.asarray(x).astype(dt), jnp.asarray(y).astype(dt)
        den = (x * x + y * y).sum()
        return jnp.where(den == 0, 0.0, 1.0 - 2.0 * (x * y).sum() / jnp.where(den == 0, 1, den))
    x, y = np.asarray(x), np.asarray(y)
    ck = Checker("calc_diff")
    for v, arg in ((x, "x"), (y, "y")):   # None or a string would become nan or a TypeError
        ck.that(jnp.issubdtype(v.dtype, jnp.number) or v.dtype == np.bool_, arg,
                "must be a numeric array", v.dtype.name)
    ck.that(x.size == y.size, "y", f"must have x's {x.size} elements", y.size)
    x, y = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    den = float(np.dot(x, x) + np.dot(y, y))  # dots: no temporaries the size of the inputs
    return 0.0 if den == 0 else 1.0 - 2.0 * float(np.dot(x, y)) / den


calc_diff.__jax_dg_runs__ = ("on the host in float64 (numpy) for concrete arrays, as DeepGEMM's; "
                             "a jnp expression inside a trace")
