"""Differentiable FP8 layers with DeepSeek V3's recipe: forward and backward on DeepGEMM.

    fp8_linear(x, w)                              y = x @ w.T
    fp8_grouped_linear(x, w, masked_m)            y[g] = x[g] @ w[g].T  (MoE experts, masked)

Forward: x per token (1 x 128 blocks along K), w per block (128 x 128), bf16 out. Backward, all
FP8 GEMMs (no XLA dot on dequantised values):
  dgrad  dx = dy @ w:   dy per token along N; w's FP8 values and block scales transposed (a
         128 x 128 block grid is transpose-symmetric, so no re-quantisation).
  wgrad  dw = dy.T @ x: both quantised along M (1 x 128), the float32-accumulating recipe
         (1, 1, 128) onto zeros.
The quantisers are straight-through: gradients are those of the unquantised product.

The casts are jax_dg's fused quantisers (jax_dg.ops.cast: one pass per operand, scales
written in the layout DeepGEMM reads, the transposed casts from the same read): three per step,
x and w in the forward pass, dy in the backward, bitwise the separate per-token and per-block
casts they replace.

Both layers go through jax_dg.core.derivative.with_vjp, the one backward mechanism (Ops use it
for their records' `vjp`): the forward pass casts x and w once (`save`), with their transposed
casts when differentiated, its GEMM reads them, and the rule (`_linear_vjp`, `_grouped_vjp`)
reuses the transposed ones for the dgrad and the wgrad. Not differentiated (`save_primal`),
nothing transposed is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dg.core import derivative
from jax_dg.core.checks import Checker
from jax_dg.core.op import exposes
from jax_dg.ops.cast import cast_blocks, cast_tokens
from jax_dg.ops.gemm import FP8_GEMM, RECIPE_CHANNEL, fp8_gemm_nt
from jax_dg.ops.grouped import K_GROUPED_FP8, M_GROUPED_FP8_MASKED, k_grouped_fp8_gemm_nt_contiguous, \
    m_grouped_fp8_gemm_nt_masked

__all__ = ["fp8_grouped_linear", "fp8_linear"]

BF16 = jnp.bfloat16
F32 = jnp.float32


def _check_linear(ck: Checker, x, w) -> tuple[int, int]:
    ck.array(x, "x")
    ck.array(w, "w")
    ck.dtype(x, "x", BF16, F32)
    ck.dtype(w, "w", BF16, F32)
    ck.that(x.ndim >= 1, "x", "must be [..., K]", tuple(x.shape))
    ck.ndim(w, "w", 2, "[N, K]")
    n, k = w.shape
    ck.that(x.shape[-1] == k, "x", f"must end in w's K = {k}", tuple(x.shape))
    ck.that(k % 16 == 0 and k > 0, "w", "must have K % 16 == 0 (FP8 rows of 16 bytes)", k)
    ck.that(n % 16 == 0 and n > 0, "w", "must have N % 16 == 0 (the backward contracts over N)", n)
    return n, k


def _linear_save(x2, w, *, transposed: bool = True):
    """One fused cast per operand (jax_dg.ops.cast): x per token and w per block for the
    forward GEMM; with `transposed` (differentiated), from the same reads, x.T per token for
    the wgrad and w.T's blocks for the dgrad."""
    x, xt = cast_tokens(x2, transposed=transposed)
    w_, wt = cast_blocks(w, transposed=transposed)
    return {"x": x, "w": w_, "xt": xt, "wt": wt}


def _linear_call(x2, w, saved):
    return fp8_gemm_nt(saved["x"], saved["w"])


def _linear_vjp(inputs, cts, saved):
    """(dx, dw) of y = x2 @ w.T: dgrad on w's saved blocks transposed; wgrad along M (rows
    padded to 16 by the cast), both from one cast of dy."""
    g, gt = cast_tokens(cts.astype(BF16), transposed=True)
    dx = fp8_gemm_nt(g, saved["wt"])                                     # [M, K] bf16
    n, k = gt[0].shape[0], saved["xt"][0].shape[0]
    dw = fp8_gemm_nt(gt, saved["xt"], c=jnp.zeros((n, k), F32), recipe=RECIPE_CHANNEL)
    return {"x": dx, "w": dw}


