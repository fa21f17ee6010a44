"""mqa_logits (non-paged MQA logits) and the sparse variant: the bridge path against the pure-JAX
reference, output forms, bad inputs, and (GPU) DeepGEMM called from torch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.reference import mqa as ref
from tests.conftest import bits, digest, to_torch, run

FP8 = jnp.float8_e4m3fn
NEG_INF = -np.inf


def make_inputs(keys, m, n, h, d):
    q = jax.random.normal(keys(), (m, h, d), jnp.bfloat16).astype(FP8)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(keys(), (n, d), jnp.bfloat16))
    w = jax.random.normal(keys(), (m, h), jnp.float32)
    return (q, None), kv, w


def varied_ranges(keys, m, n):
    """ks/ke with empty rows (ke == ks, at 0 and mid-range), a full row, one-key rows and rows
    ending at N."""
    rng = np.random.default_rng(int(jax.random.randint(keys(), (), 0, 2 ** 31 - 1)))
    ks = rng.integers(0, n, m)
    ke = np.minimum(ks + rng.integers(0, n, m), n)
    ks[0], ke[0] = 0, n          # everything
    ks[1], ke[1] = 0, 0          # empty at 0
    ks[2] = ke[2] = n // 2       # empty mid-range
    ks[3], ke[3] = n - 1, n      # the last key only
    ke[4] = n
    ks[5], ke[5] = 7, 8
    return jnp.asarray(ks, jnp.int32), jnp.asarray(ke, jnp.int32)


def valid_of(ks, ke, width, compressed):
    ks, ke = np.asarray(ks)[:, None], np.asarray(ke)[:, None]
    pos = np.arange(width)[None, :]
    return pos < ke - ks if compressed else (pos >= ks) & (pos < ke)


def assert_close_on(valid, out, expect):
    out, expect = np.asarray(out), np.asarray(expect)
    assert np.isfinite(out[valid]).all()
    np.testing.assert_allclose(out[valid], expect[valid], rtol=1e-5, atol=1e-4)
    assert jax_dg.calc_diff(out[valid], expect[valid]) < 1e-10


# --- CPU: bridge (torch emulation through the FFI) vs the pure-JAX reference ----------------------

@pytest.mark.parametrize("h,d", [(32, 64), (64, 128), (32, 128), (64, 64)])
@pytest.mark.parametrize("compressed", [False, True])
def test_matches_reference_under_jit(keys, h, d, compressed):
    m, n = 41, 300
    q, kv, w = make_inputs(keys, m, n, h, d)
    ks, ke = varied_ranges(keys, m, n)
    msk = int((ke - ks).max()) if compressed else None
    f = lambda q, kv, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=msk)  # noqa: E731
    before = digest(q, kv, w, ks, ke)
    out = run("auto", f, q, kv, w, ks, ke)
    expect = run("xla", f, q, kv, w, ks, ke)
    assert digest(q, kv, w, ks, ke) == before, "inputs were written"
    assert out.shape == (m, msk or n) and out.dtype == jnp.float32
    valid = valid_of(ks, ke, msk or n, compressed)
    np.testing.assert_array_equal(np.asarray(out) == NEG_INF, ~valid)   # -inf exactly where invalid
    np.testing.assert_array_equal(np.asarray(expect) == NEG_INF, ~valid)
    assert_close_on(valid, out, expect)
    # Independent of both: the formula on dequantised inputs, in numpy float64.
    qf = np.asarray(q[0], np.float64)
    kf = np.asarray(kv[0], np.float64) * np.asarray(kv[1], np.float64)[:, None]
    scores = np.maximum((qf.reshape(m * h, d) @ kf.T).reshape(m, h, n), 0)
    full = np.einsum("mhn,mh->mn", scores, np.asarray(w, np.float64), optimize=True)
    if compressed:
        pos = np.clip(np.asarray(ks)[:, None] + np.arange(msk)[None, :], 0, n - 1)
        full = np.take_along_axis(full, pos, axis=1)
    assert jax_dg.calc_diff(np.asarray(out)[valid], full[valid]) < 1e-9


def test_compressed_columns_are_the_full_values_bitwise(keys):
    m, n = 33, 500
    q, kv, w = make_inputs(keys, m, n, 64, 128)
    ks, ke = varied_ranges(keys, m, n)
    msk = int((ke - ks).max())
    full = np.asarray(run("auto", jax_dg.mqa_logits, q, kv, w, ks, ke))
    comp = np.asarray(run("auto", lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk), q, kv, w, ks, ke))
    valid = valid_of(ks, ke, msk, True)
    pos = np.clip(np.asarray(ks)[:, None] + np.arange(msk)[None, :], 0, n - 1)
    np.testing.assert_array_equal(comp[valid], np.take_along_axis(full, pos, axis=1)[valid])


@pytest.mark.parametrize("compressed", [False, True])
def test_clean_logits_false_keeps_valid_positions(keys, compressed):
    m, n = 40, 260
    q, kv, w = make_inputs(keys, m, n, 32, 128)
    ks, ke = varied_ranges(keys, m, n)
    msk = int((ke - ks).max()) if compressed else None
    dirty = run("auto", lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk, clean_logits=False),
                q, kv, w, ks, ke)
    clean = run("auto", lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk), q, kv, w, ks, ke)
    expect = run("xla", lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk, clean_logits=False),
                 q, kv, w, ks, ke)
    valid = valid_of(ks, ke, msk or n, compressed)
    np.testing.assert_array_equal(np.asarray(dirty)[valid], np.asarray(clean)[valid])
    assert_close_on(valid, dirty, expect)


def test_seed_call_shape(keys):
    m, n = 24, 200
    q, kv, w = make_inputs(keys, m, n, 64, 64)
    ks, ke = varied_ranges(keys, m, n)
    msk = int((ke - ks).max())
    a = run("auto", lambda *x: jax_dg.fp8_fp4_mqa_logits(*x, msk), q, kv, w, ks, ke)
    b = run("auto", lambda *x: jax_dg.mqa_logits(*x, max_seqlen_k=msk), q, kv, w, ks, ke)
    assert bits(a) == bits(b) and a.shape == (m, msk)
    full = run("auto", lambda *x: jax_dg.fp8_fp4_mqa_logits(*x, None), q, kv, w, ks, ke)
    assert full.shape == (m, n)


def test_compressed_rows_longer_than_max_seqlen_k_keep_their_first_keys(keys):
    m, n = 16, 256
    q, kv, w = make_inputs(keys, m, n, 32, 64)
    ks = jnp.zeros((m,), jnp.int32).at[3].set(10)
    ke = jnp.full((m,), n, jnp.int32).at[5].set(20)
    msk = 64
    f = lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk)  # noqa: E731
    out, expect = run("auto", f, q, kv, w, ks, ke), run("xla", f, q, kv, w, ks, ke)
    valid = valid_of(ks, jnp.minimum(ke, ks + msk), msk, True)
    np.testing.assert_array_equal(np.asarray(out) == NEG_INF, ~valid)
    assert_close_on(valid, out, expect)


def test_q_scale_is_folded_into_weights(keys):
    m, n, h, d = 20, 128, 32, 64
    x = jax.random.normal(keys(), (m * h, d), jnp.float32)
    qv, qs = jax_dg.per_row_cast_to_fp8(x, use_ue8m0=True)   # power-of-two scales: exact fold
    qv, qs = qv.reshape(m, h, d), qs.reshape(m, h)
    _, kv, w = make_inputs(keys, m, n, h, d)
    ks, ke = varied_ranges(keys, m, n)
    scaled = run("auto", jax_dg.mqa_logits, (qv, qs), kv, w, ks, ke)
    folded = run("auto", jax_dg.mqa_logits, (qv, None), kv, w * qs, ks, ke)
    assert bits(scaled) == bits(folded)
    # Against the formula on the dequantised q.
    valid = valid_of(ks, ke, n, False)
    qf = qv.astype(jnp.float32) * qs[:, :, None]
    direct = ref.weighted_relu_logits(qf, kv[0].astype(jnp.float32) * kv[1][:, None], w)
    assert jax_dg.calc_diff(np.asarray(scaled)[valid], np.asarray(direct)[valid]) < 1e-10
    per_token = run("auto", jax_dg.mqa_logits, (qv, qs[:, 0]), kv, w, ks, ke)
    assert bits(per_token) == bits(run("auto", jax_dg.mqa_logits, (qv, None), kv, w * qs[:, :1], ks, ke))


def test_bare_q_values_and_16_heads(keys):
    m, n = 9, 100
    q, kv, w = make_inputs(keys, m, n, 16, 128)
    ks, ke = varied_ranges(keys, m, n)
    a = run("auto", jax_dg.mqa_logits, q[0], kv, w, ks, ke)
    b = run("xla", jax_dg.mqa_logits, q, kv, w, ks, ke)
    assert_close_on(valid_of(ks, ke, n, False), a, b)


def test_repeated_calls_are_bitwise_identical(keys):
    m, n = 30, 400
    q, kv, w = make_inputs(keys, m, n, 64, 128)
    ks, ke = varied_ranges(keys, m, n)
    for msk in (None, 300):
        f = jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk))
        first = bits(f(q, kv, w, ks, ke))
        assert all(bits(f(q, kv, w, ks, ke)) == first for _ in range(5))


def test_nothing_to_score(keys):
    q, kv, w = make_inputs(keys, 4, 0, 32, 64)
    ks = ke = jnp.zeros((4,), jnp.int32)
    out = jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=8))(q, kv, w, ks, ke)
    assert out.shape == (4, 8) and bool((out == NEG_INF).all())
    q, kv, w = make_inputs(keys, 0, 50, 32, 64)
    empty = jnp.zeros((0,), jnp.int32)
    assert jax.jit(jax_dg.mqa_logits)(q, kv, w, empty, empty).shape == (0, 50)


def test_inside_a_larger_jitted_program(keys):
    m, n, k = 48, 512, 16
    q, kv, w = make_inputs(keys, m, n, 64, 128)
    ks, ke = jax_dg.causal_ks_ke(m, n)

    def step(q, kv, w, ks, ke):
        return jax_dg.topk_indices(jax_dg.mqa_logits(q, kv, w, ks, ke), k)

    a, b = run("auto", step, q, kv, w, ks, ke), run("xla", step, q, kv, w, ks, ke)
    assert a.shape == (m, k) and a.dtype == jnp.int32
    assert np.mean(np.sort(np.asarray(a), 1) == np.sort(np.asarray(b), 1)) > 0.99


@pytest.mark.parametrize("case,arg", [
    ("q_dtype", "q[0]"), ("q_rank", "q[0]"), ("heads", "q[0]"), ("head_dim", "q[0]"),
    ("d_mismatch", "kv[0]"), ("kv_dtype", "kv[0]"), ("kv_not_pair", "kv"), ("kv_scale_dtype", "kv[1]"),
    ("kv_scale_shape", "kv[1]"), ("weights_dtype", "weights"), ("weights_shape", "weights"),
    ("ks_dtype", "cu_seqlen_ks"), ("ke_shape", "cu_seqlen_ke"), ("msk_zero", "max_seqlen_k"),
    ("msk_traced", "max_seqlen_k"), ("msk_bool", "max_seqlen_k"), ("q_scale_dtype", "q[1]"),
    ("q_scale_shape", "q[1]"), ("q_pair", "q"),
])
def test_bad_inputs_fail_at_trace_time_naming_the_argument(keys, case, arg):
    m, n, h, d = 8, 64, 32, 64
    (qv, _), (kvv, kvs), w = make_inputs(keys, m, n, h, d)
    ks, ke = jax_dg.causal_ks_ke(m, n)
    q, kv, kw = (qv, None), (kvv, kvs), {}
    if case == "q_dtype":
        q = (qv.astype(jnp.bfloat16), None)
    elif case == "q_rank":
        q = (qv.reshape(m, h * d), None)
    elif case == "heads":
        q, w = (jnp.zeros((m, 128, d), FP8), None), jnp.zeros((m, 128), jnp.float32)
    elif case == "head_dim":
        q, kv = (jnp.zeros((m, h, 256), FP8), None), (jnp.zeros((n, 256), FP8), kvs)
    elif case == "d_mismatch":
        kv = (jnp.zeros((n, 128), FP8), kvs)
    elif case == "kv_dtype":
        kv = (kvv.astype(jnp.float8_e5m2), kvs)
    elif case == "kv_not_pair":
        kv = kvv
    elif case == "kv_scale_dtype":
        kv = (kvv, kvs.astype(jnp.bfloat16))
    elif case == "kv_scale_shape":
        kv = (kvv, kvs[:, None])
    elif case == "weights_dtype":
        w = w.astype(jnp.bfloat16)
    elif case == "weights_shape":
        w = w[:, :16]
    elif case == "ks_dtype":
        ks = ks.astype(jnp.float32)
    elif case == "ke_shape":
        ke = ke[:-1]
    elif case == "msk_zero":
        kw = dict(max_seqlen_k=0)
    elif case == "msk_bool":
        kw = dict(max_seqlen_k=True)
    elif case == "q_scale_dtype":
        q = (qv, jnp.ones((m, h), jnp.int32))
    elif case == "q_scale_shape":
        q = (qv, jnp.ones((m, h + 1), jnp.float32))
    elif case == "q_pair":
        q = (qv, None, None)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"mqa_logits: `{arg}`")):
        if case == "msk_traced":
            jax.jit(lambda q, kv, w, ks, ke, s: jax_dg.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=s)
                    ).trace(q, kv, w, ks, ke, 16)
        else:
            jax.jit(lambda q, kv, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke, **kw)).trace(q, kv, w, ks, ke)


# --- sparse (SM100 kernels): references and rules ------------------------------------------------

def make_sparse_inputs(keys, m, n, h, sbk, nmsb, fmt, unaligned=True):
    rng = np.random.default_rng(int(jax.random.randint(keys(), (), 0, 2 ** 31 - 1)))
    if fmt == "fp8":
        q = jax.random.normal(keys(), (m, h, 128), jnp.float32).astype(FP8)
        kv = jax.random.normal(keys(), (n, 128), jnp.float32).astype(FP8)
    else:
        q = jnp.asarray(rng.integers(-128, 128, (m, h, 64)), jnp.int8)
        kv = jnp.asarray(rng.integers(-128, 128, (n, 64)), jnp.int8)
    exps = lambda shape: jax.lax.bitcast_convert_type(  # noqa: E731
        jnp.asarray(rng.integers(120, 134, (*shape, 4)), jnp.uint8), jnp.int32)
    w = jax.random.normal(keys(), (m, h), jnp.bfloat16)
    ks = rng.integers(0, n // 2, m) if unaligned else rng.integers(0, n // 2 // sbk, m) * sbk
    ke = np.minimum(ks + rng.integers(0, n // 2, m), n)
    ke[1] = ks[1]                      # an empty row
    idx = []
    for s, e in zip(ks, ke):
        first, avail = s // sbk, -(-(e - s) // sbk)
        take = min(avail, nmsb)
        blocks = (list(range(first, first + avail)) if take == avail else
                  sorted(rng.choice(np.arange(first, first + avail), take, replace=False).tolist()))
        idx.append(blocks + [blocks[-1] if blocks else 0] * (nmsb - take))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return (q, exps((m, h))), (kv, exps((n,))), w, i32(ks), i32(ke), i32(idx)


def sparse_step(n, sbk, nmsb):
    def f(q, kv, w, ks, ke, idx):
        meta = jax_dg.get_sparse_mqa_logits_metadata(ks, ke, n, idx, q[0].dtype, sbk)
        return meta, jax_dg.fp8_fp4_sparse_mqa_logits(q, kv, w, meta, nmsb, sbk)
    return f


@pytest.mark.parametrize("fmt,h,sbk,nmsb", [("fp8", 32, 16, 8), ("fp4", 12, 8, 16), ("fp8", 20, 8, 4),
                                             ("fp4", 32, 16, 4)])
def test_sparse_matches_reference_and_the_dense_formula(keys, fmt, h, sbk, nmsb):
    m, n = 13, 600
    args = make_sparse_inputs(keys, m, n, h, sbk, nmsb, fmt)
    q, kv, w, ks, ke, idx = args
    before = digest(args)
    meta, out = run("auto", sparse_step(n, sbk, nmsb), *args)
    meta_ref, expect = run("xla", sparse_step(n, sbk, nmsb), *args)
    assert digest(args) == before, "inputs were written"
    assert bits(meta) == bits(meta_ref) and meta.dtype == jnp.uint8
    assert out.shape == (m, nmsb * sbk) and out.dtype == jnp.bfloat16
    token, valid = (np.asarray(x) for x in ref.sparse_columns(ks, ke, idx, sbk))
    assert valid.sum() > 0 and not valid[1].any()
    a, b = np.asarray(out, np.float32), np.asarray(expect, np.float32)
    np.testing.assert_array_equal(a == NEG_INF, ~valid)
    np.testing.assert_array_equal(a[valid], b[valid])
    # The DeepGEMM test's oracle: the dense logits gathered at each column's token, in bf16.
    dense = ref.weighted_relu_logits(ref.mx_dequant(*q), ref.mx_dequant(*kv), w.astype(jnp.float32))
    gathered = np.asarray(jnp.take_along_axis(dense, jnp.clip(token, 0, n - 1), 1).astype(jnp.bfloat16),
                          np.float32)
    assert jax_dg.calc_diff(a[valid], gathered[valid]) < 1e-5


def test_sparse_clean_logits_false_and_aligned_ranges(keys):
    m, n, sbk, nmsb = 10, 400, 16, 8
    args = make_sparse_inputs(keys, m, n, 8, sbk, nmsb, "fp8", unaligned=False)
    ks, ke, idx = args[3:]

    def f(q, kv, w, ks, ke, idx):
        meta = jax_dg.get_sparse_mqa_logits_metadata(ks, ke, n, idx, jnp.float8_e4m3fn, sbk)
        return jax_dg.fp8_fp4_sparse_mqa_logits(q, kv, w, meta, nmsb, sbk, clean_logits=False)

    dirty = np.asarray(run("auto", f, *args), np.float32)
    clean = np.asarray(run("xla", sparse_step(n, sbk, nmsb), *args)[1], np.float32)
    _, valid = (np.asarray(x) for x in ref.sparse_columns(ks, ke, idx, sbk))
    np.testing.assert_array_equal(dirty[valid], clean[valid])


def test_sparse_kernels_are_sm100_only(monkeypatch):
    from jax_dg.core import device
    from jax_dg.ops import mqa
    monkeypatch.setattr(device, "target", lambda: device.Target("deep_gemm", "cuda", "sm90", 132))
    for op in (mqa.FP8_FP4_SPARSE_MQA_LOGITS, mqa.GET_SPARSE_MQA_LOGITS_METADATA):
        with pytest.raises(jax_dg.UnsupportedArchError, match="only on sm100.*JAX_DG_BACKEND=torch"):
            op.gate(device.target())


@pytest.mark.parametrize("case,arg", [
    ("q_dtype", "q[0]"), ("heads", "q[0]"), ("head_dim", "q[0]"), ("q_scale_missing", "q[1]"),
    ("q_scale_dtype", "q[1]"), ("kv_format", "kv[0]"), ("kv_scale", "kv[1]"),
    ("weights_dtype", "weights"), ("metadata_dtype", "metadata"), ("metadata_rows", "metadata"),
    ("nmsb", "num_max_sparse_blocks"), ("sbk", "sparse_block_kv"),
])
def test_sparse_bad_inputs_fail_at_trace_time(keys, case, arg):
    m, n, sbk, nmsb = 6, 128, 8, 4
    (qv, qs), (kvv, kvs), w, ks, ke, idx = make_sparse_inputs(keys, m, n, 8, sbk, nmsb, "fp8")
    meta = jax.eval_shape(lambda ks, ke, idx: jax_dg.get_sparse_mqa_logits_metadata(
        ks, ke, n, idx, FP8, sbk), ks, ke, idx)
    meta = jnp.zeros(meta.shape, meta.dtype)
    q, kv, static = (qv, qs), (kvv, kvs), (nmsb, sbk)
    if case == "q_dtype":
        q = (qv.astype(jnp.bfloat16), qs)
    elif case == "heads":
        q, w = (jnp.zeros((m, 6, 128), FP8), qs[:, :6]), w[:, :6]
    elif case == "head_dim":
        q = (qv[:, :, :64], qs)
    elif case == "q_scale_missing":
        q = (qv, None)
    elif case == "q_scale_dtype":
        q = (qv, qs.astype(jnp.float32))
    elif case == "kv_format":
        kv = (jnp.zeros((n, 64), jnp.int8), kvs)
    elif case == "kv_scale":
        kv = (kvv, kvs[:-1])
    elif case == "weights_dtype":
        w = w.astype(jnp.float32)
    elif case == "metadata_dtype":
        meta = meta.astype(jnp.int32)
    elif case == "metadata_rows":
        meta = meta[:64]
    elif case == "nmsb":
        static = (6, sbk)
    elif case == "sbk":
        static = (nmsb, 32)
    name = "fp8_fp4_sparse_mqa_logits"
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"{name}: `{arg}`")):
        jax.jit(lambda q, kv, w, meta: jax_dg.fp8_fp4_sparse_mqa_logits(q, kv, w, meta, *static)
                ).trace(q, kv, w, meta)


@pytest.mark.parametrize("case,arg", [
    ("ks_dtype", "cu_seqlen_ks"), ("ke_shape", "cu_seqlen_ke"), ("idx_rows", "sparse_kv_block_indices"),
    ("idx_cols", "sparse_kv_block_indices"), ("qk_dtype", "qk_dtype"), ("sbk", "sparse_block_kv"),
    ("num_kv_tokens", "num_kv_tokens"),
])
def test_sparse_metadata_bad_inputs(keys, case, arg):
    m, n, sbk, nmsb = 6, 128, 8, 4
    *_, ks, ke, idx = make_sparse_inputs(keys, m, n, 8, sbk, nmsb, "fp8")
    static = dict(num_kv_tokens=n, qk_dtype=FP8, sparse_block_kv=sbk)
    if case == "ks_dtype":
        ks = ks.astype(jnp.uint32)
    elif case == "ke_shape":
        ke = ke[:3]
    elif case == "idx_rows":
        idx = idx[:3]
    elif case == "idx_cols":
        idx = idx[:, :3]
    elif case == "qk_dtype":
        static["qk_dtype"] = jnp.bfloat16
    elif case == "sbk":
        static["sparse_block_kv"] = 4
    elif case == "num_kv_tokens":
        static["num_kv_tokens"] = 1.5
    name = "get_sparse_mqa_logits_metadata"
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"{name}: `{arg}`")):
        jax.jit(lambda ks, ke, idx: jax_dg.get_sparse_mqa_logits_metadata(
            ks, ke, static["num_kv_tokens"], idx, static["qk_dtype"], static["sparse_block_kv"])
        ).trace(ks, ke, idx)


# --- GPU: DeepGEMM's shapes and thresholds (deep_gemm_facts.md, /tmp/research/mqa.md) ------------

def gpu_inputs(keys, s, sk, h, d):
    q = jax.random.normal(keys(), (s, h, d), jnp.bfloat16).astype(FP8)   # as DeepGEMM's test: no q scale
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(keys(), (sk, d), jnp.bfloat16))
    w = jax.random.normal(keys(), (s, h), jnp.float32)
    ks, ke = jax_dg.causal_ks_ke(s, sk, include_self=False)             # ks = 0, ke = arange(S) + SK - S
    return (q, None), kv, w, ks, ke


def torch_inputs(q, kv, w, ks, ke):
    """The GPU inputs as torch views, shaped as deep_gemm.fp8_fp4_mqa_logits takes them
    (q without its scale, kv as (values, scales))."""
    return to_torch(q[0]), (to_torch(kv[0]), to_torch(kv[1])), to_torch(w), to_torch(ks), to_torch(ke)


def torch_calc_diff(x, y):
    """DeepGEMM's calc_diff on the GPU in float64, -inf set to 0 first (as its test does)."""
    import torch
    x = torch.nan_to_num(x.double(), neginf=0.0)
    y = torch.nan_to_num(y.double(), neginf=0.0)
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def torch_bits(x):
    import torch
    return x.view(torch.int32)


