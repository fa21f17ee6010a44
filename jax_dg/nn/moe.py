"""MoE: DeepSeek V3's mixture of experts as an NNX module on jax_dg's grouped FP8 GEMMs.

gate -> top-k experts per token -> tokens permuted into per-expert batches -> SwiGLU experts
(grouped FP8 GEMMs, DeepSeek V3's recipe) -> weighted combine, plus shared experts (FP8Linear).
Two grouped layouts, one module:

  "masked"      each expert's rows in a [E, capacity, ...] batch (fp8_grouped_linear):
                differentiable, capture-friendly static shapes; the training and decode path.
                Assignments past an expert's capacity are dropped: `return_dropped=True`
                returns their count beside the output.
  "contiguous"  experts' rows back to back, each group padded to DeepGEMM's alignment
                (m_grouped_fp8_gemm_nt_contiguous): no capacity, forward only; the prefill path.

Routing as DeepSeek V3 (inference/model.py, `Gate`): sigmoid scores, a per-expert bias added for
the choice only (the load-balancing correction, a non-trained variable here), experts chosen
within the `topk_groups` best of `n_groups` groups (a group's score: its two best experts), the
chosen scores normalised to sum 1 and scaled by `route_scale`.
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dg.contracts import align
from jax_dg.nn.linear import FP8Linear
from jax_dg.operands.routing import (combine_from_contiguous, combine_from_masked, contiguous_layout,
                                     masked_layout, permute_to_contiguous, permute_to_masked)
from jax_dg.ops.cast import cast_blocks, cast_tokens, per_token_cast_to_fp8
from jax_dg.ops.grouped import m_grouped_fp8_gemm_nt_contiguous
from jax_dg.ops.linear import fp8_grouped_linear

# Per expert: fan-in is the last axis, the expert axis is a batch of matrices (not fan-in).
default_init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
gate_init = nnx.initializers.lecun_normal()


class RouterBias(nnx.Variable):
    """The gate's load-balancing bias (DeepSeek V3's e_score_correction_bias): added to the
    scores to choose experts only, updated by a balancing rule, not by gradients (filter it by
    this type for optimisers and checkpoints)."""


def _swiglu(h: jax.Array) -> jax.Array:
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(jnp.bfloat16)


class MoE(nnx.Module):
    """DeepSeek V3's MoE layer (see the module doc). x [T, dim] (2-D: rows are tokens) ->
    bfloat16 [T, dim].

    dim and inter_dim: multiples of 128 (DeepGEMM's FP8 blocks); n_experts experts, `topk` per
    token; n_shared shared experts of inter_dim each; capacity_factor sizes the masked layout's
    per-expert batch: align(ceil(T * topk / n_experts * capacity_factor), 128) rows.
    `expert_metadata` goes to both expert weights [E, ...] (e.g. `{"out_sharding": ("expert",
    None, None), "mesh": mesh}` for expert parallelism).
    """

    def __init__(self, dim: int, inter_dim: int, n_experts: int, topk: int, *, n_shared: int = 1,
                 n_groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0,
                 capacity_factor: float = 2.0, param_dtype=jnp.bfloat16, rngs: nnx.Rngs,
                 expert_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({})):
        self.n_experts, self.topk, self.n_groups, self.topk_groups = n_experts, topk, n_groups, topk_groups
        self.route_scale, self.capacity_factor = route_scale, capacity_factor
        self.gate = nnx.Param(gate_init(rngs.params(), (dim, n_experts), jnp.float32).T)
        self.gate_bias = RouterBias(jnp.zeros((n_experts,), jnp.float32))
        self.w13 = nnx.Param(default_init(rngs.params(), (n_experts, 2 * inter_dim, dim), param_dtype),
                             **expert_metadata)
        self.w2 = nnx.Param(default_init(rngs.params(), (n_experts, dim, inter_dim), param_dtype),
                            **expert_metadata)
        self.shared_in = FP8Linear(dim, 2 * n_shared * inter_dim, param_dtype=param_dtype, rngs=rngs) \
            if n_shared else nnx.data(None)
        self.shared_out = FP8Linear(n_shared * inter_dim, dim, param_dtype=param_dtype, rngs=rngs) \
            if n_shared else nnx.data(None)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(int32 [T, topk] experts, float32 [T, topk] combine weights) of tokens x [T, dim]."""
        # the gate in float32 at full precision, as DeepSeek's (XLA's GPU default is TF32)
        scores = jax.nn.sigmoid(jnp.matmul(x.astype(jnp.float32), self.gate[...].T.astype(jnp.float32),
                                           precision=jax.lax.Precision.HIGHEST))
        biased = scores + self.gate_bias[...]
        if self.n_groups > 1:
            t = x.shape[0]
            grouped = biased.reshape(t, self.n_groups, -1)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
            keep = jax.lax.top_k(group_score, self.topk_groups)[1]
            mask = jnp.zeros((t, self.n_groups), bool).at[jnp.arange(t)[:, None], keep].set(True)
            biased = jnp.where(mask[:, :, None], grouped, -jnp.inf).reshape(t, -1)
        experts = jax.lax.top_k(biased, self.topk)[1]
        weights = jnp.take_along_axis(scores, experts, axis=1)
        weights = weights / weights.sum(-1, keepdims=True) * self.route_scale
        return experts.astype(jnp.int32), weights

    def __call__(self, x: jax.Array, *, layout: str = "masked", return_dropped: bool = False):
        """bfloat16 [T, dim]; with `return_dropped`, also the int32 count of (token, expert)
        assignments the masked layout's capacity dropped (0 for "contiguous")."""
        experts, weights = self.route(x)
        if layout == "masked":
            y, dropped = self._masked(x, experts, weights)
        elif layout == "contiguous":
            y, dropped = self._contiguous(x, experts, weights), jnp.zeros((), jnp.int32)
        else:
            raise ValueError(f"MoE: `layout` must be 'masked' or 'contiguous', got {layout!r}")
        if self.shared_in is not None:
            shared = self.shared_out(_swiglu(self.shared_in(x)))
            y = (y.astype(jnp.float32) + shared.astype(jnp.float32)).astype(jnp.bfloat16)
        return (y, dropped) if return_dropped else y

    def capacity(self, tokens: int) -> int:
        """Rows per expert in the masked layout for a batch of `tokens`:
        align(ceil(tokens * topk * capacity_factor / n_experts), 128)."""
        rows = -(-tokens * self.topk * self.capacity_factor // self.n_experts)
        return align(max(1, int(rows)), 128)

    def _masked(self, x, experts, weights):
        cap = self.capacity(x.shape[0])
        lay = masked_layout(experts, self.n_experts, cap)
        hint = max(1, -(-x.shape[0] * self.topk // self.n_experts))
        h = fp8_grouped_linear(permute_to_masked(x.astype(jnp.bfloat16), lay), self.w13[...], lay.masked_m, hint)
        y = fp8_grouped_linear(_swiglu(h), self.w2[...], lay.masked_m, hint)
        return combine_from_masked(y, lay, weights, jnp.bfloat16), lay.num_dropped

    def _contiguous(self, x, experts, weights):
        lay = contiguous_layout(experts, self.n_experts)
        (w13, _), (w2, _) = cast_blocks(self.w13[...]), cast_blocks(self.w2[...])   # one kernel each
        a = permute_to_contiguous(per_token_cast_to_fp8(x.astype(jnp.bfloat16)), lay)
        h = m_grouped_fp8_gemm_nt_contiguous(a, w13, lay.grouped_layout)
        y = m_grouped_fp8_gemm_nt_contiguous(cast_tokens(_swiglu(h))[0], w2, lay.grouped_layout)
        return combine_from_contiguous(y, lay, weights, jnp.bfloat16)
