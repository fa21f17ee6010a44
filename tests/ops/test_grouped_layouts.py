"""m-grouped contiguous GEMMs with DeepGEMM's psum layout (use_psum_layout=True), BF16 with B
stored [G, K, N] (the grouped `nn` form); compiled_dims: tests/ops/test_compiled_dims.py. CPU: the bridge against the pure-JAX
reference under jit, psum from routing, bad inputs at trace time. GPU: DeepGEMM's test shapes
(test_fp8_fp4.py / test_bf16.py at 88965b0: per-group calc_diff on [align(psum[j-1]), psum[j])),
bitwise equal to deep_gemm called from torch, 20 repeats bitwise identical."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.contracts import align
from jax_dg.reference.grouped import psum_to_row_groups
from tests.conftest import device_copies, run, same_bits, to_torch
from tests.ops.test_grouped import k_group_sizes
from tests.ops.test_grouped import (cast_a, cast_b, contiguous_expected, contiguous_layout,
                                    device_diff)

BF16 = jnp.bfloat16
MS = [130, 0, 57, 128]      # uneven, an empty group


def psum_of(ms, alignment=128):
    """DeepGEMM's generator: group j ends at its aligned start + ms[j]."""
    out, start = [], 0
    for m in ms:
        out.append(start + m)
        start = align(start + m, alignment)
    return np.asarray(out, np.int32)


def ids_of(psum, m, alignment=128):
    return np.asarray(psum_to_row_groups(jnp.asarray(psum), m, alignment))


def inputs(keys, fp8, ms, n=64, k=192):
    m = len(contiguous_layout(ms))
    x = jax.random.normal(keys(), (m, k), BF16)      # rows outside groups hold data too
    w = jax.random.normal(keys(), (len(ms), n, k), BF16)
    return x, w, ((cast_a(x), cast_b(w)) if fp8 else (x, w))


def fn_of(fp8):
    return jax_dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else jax_dg.m_grouped_bf16_gemm_nt_contiguous


def test_psum_to_row_groups_is_the_per_row_layout():
    psum = psum_of(MS)
    np.testing.assert_array_equal(ids_of(psum, 512), contiguous_layout(MS))
    # a psum that stops short of M leaves the tail in no group
    assert (ids_of(psum_of([5, 10]), 512)[266:] == -1).all()


@pytest.mark.parametrize("fp8", [True, False])
def test_psum_matches_per_row_ids_and_reference(keys, fp8):
    x, w, (a, b) = inputs(keys, fp8, MS)
    psum = jnp.asarray(psum_of(MS))
    ids = jnp.asarray(contiguous_layout(MS))
    f = lambda a, b, p: fn_of(fp8)(a, b, p, use_psum_layout=True)  # noqa: E731
    got = run("auto", f, a, b, psum)
    by_ids = run("auto", fn_of(fp8), a, b, ids)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(by_ids).view(np.uint16))
    expect = run("xla", f, a, b, psum)
    assert jax_dg.calc_diff(np.asarray(got, np.float32), np.asarray(expect, np.float32)) < 1e-6
    assert not np.asarray(got)[np.asarray(ids) < 0].any(), "rows in no group must be 0"
    if not fp8:
        assert jax_dg.calc_diff(np.asarray(got, np.float32),
                                np.asarray(contiguous_expected(x, w, np.asarray(ids)))) < 1e-5


def test_psum_from_routing_and_the_permute_flow(keys):
    t, topk, g, k, n = 60, 2, 4, 128, 64
    topk_idx = jax.random.randint(keys(), (t, topk), 0, g)
    x = jax.random.normal(keys(), (t, k), BF16)
    w = jax.random.normal(keys(), (g, n, k), BF16)
    tw = jax.random.uniform(keys(), (t, topk))

    def moe(x, topk_idx, tw, psum_form):
        if psum_form:
            psum, layout = jax_dg.psum_layout(topk_idx, g)
            y = jax_dg.m_grouped_bf16_gemm_nt_contiguous(jax_dg.permute_to_contiguous(x, layout), w,
                                                         psum, use_psum_layout=True)
        else:
            layout = jax_dg.contiguous_layout(topk_idx, g)
            y = jax_dg.m_grouped_bf16_gemm_nt_contiguous(jax_dg.permute_to_contiguous(x, layout), w,
                                                         layout.grouped_layout)
        return jax_dg.combine_from_contiguous(y, layout, tw)
    a = run("auto", lambda *z: moe(*z, True), x, topk_idx, tw)
    b = run("auto", lambda *z: moe(*z, False), x, topk_idx, tw)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    psum, layout = jax_dg.psum_layout(topk_idx, g)
    np.testing.assert_array_equal(ids_of(psum, layout.grouped_layout.shape[0]), layout.grouped_layout)
    # max_rows smaller than needed: ends are cut to it, its ids still match
    psum, layout = jax_dg.psum_layout(topk_idx, g, max_rows=128)
    assert int(psum.max()) <= 128
    np.testing.assert_array_equal(ids_of(psum, 128), layout.grouped_layout)


