"""Autodiff: fp8_linear and fp8_grouped_linear (DeepSeek V3's FP8 recipe, backward on
DeepGEMM's kernels), the bf16 GEMMs' rules, and the error for everything else."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg

F32 = jnp.float32


def linear_case(keys, lead=(2, 100), n=256, k=384, x_dtype=jnp.bfloat16):
    x = jax.random.normal(keys(), (*lead, k), F32).astype(x_dtype)
    w = jax.random.normal(keys(), (n, k), F32) * 0.05
    up = jax.random.normal(keys(), (*lead, n), F32)
    return x, w, up


def grads(fn, *args):
    return jax.jit(jax.grad(fn, tuple(range(len(args)))))(*args)


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, F32])
def test_fp8_linear_grads_match_dense_math(keys, x_dtype):
    x, w, up = linear_case(keys, x_dtype=x_dtype)
    y = jax.jit(jax_dg.fp8_linear)(x, w)
    assert y.shape == (2, 100, 256) and y.dtype == jnp.bfloat16
    assert jax_dg.calc_diff(y.astype(F32), x.astype(F32) @ w.T) < 2e-3
    loss = lambda x, w: ((jax_dg.fp8_linear(x, w).astype(F32) * up) ** 2).sum()   # noqa: E731
    dense = lambda x, w: (((x.astype(F32) @ w.T) * up) ** 2).sum()                # noqa: E731
    (dx, dw), (rx, rw) = grads(loss, x, w), grads(dense, x, w)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert jax_dg.calc_diff(dx.astype(F32), rx) < 2e-3
    assert jax_dg.calc_diff(dw, rw) < 2e-3


def test_fp8_linear_backward_is_jax_dg_custom_calls(keys):
    x, w, up = linear_case(keys)
    loss = lambda x, w: ((jax_dg.fp8_linear(x, w).astype(F32) * up) ** 2).sum()   # noqa: E731
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
    assert "dot_general" not in hlo and " dot(" not in hlo       # no XLA GEMM on dequantised values
    assert hlo.count("jax_dg_fp8_gemm_nt") == 3                  # forward, dgrad, wgrad


def test_fp8_grouped_linear_grads_match_dense_math(keys):
    g, m, n, k = 3, 128, 256, 256
    x = jax.random.normal(keys(), (g, m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (g, n, k), F32) * 0.05
    masked_m = jnp.array([100, 0, 128], jnp.int32)
    up = jax.random.normal(keys(), (g, m, n), F32)
    rows = jnp.arange(m)[None, :, None] < masked_m[:, None, None]
    loss = lambda x, w: ((jax_dg.fp8_grouped_linear(x, w, masked_m, 64).astype(F32) * up) ** 2).sum()  # noqa: E731
    dense = lambda x, w: (((jnp.einsum("gmk,gnk->gmn", x.astype(F32), w) * rows) * up) ** 2).sum()  # noqa: E731
    (dx, dw), (rx, rw) = grads(loss, x, w), grads(dense, x, w)
    assert jax_dg.calc_diff(dx.astype(F32), rx) < 2e-3 and jax_dg.calc_diff(dw, rw) < 2e-3
    assert not np.asarray(dx[0, 100:]).any() and not np.asarray(dx[1]).any()   # masked rows: no gradient
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
    assert "dot_general" not in hlo
    assert "jax_dg_m_grouped_fp8_gemm_nt_masked" in hlo and "jax_dg_k_grouped_fp8_gemm_nt_contiguous" in hlo


# --- the backward through jax_dg.core.derivative.with_vjp is the one it replaced, bitwise --------
# The formulation before with_vjp (two plain jax.custom_vjp, the oracle's quantisers), kept here
# verbatim but for the names: jax.grad of the layers must give the same bits.

def _old_linear(x, w, quant=None):
    """quant: the quantisers' module (default the oracle, jax_dg.reference.quant)."""
    from jax_dg.reference import quant as oracle
    per_block_cast_to_fp8 = (quant or oracle).per_block_cast_to_fp8
    per_token_cast_to_fp8 = (quant or oracle).per_token_cast_to_fp8
    bf16 = jnp.bfloat16

    def pad_rows(x, multiple):
        m = x.shape[0]
        return x if m % multiple == 0 else jnp.pad(x, ((0, -(-m // multiple) * multiple - m), (0, 0)))

    def fwd(x2, w):
        wq = per_block_cast_to_fp8(w)
        return jax_dg.fp8_gemm_nt(per_token_cast_to_fp8(x2), wq), (x2, wq, jnp.zeros((), w.dtype))

    @jax.custom_vjp
    def linear(x2, w):
        return fwd(x2, w)[0]

    def bwd(res, dy):
        x2, wq, w_like = res
        g = dy.astype(bf16)
        dx = jax_dg.fp8_gemm_nt(per_token_cast_to_fp8(g), (wq[0].T, wq[1].T))
        gt, xt = pad_rows(g, 16).T, pad_rows(x2, 16).T
        dw = jax_dg.fp8_gemm_nt(per_token_cast_to_fp8(gt), per_token_cast_to_fp8(xt),
                                c=jnp.zeros((g.shape[1], x2.shape[1]), F32))
        return dx.astype(x2.dtype), dw.astype(w_like.dtype)
    linear.defvjp(fwd, bwd)
    return linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


def _old_grouped_linear(x, w, masked_m, expected_m, quant=None):
    from jax_dg.reference import quant as oracle
    per_block_cast_to_fp8 = (quant or oracle).per_block_cast_to_fp8
    per_token_cast_to_fp8 = (quant or oracle).per_token_cast_to_fp8
    pt, pb = jax.vmap(per_token_cast_to_fp8), jax.vmap(per_block_cast_to_fp8)

    def fwd(x, w, masked_m, expected_m):
        b = pb(w)
        y = jax_dg.m_grouped_fp8_gemm_nt_masked(pt(x), b, masked_m, expected_m)
        return y, (x, b, masked_m, jnp.zeros((), w.dtype))

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def grouped(x, w, masked_m, expected_m):
        return fwd(x, w, masked_m, expected_m)[0]

    def bwd(expected_m, res, dy):
        x, b, masked_m, w_like = res
        g_, mmax, _ = x.shape
        rows = jnp.arange(mmax, dtype=jnp.int32)[None, :, None] < jnp.clip(masked_m, 0, mmax)[:, None, None]
        g = jnp.where(rows, dy, 0).astype(jnp.bfloat16)
        bt = (jnp.swapaxes(b[0], 1, 2), jnp.swapaxes(b[1], 1, 2))
        dx = jax_dg.m_grouped_fp8_gemm_nt_masked(pt(g), bt, masked_m, expected_m)
        n, k = g.shape[2], x.shape[2]
        xs = jnp.where(rows, x, 0).astype(jnp.bfloat16)
        qa, qb = pt(jnp.swapaxes(g, 1, 2)), pt(jnp.swapaxes(xs, 1, 2))
        a = (qa[0].reshape(-1), jnp.swapaxes(qa[1], 1, 2).reshape(-1, n))
        bb = (qb[0].reshape(-1), jnp.swapaxes(qb[1], 1, 2).reshape(-1, k))
        dw = jax_dg.k_grouped_fp8_gemm_nt_contiguous(a, bb, [mmax] * g_, c=jnp.zeros((g_, n, k), F32))
        return dx.astype(x.dtype), dw.astype(w_like.dtype), None
    grouped.defvjp(fwd, bwd)
    return grouped(x, w, masked_m, expected_m)


def assert_bitwise(got, want):
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(r.astype(F32)))


@pytest.mark.parametrize("x_dtype,w_dtype", [(jnp.bfloat16, F32), (F32, jnp.bfloat16)])
def test_fp8_linear_grads_are_bitwise_the_previous_formulation(keys, x_dtype, w_dtype, cpu_device):
    x, w, up = linear_case(keys, lead=(3, 37), n=128, k=272, x_dtype=x_dtype)   # M, K % 128 != 0
    w = w.astype(w_dtype)
    new, old = jax_dg.fp8_linear, _old_linear
    assert_bitwise([jax.jit(new)(x, w)], [jax.jit(old)(x, w)])
    loss = lambda f: lambda x, w: ((f(x, w).astype(F32) * up) ** 2).sum()   # noqa: E731
    assert_bitwise(grads(loss(new), x, w), grads(loss(old), x, w))
    # eagerly, with a cotangent that is no function of y (jax.vjp)
    ct = up.astype(jnp.bfloat16)
    assert_bitwise(jax.vjp(new, x, w)[1](ct), jax.vjp(old, x, w)[1](ct))


def test_fp8_grouped_linear_grads_are_bitwise_the_previous_formulation(keys, cpu_device):
    g, m, n, k = 2, 128, 128, 256
    x = jax.random.normal(keys(), (g, m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (g, n, k), F32) * 0.05
    masked_m = jnp.array([77, 128], jnp.int32)
    up = jax.random.normal(keys(), (g, m, n), F32)
    new = lambda x, w: jax_dg.fp8_grouped_linear(x, w, masked_m, 64)     # noqa: E731
    old = lambda x, w: _old_grouped_linear(x, w, masked_m, 64)           # noqa: E731
    assert_bitwise([jax.jit(new)(x, w)], [jax.jit(old)(x, w)])
    loss = lambda f: lambda x, w: ((f(x, w).astype(F32) * up) ** 2).sum()   # noqa: E731
    assert_bitwise(grads(loss(new), x, w), grads(loss(old), x, w))
    # masked_m, an integer input, has a float0 cotangent
    dm = jax.grad(lambda x, mm: jax_dg.fp8_grouped_linear(x, w, mm, 64).astype(F32).sum(),
                  argnums=1, allow_int=True)(x, masked_m)
    assert dm.dtype == jax.dtypes.float0


def test_with_vjp_saves_once_and_hands_the_rule_what_it_saved():
    from jax_dg.core import derivative
    calls = {"save": 0}

    def save(x, n):
        calls["save"] += 1
        return x * 2.0

    def call(x, n, saved):
        return (saved * x).sum() + n.sum()

    def rule(inputs, cts, saved, *, scale):
        assert set(inputs) == {"x", "n"}
        return {"x": cts * saved * scale}          # no entry for n: an integer input

    f = derivative.with_vjp(call, ("x", "n"), rule, {"scale": 2.0}, save=save)
    x, n = jnp.arange(3.0), jnp.arange(3, dtype=jnp.int32)
    assert float(f(x, n)) == float((2 * x * x).sum() + 3) and calls["save"] == 1
    calls["save"] = 0
    y, vjp = jax.vjp(f, x, n)                      # one forward pass: save runs once
    assert calls["save"] == 1
    dx, dn = vjp(jnp.ones((), F32))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(2 * x * 2.0))   # the rule, not autodiff
    assert dn.dtype == jax.dtypes.float0
    # without save, the rule gets no `saved` and the inputs are kept
    g = derivative.with_vjp(lambda x: x * 3.0, ("x",), lambda inputs, cts: {"x": cts * 5.0}, {})
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: g(x).sum())(x)), np.full(3, 5.0))


