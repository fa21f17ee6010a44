"""MoE: DeepSeek's mixture of experts (V3 / V3.2 inference/model.py) as NNX modules on jax_dg's
grouped FP8 GEMMs; MLP: its dense SwiGLU (the shared experts, and the first layers' MLP).

gate (jax_dg.nn.gate: DeepSeek's router) -> each token's top-k experts -> tokens permuted into
per-expert rows -> SwiGLU experts on grouped FP8 GEMMs -> the outputs weighted and summed per
token in float32 -> plus the shared experts' output, in float32, rounded to bfloat16 once (as
DeepSeek's MoE.forward sums into a float32 buffer).

The experts' weights are bf16 masters (training: every call quantises them, fp8_grouped_linear's
recipe, differentiable in the masked layout) or FP8 as the checkpoint stores them
(`fp8_weights=True`, jax_dg.nn.quantize / load_checkpoint: `w13` float8_e4m3fn [E, 2 * inter,
dim] with `w13_scale_inv` [E, 2 * inter / 128, dim / 128], `w2` [E, dim, inter] with
`w2_scale_inv`; the grouped GEMMs read them as they are, never re-quantising: serving).

No assignment is ever dropped unless the caller asks for a capacity. Two grouped layouts:

  "masked"      each expert's rows in an [E, rows, ...] batch (m_grouped masked GEMMs): static
                shapes, capture-friendly, differentiable with bf16 masters. Dropless by
                default: rows = align(T, 128) per expert, since an expert takes each token at
                most once (a token's top-k experts are distinct). That is one 128-row block per
                expert while T <= 128 (decode: DeepGEMM's smallest masked batch anyway, so
                dropless costs nothing there); it grows as E * T rows for long prefills, where
                "contiguous" is the layout to use. `capacity=` (rows per expert, rounded up to
                128) bounds it instead, and the call then returns how many assignments it dropped.
                (On CPU, the torch emulation, dropless rows cost nothing measurable at the
                example's sizes: 8 experts, T <= 256, 94-127 ms a call in either form.)
  "contiguous"  experts' rows back to back, each expert's padded to the mk alignment (m_grouped
                contiguous GEMMs): T * topk rows plus at most alignment - 1 padding per expert
                present, always dropless; forward only (no gradient).
  "auto"        (default) masked with bf16 masters (the differentiable one); with stored FP8
                weights (inference), the layout that materialises fewer activation rows for this
                T, E, topk: the masked E * align(T, 128) or the contiguous worst case T * topk +
                min(E, T * topk) * (alignment - 1), masked on a tie. DeepSeek's decode of 8
                tokens over 64 experts (top-8): 8192 rows either way -> masked; over 256
                experts: 32768 vs 8192 -> contiguous; a 4096-token prefill: contiguous.

Both grouped GEMMs read only the experts present (the masked kernel skips empty groups' blocks,
the contiguous one reads the groups its row blocks name), so a decode step reads each needed
expert's FP8 weights once. With stored weights x is cast to FP8 once per token before the
permutation (the per-token cast commutes with it), and the GEMMs leave the rows no assignment
owns as DeepGEMM leaves them (clean=False, no zeroing pass): the masked layout's cast between
the GEMMs reads its rows past each count as 0, a contiguous padding row only meets its own
per-token cast, and the combine reads neither.
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dg.contracts import align
from jax_dg.nn.gate import Gate
from jax_dg.nn.linear import FP8Weights, FP8Linear, StoredFP8, check_scale_fmt, dequantize_blocks, \
    quantize_blocks, sharding_metadata
from jax_dg.operands.routing import (combine_from_contiguous, combine_from_masked, contiguous_layout,
                                     get_mk_alignment_for_contiguous_layout, masked_layout,
                                     max_contiguous_rows, permute_to_contiguous, permute_to_masked)
from jax_dg.ops.cast import cast_blocks, cast_tokens
from jax_dg.ops.grouped import m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked
from jax_dg.ops.linear import fp8_grouped_linear

if tp.TYPE_CHECKING:
    from jax_dg.nn.config import DeepSeekV32Config

# Per expert: fan-in is the last axis, the expert axis is a batch of matrices (not fan-in).
default_init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
LAYOUTS = ("auto", "masked", "contiguous")


def _swiglu(h: jax.Array) -> jax.Array:
    """silu(gate) * up in float32, rounded to bfloat16 (DeepSeek's Expert/MLP)."""
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(jnp.bfloat16)


def _tokens(x: jax.Array, ue8m0: bool):
    """x [..., K] cast per token: (float8 values, float32 scales [..., ceil(K/128)])."""
    q, s = cast_tokens(x, use_ue8m0=ue8m0)[0]
    return q, s.logical()


class MLP(nnx.Module):
    """DeepSeek's dense SwiGLU MLP: w2(silu(x @ W1) * (x @ W3)), W1 and W3 fused into one
    FP8Linear `w13` (gate rows first, then up), `w2` the down projection; bfloat16 out. The
    shared experts of an MoE and the first dense layers' MLP. fp8_weights and scale_fmt as
    FP8Linear's."""

    def __init__(self, dim: int, inter_dim: int, *, fp8_weights: bool = False, scale_fmt: str | None = None,
                 param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
        kw = dict(fp8_weights=fp8_weights, scale_fmt=scale_fmt, param_dtype=param_dtype, rngs=rngs)
        self.inter_dim = inter_dim
        self.w13 = FP8Linear(dim, 2 * inter_dim, **kw)
        self.w2 = FP8Linear(inter_dim, dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(_swiglu(self.w13(x)))


class MoE(FP8Weights, nnx.Module):
    """DeepSeek's MoE layer (see the module doc). x [T, dim] (2-D: rows are tokens) -> bfloat16
    [T, dim].

    dim and inter_dim: multiples of 128 (DeepGEMM's FP8 blocks); n_experts routed experts,
    `topk` per token; n_shared shared experts of inter_dim each (one MLP of n_shared *
    inter_dim). The router's arguments are jax_dg.nn.Gate's (gate_bias: whether it has the
    checkpoint's e_score_correction_bias). fp8_weights: hold stored FP8 expert weights (see the
    module doc); scale_fmt "ue8m0": power-of-two activation scales on that path (DeepSeek's
    act_quant; the bf16 masters' training recipe keeps float32 ones). `expert_metadata` goes to
    both expert weights [E, ...] (e.g. `{"out_sharding": ("expert", None, None), "mesh": mesh}`
    for expert parallelism; stored scales keep its expert axis).
    """

    def __init__(self, dim: int, inter_dim: int, n_experts: int, topk: int, *, n_shared: int = 1,
                 n_groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0,
                 score_func: str = "sigmoid", norm_topk_prob: bool | None = None, gate_bias: bool = True,
                 fp8_weights: bool = False, scale_fmt: str | None = None, param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs, expert_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({})):
        for v, arg in ((dim, "dim"), (inter_dim, "inter_dim")):
            if v <= 0 or v % 128:
                raise ValueError(f"MoE: `{arg}` must be a positive multiple of 128 (DeepGEMM's FP8 "
                                 f"blocks), got {v}")
        self.dim, self.inter_dim, self.param_dtype = dim, inter_dim, param_dtype
        self.n_experts, self.topk, self.n_groups, self.topk_groups = n_experts, topk, n_groups, topk_groups
        self.route_scale, self.scale_fmt = route_scale, scale_fmt
        self.use_ue8m0 = check_scale_fmt(scale_fmt, "MoE")
        self.gate = Gate(dim, n_experts, topk, n_groups=n_groups, topk_groups=topk_groups,
                         score_func=score_func, route_scale=route_scale, norm_topk_prob=norm_topk_prob,
                         bias=gate_bias, rngs=rngs)
        self.w13 = nnx.Param(default_init(rngs.params(), (n_experts, 2 * inter_dim, dim), param_dtype),
                             **expert_metadata)
        self.w2 = nnx.Param(default_init(rngs.params(), (n_experts, dim, inter_dim), param_dtype),
                            **expert_metadata)
        self.w13_scale_inv = nnx.data(None)
        self.w2_scale_inv = nnx.data(None)
        self.shared = MLP(dim, n_shared * inter_dim, fp8_weights=fp8_weights, scale_fmt=scale_fmt,
                          param_dtype=param_dtype, rngs=rngs) if n_shared else nnx.data(None)
        if fp8_weights:
            self._quantize_own(None)

    @classmethod
    def from_config(cls, cfg: DeepSeekV32Config, *, rngs: nnx.Rngs, fp8_weights: bool | None = None,
                    param_dtype=jnp.bfloat16,
                    expert_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({})) -> MoE:
        """The MoE of a DeepSeek-V3.2 configuration (jax_dg.nn.config); fp8_weights defaults to
        whether the checkpoint stores FP8 weights."""
        return cls(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                   n_shared=cfg.n_shared_experts, n_groups=cfg.n_group, topk_groups=cfg.topk_group,
                   route_scale=cfg.routed_scaling_factor, score_func=cfg.scoring_func,
                   norm_topk_prob=cfg.norm_topk_prob, gate_bias=cfg.gate_bias,
                   fp8_weights=cfg.fp8_weights if fp8_weights is None else fp8_weights,
                   scale_fmt=cfg.scale_fmt, param_dtype=param_dtype, rngs=rngs,
                   expert_metadata=expert_metadata)

    # --- the two weight forms -------------------------------------------------------------------

    @property
    def stored_fp8(self) -> bool:
        return self.w13_scale_inv is not None

    def _quantize_own(self, ue8m0: bool | None) -> None:
        ue8m0 = self.use_ue8m0 if ue8m0 is None else bool(ue8m0)
        for name in ("w13", "w2"):
            var = getattr(self, name)
            q, s = quantize_blocks(var[...], ue8m0)
            meta = sharding_metadata(var)
            setattr(self, name, StoredFP8(q, **meta))
            spec = meta.get("out_sharding")   # the scales [E, ...] keep the experts' axis only
            setattr(self, f"{name}_scale_inv",
                    StoredFP8(s, **({**meta, "out_sharding": (spec[0], None, None)} if spec else meta)))

    def _dequantize_own(self, dtype) -> None:
        for name in ("w13", "w2"):
            var, scale = getattr(self, name), getattr(self, f"{name}_scale_inv")
            setattr(self, name, nnx.Param(dequantize_blocks(var[...], scale[...], dtype or self.param_dtype),
                                          **sharding_metadata(var)))
            setattr(self, f"{name}_scale_inv", nnx.data(None))

    # --- the forward ------------------------------------------------------------------------------

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(int32 [T, topk] experts, float32 [T, topk] combine weights) of tokens x [T, dim]."""
        return self.gate(x)

    def capacity(self, tokens: int) -> int:
        """The masked layout's dropless rows per expert for `tokens` tokens: align(tokens, 128)
        (an expert takes each token at most once)."""
        return align(max(1, tokens), 128)

    def layout_for(self, tokens: int, layout: str = "auto") -> str:
        """The layout a call on `tokens` tokens runs ("masked" or "contiguous"; see the module doc)."""
        if layout not in LAYOUTS:
            raise ValueError(f"MoE: `layout` must be one of {LAYOUTS}, got {layout!r}")
        if layout != "auto":
            return layout
        if not self.stored_fp8:
            return "masked"
        masked = self.n_experts * self.capacity(tokens)
        contiguous = max_contiguous_rows(tokens, self.topk, self.n_experts, get_mk_alignment_for_contiguous_layout())
        return "masked" if masked <= contiguous else "contiguous"

    def __call__(self, x: jax.Array, *, layout: str = "auto", capacity: int | None = None,
                 return_dropped: bool = False):
        """bfloat16 [T, dim]. With `capacity` (masked layout only: rows per expert, rounded up to
        a multiple of 128) or `return_dropped`: (output, int32 count of the (token, expert)
        assignments the capacity dropped; always 0 without one)."""
        layout = self.layout_for(x.shape[0], layout)
        if capacity is not None:
            if layout != "masked":
                raise ValueError("MoE: `capacity` bounds the masked layout's rows per expert; the "
                                 "contiguous layout has none (it is always dropless)")
            if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
                raise ValueError(f"MoE: `capacity` must be a positive int (rows per expert), got {capacity!r}")
        experts, weights = self.gate(x)
        if layout == "masked":
            rows = self.capacity(x.shape[0]) if capacity is None else align(capacity, 128)
            y, dropped = self._masked(x, experts, weights, rows)
        else:
            y, dropped = self._contiguous(x, experts, weights), jnp.zeros((), jnp.int32)
        if self.shared is not None:       # float32 sum, rounded once (DeepSeek's MoE.forward)
            y = y + self.shared(x).astype(jnp.float32)
        y = y.astype(jnp.bfloat16)
        return (y, dropped) if return_dropped or capacity is not None else y

    def _masked(self, x, experts, weights, rows):
        lay = masked_layout(experts, self.n_experts, rows)
        hint = max(1, -(-x.shape[0] * self.topk // self.n_experts))
        if self.stored_fp8:
            a = permute_to_masked(_tokens(x, self.use_ue8m0), lay)
            h = m_grouped_fp8_gemm_nt_masked(a, (self.w13[...], self.w13_scale_inv[...]), lay.masked_m, hint,
                                             clean=False)
            a = cast_tokens(_swiglu(h), use_ue8m0=self.use_ue8m0, valid_rows=lay.masked_m)[0]
            y = m_grouped_fp8_gemm_nt_masked(a, (self.w2[...], self.w2_scale_inv[...]), lay.masked_m, hint,
                                             clean=False)
        else:
            h = fp8_grouped_linear(permute_to_masked(x.astype(jnp.bfloat16), lay), self.w13[...],
                                   lay.masked_m, hint)
            y = fp8_grouped_linear(_swiglu(h), self.w2[...], lay.masked_m, hint)
        return combine_from_masked(y, lay, weights, jnp.float32), lay.num_dropped

    def _contiguous(self, x, experts, weights):
        lay = contiguous_layout(experts, self.n_experts)
        if self.stored_fp8:
            w13 = (self.w13[...], self.w13_scale_inv[...])
            w2 = (self.w2[...], self.w2_scale_inv[...])
            ue8m0 = self.use_ue8m0
        else:   # bf16 masters: quantised on this call (one fused cast each), the training recipe's scales
            w13, w2, ue8m0 = cast_blocks(self.w13[...])[0], cast_blocks(self.w2[...])[0], False
        a = permute_to_contiguous(_tokens(x, ue8m0), lay)
        h = m_grouped_fp8_gemm_nt_contiguous(a, w13, lay.grouped_layout, clean=False)
        y = m_grouped_fp8_gemm_nt_contiguous(_tokens(_swiglu(h), ue8m0), w2, lay.grouped_layout, clean=False)
        return combine_from_contiguous(y, lay, weights, jnp.float32)
