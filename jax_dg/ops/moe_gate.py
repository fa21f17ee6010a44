"""MoE gate: DeepGEMM's BF16 Mega Gate (gate GEMM fused with the top-k routing). SM100 only."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_dg.core import values
from jax_dg.core.checks import Checker
from jax_dg.core.op import REQUIRED, Op, exposes
from jax_dg.reference import moe_gate as ref

__all__ = ["bf16_mega_gate"]

BF16 = jnp.bfloat16
F32 = jnp.float32
# DeepGEMM's host limits (csrc/apis/mega_gate.hpp, layout/mega_gate.cuh).
HIDDEN_ALIGNMENT = 256
MAX_ROUTED_EXPERTS = 512
EXPERTS_PER_LANE_VECTOR = 4
MAX_TOPK = 32
MAX_TOKENS = 1 << 20


def index_dtype() -> str:
    """The dtype of the returned expert indices: int64 (DeepGEMM's) under jax_enable_x64, else
    int32 (JAX's default 32-bit mode has no 64-bit arrays; the call converts DeepGEMM's int64)."""
    return "int64" if jax.config.jax_enable_x64 else "int32"


def _shapes(x, weight, mask, bias, image_bias, image_token_mask, fix_routing_mask, to_physical_map,
          logical_count, unmapped_topk_idx, *, num_topk, scoring_func, routed_scaling_factor,
          ep_rank, num_shared_experts, index_dtype):
    ck = Checker("bf16_mega_gate")
    ck.ndim(x, "x", 2, "[T, H]")
    ck.dtype(x, "x", BF16)
    t, h = x.shape
    ck.that(h > 0 and h % HIDDEN_ALIGNMENT == 0, "x", f"must have H % {HIDDEN_ALIGNMENT} == 0 (H > 0)", h)
    ck.that(t <= MAX_TOKENS, "x", f"must have T <= {MAX_TOKENS}", t)
    ck.ndim(weight, "weight", 2, "[E, H]")
    ck.dtype(weight, "weight", BF16)
    e = weight.shape[0]
    ck.that(weight.shape[1] == h, "weight", f"must be [E, H] with x's H = {h}", tuple(weight.shape))
    ck.that(0 < e <= MAX_ROUTED_EXPERTS and e % EXPERTS_PER_LANE_VECTOR == 0, "weight",
            f"must have 0 < E <= {MAX_ROUTED_EXPERTS} and E % {EXPERTS_PER_LANE_VECTOR} == 0", e)
    ck.that(0 < num_topk <= min(e, MAX_TOPK), "num_topk", f"must be in [1, min(E, {MAX_TOPK})]", num_topk)
    ck.that(ep_rank >= 0, "ep_rank", "must be >= 0", ep_rank)
    ck.that(math.isfinite(routed_scaling_factor), "routed_scaling_factor", "must be finite",
            routed_scaling_factor)
    ck.that(scoring_func in ref.SCORING_FUNCS, "scoring_func", f"must be one of {ref.SCORING_FUNCS}",
            repr(scoring_func))
    s = num_shared_experts
    if s:
        ck.that(s in (1, 2), "num_shared_experts", "must be 0, 1 or 2", s)
        ck.that(num_topk % s == 0 and e % (num_topk // s) == 0, "num_shared_experts",
                "needs num_topk % S == 0 and E % (num_topk / S) == 0", (num_topk, e, s))
    ck.that(num_topk + s <= MAX_TOPK, "num_topk", f"plus num_shared_experts must be <= {MAX_TOPK}",
            num_topk + s)
    if mask is not None:
        ck.tensor(mask, "mask", [jnp.bool_], (t,), "[T]")
    if bias is not None:
        ck.tensor(bias, "bias", [F32], (e,), "[E]")
    ck.that((image_bias is None) == (image_token_mask is None), "image_bias",
            "and image_token_mask must be given together")
    if image_bias is not None:
        ck.tensor(image_bias, "image_bias", [F32], (e,), "[E]")
        ck.tensor(image_token_mask, "image_token_mask", [jnp.bool_], (t,), "[T]")
    ck.that((to_physical_map is None) == (logical_count is None), "to_physical_map",
            "and logical_count must be given together")
    if to_physical_map is not None:
        ck.ndim(to_physical_map, "to_physical_map", 2, "[E + S, num_duplicates]")
        ck.tensor(to_physical_map, "to_physical_map", [jnp.int32],
                  (e + s, max(1, to_physical_map.shape[1])), "[E + S, num_duplicates >= 1]")
        ck.tensor(logical_count, "logical_count", [jnp.int32], (e + s,), "[E + S]")
    if unmapped_topk_idx is not None:
        ck.tensor(unmapped_topk_idx, "unmapped_topk_idx", [index_dtype], (t, num_topk), "[T, num_topk]")
    if fix_routing_mask is not None:
        ck.that(unmapped_topk_idx is not None, "fix_routing_mask",
                "needs unmapped_topk_idx (the routing it keeps)")
        ck.tensor(fix_routing_mask, "fix_routing_mask", [jnp.bool_], (t,), "[T]")
    outs = [jax.ShapeDtypeStruct((t, num_topk + s), index_dtype),
            jax.ShapeDtypeStruct((t, num_topk + s), F32)]
    if unmapped_topk_idx is not None:
        outs.append(jax.ShapeDtypeStruct((t, num_topk), index_dtype))
    return outs


def _run(rt, x, weight, mask, bias, image_bias, image_token_mask, fix_routing_mask,
          to_physical_map, logical_count, unmapped_in, topk_idx, topk_weights, unmapped_out=None,
          *, num_topk, scoring_func, routed_scaling_factor, ep_rank, num_shared_experts):
    # DeepGEMM writes int64 indices; int32 outputs (JAX's default) go through a temporary.
    idx64 = topk_idx if topk_idx.dtype == rt.int64 else topk_idx.to(rt.int64)
    unmapped = None
    if unmapped_out is not None:  # DeepGEMM reads (fixed rows) and writes this buffer
        if unmapped_out.dtype == rt.int64:
            if unmapped_out.data_ptr() != unmapped_in.data_ptr():
                unmapped_out.copy_(unmapped_in)
            unmapped = unmapped_out
        else:
            unmapped = unmapped_in.to(rt.int64)
    rt.dg.bf16_mega_gate(x, weight, num_topk, num_shared_experts > 0, num_shared_experts,
                         routed_scaling_factor, ep_rank, scoring_func=scoring_func, mask=mask, bias=bias,
                         image_bias=image_bias, image_token_mask=image_token_mask,
                         fix_routing_mask=fix_routing_mask, to_physical_map=to_physical_map,
                         logical_count=logical_count, unmapped_topk_idx=unmapped,
                         out=(idx64, topk_weights))
    if idx64 is not topk_idx:
        topk_idx.copy_(idx64)
    if unmapped is not None and unmapped is not unmapped_out:
        unmapped_out.copy_(unmapped)


BF16_MEGA_GATE = Op(
    name="bf16_mega_gate",
    args=("x", "weight", "mask", "bias", "image_bias", "image_token_mask", "fix_routing_mask",
          "to_physical_map", "logical_count", "unmapped_topk_idx"),
    statics=dict.fromkeys(("num_topk", "scoring_func", "routed_scaling_factor", "ep_rank",
                           "num_shared_experts", "index_dtype"), REQUIRED),
    shapes=_shapes,
    run=_run,
    reference=ref.bf16_mega_gate,
    symbols=("bf16_mega_gate",),
    aliases={"unmapped_topk_idx": 2},
    archs=frozenset({"sm100"}),
)


def _sanitise(ck: Checker, weight, fix, unmapped, to_physical_map, logical_count):
    """The index values DeepGEMM reads unchecked, brought into range (selects on [T, num_topk]
    and [E + S] vectors, fused): a fixed row whose ids are not all in [0, E) is routed afresh
    (its fix flag cleared; ids are clipped into range, and the kernel overwrites the rows it
    routes), and logical_count is clipped to [1, num_duplicates]. In checked mode
    (jax_dg.checked) they raise instead."""
    if not hasattr(weight, "shape") or len(weight.shape) != 2:
        return fix, unmapped, logical_count     # the shape function names what is wrong
    e = weight.shape[0]
    if fix is not None and unmapped is not None and hasattr(fix, "shape") and \
            fix.shape == unmapped.shape[:1] and jnp.dtype(fix.dtype) == jnp.bool_:
        row_ok = jnp.all((unmapped >= 0) & (unmapped < e), axis=1)
        row_ok = values.require(ck.op, "unmapped_topk_idx", ~fix | row_ok,
                                f"must hold expert ids in [0, E = {e}) in the rows of fix_routing_mask",
                                carry=row_ok)
        fix = fix & row_ok
        unmapped = jnp.clip(unmapped, 0, e - 1)
    if logical_count is not None and to_physical_map is not None and \
            getattr(to_physical_map, "ndim", 0) == 2 and getattr(logical_count, "ndim", 0) == 1:
        dup = max(1, to_physical_map.shape[1])
        ck.dtype(logical_count, "logical_count", jnp.int32)
        logical_count = values.require(ck.op, "logical_count", (logical_count >= 1) & (logical_count <= dup),
                                       f"must lie in [1, num_duplicates = {dup}]", logical_count)
        logical_count = jnp.clip(logical_count, 1, dup)
    return fix, unmapped, logical_count


@exposes(BF16_MEGA_GATE)
def bf16_mega_gate(x, weight, num_topk, *, scoring_func, routed_scaling_factor, ep_rank,
                   bias=None, image_bias=None, image_token_mask=None, fix_routing_mask=None,
                   unmapped_topk_idx=None, mask=None, num_shared_experts=0, to_physical_map=None,
                   logical_count=None, return_unmapped_topk_idx=False):
    """MoE routing fused with its gate GEMM (DeepGEMM `bf16_mega_gate`, SM100 only).

    x: bfloat16 [T, H], H % 256 == 0.  weight: bfloat16 [E, H], E <= 512, E % 4 == 0.
    num_topk: static int, 1 <= num_topk <= min(E, 32).
    scoring_func: "sqrtsoftplus" | "sigmoid" | "identity" (DeepGEMM builds differ in which
        they accept: the newest upstream only "sqrtsoftplus"; the references accept all three).
    routed_scaling_factor: finite float.  ep_rank: int >= 0 (only used with an expert map).
    bias / image_bias: float32 [E] added to the scores for ranking only; tokens with
        image_token_mask (bool [T]) use image_bias instead of bias. Given together.
    fix_routing_mask: bool [T]; those tokens keep the routing read from unmapped_topk_idx
        ([T, num_topk] expert ids, required with it); their weights are recomputed.
    DeepGEMM extras (vLLM's wrapper passes none of them): mask bool [T] (False rows get index -1,
        weight 0), num_shared_experts S in {1, 2} (use_shared_as_routed: S extra slots with index
        E + s and weight 1), to_physical_map int32 [E + S, dup] with logical_count int32 [E + S]
        (expert replication; token t picks duplicate (ep_rank + 23333 t) % count).
    Index values DeepGEMM reads unchecked are brought into range first: logical_count is
    clipped to [1, num_duplicates]; a row of fix_routing_mask whose unmapped_topk_idx ids are
    not all in [0, E) is routed afresh as if not fixed. Under `jax_dg.checked()` they raise
    instead, naming the argument.

    Returns (topk_weights float32 [T, num_topk + S], topk_idx [T, num_topk + S]), best expert
    first, ties to the smaller index; with return_unmapped_topk_idx also the logical top-k that
    DeepGEMM writes into unmapped_topk_idx (equal to topk_idx[:, :num_topk] without an expert map).

    Index dtype: DeepGEMM writes int64. Under JAX's default 32-bit mode jax_dg returns int32
    (DeepGEMM writes into an int64 scratch that the call converts; ids are < 2**31); with
    jax_enable_x64 it returns int64 and DeepGEMM writes the output buffer directly.
    unmapped_topk_idx may be int32 or int64; it is cast to that index dtype.

    The DeepGEMM kernel exists only on SM100: elsewhere the call raises a clear error, and
    JAX_DG_BACKEND=torch or xla runs the reference.
    """
    ck = Checker("bf16_mega_gate")
    num_topk = ck.static_int(num_topk, "num_topk", minimum=1)
    ep_rank = ck.static_int(ep_rank, "ep_rank", minimum=0)
    num_shared_experts = ck.static_int(num_shared_experts, "num_shared_experts", minimum=0)
    idt = index_dtype()
    if return_unmapped_topk_idx and unmapped_topk_idx is None:
        ck.fail("return_unmapped_topk_idx", "needs unmapped_topk_idx (DeepGEMM writes into it)")
    if unmapped_topk_idx is not None:
        ck.dtype(unmapped_topk_idx, "unmapped_topk_idx", jnp.int32, jnp.int64)
        unmapped_topk_idx = unmapped_topk_idx.astype(idt)
    fix_routing_mask, unmapped_topk_idx, logical_count = _sanitise(
        ck, weight, fix_routing_mask, unmapped_topk_idx, to_physical_map, logical_count)
    outs = BF16_MEGA_GATE(
        x, weight, mask, bias, image_bias, image_token_mask, fix_routing_mask, to_physical_map,
        logical_count, unmapped_topk_idx, num_topk=num_topk, scoring_func=str(scoring_func),
        routed_scaling_factor=ck.static_float(routed_scaling_factor, "routed_scaling_factor"), ep_rank=ep_rank,
        num_shared_experts=num_shared_experts, index_dtype=idt)
    if return_unmapped_topk_idx:
        return outs[1], outs[0], outs[2]
    return outs[1], outs[0]
