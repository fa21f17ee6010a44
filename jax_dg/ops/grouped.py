"""Grouped GEMMs for MoE experts: m-grouped (contiguous rows / masked per-expert batches), FP8 and
BF16, and the k-grouped FP8 weight-gradient GEMM.

Outputs are fully defined: with `clean=True` (default) the rows DeepGEMM leaves unspecified
(padding rows of the contiguous layout, rows past masked_m) are set to 0 after DeepGEMM's call
by jax_dg's own kernel (kernels/zero_rows.cu, a native call composed in the op's finish, in
place) that writes only those rows: no pass over the rest of d (the psum layout and the nn
form clean with an XLA select).
`clean=False` skips it and returns DeepGEMM's output as is; where a's padding
rows are zero (as routing.permute_to_contiguous / _to_masked make them) and only routed rows
are read back (routing.combine_from_*), that is exact. Index vectors are always brought into
range (ids outside [-1, G) become -1, masked_m is clipped to [0, Mmax]; jax_dg.core.values).

Under jax.vmap the ops run once per batch element (a loop, lax.map: no batching rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dg.contracts import align, cdiv
from jax_dg.core import native, values
from jax_dg.core.checks import Checker
from jax_dg.core.op import REQUIRED, Op, exposes, shaped
from jax_dg.core.sharding import Layout, Sharding
from jax_dg.operands.routing import get_mk_alignment_for_contiguous_layout
from jax_dg.operands.scales import logical_view, mn_major_logical, mn_major_physical
from jax_dg.reference import grouped as ref

__all__ = ["fp8_m_grouped_gemm_nt_masked", "k_grouped_bf16_gemm_tn_contiguous",
           "k_grouped_fp8_gemm_nt_contiguous", "m_grouped_bf16_gemm_nn_contiguous",
           "m_grouped_bf16_gemm_nt_contiguous", "m_grouped_bf16_gemm_nt_masked",
           "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"]

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
F32 = jnp.float32
I32 = jnp.int32
# The masked kernels' row block on SM90 (Mmax must be a multiple). The contiguous ops use
# get_mk_alignment_for_contiguous_layout() (128 unless set), read while tracing.
MK_ALIGNMENT = 128


def _m_grouped_operands(ck: Checker, a, sfa, b, sfb, *, fp8: bool, masked: bool, mk_alignment: int = 0,
                        physical: bool = True):
    """Checks the operands of an m-grouped GEMM; returns (G, M or Mmax, N, K). a's FP8 scales
    reach the op as their MN-major physical buffer (`physical`; see _fp8_operands)."""
    an, bn = ("a[0]", "b[0]") if fp8 else ("a", "b")
    ck.ndim(a, an, 3 if masked else 2, "[G, Mmax, K]" if masked else "[M, K]")
    ck.ndim(b, bn, 3, "[G, N, K]")
    ck.dtype(a, an, FP8 if fp8 else BF16)
    ck.dtype(b, bn, FP8 if fp8 else BF16)
    g, n, k = b.shape
    m = a.shape[-2]
    ck.that(a.shape[-1] == k, an, f"must have b's K = {k} as its last dim", tuple(a.shape))
    ck.that(not masked or a.shape[0] == g, an, f"must have b's G = {g} groups", tuple(a.shape))
    ck.that(g > 0 and n > 0 and k > 0, bn, "must have G, N and K > 0", tuple(b.shape))
    ck.that(n % 8 == 0, bn, "must have N % 8 == 0 (16-byte rows of the bfloat16 d)", n)
    if fp8:
        ck.that(k % 16 == 0, an, "must have K % 16 == 0 (16-byte rows for TMA)", k)
        if physical:
            ck.tensor(sfa, "a[1]", [F32], (*a.shape[:-2], cdiv(k, 128), align(m, 4)),
                      ("[G, ceil(K/128), align(Mmax, 4)]" if masked else "[ceil(K/128), align(M, 4)]")
                      + " (MN-major physical, jax_dg.operands.scales.mn_major_physical)")
        else:
            ck.tensor(sfa, "a[1]", [F32], (*a.shape[:-1], cdiv(k, 128)),
                      "[G, Mmax, ceil(K/128)]" if masked else "[M, ceil(K/128)]")
        ck.tensor(sfb, "b[1]", [F32], (g, cdiv(n, 128), cdiv(k, 128)), "[G, ceil(N/128), ceil(K/128)]")
    else:
        ck.that(k % 64 == 0, an, "must have K % 64 == 0 (DeepGEMM's BF16 grouped kernels)", k)
    if masked:
        ck.that(m > 0 and m % MK_ALIGNMENT == 0, an,
                f"must have Mmax a positive multiple of {MK_ALIGNMENT} (DeepGEMM stores all groups "
                "through one [G * Mmax] map, so a partial last block would spill into the next group)", m)
    else:
        ck.that(m % mk_alignment == 0, an,
                f"must have M % {mk_alignment} == 0 (every group's rows padded to a multiple of "
                f"get_mk_alignment_for_contiguous_layout() = {mk_alignment})", m)
    return g, m, n, k


def _fp8_scales(ck: Checker, a, sfa, b, sfb, *, masked: bool):
    """a's per-token scales as the op takes them: checked as the caller gave them, then their
    MN-major physical buffer, which DeepGEMM's SM90 kernels read as they are (no allocation,
    no transpose of its own: what makes the call capture-safe)."""
    _m_grouped_operands(ck, a, logical_view(sfa), b, sfb, fp8=True, masked=masked, physical=False,
                        mk_alignment=1 if masked else get_mk_alignment_for_contiguous_layout())
    return mn_major_physical(sfa)


SM90 = frozenset({"sm90"})   # where the m-grouped calls allocate nothing (graph-safe)

# The statics of each layout's ops (compiled_dims: DeepGEMM's default when None)
CONTIGUOUS_STATICS = {"mk_alignment": REQUIRED, "clean": REQUIRED, "compiled_dims": None}
MASKED_STATICS = {"expected_m": REQUIRED, "clean": REQUIRED, "compiled_dims": None}
PSUM_STATICS = {"mk_alignment": REQUIRED, "use_psum_layout": REQUIRED, "expected_m": REQUIRED,
                "compiled_dims": REQUIRED}
K_GROUPED_STATICS = {"ks": REQUIRED, "compiled_dims": None}

# Sharding: contiguous rows split in whole alignment blocks, masked groups (experts) split, and
# N splits, all with no collective (every shard holds all experts' weights, or its experts').
_TIES = {"ma": ("m", "aligned", 4), "kb": ("k", "blocks", 128), "nb": ("n", "blocks", 128)}
CONTIGUOUS_SHARDING = Sharding(
    lambda names, *, mk_alignment: Layout(
        {"a": "m k", "sfa": "kb ma", "b": "g n k", "sfb": "g nb kb", "grouped_layout": "m"}, ["m n"],
        multiple={"m": mk_alignment}),
    free=frozenset({"m", "n"}), tied=_TIES)
MASKED_SHARDING = Sharding(
    lambda names: Layout(
        {"a": "g r k", "sfa": "g kb ra", "b": "g n k", "sfb": "g nb kb", "masked_m": "g"}, ["g r n"]),
    free=frozenset({"g", "n"}), tied=_TIES)


# --- m-grouped, contiguous layout ---------------------------------------------------------------

def _contiguous_shapes(name: str, fp8: bool):
    def shapes(a, sfa, b, sfb, grouped_layout, *, target, mk_alignment):
        """d's type; the plan: whether the cleaning leaves the blocks that start with padding
        alone (_SKIP_PADDING_BLOCKS)."""
        ck = Checker(name)
        _, m, n, _ = _m_grouped_operands(ck, a, sfa, b, sfb, fp8=fp8, masked=False,
                                         mk_alignment=mk_alignment)
        ck.tensor(grouped_layout, "grouped_layout", [I32], (m,), "[M] (group id per row, -1 = padding)")
        skip = (_SKIP_PADDING_BLOCKS["fp8" if fp8 else "bf16"] and target.backend == "deep_gemm"
                and target.arch == "sm90")
        return shaped([jax.ShapeDtypeStruct((m, n), BF16)], skip_padding_blocks=skip)
    return shapes


def _use_alignment(dg, mk_alignment):
    """DeepGEMM picks BLOCK_M <= its global alignment when the kernel runs: make it the value
    the layout was traced with (a getter call when it already is)."""
    if dg.get_mk_alignment_for_contiguous_layout() != mk_alignment:
        dg.set_mk_alignment_for_contiguous_layout(mk_alignment)


# Whether the padding rows of a block whose first row is padding can be left alone: the SM90
# FP8 kernel stores zeros there; the BF16 kernel computes every row from a (established
# bitwise on the H200: test_grouped.py::test_gpu_which_padding_rows_deep_gemm_writes).
_SKIP_PADDING_BLOCKS = {"fp8": True, "bf16": False}


def _zero_padding_rows(outs, inputs, *, mk_alignment, clean, skip_padding_blocks):
    """The contiguous ops' finish: with clean, the padding rows of d zeroed in place by jax_dg's
    own kernel. The skip was established on SM90 only (DeepGEMM's kernel there): every
    padding row is zeroed elsewhere, and on the torch emulation (the shape rule's plan)."""
    (d,) = outs
    if not clean:
        return (d,)
    return (native.zero_padding_rows(d, inputs["grouped_layout"], block=mk_alignment,
                                     skip_padding_blocks=skip_padding_blocks),)


def _zero_masked_tail(outs, inputs, *, clean):
    """The masked ops' finish: with clean, the rows past masked_m zeroed in place by jax_dg's
    own kernel (DeepGEMM never writes the blocks past masked_m: stale memory)."""
    (d,) = outs
    return (native.zero_masked_tail(d, inputs["masked_m"]) if clean else d,)


def _fp8_contiguous_run(rt, a, sfa, b, sfb, grouped_layout, d, *, mk_alignment, compiled_dims):
    _use_alignment(rt.dg, mk_alignment)
    rt.dg.m_grouped_fp8_gemm_nt_contiguous((a, rt.mn_major_view(sfa, a.shape[0])), (b, sfb), d,
                                           grouped_layout, **rt.dims(compiled_dims))


M_GROUPED_FP8_CONTIGUOUS = Op(
    name="m_grouped_fp8_gemm_nt_contiguous",
    args=("a", "sfa", "b", "sfb", "grouped_layout"),
    statics=CONTIGUOUS_STATICS,
    shapes=_contiguous_shapes("m_grouped_fp8_gemm_nt_contiguous", fp8=True),
    run=_fp8_contiguous_run,
    reference=lambda a, sfa, b, sfb, layout, *, mk_alignment: ref.m_grouped_fp8_gemm_nt_contiguous(
        a, mn_major_logical(sfa, a.shape[0]), b, sfb, layout, mk_alignment=mk_alignment),
    symbols=("m_grouped_fp8_gemm_nt_contiguous",),
    own_kernels=("zero_padding_rows",),
    graph_safe=SM90,
    finish=_zero_padding_rows,
    sharding=CONTIGUOUS_SHARDING,
)

_bf16_contiguous_shapes = _contiguous_shapes("m_grouped_bf16_gemm_nt_contiguous", fp8=False)


def _bf16_contiguous_run(rt, a, b, grouped_layout, d, *, mk_alignment, compiled_dims):
    _use_alignment(rt.dg, mk_alignment)
    rt.dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, **rt.dims(compiled_dims))


M_GROUPED_BF16_CONTIGUOUS = Op(
    name="m_grouped_bf16_gemm_nt_contiguous",
    args=("a", "b", "grouped_layout"),
    statics=CONTIGUOUS_STATICS,
    shapes=lambda a, b, grouped_layout, *, target, mk_alignment: _bf16_contiguous_shapes(
        a, None, b, None, grouped_layout, target=target, mk_alignment=mk_alignment),
    run=_bf16_contiguous_run,
    reference=lambda a, b, layout, *, mk_alignment: ref.m_grouped_bf16_gemm_nt_contiguous(
        a, b, layout, mk_alignment=mk_alignment),
    symbols=("m_grouped_bf16_gemm_nt_contiguous",),
    own_kernels=("zero_padding_rows",),
    graph_safe=SM90,
    finish=_zero_padding_rows,
    sharding=CONTIGUOUS_SHARDING,
)


# DeepGEMM's m-grouped contiguous kernels compute a block of A rows with the group id of its
# first row (the scheduler reads grouped_layout[block * A]), and SM90's FP8 kernel skips each
# 64-row slice whose first row is padding (a math warp group's is_computation_valid).
SLICE = 64


def _blocks_rule(alignment: int) -> str:
    s = min(SLICE, alignment)
    return (f"must give each routed row (id >= 0) the id of the first row of its block of "
            f"A = get_mk_alignment_for_contiguous_layout() = {alignment} rows, and a routed first row "
            f"to its {s}-row slice: DeepGEMM computes a block with the group of its first row and "
            f"skips a slice that starts with padding (keep each group's rows contiguous from a "
            f"multiple of A, padded with -1 to one)")


def _blocks_kept(ids, alignment: int):
    """Per row: whether DeepGEMM computes it with its own group, or it is padding (numpy or
    jnp ids [M], M % alignment == 0)."""
    xp = np if isinstance(ids, np.ndarray) else jnp
    s = min(SLICE, alignment)
    r = xp.arange(ids.shape[0])
    first, slice_first = ids[r // alignment * alignment], ids[r // s * s]
    return (ids < 0) | ((ids == first) & (slice_first >= 0))


def _static_row_ids(ck: Checker, ids, alignment: int):
    """Per-row ids known while tracing (numpy, lists): a layout DeepGEMM would compute other
    than written is an ArgumentError (traced ids: under `checked()`, in _contiguous)."""
    if isinstance(ids, jax.core.Tracer) or isinstance(ids, jax.Array):
        return
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] % alignment:
        return   # the shape function names the shape, dtype or length
    bad = np.flatnonzero(~_blocks_kept(ids, alignment))
    ck.that(bad.size == 0, "grouped_layout", _blocks_rule(alignment),
            f"rows {bad[:4].tolist()} holding {ids[bad[:4]].tolist()}")


def _contiguous(op, ck, arrays, num_groups, grouped_layout, clean, compiled_dims=None):
    clean = ck.static_bool(clean, "clean")
    alignment = get_mk_alignment_for_contiguous_layout()
    _static_row_ids(ck, grouped_layout, alignment)
    grouped_layout = jnp.asarray(grouped_layout)
    ck.dtype(grouped_layout, "grouped_layout", I32)   # before the select below reads it as ints
    # Ids outside [-1, G) become padding (-1), with or without `clean`: DeepGEMM would read
    # past b for ids >= G. A select on the [M] ids, fused.
    grouped_layout = values.require(ck.op, "grouped_layout",
                                    (grouped_layout >= -1) & (grouped_layout < num_groups),
                                    f"must hold group ids in [0, G = {num_groups}) or -1 (padding)",
                                    grouped_layout)
    grouped_layout = jnp.where((grouped_layout >= 0) & (grouped_layout < num_groups), grouped_layout, -1)
    # A layout off the blocks is in range, so it is not changed: DeepGEMM computes it its own way
    # (docs/api.md, "Grouped layouts"); under checked() it raises instead.
    grouped_layout = values.require(ck.op, "grouped_layout", _blocks_kept(grouped_layout, alignment),
                                    _blocks_rule(alignment), grouped_layout, rows=True)
    (d,) = op(*arrays, grouped_layout, mk_alignment=alignment, clean=clean, compiled_dims=compiled_dims)
    return d


@exposes(M_GROUPED_FP8_CONTIGUOUS)   # and M_GROUPED_FP8_PSUM (marked where it is declared)
def m_grouped_fp8_gemm_nt_contiguous(a, b, grouped_layout, *, clean: bool = True,
                                     use_psum_layout: bool = False,
                                     expected_m_for_psum_layout: int | None = None,
                                     compiled_dims: str | None = None) -> jax.Array:
    """MoE experts on contiguous rows: d[r] = a[r] @ b[grouped_layout[r]].T (DeepGEMM
    m_grouped_fp8_gemm_nt_contiguous).

    a: (values float8_e4m3fn [M, K], scales float32 [M, ceil(K/128)])         per token
    b: (values float8_e4m3fn [G, N, K], scales float32 [G, ceil(N/128), ceil(K/128)])  per block
    grouped_layout: int32 [M], the expert of each row, -1 for padding rows.
    Returns d bfloat16 [M, N].

    Layout contract (DeepGEMM computes a block of A rows with the group of its first row, where
    A = get_mk_alignment_for_contiguous_layout(), 128 unless set): each group's rows are
    contiguous, start at a multiple of A and are padded with -1 rows to a multiple of A (so
    M % A == 0); groups may come in any order and may be empty. A is read while tracing and
    DeepGEMM is set to it when the kernel runs. Padding inside a group's block is allowed; a
    layout that DeepGEMM would compute other than written (a routed row whose id differs from
    its block's first row, or in a 64-row slice that opens with padding) is an ArgumentError
    when known while tracing and raises under `jax_dg.checked()`; otherwise the GPU computes
    it block-wise while the CPU backends compute each row with its own id (docs/api.md,
    "Grouped-contiguous layouts"). K % 16 == 0, N % 8 == 0.
    Ids outside [-1, G) are treated as padding (-1) before DeepGEMM reads them (always: it
    does not check them); under `jax_dg.checked()` they raise instead, naming grouped_layout.
    clean=True (default): padding rows are 0 in d; jax_dg's kernel writes only the padding
    rows of blocks that hold routed rows (DeepGEMM's SM90 FP8 kernel writes the others as 0;
    the BF16 form and other GPUs zero every padding row). That holds for layouts that keep the
    contract above (a block that starts with padding holds only padding). With the psum layout,
    clean=True is a select in XLA over d instead. clean=False: d straight from DeepGEMM; padding rows
    hold 0 or a[r] @ b[g].T for the group g of their block (so 0 where a's padding rows are 0,
    as routing.permute_to_contiguous makes them).
    use_psum_layout=True: grouped_layout is instead int32 [G], psum[j] = the end row (exclusive)
    of group j, whose rows run from align(psum[j-1], A) (0 for j = 0) to psum[j]; M % A == 0
    still (jax_dg.operands.routing.psum_layout builds it from top-k ids). Offsets known while tracing
    (numpy, lists, constants) must be non-decreasing and in [0, M] (ArgumentError); traced
    ones are clipped to [0, M] and to their running maximum before DeepGEMM reads them
    (always; a decreasing entry makes its group empty; under `jax_dg.checked()` they raise
    instead). Rows in no group are 0 with clean=True, unspecified with clean=False.
    expected_m_for_psum_layout: static rows-per-group hint (psum layout only).
    Sharding: the psum form runs whole (operands gathered).
    compiled_dims: static string of the dims DeepGEMM compiles in (distinct letters of 'mnk';
    DeepGEMM's default 'nk'): speed only, the same results.
    """
    ck = Checker("m_grouped_fp8_gemm_nt_contiguous")
    _psum_doc_check(ck, use_psum_layout, expected_m_for_psum_layout)
    dims = ck.compiled_dims(compiled_dims)
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    ck.ndim(bv, "b[0]", 3, "[G, N, K]")
    sfa = _fp8_scales(ck, av, sfa, bv, sfb, masked=False)
    if use_psum_layout:
        return _psum_contiguous(M_GROUPED_FP8_PSUM, ck, (av, sfa, bv, sfb), av.shape[0], grouped_layout,
                                clean, expected_m_for_psum_layout, dims)
    return _contiguous(M_GROUPED_FP8_CONTIGUOUS, ck, (av, sfa, bv, sfb), bv.shape[0],
                       grouped_layout, clean, dims)


@exposes(M_GROUPED_BF16_CONTIGUOUS)   # and M_GROUPED_BF16_PSUM (marked where it is declared)
def m_grouped_bf16_gemm_nt_contiguous(a, b, grouped_layout, *, clean: bool = True,
                                      use_psum_layout: bool = False,
                                      expected_m_for_psum_layout: int | None = None,
                                      compiled_dims: str | None = None) -> jax.Array:
    """BF16 m_grouped_fp8_gemm_nt_contiguous: a bfloat16 [M, K], b bfloat16 [G, N, K],
    grouped_layout int32 [M] (-1 = padding) -> d bfloat16 [M, N], float32 accumulation
    (DeepGEMM m_grouped_bf16_gemm_nt_contiguous). Same layout contract, `clean`, psum layout
    (use_psum_layout, expected_m_for_psum_layout) and compiled_dims; K % 64 == 0. B stored
    [G, K, N]: m_grouped_bf16_gemm_nn_contiguous."""
    ck = Checker("m_grouped_bf16_gemm_nt_contiguous")
    _psum_doc_check(ck, use_psum_layout, expected_m_for_psum_layout)
    dims = ck.compiled_dims(compiled_dims)
    ck.ndim(b, "b", 3, "[G, N, K]")
    if use_psum_layout:
        ck.ndim(a, "a", 2, "[M, K]")
        return _psum_contiguous(M_GROUPED_BF16_PSUM, ck, (a, b), a.shape[0], grouped_layout, clean,
                                expected_m_for_psum_layout, dims)
    return _contiguous(M_GROUPED_BF16_CONTIGUOUS, ck, (a, b), b.shape[0], grouped_layout, clean, dims)


# --- m-grouped, masked layout -------------------------------------------------------------------

def _masked_shapes(name: str, fp8: bool):
    def shapes(a, sfa, b, sfb, masked_m, *, expected_m):
        ck = Checker(name)
        g, m, n, _ = _m_grouped_operands(ck, a, sfa, b, sfb, fp8=fp8, masked=True)
        ck.tensor(masked_m, "masked_m", [I32], (g,), "[G]")
        ck.static_int(expected_m, "expected_m", 1)
        return [jax.ShapeDtypeStruct((g, m, n), BF16)]
    return shapes


def _fp8_masked_run(rt, a, sfa, b, sfb, masked_m, d, *, expected_m, compiled_dims):
    rt.dg.m_grouped_fp8_gemm_nt_masked((a, rt.mn_major_view(sfa, a.shape[1])), (b, sfb), d, masked_m,
                                       expected_m, **rt.dims(compiled_dims))


M_GROUPED_FP8_MASKED = Op(
    name="m_grouped_fp8_gemm_nt_masked",
    args=("a", "sfa", "b", "sfb", "masked_m"),
    statics=MASKED_STATICS,
    shapes=_masked_shapes("m_grouped_fp8_gemm_nt_masked", fp8=True),
    run=_fp8_masked_run,
    reference=lambda a, sfa, b, sfb, masked_m, *, expected_m: ref.m_grouped_fp8_gemm_nt_masked(
        a, mn_major_logical(sfa, a.shape[1]), b, sfb, masked_m, expected_m=expected_m),
    symbols=("m_grouped_fp8_gemm_nt_masked",),
    own_kernels=("zero_masked_tail",),
    graph_safe=SM90,
    finish=_zero_masked_tail,
    sharding=MASKED_SHARDING,
)

_bf16_masked_shapes = _masked_shapes("m_grouped_bf16_gemm_nt_masked", fp8=False)


def _bf16_masked_run(rt, a, b, masked_m, d, *, expected_m, compiled_dims):
    rt.dg.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, **rt.dims(compiled_dims))


