"""jax_dg.operands.paged: DeepGEMM's paged KV-cache block layout, quantisation, block tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_dg
from jax_dg.operands import paged


def kv_cache_cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's test helper (tests/test_attention.py), verbatim but for the device and its
    `/ 448.0`, written as what torch computes on the GPU (a multiplication by the float
    reciprocal: ATen's div_true_kernel_cuda; its CPU kernel divides)."""
    num_blocks, block_size, num_heads, head_dim = x.shape
    assert num_heads == 1
    x_amax = x.abs().float().amax(dim=3, keepdim=True).clamp(1e-4)
    sf = x_amax * (1.0 / 448.0)
    x_scaled = (x * (1.0 / sf)).to(torch.float8_e4m3fn)
    x_fp8 = torch.empty((num_blocks, block_size * (head_dim + 4)), device=x.device, dtype=torch.uint8)
    x_fp8[:, : block_size * head_dim] = x_scaled.view(num_blocks, block_size * head_dim).view(torch.uint8)
    x_fp8[:, block_size * head_dim :] = sf.view(num_blocks, block_size).view(torch.uint8)
    return x_fp8.view(num_blocks, block_size, num_heads, head_dim + 4)


def as_torch(x):
    return torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch.bfloat16)


@pytest.mark.parametrize("nb,blk,d", [(3, 64, 128), (5, 32, 64), (1, 64, 32)])
def test_quantize_matches_deep_gemm_bitwise(nb, blk, d):
    k = jnp.asarray((np.random.default_rng(nb).standard_normal((nb, blk, d)) * 3).astype(jnp.bfloat16))
    ours = paged.quantize_kv_cache(k)
    theirs = jnp.asarray(kv_cache_cast_to_fp8(as_torch(k)[:, :, None, :]).numpy())
    assert ours.shape == (nb, blk, 1, d + 4) and ours.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_pack_unpack_round_trip_and_byte_order():
    nb, blk, d = 4, 32, 64
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.standard_normal((nb, blk, d)).astype(jnp.float8_e4m3fn))
    scales = jnp.asarray(rng.uniform(0.01, 2.0, (nb, blk)).astype(np.float32))
    cache = paged.pack_kv_cache(values, scales)
    raw = np.asarray(cache).reshape(nb, -1)
    # Per block: the block's fp8 rows first (token-major), then its float32 scales.
    np.testing.assert_array_equal(raw[:, :blk * d], np.asarray(values).view(np.uint8).reshape(nb, -1))
    np.testing.assert_array_equal(raw[:, blk * d:].view(np.float32), np.asarray(scales))
    v2, s2 = paged.unpack_kv_cache(cache)
    np.testing.assert_array_equal(np.asarray(v2).view(np.uint8), np.asarray(values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(scales))
    # MX caches keep int32 packed UE8M0 scales in the same 4 bytes.
    mx = jnp.full((nb, blk), 0x7F7F7F7F, jnp.int32)
    _, s3 = paged.unpack_kv_cache(paged.pack_kv_cache(values, mx), mx_scales=True)
    np.testing.assert_array_equal(np.asarray(s3), np.asarray(mx))


@pytest.mark.parametrize("mx_scales,value_dtype", [(False, jnp.float8_e4m3fn), (True, jnp.float8_e4m3fn),
                                                    (True, jnp.int8)])
def test_unpack_is_bitwise_the_oracles_split(mx_scales, value_dtype):
    """jax_dg.operands.paged reads the layout itself (no oracle import): the same bytes as
    jax_dg.reference.paged_mqa.split_kv_cache, for any byte pattern (NaN bits included)."""
    from jax_dg.reference.paged_mqa import SCALE_BYTES, split_kv_cache
    assert SCALE_BYTES == paged.SCALE_BYTES == jax_dg.contracts.KV_SCALE_BYTES == 4
    for nb, blk, d in [(3, 64, 128), (2, 32, 68), (1, 64, 32)]:
        raw = jnp.asarray(np.random.default_rng(d).integers(0, 256, (nb, blk, 1, d + 4), dtype=np.uint8))
        got = paged.unpack_kv_cache(raw, mx_scales=mx_scales, value_dtype=value_dtype)
        want = split_kv_cache(raw, mx_scales=mx_scales, value_dtype=value_dtype)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("scale", [3.0, 0.0, 1e-30, 1e37])
def test_quantize_is_bitwise_the_oracles_per_token_cast(scale):
    """A cache row is one 1 x D block of the oracle's per-token quantiser (the zero, tiny and
    huge keys included)."""
    from jax_dg.reference.quant import per_token_cast_to_fp8
    nb, blk, d = 2, 64, 96
    k = jnp.asarray((np.random.default_rng(4).standard_normal((nb, blk, d)) * scale).astype(np.float32))
    values, sf = paged.unpack_kv_cache(paged.quantize_kv_cache(k))
    ov, osf = per_token_cast_to_fp8(k.reshape(-1, d), gran_k=d)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8).reshape(-1, d), np.asarray(ov).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sf).reshape(-1), np.asarray(osf)[:, 0])


