"""einsum (BF16) and fp8_einsum: the bridge path against the pure-JAX reference, bad inputs, and
(GPU) DeepGEMM's test shapes and thresholds against deep_gemm called from torch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from tests.conftest import bits, digest, to_torch, run


def exact(expr, a, b):
    return np.einsum(expr, np.asarray(a, np.float32), np.asarray(b, np.float32))


def operands(keys, expr, sizes):
    dims = expr.replace("->", ",").split(",")
    return tuple(jax.random.normal(keys(), tuple(sizes[c] for c in d), jnp.bfloat16) for d in dims[:2])


@jax.jit
def fp8_cast(x, y):
    b, h, r = x.shape
    qx, sx = jax_dg.per_token_cast_to_fp8(x.reshape(-1, r), use_ue8m0=True)
    qy, sy = jax.vmap(lambda t: jax_dg.per_block_cast_to_fp8(t, use_ue8m0=True))(y)
    return (qx.reshape(b, h, r), sx.reshape(b, h, -1)), (qy, sy)


def fp8_operands(keys, b, h, r, d):
    """DeepGEMM's test_einsum FP8 data: x per token over [b*h, r], y per block per head, UE8M0."""
    x = jax.random.normal(keys(), (b, h, r), jnp.bfloat16)
    y = jax.random.normal(keys(), (h, d, r), jnp.bfloat16)
    return (x, y, *fp8_cast(x, y))


BMK = "bmk,bnk->mn"


@pytest.mark.parametrize("variant", ["float32", "float32+c", "bfloat16"])
def test_bmk_bnk_mn_matches_reference(keys, variant):
    a, b = operands(keys, BMK, dict(b=3, m=64, n=128, k=64))
    c = jax.random.normal(keys(), (64, 128), jnp.float32)
    kw = {"float32": {}, "float32+c": dict(c=c), "bfloat16": dict(out_dtype=jnp.bfloat16)}[variant]
    f = lambda a, b: jax_dg.einsum(BMK, a, b, **kw)  # noqa: E731
    before = digest(a, b, c)
    d = run("auto", f, a, b)
    assert digest(a, b, c) == before, "inputs were written"
    assert d.shape == (64, 128) and d.dtype == jnp.dtype(variant.split("+")[0])
    np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(run("xla", f, a, b), np.float32),
                               rtol=1e-5 if variant != "bfloat16" else 2 ** -7, atol=1e-3)
    expected = exact(BMK, a, b) + (np.asarray(c) if "c" in kw else 0)
    assert jax_dg.calc_diff(d, expected) < 1e-5


def test_bmk_bnk_mn_accumulator_is_donated(keys):
    a, b = operands(keys, BMK, dict(b=2, m=64, n=64, k=128))
    c = jax.random.normal(keys(), (64, 64), jnp.float32)
    f = lambda a, b, c: jax_dg.einsum(BMK, a, b, c=c)  # noqa: E731
    d = jax.jit(f, donate_argnums=2)(a, b, c + 0)
    np.testing.assert_allclose(np.asarray(d), exact(BMK, a, b) + np.asarray(c), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("expr", ["bhr,hdr->bhd", "bhd,hdr->bhr"])
@pytest.mark.parametrize("use_cublaslt", [False, True])
def test_batched_heads_match_reference(keys, expr, use_cublaslt):
    a, b = operands(keys, expr, dict(b=5, h=3, r=128, d=64))
    f = lambda a, b: jax_dg.einsum(expr, a, b, use_cublaslt=use_cublaslt)  # noqa: E731
    d = run("auto", f, a, b)
    assert d.dtype == jnp.bfloat16 and d.shape == exact(expr, a, b).shape
    np.testing.assert_array_equal(np.asarray(d, np.float32), np.asarray(run("xla", f, a, b), np.float32))
    assert jax_dg.calc_diff(d, exact(expr, a, b)) < 1e-5


def test_fp8_einsum_matches_reference(keys):
    x, y, a, b = fp8_operands(keys, 4, 2, 256, 128)
    f = lambda a, b: jax_dg.fp8_einsum("bhr,hdr->bhd", a, b)  # noqa: E731
    before = digest(a, b)
    d = run("auto", f, a, b)
    assert digest(a, b) == before, "inputs were written"
    assert d.shape == (4, 2, 128) and d.dtype == jnp.bfloat16
    ref = run("xla", f, a, b)
    assert jax_dg.calc_diff(d, ref) < 1e-6
    np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7, atol=1e-2)
    assert jax_dg.calc_diff(d, exact("bhr,hdr->bhd", x, y)) < 1e-3


