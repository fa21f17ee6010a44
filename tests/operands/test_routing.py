"""MoE routing helpers: top-k ids -> DeepGEMM's contiguous / masked grouped layouts and back,
against a plain numpy MoE; through jax_dg's grouped GEMMs on CPU and (GPU) DeepGEMM."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.operands import routing as routing_mod


def routing(seed, t, k, g, *, drop=0.1, skew=True):
    """Top-k ids without repeats per token; uneven experts (some empty), some ids -1."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(g, 0.3)) if skew else np.full(g, 1 / g)
    if k < g:  # an expert nobody picks (k distinct picks need k experts with p > 0)
        p[rng.integers(0, g)] = 0
    p /= p.sum()
    ids = np.stack([rng.choice(g, k, replace=False, p=p) for _ in range(t)]).astype(np.int32)
    ids[rng.random((t, k)) < drop] = -1
    weights = rng.random((t, k)).astype(np.float32)
    return ids, weights


def numpy_moe(x, w, ids, weights):
    """out[t] = sum_k weights[t, k] * x[t] @ w[ids[t, k]].T over routed slots, float64."""
    out = np.zeros((x.shape[0], w.shape[1]))
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            if 0 <= e < w.shape[0]:
                out[t] += weights[t, j] * (x[t].astype(np.float64) @ w[e].astype(np.float64).T)
    return out


