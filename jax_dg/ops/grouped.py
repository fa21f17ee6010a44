"""Grouped GEMMs for MoE experts: m-grouped (contiguous rows / masked per-expert batches), FP8 and
BF16, and the k-grouped FP8 weight-gradient GEMM.

Outputs are fully defined: with `clean=True` (default) rows DeepGEMM leaves unspecified (padding
rows of the contiguous layout, rows past masked_m) are set to 0 by a masked select in the jitted
program, which XLA fuses into whatever consumes the result where it can. `clean=False` skips it
(and the input sanitising below) and returns DeepGEMM's output as is.

Under jax.vmap the ops run once per batch element (the Op default, vmap_method="sequential").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.contracts import align, cdiv
from jax_dg.core import runtime as rt
from jax_dg.core.checks import Checker
from jax_dg.core.op import Op, exposes
from jax_dg.core.sharding import Layout, Sharding
from jax_dg.routing import get_mk_alignment_for_contiguous_layout
from jax_dg.scales import mn_major_logical, mn_major_physical
from jax_dg.reference import grouped as ref

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
                      + " (MN-major physical, jax_dg.scales.mn_major_physical)")
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
    _m_grouped_operands(ck, a, sfa, b, sfb, fp8=True, masked=masked, physical=False,
                        mk_alignment=1 if masked else get_mk_alignment_for_contiguous_layout())
    return mn_major_physical(sfa)


SM90 = frozenset({"sm90"})   # where the m-grouped calls allocate nothing (graph-safe)

# Sharding: contiguous rows split in whole alignment blocks, masked groups (experts) split, and
# N splits, all with no collective (every shard holds all experts' weights, or its experts').
_TIES = {"ma": ("m", "aligned", 4), "kb": ("k", "blocks", 128), "nb": ("n", "blocks", 128)}
CONTIGUOUS_SHARDING = Sharding(
    lambda names, *, mk_alignment: Layout(
        {"a": "m k", "sfa": "kb ma", "b": "g n k", "sfb": "g nb kb", "grouped_layout": "m"}, ["m n"],
        multiple={"m": mk_alignment}),
    free=frozenset({"m", "n"}), tied=_TIES)
MASKED_SHARDING = Sharding(
    lambda names, *, expected_m: Layout(
        {"a": "g r k", "sfa": "g kb ra", "b": "g n k", "sfb": "g nb kb", "masked_m": "g"}, ["g r n"]),
    free=frozenset({"g", "n"}), tied=_TIES)


# --- m-grouped, contiguous layout ---------------------------------------------------------------

def _contiguous_rule(name: str, fp8: bool):
    def rule(a, sfa, b, sfb, grouped_layout, *, mk_alignment):
        ck = Checker(name)
        _, m, n, _ = _m_grouped_operands(ck, a, sfa, b, sfb, fp8=fp8, masked=False,
                                         mk_alignment=mk_alignment)
        ck.tensor(grouped_layout, "grouped_layout", [I32], (m,), "[M] (group id per row, -1 = padding)")
        return [jax.ShapeDtypeStruct((m, n), BF16)]
    return rule


def _use_alignment(dg, mk_alignment):
    """DeepGEMM picks BLOCK_M <= its global alignment when the kernel runs: make it the value
    the layout was traced with (a getter call when it already is)."""
    if dg.get_mk_alignment_for_contiguous_layout() != mk_alignment:
        dg.set_mk_alignment_for_contiguous_layout(mk_alignment)


def _fp8_contiguous_run(dg, a, sfa, b, sfb, grouped_layout, d, *, mk_alignment):
    _use_alignment(dg, mk_alignment)
    dg.m_grouped_fp8_gemm_nt_contiguous((a, rt.mn_major_view(sfa, a.shape[0])), (b, sfb), d,
                                        grouped_layout)


M_GROUPED_FP8_CONTIGUOUS = Op(
    name="m_grouped_fp8_gemm_nt_contiguous",
    args=("a", "sfa", "b", "sfb", "grouped_layout"),
    rule=_contiguous_rule("m_grouped_fp8_gemm_nt_contiguous", fp8=True),
    run=_fp8_contiguous_run,
    reference=lambda a, sfa, b, sfb, layout, *, mk_alignment: ref.m_grouped_fp8_gemm_nt_contiguous(
        a, mn_major_logical(sfa, a.shape[0]), b, sfb, layout, mk_alignment=mk_alignment),
    symbols=("m_grouped_fp8_gemm_nt_contiguous",),
    graph_safe=SM90,
    sharding=CONTIGUOUS_SHARDING,
)

_bf16_contiguous_rule = _contiguous_rule("m_grouped_bf16_gemm_nt_contiguous", fp8=False)


def _bf16_contiguous_run(dg, a, b, grouped_layout, d, *, mk_alignment):
    _use_alignment(dg, mk_alignment)
    dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout)


M_GROUPED_BF16_CONTIGUOUS = Op(
    name="m_grouped_bf16_gemm_nt_contiguous",
    args=("a", "b", "grouped_layout"),
    rule=lambda a, b, grouped_layout, *, mk_alignment: _bf16_contiguous_rule(
        a, None, b, None, grouped_layout, mk_alignment=mk_alignment),
    run=_bf16_contiguous_run,
    reference=ref.m_grouped_bf16_gemm_nt_contiguous,
    symbols=("m_grouped_bf16_gemm_nt_contiguous",),
    graph_safe=SM90,
    sharding=CONTIGUOUS_SHARDING,
)


def _contiguous(op, ck, arrays, num_groups, grouped_layout, clean):
    clean = ck.static_bool(clean, "clean")
    ck.dtype(grouped_layout, "grouped_layout", I32)   # before the select below reads it as ints
    if clean:
        # Ids outside [0, G) become padding: DeepGEMM would read past b for ids >= G.
        grouped_layout = jnp.where(grouped_layout < num_groups, grouped_layout, -1)
    (d,) = op(*arrays, grouped_layout, mk_alignment=get_mk_alignment_for_contiguous_layout())
    if clean:
        d = jnp.where((grouped_layout >= 0)[:, None], d, jnp.zeros((), d.dtype))
    return d


@exposes(M_GROUPED_FP8_CONTIGUOUS)
def m_grouped_fp8_gemm_nt_contiguous(a, b, grouped_layout, *, clean: bool = True) -> jax.Array:
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
    DeepGEMM is set to it when the kernel runs. Rows of a layout that breaks it are not
    computed as written. K % 16 == 0, N % 8 == 0.
    clean=True (default): padding rows (and ids outside [0, G), treated as padding) are 0 in d.
    clean=False: d straight from DeepGEMM; padding rows hold 0 or a[r] @ b[g].T for the group g
    of their block, and ids must lie in [-1, G).
    """
    ck = Checker("m_grouped_fp8_gemm_nt_contiguous")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    ck.ndim(bv, "b[0]", 3, "[G, N, K]")
    sfa = _fp8_scales(ck, av, sfa, bv, sfb, masked=False)
    return _contiguous(M_GROUPED_FP8_CONTIGUOUS, ck, (av, sfa, bv, sfb), bv.shape[0],
                       grouped_layout, clean)