@pytest.mark.parametrize("case,arg", [
    ("expr", "expr"), ("cublaslt_bmk", "use_cublaslt"), ("c_bf16", "c"), ("m_align", "a"),
    ("s_mismatch", "b"), ("c_bhr", "c"), ("r_align", "b"), ("out_dtype_bhr", "out_dtype"), ("dtype", "a"),
])
def test_einsum_bad_inputs(keys, case, arg):
    expr, kw = BMK, {}
    a, b = operands(keys, BMK, dict(b=2, m=64, n=64, k=64))
    if case == "expr":
        expr = "bmk,bkn->mn"
    elif case == "cublaslt_bmk":
        kw = dict(use_cublaslt=True)
    elif case == "c_bf16":
        kw = dict(c=jnp.zeros((64, 64), jnp.float32), out_dtype=jnp.bfloat16)
    elif case == "m_align":
        a = a[:, :32]
    elif case == "s_mismatch":
        b = b[:1]
    elif case == "dtype":
        a = a.astype(jnp.float32)
    else:
        expr = "bhr,hdr->bhd"
        a, b = operands(keys, expr, dict(b=2, h=2, r=64, d=64))
        if case == "c_bhr":
            kw = dict(c=jnp.zeros((2, 2, 64), jnp.float32))
        elif case == "r_align":
            a, b = a[..., :60], b[..., :60]
        elif case == "out_dtype_bhr":
            kw = dict(out_dtype=jnp.float32)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"einsum: `{arg}`")):
        jax.jit(lambda a, b: jax_dg.einsum(expr, a, b, **kw)).trace(a, b)


@pytest.mark.parametrize("case,arg", [
    ("expr", "expr"), ("r_align", "a[0]"), ("sfb_shape", "b[1]"), ("heads", "b[0]"), ("not_a_pair", "a"),
])
def test_fp8_einsum_bad_inputs(keys, case, arg):
    _, _, a, b = fp8_operands(keys, 2, 2, 128, 128)
    expr = "bhr,hdr->bhd"
    if case == "expr":
        expr = "bhd,hdr->bhr"
    elif case == "r_align":
        a, b = (a[0][..., :120], a[1]), (b[0][..., :120], b[1])
    elif case == "sfb_shape":
        b = (b[0], b[1][:, :, :0])
    elif case == "heads":
        b = (b[0][:1], b[1][:1])
    elif case == "not_a_pair":
        a = a[0]
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"fp8_einsum: `{arg}`")):
        jax.jit(lambda a, b: jax_dg.fp8_einsum(expr, a, b)).trace(a, b)


# --- GPU: DeepGEMM's test_einsum shapes and thresholds --------------------------------------

def _torch_bits(t):
    import torch
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).cpu().numpy().tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("s,m,n,k,out_dtype", [(129, 128, 384, 128, "float32"), (4096, 256, 256, 256, "bfloat16"),
                                               (8192, 384, 128, 384, "float32")])
