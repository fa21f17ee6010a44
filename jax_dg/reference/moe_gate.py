"""Pure-JAX reference of DeepGEMM's BF16 Mega Gate (gate GEMM fused with the MoE top-k).

The contract, from DeepGEMM's `bf16_mega_gate` (csrc/apis/mega_gate.hpp, the SM100 kernel
sm100_bf16_mega_gate.cuh and tests/test_mega_gate.py):

    logits  = x @ weight.T                        float32 accumulation of bfloat16 operands
    scores  = scoring(logits)                     sigmoid | sqrt(softplus) | identity
    ranking = scores + bias                       image tokens take image_bias instead of bias;
                                                  without any bias the raw logits rank (every
                                                  scoring function is increasing)
    topk    = the num_topk best ranking, best first, ties to the smallest expert index
    weights = scores[topk] / (sum(scores[topk]) + 1e-20) * routed_scaling_factor

Rows with fix_routing_mask keep the routing read from unmapped_topk_idx (weights recomputed
from their scores); rows with mask == False get index -1 and weight 0. Shared experts
(num_shared_experts > 0, DeepGEMM's use_shared_as_routed) take the slots after the top-k with
index num_routed_experts + s and weight 1. With an expert physical map, slot j of token t maps
logical expert e to to_physical_map[e, (ep_rank + t * 23333 mod 2**32) % logical_count[e]].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "identity")


def sqrt_softplus(v: jax.Array) -> jax.Array:
    """DeepGEMM's sqrt(softplus(v)), softplus linear above 20 (as torch's threshold)."""
    return jnp.sqrt(jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0)))))


def score(logits: jax.Array, scoring_func: str) -> jax.Array:
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if scoring_func == "sqrtsoftplus":
        return sqrt_softplus(logits)
    if scoring_func == "identity":
        return logits
    raise ValueError(f"unknown scoring_func {scoring_func!r}; choose one of {SCORING_FUNCS}")


def physical_index(logical, token, ep_rank: int, to_physical_map, logical_count):
    """DeepGEMM's spread of a logical expert over its duplicates (uint32 arithmetic)."""
    spread = token.astype(jnp.uint32) * jnp.uint32(23333) + jnp.uint32(ep_rank)
    count = jnp.clip(logical_count, 1, to_physical_map.shape[1])[logical].astype(jnp.uint32)
    dup = (spread % count).astype(jnp.int32)
    return to_physical_map[logical, dup]


def bf16_mega_gate(x, weight, mask, bias, image_bias, image_token_mask, fix_routing_mask,
                   to_physical_map, logical_count, unmapped_topk_idx, *, num_topk: int,
                   scoring_func: str, routed_scaling_factor: float, ep_rank: int,
                   num_shared_experts: int, index_dtype: str):
    """Returns (topk_idx, topk_weights[, unmapped_topk_idx]) as DeepGEMM writes them."""
    t, e = x.shape[0], weight.shape[0]
    idt = jnp.dtype(index_dtype)
    logits = jnp.matmul(x.astype(jnp.float32), weight.astype(jnp.float32).T, precision=HIGHEST)
    scores = score(logits, scoring_func)
    if bias is None and image_bias is None:
        ranking = logits
    else:
        b = jnp.zeros((1, e), jnp.float32) if bias is None else bias.astype(jnp.float32)[None]
        if image_bias is not None:
            b = jnp.where(image_token_mask[:, None], image_bias.astype(jnp.float32)[None], b)
        ranking = scores + b
    _, selected = jax.lax.top_k(ranking, num_topk)
    selected = selected.astype(jnp.int32)
    if fix_routing_mask is not None:   # a fixed row with an id outside [0, E) is routed afresh
        fixed = unmapped_topk_idx.astype(jnp.int32)
        keep = fix_routing_mask & jnp.all((fixed >= 0) & (fixed < e), axis=1)
        selected = jnp.where(keep[:, None], fixed, selected)
    picked = jnp.take_along_axis(scores, selected, axis=1)
    weights = picked / (picked.sum(axis=1, keepdims=True) + 1e-20) * jnp.float32(routed_scaling_factor)
    logical = selected
    if num_shared_experts:
        shared = jnp.broadcast_to(e + jnp.arange(num_shared_experts, dtype=jnp.int32), (t, num_shared_experts))
        logical = jnp.concatenate([selected, shared], axis=1)
        weights = jnp.concatenate([weights, jnp.ones((t, num_shared_experts), jnp.float32)], axis=1)
    physical = logical
    if to_physical_map is not None:
        token = jnp.arange(t, dtype=jnp.int32)[:, None]
        physical = physical_index(logical, token, ep_rank, to_physical_map, logical_count)
    if mask is not None:
        physical = jnp.where(mask[:, None], physical, -1)
        weights = jnp.where(mask[:, None], weights, 0.0)
        selected = jnp.where(mask[:, None], selected, -1)
    outs = (physical.astype(idt), weights.astype(jnp.float32))
    if unmapped_topk_idx is not None:
        outs += (selected.astype(idt),)
    return outs