@exposes(M_GROUPED_BF16_CONTIGUOUS)
def m_grouped_bf16_gemm_nt_contiguous(a, b, grouped_layout, *, clean: bool = True) -> jax.Array:
    """BF16 m_grouped_fp8_gemm_nt_contiguous: a bfloat16 [M, K], b bfloat16 [G, N, K],
    grouped_layout int32 [M] (-1 = padding) -> d bfloat16 [M, N], float32 accumulation
    (DeepGEMM m_grouped_bf16_gemm_nt_contiguous). Same layout contract and `clean`; K % 64 == 0."""
    ck = Checker("m_grouped_bf16_gemm_nt_contiguous")
    ck.ndim(b, "b", 3, "[G, N, K]")
    return _contiguous(M_GROUPED_BF16_CONTIGUOUS, ck, (a, b), b.shape[0], grouped_layout, clean)


# --- m-grouped, masked layout -------------------------------------------------------------------

def _masked_rule(name: str, fp8: bool):
    def rule(a, sfa, b, sfb, masked_m, *, expected_m):
        ck = Checker(name)
        g, m, n, _ = _m_grouped_operands(ck, a, sfa, b, sfb, fp8=fp8, masked=True)
        ck.tensor(masked_m, "masked_m", [I32], (g,), "[G]")
        ck.static_int(expected_m, "expected_m", 1)
        return [jax.ShapeDtypeStruct((g, m, n), BF16)]
    return rule


def _fp8_masked_run(dg, a, sfa, b, sfb, masked_m, d, *, expected_m):
    dg.m_grouped_fp8_gemm_nt_masked((a, rt.mn_major_view(sfa, a.shape[1])), (b, sfb), d, masked_m,
                                    expected_m)