M_GROUPED_BF16_MASKED = Op(
    name="m_grouped_bf16_gemm_nt_masked",
    args=("a", "b", "masked_m"),
    statics=MASKED_STATICS,
    shapes=lambda a, b, masked_m, *, expected_m: _bf16_masked_shapes(a, None, b, None, masked_m,
                                                                     expected_m=expected_m),
    run=_bf16_masked_run,
    reference=lambda a, b, masked_m, *, expected_m: ref.m_grouped_bf16_gemm_nt_masked(
        a, b, masked_m, expected_m=expected_m),
    symbols=("m_grouped_bf16_gemm_nt_masked",),
    own_kernels=("zero_masked_tail",),
    graph_safe=SM90,
    finish=_zero_masked_tail,
    sharding=MASKED_SHARDING,
)


def _masked(op, ck, arrays, max_m, masked_m, expected_m, clean, compiled_dims=None):
    clean = ck.static_bool(clean, "clean")
    expected_m = ck.static_int(expected_m, "expected_m", 1)
    ck.dtype(masked_m, "masked_m", I32)               # before the clip below reads it as ints
    # DeepGEMM runs ceil(masked_m / BLOCK_M) blocks: keep it inside [0, Mmax], with or without
    # `clean` (a clip on the [G] counts, fused).
    masked_m = values.require(ck.op, "masked_m", (masked_m >= 0) & (masked_m <= max_m),
                              f"must lie in [0, Mmax = {max_m}]", masked_m)
    masked_m = jnp.clip(masked_m, 0, max_m)
    (d,) = op(*arrays, masked_m, expected_m=expected_m, clean=clean,
              compiled_dims=ck.compiled_dims(compiled_dims))
    return d


