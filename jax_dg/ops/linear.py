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

Both layers go through jax_dg.core.derivative.with_vjp, the one backward mechanism (Ops use it
for their records' `vjp`): the forward pass quantises w once (`save`), its GEMM reads it, and
the rule (`_linear_vjp`, `_grouped_vjp`) reuses it transposed for the dgrad.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dg.contracts import align
from jax_dg.core import derivative
from jax_dg.core.checks import Checker
from jax_dg.core.op import exposes
from jax_dg.ops.gemm import FP8_GEMM, fp8_gemm_nt
from jax_dg.ops.grouped import K_GROUPED_FP8, M_GROUPED_FP8_MASKED, k_grouped_fp8_gemm_nt_contiguous, \
    m_grouped_fp8_gemm_nt_masked
from jax_dg.operands.quant import per_block_cast_to_fp8, per_token_cast_to_fp8

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


def _pad_rows(x, multiple: int):
    m = x.shape[0]
    return x if m % multiple == 0 else jnp.pad(x, ((0, align(m, multiple) - m), (0, 0)))


def _t_fp8(q):
    """FP8 values and 128 x 128 block scales of w.T from those of w (no re-quantisation)."""
    return q[0].T, q[1].T


def _linear_save(x2, w):
    """What the forward GEMM and the dgrad both read: w per 128 x 128 block."""
    return per_block_cast_to_fp8(w)


def _linear_call(x2, w, wq):
    return fp8_gemm_nt(per_token_cast_to_fp8(x2), wq)


def _wgrad(g, x2):
    """dw = g.T @ x2 [N, K] float32: both quantised along M, accumulated onto zeros."""
    m16 = _pad_rows(g, 16), _pad_rows(x2, 16)    # zero rows add nothing; K % 16 of the GEMM
    gt, xt = m16[0].T, m16[1].T                  # [N, M'], [K, M']
    zeros = jnp.zeros((g.shape[1], x2.shape[1]), F32)
    return fp8_gemm_nt(per_token_cast_to_fp8(gt), per_token_cast_to_fp8(xt), c=zeros)


def _linear_vjp(inputs, cts, saved):
    """(dx, dw) of y = x2 @ w.T: dgrad on w's saved blocks transposed, wgrad along M."""
    g = cts.astype(BF16)
    dx = fp8_gemm_nt(per_token_cast_to_fp8(g), _t_fp8(saved))          # [M, K] bf16
    return {"x": dx, "w": _wgrad(g, inputs["x"])}


@exposes(FP8_GEMM["nt"])
def fp8_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T in bfloat16 with DeepSeek V3's FP8 recipe, differentiable (see the module doc).

    x: bfloat16 or float32 [..., K]; w: bfloat16 or float32 [N, K] (the weight as trained; it is
    quantised per 128 x 128 block on every call). K % 16 == 0 and N % 16 == 0.
    Returns bfloat16 [..., N]. jax.grad gives dx in x's dtype and dw in w's dtype.
    """
    ck = Checker("fp8_linear")
    n, k = _check_linear(ck, x, w)
    lead = x.shape[:-1]
    linear = derivative.with_vjp(_linear_call, ("x", "w"), _linear_vjp, {}, save=_linear_save)
    return linear(x.reshape(-1, k), w).reshape(*lead, n)


# --- MoE experts: the masked layout --------------------------------------------------------------

def _grouped_save(x, w, masked_m):
    """w per 128 x 128 block, per group: the forward's and the dgrad's operand."""
    return jax.vmap(per_block_cast_to_fp8)(w)


def _grouped_call(x, w, masked_m, b, *, expected_m):
    return m_grouped_fp8_gemm_nt_masked(jax.vmap(per_token_cast_to_fp8)(x), b, masked_m, expected_m)


def _grouped_vjp(inputs, cts, saved, *, expected_m):
    """(dx, dw) of y[g] = x[g] @ w[g].T over each group's first masked_m rows."""
    x, masked_m, b = inputs["x"], inputs["masked_m"], saved
    g_, mmax, _ = x.shape
    rows = jnp.arange(mmax, dtype=jnp.int32)[None, :, None] < jnp.clip(masked_m, 0, mmax)[:, None, None]
    g = jnp.where(rows, cts, 0).astype(BF16)           # rows past masked_m were set to 0: no gradient
    # dgrad: per group dx[g] = dy[g] @ w[g] (w's blocks transposed)
    bt = (jnp.swapaxes(b[0], 1, 2), jnp.swapaxes(b[1], 1, 2))
    dx = m_grouped_fp8_gemm_nt_masked(jax.vmap(per_token_cast_to_fp8)(g), bt, masked_m, expected_m)
    # wgrad: dw[g] = dy[g].T @ x[g], the k-grouped GEMM over each group's Mmax rows (zeros past
    # masked_m), both quantised along M per channel
    n, k = g.shape[2], x.shape[2]
    xs = jnp.where(rows, x, 0).astype(BF16)
    gt = jnp.swapaxes(g, 1, 2)                          # [G, N, Mmax]
    xt = jnp.swapaxes(xs, 1, 2)                         # [G, K, Mmax]
    qa = jax.vmap(per_token_cast_to_fp8)(gt)            # values [G, N, Mmax], scales [G, N, Mmax/128]
    qb = jax.vmap(per_token_cast_to_fp8)(xt)
    # the k-grouped layout: group g's [N, Mmax] block row-major, scales [sum(ks)/128, N]
    a = (qa[0].reshape(-1), jnp.swapaxes(qa[1], 1, 2).reshape(-1, n))
    bb = (qb[0].reshape(-1), jnp.swapaxes(qb[1], 1, 2).reshape(-1, k))
    dw = k_grouped_fp8_gemm_nt_contiguous(a, bb, [mmax] * g_, c=jnp.zeros((g_, n, k), F32))
    return {"x": dx, "w": dw}                           # masked_m: integer, no cotangent


@exposes(M_GROUPED_FP8_MASKED, K_GROUPED_FP8)
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
                                  save=_grouped_save)
    return grouped(x, w, masked_m)
