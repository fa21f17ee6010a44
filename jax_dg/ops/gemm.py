"""Dense GEMMs: FP8 with DeepSeek's block scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.core.checks import Checker, cdiv
from jax_dg.core.op import Op
from jax_dg.reference import gemm as ref

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
# SM90 scale recipes (gran_m of a, gran_n of b, gran_k) and what each kernel writes:
# per-token a with per-block b -> bfloat16 d, no c; per-token a with per-channel b -> float32
# d accumulated onto a required c.
RECIPE_BLOCK = (1, 128, 128)
RECIPE_CHANNEL = (1, 1, 128)
OUT_DTYPE = {RECIPE_BLOCK: "bfloat16", RECIPE_CHANNEL: "float32"}


def infer_recipe(n: int, sfb_shape) -> tuple[int, int, int]:
    """DeepGEMM's default (per-block b) unless b's scales are per channel ([N, ...], N > 1)."""
    return RECIPE_CHANNEL if n > 1 and tuple(sfb_shape)[:1] == (n,) else RECIPE_BLOCK


def _fp8_gemm_nt_rule(a, sfa, b, sfb, c, *, out_dtype, recipe):
    ck = Checker("fp8_gemm_nt")
    recipe = tuple(recipe)
    ck.that(recipe in OUT_DTYPE, "recipe", f"must be one of {sorted(OUT_DTYPE)} on SM90", recipe)
    gm, gn, gk = recipe
    ck.ndim(a, "a[0]", 2, "[M, K]")
    ck.dtype(a, "a[0]", FP8)
    ck.ndim(b, "b[0]", 2, "[N, K]")
    ck.dtype(b, "b[0]", FP8)
    m, k = a.shape
    n = b.shape[0]
    ck.that(b.shape[1] == k, "b[0]", f"must be [N, K] with a[0]'s K = {k}", tuple(b.shape))
    ck.that(k % 16 == 0, "a[0]", "must have K % 16 == 0 (16-byte rows for TMA)", k)
    ck.tensor(sfa, "a[1]", [F32], (cdiv(m, gm), cdiv(k, gk)), f"[ceil(M/{gm}), ceil(K/{gk})]")
    ck.tensor(sfb, "b[1]", [F32], (cdiv(n, gn), cdiv(k, gk)), f"[ceil(N/{gn}), ceil(K/{gk})]")
    ck.that(out_dtype == OUT_DTYPE[recipe], "out_dtype",
            f"must be {OUT_DTYPE[recipe]} with recipe {recipe}", out_dtype)
    ck.that(n % (8 if out_dtype == "bfloat16" else 4) == 0, "b[0]",
            f"must have N % {8 if out_dtype == 'bfloat16' else 4} == 0 (16-byte rows of d)", n)
    if recipe == RECIPE_CHANNEL:
        ck.that(c is not None, "c", f"is required with recipe {recipe} (d = c + a @ b.T)")
    if c is not None:
        ck.that(recipe == RECIPE_CHANNEL, "c", f"needs recipe {RECIPE_CHANNEL} (per-channel b "
                "scales, float32 d); DeepGEMM's per-block kernel does not accumulate")
        ck.tensor(c, "c", [F32], (m, n), "[M, N]")
    return [jax.ShapeDtypeStruct((m, n), out_dtype)]


def _fp8_gemm_nt_call(k, a, sfa, b, sfb, c, d, *, out_dtype, recipe):
    k.fp8_gemm_nt((a, sfa), (b, sfb), d, c=c, recipe=tuple(recipe))


def _fp8_gemm_nt_reference(a, sfa, b, sfb, c, *, out_dtype, recipe):
    return ref.fp8_gemm_nt(a, sfa, b, sfb, c, out_dtype=out_dtype, recipe=tuple(recipe))


FP8_GEMM_NT = Op(
    name="fp8_gemm_nt",
    args=("a", "sfa", "b", "sfb", "c"),
    rule=_fp8_gemm_nt_rule,
    call=_fp8_gemm_nt_call,
    reference=_fp8_gemm_nt_reference,
    kernels=("fp8_gemm_nt",),
    aliases={"c": 0},
)


def fp8_gemm_nt(a, b, *, c=None, out_dtype=None, recipe=None) -> jax.Array:
    """d = a @ b.T (+ c) on FP8 operands with DeepSeek's block scaling (DeepGEMM fp8_gemm_nt).

    a: (values float8_e4m3fn [M, K], scales float32 [M, ceil(K/128)])      per token (1 x 128)
    b: (values float8_e4m3fn [N, K], scales float32 [ceil(N/128), ceil(K/128)])  per block
       or scales float32 [N, ceil(K/128)]: per channel, recipe (1, 1, 128)
    c: float32 [M, N] accumulator, required by (and only by) the per-channel recipe; XLA may
       donate its buffer to d.
    out_dtype: bfloat16 for the per-block recipe, float32 for the per-channel one (the default
       follows the recipe; other choices are rejected, as DeepGEMM's SM90 kernels do).
    recipe: (gran_m, gran_n, gran_k); inferred from b's scale shape when None.
    Returns d [M, N]. K must be a multiple of 16, N of 8 (bfloat16 d) or 4 (float32 d).
    """
    ck = Checker("fp8_gemm_nt")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    ck.array(bv, "b[0]")
    ck.array(sfb, "b[1]")
    recipe = tuple(int(r) for r in recipe) if recipe is not None else infer_recipe(bv.shape[0], sfb.shape)
    out_dtype = OUT_DTYPE.get(recipe, "bfloat16") if out_dtype is None else jnp.dtype(out_dtype).name
    (d,) = FP8_GEMM_NT(av, sfa, bv, sfb, c, out_dtype=out_dtype, recipe=list(recipe))
    return d
