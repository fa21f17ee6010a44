"""The indexer helpers: K quantisation, q-scale folding, causal / varlen key ranges, top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_dg


def deep_gemm_per_custom_dims_cast_to_fp8(x: torch.Tensor, dims, use_ue8m0: bool):
    """deep_gemm/utils/math.py (2.5.0), verbatim but for ceil_to_ue8m0 inlined and `/ 448.0`
    written as torch computes it on the GPU (times the float reciprocal; its CPU kernel divides)."""
    excluded_dims = tuple([i for i in range(x.dim()) if i not in set(dims)])
    x_amax = x.abs().float().amax(dim=excluded_dims, keepdim=True).clamp(1e-4)
    sf = x_amax * (1.0 / 448.0)
    if use_ue8m0:
        bits = sf.abs().float().view(torch.int)
        exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
        sf = (exp.clamp(1, 254) << 23).view(torch.float)
    x_scaled = (x * (1.0 / sf)).to(torch.float8_e4m3fn)
    return x_scaled, sf.squeeze()


@pytest.mark.parametrize("shape", [(300, 128), (64, 4, 32), (7, 64)])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_per_row_cast_matches_deep_gemm_bitwise(keys, shape, use_ue8m0):
    x = jax.random.normal(keys(), shape, jnp.bfloat16) * 3
    x = x.at[1].set(0)                                   # an all-zero row: the 1e-4 floor
    values, sf = jax.jit(lambda x: jax_dg.per_row_cast_to_fp8(x, use_ue8m0=use_ue8m0))(x)
    tv, tsf = deep_gemm_per_custom_dims_cast_to_fp8(torch.from_numpy(np.array(x, np.float32)).bfloat16(),
                                                     (0,), use_ue8m0)
    assert values.dtype == jnp.float8_e4m3fn and values.shape == shape
    assert sf.dtype == jnp.float32 and sf.shape == (shape[0],)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(values, jnp.uint8)),
                                  tv.view(torch.uint8).numpy())
    np.testing.assert_array_equal(np.asarray(sf), tsf.numpy())
    back = np.asarray(values, np.float32) * np.asarray(sf).reshape(-1, *[1] * (len(shape) - 1))
    assert jax_dg.calc_diff(back, np.asarray(x, np.float32)) < 1e-3


def test_fold_q_scale():
    w = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    s = jnp.asarray([[2.0, 0.5, 4.0], [1.0, 8.0, 0.25]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax_dg.fold_q_scale(w, s)), np.asarray(w) * np.asarray(s))
    np.testing.assert_array_equal(np.asarray(jax_dg.fold_q_scale(w, s[:, 0])), np.asarray(w) * np.asarray(s[:, :1]))


def test_causal_ks_ke():
    ks, ke = jax_dg.causal_ks_ke(4, 10)
    assert ks.dtype == ke.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ks), 0)
    np.testing.assert_array_equal(np.asarray(ke), [7, 8, 9, 10])
    _, ke = jax_dg.causal_ks_ke(4, 4, include_self=False)     # DeepGEMM's test mask
    np.testing.assert_array_equal(np.asarray(ke), np.arange(4) + 4 - 4)
    with pytest.raises(ValueError, match="num_queries"):
        jax_dg.causal_ks_ke(5, 4)


def test_varlen_causal_ks_ke():
    cu_q = jnp.asarray([0, 3, 3, 5], jnp.int32)          # sequences of 3, 0 and 2 queries
    ks, ke = jax.jit(jax_dg.varlen_causal_ks_ke, static_argnums=1)(cu_q, 7)
    np.testing.assert_array_equal(np.asarray(ks), [0, 0, 0, 3, 3, 0, 0])
    np.testing.assert_array_equal(np.asarray(ke), [1, 2, 3, 4, 5, 0, 0])   # padding rows empty
    cu_k = jnp.asarray([0, 10, 14, 20], jnp.int32)       # cached prefixes: 7, 4 and 4 keys
    ks, ke = jax_dg.varlen_causal_ks_ke(cu_q, 5, cu_k)
    np.testing.assert_array_equal(np.asarray(ks), [0, 0, 0, 14, 14])
    np.testing.assert_array_equal(np.asarray(ke), [8, 9, 10, 19, 20])
    _, ke = jax_dg.varlen_causal_ks_ke(cu_q, 5, cu_k, include_self=False)
    np.testing.assert_array_equal(np.asarray(ke), [7, 8, 9, 18, 19])


def test_varlen_ranges_feed_mqa_logits(keys):
    cu = jnp.asarray([0, 5, 12, 30], jnp.int32)
    m, h, d = 32, 32, 64
    ks, ke = jax_dg.varlen_causal_ks_ke(cu, m)
    q = jax.random.normal(keys(), (m, h, d), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(keys(), (30, d), jnp.bfloat16))
    w = jax.random.normal(keys(), (m, h), jnp.float32)
    out = np.asarray(jax.jit(jax_dg.mqa_logits)(q, kv, w, ks, ke))
    # Row 6 is query 1 of sequence 1 (keys 5..11): it sees keys 5 and 6 only.
    assert np.isfinite(out[6, 5:7]).all() and (out[6, :5] == -np.inf).all() and (out[6, 7:] == -np.inf).all()
    assert (out[30:] == -np.inf).all()                   # padding rows


def test_topk_indices():
    logits = jnp.asarray([[1.0, 5.0, -jnp.inf, 3.0], [-jnp.inf] * 3 + [2.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax_dg.topk_indices(logits, 3)), [[1, 3, 0], [3, -1, -1]])
    idx = jax_dg.topk_indices(logits, 2, offsets=jnp.asarray([10, 20], jnp.int32))
    np.testing.assert_array_equal(np.asarray(idx), [[11, 13], [23, -1]])
