"""Gate: DeepSeek's MoE router (V3 / V3.2 inference/model.py's `Gate`) as an NNX module.

Per token, in float32 at full precision:

    scores   = score_func(x @ weight.T)              sigmoid or softmax over the experts
    biased   = scores + bias                         only where the checkpoint has a bias
    group    = biased's best two summed per group    with a bias;  biased's max without one
    keep the topk_groups best groups, then the topk best experts by `biased` inside them
    weights  = scores of the chosen experts          (unbiased), normalised to sum 1 when
               norm_topk_prob (DeepSeek: with sigmoid scores), times route_scale

The bias (`e_score_correction_bias`, the auxiliary-loss-free load balancing) only chooses
experts; it is a RouterBias variable, moved by a balancing rule rather than by gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

gate_init = nnx.initializers.lecun_normal()
HI = jax.lax.Precision.HIGHEST


class RouterBias(nnx.Variable):
    """The gate's load-balancing bias (DeepSeek's e_score_correction_bias): added to the scores
    to choose experts only, updated by a balancing rule, not by gradients (filter it by this type
    for optimisers and checkpoints)."""


class Gate(nnx.Module):
    """DeepSeek's router (see the module doc): x [T, dim] -> (int32 [T, topk] experts, float32
    [T, topk] combine weights).

    weight: float32 [n_experts, dim] (the checkpoint's [E, dim] layout); bias: a RouterBias
    float32 [n_experts] when `bias` (the checkpoint carries e_score_correction_bias), else None.
    norm_topk_prob None is DeepSeek's rule: normalise with sigmoid scores, not with softmax ones.
    """

    def __init__(self, dim: int, n_experts: int, topk: int, *, n_groups: int = 1, topk_groups: int = 1,
                 score_func: str = "sigmoid", route_scale: float = 1.0,
                 norm_topk_prob: bool | None = None, bias: bool = True, rngs: nnx.Rngs):
        def rule(ok, arg, text, value):
            if not ok:
                raise ValueError(f"Gate: `{arg}` {text}, got {value!r}")
        rule(score_func in ("sigmoid", "softmax"), "score_func", "must be 'sigmoid' or 'softmax'", score_func)
        rule(n_groups >= 1 and n_experts % n_groups == 0, "n_groups", f"must divide n_experts = {n_experts}",
             n_groups)
        rule(1 <= topk_groups <= n_groups, "topk_groups", f"must lie in [1, n_groups = {n_groups}]", topk_groups)
        rule(1 <= topk <= n_experts // n_groups * topk_groups, "topk",
             f"must lie in [1, {n_experts // n_groups * topk_groups}] (the experts of topk_groups groups)", topk)
        rule(not bias or n_groups == 1 or n_experts // n_groups >= 2, "n_groups",
             "must leave two experts per group with a bias (a group scores its best two)", n_groups)
        self.n_experts, self.topk, self.n_groups, self.topk_groups = n_experts, topk, n_groups, topk_groups
        self.score_func, self.route_scale = score_func, float(route_scale)
        self.norm_topk_prob = score_func == "sigmoid" if norm_topk_prob is None else bool(norm_topk_prob)
        self.weight = nnx.Param(gate_init(rngs.params(), (dim, n_experts), jnp.float32).T)
        self.bias = RouterBias(jnp.zeros((n_experts,), jnp.float32)) if bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = x.shape[0]
        # float32 at full precision, as DeepSeek's (XLA's GPU default for float32 is TF32)
        logits = jnp.matmul(x.astype(jnp.float32), self.weight[...].astype(jnp.float32).T, precision=HI)
        scores = jax.nn.sigmoid(logits) if self.score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
        biased = scores if self.bias is None else scores + self.bias[...].astype(jnp.float32)
        if self.n_groups > 1:
            grouped = biased.reshape(t, self.n_groups, -1)
            if self.bias is None:
                group_score = grouped.max(-1)
            else:
                group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
            keep = jax.lax.top_k(group_score, self.topk_groups)[1]
            mask = jnp.zeros((t, self.n_groups), bool).at[jnp.arange(t)[:, None], keep].set(True)
            biased = jnp.where(mask[:, :, None], grouped, -jnp.inf).reshape(t, -1)
        experts = jax.lax.top_k(biased, self.topk)[1]
        weights = jnp.take_along_axis(scores, experts, axis=1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return experts.astype(jnp.int32), weights * self.route_scale
