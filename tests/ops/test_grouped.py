"""Grouped GEMMs (MoE): m-grouped contiguous / masked (FP8, BF16) and k-grouped FP8.

CPU: the bridge path (torch emulation) against the pure-JAX reference under jit, with uneven,
empty and out-of-order groups, padding rows holding data, masked_m out of range, bad inputs.
GPU: DeepGEMM's test shapes and thresholds, bitwise equal to deep_gemm called from torch on the
defined rows, padding rows as jax_dg defines them (0).
"""

from __future__ import annotations

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.contracts import align
from tests.conftest import device_copies, digest, run, same_bits, to_torch

HIGHEST = jax.lax.Precision.HIGHEST


@jax.jit
def cast_a(x):
    """Per-token FP8 of [..., K] (2-D or 3-D)."""
    if x.ndim == 2:
        return jax_dg.per_token_cast_to_fp8(x)
    return jax.vmap(jax_dg.per_token_cast_to_fp8)(x)


def cast_b(w):
    """Per-block FP8 of each group of [G, N, K]."""
    return jax.jit(jax.vmap(jax_dg.per_block_cast_to_fp8))(w)


def contiguous_layout(ms, order=None, alignment=128):
    """Group ids per row: each group's ms[g] rows, then -1 up to a multiple of `alignment`, in `order`."""
    ids = []
    for g in (range(len(ms)) if order is None else order):
        ids += [g] * ms[g] + [-1] * (align(ms[g], alignment) - ms[g])
    return np.asarray(ids, np.int32)


def contiguous_expected(x, w, layout):
    """float32 rows x[r] @ w[layout[r]].T (0 for padding), computed per group on the device."""
    out = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
    for g in range(w.shape[0]):
        rows = np.flatnonzero(layout == g)
        if rows.size:
            seg = slice(rows[0], rows[-1] + 1)  # one contiguous segment per group
            out = out.at[seg].set(jnp.matmul(x[seg].astype(jnp.float32), w[g].astype(jnp.float32).T,
                                             precision=HIGHEST))
    return out


def masked_expected(x, w, masked_m):
    """float32 [G, Mmax, N]: x[g] @ w[g].T on rows < masked_m[g], 0 after (only those rows computed)."""
    masked_m = np.clip(np.asarray(masked_m), 0, x.shape[1])
    top = max(int(masked_m.max()), 1)
    d = jnp.einsum("gmk,gnk->gmn", x[:, :top].astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
    rows = np.arange(top)[None, :] < masked_m[:, None]
    d = jnp.where(rows[:, :, None], d, 0)
    return jnp.pad(d, ((0, 0), (0, x.shape[1] - top), (0, 0)))


@jax.jit
def device_diff(x, y):
    """calc_diff on the device (float32 sums): for outputs too large to bring to the host."""
    return jax_dg.calc_diff(x, y)


def rows_of(layout):
    return np.flatnonzero(np.asarray(layout) >= 0)


# --- CPU: m-grouped contiguous ---------------------------------------------------------------

MS = [130, 0, 57, 128]      # uneven, one empty group; padding rows follow 130 and 57
ORDERS = [None, [2, 0, 3, 1]]  # groups in id order, and out of order


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fp8", [True, False])
def test_contiguous_matches_reference(keys, fp8, order):
    n, k = 64, 192
    layout = jnp.asarray(contiguous_layout(MS, order))
    x = jax.random.normal(keys(), (layout.shape[0], k), jnp.bfloat16)  # padding rows hold data
    w = jax.random.normal(keys(), (len(MS), n, k), jnp.bfloat16)
    a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
    fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else jax_dg.m_grouped_bf16_gemm_nt_contiguous
    before = digest(a, b, layout)
    d = run("auto", fn, a, b, layout)
    assert digest(a, b, layout) == before, "inputs were written"
    assert d.shape == (layout.shape[0], n) and d.dtype == jnp.bfloat16
    ref = run("xla", fn, a, b, layout)
    np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7, atol=1e-2)
    assert jax_dg.calc_diff(d, ref) < 1e-6
    pad = np.asarray(layout) < 0
    assert not np.asarray(d, np.float32)[pad].any(), "padding rows must be 0"
    assert jax_dg.calc_diff(d, contiguous_expected(x, w, np.asarray(layout))) < (1e-3 if fp8 else 1e-5)