def test_traced_psum_out_of_order_is_made_safe(keys):
    _, _, (a, b) = inputs(keys, False, MS)
    bad = jnp.asarray([200, 100, 9999, -5], jnp.int32)   # decreasing, past M, negative
    f = lambda a, b, p: jax_dg.m_grouped_bf16_gemm_nt_contiguous(a, b, p, use_psum_layout=True)  # noqa: E731
    got = np.asarray(run("auto", f, a, b, bad))
    safe = np.asarray([200, 200, 512, 512], np.int32)    # clip to [0, M], running maximum
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(run("auto", f, a, b, jnp.asarray(safe))).view(np.uint16))
    expect = np.asarray(run("xla", f, a, b, bad), np.float32)
    np.testing.assert_array_equal(got == 0, expect == 0)
    assert jax_dg.calc_diff(got.astype(np.float32), expect) < 1e-6
    assert not got[ids_of(safe, 512) < 0].any()


@pytest.mark.parametrize("psum,rule", [([100, 50, 300, 400], "non-decreasing"), ([100, 200, 300, 600], r"\[0, M\]"),
                                       ([-1, 200, 300, 400], r"\[0, M\]")])
@pytest.mark.parametrize("fp8", [True, False])
def test_static_psum_is_checked_at_trace_time(keys, fp8, psum, rule):
    _, _, (a, b) = inputs(keys, fp8, MS)
    name = "m_grouped_fp8_gemm_nt_contiguous" if fp8 else "m_grouped_bf16_gemm_nt_contiguous"
    p = np.asarray(psum, np.int32)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"{name}: `grouped_layout`") + ".*" + rule):
        jax.jit(lambda a, b: fn_of(fp8)(a, b, p, use_psum_layout=True)).trace(a, b)


@pytest.mark.parametrize("case,arg", [
    ("psum_shape", "grouped_layout"), ("psum_dtype", "grouped_layout"), ("expected_m_without_psum", "expected_m_for_psum_layout"),
    ("flag_not_bool", "use_psum_layout"), ("dims_letter", "compiled_dims"), ("dims_repeat", "compiled_dims"),
    ("dims_type", "compiled_dims"), ("expected_m_zero", "expected_m_for_psum_layout"),
])
def test_bad_layout_arguments_name_the_argument(keys, case, arg):
    _, _, (a, b) = inputs(keys, False, MS)
    psum = jnp.asarray(psum_of(MS))
    kw = dict(use_psum_layout=True)
    if case == "psum_shape":
        psum = jnp.zeros((5,), jnp.int32)
    elif case == "psum_dtype":
        psum = psum.astype(jnp.float32)
    elif case == "expected_m_without_psum":
        kw = dict(expected_m_for_psum_layout=128)
        psum = jnp.asarray(contiguous_layout(MS))
    elif case == "flag_not_bool":
        kw = dict(use_psum_layout=1)
    elif case.startswith("dims"):
        kw["compiled_dims"] = {"dims_letter": "nx", "dims_repeat": "nn", "dims_type": 3}[case]
    else:
        kw["expected_m_for_psum_layout"] = 0
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"`{arg}`")):
        jax.jit(lambda a, b, p: jax_dg.m_grouped_bf16_gemm_nt_contiguous(a, b, p, **kw)).trace(a, b, psum)


@pytest.mark.parametrize("psum_form", [False, True])
def test_bf16_nn_form_is_the_nt_form_of_the_transpose(keys, psum_form):
    x, w, _ = inputs(keys, False, MS)
    wn = jnp.swapaxes(w, 1, 2)                                   # [G, K, N]: B MN-major
    layout = jnp.asarray(psum_of(MS) if psum_form else contiguous_layout(MS))
    f = lambda x, wn, l: jax_dg.m_grouped_bf16_gemm_nn_contiguous(x, wn, l, use_psum_layout=psum_form)  # noqa: E731
    got = run("auto", f, x, wn, layout)
    nt = run("auto", lambda x, w, l: jax_dg.m_grouped_bf16_gemm_nt_contiguous(x, w, l, use_psum_layout=psum_form),
             x, w, layout)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(nt).view(np.uint16))
    expect = run("xla", f, x, wn, layout)
    assert jax_dg.calc_diff(np.asarray(got, np.float32), np.asarray(expect, np.float32)) < 1e-6