# S=2048; SK in {8192, 65536}; (H, D) over {32, 64} x {64, 128}, plus H=16 (2.5.0's SM90 kernel takes it).
GPU_CASES = [(2048, 8192, 64, 128), (2048, 8192, 32, 64), (2048, 8192, 64, 64), (2048, 8192, 32, 128),
             (2048, 65536, 64, 128), (2048, 65536, 32, 64), (2048, 8192, 16, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("s,sk,h,d", GPU_CASES)
def test_gpu_matches_deep_gemm_from_torch(keys, s, sk, h, d):
    import deep_gemm
    import torch
    q, kv, w, ks, ke = gpu_inputs(keys, s, sk, h, d)
    before = digest(q, kv, w, ks, ke)
    f = jax.jit(lambda *a: jax_dg.mqa_logits(*a))
    out = f(q, kv, w, ks, ke)
    expect = run("xla", jax_dg.mqa_logits, q, kv, w, ks, ke)
    t_out, t_ref = to_torch(out), to_torch(expect)
    tq, tkv, tw, tks, tke = torch_inputs(q, kv, w, ks, ke)
    pos = torch.arange(sk, device="cuda")[None, :]
    mask = (pos >= tks[:, None].long()) & (pos < tke[:, None].long())
    assert torch.equal(t_out == float("-inf"), ~mask), "-inf mask differs from [ks, ke)"
    assert torch.equal(t_ref == float("-inf"), ~mask)
    assert torch.isfinite(t_out[mask]).all()
    assert torch_calc_diff(t_out, t_ref) < 5e-6
    # The same inputs through deep_gemm from torch (keywords: see mqa.md's positional trap).
    dg = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=True, max_seqlen_k=0)
    torch.cuda.synchronize()
    assert torch.equal(torch_bits(t_out), torch_bits(dg)), "not bitwise equal to deep_gemm from torch"
    for _ in range(20):
        assert torch.equal(torch_bits(to_torch(f(q, kv, w, ks, ke))), torch_bits(t_out))
    # Compressed form: valid columns bitwise equal to deep_gemm's (same kernel), tail -inf.
    msk = int((ke - ks).max())
    fc = jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk))
    comp = to_torch(fc(q, kv, w, ks, ke))
    dgc = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=False, max_seqlen_k=msk)
    torch.cuda.synchronize()
    cvalid = torch.arange(msk, device="cuda")[None, :] < (tke - tks)[:, None]
    assert torch.equal(comp == float("-inf"), ~cvalid)
    assert torch.equal(torch_bits(comp)[cvalid], torch_bits(dgc)[cvalid])
    full_at = t_out.gather(1, (tks[:, None].long() + torch.arange(msk, device="cuda")[None, :]).clamp(max=sk - 1))
    assert torch.equal(torch_bits(comp)[cvalid], torch_bits(full_at)[cvalid])
    for _ in range(5):
        assert torch.equal(torch_bits(to_torch(fc(q, kv, w, ks, ke))), torch_bits(comp))
    assert digest(q, kv, w, ks, ke) == before, "inputs were written"