def test_contiguous_ids_outside_the_groups_are_padding(keys):
    n, k = 64, 128
    layout = contiguous_layout([128, 100])
    bad = layout.copy()
    bad[5], bad[130:140] = 7, -3  # an id >= G in group 0; ids < -1 in group 1
    x = jax.random.normal(keys(), (layout.shape[0], k), jnp.bfloat16)
    w = jax.random.normal(keys(), (2, n, k), jnp.bfloat16)
    d = run("auto", jax_dg.m_grouped_bf16_gemm_nt_contiguous, x, w, jnp.asarray(bad))
    as_padding = np.where((bad >= 0) & (bad < 2), bad, -1)
    np.testing.assert_array_equal(
        np.asarray(d), np.asarray(run("auto", jax_dg.m_grouped_bf16_gemm_nt_contiguous, x, w,
                                      jnp.asarray(as_padding))))
    assert not np.asarray(d, np.float32)[[5, *range(130, 140)]].any()


def test_contiguous_unclean_keeps_the_defined_rows(keys):
    layout = jnp.asarray(contiguous_layout([70, 128]))
    x = jax.random.normal(keys(), (layout.shape[0], 128), jnp.bfloat16)
    w = jax.random.normal(keys(), (2, 64, 128), jnp.bfloat16)
    f = jax_dg.m_grouped_bf16_gemm_nt_contiguous
    d = run("auto", lambda *a: f(*a, clean=False), x, w, layout)
    ref = run("xla", f, x, w, layout)
    valid = rows_of(layout)
    np.testing.assert_array_equal(np.asarray(d)[valid], np.asarray(ref)[valid])


def test_contiguous_with_no_rows(keys):
    a = (jnp.zeros((0, 128), jnp.float8_e4m3fn), jnp.zeros((0, 1), jnp.float32))
    b = cast_b(jax.random.normal(keys(), (2, 64, 128), jnp.bfloat16))
    d = run("auto", jax_dg.m_grouped_fp8_gemm_nt_contiguous, a, b, jnp.zeros((0,), jnp.int32))
    assert d.shape == (0, 64)


def test_contiguous_follows_the_mk_alignment(keys, monkeypatch):
    """Layouts padded to another alignment: checked against it while tracing, and the backend's
    BLOCK_M cap is set to it when the kernel runs (here the torch emulation records it)."""
    from jax_dg.operands import routing as layout_mod
    from jax_dg.backends import torch_emu
    monkeypatch.setattr(layout_mod, "_dg", lambda name: None)  # jax_dg's value alone
    layout = jnp.asarray(contiguous_layout([70, 0, 20], alignment=64))  # M = 128 + 64
    x = jax.random.normal(keys(), (layout.shape[0], 128), jnp.bfloat16)
    w = jax.random.normal(keys(), (3, 64, 128), jnp.bfloat16)
    f = jax.jit(jax_dg.m_grouped_bf16_gemm_nt_contiguous)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape("`a` must have M % 128 == 0")):
        f(x, w, layout)
    try:
        with jax_dg.mk_alignment_scope(64):
            d = jax.block_until_ready(f(x, w, layout))
            assert torch_emu.get_mk_alignment_for_contiguous_layout() == 64
            ref = run("xla", jax_dg.m_grouped_bf16_gemm_nt_contiguous, x, w, layout)
        assert jax_dg.calc_diff(d, ref) < 1e-6
        assert jax_dg.calc_diff(d, contiguous_expected(x, w, np.asarray(layout))) < 1e-5
        with pytest.raises(jax_dg.ArgumentError, match=re.escape("get_mk_alignment_for_contiguous_layout() = 128")):
            f(x, w, layout)  # traced again outside the scope
    finally:
        torch_emu.set_mk_alignment_for_contiguous_layout(128)


def test_contiguous_call_sets_deep_gemms_alignment_only_when_it_differs():
    from jax_dg.ops.grouped import _use_alignment
    calls = []
    k = types.SimpleNamespace(get_mk_alignment_for_contiguous_layout=lambda: 128,
                              set_mk_alignment_for_contiguous_layout=calls.append)
    _use_alignment(k, 128)
    assert calls == []
    _use_alignment(k, 64)
    assert calls == [64]