@pytest.mark.parametrize("t,k,g,a", [(37, 4, 8, 128), (200, 8, 32, 64), (5, 2, 16, 128), (64, 6, 7, 32)])
def test_contiguous_layout_invariants(t, k, g, a):
    ids, _ = routing(t + g, t, k, g)
    lay = jax.jit(lambda i: jax_dg.contiguous_layout(i, g, alignment=a))(jnp.asarray(ids))
    gl, tok, row = np.asarray(lay.grouped_layout), np.asarray(lay.token_index), np.asarray(lay.row_index)
    m = gl.shape[0]
    counts = np.bincount(ids[ids >= 0], minlength=g)
    padded = -(-counts // a) * a
    assert m % a == 0 and m >= padded.sum()
    np.testing.assert_array_equal(np.asarray(lay.group_sizes), counts)
    np.testing.assert_array_equal(np.asarray(lay.group_offsets), np.cumsum(padded) - padded)
    assert int(lay.num_rows) == padded.sum()
    # every routed (t, k) has a row of its expert holding its token; unrouted ones have none
    routed = ids >= 0
    assert (row[~routed] == -1).all()
    np.testing.assert_array_equal(gl[row[routed]], ids[routed])
    np.testing.assert_array_equal(tok[row[routed]], np.nonzero(routed)[0])
    assert len(set(row[routed].tolist())) == routed.sum()
    # segments: aligned starts, token order inside, -1 padding (token index T) elsewhere
    for e in range(g):
        start = padded[:e].sum()
        assert start % a == 0
        seg = slice(start, start + counts[e])
        assert (gl[seg] == e).all() and (np.diff(tok[seg]) >= 0).all()
        assert (gl[start + counts[e]:start + padded[e]] == -1).all()
    pad = gl == -1
    assert (tok[pad] == t).all() and pad.sum() == m - counts.sum()


def test_contiguous_default_alignment_and_max_rows():
    ids, _ = routing(0, 50, 4, 8)
    with jax_dg.mk_alignment_scope(64):  # read while tracing
        lay = jax.jit(lambda i: jax_dg.contiguous_layout(i, 8))(jnp.asarray(ids))
    assert lay.grouped_layout.shape[0] % 64 == 0
    # worst case: every routed row plus alignment - 1 padding per used expert
    assert lay.grouped_layout.shape[0] == -(-(50 * 4 + 8 * 63) // 64) * 64
    # too small max_rows: overflowing rows are dropped (row_index -1), num_rows tells
    small = jax.jit(lambda i: jax_dg.contiguous_layout(i, 8, alignment=64, max_rows=128))(jnp.asarray(ids))
    assert int(small.num_rows) > 128
    kept = np.asarray(small.row_index) >= 0
    assert 0 < kept.sum() < (ids >= 0).sum() and (np.asarray(small.row_index)[kept] < 128).all()


@pytest.mark.parametrize("t,k,g,max_m", [(37, 4, 8, 64), (100, 8, 16, 32)])
def test_masked_layout_invariants_and_overflow(t, k, g, max_m):
    ids, _ = routing(t * g, t, k, g)
    lay = jax.jit(lambda i: jax_dg.masked_layout(i, g, max_m))(jnp.asarray(ids))
    counts = np.bincount(ids[ids >= 0], minlength=g)
    np.testing.assert_array_equal(np.asarray(lay.masked_m), np.minimum(counts, max_m))
    assert int(lay.num_dropped) == np.maximum(counts - max_m, 0).sum()
    tok, row = np.asarray(lay.token_index), np.asarray(lay.row_index)
    for e in range(g):
        n = min(counts[e], max_m)
        assert (tok[e, n:] == t).all() and (np.diff(tok[e, :n]) >= 0).all()
        # the first max_m assignments of the expert (in token order) are the kept ones
        ts = np.nonzero(ids == e)[0][:n]
        np.testing.assert_array_equal(tok[e, :n], ts)
    routed_kept = row >= 0
    np.testing.assert_array_equal(row[routed_kept] // max_m, ids[routed_kept])
    assert routed_kept.sum() == (ids >= 0).sum() - int(lay.num_dropped)


def expert_matmul_contiguous(xp, w, gl):
    out = np.zeros((xp.shape[0], w.shape[1]), np.float32)
    for r, e in enumerate(gl):
        if e >= 0:
            out[r] = xp[r].astype(np.float64) @ w[e].astype(np.float64).T
    return out


def test_round_trip_contiguous_equals_dense_moe():
    t, k, g, h, n = 48, 4, 8, 64, 32
    ids, weights = routing(1, t, k, g)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = rng.standard_normal((g, n, h)).astype(np.float32)

    @jax.jit
    def permute(x, ids):
        lay = jax_dg.contiguous_layout(ids, g, alignment=32)
        return lay, jax_dg.permute_to_contiguous(x, lay)

    lay, xp = permute(jnp.asarray(x), jnp.asarray(ids))
    xp = np.asarray(xp)
    assert (xp[np.asarray(lay.grouped_layout) == -1] == 0).all(), "padding rows are zero"
    y = expert_matmul_contiguous(xp, w, np.asarray(lay.grouped_layout))
    out = jax.jit(jax_dg.combine_from_contiguous)(jnp.asarray(y), lay, jnp.asarray(weights))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), numpy_moe(x, w, ids, weights), rtol=1e-4, atol=1e-4)


def test_round_trip_masked_equals_dense_moe():
    t, k, g, h, n, max_m = 40, 4, 8, 64, 32, 64
    ids, weights = routing(3, t, k, g)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = rng.standard_normal((g, n, h)).astype(np.float32)
    lay, xp = jax.jit(lambda x, i: (lambda lay: (lay, jax_dg.permute_to_masked(x, lay)))(
        jax_dg.masked_layout(i, g, max_m)))(jnp.asarray(x), jnp.asarray(ids))
    assert int(lay.num_dropped) == 0
    xp = np.asarray(xp)
    assert xp.shape == (g, max_m, h)
    y = np.einsum("gmh,gnh->gmn", xp, w)
    out = jax.jit(lambda y, lay, w: jax_dg.combine_from_masked(y, lay, w, out_dtype=jnp.float32))(
        jnp.asarray(y), lay, jnp.asarray(weights))
    np.testing.assert_allclose(np.asarray(out), numpy_moe(x, w, ids, weights), rtol=1e-4, atol=1e-4)


def test_permute_fp8_pairs_keeps_values_and_scales_together():
    ids, _ = routing(5, 20, 2, 4)
    x = jax.random.normal(jax.random.PRNGKey(0), (20, 256), jnp.bfloat16)

    @jax.jit
    def f(x, ids):
        q = jax_dg.per_token_cast_to_fp8(x)
        lay = jax_dg.contiguous_layout(ids, 4, alignment=128)
        masked = jax_dg.permute_to_masked(q, jax_dg.masked_layout(ids, 4, 32))
        return q, lay, jax_dg.permute_to_contiguous(q, lay), masked

    q, lay, (vals, scales), masked = f(x, jnp.asarray(ids))
    assert vals.dtype == jnp.float8_e4m3fn and scales.shape == (lay.grouped_layout.shape[0], 2)
    rows = np.asarray(lay.row_index)[ids >= 0]
    src = np.nonzero(ids >= 0)[0]
    np.testing.assert_array_equal(np.asarray(vals.astype(jnp.float32))[rows], np.asarray(q[0].astype(jnp.float32))[src])
    np.testing.assert_array_equal(np.asarray(scales)[rows], np.asarray(q[1])[src])
    assert masked[0].shape == (4, 32, 256) and masked[1].shape == (4, 32, 2)


@pytest.mark.parametrize("call,arg", [
    (lambda: jax_dg.contiguous_layout(jnp.zeros((4,), jnp.int32), 8), "topk_idx"),
    (lambda: jax_dg.contiguous_layout(jnp.zeros((4, 2), jnp.float32), 8), "topk_idx"),
    (lambda: jax_dg.contiguous_layout(jnp.zeros((4, 2), jnp.int32), 8, alignment=128, max_rows=100), "max_rows"),
    (lambda: jax_dg.masked_layout(jnp.zeros((4, 2), jnp.int32), 0, 8), "num_experts"),
    (lambda: jax_dg.masked_layout(jnp.zeros((4, 2), jnp.int32), 8, 0), "max_m"),
])
def test_bad_inputs_name_the_argument(call, arg):
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"`{arg}`")):
        call()


