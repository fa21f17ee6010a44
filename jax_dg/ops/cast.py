"""DeepGEMM's FP8 casts fused for training: one pass over the input writes what the GEMMs read.

    cast_tokens(x, transposed=...)   per token (1 x 128 along K): values, and the scales already
                                     MN-major and TMA-aligned (the physical buffer DeepGEMM's
                                     SM90 kernels read); with `transposed`, from the same read,
                                     the per-token cast of x.T (the wgrad's operand) too
    cast_blocks(x, transposed=...)   per 128 x 128 block: values and scales, and with
                                     `transposed` the values of x.T (the dgrad's w.T)

jax_dg's own kernel (kernels/cast_fp8.cu, a native custom call, capturable; its C++ twin on
CPU), bitwise DeepGEMM's quantisers (jax_dg.numerics' formulas) followed by the scales' MN-major
layout and the transposes: the pure-JAX reference below (jax_dg.reference.quant's quantisers),
which is `JAX_DG_BACKEND=xla`'s path and the tests' oracle. The public quantisers below
(per_token_cast_to_fp8, per_block_cast_to_fp8) run this kernel where it applies, and
jax_dg.operands.quant's formulas in XLA otherwise. Rows at or past `valid_rows[b]` are read as
0 (the masked experts' rows, without a select pass before the cast).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.contracts import align, cdiv
from jax_dg.core import native
from jax_dg.core.checks import Checker
from jax_dg.core.op import REQUIRED, Op, bcast, exposes, fold_rows
from jax_dg.core.sharding import Layout, Sharding
from jax_dg.operands import quant
from jax_dg.operands.scales import MNMajor, mn_major_physical
from jax_dg.reference import quant as ref

__all__ = ["cast_blocks", "cast_tokens", "per_block_cast_to_fp8", "per_token_cast_to_fp8"]

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
I32 = jnp.int32


def _shapes(x, valid_rows, *, per_block, rows_out, cols_out):
    ck = Checker("cast_fp8")
    ck.ndim(x, "x", 3, "[B, R, C]")
    ck.dtype(x, "x", jnp.bfloat16, F32)
    b, r, c = x.shape
    ck.that(c % 16 == 0, "x", "must have C % 16 == 0 (16-byte rows of FP8 values)", c)
    if valid_rows is not None:
        ck.tensor(valid_rows, "valid_rows", [I32], (b,), "[B]")
    rt = align(r, 16)
    sq = (b, cdiv(r, 128), cdiv(c, 128)) if per_block else (b, cdiv(c, 128), align(r, 4))
    sqt = (b, cdiv(c, 128), cdiv(r, 128)) if per_block else (b, cdiv(rt, 128), align(c, 4))
    none = lambda dtype: jax.ShapeDtypeStruct((0,), dtype)   # noqa: E731
    return [jax.ShapeDtypeStruct((b, r, c), FP8) if rows_out else none(FP8),
            jax.ShapeDtypeStruct(sq, F32) if rows_out else none(F32),
            jax.ShapeDtypeStruct((b, c, rt), FP8) if cols_out else none(FP8),
            jax.ShapeDtypeStruct(sqt, F32) if cols_out else none(F32)]


def _native(x, valid_rows, *, types, per_block, ue8m0, rows_out, cols_out):
    return native.cast_fp8(x, valid_rows, types, per_block=per_block, ue8m0=ue8m0,
                           rows_out=rows_out, cols_out=cols_out)


def _reference_one(x, valid, *, per_block, ue8m0, rows_out, cols_out):
    r = x.shape[0]
    x = jnp.where(jnp.arange(r)[:, None] < valid, x, 0).astype(x.dtype)
    if per_block:
        q, sq = ref.per_block_cast_to_fp8(x, ue8m0)
        qt = jnp.pad(q, ((0, align(r, 16) - r), (0, 0))).T
        return q, sq, qt, sq.T
    xt = jnp.pad(x, ((0, align(r, 16) - r), (0, 0))).T       # zero rows: amax unchanged
    q, sq = ref.per_token_cast_to_fp8(x, ue8m0)
    qt, sqt = ref.per_token_cast_to_fp8(xt, ue8m0)
    return q, mn_major_physical(sq), qt, mn_major_physical(sqt)


def _reference(x, valid_rows, *, per_block, ue8m0, rows_out, cols_out):
    valid = jnp.full((x.shape[0],), x.shape[1], I32) if valid_rows is None else valid_rows
    outs = jax.vmap(lambda xb, vb: _reference_one(xb, vb, per_block=per_block, ue8m0=ue8m0,
                                                  rows_out=rows_out, cols_out=cols_out))(x, valid)
    empty = lambda dtype: jnp.zeros((0,), dtype)   # noqa: E731
    return (outs[0] if rows_out else empty(FP8), outs[1] if rows_out else empty(F32),
            outs[2] if cols_out else empty(FP8), outs[3] if cols_out else empty(F32))


def _batch(size, batched, inputs, *, per_block, ue8m0, rows_out, cols_out):
    """vmap: the mapped axis folds into the kernel's batch (one launch)."""
    x = fold_rows(bcast(inputs["x"], batched["x"], size))
    v = inputs.get("valid_rows")
    v = None if v is None else bcast(v, batched["valid_rows"], size).reshape(-1)
    outs = _call(x, v, per_block=per_block, ue8m0=ue8m0, rows_out=rows_out, cols_out=cols_out)
    return tuple(jnp.zeros((size, 0), o.dtype) if o.ndim == 1 else o.reshape(size, -1, *o.shape[1:])
                 for o in outs)