# --- CPU: m-grouped masked -------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [True, False])
def test_masked_matches_reference(keys, fp8):
    g, max_m, n, k = 5, 128, 64, 192
    masked_m = jnp.asarray([37, 0, 128, 200, -4], jnp.int32)  # uneven, empty, full, > Mmax, < 0
    x = jax.random.normal(keys(), (g, max_m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (g, n, k), jnp.bfloat16)
    a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
    fn = jax_dg.m_grouped_fp8_gemm_nt_masked if fp8 else jax_dg.m_grouped_bf16_gemm_nt_masked
    f = lambda a, b, m: fn(a, b, m, 48)  # noqa: E731
    before = digest(a, b, masked_m)
    d = run("auto", f, a, b, masked_m)
    assert digest(a, b, masked_m) == before, "inputs were written"
    assert d.shape == (g, max_m, n) and d.dtype == jnp.bfloat16
    ref = run("xla", f, a, b, masked_m)
    np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7, atol=1e-2)
    expected = masked_expected(x, w, np.minimum(np.asarray(masked_m), max_m))
    assert jax_dg.calc_diff(d, expected) < (1e-3 if fp8 else 1e-5)
    dn = np.asarray(d, np.float32)
    assert not dn[0, 37:].any() and not dn[1].any() and not dn[4].any(), "rows past masked_m must be 0"


def test_masked_old_name_and_vmap(keys):
    assert jax_dg.fp8_m_grouped_gemm_nt_masked is jax_dg.m_grouped_fp8_gemm_nt_masked
    x = jax.random.normal(keys(), (2, 2, 128, 64), jnp.bfloat16)
    w = jax.random.normal(keys(), (2, 64, 64), jnp.bfloat16)
    masked_m = jnp.asarray([[3, 128], [0, 77]], jnp.int32)
    f = jax.vmap(lambda x, m: jax_dg.m_grouped_bf16_gemm_nt_masked(x, w, m, 64))  # sequential
    d = jax.jit(f)(x, masked_m)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(d[i]), np.asarray(run("auto", lambda x, m: jax_dg.m_grouped_bf16_gemm_nt_masked(
                x, w, m, 64), x[i], masked_m[i])))


# --- CPU: k-grouped --------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=1)
def k_grouped_pack(v, ks):
    """[sum(ks), MN] -> per-channel FP8 (128 along K), each group row-major [MN, K_g], flattened."""
    q, s = jax_dg.per_token_cast_to_fp8(v.T)
    q, off, flat = q.T, 0, []
    for kg in ks:
        flat.append(q[off:off + kg].T.reshape(-1))
        off += kg
    return jnp.concatenate(flat), s.T


def k_grouped_inputs(keys, ks, m, n):
    """DeepGEMM's generate_k_grouped_contiguous, K-major: returns (a, b, x, y) with x [sum(ks), M]."""
    x = jax.random.normal(keys(), (sum(ks), m), jnp.bfloat16)
    y = jax.random.normal(keys(), (sum(ks), n), jnp.bfloat16)
    return k_grouped_pack(x, tuple(ks)), k_grouped_pack(y, tuple(ks)), x, y


def k_grouped_expected(x, y, c, ks):
    out, off = [], 0
    for g, kg in enumerate(ks):
        out.append(c[g] + jnp.matmul(x[off:off + kg].astype(jnp.float32).T,
                                     y[off:off + kg].astype(jnp.float32), precision=HIGHEST))
        off += kg
    return jnp.stack(out)


def test_k_grouped_matches_reference(keys):
    ks, m, n = [256, 0, 128, 384], 64, 96
    a, b, x, y = k_grouped_inputs(keys, ks, m, n)
    c = jax.random.normal(keys(), (len(ks), m, n), jnp.float32) * 32
    f = lambda a, b, c: jax_dg.k_grouped_fp8_gemm_nt_contiguous(a, b, ks, c=c)  # noqa: E731
    before = digest(a, b, c)
    d = run("auto", f, a, b, c)
    assert digest(a, b, c) == before, "inputs were written"
    assert d.shape == (len(ks), m, n) and d.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(d), np.asarray(run("xla", f, a, b, c)), rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(d[1]), np.asarray(c[1]))  # empty group: d = c
    assert jax_dg.calc_diff(d, k_grouped_expected(x, y, c, ks)) < 1e-3
    donated = jax.jit(f, donate_argnums=2)(a, b, c + 0)
    np.testing.assert_array_equal(np.asarray(donated), np.asarray(d))