@pytest.mark.parametrize("family", ["bf16_gemm", "cublaslt_gemm"])
@pytest.mark.parametrize("storage", ["nt", "nn", "tn", "tt"])
def test_bf16_gemm_grads_match_dense_math(keys, family, storage):
    a_t, b_n = storage[0] == "t", storage[1] == "n"
    m, n, k = 128, 192, 256
    a = jax.random.normal(keys(), (k, m) if a_t else (m, k), jnp.bfloat16)
    b = jax.random.normal(keys(), (k, n) if b_n else (n, k), jnp.bfloat16)
    c = jax.random.normal(keys(), (m, n), F32)
    up = jax.random.normal(keys(), (m, n), F32)
    fn = getattr(jax_dg, f"{family}_{storage}")
    loss = lambda a, b, c: ((fn(a, b, c=c, out_dtype=F32)) * up).sum()   # noqa: E731

    def dense(a, b, c):
        A = (a.T if a_t else a).astype(F32)
        B = (b if b_n else b.T).astype(F32)
        return ((A @ B + c) * up).sum()
    for got, want in zip(grads(loss, a, b, c), grads(dense, a, b, c)):
        assert got.dtype == want.dtype or got.dtype == jnp.bfloat16
        assert jax_dg.calc_diff(got.astype(F32), want.astype(F32)) < 1e-4
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(a, b, c).as_text()
    assert "dot_general" not in hlo