def _layout(names, *, per_block, rows_out, cols_out, aligned):
    """Batches and rows split with no collective, columns in whole 128-blocks; a shard casts
    whole blocks (rows in 128s where a block or the transposed cast spans rows, else in 16s),
    so its results are the slices of the whole's. `aligned` (R % 16 == 0, which sharding the
    rows needs) names the MN-major scales' padded dimensions by the rows' factor, so Shardy
    carries the rows' sharding onto them; the 128-block dimensions of the scales stay factors
    of their own (small: Shardy may gather them)."""
    m_pad = "m" if aligned else "ma"
    sq = "b mb kb" if per_block else f"b kb {m_pad}"
    sqt = "b kb mb" if per_block else "b mb k"
    outs = ["b m k" if rows_out else "e0", sq if rows_out else "e1",
            f"b k {'m' if aligned else 'mt'}" if cols_out else "e2", sqt if cols_out else "e3"]
    return Layout({"x": "b m k", "valid_rows": "b"}, outs,
                  multiple={"m": 128 if per_block or cols_out else 16, "k": 128})


CAST_FP8 = Op(
    name="cast_fp8",
    args=("x", "valid_rows"),
    statics={"per_block": REQUIRED, "ue8m0": False, "rows_out": True, "cols_out": False,
             "aligned": False},
    shapes=_shapes,
    native=_native,
    reference=_reference,
    own_kernels=("cast_fp8",),
    batch=_batch,
    sharding=Sharding(_layout, free=frozenset({"b", "m", "k"}),
                      tied={"kb": ("k", "blocks", 128), "mb": ("m", "blocks", 128),
                            "ma": ("m", "aligned", 4), "mt": ("m", "aligned", 16)}),
)


def _check(name: str, x, ue8m0) -> tuple[Checker, bool]:
    ck = Checker(name)
    ck.array(x, "x")
    ck.dtype(x, "x", jnp.bfloat16, F32)
    ck.that(x.ndim in (2, 3), "x", "must be [R, C] or [B, R, C]", tuple(x.shape))
    return ck, ck.static_bool(ue8m0, "use_ue8m0")


def _call(x, valid_rows, **static):
    """x [R, C] or [B, R, C] through the op (as [B, R, C]); results with x's leading shape."""
    lead = x.ndim == 2
    outs = CAST_FP8(x[None] if lead else x, valid_rows, aligned=x.shape[-2] % 16 == 0, **static)
    return tuple(o[0] if lead and o.ndim > 1 else o for o in outs)


