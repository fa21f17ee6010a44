"""Dense GEMMs: FP8 with DeepSeek's block scaling, BF16 (DeepGEMM and cuBLASLt), in the four
operand storages nt / nn / tn / tt."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dg import contracts
from jax_dg.contracts import align, cdiv
from jax_dg.core import device
from jax_dg.core.checks import ArgumentError, Checker
from jax_dg.core.op import REQUIRED, Op, bcast, exposes, fold_rows, shaped
from jax_dg.core.sharding import Layout, Sharding
from jax_dg.ops.grouped import M_GROUPED_BF16_MASKED, M_GROUPED_FP8_MASKED
from jax_dg.reference import gemm as ref
from jax_dg.operands.scales import MNMajor, logical_view, mn_major_logical, mn_major_physical

__all__ = ["bf16_gemm_nn", "bf16_gemm_nt", "bf16_gemm_tn", "bf16_gemm_tt", "cublaslt_gemm_nn",
           "cublaslt_gemm_nt", "cublaslt_gemm_tn", "cublaslt_gemm_tt", "fp8_gemm_nn",
           "fp8_gemm_nt", "fp8_gemm_nt_skip_head_mid", "fp8_gemm_tn", "fp8_gemm_tt"]

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
# SM90 scale recipes (gran_m of a, gran_n of b, gran_k) and what each kernel writes:
# per-token a with per-block b -> bfloat16 d, no c; per-token a with per-channel b -> float32
# d accumulated onto a required c.
RECIPE_BLOCK = (1, 128, 128)
RECIPE_CHANNEL = (1, 1, 128)
OUT_DTYPE = {RECIPE_BLOCK: "bfloat16", RECIPE_CHANNEL: "float32"}


def infer_recipe(n: int, sfb_shape) -> tuple[int, int, int]:
    """DeepGEMM's default (per-block b) unless b's scales are per channel ([N, ...], N > 1)."""
    return RECIPE_CHANNEL if n > 1 and tuple(sfb_shape)[:1] == (n,) else RECIPE_BLOCK


# --- Operand storage -------------------------------------------------------------------------
# DeepGEMM names a GEMM by how its operands are stored: d[M, N] = op(a) @ op(b), where a is
# "n" = [M, K] or "t" = [K, M], and b is "t" = [N, K] or "n" = [K, N]. JAX arrays have no
# strides, so here the letters say how the arrays are stored (row-major); a quantised operand's
# scales are stored like its values. The ops hand DeepGEMM the transposed torch views its API
# expects.

BF16 = jnp.bfloat16
STORAGES = ("nt", "nn", "tn", "tt")


def _transposed(storage: str) -> tuple[bool, bool]:
    """(a stored [K, M], b stored [K, N]) for a storage name."""
    return storage[0] == "t", storage[1] == "n"


def _dims(shape, swapped: bool) -> tuple[int, int]:
    """(mn, k) of an operand stored [mn, k], or [k, mn] when swapped."""
    return (shape[1], shape[0]) if swapped else (shape[0], shape[1])


def _grid(mn: int, k: int, swapped: bool):
    return (k, mn) if swapped else (mn, k)


def _grid_text(swapped: bool, mn: str, k: str) -> str:
    return f"[{k}, {mn}]" if swapped else f"[{mn}, {k}]"


def _check_operands(ck: Checker, a, b, storage: str, dtype) -> tuple[int, int, int]:
    """Checks a and b (ranks, dtypes, matching K) stored as `storage`; returns (m, n, k)."""
    a_t, b_n = _transposed(storage)
    ck.ndim(a, "a[0]" if dtype == FP8 else "a", 2, _grid_text(a_t, "M", "K"))
    ck.ndim(b, "b[0]" if dtype == FP8 else "b", 2, _grid_text(b_n, "N", "K"))
    ck.dtype(a, "a[0]" if dtype == FP8 else "a", dtype)
    ck.dtype(b, "b[0]" if dtype == FP8 else "b", dtype)
    m, k = _dims(a.shape, a_t)
    n, kb = _dims(b.shape, b_n)
    ck.that(kb == k, "b[0]" if dtype == FP8 else "b",
            f"must be {_grid_text(b_n, 'N', 'K')} with a's K = {k}", tuple(b.shape))
    return m, n, k


# --- FP8: nt / nn / tn / tt ---------------------------------------------------------------------
# On SM90 DeepGEMM's FP8 kernels read both operands K-major only; a row-major JAX array stored
# [K, M] or [K, N] is MN-major, so nn / tn / tt run through DeepGEMM on SM100 only. On SM90 call
# fp8_gemm_nt on transposed arrays (XLA transposes them), or use JAX_DG_BACKEND=torch / xla.

def _mn_major(storage: str, recipe) -> tuple[bool, bool]:
    """Which scales reach the op as MN-major physical buffers (jax_dg.operands.scales.mn_major_physical):
    on nt, the per-token a's and per-channel b's, which DeepGEMM's SM90 kernels read MN-major and
    TMA-aligned. Built in the jitted program, DeepGEMM takes them as they are and allocates
    nothing (what makes the call capture-safe)."""
    return storage == "nt", storage == "nt" and recipe == RECIPE_CHANNEL


def _check_sf(ck: Checker, sf, arg: str, mn: int, kb: int, gran_mn: int, transposed: bool,
             physical: bool, k_text: str, mn_name: str) -> None:
    if physical:
        ck.tensor(sf, arg, [F32], (kb, align(mn, 4)),
                  f"[{k_text}, align({mn_name}, 4)] (MN-major physical, jax_dg.operands.scales.mn_major_physical)")
    else:
        ck.tensor(sf, arg, [F32], _grid(cdiv(mn, gran_mn), kb, transposed),
                  _grid_text(transposed, f"ceil({mn_name}/{gran_mn})", k_text))


def _fp8_shapes(storage: str, physical: bool = True):
    def shapes(a, sfa, b, sfb, c, *, out_dtype, recipe):
        ck = Checker(f"fp8_gemm_{storage}")
        ck.that(recipe in OUT_DTYPE, "recipe", f"must be one of {sorted(OUT_DTYPE)} on SM90", recipe)
        gm, gn, gk = recipe
        a_t, b_n = _transposed(storage)
        m, n, k = _check_operands(ck, a, b, storage, FP8)
        ck.that(k % 16 == 0, "a[0]", "must have K % 16 == 0 (16-byte rows for TMA)", k)
        phys_a, phys_b = _mn_major(storage, recipe) if physical else (False, False)
        _check_sf(ck, sfa, "a[1]", m, cdiv(k, gk), gm, a_t, phys_a, f"ceil(K/{gk})", "M")
        _check_sf(ck, sfb, "b[1]", n, cdiv(k, gk), gn, b_n, phys_b, f"ceil(K/{gk})", "N")
        ck.that(out_dtype == OUT_DTYPE[recipe], "out_dtype",
                f"must be {OUT_DTYPE[recipe]} with recipe {recipe}", out_dtype)
        align_n = 8 if out_dtype == "bfloat16" else 4
        ck.that(n % align_n == 0, "b[0]", f"must have N % {align_n} == 0 (16-byte rows of d)", n)
        ck.that(not a_t or m % 16 == 0, "a[0]", "stored [K, M] must have M % 16 == 0 (16-byte rows)", m)
        ck.that(not b_n or n % 16 == 0, "b[0]", "stored [K, N] must have N % 16 == 0 (16-byte rows)", n)
        ck.that(c is not None or recipe != RECIPE_CHANNEL, "c",
                f"is required with recipe {recipe} (d = c + a @ b.T)")
        if c is not None:
            ck.that(recipe == RECIPE_CHANNEL, "c", f"needs recipe {RECIPE_CHANNEL} (per-channel b "
                    "scales, float32 d); DeepGEMM's per-block kernel does not accumulate")
            ck.tensor(c, "c", [F32], (m, n), "[M, N]")
        return [jax.ShapeDtypeStruct((m, n), out_dtype)]
    return shapes


def _fp8_rule(storage: str):
    check = _fp8_shapes(storage)

    def rule(a, sfa, b, sfb, c, *, out_dtype, recipe):
        """d's type; the plan: which scales reach DeepGEMM as MN-major views of their physical
        buffer."""
        return shaped(check(a, sfa, b, sfb, c, out_dtype=out_dtype, recipe=recipe),
                      mn_major=_mn_major(storage, recipe))
    return rule


def _fp8_run(storage: str):
    name = f"fp8_gemm_{storage}"

    def run(rt, a, sfa, b, sfb, c, d, *, recipe, mn_major, compiled_dims):
        if mn_major[0]:
            sfa = rt.mn_major_view(sfa, a.shape[0])
        if mn_major[1]:
            sfb = rt.mn_major_view(sfb, b.shape[0])
        getattr(rt.dg, name)((a, sfa), (b, sfb), d, c=c, recipe=recipe, **rt.dims(compiled_dims))
    return run


def _fp8_reference(storage: str):
    a_t, b_n = _transposed(storage)

    def reference(a, sfa, b, sfb, c, *, out_dtype, recipe):
        phys_a, phys_b = _mn_major(storage, recipe)
        if phys_a:
            sfa = mn_major_logical(sfa, a.shape[0])
        if phys_b:
            sfb = mn_major_logical(sfb, b.shape[0])
        if a_t:
            a, sfa = a.T, sfa.T
        if b_n:
            b, sfb = b.T, sfb.T
        return ref.fp8_gemm_nt(a, sfa, b, sfb, c, out_dtype=out_dtype, recipe=recipe)
    return reference


def _masked_batch(op, a, sfa_logical, b, sfb, size: int, m: int):
    """Both operands batched: the masked grouped GEMM with G = batch, every group M rows of
    Mmax = align(M, 128); rows past M are sliced off (padding rows of a are 0)."""
    mmax = align(m, contracts.MASKED_BLOCK_M)
    pad = ((0, 0), (0, mmax - m), (0, 0))
    args = [jnp.pad(a, pad)]
    if sfa_logical is not None:
        args.append(mn_major_physical(jnp.pad(sfa_logical, pad, constant_values=1.0)))
    args += [b] + ([sfb] if sfb is not None else [])
    masked_m = jnp.full((size,), m, jnp.int32)
    (d,) = op(*args, masked_m, expected_m=max(m, 1), clean=False)   # rows past m: sliced off
    return (d[:, :m],)


def _fp8_batch(storage: str):
    """vmap of fp8_gemm_nt: a batched `a` with a shared `b` folds into M (one GEMM of B*M rows);
    both batched (per-block recipe) run as one masked grouped GEMM; otherwise sequential."""
    def batch(size, batched, inputs, *, out_dtype, recipe, compiled_dims):
        if storage != "nt":
            return None
        a, sfa, b, sfb, c = (inputs[n] if n in inputs else None for n in ("a", "sfa", "b", "sfb", "c"))
        m = a.shape[1] if batched["a"] else a.shape[0]
        sfa_l = mn_major_logical(bcast(sfa, batched["sfa"], size), m)
        if not batched["b"] and not batched["sfb"] and (batched["a"] or batched["sfa"]):
            a = bcast(a, batched["a"], size)
            c = bcast(c, batched.get("c", False), size)
            (d,) = FP8_GEMM["nt"](fold_rows(a), mn_major_physical(fold_rows(sfa_l)), b, sfb,
                                  None if c is None else fold_rows(c), out_dtype=out_dtype, recipe=recipe,
                                  compiled_dims=compiled_dims)
            return (d.reshape(size, m, -1),)
        if recipe == RECIPE_BLOCK and c is None:
            return _masked_batch(M_GROUPED_FP8_MASKED, bcast(a, batched["a"], size), sfa_l,
                                 bcast(b, batched["b"], size), bcast(sfb, batched["sfb"], size), size, m)
        return None
    return batch


# Sharding: rows (M) and columns (N) split with no collective; a sharded K gives partial
# products and one psum (not with the accumulator c). Scale blocks follow what they scale.
_GEMM_TIES = {"ma": ("m", "aligned", 4), "na": ("n", "aligned", 4), "kb": ("k", "blocks", 128),
              "nb": ("n", "blocks", 128)}


def _fp8_layout(names, *, recipe):
    sfb = "nb kb" if recipe == RECIPE_BLOCK else "kb na"   # per-channel b's scales: MN-major physical
    return Layout({"a": "m k", "sfa": "kb ma", "b": "n k", "sfb": sfb, "c": "m n"}, ["m n"])


FP8_SHARDING = Sharding(_fp8_layout, free=frozenset({"m", "n"}), reduce=frozenset({"k"}),
                        tied=_GEMM_TIES, forbid={"k": frozenset({"c"})})


FP8_GEMM = {
    storage: Op(
        name=f"fp8_gemm_{storage}",
        args=("a", "sfa", "b", "sfb", "c"),
        statics={"out_dtype": REQUIRED, "recipe": REQUIRED, "compiled_dims": None},
        shapes=_fp8_rule(storage),
        run=_fp8_run(storage),
        reference=_fp8_reference(storage),
        symbols=(f"fp8_gemm_{storage}",),
        aliases={"c": 0},
        # SM90 reads FP8 operands K-major only (see above)
        archs=contracts.DEEP_GEMM_ARCHS if storage == "nt" else frozenset({"sm100"}),
        # SM90 with MN-major scales allocates nothing (SM100 re-packs fp32 scales into UE8M0)
        graph_safe=frozenset({"sm90"}) if storage == "nt" else frozenset(),
        batch=_fp8_batch(storage),
        sharding=FP8_SHARDING if storage == "nt" else None,
    )
    for storage in STORAGES
}


def _fp8_public(storage: str, doc: str):
    a_t, b_n = _transposed(storage)
    name = f"fp8_gemm_{storage}"

    @exposes(FP8_GEMM[storage])
    def fn(a, b, *, c=None, out_dtype=None, recipe=None, compiled_dims=None) -> jax.Array:
        ck = Checker(name)
        av, sfa = ck.pair(a, "a")
        bv, sfb = ck.pair(b, "b")
        view_a, view_b = logical_view(sfa), logical_view(sfb)   # an MNMajor as its logical scales
        ck.ndim(bv, "b[0]", 2, _grid_text(b_n, "N", "K"))
        ck.ndim(view_b, "b[1]", 2, "scales")
        n = bv.shape[1] if b_n else bv.shape[0]
        inferred = recipe is None
        if inferred:
            recipe = infer_recipe(n, view_b.shape[::-1] if b_n else view_b.shape)
        recipe = ck.recipe(recipe)
        out_dtype = OUT_DTYPE.get(recipe, "bfloat16") if out_dtype is None else ck.dtype_name(out_dtype, "out_dtype")
        # per-token scales given for b (a common slip) are read as per-channel: say so
        ck.that(not inferred or recipe != RECIPE_CHANNEL or c is not None, "c",
                f"is required with recipe {RECIPE_CHANNEL} (d = c + a @ b.T, float32), which b's "
                f"scales select: b[1] {tuple(view_b.shape)} holds one scale per row of b "
                f"({_grid_text(b_n, 'N', 'ceil(K/128)')}, per channel, as per_token_cast_to_fp8 "
                f"makes). Pass c, or quantise b per 128 x 128 block with per_block_cast_to_fp8 "
                f"(scales {_grid_text(b_n, 'ceil(N/128)', 'ceil(K/128)')}) for the bfloat16 GEMM")
        phys_a, phys_b = _mn_major(storage, recipe)
        for sf, phys, arg in ((sfa, phys_a, "a[1]"), (sfb, phys_b, "b[1]")):
            ck.that(not isinstance(sf, MNMajor) or phys, arg, "is MN-major (MNMajor), which only "
                    "fp8_gemm_nt's per-token a and per-channel b scales take")
        if phys_a or phys_b:   # check what the caller gave, then hand the kernel its layout
            _fp8_shapes(storage, physical=False)(av, view_a, bv, view_b, c, out_dtype=out_dtype,
                                                 recipe=recipe)
            sfa = mn_major_physical(sfa) if phys_a else sfa
            sfb = mn_major_physical(sfb) if phys_b else sfb
        (d,) = FP8_GEMM[storage](av, sfa, bv, sfb, c, out_dtype=out_dtype, recipe=recipe,
                                 compiled_dims=ck.compiled_dims(compiled_dims))
        return d
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


fp8_gemm_nt = _fp8_public("nt", """d = a @ b.T (+ c) on FP8 operands with DeepSeek's block scaling (DeepGEMM fp8_gemm_nt).

    a: (values float8_e4m3fn [M, K], scales float32 [M, ceil(K/128)])      per token (1 x 128)
    b: (values float8_e4m3fn [N, K], scales float32 [ceil(N/128), ceil(K/128)])  per block
       or scales float32 [N, ceil(K/128)]: per channel, recipe (1, 1, 128)
       Per-token a and per-channel b scales may come already MN-major (an MNMajor, e.g. from
       jax_dg.cast_tokens): handed to DeepGEMM as they are, with no layout pass in the call.
    c: float32 [M, N] accumulator, required by (and only by) the per-channel recipe; XLA may
       donate its buffer to d.
    out_dtype: bfloat16 for the per-block recipe, float32 for the per-channel one (the default
       follows the recipe; other choices are rejected, as DeepGEMM's SM90 kernels do).
    recipe: (gran_m, gran_n, gran_k); inferred from b's scale shape when None.
    compiled_dims: static, the dims DeepGEMM compiles into the kernel (distinct letters of
       'mnk'; DeepGEMM's default 'nk' for nt/nn, 'mn' for tn/tt): speed only, never results.
    Returns d [M, N]. K must be a multiple of 16, N of 8 (bfloat16 d) or 4 (float32 d).
    """)
fp8_gemm_nn = _fp8_public("nn", """d = a @ b (+ c): fp8_gemm_nt with b stored [K, N] (DeepGEMM fp8_gemm_nn).

    a: (values [M, K], scales [M, ceil(K/128)]); b: (values [K, N], scales [ceil(K/128),
    ceil(N/128)] per block, or [ceil(K/128), N] per channel with recipe (1, 1, 128) and c).
    DeepGEMM runs it on SM100; SM90's FP8 kernels read b K-major only, so there the call raises
    (use fp8_gemm_nt(a, (b.T, scales.T)), or JAX_DG_BACKEND=torch / xla). N % 16 == 0.
    """)
fp8_gemm_tn = _fp8_public("tn", """d = a.T @ b (+ c): a stored [K, M] (scales [ceil(K/128), M]), b stored [K, N] (scales
    [ceil(K/128), ceil(N/128)], or [ceil(K/128), N] per channel). DeepGEMM fp8_gemm_tn; SM100
    only (see fp8_gemm_nn). M % 16 == 0 and N % 16 == 0.""")
fp8_gemm_tt = _fp8_public("tt", """d = a.T @ b.T (+ c): a stored [K, M] (scales [ceil(K/128), M]), b stored [N, K] (scales
    as in fp8_gemm_nt). DeepGEMM fp8_gemm_tt; SM100 only (see fp8_gemm_nn). M % 16 == 0.""")


# --- FP8 nt into the left/right slices of each head (DeepGEMM fp8_gemm_nt_skip_head_mid) -------

def _head_splits(ck: Checker, head_splits) -> tuple[int, int, int]:
    ok = (isinstance(head_splits, (tuple, list)) and len(head_splits) == 3
          and all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                  for v in head_splits))
    ck.that(ok and head_splits[0] >= 0 and head_splits[1] >= 0 and head_splits[2] >= 0
            and head_splits[0] + head_splits[2] > 0, "head_splits",
            "must be a static (left, mid, right) of ints >= 0 with left + right > 0", repr(head_splits))
    return tuple(int(v) for v in head_splits)


def _skip_head_mid_shapes(a, sfa, b, sfb, d, *, head_splits, recipe):
    ck = Checker("fp8_gemm_nt_skip_head_mid")
    m, n = _fp8_shapes("nt")(a, sfa, b, sfb, None, out_dtype="bfloat16", recipe=recipe)[0].shape
    left, mid, right = head_splits
    ck.that(n % (left + right) == 0, "head_splits",
            f"must have left + right = {left + right} dividing b's N = {n}", head_splits)
    width = n + n // (left + right) * mid
    ck.tensor(d, "d", [BF16], (m, width), f"[M, N + N / (left + right) * mid] = [{m}, {width}]")
    return [jax.ShapeDtypeStruct((m, width), BF16)]


def _skip_head_mid_run(rt, a, sfa, b, sfb, d_in, d, *, head_splits, recipe, compiled_dims):
    # d is d_in's buffer (aliased): the kernel writes around the heads' middle columns
    rt.dg.fp8_gemm_nt_skip_head_mid((a, rt.mn_major_view(sfa, a.shape[0])), (b, sfb), d, head_splits,
                                    recipe=recipe, **rt.dims(compiled_dims))


FP8_GEMM_NT_SKIP_HEAD_MID = Op(
    name="fp8_gemm_nt_skip_head_mid",
    args=("a", "sfa", "b", "sfb", "d"),
    statics={"head_splits": REQUIRED, "recipe": REQUIRED, "compiled_dims": None},
    shapes=_skip_head_mid_shapes,
    run=_skip_head_mid_run,
    reference=lambda a, sfa, b, sfb, d, *, head_splits, recipe: ref.fp8_gemm_nt_skip_head_mid(
        a, mn_major_logical(sfa, a.shape[0]), b, sfb, d, head_splits=head_splits, recipe=recipe),
    symbols=("fp8_gemm_nt_skip_head_mid",),
    aliases={"d": 0},
    # not graph_safe: whether the call allocates was not measured on the H200 (fp8_gemm_nt's
    # path with the same scale layout allocates nothing)
)


@exposes(FP8_GEMM_NT_SKIP_HEAD_MID)
def fp8_gemm_nt_skip_head_mid(a, b, head_splits, *, d=None, compiled_dims=None) -> jax.Array:
    """fp8_gemm_nt written into the left and right slices of each head of a wider d (DeepGEMM
    fp8_gemm_nt_skip_head_mid): the N output columns are heads of left + right columns; head h
    lands in d[:, h*w : h*w + left] and d[:, h*w + left + mid : (h+1)*w], w = left + mid + right.

    a: (values float8_e4m3fn [M, K], scales float32 [M, ceil(K/128)])      per token
    b: (values float8_e4m3fn [N, K], scales float32 [ceil(N/128), ceil(K/128)])  per block
    head_splits: static (left, mid, right); (left + right) divides N. DeepGEMM compiles the
       splits into its epilogue, which needs each a multiple of its store block (DeepGEMM's
       own case, (128, 64, 128), is the one tested on a GPU); others fail there when compiled.
    d: bfloat16 [M, N + N / (left + right) * mid] whose middle columns are kept (XLA may donate
       its buffer); None: zeros there.
    compiled_dims: as for fp8_gemm_nt.
    Returns d bfloat16 [M, N + N / (left + right) * mid], fully defined.
    DeepGEMM 2.8 has no such kernel: there fp8_gemm_nt writes [M, N] and XLA writes its columns
    around each head's middle (one pass over d, in place where d is donated).
    """
    ck = Checker("fp8_gemm_nt_skip_head_mid")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    splits = _head_splits(ck, head_splits)
    _fp8_shapes("nt", physical=False)(av, sfa, bv, sfb, None, out_dtype="bfloat16", recipe=RECIPE_BLOCK)
    m, n = av.shape[0], bv.shape[0]
    if d is None:
        ck.that(n % (splits[0] + splits[2]) == 0, "head_splits",
                f"must have left + right = {splits[0] + splits[2]} dividing b's N = {n}", head_splits)
        d = jnp.zeros((m, n + n // (splits[0] + splits[2]) * splits[1]), BF16)
    if device.target().api.lacks("fp8_gemm_nt_skip_head_mid"):
        return _around_heads_mid(fp8_gemm_nt(a, b, compiled_dims=compiled_dims), d, splits)
    (out,) = FP8_GEMM_NT_SKIP_HEAD_MID(av, mn_major_physical(sfa), bv, sfb, d, head_splits=splits,
                                       recipe=RECIPE_BLOCK, compiled_dims=ck.compiled_dims(compiled_dims))
    return out


def _around_heads_mid(y, d, splits):
    """d with y's [M, N] columns written around each head's middle (heads of left + right)."""
    left, mid, right = splits
    ck = Checker("fp8_gemm_nt_skip_head_mid")
    m, n = y.shape
    heads = n // (left + right)
    ck.tensor(d, "d", [BF16], (m, n + heads * mid), f"[M, N + N / (left + right) * mid] = "
              f"[{m}, {n + heads * mid}]")
    y, dh = y.reshape(m, heads, left + right), d.reshape(m, heads, left + mid + right)
    dh = dh.at[:, :, :left].set(y[..., :left]).at[:, :, left + mid:].set(y[..., left:])
    return dh.reshape(d.shape)


# --- BF16: DeepGEMM's kernels and cuBLASLt, in all four storages ------------------------------
# DeepGEMM's SM90 BF16 kernel reads either operand K- or MN-major, so all four storages run.

def _bf16_shapes(name: str, storage: str, deep_gemm_kernel: bool):
    a_t, b_n = _transposed(storage)

    def shapes(a, b, c, *, out_dtype):
        ck = Checker(name)
        m, n, k = _check_operands(ck, a, b, storage, BF16)
        ck.that(out_dtype in ("bfloat16", "float32"), "out_dtype", "must be bfloat16 or float32",
                out_dtype)
        if deep_gemm_kernel:
            # TMA: 16-byte rows everywhere; K % 64 is DeepGEMM's SM90 BF16 contract.
            ck.that(k % 64 == 0, "a", "must have K % 64 == 0 (DeepGEMM's SM90 BF16 kernels)", k)
            align_n = 8 if out_dtype == "bfloat16" or b_n else 4
            ck.that(n % align_n == 0, "b", f"must have N % {align_n} == 0 (16-byte rows)", n)
            ck.that(not a_t or m % 8 == 0, "a", "stored [K, M] must have M % 8 == 0 (16-byte rows)", m)
        if c is not None:
            ck.tensor(c, "c", [out_dtype], (m, n), "[M, N] of out_dtype")
        return [jax.ShapeDtypeStruct((m, n), out_dtype)]
    return shapes


def _bf16_run(name: str):
    def run(rt, a, b, c, d, *, compiled_dims):   # cuBLASLt's: always None
        getattr(rt.dg, name)(a, b, d, c=c, **rt.dims(compiled_dims))
    return run


def _bf16_reference(storage: str):
    a_t, b_n = _transposed(storage)

    def reference(a, b, c, *, out_dtype):
        return ref.bf16_gemm_nt(a.T if a_t else a, b.T if b_n else b, c, out_dtype=out_dtype)
    return reference


def _product(family: str, x, x_t: bool, y, y_n: bool, out_dtype: str):
    """X @ Y for X stored as x ([P, R], or [R, P] when x_t) and Y as y ([R, Q] when y_n, else
    [Q, R]), on `family`'s kernel in the matching storage; cuBLASLt where DeepGEMM's BF16
    kernel cannot take the shape (its K % 64 / 16-byte row rules)."""
    storage = ("t" if x_t else "n") + ("n" if y_n else "t")
    ops = BF16_GEMM if family == "bf16_gemm" else CUBLASLT_GEMM
    try:
        ops[storage].shapes(x, y, None, out_dtype=out_dtype)
    except ArgumentError:
        ops = CUBLASLT_GEMM
    return ops[storage](x, y, None, out_dtype=out_dtype)[0]


def _bf16_vjp(family: str, storage: str):
    """d = A @ B (+ c), A = op(a), B = op(b): dA = dD @ B^T, dB = A^T @ dD, dc = dD, each
    computed in the storage a and b have (the other storages' kernels; bf16 operands)."""
    a_t, b_n = _transposed(storage)

    def vjp(inputs, cts):   # each product: its storage's default compiled_dims
        a, b, c = inputs["a"], inputs["b"], inputs.get("c")
        (dd,) = cts
        g = dd.astype(BF16)
        if a_t:   # a stored [K, M]: its cotangent is B @ dD^T
            da = _product(family, b, not b_n, g, False, "float32")
        else:     # dD @ B^T
            da = _product(family, g, False, b, not b_n, "float32")
        if b_n:   # b stored [K, N]: A^T @ dD
            db = _product(family, a, not a_t, g, True, "float32")
        else:     # b stored [N, K]: dD^T @ A
            db = _product(family, g, True, a, not a_t, "float32")
        grads = {"a": da, "b": db}
        if c is not None:
            grads["c"] = dd
        return grads
    return vjp


def _bf16_batch(family: str, storage: str):
    """vmap of a BF16 GEMM: a batched `a` stored [M, K] with a shared `b` folds into M; both
    batched (nt, DeepGEMM's kernel, no c, bf16 d) run as one masked grouped GEMM; otherwise
    sequential."""
    a_t, _ = _transposed(storage)

    def batch(size, batched, inputs, *, out_dtype, compiled_dims):
        a, b, c = inputs["a"], inputs["b"], inputs.get("c")
        if not batched["b"] and not a_t:
            m = a.shape[1] if batched["a"] else a.shape[0]
            a, c = bcast(a, batched["a"], size), bcast(c, batched.get("c", False), size)
            ops = BF16_GEMM if family == "bf16_gemm" else CUBLASLT_GEMM
            (d,) = ops[storage](fold_rows(a), b, None if c is None else fold_rows(c), out_dtype=out_dtype,
                                compiled_dims=compiled_dims)
            return (d.reshape(size, m, -1),)
        if (storage == "nt" and family == "bf16_gemm" and c is None and out_dtype == "bfloat16"
                and a.shape[-1] % 64 == 0):
            a, b = bcast(a, batched["a"], size), bcast(b, batched["b"], size)
            return _masked_batch(M_GROUPED_BF16_MASKED, a, None, b, None, size, a.shape[1])
        return None
    return batch


def _bf16_sharding(storage: str) -> Sharding:
    a_t, b_n = _transposed(storage)
    layout = Layout({"a": "k m" if a_t else "m k", "b": "k n" if b_n else "n k", "c": "m n"}, ["m n"])
    return Sharding(lambda names, **static: layout, free=frozenset({"m", "n"}), reduce=frozenset({"k"}),
                    forbid={"k": frozenset({"c"})})


def _bf16_op(family: str, storage: str) -> Op:
    name = f"{family}_{storage}"
    return Op(name=name, args=("a", "b", "c"), statics={"out_dtype": REQUIRED, "compiled_dims": None},
              shapes=_bf16_shapes(name, storage, family == "bf16_gemm"),
              run=_bf16_run(name), reference=_bf16_reference(storage), symbols=(name,),
              aliases={"c": 0},
              # no scales, no scratch (cuBLASLt's workspace is DeepGEMM's, made once at start-up)
              graph_safe=contracts.DEEP_GEMM_ARCHS,
              vjp=_bf16_vjp(family, storage),
              batch=_bf16_batch(family, storage),
              sharding=_bf16_sharding(storage))


BF16_GEMM = {storage: _bf16_op("bf16_gemm", storage) for storage in STORAGES}
CUBLASLT_GEMM = {storage: _bf16_op("cublaslt_gemm", storage) for storage in STORAGES}


def _bf16_gemm(ops, storage, a, b, c, out_dtype, compiled_dims=None):
    ck = Checker(ops[storage].name)
    if out_dtype is None:
        out_dtype = c.dtype if c is not None and hasattr(c, "dtype") else BF16
    (d,) = ops[storage](a, b, c, out_dtype=ck.dtype_name(out_dtype, "out_dtype"),
                        compiled_dims=ck.compiled_dims(compiled_dims))
    return d


_BF16_DOC = """d = {math} (+ c) on bfloat16 operands, float32 accumulation ({kernel}).

    a: bfloat16 {a}; b: bfloat16 {b}. out_dtype: bfloat16 (default) or float32; c: optional
    accumulator [M, N] of out_dtype (XLA may donate its buffer to d).{extra}
    """
_DG_EXTRA = """
    compiled_dims: static, the dims DeepGEMM compiles into the kernel (distinct letters of 'mnk';
    DeepGEMM's default 'nk' for nt/nn, 'mn' for tn/tt): speed only, never results.
    DeepGEMM's SM90 contract: K % 64 == 0, N % 8 == 0 (N % 4 for float32 d), and an operand
    stored MN-major ([K, M] / [K, N]) needs M % 8 / N % 8."""


def _bf16_public(family: str, storage: str):
    a_t, b_n = _transposed(storage)
    name = f"{family}_{storage}"
    ops = BF16_GEMM if family == "bf16_gemm" else CUBLASLT_GEMM

    if family == "bf16_gemm":
        @exposes(ops[storage])
        def fn(a, b, *, c=None, out_dtype=None, compiled_dims=None) -> jax.Array:
            return _bf16_gemm(ops, storage, a, b, c, out_dtype, compiled_dims)
    else:   # cuBLASLt takes no compiled_dims
        @exposes(ops[storage])
        def fn(a, b, *, c=None, out_dtype=None) -> jax.Array:
            return _bf16_gemm(ops, storage, a, b, c, out_dtype)
    fn.__name__ = fn.__qualname__ = name
    math = f"{'a.T' if a_t else 'a'} @ {'b' if b_n else 'b.T'}"
    fn.__doc__ = _BF16_DOC.format(
        math=math, kernel=f"DeepGEMM {name}" if family == "bf16_gemm" else f"cuBLASLt through DeepGEMM's {name}",
        a=_grid_text(a_t, "M", "K"), b=_grid_text(b_n, "N", "K"),
        extra=_DG_EXTRA if family == "bf16_gemm" else "")
    return fn


bf16_gemm_nt = _bf16_public("bf16_gemm", "nt")
bf16_gemm_nn = _bf16_public("bf16_gemm", "nn")
bf16_gemm_tn = _bf16_public("bf16_gemm", "tn")
bf16_gemm_tt = _bf16_public("bf16_gemm", "tt")
cublaslt_gemm_nt = _bf16_public("cublaslt_gemm", "nt")
cublaslt_gemm_nn = _bf16_public("cublaslt_gemm", "nn")
cublaslt_gemm_tn = _bf16_public("cublaslt_gemm", "tn")
cublaslt_gemm_tt = _bf16_public("cublaslt_gemm", "tt")