# --- CPU: bad inputs -------------------------------------------------------------------------

def _fp8_contiguous(keys):
    layout = jnp.asarray(contiguous_layout([100, 128]))
    a = cast_a(jax.random.normal(keys(), (layout.shape[0], 128), jnp.bfloat16))
    b = cast_b(jax.random.normal(keys(), (2, 64, 128), jnp.bfloat16))
    return a, b, layout


@pytest.mark.parametrize("case,arg", [
    ("m_align", "a[0]"), ("layout_dtype", "grouped_layout"), ("layout_shape", "grouped_layout"),
    ("sfb_shape", "b[1]"), ("k_mismatch", "a[0]"), ("n_align", "b[0]"), ("b_rank", "b[0]"),
    ("not_a_pair", "b"),
])
def test_contiguous_bad_inputs(keys, case, arg):
    a, b, layout = _fp8_contiguous(keys)
    if case == "m_align":
        a, layout = (a[0][:200], a[1][:200]), layout[:200]
    elif case == "layout_dtype":
        layout = layout.astype(jnp.float32)
    elif case == "layout_shape":
        layout = layout[:128]
    elif case == "sfb_shape":
        b = (b[0], b[1][:, :, :0])
    elif case == "k_mismatch":
        a = (a[0][:, :64], a[1])
    elif case == "n_align":
        b = (b[0][:, :60], b[1])
    elif case == "b_rank":
        b = (b[0][0], b[1][0])
    elif case == "not_a_pair":
        b = b[0]
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"m_grouped_fp8_gemm_nt_contiguous: `{arg}`")):
        jax.jit(jax_dg.m_grouped_fp8_gemm_nt_contiguous).trace(a, b, layout)


@pytest.mark.parametrize("name,case,arg", [
    ("m_grouped_fp8_gemm_nt_masked", "max_m_align", "a[0]"),
    ("m_grouped_fp8_gemm_nt_masked", "groups", "a[0]"),
    ("m_grouped_fp8_gemm_nt_masked", "masked_m_shape", "masked_m"),
    ("m_grouped_fp8_gemm_nt_masked", "expected_m", "expected_m"),
    ("m_grouped_bf16_gemm_nt_masked", "k_align", "a"),
    ("m_grouped_bf16_gemm_nt_masked", "masked_m_dtype", "masked_m"),
    ("m_grouped_bf16_gemm_nt_contiguous", "dtype", "a"),
])
def test_masked_and_bf16_bad_inputs(keys, name, case, arg):
    x = jax.random.normal(keys(), (2, 128, 128), jnp.bfloat16)
    w = jax.random.normal(keys(), (2, 64, 128), jnp.bfloat16)
    fp8 = "fp8" in name
    a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
    masked_m, expected_m = jnp.asarray([5, 9], jnp.int32), 8
    fn = getattr(jax_dg, name)
    args = lambda: (a, b, masked_m)  # noqa: E731
    if case == "max_m_align":
        a = (a[0][:, :96], a[1][:, :96])
    elif case == "groups":
        a = (a[0][:1], a[1][:1])
    elif case == "masked_m_shape":
        masked_m = masked_m[:1]
    elif case == "expected_m":
        expected_m = 0
    elif case == "k_align":
        a, b = a[..., :96], b[..., :96]
    elif case == "masked_m_dtype":
        masked_m = masked_m.astype(jnp.float32)
    elif case == "dtype":
        args = lambda: (x[0].astype(jnp.float32), w, jnp.zeros((128,), jnp.int32))  # noqa: E731
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"{name}: `{arg}`")):
        if "masked" in name:
            jax.jit(lambda a, b, m: fn(a, b, m, expected_m)).trace(*args())
        else:
            jax.jit(fn).trace(*args())


@pytest.mark.parametrize("case,arg", [
    ("ks_align", "ks"), ("ks_len", "c"), ("a_size", "a[0]"), ("sfb_shape", "b[1]"),
    ("c_missing", "c"), ("c_dtype", "c"), ("ks_not_list", "ks"),
])
def test_k_grouped_bad_inputs(keys, case, arg):
    ks, m, n = [128, 256], 64, 32
    a, b, _, _ = k_grouped_inputs(keys, ks, m, n)
    c = jnp.zeros((2, m, n), jnp.float32)
    if case == "ks_align":
        ks = [64, 320]
    elif case == "ks_len":
        ks = [128, 128, 128]
    elif case == "a_size":
        a = (a[0][:-16], a[1])
    elif case == "sfb_shape":
        b = (b[0], b[1].T)
    elif case == "c_missing":
        c = None
    elif case == "c_dtype":
        c = c.astype(jnp.bfloat16)
    elif case == "ks_not_list":
        ks = 384
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"k_grouped_fp8_gemm_nt_contiguous: `{arg}`")):
        jax.jit(lambda a, b, c: jax_dg.k_grouped_fp8_gemm_nt_contiguous(a, b, ks, c=c)).trace(a, b, c)


