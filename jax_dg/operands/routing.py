"""MoE routing <-> DeepGEMM's grouped layouts, in jittable JAX (every size is static).

Top-k expert ids `topk_idx` [T, K] (ids outside [0, num_experts) -- e.g. -1, or experts of
another rank -- are not routed) become either

* the contiguous layout of `m_grouped_*_gemm_nt_contiguous`: rows sorted by expert, each
  expert's segment padded to the mk alignment (`get_mk_alignment_for_contiguous_layout()` at
  trace time), `grouped_layout` int32 [M] = expert of each row, -1 on padding rows; M is
  static (`max_rows`, default the worst case), unused trailing rows are padding too;
* the masked layout of `m_grouped_*_gemm_nt_masked`: [G, max_m, ...] with `masked_m` int32
  [G] valid rows per expert (assignments beyond max_m are dropped and counted).

The mk alignment (DeepGEMM's BLOCK_M cap for contiguous layouts) is configured here too.

Within an expert, rows keep token order (then slot order). `permute_*` gathers the token rows
(padding rows are 0, as DeepGEMM's tests feed them), `combine_*` scatters the GEMM output back:
out[t] = sum_k topk_weights[t, k] * y[row of (t, k)], accumulated in float32.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dg.backends import deep_gemm
from jax_dg.contracts import LEGACY_MK_ALIGNMENT, align, cdiv
from jax_dg.core import device
from jax_dg.core.checks import ArgumentError, Checker


# --- M/K alignment of the contiguous grouped layout ------------------------------------------

# The alignment set through jax_dg (None: DeepGEMM's own, else the legacy 128). It is a
# jit-cache-sensitive context: layouts and the contiguous ops read it while tracing, so a
# function traced under one alignment is traced again under another instead of reusing stale
# padding.
_mk_alignment = jax.make_user_context(default_value=None)


def _dg(name: str):
    return deep_gemm.lookup(name)


def get_mk_alignment_for_contiguous_layout() -> int:
    """The row alignment of each group in m-grouped contiguous layouts: the value set through
    jax_dg (`set_mk_alignment_for_contiguous_layout`, `mk_alignment_scope`), else DeepGEMM's
    when deep_gemm imports, else 128 (DeepGEMM's legacy value). An int, as DeepGEMM returns
    (vLLM's wrapper returns [value, value])."""
    if _mk_alignment.value is not None:
        return _mk_alignment.value
    fn = _dg("get_mk_alignment_for_contiguous_layout")
    return int(fn()) if fn is not None else LEGACY_MK_ALIGNMENT


def _checked_alignment(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ArgumentError(f"set_mk_alignment_for_contiguous_layout: `value` must be a positive "
                            f"int, got {value!r}")
    return value


def _set_deep_gemm_alignment(value: int) -> None:
    fn = _dg("set_mk_alignment_for_contiguous_layout")
    if fn is not None:
        fn(value)


def set_mk_alignment_for_contiguous_layout(value: int) -> None:
    """Sets the alignment: DeepGEMM's BLOCK_M cap for m-grouped contiguous GEMMs. Group padding
    must match the kernel's BLOCK_M: jax_dg's layouts and contiguous ops trace with this value
    (functions traced before are traced again), and each contiguous op sets DeepGEMM to the
    value it was traced with before its kernel runs. DeepGEMM's own global is set too, for
    torch code in the same process."""
    value = _checked_alignment(value)
    _mk_alignment.set_global(value)
    _set_deep_gemm_alignment(value)


@contextlib.contextmanager
def mk_alignment_scope(value: int):
    """The alignment for the block (functions traced inside use it); restored on exit."""
    value = _checked_alignment(value)
    prev_dg = _dg("get_mk_alignment_for_contiguous_layout")
    prev_dg = int(prev_dg()) if prev_dg is not None else None
    with _mk_alignment(value):
        _set_deep_gemm_alignment(value)
        try:
            yield
        finally:
            if prev_dg is not None:
                _set_deep_gemm_alignment(prev_dg)


def get_theoretical_mk_alignment_for_contiguous_layout(expected_m: int | None = None,
                                                       num_groups: int | None = None) -> int:
    """The alignment DeepGEMM recommends for a grouped call. `expected_m` is the total routed
    rows (tokens x topk) when `num_groups` (experts on this rank) is given, else per group.

    With deep_gemm: its own answer (older builds take only the per-group m: it is computed as
    ceil(expected_m / num_groups), as vLLM's wrapper does). Without: DeepGEMM's table for the
    default device's family: SM100 256; SM120 64 when the per-group m <= 64, else 128; SM90,
    other GPUs and CPU 128.
    """
    ck = Checker("get_theoretical_mk_alignment_for_contiguous_layout")
    if expected_m is not None:
        expected_m = ck.static_int(expected_m, "expected_m", minimum=0)
    if num_groups is not None:
        num_groups = ck.static_int(num_groups, "num_groups", minimum=1)
    fn = _dg("get_theoretical_mk_alignment_for_contiguous_layout")
    if fn is not None:
        if num_groups is None:
            return int(fn(expected_m))
        try:
            return int(fn(expected_m, num_groups))
        except TypeError:
            return int(fn(None if expected_m is None else cdiv(expected_m, num_groups)))
    per_group = expected_m if num_groups is None or expected_m is None else cdiv(expected_m, num_groups)
    family = device.family()
    if family == "sm100":
        return 256
    if family == "sm120":
        return 64 if per_group is not None and per_group <= 64 else 128
    return LEGACY_MK_ALIGNMENT


class ContiguousLayout(NamedTuple):
    grouped_layout: jax.Array  # int32 [M]: expert of each row, -1 on padding rows
    token_index: jax.Array     # int32 [M]: source token of each row, T on padding rows
    row_index: jax.Array       # int32 [T, K]: row of each (token, slot), -1 if not routed
    group_sizes: jax.Array     # int32 [G]: rows routed to each expert (before padding)
    group_offsets: jax.Array   # int32 [G]: first row of each expert's aligned segment
    num_rows: jax.Array        # int32 []: rows the layout needs (sum of aligned group sizes)


class MaskedLayout(NamedTuple):
    masked_m: jax.Array        # int32 [G]: valid rows of each expert (<= max_m)
    token_index: jax.Array     # int32 [G, max_m]: source token of each slot, T when empty
    row_index: jax.Array       # int32 [T, K]: flat slot g * max_m + i of each (token, slot), -1
    num_dropped: jax.Array     # int32 []: routed assignments beyond max_m (dropped)


def _check_topk(ck: Checker, topk_idx, num_experts):
    ck.ndim(topk_idx, "topk_idx", 2, "[T, K]")
    ck.that(jnp.issubdtype(topk_idx.dtype, jnp.integer), "topk_idx", "must hold integer expert ids",
            jnp.dtype(topk_idx.dtype).name)
    return ck.static_int(num_experts, "num_experts", minimum=1)


def _rank_by_expert(topk_idx: jax.Array, num_experts: int):
    """Per assignment (flat t*K+k): expert (num_experts if not routed), rank within its expert
    in token order, and the per-expert counts."""
    flat = topk_idx.reshape(-1).astype(jnp.int32)
    expert = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(expert, stable=True)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[expert[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return expert, rank, counts[:num_experts]


def max_contiguous_rows(num_tokens: int, topk: int, num_experts: int, alignment: int) -> int:
    """Rows that always suffice: every routed row plus alignment - 1 padding per used expert."""
    routed = num_tokens * topk
    return align(routed + min(num_experts, routed) * (alignment - 1), alignment)


def contiguous_layout(topk_idx: jax.Array, num_experts: int, *, alignment: int | None = None,
                      max_rows: int | None = None) -> ContiguousLayout:
    """The contiguous grouped layout of a routing (see the module doc). `alignment` defaults to
    get_mk_alignment_for_contiguous_layout(); `max_rows` (static, a multiple of it) to
    max_contiguous_rows(...). With a smaller max_rows, rows past it are dropped: row_index -1
    (compare num_rows with max_rows to detect it)."""
    ck = Checker("contiguous_layout")
    g = _check_topk(ck, topk_idx, num_experts)
    a = ck.static_int(get_mk_alignment_for_contiguous_layout() if alignment is None else alignment,
                      "alignment", minimum=1)
    t, k = topk_idx.shape
    m = max_contiguous_rows(t, k, g, a) if max_rows is None else ck.static_int(max_rows, "max_rows", 0)
    ck.that(m % a == 0, "max_rows", f"must be a multiple of the alignment {a}", m)
    expert, rank, counts = _rank_by_expert(topk_idx, g)
    padded = (counts + a - 1) // a * a
    offsets = jnp.cumsum(padded) - padded
    routed = expert < g
    row = jnp.where(routed, offsets[jnp.minimum(expert, g - 1)] + rank, m)
    row = jnp.where(row < m, row, m)  # m: out of range, dropped by the scatters below
    token = jnp.arange(t * k, dtype=jnp.int32) // k
    grouped_layout = jnp.full((m,), -1, jnp.int32).at[row].set(expert, mode="drop")
    token_index = jnp.full((m,), t, jnp.int32).at[row].set(token, mode="drop")
    row_index = jnp.where(row < m, row, -1).reshape(t, k)
    return ContiguousLayout(grouped_layout, token_index, row_index, counts, offsets.astype(jnp.int32),
                            padded.sum().astype(jnp.int32))


def psum_layout(topk_idx: jax.Array, num_experts: int, *, alignment: int | None = None,
                max_rows: int | None = None) -> tuple[jax.Array, ContiguousLayout]:
    """DeepGEMM's psum layout of a routing: (psum int32 [G], the ContiguousLayout it describes).

    psum[j] = the end row (exclusive) of expert j's rows, which start at align(psum[j-1],
    alignment): the rows of contiguous_layout(...) (same arguments), so permute_to_contiguous /
    combine_from_contiguous work with the returned layout as they are; pass psum as the
    grouped_layout of an m-grouped contiguous GEMM with use_psum_layout=True. With a smaller
    max_rows, ends are cut to it (the rows past it are dropped as in contiguous_layout)."""
    layout = contiguous_layout(topk_idx, num_experts, alignment=alignment, max_rows=max_rows)
    m = layout.grouped_layout.shape[0]
    psum = jnp.minimum(layout.group_offsets + layout.group_sizes, m).astype(jnp.int32)
    return psum, layout


def masked_layout(topk_idx: jax.Array, num_experts: int, max_m: int) -> MaskedLayout:
    """The masked grouped layout of a routing: expert g's rows in slots [0, masked_m[g])."""
    ck = Checker("masked_layout")
    g = _check_topk(ck, topk_idx, num_experts)
    max_m = ck.static_int(max_m, "max_m", minimum=1)
    t, k = topk_idx.shape
    expert, rank, counts = _rank_by_expert(topk_idx, g)
    kept = (expert < g) & (rank < max_m)
    slot = jnp.where(kept, expert * max_m + rank, g * max_m)
    token = jnp.arange(t * k, dtype=jnp.int32) // k
    token_index = jnp.full((g * max_m,), t, jnp.int32).at[slot].set(token, mode="drop")
    masked_m = jnp.minimum(counts, max_m).astype(jnp.int32)
    return MaskedLayout(masked_m, token_index.reshape(g, max_m),
                        jnp.where(kept, slot, -1).reshape(t, k),
                        (counts - masked_m).sum().astype(jnp.int32))


def _gather_rows(x, index):
    """x[index] along axis 0 with zero rows where index is out of range (FP8 pairs too)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_gather_rows(v, index) for v in x)
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def permute_to_contiguous(x, layout: ContiguousLayout):
    """Token rows x [T, ...] (or a (values, scales) pair) -> [M, ...] in the contiguous layout."""
    return _gather_rows(x, layout.token_index)


def permute_to_masked(x, layout: MaskedLayout):
    """Token rows x [T, ...] (or a (values, scales) pair) -> [G, max_m, ...]."""
    g, max_m = layout.token_index.shape
    out = _gather_rows(x, layout.token_index.reshape(-1))
    reshape = lambda v: v.reshape(g, max_m, *v.shape[1:])  # noqa: E731
    return type(out)(reshape(v) for v in out) if isinstance(out, (tuple, list)) else reshape(out)


def _combine(rows: jax.Array, row_index: jax.Array, topk_weights, out_dtype):
    ck = Checker("combine")
    ck.shape(topk_weights, "topk_weights", row_index.shape, "[T, K] (topk_idx's shape)")
    n = rows.shape[0]
    index = jnp.where(row_index >= 0, row_index, n)
    picked = jnp.take(rows, index.reshape(-1), axis=0, mode="fill", fill_value=0)
    picked = picked.reshape(*row_index.shape, *rows.shape[1:]).astype(jnp.float32)
    w = jnp.where(row_index >= 0, topk_weights.astype(jnp.float32), 0.0)
    w = w.reshape(*w.shape, *([1] * (rows.ndim - 1)))
    return (picked * w).sum(axis=1).astype(out_dtype or rows.dtype)


def combine_from_contiguous(y: jax.Array, layout: ContiguousLayout, topk_weights: jax.Array,
                            out_dtype=None) -> jax.Array:
    """GEMM output y [M, N] in the contiguous layout -> [T, N], weighted by topk_weights [T, K]."""
    return _combine(y, layout.row_index, topk_weights, out_dtype)


def combine_from_masked(y: jax.Array, layout: MaskedLayout, topk_weights: jax.Array,
                        out_dtype=None) -> jax.Array:
    """GEMM output y [G, max_m, N] in the masked layout -> [T, N], weighted by topk_weights."""
    return _combine(y.reshape(-1, *y.shape[2:]), layout.row_index, topk_weights, out_dtype)