M_GROUPED_FP8_MASKED = Op(
    name="m_grouped_fp8_gemm_nt_masked",
    args=("a", "sfa", "b", "sfb", "masked_m"),
    rule=_masked_rule("m_grouped_fp8_gemm_nt_masked", fp8=True),
    run=_fp8_masked_run,
    reference=lambda a, sfa, b, sfb, masked_m, *, expected_m: ref.m_grouped_fp8_gemm_nt_masked(
        a, mn_major_logical(sfa, a.shape[1]), b, sfb, masked_m, expected_m=expected_m),
    symbols=("m_grouped_fp8_gemm_nt_masked",),
    graph_safe=SM90,
    sharding=MASKED_SHARDING,
)

_bf16_masked_rule = _masked_rule("m_grouped_bf16_gemm_nt_masked", fp8=False)


def _bf16_masked_run(dg, a, b, masked_m, d, *, expected_m):
    dg.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)


M_GROUPED_BF16_MASKED = Op(
    name="m_grouped_bf16_gemm_nt_masked",
    args=("a", "b", "masked_m"),
    rule=lambda a, b, masked_m, *, expected_m: _bf16_masked_rule(a, None, b, None, masked_m,
                                                                  expected_m=expected_m),
    run=_bf16_masked_run,
    reference=ref.m_grouped_bf16_gemm_nt_masked,
    symbols=("m_grouped_bf16_gemm_nt_masked",),
    graph_safe=SM90,
    sharding=MASKED_SHARDING,
)


def _masked(op, ck, arrays, max_m, masked_m, expected_m, clean):
    clean = ck.static_bool(clean, "clean")
    expected_m = ck.static_int(expected_m, "expected_m", 1)
    ck.dtype(masked_m, "masked_m", I32)               # before the clip below reads it as ints
    if clean:
        # DeepGEMM runs ceil(masked_m / BLOCK_M) blocks: keep it inside [0, Mmax].
        masked_m = jnp.clip(masked_m, 0, max_m)
    (d,) = op(*arrays, masked_m, expected_m=expected_m)
    if clean:
        rows = jnp.arange(max_m, dtype=masked_m.dtype)[None, :] < masked_m[:, None]
        d = jnp.where(rows[:, :, None], d, jnp.zeros((), d.dtype))
    return d


@exposes(M_GROUPED_FP8_MASKED)
def m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m: int, *, clean: bool = True) -> jax.Array:
    """MoE experts on per-expert batches: d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T
    (DeepGEMM m_grouped_fp8_gemm_nt_masked, old name fp8_m_grouped_gemm_nt_masked).

    a: (values float8_e4m3fn [G, Mmax, K], scales float32 [G, Mmax, ceil(K/128)])
    b: (values float8_e4m3fn [G, N, K], scales float32 [G, ceil(N/128), ceil(K/128)])
    masked_m: int32 [G], the valid rows of each group; expected_m: static int > 0, a hint for
    DeepGEMM's tile heuristics (typical rows per group).
    Returns d bfloat16 [G, Mmax, N]. Mmax % 128 == 0, K % 16 == 0, N % 8 == 0.
    clean=True (default): masked_m is clipped to [0, Mmax] and rows >= masked_m[g] are 0.
    clean=False: d straight from DeepGEMM (rows >= masked_m[g] unspecified; masked_m must lie
    in [0, Mmax]).
    """
    ck = Checker("m_grouped_fp8_gemm_nt_masked")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    ck.ndim(av, "a[0]", 3, "[G, Mmax, K]")
    sfa = _fp8_scales(ck, av, sfa, bv, sfb, masked=True)
    return _masked(M_GROUPED_FP8_MASKED, ck, (av, sfa, bv, sfb), av.shape[1], masked_m, expected_m,
                   clean)


fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked  # DeepGEMM's (and vLLM's) old name


@exposes(M_GROUPED_BF16_MASKED)
def m_grouped_bf16_gemm_nt_masked(a, b, masked_m, expected_m: int, *, clean: bool = True) -> jax.Array:
    """BF16 m_grouped_fp8_gemm_nt_masked: a bfloat16 [G, Mmax, K], b bfloat16 [G, N, K],
    masked_m int32 [G] -> d bfloat16 [G, Mmax, N] (DeepGEMM m_grouped_bf16_gemm_nt_masked).
    Same `clean` and Mmax rule; K % 64 == 0."""
    ck = Checker("m_grouped_bf16_gemm_nt_masked")
    ck.ndim(a, "a", 3, "[G, Mmax, K]")
    return _masked(M_GROUPED_BF16_MASKED, ck, (a, b), a.shape[1], masked_m, expected_m, clean)