def test_ue8m0_caches_hold_power_of_two_scales():
    """use_ue8m0 (DeepSeek V3.2's scale_fmt): every way into a cache rounds each row's scale up
    to a power of two, the rows as per_row_cast_to_fp8(use_ue8m0=True) casts them."""
    nb, blk, d = 2, 64, 128
    k = jnp.asarray(np.random.default_rng(5).standard_normal((nb * blk, d)).astype(np.float32))
    want_v, want_s = jax_dg.per_row_cast_to_fp8(k, use_ue8m0=True)
    slots = jnp.arange(nb * blk, dtype=jnp.int32)
    table = jnp.arange(nb, dtype=jnp.int32)[None]
    caches = [paged.quantize_kv_cache(k.reshape(nb, blk, d), use_ue8m0=True),
              paged.kv_cache_from_rows(k, slots, nb, blk, use_ue8m0=True),
              paged.update_kv_cache(paged.quantize_kv_cache(k.reshape(nb, blk, d)), k, slots, use_ue8m0=True),
              paged.kv_cache_from_sequences(k[None], table, blk, nb, use_ue8m0=True)]
    for cache in caches:
        v, s = paged.unpack_kv_cache(cache)
        np.testing.assert_array_equal(np.asarray(s).reshape(-1), np.asarray(want_s))
        np.testing.assert_array_equal(np.asarray(v).view(np.uint8).reshape(-1, d), np.asarray(want_v).view(np.uint8))
    s = np.asarray(want_s)
    assert np.array_equal(s, 2.0 ** np.round(np.log2(s)))
    assert not np.array_equal(np.asarray(paged.unpack_kv_cache(paged.quantize_kv_cache(k.reshape(nb, blk, d)))[1]).reshape(-1), s)


def test_dequantize_follows_block_tables():
    nb, blk, d = 6, 64, 32
    k = jnp.asarray(np.random.default_rng(1).standard_normal((nb, blk, d)).astype(np.float32))
    cache = paged.quantize_kv_cache(k)
    table = jnp.array([[5, 0], [2, 3]], jnp.int32)
    dense = paged.dequantize_kv_cache(cache)
    gathered = paged.dequantize_kv_cache(cache, table)
    assert gathered.shape == (2, 2 * blk, d)
    np.testing.assert_array_equal(np.asarray(gathered[0, blk:]), np.asarray(dense[0]))
    np.testing.assert_array_equal(np.asarray(gathered[1, :blk]), np.asarray(dense[2]))
    assert jax_dg.calc_diff(dense, k) < 1e-3