@exposes(M_GROUPED_FP8_MASKED)
def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m: int, *, clean: bool = True,
                                 compiled_dims: str | None = None) -> jax.Array:
    """MoE experts on per-expert batches: d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T
    (DeepGEMM m_grouped_fp8_gemm_nt_masked, old name fp8_m_grouped_gemm_nt_masked).

    a: (values float8_e4m3fn [G, Mmax, K], scales float32 [G, Mmax, ceil(K/128)], or an
       MNMajor of them, e.g. from jax_dg.cast_tokens: taken as it is, no layout pass)
    b: (values float8_e4m3fn [G, N, K], scales float32 [G, ceil(N/128), ceil(K/128)])
    masked_m: int32 [G], the valid rows of each group; expected_m: static int > 0, a hint for
    DeepGEMM's tile heuristics (typical rows per group).
    Returns d bfloat16 [G, Mmax, N]. Mmax % 128 == 0, K % 16 == 0, N % 8 == 0.
    masked_m is clipped to [0, Mmax] before DeepGEMM reads it (always: it does not check it);
    under `jax_dg.checked()` a value outside raises instead, naming masked_m.
    clean=True (default): rows >= masked_m[g] are 0 (written by jax_dg's kernel, which
    touches only those rows). clean=False: d straight from DeepGEMM (rows >= masked_m[g]
    unspecified).
    compiled_dims: static, the dims DeepGEMM compiles in (distinct letters of 'mnk'; DeepGEMM's
    default 'nk'): speed only, the same results.
    """
    ck = Checker("m_grouped_fp8_gemm_nt_masked")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    ck.ndim(av, "a[0]", 3, "[G, Mmax, K]")
    sfa = _fp8_scales(ck, av, sfa, bv, sfb, masked=True)
    return _masked(M_GROUPED_FP8_MASKED, ck, (av, sfa, bv, sfb), av.shape[1], masked_m, expected_m,
                   clean, compiled_dims)


fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked  # DeepGEMM's (and vLLM's) old name


@exposes(M_GROUPED_BF16_MASKED)
def m_grouped_bf16_gemm_nt_masked(a, b, masked_m, expected_m: int, *, clean: bool = True,
                                  compiled_dims: str | None = None) -> jax.Array:
    """BF16 m_grouped_fp8_gemm_nt_masked: a bfloat16 [G, Mmax, K], b bfloat16 [G, N, K],
    masked_m int32 [G] -> d bfloat16 [G, Mmax, N] (DeepGEMM m_grouped_bf16_gemm_nt_masked).
    Same `clean`, Mmax rule and compiled_dims; K % 64 == 0."""
    ck = Checker("m_grouped_bf16_gemm_nt_masked")
    ck.ndim(a, "a", 3, "[G, Mmax, K]")
    return _masked(M_GROUPED_BF16_MASKED, ck, (a, b), a.shape[1], masked_m, expected_m, clean,
                   compiled_dims)


# --- k-grouped (weight gradients), SM90 -----------------------------------------------------------

def _k_grouped_c(ck: Checker, c, ks):
    """The k-grouped rule's ks and c checks (shared by FP8 and BF16); returns (G, M, N)."""
    ck.that(len(ks) > 0 and all(kg >= 0 and kg % 128 == 0 for kg in ks), "ks",
            "must be a non-empty list of multiples of 128 (one K per group, 0 allowed)", ks)
    ck.ndim(c, "c", 3, "[G, M, N]")
    ck.dtype(c, "c", F32)
    g, m, n = c.shape
    ck.that(g == len(ks), "c", f"must have len(ks) = {len(ks)} groups", tuple(c.shape))
    return g, m, n


