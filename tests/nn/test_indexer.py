"""LightningIndexer: its two paths (prefill, decode against the paged FP8 key cache) against
the pure-JAX reference (the same module traced with JAX_DG_BACKEND=xla), and the cache update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jax_dg  # noqa: E402
from jax_dg import nn  # noqa: E402
from jax_dg.operands import paged  # noqa: E402
from tests.conftest import on_deep_gemm  # noqa: E402


def make_indexer(topk=64):
    return nn.LightningIndexer(256, 128, n_heads=32, head_dim=128, topk=topk, rngs=nnx.Rngs(0))


def inputs(t, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(k1, (t, 256), jnp.bfloat16), jax.random.normal(k2, (t, 128), jnp.bfloat16))


def agreement(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.mean([len(set(r) & set(s)) / max(len(set(r)), 1) for r, s in zip(a, b)]))


def test_indexer_prefill_matches_the_reference_and_is_causal():
    idx_mod = make_indexer()
    x, qr = inputs(192)
    prefill = nnx.jit(lambda m, x, qr: m.prefill(x, qr))
    idx, k = prefill(idx_mod, x, qr)
    assert idx.shape == (192, 64) and idx.dtype == jnp.int32 and k.shape == (192, 128)
    idx = np.asarray(idx)
    rows = np.arange(192)[:, None]
    assert ((idx <= rows) | (idx == -1)).all()              # no query sees a later key
    assert ((idx == -1).sum(1) == np.maximum(64 - (np.arange(192) + 1), 0)).all()
    with jax_dg.use_backend("xla"):
        ref, _ = nnx.jit(lambda m, x, qr: m.prefill(x, qr))(idx_mod, x, qr)
    # ties within rounding may swap; on DeepGEMM the q and k projections' last bits move FP8
    # casts by an ulp, and near-ties with them (measured 0.983 on the H200)
    assert agreement(idx, ref) > (0.97 if on_deep_gemm() else 0.99)


def cached_pair(m, t, seed, blk=64):
    """Tokens x, qr [t + 1, ...] and two sequences of the same first t tokens, cached through
    different block tables; then one decode step of token t for both: (x, qr, tables, nb,
    cache, idx, cache after)."""
    b = 2
    x, qr = inputs(t + 1, seed=seed)
    tables, nb = paged.build_block_tables(np.array([t + 1] * b), blk, key=jax.random.PRNGKey(5))
    k = m.keys(x[:t], jnp.arange(t, dtype=jnp.int32))
    cache = nn.IndexerCache(paged.kv_cache_from_sequences(jnp.stack([k] * b), tables, blk, nb,
                                                          use_ue8m0=m.use_ue8m0),
                            tables, jnp.full((b,), t, jnp.int32))
    decode = nnx.jit(lambda m, x, qr, c: m.decode(x, qr, c))
    idx, after = decode(m, jnp.stack([x[t]] * b), jnp.stack([qr[t]] * b), cache)
    return x, qr, tables, nb, cache, idx, after


def test_indexer_decode_writes_the_cache_and_equals_prefills_last_row():
    m = make_indexer()
    b, t, blk = 2, 150, 64
    x, qr, tables, nb, cache, idx, cache2 = cached_pair(m, t, 3, blk)
    assert idx.shape == (b, 64) and (np.asarray(cache2.context_lens) == t + 1).all()
    whole = paged.kv_cache_from_sequences(jnp.stack([m.keys(x, jnp.arange(t + 1, dtype=jnp.int32))] * b),
                                          tables, blk, nb)
    # the update: token t's slot of each sequence holds its key, and nothing else moved
    got, want = (np.asarray(paged.dequantize_kv_cache(c, tables)) for c in (cache2.kv_cache, whole))
    before = np.asarray(paged.dequantize_kv_cache(cache.kv_cache, tables))
    np.testing.assert_array_equal(np.delete(got, t, axis=1), np.delete(before, t, axis=1))
    if on_deep_gemm():   # DeepGEMM's key projection for 2 rows and for 151 rounds differently in
        # the last bits, which the FP8 cast of the key turns into one-ulp flips (measured on the
        # H200: 28 of 50688 cache bytes); DeepGEMM's FP8 threshold
        assert jax_dg.calc_diff(got[:, t], want[:, t]) < 1e-3
    else:
        np.testing.assert_array_equal(np.asarray(cache2.kv_cache), np.asarray(whole))
    last, _ = nnx.jit(lambda m, x, qr: m.prefill(x, qr))(m, x, qr)
    for row in np.asarray(idx):
        assert agreement([row], [np.asarray(last)[t]]) > 0.98


def test_indexer_decode_on_a_full_table_writes_nothing():
    m = make_indexer()
    x, qr = inputs(2, seed=4)
    tables, nb = paged.build_block_tables(np.array([64, 10]), 64)   # one block each
    cache = nn.IndexerCache(paged.quantize_kv_cache(jax.random.normal(jax.random.PRNGKey(6), (nb, 64, 128),
                                                                      jnp.bfloat16)),
                            tables, jnp.array([64, 10], jnp.int32))   # sequence 0 is full
    _, after = nnx.jit(lambda m, x, qr, c: m.decode(x, qr, c))(m, x, qr, cache)
    np.testing.assert_array_equal(np.asarray(after.context_lens), [64, 11])
    before_v, after_v = (np.asarray(c).reshape(nb, -1) for c in (cache.kv_cache, after.kv_cache))
    b0, b1 = np.asarray(tables)[:, 0]
    np.testing.assert_array_equal(after_v[b0], before_v[b0])          # the full sequence's block
    assert (after_v[b1] != before_v[b1]).any()                         # the other one's got its key


def test_update_kv_cache_writes_only_its_slots():
    cache = paged.quantize_kv_cache(jax.random.normal(jax.random.PRNGKey(0), (3, 64, 128), jnp.bfloat16))
    rows = jax.random.normal(jax.random.PRNGKey(1), (2, 128), jnp.bfloat16)
    rows = jnp.concatenate([rows, rows[:1]])
    out = paged.update_kv_cache(cache, rows, jnp.array([70, 3 * 64 + 5, -1], jnp.int32))  # 2, 3: outside
    want = paged.kv_cache_from_rows(rows[:1], jnp.array([70]), 3, 64)
    values, scales = paged.unpack_kv_cache(out)
    old_v, old_s = paged.unpack_kv_cache(cache)
    new_v, new_s = paged.unpack_kv_cache(want)
    mask = np.zeros((3, 64), bool)
    mask[1, 6] = True
    np.testing.assert_array_equal(np.asarray(scales)[mask], np.asarray(new_s)[mask])
    np.testing.assert_array_equal(np.asarray(scales)[~mask], np.asarray(old_s)[~mask])
    bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))  # noqa: E731
    np.testing.assert_array_equal(bits(values)[mask], bits(new_v)[mask])
    np.testing.assert_array_equal(bits(values)[~mask], bits(old_v)[~mask])
    with pytest.raises(jax_dg.ArgumentError, match="update_kv_cache: `k`"):
        paged.update_kv_cache(cache, rows[:, :64], jnp.array([0, 1, 2], jnp.int32))


# --- DeepSeek V3.2 as shipped: YaRN, UE8M0, stored FP8 weights ---------------------------------

def shipped_indexer(scale_fmt="ue8m0", max_seq_len=163840, topk=64):
    """An indexer with V3.2's RoPE (YaRN: max_seq_len past the original 4096), 64 heads of 128,
    stored FP8 weights, random norms (DeepSeek's config at a small hidden size)."""
    rope = nn.RoPE(dim=64, theta=10000.0, max_seq_len=max_seq_len, original_seq_len=4096, factor=40.0,
                   beta_fast=32, beta_slow=1, mscale=1.0)
    m = nn.LightningIndexer(256, 128, n_heads=64, head_dim=128, topk=topk, rope=rope, scale_fmt=scale_fmt,
                            fp8_weights=True, rngs=nnx.Rngs(0))
    k1, k2 = jax.random.split(jax.random.PRNGKey(11))
    m.k_norm.scale[...] = 1 + 0.2 * jax.random.normal(k1, (128,))
    m.k_norm.bias[...] = 0.2 * jax.random.normal(k2, (128,))
    return m


def deepseek_params(m):
    f = lambda lin: (np.asarray(lin.weight[...]), np.asarray(lin.weight_scale_inv[...]))  # noqa: E731
    return {"wq_b": f(m.wq_b), "wk": f(m.wk), "k_norm_weight": np.asarray(m.k_norm.scale[...], np.float64),
            "k_norm_bias": np.asarray(m.k_norm.bias[...], np.float64),
            "weights_proj": np.asarray(m.weights_proj.kernel[...], np.float32).T}


def deepseek_scores(m, x, qr, positions, *, yarn=True, scale_fmt="ue8m0"):
    from tests.nn import deepseek_reference as ref
    from tests.nn.test_rope import yarn_reference
    r = m.rope
    inv = yarn_reference(r.dim, r.theta, r.max_seq_len if yarn else r.original_seq_len, r.original_seq_len,
                         r.factor, r.beta_fast, r.beta_slow).astype(np.float32)
    return ref.indexer_scores(np.asarray(x, np.float32), np.asarray(qr, np.float32), np.asarray(positions),
                              deepseek_params(m), inv_freq=inv, n_heads=m.n_heads, head_dim=m.head_dim,
                              scale_fmt=scale_fmt)


def topk_of(scores, k):
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.where(np.take_along_axis(scores, order, 1) > -np.inf, order, -1)


def test_keys_are_deepseeks_with_yarn_at_any_position():
    """The keys before their FP8 cast: YaRN RoPE on the first 64 features, pairs (i, i + 32), the
    Hadamard rotation; at positions up to 160k, where YaRN's frequencies differ from plain ones."""
    from tests.nn import deepseek_reference as ref
    from tests.nn.test_rope import yarn_reference
    m = shipped_indexer()
    x, _ = inputs(64, seed=5)
    pos = jnp.asarray(np.random.default_rng(0).integers(0, 160000, 64), jnp.int32)
    got = np.asarray(jax.jit(lambda x, p: m.keys(x, p))(x, pos), np.float32)
    p = deepseek_params(m)
    r = m.rope

    def want(max_seq_len):
        inv = yarn_reference(64, r.theta, max_seq_len, 4096, r.factor, 32, 1).astype(np.float32)
        angles = (np.asarray(pos, np.float32)[:, None] * inv[None]).astype(np.float32)
        k = ref.linear(np.asarray(x, np.float32), *p["wk"], "ue8m0").astype(np.float64)
        k = ref.bf16((k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
                     * p["k_norm_weight"] + p["k_norm_bias"])
        return ref.bf16(np.concatenate([ref.bf16(ref.rope_half(k[:, :64], angles)), k[:, 64:]], -1)
                        @ ref.hadamard(128))
    # bfloat16 roundings of values computed in another order: some keys an ulp apart
    assert jax_dg.calc_diff(got, want(163840)) < 1e-5
    assert jax_dg.calc_diff(got, want(4096)) > 1e-3      # plain RoPE at those positions: far off


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_prefill_picks_deepseeks_topk(scale_fmt):
    m = shipped_indexer(scale_fmt)
    x, qr = inputs(256, seed=6)
    idx, keys = nnx.jit(lambda m, x, qr: m.prefill(x, qr))(m, x, qr)
    want = topk_of(deepseek_scores(m, x, qr, np.arange(256), scale_fmt=scale_fmt), 64)
    # Near-ties within float32 rounding may swap (measured on the emulation 1.0 with UE8M0,
    # 0.99994 with float32 scales). On DeepGEMM the FP8 projections' tensor-core sums move some
    # bf16 q and k values an ulp from the float64 oracle's, which moves FP8 casts and near-ties
    # with them (the plain indexer's test above measured 0.983 so on the H200 at this size): the
    # bound there is that one; the target (>= 0.99 against DeepSeek's own kernels at the
    # shipped sizes) is the lead's end-to-end measure. What each of YaRN and the scale format is
    # worth: against DeepSeek without YaRN 0.949, with the other scale format 0.975.
    assert agreement(idx, want) >= (0.97 if on_deep_gemm() else 0.99)
    no_yarn = topk_of(deepseek_scores(m, x, qr, np.arange(256), yarn=False, scale_fmt=scale_fmt), 64)
    other_fmt = topk_of(deepseek_scores(m, x, qr, np.arange(256), scale_fmt=None if scale_fmt else "ue8m0"), 64)
    if not on_deep_gemm():
        assert agreement(idx, no_yarn) < 0.97 and agreement(idx, other_fmt) < 0.985


def test_decode_caches_ue8m0_keys_and_picks_deepseeks_topk():
    m = shipped_indexer()
    b, t = 2, 150
    x, qr, _, _, _, idx, cache2 = cached_pair(m, t, 8)
    _, scales = paged.unpack_kv_cache(cache2.kv_cache)
    s = np.asarray(scales)[np.asarray(scales) > 0]
    assert s.size == b * (t + 1) and np.array_equal(s, 2.0 ** np.round(np.log2(s)))   # powers of two
    want = topk_of(deepseek_scores(m, x, qr, np.arange(t + 1)), 64)[t]
    for row in np.asarray(idx):
        assert agreement([row], [want]) >= (0.97 if on_deep_gemm() else 0.98)


def test_from_config():
    from tests.nn.checkpoints import HF_V32_CONFIG
    cfg = nn.load_config({**HF_V32_CONFIG, "hidden_size": 256, "q_lora_rank": 128})
    m = nnx.eval_shape(lambda: nn.LightningIndexer.from_config(cfg, rngs=nnx.Rngs(0)))
    assert m.rope == cfg.rope and m.rope.yarn and m.use_ue8m0 and m.topk == 2048 and m.n_heads == 64
    assert m.wq_b.stored_fp8 and m.wk.weight.shape == (128, 256) and m.weights_proj.kernel.shape == (256, 64)
