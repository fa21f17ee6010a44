"""Dense GEMMs: FP8 with DeepSeek's block scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.core.checks import Checker, cdiv
from jax_dg.core.op import Op
from jax_dg.reference import gemm as ref

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
DEFAULT_RECIPE = (1, 128, 128)
# Scale granularities DeepGEMM takes on SM90: per-token a with per-block or per-channel b.
RECIPES = {(1, 128, 128), (1, 1, 128)}


def _recipe(recipe):
    return tuple(recipe) if recipe is not None else DEFAULT_RECIPE


def _fp8_gemm_nt_rule(a, sfa, b, sfb, c, *, out_dtype, recipe):
    ck = Checker("fp8_gemm_nt")
    gm, gn, gk = _recipe(recipe)
    ck.that((gm, gn, gk) in RECIPES, "recipe", f"must be one of {sorted(RECIPES)}", recipe)
    ck.ndim(a, "a[0]", 2, "[M, K]")
    ck.dtype(a, "a[0]", FP8)
    ck.ndim(b, "b[0]", 2, "[N, K]")
    ck.dtype(b, "b[0]", FP8)
    m, k = a.shape
    n = b.shape[0]
    ck.that(b.shape[1] == k, "b[0]", f"must be [N, K] with a[0]'s K = {k}", tuple(b.shape))
    ck.tensor(sfa, "a[1]", [F32], (cdiv(m, gm), cdiv(k, gk)), f"[ceil(M/{gm}), ceil(K/{gk})]")
    ck.tensor(sfb, "b[1]", [F32], (cdiv(n, gn), cdiv(k, gk)), f"[ceil(N/{gn}), ceil(K/{gk})]")
    ck.that(out_dtype in ("bfloat16", "float32"), "out_dtype", "must be bfloat16 or float32",
            out_dtype)
    if c is not None:
        ck.tensor(c, "c", [F32], (m, n), "[M, N]")
        ck.that(out_dtype == "float32", "out_dtype", "must be float32 when `c` is given",
                out_dtype)
    return [jax.ShapeDtypeStruct((m, n), out_dtype)]


def _fp8_gemm_nt_call(k, a, sfa, b, sfb, c, d, *, out_dtype, recipe):
    k.fp8_gemm_nt((a, sfa), (b, sfb), d, c=c, recipe=None if recipe is None else tuple(recipe))


def _fp8_gemm_nt_reference(a, sfa, b, sfb, c, *, out_dtype, recipe):
    return ref.fp8_gemm_nt(a, sfa, b, sfb, c, out_dtype=out_dtype, recipe=_recipe(recipe))


FP8_GEMM_NT = Op(
    name="fp8_gemm_nt",
    args=("a", "sfa", "b", "sfb", "c"),
    rule=_fp8_gemm_nt_rule,
    call=_fp8_gemm_nt_call,
    reference=_fp8_gemm_nt_reference,
    kernels=("fp8_gemm_nt",),
    aliases={"c": 0},
)


def fp8_gemm_nt(a, b, *, c=None, out_dtype=jnp.bfloat16, recipe=None) -> jax.Array:
    """d = a @ b.T (+ c) on FP8 operands with block scales (DeepGEMM's fp8_gemm_nt).

    a: (values float8_e4m3fn [M, K], scales float32 [M, ceil(K/128)])  (per token)
    b: (values float8_e4m3fn [N, K], scales float32 [ceil(N/128), ceil(K/128)])  (per block)
    c: optional float32 [M, N] accumulator (then out_dtype must be float32); XLA may donate it.
    Returns d [M, N] in out_dtype (bfloat16 by default).
    """
    ck = Checker("fp8_gemm_nt")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    (d,) = FP8_GEMM_NT(av, sfa, bv, sfb, c, out_dtype=jnp.dtype(out_dtype).name,
                       recipe=None if recipe is None else [int(r) for r in recipe])
    return d