def test_other_ops_say_what_is_differentiable(keys):
    q = jnp.zeros((4, 32, 64), jnp.float8_e4m3fn)
    kv = (jnp.zeros((8, 64), jnp.float8_e4m3fn), jnp.ones((8,), F32))
    ks = jnp.zeros((4,), jnp.int32)
    f = lambda w: jax_dg.mqa_logits(q, kv, w, ks, ks + 8).sum()   # noqa: E731
    with pytest.raises(jax_dg.NotDifferentiableError, match=r"`fp8_fp4_mqa_logits` has no derivative "
                       r"rule.*fp8_linear.*use_backend\('xla'\)"):
        jax.grad(f)(jnp.ones((4, 32), F32))
    with jax_dg.use_backend("xla"):            # the reference differentiates
        assert jax.grad(f)(jnp.ones((4, 32), F32)).shape == (4, 32)
    a = jax_dg.per_token_cast_to_fp8(jnp.ones((16, 128), F32))
    b = jax_dg.per_block_cast_to_fp8(jnp.ones((16, 128), F32))
    with pytest.raises(jax_dg.NotDifferentiableError, match="fp8_gemm_nt"):
        jax.grad(lambda s: jax_dg.fp8_gemm_nt((a[0], s), b).astype(F32).sum())(a[1])