def test_bf16_nn_bad_inputs(keys):
    x, w, _ = inputs(keys, False, MS)
    ids = jnp.asarray(contiguous_layout(MS))
    with pytest.raises(jax_dg.ArgumentError, match=re.escape("m_grouped_bf16_gemm_nn_contiguous: `a`")):
        jax.jit(lambda x, w, l: jax_dg.m_grouped_bf16_gemm_nn_contiguous(x, w, l)).trace(x, w, ids)   # [G, N, K] given
    with pytest.raises(jax_dg.ArgumentError, match=re.escape("`b`")):
        jax.jit(lambda x, w, l: jax_dg.m_grouped_bf16_gemm_nn_contiguous(x, w[0], l)).trace(x, w, ids)


# --- GPU: DeepGEMM's shapes ---------------------------------------------------------------------

def _upstream_case(keys, fp8, g, expected_m, n, k, seed):
    rng = np.random.default_rng(seed)
    ms = [int(expected_m * rng.uniform(0.7, 1.3)) for _ in range(g)]
    psum_np = psum_of(ms)
    m = align(int(psum_np[-1]), 128)
    x = jax.random.normal(keys(), (m, k), BF16)
    w = jax.random.normal(keys(), (g, n, k), BF16)
    a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
    return ms, psum_np, x, w, a, b


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,g,expected_m,n,k", [(True, 4, 8192, 4096, 4096), (False, 8, 4096, 7168, 3072)])
def test_gpu_psum_matches_deep_gemm_from_torch(keys, fp8, g, expected_m, n, k):
    import deep_gemm
    import torch
    ms, psum_np, x, w, a, b = _upstream_case(keys, fp8, g, expected_m, n, k, g * expected_m + n)
    psum = jnp.asarray(psum_np)
    ids_np = ids_of(psum_np, x.shape[0])
    f = jax.jit(lambda a, b, p: fn_of(fp8)(a, b, p, use_psum_layout=True))
    inputs_before = device_copies(a, b, psum)
    d = f(a, b, psum)
    expect = contiguous_expected(x, w, ids_np)
    start = 0
    for j in range(g):   # upstream: calc_diff per group over [align(psum[j-1]), psum[j])
        if psum_np[j] > start:
            assert float(device_diff(d[start:psum_np[j]], expect[start:psum_np[j]])) < (1e-3 if fp8 else 1e-5)
        start = align(int(psum_np[j]), 128)
    assert not bool(jnp.any(d[ids_np < 0] != 0)), "rows in no group must be 0"
    d_t = torch.empty(d.shape, dtype=torch.bfloat16, device="cuda")
    if fp8:
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1])),
                                                   d_t, to_torch(psum), use_psum_layout=True)
    else:
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(to_torch(a), to_torch(b), d_t, to_torch(psum), use_psum_layout=True)
    torch.cuda.synchronize()
    rows = torch.from_numpy(ids_np >= 0).cuda()
    ours = to_torch(jax.block_until_ready(d))
    assert torch.equal(ours[rows].view(torch.int16), d_t[rows].view(torch.int16)), "differs from deep_gemm's"
    assert all(bool(same_bits(f(a, b, psum), d)) for _ in range(20))
    assert bool(same_bits(inputs_before, (a, b, psum))), "inputs were written"


@pytest.mark.gpu
@pytest.mark.parametrize("psum_form", [False, True])
def test_gpu_bf16_nn_matches_deep_gemm_from_torch(keys, psum_form):
    """B stored [G, K, N]: upstream's MN-major B (b.mT.contiguous().mT to nt, b.mT to nn)."""
    import deep_gemm
    import torch
    ms, psum_np, x, w, _, _ = _upstream_case(keys, False, 4, 8192, 4096, 4096, 7 + psum_form)
    wn = jnp.swapaxes(w, 1, 2)
    layout = jnp.asarray(psum_np if psum_form else ids_of(psum_np, x.shape[0]))
    ids_np = ids_of(psum_np, x.shape[0])
    f = jax.jit(lambda x, wn, l: jax_dg.m_grouped_bf16_gemm_nn_contiguous(x, wn, l, use_psum_layout=psum_form))
    d = f(x, wn, layout)
    valid = np.flatnonzero(ids_np >= 0)
    assert float(device_diff(d[valid], contiguous_expected(x, w, ids_np)[valid])) < 1e-5
    d_t = torch.empty(d.shape, dtype=torch.bfloat16, device="cuda")
    deep_gemm.m_grouped_bf16_gemm_nn_contiguous(to_torch(x), to_torch(wn), d_t, to_torch(layout),
                                                use_psum_layout=psum_form)
    torch.cuda.synchronize()
    rows = torch.from_numpy(ids_np >= 0).cuda()
    ours = to_torch(jax.block_until_ready(d))
    assert torch.equal(ours[rows].view(torch.int16), d_t[rows].view(torch.int16)), "differs from deep_gemm's"
    assert all(bool(same_bits(f(x, wn, layout), d)) for _ in range(20))


