"""Pure-JAX references of DeepGEMM's hyper-connection kernels: Mega mHC (the manifold-constrained
hyper-connection step) and, at the end, the pre-norm GEMM.

The contract, from DeepGEMM's `mega_mhc` (csrc/apis/mega_mhc.hpp, layout/mega_mhc.cuh and
tests/test_mega_mhc.py's `mhc_reference`), hc_mult = 4 routes, 24 = 4 * (4 + 2) mixes:

    new_residual = bf16(x[:, None] * post_mix + einsum('tij,tih->tjh', comb_res_mix, residual))
    mixes        = flatten(new_residual) @ fn.T * rsqrt(sum(new_residual^2) / (4 H) + hc_norm_eps)
    mixes        = mixes * [s0]*4 + [s1]*4 + [s2]*16  + mix_bases
    new_prev_mix = sigmoid(mixes[:, :4]) + hc_pre_eps                      [T, 4, 1]
    new_post_mix = sigmoid(mixes[:, 4:8]) * hc_post_scale                  [T, 4, 1]
    new_comb_res_mix = sinkhorn(mixes[:, 8:].reshape(T, 4, 4))            [T, 4, 4]
    norm_input   = bf16(sum_j new_residual[:, j] * prev_mix[:, j])    prev_mix: shifted_prev_mix
                                                                       when given, else new_prev_mix
    y_bf16       = bf16(norm_input * rsqrt(mean(norm_input^2) + rmsnorm_eps) * rmsnorm_weight * rmsnorm_scale)
    y_fp8, sf    = per-token FP8 cast of y_bf16, 1 x 32 blocks, UE8M0 scales packed 4 per int32

sinkhorn(v) = softmax(v, -1) + eps, then column-normalise, then (iters - 1) times row- and
column-normalise, each dividing by (sum + eps). All in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.contracts import align, cdiv, hc_split_bounds
from jax_dg.reference.quant import pack_ue8m0_to_int, per_token_cast_to_fp8

HIGHEST = jax.lax.Precision.HIGHEST
NUM_ROUTES = 4
SF_GRAN_K = 32            # FP8 y: one UE8M0 scale per 32 hidden elements
HIDDEN_PER_SF_WORD = 128  # four scales packed in one int32


def _bf16_rounded(x: jax.Array) -> jax.Array:
    """x rounded to bfloat16, kept float32. XLA may drop an f32 -> bf16 -> f32 round trip
    (xla_allow_excess_precision); reduce_precision always rounds, as the kernel does."""
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def sinkhorn(v: jax.Array, iters: int, eps: float) -> jax.Array:
    v = jax.nn.softmax(v, axis=-1) + eps
    v = v / (v.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        v = v / (v.sum(axis=-1, keepdims=True) + eps)
        v = v / (v.sum(axis=-2, keepdims=True) + eps)
    return v


def shared_sf_rows(num_tokens: int, block_m: int) -> jax.Array:
    """Row of token t in Mega MoE's shared-expert SF pages (four 32-row groups interleaved
    within each 128-row page, pages of align(block_m, 128) rows per block of block_m tokens)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    i = t % block_m
    return t // block_m * align(block_m, 128) + (i & ~127) + (i & 31) * 4 + ((i >> 5) & 3)


def shared_sf_num_rows(num_tokens: int, block_m: int) -> int:
    return cdiv(num_tokens, block_m) * align(block_m, 128)


def mega_mhc(x, residual, shifted_prev_mix, post_mix, comb_res_mix, fn, mix_scales, mix_bases,
             rmsnorm_weight, *, hc_mult, hc_norm_eps, hc_pre_eps, hc_post_scale, sinkhorn_eps,
             num_sinkhorn_iters, rmsnorm_eps, rmsnorm_scale, with_bf16, sf_layout,
             shared_sf_block_m):
    """Outputs in the op's order (see jax_dg.ops.mhc); SF outputs in their physical layouts."""
    t, h = x.shape
    f32 = jnp.float32
    new_residual = x.astype(f32)[:, None, :] * post_mix
    new_residual = new_residual + jnp.einsum("tij,tih->tjh", comb_res_mix, residual.astype(f32),
                                             precision=HIGHEST)
    new_residual = new_residual.astype(jnp.bfloat16)
    nr = _bf16_rounded(new_residual.astype(f32))
    mixes = jnp.matmul(nr.reshape(t, hc_mult * h), fn.T, precision=HIGHEST)
    sqr_sum = jnp.square(nr).sum(axis=(1, 2))
    mixes = mixes * jax.lax.rsqrt(sqr_sum / (hc_mult * h) + hc_norm_eps)[:, None]
    scales = jnp.concatenate([jnp.broadcast_to(mix_scales[0], (hc_mult,)),
                              jnp.broadcast_to(mix_scales[1], (hc_mult,)),
                              jnp.broadcast_to(mix_scales[2], (hc_mult * hc_mult,))])
    mixes = mixes * scales + mix_bases
    new_prev_mix = jax.nn.sigmoid(mixes[:, :hc_mult])[:, :, None] + hc_pre_eps
    new_post_mix = (jax.nn.sigmoid(mixes[:, hc_mult:2 * hc_mult]) * hc_post_scale)[:, :, None]
    new_comb = sinkhorn(mixes[:, 2 * hc_mult:].reshape(t, hc_mult, hc_mult), num_sinkhorn_iters,
                        sinkhorn_eps)
    prev = new_prev_mix if shifted_prev_mix is None else shifted_prev_mix
    norm_input = _bf16_rounded((nr * prev).sum(axis=1))
    y = (norm_input * jax.lax.rsqrt(jnp.square(norm_input).mean(axis=1) + rmsnorm_eps)[:, None]
         * (rmsnorm_weight.astype(f32) * rmsnorm_scale)).astype(jnp.bfloat16)
    outs = [new_residual]
    if shifted_prev_mix is not None:
        outs.append(new_prev_mix)
    outs += [new_post_mix, new_comb]
    if with_bf16:
        outs.append(y)
    if sf_layout:
        y_fp8, sf = per_token_cast_to_fp8(y, use_ue8m0=True, gran_k=SF_GRAN_K)
        packed = pack_ue8m0_to_int(sf)  # [T, H / 128]
        outs.append(y_fp8)
        if sf_layout == "gemm":      # column-major, TMA-aligned: physical [H/128, align(T, 4)]
            outs.append(jnp.zeros((h // HIDDEN_PER_SF_WORD, align(t, 4)), jnp.int32)
                        .at[:, :t].set(packed.T))
        else:                        # routed: row-major; shared: Mega MoE pages, physical [H/128, R]
            outs.append(packed)
            rows = shared_sf_rows(t, shared_sf_block_m)
            outs.append(jnp.zeros((h // HIDDEN_PER_SF_WORD, shared_sf_num_rows(t, shared_sf_block_m)),
                                  jnp.int32).at[:, rows].set(packed.T))
    return tuple(outs)


# --- the hyper-connection pre-norm GEMM -----------------------------------------------------------

def tf32_hc_prenorm_gemm(x, fn, *, num_split):
    xf, fn = x.astype(jnp.float32), fn.astype(jnp.float32)
    if num_split is None:
        return jnp.matmul(xf, fn.T, precision=HIGHEST), jnp.square(xf).sum(-1)
    parts = [(jnp.matmul(xf[:, s:e], fn[:, s:e].T, precision=HIGHEST), jnp.square(xf[:, s:e]).sum(-1))
             for s, e in hc_split_bounds(x.shape[1], num_split)]
    return jnp.stack([d for d, _ in parts]), jnp.stack([q for _, q in parts])