# --- k-grouped (weight gradients), SM90 -----------------------------------------------------------

def _k_grouped_rule(a, sfa, b, sfb, ks_tensor, c, *, ks):
    ck = Checker("k_grouped_fp8_gemm_nt_contiguous")
    ck.that(len(ks) > 0 and all(kg >= 0 and kg % 128 == 0 for kg in ks), "ks",
            "must be a non-empty list of multiples of 128 (one K per group, 0 allowed)", ks)
    ck.ndim(c, "c", 3, "[G, M, N]")
    ck.dtype(c, "c", F32)
    g, m, n = c.shape
    ck.that(g == len(ks), "c", f"must have len(ks) = {len(ks)} groups", tuple(c.shape))
    ck.that(n % 4 == 0, "c", "must have N % 4 == 0 (16-byte rows of the float32 d)", n)
    sum_k = sum(ks)
    ck.tensor(a, "a[0]", [FP8], (sum_k * m,), "[sum(ks) * M] (group g row-major [M, ks[g]])")
    ck.tensor(b, "b[0]", [FP8], (sum_k * n,), "[sum(ks) * N] (group g row-major [N, ks[g]])")
    ck.tensor(sfa, "a[1]", [F32], (sum_k // 128, m), "[sum(ks) / 128, M]")
    ck.tensor(sfb, "b[1]", [F32], (sum_k // 128, n), "[sum(ks) / 128, N]")
    ck.tensor(ks_tensor, "ks_tensor", [I32], (g,), "[G]")
    return [jax.ShapeDtypeStruct((g, m, n), F32)]


def _k_grouped_run(dg, a, sfa, b, sfb, ks_tensor, c, d, *, ks):
    # DeepGEMM reads the scales as [M, sum(ks)/128] MN-major: the transposed views of ours.
    dg.k_grouped_fp8_gemm_nt_contiguous((a, sfa.T), (b, sfb.T), d, list(ks), ks_tensor, c=c)


K_GROUPED_FP8 = Op(
    name="k_grouped_fp8_gemm_nt_contiguous",
    args=("a", "sfa", "b", "sfb", "ks_tensor", "c"),
    rule=_k_grouped_rule,
    run=_k_grouped_run,
    reference=ref.k_grouped_fp8_gemm_nt_contiguous,
    symbols=("k_grouped_fp8_gemm_nt_contiguous",),
    aliases={"c": 0},
    archs=frozenset({"sm90"}),
)


@exposes(K_GROUPED_FP8)
def k_grouped_fp8_gemm_nt_contiguous(a, b, ks, *, c) -> jax.Array:
    """Grouped weight gradients: d[g] = c[g] + A_g @ B_g.T, with group g's K = ks[g] (DeepGEMM
    k_grouped_fp8_gemm_nt_contiguous; its SM90 kernel, recipe (1, 1, 128)).

    a: (values float8_e4m3fn [sum(ks) * M], scales float32 [sum(ks) / 128, M]): group g is the
       row-major [M, ks[g]] block at element offset M * sum(ks[:g]); its scales are rows
       sum(ks[:g]) / 128 ... of the scales (per channel, 128 along K).
    b: the same with N.
    ks: static list of each group's K, multiples of 128 (0 = empty group: d[g] = c[g]).
    c: float32 [G, M, N], required (XLA may donate it to d). N % 4 == 0.
    Returns d float32 [G, M, N].
    """
    ck = Checker("k_grouped_fp8_gemm_nt_contiguous")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    if not isinstance(ks, (list, tuple)):
        ck.fail("ks", "must be a static list of ints", type(ks).__name__)
    ks = [ck.static_int(kg, "ks") for kg in ks]
    ck.that(all(0 <= kg < 2 ** 31 for kg in ks), "ks", "must be multiples of 128 in [0, 2**31) "
            "(int32 group sizes)", ks)
    ck.that(c is not None, "c", "is required (d = c + a @ b.T)")
    ks_tensor = jnp.asarray(ks, dtype=I32)
    (d,) = K_GROUPED_FP8(av, sfa, bv, sfb, ks_tensor, c, ks=ks)
    return d