# --- GPU: DeepGEMM's test shapes (generate_m_grouped_contiguous / _masked / k_grouped) --------
# Outputs here are 0.5-1 GB: every comparison runs on the device (torch.equal on zero-copy views,
# calc_diff in float32 sums) so the tests spend their time in the kernels, not in host copies.

def _torch_pair(p):
    return to_torch(p[0]), to_torch(p[1])


def _equal_on(rows, ours, theirs_t):
    """Bitwise equality of a jax and a torch array on the rows where `rows` (a torch bool mask) holds."""
    import torch
    ours_t = to_torch(jax.block_until_ready(ours))
    return bool(torch.equal(ours_t[rows].view(torch.int16), theirs_t[rows].view(torch.int16)))


@jax.jit
def _masked_group_diffs(d, expected, masked_m):
    """calc_diff per group over its first masked_m[g] rows; and whether any later row is nonzero."""
    rows = (jnp.arange(d.shape[1])[None, :] < masked_m[:, None])[:, :, None]
    d32 = d.astype(jnp.float32)
    diffs = jax.vmap(jax_dg.calc_diff)(jnp.where(rows, d32, 0), jnp.where(rows, expected, 0))
    return diffs, jnp.any(jnp.where(rows, 0, d32) != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,g,expected_m,n,k", [
    (True, 4, 8192, 6144, 7168), (True, 8, 4096, 4096, 2048), (False, 8, 4096, 4096, 4096),
])
def test_gpu_contiguous_matches_deep_gemm_from_torch(keys, fp8, g, expected_m, n, k):
    import deep_gemm
    import torch
    rng = np.random.default_rng(g * expected_m + n)
    ms = [int(expected_m * rng.uniform(0.7, 1.3)) for _ in range(g)]
    layout_np = contiguous_layout(ms)
    layout = jnp.asarray(layout_np)
    m = layout_np.shape[0]
    # Unlike DeepGEMM's generator, padding rows hold data: jax_dg must still return 0 there.
    x = jax.random.normal(keys(), (m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (g, n, k), jnp.bfloat16)
    a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
    fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else jax_dg.m_grouped_bf16_gemm_nt_contiguous
    f = jax.jit(fn)
    inputs = device_copies(a, b, layout)
    d = f(a, b, layout)
    valid = rows_of(layout_np)
    assert float(device_diff(d[valid], contiguous_expected(x, w, layout_np)[valid])) < (1e-3 if fp8 else 1e-5)
    assert not bool(jnp.any(d[layout_np < 0] != 0)), "padding rows must be 0"
    d_t = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    if fp8:
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(_torch_pair(a), _torch_pair(b), d_t, to_torch(layout))
    else:
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(to_torch(a), to_torch(b), d_t, to_torch(layout))
    torch.cuda.synchronize()
    assert _equal_on(to_torch(layout) >= 0, d, d_t), "defined rows differ from deep_gemm's"
    assert all(bool(same_bits(f(a, b, layout), d)) for _ in range(20))
    assert bool(same_bits(inputs, (a, b, layout))), "inputs were written"


@pytest.mark.gpu
def test_gpu_contiguous_at_another_mk_alignment(keys):
    """A layout padded to 64 under mk_alignment_scope(64): DeepGEMM is set to 64 when the op runs
    (after the alignment went back to 128 in between) and matches deep_gemm from torch at 64."""
    import deep_gemm
    import torch
    g, n, k = 4, 4096, 7168
    ms = [100, 0, 37, 64]
    layout_np = contiguous_layout(ms, alignment=64)
    layout = jnp.asarray(layout_np)
    x = jax.random.normal(keys(), (layout_np.shape[0], k), jnp.bfloat16)
    w = jax.random.normal(keys(), (g, n, k), jnp.bfloat16)
    a, b = cast_a(x), cast_b(w)
    f = jax.jit(jax_dg.m_grouped_fp8_gemm_nt_contiguous)
    prev = deep_gemm.get_mk_alignment_for_contiguous_layout()
    with jax_dg.mk_alignment_scope(64):
        compiled = f.lower(a, b, layout).compile()  # traced at 64
    assert deep_gemm.get_mk_alignment_for_contiguous_layout() == prev
    d = jax.block_until_ready(compiled(a, b, layout))
    valid = rows_of(layout_np)
    assert float(device_diff(d[valid], contiguous_expected(x, w, layout_np)[valid])) < 1e-3
    d_t = torch.empty((layout_np.shape[0], n), dtype=torch.bfloat16, device="cuda")
    try:
        deep_gemm.set_mk_alignment_for_contiguous_layout(64)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(_torch_pair(a), _torch_pair(b), d_t, to_torch(layout))
        torch.cuda.synchronize()
    finally:
        deep_gemm.set_mk_alignment_for_contiguous_layout(prev)
    assert _equal_on(to_torch(layout) >= 0, d, d_t), "defined rows differ from deep_gemm's at alignment 64"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,g,expected_m,n,k", [
    (True, 32, 192, 4096, 7168), (True, 6, 1024, 7168, 3072), (True, 32, 20, 4096, 2048),
    (False, 6, 1024, 4096, 4096),
])
def test_gpu_masked_matches_deep_gemm_from_torch(keys, fp8, g, expected_m, n, k):
    import deep_gemm
    import torch
    max_m = 4096
    rng = np.random.default_rng(g * expected_m + n)
    masked_np = np.asarray([int(expected_m * rng.uniform(0.7, 1.3)) for _ in range(g)], np.int32)
    masked_m = jnp.asarray(masked_np)
    x = jax.random.normal(keys(), (g, max_m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (g, n, k), jnp.bfloat16)
    a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
    hint = int(expected_m * 1.2) if fp8 else expected_m  # what DeepGEMM's test passes
    fn = jax_dg.m_grouped_fp8_gemm_nt_masked if fp8 else jax_dg.m_grouped_bf16_gemm_nt_masked
    f = jax.jit(lambda a, b, mm: fn(a, b, mm, hint))
    inputs = device_copies(a, b, masked_m)
    d = f(a, b, masked_m)
    diffs, dirty = _masked_group_diffs(d, masked_expected(x, w, masked_np), masked_m)
    assert (np.asarray(diffs) < (1e-3 if fp8 else 1e-5)).all(), np.asarray(diffs)
    assert not bool(dirty), "rows past masked_m must be 0"
    d_t = torch.empty((g, max_m, n), dtype=torch.bfloat16, device="cuda")
    if fp8:
        deep_gemm.m_grouped_fp8_gemm_nt_masked(_torch_pair(a), _torch_pair(b), d_t, to_torch(masked_m), hint)
    else:
        deep_gemm.m_grouped_bf16_gemm_nt_masked(to_torch(a), to_torch(b), d_t, to_torch(masked_m), hint)
    torch.cuda.synchronize()
    rows = torch.arange(max_m, device="cuda")[None, :] < to_torch(masked_m)[:, None]
    assert _equal_on(rows, d, d_t), "rows below masked_m differ from deep_gemm's"
    assert all(bool(same_bits(f(a, b, masked_m), d)) for _ in range(20))
    assert bool(same_bits(inputs, (a, b, masked_m))), "inputs were written"


def k_group_sizes(g, m, expected_k, empty):
    """DeepGEMM's k-grouped generator: each group's K ~ expected_k x U(0.7, 1.3), aligned to 128;
    with `empty`, one group gets K = 0."""
    rng = np.random.default_rng(g * m + expected_k)
    ks = [align(int(expected_k * rng.uniform(0.7, 1.3)), 128) for _ in range(g)]
    if empty:
        ks[int(rng.integers(g))] = 0
    return ks


@pytest.mark.gpu
@pytest.mark.parametrize("g,m,n,expected_k,empty", [(4, 4096, 7168, 8192, False), (8, 4096, 7168, 4096, True)])
def test_gpu_k_grouped_matches_deep_gemm_from_torch(keys, g, m, n, expected_k, empty):
    import deep_gemm
    import torch
    ks = k_group_sizes(g, m, expected_k, empty)
    a, b, x, y = k_grouped_inputs(keys, ks, m, n)
    c = jax.random.normal(keys(), (g, m, n), jnp.float32) * 32
    f = jax.jit(lambda a, b, c: jax_dg.k_grouped_fp8_gemm_nt_contiguous(a, b, ks, c=c))
    inputs = device_copies(a, b, c)
    d = f(a, b, c)
    assert float(device_diff(d, k_grouped_expected(x, y, c, ks))) < 1e-3
    d_t = to_torch(c).clone()
    deep_gemm.k_grouped_fp8_gemm_nt_contiguous(
        (to_torch(a[0]), to_torch(a[1]).T), (to_torch(b[0]), to_torch(b[1]).T), d_t, ks,
        torch.tensor(ks, dtype=torch.int32, device="cuda"), c=d_t)
    torch.cuda.synchronize()
    assert bool(torch.equal(to_torch(jax.block_until_ready(d)), d_t)), "differs from deep_gemm's"
    assert all(bool(same_bits(f(a, b, c), d)) for _ in range(20))
    assert bool(same_bits(inputs, (a, b, c))), "inputs were written"


# --- which rows DeepGEMM writes, and jax_dg's cleaning kernels (kernels/zero_rows.cu) ----------

@pytest.mark.parametrize("skip", [False, True])
def test_zero_padding_rows_reference_contract(skip):
    """The specification of the contiguous cleaning kernel: rows with id < 0 become 0, except,
    with skip, in blocks whose first id is < 0; nothing else is touched."""
    import torch
    from tests import own_kernels_oracle as torch_emu
    layout = torch.tensor([0, 0, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1], dtype=torch.int32)
    d = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8) + 1
    want = d.clone()
    pad = layout < 0
    if skip:
        pad[4:8] = False          # the block [4, 8) starts with padding
    want[pad] = 0
    torch_emu.zero_padding_rows(d, layout, 4, skip)
    assert torch.equal(d, want)