@pytest.mark.gpu
def test_gpu_varied_ranges_and_clean_logits_false(keys):
    import torch
    m, n = 1000, 5000
    q, kv, w = make_inputs(keys, m, n, 64, 128)
    ks, ke = varied_ranges(keys, m, n)
    expect = to_torch(run("xla", jax_dg.mqa_logits, q, kv, w, ks, ke))
    valid = torch.from_numpy(valid_of(ks, ke, n, False)).cuda()
    for clean in (True, False):
        out = to_torch(run("auto", lambda *a: jax_dg.mqa_logits(*a, clean_logits=clean), q, kv, w, ks, ke))
        if clean:
            assert torch.equal(out == float("-inf"), ~valid)
        assert torch_calc_diff(out[valid], expect[valid]) < 5e-6
    msk = int((ke - ks).max())
    comp = to_torch(run("auto", lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk), q, kv, w, ks, ke))
    cref = to_torch(run("xla", lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk), q, kv, w, ks, ke))
    assert torch.equal(comp == float("-inf"), cref == float("-inf"))
    cvalid = cref != float("-inf")
    assert torch_calc_diff(comp[cvalid], cref[cvalid]) < 5e-6


@pytest.mark.gpu
@pytest.mark.parametrize("s,sk,ranges", [(2048, 8192, "causal"), (1024, 32768, "causal"),
                                         (1000, 5000, "varied")])
