"""Pure-JAX helpers that feed the lightning indexer (`jax_dg.mqa_logits`) without touching torch.

- `per_row_cast_to_fp8`: K rows -> (float8_e4m3fn values, float32 scale per row), DeepGEMM's
  `per_custom_dims_cast_to_fp8(x, (0,), use_ue8m0)`.
- `fold_q_scale`: SM90's MQA kernel takes no q scale; a positive per-(token, head) q scale moves
  into the weights (exact: relu(s * x) = s * relu(x) for s > 0), as vLLM's indexer does.
- `causal_ks_ke`, `varlen_causal_ks_ke`: the [ks, ke) key range of every query row for a causal
  prefill, over one sequence or over packed sequences given by cu_seqlens.
(The selection itself, `topk_indices` and `indexer_topk`, is in jax_dg.ops.topk.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.core.checks import Checker
from jax_dg.operands.quant import cast_with_scale, scale_for


def per_row_cast_to_fp8(x: jax.Array, *, use_ue8m0: bool = False) -> tuple[jax.Array, jax.Array]:
    """[N, ...] -> (float8_e4m3fn [N, ...], float32 scale [N]): one scale per row (dim 0).

    sf = max(amax of the row, 1e-4) / 448 (rounded up to a power of two with use_ue8m0);
    values = x * (1 / sf) cast to e4m3, exactly as DeepGEMM's per_custom_dims_cast_to_fp8(x, (0,)).
    """
    ck = Checker("per_row_cast_to_fp8")
    ck.floating(x, "x")
    ck.that(len(x.shape) >= 1, "x", "must have a row dimension", tuple(x.shape))
    use_ue8m0 = ck.static_bool(use_ue8m0, "use_ue8m0")
    xf = x.astype(jnp.float32)
    axes = tuple(range(1, x.ndim))
    amax = jnp.abs(xf).max(axis=axes, keepdims=True) if axes else jnp.abs(xf)
    sf = scale_for(amax, use_ue8m0)
    return cast_with_scale(xf, sf), sf.reshape(x.shape[0])


def fold_q_scale(weights: jax.Array, q_scale: jax.Array) -> jax.Array:
    """weights [M, H] * q_scale ([M, H] per token and head, [M, 1] or [M] per token) in float32.

    The scale must be positive (any FP8 quantiser's is). It is exact when the scale is a power
    of two (UE8M0), otherwise one float32 rounding per weight.
    """
    ck = Checker("fold_q_scale")
    ck.floating(weights, "weights")
    ck.floating(q_scale, "q_scale")
    q_scale = q_scale.astype(jnp.float32)
    if q_scale.ndim == 1:
        q_scale = q_scale[:, None]
    return weights.astype(jnp.float32) * q_scale


def causal_ks_ke(num_queries: int, num_keys: int, *, include_self: bool = True):
    """ks, ke (int32 [num_queries]) for the last `num_queries` tokens of a `num_keys`-token sequence.

    Query i sits at position p = num_keys - num_queries + i and sees keys [0, p + 1), or [0, p)
    with include_self=False (DeepGEMM's test mask `ke = arange(S) + SK - S`, whose first row is
    empty when S == SK).
    """
    ck = Checker("causal_ks_ke")
    num_queries = ck.static_int(num_queries, "num_queries", minimum=0)
    num_keys = ck.static_int(num_keys, "num_keys", minimum=0)
    include_self = ck.static_bool(include_self, "include_self")
    ck.that(num_queries <= num_keys, "num_queries", f"must be <= `num_keys` ({num_keys})", num_queries)
    ks = jnp.zeros((num_queries,), jnp.int32)
    ke = jnp.arange(num_queries, dtype=jnp.int32) + (num_keys - num_queries + int(include_self))
    return ks, ke


def varlen_causal_ks_ke(cu_seqlens_q: jax.Array, num_queries: int, cu_seqlens_k: jax.Array | None = None,
                        *, include_self: bool = True):
    """ks, ke (int32 [num_queries]) for packed sequences (a causal prefill over a varlen batch).

    Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and key positions
    [cu_seqlens_k[b], cu_seqlens_k[b+1]) of the packed K (cu_seqlens_k defaults to cu_seqlens_q:
    no cached prefix). Its queries are the sequence's last tokens: query j of a sequence with Lq
    queries and Lk keys sees keys [cu_k[b], cu_k[b] + Lk - Lq + j + 1) (no `+ 1` without
    include_self). Rows past cu_seqlens_q[-1] (padding) get the empty range ks = ke = 0.
    """
    ck = Checker("varlen_causal_ks_ke")
    num_queries = ck.static_int(num_queries, "num_queries", minimum=0)
    include_self = ck.static_bool(include_self, "include_self")

    def offsets(cu, arg):   # lists allowed; floats and bools are not silently made ints
        cu = jnp.asarray(cu) if isinstance(cu, (list, tuple)) else cu
        ck.integer(cu, arg)
        ck.that(cu.ndim == 1 and cu.shape[0] >= 1, arg, "must be 1-D [B+1]",
                tuple(cu.shape))
        return cu.astype(jnp.int32)
    cu_q = offsets(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else offsets(cu_seqlens_k, "cu_seqlens_k")
    ck.that(cu_k.shape == cu_q.shape, "cu_seqlens_k", f"must have cu_seqlens_q's shape {cu_q.shape}",
            cu_k.shape)
    rows = jnp.arange(num_queries, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(cu_q, rows, side="right") - 1, 0, cu_q.shape[0] - 2)
    j = rows - cu_q[b]
    len_q = cu_q[b + 1] - cu_q[b]
    len_k = cu_k[b + 1] - cu_k[b]
    ks = cu_k[b]
    ke = ks + len_k - len_q + j + int(include_self)
    inside = rows < cu_q[-1]
    return jnp.where(inside, ks, 0), jnp.where(inside, jnp.maximum(ke, ks), 0)