@exposes(FP8_GEMM["nt"], differentiable=True)
def fp8_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T in bfloat16 with DeepSeek V3's FP8 recipe, differentiable (see the module doc).

    x: bfloat16 or float32 [..., K]; w: bfloat16 or float32 [N, K] (the weight as trained; it is
    quantised per 128 x 128 block on every call). K % 16 == 0 and N % 16 == 0.
    Returns bfloat16 [..., N]. jax.grad gives dx in x's dtype and dw in w's dtype.
    """
    ck = Checker("fp8_linear")
    n, k = _check_linear(ck, x, w)
    lead = x.shape[:-1]
    linear = derivative.with_vjp(_linear_call, ("x", "w"), _linear_vjp, {}, save=_linear_save,
                                 save_primal=functools.partial(_linear_save, transposed=False))
    return linear(x.reshape(-1, k), w).reshape(*lead, n)


# --- MoE experts: the masked layout --------------------------------------------------------------

def _grouped_save(x, w, masked_m, *, transposed: bool = True):
    """x per token (rows past masked_m read as 0) and w per block per group, for the forward
    GEMM; with `transposed`, x.T per token (the wgrad's, from x rounded to bfloat16 as the
    wgrad's operands are) and w.T's blocks (the dgrad's)."""
    x_bf16 = x.dtype == BF16
    xq, xt = cast_tokens(x, transposed=transposed and x_bf16, valid_rows=masked_m)
    if transposed and not x_bf16:
        xt = cast_tokens(x.astype(BF16), transposed=True, rows=False, valid_rows=masked_m)[1]
    wq, wt = cast_blocks(w, transposed=transposed)
    return {"x": xq, "w": wq, "xt": xt, "wt": wt}


def _grouped_call(x, w, masked_m, saved, *, expected_m):
    return m_grouped_fp8_gemm_nt_masked(saved["x"], saved["w"], masked_m, expected_m)


def _grouped_vjp(inputs, cts, saved, *, expected_m):
    """(dx, dw) of y[g] = x[g] @ w[g].T over each group's first masked_m rows: one cast of dy
    (rows past masked_m read as 0: no gradient there) for both GEMMs."""
    masked_m = inputs["masked_m"]
    g, gt = cast_tokens(cts.astype(BF16), transposed=True, valid_rows=masked_m)
    dx = m_grouped_fp8_gemm_nt_masked(g, saved["wt"], masked_m, expected_m)   # dgrad, w.T's blocks
    # wgrad: dw[g] = dy[g].T @ x[g], the k-grouped GEMM over each group's Mmax rows, both cast
    # along M: the k-grouped layout is group g's [N, Mmax] block row-major, its scales
    # [Mmax/128, N] (the MN-major buffer as it is: N % 128 == 0, no padding columns)
    (gq, gs), (xq, xs) = gt, saved["xt"]
    groups, n, mmax = gq.shape
    k = xq.shape[1]
    a = (gq.reshape(-1), gs.physical.reshape(-1, n))
    b = (xq.reshape(-1), xs.physical.reshape(-1, k))
    dw = k_grouped_fp8_gemm_nt_contiguous(a, b, [mmax] * groups, c=jnp.zeros((groups, n, k), F32))
    return {"x": dx, "w": dw}                           # masked_m: integer, no cotangent


@exposes(M_GROUPED_FP8_MASKED, K_GROUPED_FP8, differentiable=True)
def fp8_grouped_linear(x: jax.Array, w: jax.Array, masked_m: jax.Array, expected_m: int) -> jax.Array:
    """MoE experts on per-expert batches, differentiable: y[g, :masked_m[g]] = x[g] @ w[g].T.

    x: bfloat16 or float32 [G, Mmax, K] (Mmax % 128 == 0; rows past masked_m[g] are ignored);
    w: bfloat16 or float32 [G, N, K]; masked_m: int32 [G]; expected_m: static int > 0 (a tile
    hint). Forward: m_grouped_fp8_gemm_nt_masked on per-token x and per-block w. Backward:
    dgrad on the same kernel with w's blocks transposed, wgrad on the k-grouped FP8 GEMM over
    each group's Mmax rows (zeros past masked_m), both quantised along M, float32 accumulation.
    Returns bfloat16 [G, Mmax, N], rows past masked_m[g] zero.
    """
    ck = Checker("fp8_grouped_linear")
    ck.array(x, "x")
    ck.array(w, "w")
    ck.dtype(x, "x", BF16, F32)
    ck.dtype(w, "w", BF16, F32)
    ck.ndim(x, "x", 3, "[G, Mmax, K]")
    ck.ndim(w, "w", 3, "[G, N, K]")
    g, n, k = w.shape
    ck.that(x.shape[0] == g and x.shape[2] == k, "x", f"must be [G, Mmax, K] with w's G = {g}, K = {k}",
            tuple(x.shape))
    ck.that(x.shape[1] % 128 == 0 and x.shape[1] > 0, "x", "must have Mmax a positive multiple of 128",
            x.shape[1])
    ck.that(n % 128 == 0 and k % 128 == 0, "w", "must have N and K multiples of 128 (the backward's "
            "k-grouped GEMM takes 128-row groups)", (n, k))
    ck.tensor(masked_m, "masked_m", [jnp.int32], (g,), "[G]")
    expected_m = ck.static_int(expected_m, "expected_m", 1)
    grouped = derivative.with_vjp(functools.partial(_grouped_call, expected_m=expected_m),
                                  ("x", "w", "masked_m"), _grouped_vjp, {"expected_m": expected_m},
                                  save=_grouped_save,
                                  save_primal=functools.partial(_grouped_save, transposed=False))
    return grouped(x, w, masked_m)
