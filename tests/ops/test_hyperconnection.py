"""tf32_hc_prenorm_gemm: per-split partials against the pure-JAX reference, bad inputs, and (GPU)
DeepGEMM's test_hyperconnection shapes and threshold against deep_gemm called from torch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.contracts import hc_split_bounds as split_bounds
from tests.conftest import bits, digest, to_torch, run


def inputs(keys, m, n, k):
    return (jax.random.normal(keys(), (m, k), jnp.bfloat16),
            jax.random.normal(keys(), (n, k), jnp.float32))


def test_split_bounds_follow_deep_gemm():
    # 10 blocks of 64 over 4 splits: 3, 3, 2, 2 blocks (the remainder to the first splits).
    assert split_bounds(640, 4) == [(0, 192), (192, 384), (384, 512), (512, 640)]
    assert split_bounds(128, 2) == [(0, 64), (64, 128)]


@pytest.mark.parametrize("m,n,k,num_split", [(13, 24, 640, None), (13, 24, 640, 4), (37, 8, 640, 10),
                                             (5, 32, 128, 1), (0, 16, 128, 2)])
def test_matches_reference(keys, m, n, k, num_split):
    x, fn = inputs(keys, m, n, k)
    f = lambda x, fn: jax_dg.tf32_hc_prenorm_gemm(x, fn, num_split)  # noqa: E731
    before = digest(x, fn)
    d, sq = run("auto", f, x, fn)
    assert digest(x, fn) == before, "inputs were written"
    lead = () if num_split is None else (num_split,)
    assert d.shape == (*lead, m, n) and sq.shape == (*lead, m)
    assert d.dtype == sq.dtype == jnp.float32
    rd, rsq = run("xla", f, x, fn)
    np.testing.assert_allclose(np.asarray(d), np.asarray(rd), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(sq), np.asarray(rsq), rtol=1e-5, atol=1e-3)
    xf = np.asarray(x, np.float64)
    total_d, total_sq = (d, sq) if num_split is None else (d.sum(0), sq.sum(0))
    if m:
        assert jax_dg.calc_diff(total_d, xf @ np.asarray(fn, np.float64).T) < 1e-8
        assert jax_dg.calc_diff(total_sq, np.square(xf).sum(-1)) < 1e-8
    if num_split is not None and m:  # each split covers exactly its K range
        for s, (lo, hi) in enumerate(split_bounds(k, num_split)):
            np.testing.assert_allclose(np.asarray(sq[s]), np.square(xf[:, lo:hi]).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("case,arg", [
    ("n_big", "fn"), ("n_align", "fn"), ("k_align", "x"), ("x_dtype", "x"), ("fn_dtype", "fn"),
    ("k_mismatch", "fn"), ("too_many_splits", "num_split"), ("zero_splits", "num_split"),
    ("split_not_int", "num_split"),
])
def test_bad_inputs(keys, case, arg):
    x, fn = inputs(keys, 16, 24, 256)
    num_split = 2
    if case == "n_big":
        fn = jnp.zeros((40, 256), jnp.float32)
    elif case == "n_align":
        fn = fn[:20]
    elif case == "k_align":
        x, fn = x[:, :96], fn[:, :96]
    elif case == "x_dtype":
        x = x.astype(jnp.float32)
    elif case == "fn_dtype":
        fn = fn.astype(jnp.bfloat16)
    elif case == "k_mismatch":
        fn = fn[:, :128]
    elif case == "too_many_splits":
        num_split = 5
    elif case == "zero_splits":
        num_split = 0
    elif case == "split_not_int":
        num_split = 2.0
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"tf32_hc_prenorm_gemm: `{arg}`")):
        jax.jit(lambda x, fn: jax_dg.tf32_hc_prenorm_gemm(x, fn, num_split)).trace(x, fn)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,num_split", [(4096, 24, 28672, 16), (13, 24, 7168, None), (8192, 24, 7680, 16),
                                             (137, 24, 28672, None)])
def test_gpu_matches_deep_gemm_from_torch(keys, m, n, k, num_split):
    import deep_gemm
    import torch
    x, fn = inputs(keys, m, n, k)
    f = jax.jit(lambda x, fn: jax_dg.tf32_hc_prenorm_gemm(x, fn, num_split))
    before = digest(x, fn)
    d, sq = f(x, fn)
    tx, tfn = to_torch(x), to_torch(fn)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # DeepGEMM's reference is itself TF32
    try:
        ref_d = (tx.float() @ tfn.T).cpu().numpy()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    ref_s = tx.float().square().sum(-1).cpu().numpy()
    total_d, total_s = (d, sq) if num_split is None else (d.sum(0), sq.sum(0))
    assert max(jax_dg.calc_diff(total_d, ref_d), jax_dg.calc_diff(total_s, ref_s)) < 1e-8
    shape = (m, n) if num_split is None else (num_split, m, n)
    d_t = torch.empty(shape, dtype=torch.float32, device="cuda")
    s_t = torch.empty(shape[:-1], dtype=torch.float32, device="cuda")
    deep_gemm.tf32_hc_prenorm_gemm(tx, tfn, d_t, s_t, num_split)
    torch.cuda.synchronize()
    assert bits(d) == d_t.cpu().numpy().tobytes() and bits(sq) == s_t.cpu().numpy().tobytes()
    for _ in range(20):
        again = f(x, fn)
        assert bits(again[0]) == bits(d) and bits(again[1]) == bits(sq)
    assert digest(x, fn) == before, "inputs were written"
