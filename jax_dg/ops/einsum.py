"""DeepGEMM's einsum kernels: BF16 ('bmk,bnk->mn', 'bhr,hdr->bhd', 'bhd,hdr->bhr') and FP8
('bhr,hdr->bhd', the one FP8 expression DeepGEMM runs on SM90)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.contracts import cdiv
from jax_dg.core.checks import Checker
from jax_dg.core.op import REQUIRED, Op, exposes
from jax_dg.reference import einsum as ref

__all__ = ["einsum", "fp8_einsum"]

FP8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16
F32 = jnp.float32
INT_MAX = 2 ** 31 - 1

# expression -> (a's dims, b's dims, d's dims, contracted dim)
EXPRS = {
    "bmk,bnk->mn": ("SMK", "SNK", "MN", "K"),
    "bhr,hdr->bhd": ("BHR", "HDR", "BHD", "R"),
    "bhd,hdr->bhr": ("BHD", "HDR", "BHR", "D"),
}


def _dims(ck: Checker, expr: str, a, b) -> dict[str, int]:
    """Binds each letter of the expression to its size, checking that a and b agree."""
    a_dims, b_dims = EXPRS[expr][:2]
    size = dict(zip(a_dims, a.shape))
    for letter, n in zip(b_dims, b.shape):
        ck.that(size.setdefault(letter, n) == n, "b",
                f"must be [{', '.join(b_dims)}] with a's {letter} = {size[letter]}", tuple(b.shape))
    return size


def _einsum_shapes(a, b, c, *, expr, out_dtype, use_cublaslt):
    ck = Checker("einsum")
    ck.that(expr in EXPRS, "expr", f"must be one of {sorted(EXPRS)}", repr(expr))
    a_dims, b_dims, d_dims, contracted = EXPRS[expr]
    ck.ndim(a, "a", 3, f"[{', '.join(a_dims)}]")
    ck.ndim(b, "b", 3, f"[{', '.join(b_dims)}]")
    ck.dtype(a, "a", BF16)
    ck.dtype(b, "b", BF16)
    size = _dims(ck, expr, a, b)
    if expr == "bmk,bnk->mn":
        ck.that(not use_cublaslt, "use_cublaslt", f"is not available for {expr!r}")
        ck.that(out_dtype in ("float32", "bfloat16"), "out_dtype", "must be float32 or bfloat16",
                out_dtype)
        ck.that(c is None or out_dtype == "float32", "c", "needs out_dtype float32")
        for letter, arg in (("M", "a"), ("N", "b"), ("K", "a")):
            ck.that(size[letter] % 64 == 0, arg, f"must have {letter} % 64 == 0 (DeepGEMM's kernel)",
                    size[letter])
        ck.that(size["S"] * max(size["M"], size["N"]) <= INT_MAX, "a", "must have S * max(M, N) < 2**31")
    else:
        ck.that(out_dtype == "bfloat16", "out_dtype", f"must be bfloat16 for {expr!r}", out_dtype)
        ck.that(c is None, "c", f"is not supported with {expr!r} (DeepGEMM accumulates only for "
                "'bmk,bnk->mn')")
        for letter in ("R", "D"):  # 16-byte rows of a, b and d
            ck.that(size[letter] % 8 == 0, "b", f"must have {letter} % 8 == 0 (16-byte rows for TMA)",
                    size[letter])
        ck.that(use_cublaslt or size[contracted] % 64 == 0, "b",
                f"must have {contracted} % 64 == 0 (DeepGEMM's BF16 kernel; cuBLASLt has no such rule)",
                size[contracted])
    d_shape = tuple(size[x] for x in d_dims)
    if c is not None:
        ck.tensor(c, "c", [F32], d_shape, f"[{', '.join(d_dims)}]")
    return [jax.ShapeDtypeStruct(d_shape, out_dtype)]


def _einsum_run(rt, a, b, c, d, *, expr, out_dtype, use_cublaslt):
    if expr == "bmk,bnk->mn" and out_dtype == "float32":
        # DeepGEMM accumulates into a float32 d in place (c must be d): d = c (or 0) + sum.
        if c is None:
            d.zero_()
        elif c.data_ptr() != d.data_ptr():
            d.copy_(c)
        rt.dg.einsum(expr, a, b, d, c=d)
    elif use_cublaslt:
        rt.dg.einsum(expr, a, b, d, use_cublaslt=True)
    else:
        rt.dg.einsum(expr, a, b, d)


EINSUM = Op(
    name="einsum",
    args=("a", "b", "c"),
    statics={"expr": REQUIRED, "out_dtype": REQUIRED, "use_cublaslt": REQUIRED},
    shapes=_einsum_shapes,
    run=_einsum_run,
    reference=ref.einsum,
    symbols=("einsum",),
    aliases={"c": 0},
)


@exposes(EINSUM)
def einsum(expr: str, a, b, *, c=None, out_dtype=None, use_cublaslt: bool = False) -> jax.Array:
    """DeepGEMM's BF16 einsum, float32 accumulation.

    'bmk,bnk->mn': a [S, M, K], b [S, N, K] -> d [M, N] = sum_s a[s] @ b[s].T (+ c); out_dtype
       float32 (default; c float32 [M, N] optional, XLA may donate it) or bfloat16 (no c).
       M, N and K % 64 == 0.
    'bhr,hdr->bhd': a [B, H, R], b [H, D, R] -> d bfloat16 [B, H, D].
    'bhd,hdr->bhr': a [B, H, D], b [H, D, R] -> d bfloat16 [B, H, R].
       R % 8 == 0 and D % 8 == 0; the contracted dim % 64 == 0 unless use_cublaslt, which runs
       cuBLASLt instead of DeepGEMM's kernel.
    """
    if out_dtype is None:
        out_dtype = F32 if expr == "bmk,bnk->mn" else BF16
    ck = Checker("einsum")
    (d,) = EINSUM(a, b, c, expr=expr, out_dtype=ck.dtype_name(out_dtype, "out_dtype"),
                  use_cublaslt=ck.static_bool(use_cublaslt, "use_cublaslt"))
    return d


# --- FP8 -------------------------------------------------------------------------------------

def _fp8_einsum_shapes(a, sfa, b, sfb, *, expr):
    ck = Checker("fp8_einsum")
    ck.that(expr == "bhr,hdr->bhd", "expr", "must be 'bhr,hdr->bhd' (DeepGEMM runs its other FP8 "
            "expressions on SM100 only)", repr(expr))
    ck.ndim(a, "a[0]", 3, "[B, H, R]")
    ck.ndim(b, "b[0]", 3, "[H, D, R]")
    ck.dtype(a, "a[0]", FP8)
    ck.dtype(b, "b[0]", FP8)
    bb, h, r = a.shape
    _, d, _ = b.shape
    ck.that(tuple(b.shape[::2]) == (h, r), "b[0]", f"must be [H, D, R] with a's H = {h}, R = {r}",
            tuple(b.shape))
    ck.that(r % 16 == 0, "a[0]", "must have R % 16 == 0 (16-byte rows for TMA)", r)
    ck.that(d % 8 == 0, "b[0]", "must have D % 8 == 0 (16-byte rows of the bfloat16 d)", d)
    ck.tensor(sfa, "a[1]", [F32], (bb, h, cdiv(r, 128)), "[B, H, ceil(R/128)]")
    ck.tensor(sfb, "b[1]", [F32], (h, cdiv(d, 128), cdiv(r, 128)), "[H, ceil(D/128), ceil(R/128)]")
    return [jax.ShapeDtypeStruct((bb, h, d), BF16)]


def _fp8_einsum_run(rt, a, sfa, b, sfb, d, *, expr):
    rt.dg.fp8_einsum(expr, (a, sfa), (b, sfb), d)


FP8_EINSUM = Op(
    name="fp8_einsum",
    args=("a", "sfa", "b", "sfb"),
    statics={"expr": REQUIRED},
    shapes=_fp8_einsum_shapes,
    run=_fp8_einsum_run,
    reference=ref.fp8_einsum,
    symbols=("fp8_einsum",),
)


@exposes(FP8_EINSUM)
def fp8_einsum(expr: str, a, b) -> jax.Array:
    """DeepGEMM's fp8_einsum for 'bhr,hdr->bhd' (recipe (1, 128, 128)), float32 accumulation.

    a: (values float8_e4m3fn [B, H, R], scales float32 [B, H, ceil(R/128)])   per token
    b: (values float8_e4m3fn [H, D, R], scales float32 [H, ceil(D/128), ceil(R/128)])  per block
    Returns d bfloat16 [B, H, D]. R % 16 == 0, D % 8 == 0. No accumulator: DeepGEMM's SM90
    kernel would drop it.
    """
    ck = Checker("fp8_einsum")
    av, sfa = ck.pair(a, "a")
    bv, sfb = ck.pair(b, "b")
    (d,) = FP8_EINSUM(av, sfa, bv, sfb, expr=expr)
    return d