def test_zero_masked_tail_reference_contract():
    import torch
    from tests import own_kernels_oracle as torch_emu
    d = torch.arange(3 * 4 * 8, dtype=torch.float32).reshape(3, 4, 8) + 1
    masked_m = torch.tensor([0, 3, 4], dtype=torch.int32)
    want = d.clone()
    want[0] = 0
    want[1, 3:] = 0
    torch_emu.zero_masked_tail(d, masked_m)
    assert torch.equal(d, want)


def test_combine_reads_only_routed_rows():
    """combine_from_contiguous / _masked gather routed rows only: NaN in every other row of the
    GEMM output (what clean=False may leave there) never reaches the result."""
    topk_idx = jnp.asarray([[0, 2], [1, -1], [2, 0]], jnp.int32)
    w = jnp.asarray([[0.5, 0.5], [1.0, 0.3], [0.25, 0.75]], jnp.float32)
    lay = jax_dg.contiguous_layout(topk_idx, 3, alignment=4)
    y = jnp.where((lay.grouped_layout >= 0)[:, None], jnp.ones((1, 8)) * (lay.grouped_layout[:, None] + 1),
                  jnp.nan)
    out = jax_dg.combine_from_contiguous(y, lay, w)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out[:, 0]), [0.5 * 1 + 0.5 * 3, 1.0 * 2, 0.25 * 3 + 0.75 * 1])
    mlay = jax_dg.masked_layout(topk_idx, 3, 4)
    rows = jnp.arange(4)[None, :] < mlay.masked_m[:, None]
    ym = jnp.where(rows[:, :, None], jnp.arange(1, 4, dtype=jnp.float32)[:, None, None] * jnp.ones(8), jnp.nan)
    np.testing.assert_array_equal(np.asarray(jax_dg.combine_from_masked(ym, mlay, w)), np.asarray(out))