def _fp8_experts(w):
    vals, scales = zip(*(jax_dg.per_block_cast_to_fp8(w[e]) for e in range(w.shape[0])))
    return jnp.stack(vals), jnp.stack(scales)


def moe_through_grouped_gemms(x, w, ids, weights, g, *, masked_max_m=None, expected_m=1):
    """The MoE layer the helpers are for: route, quantise, DeepGEMM grouped GEMM, combine."""
    b = _fp8_experts(w)
    if masked_max_m is None:
        lay = jax_dg.contiguous_layout(ids, g)
        a = jax_dg.per_token_cast_to_fp8(jax_dg.permute_to_contiguous(x, lay))
        y = jax_dg.m_grouped_fp8_gemm_nt_contiguous(a, b, lay.grouped_layout)
        return jax_dg.combine_from_contiguous(y, lay, weights, out_dtype=jnp.float32)
    lay = jax_dg.masked_layout(ids, g, masked_max_m)
    xp = jax_dg.permute_to_masked(x, lay)
    a = jax.vmap(jax_dg.per_token_cast_to_fp8)(xp)
    y = jax_dg.m_grouped_fp8_gemm_nt_masked(a, b, lay.masked_m, expected_m)
    return jax_dg.combine_from_masked(y, lay, weights, out_dtype=jnp.float32)