def test_gpu_deep_gemm_writes_every_valid_logit(keys, s, sk, ranges):
    # jax_dg writes -inf outside [ks, ke) only (kernels/neg_inf.cu) and takes DeepGEMM's logits
    # as written on [ks, ke): check that the kernel writes all of it into an uncleaned allocation.
    # torch's caching allocator hands the NaN-filled block just freed to DeepGEMM's request of
    # the same size (the data_ptr check makes sure), so a position it never writes stays NaN.
    import deep_gemm
    import torch
    from jax_dg import contracts
    from jax_dg.core import device
    if ranges == "causal":
        q, kv, w, ks, ke = gpu_inputs(keys, s, sk, 64, 128)
    else:
        q, kv, w = make_inputs(keys, s, sk, 64, 128)
        ks, ke = varied_ranges(keys, s, sk)
    tq, tkv, tw, tks, tke = torch_inputs(q, kv, w, ks, ke)
    stride_align = contracts.logits_stride_align(device.target().version, "float32")
    rows, stride = contracts.mqa_logits_layout(s, 64, sk, 0, stride_align)
    for _ in range(2):   # the first call compiles (its allocations may differ)
        torch.cuda.synchronize()
        sentinel = torch.full((rows, stride), float("nan"), device="cuda")
        ptr = sentinel.data_ptr()
        del sentinel
        dg = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=False, max_seqlen_k=0)
        torch.cuda.synchronize()
    assert dg.data_ptr() == ptr, "DeepGEMM's allocation did not reuse the NaN-filled block"
    unwritten = torch.isnan(dg) & torch.from_numpy(valid_of(ks, ke, sk, False)).cuda()
    bad = torch.nonzero(unwritten.any(dim=1)).flatten()[:8].tolist()
    assert not bad, (f"{int(unwritten.sum())} logits in [ks, ke) never written, rows {bad} (ks "
                     f"{tks[bad].tolist()}, ke {tke[bad].tolist()}, first unwritten column "
                     f"{[int(torch.nonzero(unwritten[r])[0]) for r in bad]})")


@pytest.mark.parametrize("relative", [False, True])
def test_neg_inf_reference_contract(relative):
    """The specification of jax_dg's -inf kernel: row r keeps [lo, hi) (relative: [0, hi - lo))
    cut to [0, cols); the rest of the [rows, cols] block becomes -inf; nothing else is touched."""
    import torch
    from tests import own_kernels_oracle as torch_emu
    lo = torch.tensor([0, 2, -3, 5, 9, 4], dtype=torch.int32)
    hi = torch.tensor([8, 6, 3, 20, 2, 4], dtype=torch.int32)
    d = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10) + 1
    want = d.clone()
    for r in range(6):
        a, b = (0, int(hi[r] - lo[r])) if relative else (int(lo[r]), int(hi[r]))
        for c in range(8):
            if not a <= c < b:
                want[r, c] = float("-inf")
    torch_emu.neg_inf_outside(d, lo, hi, 6, 8, relative)
    assert torch.equal(d, want)