def _nan_filled(shape):
    import torch
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")


def _is_nan_row(d):
    import torch
    return torch.isnan(d.float()).any(dim=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
def test_gpu_which_padding_rows_deep_gemm_writes(keys, fp8):
    """Establishes, bitwise, what jax_dg's clean=True relies on (SM90). Contiguous: DeepGEMM
    writes every row; padding rows inside a block with routed rows are a[r] @ b[g].T (0 exactly
    where a's rows are 0); the rows of a block that starts with padding are 0 with FP8 whatever
    a holds, and computed with BF16. Masked: rows below masked_m are written, whole blocks past
    it are not (stale memory: what the masked cleaning zeroes)."""
    import deep_gemm
    import torch
    g, n, k = 6, 1024, 1024
    ms = [130, 0, 64, 1, 255, 384]
    layout_np = np.concatenate([contiguous_layout(ms), np.full(256, -1, np.int32)])  # a padding tail
    layout = to_torch(jnp.asarray(layout_np))
    m = layout_np.shape[0]
    pad = layout < 0
    head = (layout.view(-1, 128)[:, 0] < 0).repeat_interleave(128)  # rows of blocks starting with padding
    w = jax.random.normal(keys(), (g, n, k), jnp.bfloat16)
    b = cast_b(w) if fp8 else w
    for zero_padding in (False, True):
        x = jax.random.normal(keys(), (m, k), jnp.bfloat16)
        if zero_padding:
            x = jnp.where(jnp.asarray(layout_np)[:, None] >= 0, x, 0)
        a = cast_a(x) if fp8 else x
        d = _nan_filled((m, n))
        if fp8:
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(_torch_pair(a), _torch_pair(b), d, layout)
        else:
            deep_gemm.m_grouped_bf16_gemm_nt_contiguous(to_torch(a), to_torch(b), d, layout)
        torch.cuda.synchronize()
        assert not bool(_is_nan_row(d).any()), "DeepGEMM left contiguous rows unwritten"
        nonzero = (d != 0).any(dim=-1)
        if zero_padding:
            assert not bool((nonzero & pad).any()), "zero padding rows of a gave nonzero rows"
        else:   # padding rows in routed blocks are computed: the reason clean=True exists
            assert bool((nonzero & pad & ~head).any())
            # FP8 stores zeros for blocks that start with padding; BF16 computes those rows too
            # (what jax_dg's _SKIP_PADDING_BLOCKS records)
            assert bool((nonzero & pad & head).any()) == (not fp8), "padding blocks' rows"
            fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else jax_dg.m_grouped_bf16_gemm_nt_contiguous
            ours = to_torch(jax.block_until_ready(jax.jit(fn)(a, b, jnp.asarray(layout_np))))
            assert not bool((ours[pad] != 0).any()), "jax_dg left a padding row nonzero"
            assert torch.equal(ours[~pad].view(torch.int16), d[~pad].view(torch.int16))

    masked_np = np.asarray([0, 1, 200, 511, 512, 300], np.int32)
    max_m = 512
    x = jax.random.normal(keys(), (g, max_m, k), jnp.bfloat16)
    a = cast_a(x) if fp8 else x
    d = _nan_filled((g, max_m, n))
    mm = to_torch(jnp.asarray(masked_np))
    if fp8:
        deep_gemm.m_grouped_fp8_gemm_nt_masked(_torch_pair(a), _torch_pair(b), d, mm, 256)
    else:
        deep_gemm.m_grouped_bf16_gemm_nt_masked(to_torch(a), to_torch(b), d, mm, 256)
    torch.cuda.synchronize()
    unwritten = _is_nan_row(d)
    below = torch.arange(max_m, device="cuda")[None, :] < mm[:, None]
    assert not bool((unwritten & below).any()), "rows below masked_m left unwritten"
    assert bool(unwritten[0].all()), "an empty group's rows were written"
    assert bool(unwritten[2, 256:].all()), "rows past masked_m's last block were written"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
def test_gpu_clean_false_is_exact_on_zero_padding(keys, fp8):
    """With a's padding rows 0 (routing.permute_to_contiguous), clean=False gives the same bits
    as clean=True: the select/cleaning is unnecessary there."""
    g, n, k = 4, 2048, 1024
    layout_np = contiguous_layout([100, 0, 300, 7])
    x = jax.random.normal(keys(), (layout_np.shape[0], k), jnp.bfloat16)
    x = jnp.where(jnp.asarray(layout_np)[:, None] >= 0, x, 0)
    w = jax.random.normal(keys(), (g, n, k), jnp.bfloat16)
    a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
    fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else jax_dg.m_grouped_bf16_gemm_nt_contiguous
    layout = jnp.asarray(layout_np)
    clean = jax.jit(fn)(a, b, layout)
    raw = jax.jit(lambda a, b, l: fn(a, b, l, clean=False))(a, b, layout)
    assert bool(same_bits(clean, raw))