@exposes(CAST_FP8)
def cast_tokens(x: jax.Array, *, transposed: bool = False, use_ue8m0: bool = False,
                valid_rows: jax.Array | None = None, rows: bool = True):
    """Per-token FP8 cast (1 x 128 blocks along C) of x bfloat16 / float32 [(B,) R, C], C % 16 == 0.

    Returns ((q, sq), (qt, sqt)) (absent parts None), the scales as MNMajor (already in the
    layout DeepGEMM's SM90 kernels read; fp8_gemm_nt and the m-grouped FP8 GEMMs take them as
    they are, with no layout pass):
      q [(B,) R, C] float8_e4m3fn; sq.physical float32 [(B,) ceil(C/128), align(R, 4)], logical
        [(B,) R, ceil(C/128)] = per_token_cast_to_fp8's scales;
      with `transposed`: the per-token cast of x.T with rows padded to Rt = align(R, 16) by
        zeros, qt [(B,) C, Rt] and sqt.physical [(B,) ceil(Rt/128), align(C, 4)] (logical
        [(B,) C, ceil(Rt/128)]).
    rows=False leaves (q, sq) out. valid_rows: int32 [B] (3-D x): rows >= valid_rows[b] are
    read as 0 (clamped to [0, R]).
    """
    ck, ue8m0 = _check("cast_tokens", x, use_ue8m0)
    rows_out, cols_out = ck.static_bool(rows, "rows"), ck.static_bool(transposed, "transposed")
    ck.that(rows_out or cols_out, "rows", "and transposed cannot both be False (nothing to write)")
    q, sq, qt, sqt = _call(x, valid_rows, per_block=False, ue8m0=ue8m0, rows_out=rows_out,
                           cols_out=cols_out)
    r, c = x.shape[-2:]
    return ((q, MNMajor(sq, r)) if rows_out else None,
            (qt, MNMajor(sqt, c)) if cols_out else None)


@exposes(CAST_FP8)
def cast_blocks(x: jax.Array, *, transposed: bool = False, use_ue8m0: bool = False):
    """Per-block FP8 cast (128 x 128) of x bfloat16 / float32 [(B,) R, C], C % 16 == 0 (and
    R % 16 == 0 with `transposed`).

    Returns ((q, sq), (qt, sqt)): q [(B,) R, C], sq float32 [(B,) ceil(R/128), ceil(C/128)]
    (per_block_cast_to_fp8's), and with `transposed` (else None) the
    blocks of x.T, qt = q.T [(B,) C, R] and sqt = sq.T (a block grid is transpose-symmetric:
    the same values, written from the same read).
    """
    ck, ue8m0 = _check("cast_blocks", x, use_ue8m0)
    cols_out = ck.static_bool(transposed, "transposed")
    ck.that(not cols_out or x.shape[-2] % 16 == 0, "x", "must have R % 16 == 0 with transposed "
            "(16-byte rows of x.T's values)", x.shape[-2])
    q, sq, qt, sqt = _call(x, None, per_block=True, ue8m0=ue8m0, rows_out=True, cols_out=cols_out)
    return (q, sq), (qt, sqt) if cols_out else None


# --- the quantisers: the fused cast where it takes the input, the formulas in XLA otherwise --------

def _fused(x, gran_k: int) -> bool:
    """Whether the fused cast (one kernel, also under jax.vmap) takes x: float32 or bfloat16,
    128-wide blocks. It is bitwise jax_dg.operands.quant's formulas; other dtypes and block
    widths run those in XLA."""
    return gran_k == 128 and x.dtype in (jnp.float32, jnp.bfloat16)


def _padded(x):
    """x with zero columns up to a multiple of 16 (the kernel's 16-byte rows): a block's amax
    and so its scale are unchanged, and the values of the padding are sliced off."""
    n = x.shape[1]
    return x if n % 16 == 0 else jnp.pad(x, ((0, 0), (0, align(n, 16) - n)))


def per_token_cast_to_fp8(x: jax.Array, use_ue8m0: bool = False, gran_k: int = 128):
    """[m, n] -> (float8 values [m, n], float32 scales [m, ceil(n / gran_k)]), 1 x gran_k blocks."""
    use_ue8m0, gran_k = quant.check_cast("per_token_cast_to_fp8", x, use_ue8m0, gran_k)
    if _fused(x, gran_k):
        q, sf = cast_tokens(_padded(x), use_ue8m0=use_ue8m0)[0]
        return q[:, :x.shape[1]], sf.logical()
    return quant.per_token(x, use_ue8m0, gran_k)


def per_block_cast_to_fp8(x: jax.Array, use_ue8m0: bool = False, gran_k: int = 128):
    """[m, n] -> (float8 values [m, n], float32 scales [ceil(m/128), ceil(n/128)]), 128 x 128 blocks."""
    use_ue8m0, gran_k = quant.check_cast("per_block_cast_to_fp8", x, use_ue8m0, gran_k)
    if _fused(x, gran_k):
        q, sf = cast_blocks(_padded(x), use_ue8m0=use_ue8m0)[0]
        return q[:, :x.shape[1]], sf
    return quant.per_block(x, use_ue8m0, gran_k)