@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_moe_layer_through_jax_dg_grouped_gemms(masked):
    if not hasattr(jax_dg, "m_grouped_fp8_gemm_nt_contiguous"):
        pytest.skip("jax_dg has no grouped GEMMs in this tree")
    t, k, g, h, n = 64, 4, 8, 256, 128
    ids, weights = routing(6, t, k, g)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, n, h)), jnp.bfloat16)
    f = jax.jit(lambda x, w, i, s: moe_through_grouped_gemms(x, w, i, s, g, masked_max_m=128 if masked else None,
                                                              expected_m=t * k // g))
    out = f(x, w, jnp.asarray(ids), jnp.asarray(weights))
    ref = numpy_moe(np.asarray(x, np.float32), np.asarray(w, np.float32), ids, weights)
    assert jax_dg.calc_diff(out, ref) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("t,k,g", [(1024, 8, 32), (4096, 8, 8)])
def test_gpu_moe_layer_on_deep_gemm(t, k, g, masked):
    h, n = 2048, 4096
    ids, weights = routing(t + g, t, k, g, drop=0.02, skew=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (t, h), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (g, n, h), jnp.bfloat16)
    max_m = -(-int(np.bincount(ids[ids >= 0], minlength=g).max()) // 128) * 128
    f = jax.jit(lambda x, w, i, s: moe_through_grouped_gemms(
        x, w, i, s, g, masked_max_m=max_m if masked else None, expected_m=t * k // g))
    out = f(x, w, jnp.asarray(ids), jnp.asarray(weights))
    with jax_dg.use_backend("xla"):
        ref = jax.jit(lambda x, w, i, s: moe_through_grouped_gemms(
            x, w, i, s, g, masked_max_m=max_m if masked else None, expected_m=t * k // g))(
            x, w, jnp.asarray(ids), jnp.asarray(weights))
    assert jax_dg.calc_diff(out, ref) < 1e-3
    first = np.asarray(out).tobytes()
    assert all(np.asarray(f(x, w, jnp.asarray(ids), jnp.asarray(weights))).tobytes() == first for _ in range(5))


# --- mk alignment -------------------------------------------------------------------------------

@pytest.fixture
def no_deep_gemm(monkeypatch):
    """The pure-Python path (what runs without deep_gemm), with the value restored after."""
    monkeypatch.setattr(routing_mod, "_dg", lambda name: None)
    prev = routing_mod._mk_alignment.get_global()
    yield
    routing_mod._mk_alignment.set_global(prev)


def test_mk_alignment_get_set_scope(no_deep_gemm):
    assert jax_dg.get_mk_alignment_for_contiguous_layout() == 128
    with jax_dg.mk_alignment_scope(256):
        assert jax_dg.get_mk_alignment_for_contiguous_layout() == 256
        with jax_dg.mk_alignment_scope(64):
            assert jax_dg.get_mk_alignment_for_contiguous_layout() == 64
        assert jax_dg.get_mk_alignment_for_contiguous_layout() == 256
    assert jax_dg.get_mk_alignment_for_contiguous_layout() == 128
    with pytest.raises(RuntimeError):
        with jax_dg.mk_alignment_scope(32):
            raise RuntimeError("inside")
    assert jax_dg.get_mk_alignment_for_contiguous_layout() == 128
    for bad in (0, -128, 1.5, True):
        with pytest.raises(ValueError):
            jax_dg.set_mk_alignment_for_contiguous_layout(bad)


@pytest.mark.parametrize("family,expected_m,num_groups,want", [
    (None, None, None, 128), (None, 4096, 8, 128), ("sm90", 100, None, 128),
    ("sm100", 10, None, 256), ("sm100", 100000, 64, 256),
    ("sm120", 64, None, 64), ("sm120", 65, None, 128), ("sm120", 512, 8, 64), ("sm120", 520, 8, 128),
    ("sm120", None, None, 128),
])
def test_theoretical_mk_alignment_table_without_deep_gemm(no_deep_gemm, monkeypatch, family,
                                                          expected_m, num_groups, want):
    from jax_dg.core import device
    monkeypatch.setattr(device, "family", lambda device=None: family)
    assert jax_dg.get_theoretical_mk_alignment_for_contiguous_layout(expected_m, num_groups) == want


def test_theoretical_mk_alignment_delegates_with_vllms_fallback(monkeypatch):
    calls = []

    def new_api(expected_m=None, num_groups=None):
        calls.append(("new", expected_m, num_groups))
        return 256

    def old_api(expected_m=None):
        calls.append(("old", expected_m))
        return 192

    for impl in (new_api, old_api):
        monkeypatch.setattr(routing_mod, "_dg", lambda name, impl=impl: impl)
        assert jax_dg.get_theoretical_mk_alignment_for_contiguous_layout(1000) == impl(1000)
        assert jax_dg.get_theoretical_mk_alignment_for_contiguous_layout(1000, 8) == impl(125)
    assert ("new", 1000, 8) in calls and ("old", 125) in calls  # TypeError -> per-group m
    with pytest.raises(ValueError):
        jax_dg.get_theoretical_mk_alignment_for_contiguous_layout(1000, 0)


def test_set_delegates_to_deep_gemm_when_present(monkeypatch):
    state = {"v": 128}
    fns = {"get_mk_alignment_for_contiguous_layout": lambda: state["v"],
           "set_mk_alignment_for_contiguous_layout": lambda v: state.update(v=v)}
    monkeypatch.setattr(routing_mod, "_dg", fns.get)
    prev = routing_mod._mk_alignment.get_global()
    try:
        with jax_dg.mk_alignment_scope(256):
            assert state["v"] == 256 and jax_dg.get_mk_alignment_for_contiguous_layout() == 256
        assert state["v"] == 128 and jax_dg.get_mk_alignment_for_contiguous_layout() == 128
        jax_dg.set_mk_alignment_for_contiguous_layout(64)
        assert state["v"] == 64 and jax_dg.get_mk_alignment_for_contiguous_layout() == 64
    finally:
        routing_mod._mk_alignment.set_global(prev)


def test_alignment_is_part_of_jits_cache_key(no_deep_gemm):
    """A function jitted once is traced again when the alignment changes (the padding is a static
    shape): in a scope, after it, and after a global set."""
    topk = jnp.asarray([[0], [1], [1]], jnp.int32)  # T 3, K 1, G 2
    f = jax.jit(lambda t: jax_dg.contiguous_layout(t, 2))
    assert f(topk).grouped_layout.shape == (384,)   # align(3 + 2 * 127, 128)
    with jax_dg.mk_alignment_scope(256):
        assert f(topk).grouped_layout.shape == (768,)
    assert f(topk).grouped_layout.shape == (384,)
    jax_dg.set_mk_alignment_for_contiguous_layout(64)
    lay = f(topk)
    assert lay.grouped_layout.shape == (192,)
    np.testing.assert_array_equal(np.asarray(lay.group_offsets), [0, 64])
    np.testing.assert_array_equal(np.asarray(lay.grouped_layout)[[0, 1, 63, 64, 65, 66]], [0, -1, -1, 1, 1, -1])


@pytest.mark.gpu
def test_gpu_mk_alignment_is_deep_gemms():
    import deep_gemm
    from jax_dg.core.device import family as arch_family
    assert jax_dg.get_mk_alignment_for_contiguous_layout() == deep_gemm.get_mk_alignment_for_contiguous_layout()
    expected = {"sm90": 128, "sm100": 256}.get(arch_family())
    got = jax_dg.get_theoretical_mk_alignment_for_contiguous_layout(4096, 8)
    assert expected is None or got == expected
    prev = deep_gemm.get_mk_alignment_for_contiguous_layout()
    with jax_dg.mk_alignment_scope(64):
        assert deep_gemm.get_mk_alignment_for_contiguous_layout() == 64
    assert deep_gemm.get_mk_alignment_for_contiguous_layout() == prev