def test_gpu_bmk_bnk_mn_matches_deep_gemm_from_torch(keys, s, m, n, k, out_dtype):
    import deep_gemm
    import torch
    a, b = operands(keys, BMK, dict(b=s, m=m, n=n, k=k))
    c = jax.random.normal(keys(), (m, n), jnp.float32) if out_dtype == "float32" else None
    f = jax.jit(lambda a, b, c: jax_dg.einsum(BMK, a, b, c=c, out_dtype=out_dtype))
    d = f(a, b, c)
    ref = jnp.einsum(BMK, a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    assert jax_dg.calc_diff(d, ref + (c if c is not None else 0)) < 1e-5
    if c is not None:
        d_t = to_torch(c).clone()
        deep_gemm.einsum(BMK, to_torch(a), to_torch(b), d_t, c=d_t)
    else:
        d_t = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        deep_gemm.einsum(BMK, to_torch(a), to_torch(b), d_t)
    torch.cuda.synchronize()
    # The kernel reduces over s with split-K atomics: equal to deep_gemm's result up to the
    # order of float32 additions (then one rounding to d's dtype: 1 bf16 ulp), not bitwise.
    theirs = d_t.float().cpu().numpy()
    rtol = 2 ** -7 if out_dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(np.asarray(d, np.float32), theirs, rtol=rtol, atol=1e-3)
    assert jax_dg.calc_diff(d, theirs) < 1e-9


@pytest.mark.gpu
@pytest.mark.parametrize("expr,bsz,h,r,d,use_cublaslt", [
    ("bhr,hdr->bhd", 4096, 8, 4096, 1024, False), ("bhr,hdr->bhd", 32, 128, 512, 128, False),
    ("bhr,hdr->bhd", 128, 8, 4096, 1024, True), ("bhd,hdr->bhr", 4096, 8, 4096, 1024, False),
    ("bhd,hdr->bhr", 4, 128, 512, 128, True),
])
def test_gpu_batched_heads_match_deep_gemm_from_torch(keys, expr, bsz, h, r, d, use_cublaslt):
    import deep_gemm
    import torch
    a, b = operands(keys, expr, dict(b=bsz, h=h, r=r, d=d))
    f = jax.jit(lambda a, b: jax_dg.einsum(expr, a, b, use_cublaslt=use_cublaslt))
    before = digest(a, b)
    out = f(a, b)
    ta, tb = to_torch(a), to_torch(b)
    assert jax_dg.calc_diff(out, torch.einsum(expr, ta, tb).float().cpu().numpy()) < 1e-10  # DeepGEMM's
    d_t = torch.empty(out.shape, dtype=torch.bfloat16, device="cuda")
    if use_cublaslt:
        deep_gemm.einsum(expr, ta, tb, d_t, use_cublaslt=True)
    else:
        deep_gemm.einsum(expr, ta, tb, d_t)
    torch.cuda.synchronize()
    assert bits(out) == _torch_bits(d_t)
    assert all(bits(f(a, b)) == bits(out) for _ in range(20))
    assert digest(a, b) == before, "inputs were written"


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [4, 4096])
def test_gpu_fp8_einsum_matches_deep_gemm_from_torch(keys, bsz):
    import deep_gemm
    import torch
    h, r, d = 8, 4096, 1024
    x, y, a, b = fp8_operands(keys, bsz, h, r, d)
    f = jax.jit(lambda a, b: jax_dg.fp8_einsum("bhr,hdr->bhd", a, b))
    before = digest(a, b)
    out = f(a, b)
    ref = jnp.einsum("bhr,hdr->bhd", x, y, preferred_element_type=jnp.float32)
    assert jax_dg.calc_diff(out, ref) < 1e-3
    d_t = torch.empty((bsz, h, d), dtype=torch.bfloat16, device="cuda")
    deep_gemm.fp8_einsum("bhr,hdr->bhd", (to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1])), d_t)
    torch.cuda.synchronize()
    assert bits(out) == _torch_bits(d_t)
    assert all(bits(f(a, b)) == bits(out) for _ in range(20))
    assert digest(a, b) == before, "inputs were written"