# --- k-grouped BF16 (wgrad) -------------------------------------------------------------------------

def k_bf16_inputs(keys, ks, m, n):
    a = jax.random.normal(keys(), (sum(ks), m), BF16)
    b = jax.random.normal(keys(), (sum(ks), n), BF16)
    c = jax.random.normal(keys(), (len(ks), m, n), jnp.float32) * 32
    return a, b, c


def k_bf16_expected(a, b, c, ks):
    out, off = [], 0
    for g, kg in enumerate(ks):
        x, y = a[off:off + kg].astype(jnp.float32), b[off:off + kg].astype(jnp.float32)
        out.append(c[g] + jnp.matmul(x.T, y, precision=jax.lax.Precision.HIGHEST))
        off += kg
    return jnp.stack(out)


@pytest.mark.parametrize("ks", [[256, 0, 128, 384], [128]])
def test_k_grouped_bf16_matches_reference(keys, ks):
    a, b, c = k_bf16_inputs(keys, ks, 64, 72)
    f = lambda a, b, c: jax_dg.k_grouped_bf16_gemm_tn_contiguous(a, b, ks, c=c)  # noqa: E731
    got = run("auto", f, a, b, c)
    assert got.dtype == jnp.float32 and got.shape == (len(ks), 64, 72)
    assert jax_dg.calc_diff(np.asarray(got), np.asarray(run("xla", f, a, b, c))) < 1e-10
    assert jax_dg.calc_diff(np.asarray(got), np.asarray(k_bf16_expected(a, b, c, ks))) < 1e-10
    if 0 in ks:
        np.testing.assert_array_equal(np.asarray(got)[ks.index(0)], np.asarray(c)[ks.index(0)])
    dims = run("auto", lambda a, b, c: jax_dg.k_grouped_bf16_gemm_tn_contiguous(a, b, ks, c=c, compiled_dims="mnk"), a, b, c)
    np.testing.assert_array_equal(np.asarray(dims), np.asarray(got))


@pytest.mark.parametrize("case,arg", [("ks_64", "ks"), ("ks_empty", "ks"), ("ks_not_list", "ks"), ("no_c", "c"),
                                      ("c_groups", "c"), ("a_rows", "a"), ("a_dtype", "a"), ("b_cols", "b"),
                                      ("dims", "compiled_dims")])
def test_k_grouped_bf16_bad_inputs(keys, case, arg):
    ks = [128, 256]
    a, b, c = k_bf16_inputs(keys, ks, 64, 72)
    kw = dict(ks=ks, c=c)
    if case == "ks_64":
        kw["ks"] = [64, 320]
    elif case == "ks_empty":
        kw["ks"] = []
    elif case == "ks_not_list":
        kw["ks"] = 384
    elif case == "no_c":
        kw["c"] = None
    elif case == "c_groups":
        kw["c"] = c[:1]
    elif case == "a_rows":
        a = a[:128]
    elif case == "a_dtype":
        a = a.astype(jnp.float32)
    elif case == "b_cols":
        b = jnp.zeros((384, 70), BF16)
    else:
        kw["compiled_dims"] = "mz"
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"k_grouped_bf16_gemm_tn_contiguous: `{arg}`")):
        jax.jit(lambda a, b: jax_dg.k_grouped_bf16_gemm_tn_contiguous(a, b, kw["ks"], c=kw["c"],
                                                                      **{k: v for k, v in kw.items() if k == "compiled_dims"})).trace(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("g,m,n,expected_k,empty", [(4, 4096, 7168, 8192, False), (16, 7168, 2048, 2048, True)])
def test_gpu_k_grouped_bf16_matches_deep_gemm_from_torch(keys, g, m, n, expected_k, empty):
    """test_bf16.py's k-grouped cases (EP64 / EP16), an empty group in one; threshold 1e-5."""
    import deep_gemm
    import torch
    ks = k_group_sizes(g, m, expected_k, empty)
    a, b, c = k_bf16_inputs(keys, ks, m, n)
    f = jax.jit(lambda a, b, c: jax_dg.k_grouped_bf16_gemm_tn_contiguous(a, b, ks, c=c))
    inputs_before = device_copies(a, b, c)
    d = f(a, b, c)
    assert float(device_diff(d, k_bf16_expected(a, b, c, ks))) < 1e-5
    d_t = to_torch(c).clone()
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(to_torch(a), to_torch(b), d_t, ks,
                                                torch.tensor(ks, dtype=torch.int32, device="cuda"), d_t)
    torch.cuda.synchronize()
    assert bool(torch.equal(to_torch(jax.block_until_ready(d)), d_t)), "differs from deep_gemm's"
    assert all(bool(same_bits(f(a, b, c), d)) for _ in range(20))
    assert bool(same_bits(inputs_before, (a, b, c))), "inputs were written"
