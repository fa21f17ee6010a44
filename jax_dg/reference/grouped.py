"""Pure-JAX references of the grouped GEMMs (MoE experts: m-grouped contiguous / masked, k-grouped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.reference.gemm import HIGHEST, dequant

F32 = jnp.float32


def m_grouped_contiguous(x, w, layout, *, out_dtype: str = "bfloat16"):
    """Row r of x [M, K] times w[layout[r]] [N, K].T; rows whose id is outside [0, G) are 0.

    Rows are sorted by group (stably) for one ragged dot, then put back in place.
    """
    g = w.shape[0]
    key = jnp.where((layout >= 0) & (layout < g), layout, g)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=g + 1)[:g].astype(jnp.int32)
    y = jax.lax.ragged_dot(x.astype(F32)[order], jnp.swapaxes(w.astype(F32), 1, 2), sizes,
                           precision=HIGHEST, preferred_element_type=F32)
    return jnp.zeros_like(y).at[order].set(y).astype(out_dtype)


def psum_to_row_groups(psum, m: int, alignment: int):
    """The per-row group ids [M] (-1 in no group) of a psum layout: group j holds rows
    [align(psum[j-1], alignment), psum[j]) (from 0 for j = 0); psum non-decreasing."""
    psum = psum.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                              (psum[:-1] + alignment - 1) // alignment * alignment])
    r = jnp.arange(m, dtype=jnp.int32)
    j = jnp.searchsorted(psum, r, side="right").astype(jnp.int32)   # first group ending after r
    safe = jnp.minimum(j, psum.shape[0] - 1)
    inside = (j < psum.shape[0]) & (r >= starts[safe])
    return jnp.where(inside, j, -1)


def m_grouped_masked(x, w, masked_m, *, out_dtype: str = "bfloat16"):
    """d[g] = x[g] [Mmax, K] @ w[g] [N, K].T for rows < masked_m[g]; the other rows 0."""
    d = jnp.einsum("gmk,gnk->gmn", x.astype(F32), w.astype(F32), precision=HIGHEST)
    rows = jnp.arange(x.shape[1])[None, :] < masked_m[:, None]
    return jnp.where(rows[:, :, None], d, 0).astype(out_dtype)


def m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, layout, *, mk_alignment=None):
    # mk_alignment sizes the kernel's row blocks; the math does not depend on it
    return m_grouped_contiguous(dequant(a, sfa, 1, 128), dequant(b, sfb, 128, 128), layout)


def m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, masked_m, *, expected_m):
    return m_grouped_masked(dequant(a, sfa, 1, 128), dequant(b, sfb, 128, 128), masked_m)


def m_grouped_bf16_gemm_nt_contiguous(a, b, layout, *, mk_alignment=None):
    return m_grouped_contiguous(a, b, layout)


def m_grouped_bf16_gemm_nt_masked(a, b, masked_m, *, expected_m):
    return m_grouped_masked(a, b, masked_m)


def k_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, ks_tensor, c, *, ks):
    """d[g] = c[g] + A_g @ B_g.T, A_g = a's block g viewed [M, ks[g]] scaled by sfa[kb, m]."""
    _, m, n = c.shape
    outs, off = [], 0
    for g, kg in enumerate(ks):
        if kg == 0:
            outs.append(c[g])
            continue
        rows = slice(off // 128, (off + kg) // 128)
        x = a[off * m:(off + kg) * m].reshape(m, kg).astype(F32) * jnp.repeat(sfa[rows].T, 128, axis=1)
        y = b[off * n:(off + kg) * n].reshape(n, kg).astype(F32) * jnp.repeat(sfb[rows].T, 128, axis=1)
        outs.append(c[g] + jnp.matmul(x, y.T, precision=HIGHEST))
        off += kg
    return jnp.stack(outs).astype(F32)


def k_grouped_bf16_gemm_tn_contiguous(a, b, c, *, ks):
    """d[g] = c[g] + a[rows_g].T @ b[rows_g], rows_g group g's K rows of a [sum(ks), M], b [sum(ks), N]."""
    outs, off = [], 0
    for g, kg in enumerate(ks):
        x, y = a[off:off + kg].astype(F32), b[off:off + kg].astype(F32)
        outs.append(c[g] + jnp.matmul(x.T, y, precision=HIGHEST) if kg else c[g])
        off += kg
    return jnp.stack(outs).astype(F32)