def _k_grouped_shapes(a, sfa, b, sfb, ks_tensor, c, *, ks):
    ck = Checker("k_grouped_fp8_gemm_nt_contiguous")
    g, m, n = _k_grouped_c(ck, c, ks)
    ck.that(n % 4 == 0, "c", "must have N % 4 == 0 (16-byte rows of the float32 d)", n)
    sum_k = sum(ks)
    ck.tensor(a, "a[0]", [FP8], (sum_k * m,), "[sum(ks) * M] (group g row-major [M, ks[g]])")
    ck.tensor(b, "b[0]", [FP8], (sum_k * n,), "[sum(ks) * N] (group g row-major [N, ks[g]])")
    ck.tensor(sfa, "a[1]", [F32], (sum_k // 128, m), "[sum(ks) / 128, M]")
    ck.tensor(sfb, "b[1]", [F32], (sum_k // 128, n), "[sum(ks) / 128, N]")
    ck.tensor(ks_tensor, "ks_tensor", [I32], (g,), "[G]")
    return [jax.ShapeDtypeStruct((g, m, n), F32)]


def _k_grouped_run(rt, a, sfa, b, sfb, ks_tensor, c, d, *, ks, compiled_dims):
    # DeepGEMM reads the scales as [M, sum(ks)/128] MN-major: the transposed views of ours.
    rt.dg.k_grouped_fp8_gemm_nt_contiguous((a, sfa.T), (b, sfb.T), d, list(ks), ks_tensor, c=c,
                                           **rt.dims(compiled_dims))


K_GROUPED_FP8 = Op(
    name="k_grouped_fp8_gemm_nt_contiguous",
    args=("a", "sfa", "b", "sfb", "ks_tensor", "c"),
    statics=K_GROUPED_STATICS,
    shapes=_k_grouped_shapes,
    run=_k_grouped_run,
    reference=ref.k_grouped_fp8_gemm_nt_contiguous,
    symbols=("k_grouped_fp8_gemm_nt_contiguous",),
    aliases={"c": 0},
    archs=frozenset({"sm90"}),
)


def _static_ks(ck: Checker, ks) -> list[int]:
    if not isinstance(ks, (list, tuple)):
        ck.fail("ks", "must be a static list of ints", type(ks).__name__)
    ck.that(all(isinstance(kg, (int, np.integer)) and 0 <= kg < 2 ** 31 for kg in ks), "ks",
            "must be multiples of 128 in [0, 2**31) (int32 group sizes)", list(ks))
    ks = [ck.static_int(kg, "ks") for kg in ks]
    return ks


@exposes(K_GROUPED_FP8)
def k_grouped_fp8_gemm_nt_contiguous(a, b, ks, *, c, compiled_dims: str | None = None) -> jax.Array:
    """Grouped weight gradients: d[g] = c[g] + A_g @ B_g.T, with group g's K = ks[g] (DeepGEMM
    k_grouped_fp8_gemm_nt_contiguous; its SM90 kernel, recipe (1, 1, 128)).

    a: (values float8_e4m3fn [sum(ks) * M], scales float32 [sum(ks) / 128, M]): group g is the
       row-major [M, ks[g]] block at element offset M * sum(ks[:g]); its scales are rows
       sum(ks[:g]) / 128 ... of the scales (per channel, 128 along K).
    b: the same with N.
    ks: static list of each group's K, multiples of 128 (0 = empty group: d[g] = c[g]).
    c: float32 [G, M, N], required (XLA may donate it to d). N % 4 == 0.
    compiled_dims: static, letters of 'mnk' ('mn' by default): speed only.
    Returns d float32 [G, M, N].
    """
    ck = Checker("k_grouped_fp8_gemm_nt_contiguous")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    ks = _static_ks(ck, ks)
    ck.that(c is not None, "c", "is required (d = c + a @ b.T)")
    ks_tensor = jnp.asarray(ks, dtype=I32)
    (d,) = K_GROUPED_FP8(av, sfa, bv, sfb, ks_tensor, c, ks=ks, compiled_dims=ck.compiled_dims(compiled_dims))
    return d


# --- m-grouped contiguous: the psum layout, and BF16 with B stored [G, K, N] ("nn") ---------------
#
# DeepGEMM's use_psum_layout=True: grouped_layout is int32 [G], psum[j] = the end (exclusive) of
# group j's rows; group j runs from align(psum[j - 1], A) (0 for j = 0) to psum[j], A =
# get_mk_alignment_for_contiguous_layout(). Rows in no group are unspecified in DeepGEMM (0
# here with clean=True, a select in XLA). These records also run the grouped nn form, with
# either layout.

def _psum_shapes(name: str, fp8: bool, nn: bool = False):
    def shapes(a, sfa, b, sfb, layout, *, mk_alignment, use_psum_layout):
        ck = Checker(name)
        bk = b if not nn else jax.ShapeDtypeStruct((b.shape[0], b.shape[2], b.shape[1]), b.dtype)
        if nn:
            ck.ndim(b, "b", 3, "[G, K, N]")
        g, m, n, _ = _m_grouped_operands(ck, a, sfa, bk, sfb, fp8=fp8, masked=False,
                                         mk_alignment=mk_alignment)
        if use_psum_layout:
            ck.tensor(layout, "grouped_layout", [I32], (g,), "[G] (psum: each group's end row)")
        else:
            ck.tensor(layout, "grouped_layout", [I32], (m,), "[M] (group id per row, -1 = padding)")
        return [jax.ShapeDtypeStruct((m, n), BF16)]
    return shapes


def _psum_kwargs(rt, use_psum_layout, expected_m, compiled_dims):
    kw = rt.dims(compiled_dims)
    if use_psum_layout:
        kw["use_psum_layout"] = True
        if expected_m:
            kw["expected_m_for_psum_layout"] = expected_m
    return kw


def _fp8_psum_run(rt, a, sfa, b, sfb, layout, d, *, mk_alignment, use_psum_layout, expected_m,
                  compiled_dims):
    _use_alignment(rt.dg, mk_alignment)
    rt.dg.m_grouped_fp8_gemm_nt_contiguous((a, rt.mn_major_view(sfa, a.shape[0])), (b, sfb), d, layout,
                                           **_psum_kwargs(rt, use_psum_layout, expected_m, compiled_dims))


def _bf16_layout_run(symbol: str):
    def run(rt, a, b, layout, d, *, mk_alignment, use_psum_layout, expected_m, compiled_dims):
        _use_alignment(rt.dg, mk_alignment)
        getattr(rt.dg, symbol)(a, b, d, layout, **_psum_kwargs(rt, use_psum_layout, expected_m, compiled_dims))
    return run


def _layout_reference(x, w, layout, mk_alignment, use_psum_layout):
    ids = ref.psum_to_row_groups(layout, x.shape[0], mk_alignment) if use_psum_layout else layout
    return ref.m_grouped_contiguous(x, w, ids)


M_GROUPED_FP8_PSUM = Op(
    name="m_grouped_fp8_gemm_nt_contiguous_psum",
    args=("a", "sfa", "b", "sfb", "grouped_layout"),
    statics=PSUM_STATICS,
    shapes=_psum_shapes("m_grouped_fp8_gemm_nt_contiguous", fp8=True),
    run=_fp8_psum_run,
    reference=lambda a, sfa, b, sfb, layout, *, mk_alignment, use_psum_layout:
        _layout_reference(ref.dequant(a, mn_major_logical(sfa, a.shape[0]), 1, 128),
                          ref.dequant(b, sfb, 128, 128), layout, mk_alignment, use_psum_layout),
    symbols=("m_grouped_fp8_gemm_nt_contiguous",),
    # not graph_safe (yet): whether DeepGEMM's psum path allocates was not measured on the H200
)


def _bf16_layout_op(name: str, symbol: str, nn: bool) -> Op:
    psum_shapes = _psum_shapes(name, fp8=False, nn=nn)
    return Op(
        name=name + ("" if nn else "_psum"),
        args=("a", "b", "grouped_layout"),
        statics=PSUM_STATICS,
        shapes=lambda a, b, layout, *, mk_alignment, use_psum_layout: psum_shapes(
            a, None, b, None, layout, mk_alignment=mk_alignment, use_psum_layout=use_psum_layout),
        run=_bf16_layout_run(symbol),
        reference=lambda a, b, layout, *, mk_alignment, use_psum_layout:
            _layout_reference(a, jnp.swapaxes(b, 1, 2) if nn else b, layout, mk_alignment,
                              use_psum_layout),
        symbols=(symbol,),
    )


M_GROUPED_BF16_PSUM = _bf16_layout_op("m_grouped_bf16_gemm_nt_contiguous",
                                      "m_grouped_bf16_gemm_nt_contiguous", nn=False)
M_GROUPED_BF16_NN_CONTIGUOUS = _bf16_layout_op("m_grouped_bf16_gemm_nn_contiguous",
                                               "m_grouped_bf16_gemm_nn_contiguous", nn=True)
# the public contiguous functions run these too (info reports what each function may run)
exposes(M_GROUPED_FP8_CONTIGUOUS, M_GROUPED_FP8_PSUM)(m_grouped_fp8_gemm_nt_contiguous)
exposes(M_GROUPED_BF16_CONTIGUOUS, M_GROUPED_BF16_PSUM)(m_grouped_bf16_gemm_nt_contiguous)


def _static_psum(ck: Checker, psum, m: int):
    """Checks psum offsets that are known while tracing (numpy, lists, constants): non-decreasing,
    in [0, M]. Traced offsets cannot be read here: _psum_contiguous brings them into range."""
    if isinstance(psum, jax.core.Tracer):
        return
    offsets = np.asarray(psum)   # (not `values`: the module of that name is imported here)
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        return   # the shape function names the shape or dtype
    ck.that(bool((offsets >= 0).all() and (offsets <= m).all()), "grouped_layout",
            f"(psum) must hold end rows in [0, M] = [0, {m}]", offsets.tolist())
    ck.that(bool((np.diff(offsets) >= 0).all()), "grouped_layout",
            "(psum) must be non-decreasing (group j ends where group j + 1 may start)", offsets.tolist())


def _psum_contiguous(op, ck, arrays, m: int, grouped_layout, clean, expected_m, compiled_dims):
    a_ = get_mk_alignment_for_contiguous_layout()
    _static_psum(ck, grouped_layout, m)
    grouped_layout = jnp.asarray(grouped_layout)
    ck.dtype(grouped_layout, "grouped_layout", I32)
    expected_m = 0 if expected_m is None else ck.static_int(expected_m, "expected_m_for_psum_layout", 1)
    clean = ck.static_bool(clean, "clean")
    # data, with or without `clean` (as the per-row ids): end rows clipped to [0, M] and to
    # their running maximum (a decreasing entry makes that group empty), so DeepGEMM never runs
    # past a or d. A scan over the [G] offsets.
    grouped_layout = values.require(ck.op, "grouped_layout",
                                    (grouped_layout >= 0) & (grouped_layout <= m)
                                    & (grouped_layout >= jax.lax.cummax(grouped_layout, axis=0)),
                                    f"(psum) must hold non-decreasing end rows in [0, M = {m}]",
                                    grouped_layout)
    grouped_layout = jax.lax.cummax(jnp.clip(grouped_layout, 0, m), axis=0)
    (d,) = op(*arrays, grouped_layout, mk_alignment=a_, use_psum_layout=True, expected_m=expected_m,
              compiled_dims=compiled_dims)
    if clean:
        ids = ref.psum_to_row_groups(grouped_layout, m, a_)
        d = jnp.where((ids >= 0)[:, None], d, jnp.zeros((), d.dtype))
    return d


def _psum_doc_check(ck: Checker, use_psum_layout, expected_m):
    ck.that(isinstance(use_psum_layout, bool), "use_psum_layout", "must be a Python bool", use_psum_layout)
    ck.that(use_psum_layout or expected_m is None, "expected_m_for_psum_layout",
            "is only taken with use_psum_layout=True (DeepGEMM asserts it)", expected_m)


def _with_ids(op):
    """`op` (one of the records above) called the way _contiguous calls the per-row-id ops.
    These records do not run the cleaning kernel: clean=True is a select in XLA here."""
    def call(*xs, mk_alignment, clean, compiled_dims):
        (d,) = op(*xs, mk_alignment=mk_alignment, use_psum_layout=False, expected_m=0,
                  compiled_dims=compiled_dims)
        if clean:
            d = jnp.where((xs[-1] >= 0)[:, None], d, jnp.zeros((), d.dtype))
        return (d,)
    return call


@exposes(M_GROUPED_BF16_NN_CONTIGUOUS)
def m_grouped_bf16_gemm_nn_contiguous(a, b, grouped_layout, *, clean: bool = True,
                                      use_psum_layout: bool = False,
                                      compiled_dims: str | None = None) -> jax.Array:
    """m_grouped_bf16_gemm_nt_contiguous with B stored [G, K, N] (MN-major B; DeepGEMM
    m_grouped_bf16_gemm_nn_contiguous): d[r] = a[r] @ b[g], a bfloat16 [M, K], b bfloat16
    [G, K, N] -> d bfloat16 [M, N]. grouped_layout: per-row ids [M] as for the nt form, or with
    use_psum_layout=True the psum [G] (see m_grouped_bf16_gemm_nt_contiguous). Same layout
    contract and `clean`; K % 64 == 0, N % 8 == 0. compiled_dims: see
    m_grouped_bf16_gemm_nt_contiguous."""
    ck = Checker("m_grouped_bf16_gemm_nn_contiguous")
    _psum_doc_check(ck, use_psum_layout, None)
    ck.ndim(b, "b", 3, "[G, K, N]")
    ck.ndim(a, "a", 2, "[M, K]")
    dims = ck.compiled_dims(compiled_dims)
    if use_psum_layout:
        return _psum_contiguous(M_GROUPED_BF16_NN_CONTIGUOUS, ck, (a, b), a.shape[0], grouped_layout,
                                clean, None, dims)
    return _contiguous(_with_ids(M_GROUPED_BF16_NN_CONTIGUOUS), ck, (a, b), b.shape[0],
                       grouped_layout, clean, dims)


# --- k-grouped BF16 (weight gradients in BF16) ----------------------------------------------------

def _k_grouped_bf16_shapes(a, b, ks_tensor, c, *, ks):
    ck = Checker("k_grouped_bf16_gemm_tn_contiguous")
    g, m, n = _k_grouped_c(ck, c, ks)
    ck.that(m % 8 == 0 and n % 8 == 0, "c", "must have M % 8 == 0 and N % 8 == 0 (16-byte rows of "
            "the MN-major bfloat16 a and b)", tuple(c.shape))
    ck.tensor(a, "a", [BF16], (sum(ks), m), "[sum(ks), M] (group g: rows sum(ks[:g]) ...)")
    ck.tensor(b, "b", [BF16], (sum(ks), n), "[sum(ks), N]")
    ck.tensor(ks_tensor, "ks_tensor", [I32], (g,), "[G]")
    return [jax.ShapeDtypeStruct((g, m, n), F32)]


def _k_grouped_bf16_run(rt, a, b, ks_tensor, c, d, *, ks, compiled_dims):
    # upstream's test runs it at mk alignment 128 ("TODO: support arbitrary alignment"): the
    # alignment the checked ks are multiples of
    _use_alignment(rt.dg, 128)
    rt.dg.k_grouped_bf16_gemm_tn_contiguous(a, b, d, list(ks), ks_tensor, c, **rt.dims(compiled_dims))


K_GROUPED_BF16 = Op(
    name="k_grouped_bf16_gemm_tn_contiguous",
    args=("a", "b", "ks_tensor", "c"),
    statics=K_GROUPED_STATICS,
    shapes=_k_grouped_bf16_shapes,
    run=_k_grouped_bf16_run,
    reference=lambda a, b, ks_tensor, c, *, ks: ref.k_grouped_bf16_gemm_tn_contiguous(a, b, c, ks=ks),
    symbols=("k_grouped_bf16_gemm_tn_contiguous",),
    aliases={"c": 0},
)


@exposes(K_GROUPED_BF16)
def k_grouped_bf16_gemm_tn_contiguous(a, b, ks, *, c, compiled_dims: str | None = None) -> jax.Array:
    """Grouped weight gradients in BF16: d[g] = c[g] + A_g.T @ B_g, A_g = a[sum(ks[:g]) :
    sum(ks[:g+1])] (DeepGEMM k_grouped_bf16_gemm_tn_contiguous, float32 accumulation).

    a: bfloat16 [sum(ks), M]; b: bfloat16 [sum(ks), N] (both MN-major, as DeepGEMM takes them).
    ks: static list of each group's K, multiples of 128 (0 = empty group: d[g] = c[g]).
    c: float32 [G, M, N], required (XLA may donate it to d). M % 8 == 0, N % 8 == 0.
    compiled_dims: static, letters of 'mnk' ('mn' by default): speed only.
    Returns d float32 [G, M, N].
    """
    ck = Checker("k_grouped_bf16_gemm_tn_contiguous")
    ck.array(a, "a")
    ck.array(b, "b")
    ks = _static_ks(ck, ks)
    ck.that(c is not None, "c", "is required (d = c + a.T @ b)")
    ck.array(c, "c")
    dims = ck.compiled_dims(compiled_dims)
    (d,) = K_GROUPED_BF16(a, b, jnp.asarray(ks, dtype=I32), c, ks=ks, compiled_dims=dims)
    return d