def test_cache_from_sequences_places_each_token_through_the_table():
    blk, d = 32, 64
    ctx = np.array([1, 33, 64, 95], np.int32)
    table, nb = paged.build_block_tables(ctx, blk, key=jax.random.PRNGKey(2), num_blocks=20)
    s = table.shape[1] * blk
    k = jnp.asarray(np.random.default_rng(2).standard_normal((4, s, d)).astype(np.float32))
    cache = paged.kv_cache_from_sequences(k, table, blk, nb, jnp.asarray(ctx))
    gathered = np.asarray(paged.dequantize_kv_cache(cache, table))
    values, sf = jax_dg.per_row_cast_to_fp8(k.reshape(-1, d))
    expect = (np.asarray(values, np.float32) * np.asarray(sf)[:, None]).reshape(4, s, d)
    for b, n in enumerate(ctx):
        np.testing.assert_array_equal(gathered[b, :n], expect[b, :n])
    # Slots nobody writes are zeros, and tokens past a length are not written.
    used = set(np.asarray(table)[b, i] for b, n in enumerate(ctx) for i in range(-(-n // blk)))
    unused = [i for i in range(nb) if i not in used]
    assert unused and not np.asarray(cache)[unused].any()
    assert not gathered[0, 1:blk].any()


def test_cache_from_rows_drops_out_of_range_slots():
    k = jnp.asarray(np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32))
    cache = paged.kv_cache_from_rows(k, jnp.array([0, 63, 10_000], jnp.int32), 1, 64)
    v, s = paged.unpack_kv_cache(cache)
    assert float(s[0, 0]) > 0 and float(s[0, 63]) > 0 and int((np.asarray(s) > 0).sum()) == 2


def test_slot_mapping():
    table = jnp.array([[7, 2]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(paged.slot_mapping(table, 4, 6)),
                                  [[28, 29, 30, 31, 8, 9]])


def test_decode_slots():
    """The next token's slot through the table; a full table writes nothing and keeps its length."""
    table = jnp.array([[7, 2], [5, 0], [3, 4]], jnp.int32)
    slots, lens = paged.decode_slots(table, jnp.array([5, 0, 8], jnp.int32), 4)
    assert slots.tolist() == [2 * 4 + 1, 5 * 4, -1] and lens.tolist() == [6, 1, 8]
    with pytest.raises(ValueError, match="context_lens"):
        paged.decode_slots(table, jnp.zeros((2,), jnp.int32), 4)


@pytest.mark.parametrize("blk", [32, 64])
@pytest.mark.parametrize("shuffle", [False, True])
def test_build_block_tables(blk, shuffle):
    ctx = np.array([1, 0, 129, 64, 65], np.int32)
    need = -(-ctx // blk)
    extra = 7 if shuffle else 0
    table, nb = paged.build_block_tables(ctx, blk, key=5 if shuffle else None,
                                         num_blocks=int(need.sum()) + extra if shuffle else None)
    table = np.asarray(table)
    assert table.dtype == np.int32 and nb == need.sum() + extra
    width = max(need.max(), 1)
    assert table.shape == (5, width + (width % 2 if blk == 32 else 0))
    owned = np.concatenate([table[b, :n] for b, n in enumerate(need)])
    assert len(set(owned.tolist())) == len(owned) and owned.min() >= 0 and owned.max() < nb
    for b, n in enumerate(need):
        assert not table[b, n:].any()   # unused entries: block 0, a valid id
    if not shuffle:
        np.testing.assert_array_equal(owned, np.arange(need.sum()))
    # 2-D lengths use the last column.
    t2, _ = paged.build_block_tables(np.stack([ctx // 2, ctx], 1), blk)
    np.testing.assert_array_equal(np.asarray(t2), np.asarray(paged.build_block_tables(ctx, blk)[0]))


def test_bad_inputs_name_the_argument():
    values = jnp.zeros((2, 64, 128), jnp.float8_e4m3fn)
    with pytest.raises(jax_dg.ArgumentError, match="`scales`"):
        paged.pack_kv_cache(values, jnp.zeros((2, 32), jnp.float32))
    with pytest.raises(jax_dg.ArgumentError, match="`values`"):
        paged.pack_kv_cache(values.astype(jnp.bfloat16), jnp.zeros((2, 64), jnp.float32))
    with pytest.raises(jax_dg.ArgumentError, match="`kv_cache`"):
        paged.unpack_kv_cache(jnp.zeros((2, 64, 1, 132), jnp.int8))
    with pytest.raises(jax_dg.ArgumentError, match="`kv_cache`"):
        paged.unpack_kv_cache(jnp.zeros((2, 64, 2, 132), jnp.uint8))
    with pytest.raises(jax_dg.ArgumentError, match="`num_blocks`"):
        paged.build_block_tables(np.array([100]), 64, num_blocks=1)
    with pytest.raises(jax_dg.ArgumentError, match="`width`"):
        paged.build_block_tables(np.array([200]), 64, width=2)