def test_bad_linear_inputs_name_the_argument():
    w = jnp.zeros((256, 384), F32)
    with pytest.raises(jax_dg.ArgumentError, match="`x` must end in w's K = 384"):
        jax_dg.fp8_linear(jnp.zeros((4, 128), F32), w)
    with pytest.raises(jax_dg.ArgumentError, match="`w` must have N % 16 == 0"):
        jax_dg.fp8_linear(jnp.zeros((4, 384), F32), jnp.zeros((250, 384), F32))
    with pytest.raises(jax_dg.ArgumentError, match="`x` must have Mmax a positive multiple of 128"):
        jax_dg.fp8_grouped_linear(jnp.zeros((2, 100, 128), F32), jnp.zeros((2, 128, 128), F32),
                                  jnp.zeros((2,), jnp.int32), 8)


# --- GPU: DeepGEMM's backward against jax.grad of the pure-JAX reference -----------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4096, 2112, 7168), (256, 7168, 2048)])
def test_gpu_fp8_linear_grads(keys, m, n, k):
    x = jax.random.normal(keys(), (m, k), F32).astype(jnp.bfloat16)
    w = jax.random.normal(keys(), (n, k), F32) * 0.02
    up = jax.random.normal(keys(), (m, n), F32)
    # A loss linear in y: both backends quantise the same dy, so the backward GEMMs alone differ.
    linear = lambda x, w: (jax_dg.fp8_linear(x, w).astype(F32) * up).sum()   # noqa: E731
    got = jax.jit(jax.grad(linear, (0, 1)))(x, w)
    with jax_dg.use_backend("xla"):      # the same recipe on the pure-JAX reference GEMMs
        ref = jax.jit(jax.grad(lambda x, w: linear(x, w), (0, 1)))(x, w)
    vs_ref = [jax_dg.calc_diff(g.astype(F32), r.astype(F32)) for g, r in zip(got, ref)]
    # A quadratic loss (dy depends on the FP8 forward): against dense math, the CPU threshold.
    quad = lambda x, w: ((jax_dg.fp8_linear(x, w).astype(F32) * up) ** 2).sum()   # noqa: E731
    got = jax.jit(jax.grad(quad, (0, 1)))(x, w)
    dense = jax.jit(jax.grad(lambda x, w: (((x.astype(F32) @ w.T) * up) ** 2).sum(), (0, 1)))(x, w)
    vs_dense = [jax_dg.calc_diff(g.astype(F32), d.astype(F32)) for g, d in zip(got, dense)]
    print(f"fp8_linear {m}x{n}x{k}: (dx, dw) calc_diff vs the reference backend {vs_ref}, vs dense {vs_dense}")
    assert max(vs_dense) < 2e-3
    assert max(vs_ref) < 1e-3     # DeepGEMM's FP8 GEMM threshold


@pytest.mark.gpu
def test_gpu_fp8_grouped_linear_grads(keys):
    g, m, n, k = 8, 256, 2048, 1024
    x = jax.random.normal(keys(), (g, m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (g, n, k), F32) * 0.02
    masked_m = jnp.asarray([256, 0, 100, 129, 1, 255, 200, 64], jnp.int32)
    up = jax.random.normal(keys(), (g, m, n), F32)
    rows = jnp.arange(m)[None, :, None] < masked_m[:, None, None]
    linear = lambda x, w: (jax_dg.fp8_grouped_linear(x, w, masked_m, 128).astype(F32) * up).sum()  # noqa: E731
    got = jax.jit(jax.grad(linear, (0, 1)))(x, w)
    with jax_dg.use_backend("xla"):
        ref = jax.jit(jax.grad(lambda x, w: linear(x, w), (0, 1)))(x, w)
    vs_ref = [jax_dg.calc_diff(a.astype(F32), r.astype(F32)) for a, r in zip(got, ref)]
    quad = lambda x, w: ((jax_dg.fp8_grouped_linear(x, w, masked_m, 128).astype(F32) * up) ** 2).sum()  # noqa: E731
    dense = lambda x, w: (((jnp.einsum("gmk,gnk->gmn", x.astype(F32), w) * rows) * up) ** 2).sum()  # noqa: E731
    vs_dense = [jax_dg.calc_diff(a.astype(F32), d.astype(F32))
                for a, d in zip(jax.jit(jax.grad(quad, (0, 1)))(x, w), jax.jit(jax.grad(dense, (0, 1)))(x, w))]
    print(f"fp8_grouped_linear: (dx, dw) calc_diff vs the reference backend {vs_ref}, vs dense {vs_dense}")
    assert max(vs_dense) < 2e-3
    assert max(vs_ref) < 1e-3     # DeepGEMM's FP8 GEMM threshold
