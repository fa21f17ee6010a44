"""jax_dg.nn.attention: MLA with DeepSeek Sparse Attention. Prefill against DeepSeek's MHA form
written densely per head; decode's absorbed form against the same attention with per-head keys
and values formed exactly (float64); the paged latent cache, several sequences of different
lengths, and decode against prefill of the longer sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jax_dg  # noqa: E402
from jax_dg import nn  # noqa: E402
from jax_dg.nn.attention import latent_bytes, pack_latent, unpack_latent  # noqa: E402
from jax_dg.operands import paged  # noqa: E402
from tests.conftest import on_deep_gemm  # noqa: E402

DIM, HEADS, NOPE, ROPE, V, C = 256, 4, 64, 32, 64, 256
# The decode step's absorbed form rounds q.W_nope, the probabilities and the latent output to
# bf16 where the exact per-head form keeps them (measured 1.4e-4 on the CPU: 8 keys, 4 heads)
ABSORBED = 5e-4
# Decode vs prefill of the same token: prefill's keys and values come out of wkv_b's FP8 GEMM
# (the latent cast per token to FP8), decode multiplies by wkv_b's bf16 weight (measured 1e-3)
FORMS = 3e-3


def make_mla(topk=16, seed=0, **kw):
    return nn.MLA(DIM, HEADS, q_lora_rank=128, kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                  v_head_dim=V, index_topk=topk, index_n_heads=32, index_head_dim=128, rngs=nnx.Rngs(seed), **kw)


def tokens(b, s, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (b, s, DIM), jnp.bfloat16)


def cache_for(m, lens, block_size=32, key=7):
    tables, nb = paged.build_block_tables(np.asarray(lens), block_size, key=key)
    return m.init_cache(tables, nb + 1, block_size)   # one spare block: not every block is used


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def bf16(a):
    return f64(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16))


def softmax(s, keep):
    s = np.where(keep, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def chosen(idx, s):
    """bool [T, s]: the key positions each query's indexer row names."""
    keep = np.zeros((idx.shape[0], s + 1), bool)
    np.put_along_axis(keep, np.where(idx < 0, s, idx), True, axis=1)
    return keep[:, :s]


@nnx.jit
def project(m, x, pos):
    """The layer's own projections (the references' inputs): (queries, latent) of x at pos."""
    return m.queries(x, pos), m.latent(x, pos)


@nnx.jit
def index_choice(m, x):
    """The indexer's prefill top-k of the sequence x [S, dim]."""
    return m.indexer.prefill(x, m.queries(x, jnp.arange(x.shape[0]))[0])[0]


def reference_prefill(m, x):
    """DeepSeek's prefill (MLA's `mask is not None` branch) of one sequence x [S, dim]: per-head
    keys [k_nope, k_pe] and values from wkv_b, scores over the causal positions the indexer
    chose, written out densely in float64 (the projections are the layer's own)."""
    s = x.shape[0]
    (qr, q_nope, q_pe), (_, kv_c, k_pe) = project(m, x, jnp.arange(s, dtype=jnp.int32))
    kv = f64(nnx.jit(lambda m, c: m.wkv_b(c))(m, kv_c)).reshape(s, HEADS, NOPE + V)
    q = np.concatenate([f64(q_nope), f64(q_pe)], -1)
    k = np.concatenate([kv[..., :NOPE], np.broadcast_to(f64(k_pe)[:, None], (s, HEADS, ROPE))], -1)
    keep = np.tril(np.ones((s, s), bool))
    if m.indexer is not None:
        keep &= chosen(np.asarray(index_choice(m, x)), s)
    p = softmax(np.einsum("shd,thd->hst", q, k) * m.softmax_scale, keep[None])
    o = bf16(np.einsum("hst,thd->shd", bf16(p), kv[..., NOPE:]))
    return f64(m.wo(jnp.asarray(o.reshape(s, -1), jnp.bfloat16)))


def reference_decode(m, x, keep, *, absorbed):
    """The last row of x [S, dim] attending to the positions `keep` [S] marks, over the cached
    latent (its FP8 round trip), in float64. absorbed=False: per-head keys and values kv_c . W
    formed exactly (the attention itself); absorbed=True: DeepSeek's decode form, q . W_nope
    against the latent and the latent output through W_v, rounding q . W_nope, the probabilities
    and the latent output to bf16 where DeepSeek's bf16 einsums do."""
    s = x.shape[0]
    (_, q_nope, q_pe), (_, kv_c, k_pe) = project(m, x, jnp.arange(s, dtype=jnp.int32))
    q_nope, q_pe = q_nope[-1:], q_pe[-1:]
    w = f64(m.wkv_b.kernel[...]).T.reshape(HEADS, NOPE + V, C)
    q_nope, q_pe, kv_c, k_pe = f64(q_nope[0]), f64(q_pe[0]), f64(kv_c), f64(k_pe)
    rope_scores = np.einsum("hr,tr->ht", q_pe, k_pe)
    if absorbed:
        q_abs = bf16(np.einsum("hd,hdc->hc", q_nope, w[:, :NOPE]))
        p = bf16(softmax((q_abs @ kv_c.T + rope_scores) * m.softmax_scale, keep[None]))
        o = bf16(np.einsum("hc,hdc->hd", bf16(p @ kv_c), w[:, NOPE:]))
    else:
        k_nope = np.einsum("tc,hdc->thd", kv_c, w[:, :NOPE])
        v = np.einsum("tc,hdc->thd", kv_c, w[:, NOPE:])
        p = softmax((np.einsum("hd,thd->ht", q_nope, k_nope) + rope_scores) * m.softmax_scale, keep[None])
        o = bf16(np.einsum("ht,thd->hd", p, v))
    return f64(m.wo(jnp.asarray(o.reshape(1, -1), jnp.bfloat16)))[0]


prefill = nnx.jit(lambda m, x, lens, c: m.prefill(x, lens, c))
decode = nnx.jit(lambda m, x, c: m.decode(x, c))


def test_latent_rows_pack_and_unpack():
    assert latent_bytes(512, 64) == 656        # V3.2: FlashMLA's FP8 sparse layout
    kv_c = jax.random.normal(jax.random.PRNGKey(0), (5, C), jnp.bfloat16) * 3
    k_pe = jax.random.normal(jax.random.PRNGKey(1), (5, ROPE), jnp.bfloat16)
    for ue8m0 in (False, True):
        rows, held = pack_latent(kv_c, k_pe, use_ue8m0=ue8m0)
        assert rows.shape == (5, latent_bytes(C, ROPE)) and rows.dtype == jnp.uint8
        back_c, back_pe = unpack_latent(rows, C)
        np.testing.assert_array_equal(np.asarray(back_pe), np.asarray(k_pe))          # bf16 kept as is
        np.testing.assert_array_equal(np.asarray(back_c), np.asarray(held))
        assert jax_dg.calc_diff(back_c, kv_c) < 1e-3                                    # FP8 per 128
        scales = np.asarray(jax.lax.bitcast_convert_type(rows[:, C:C + 8].reshape(5, 2, 4), jnp.float32))
        if ue8m0:   # powers of two
            np.testing.assert_array_equal(np.exp2(np.round(np.log2(scales))), scales)


@pytest.mark.parametrize("topk", [8, -1])
def test_prefill_matches_deepseeks_mha_form(topk):
    m = make_mla(topk)
    x = tokens(1, 40)
    out, cache = prefill(m, x, jnp.array([40]), cache_for(m, [40]))
    assert out.shape == (1, 40, DIM) and out.dtype == jnp.bfloat16
    assert cache.context_lens.tolist() == [40]
    assert (cache.index_keys is None) == (topk == -1)
    # the same weights through the FP8 GEMMs on both sides: only the attention's sums differ
    assert jax_dg.calc_diff(f64(out[0]), reference_prefill(m, x[0])) < 1e-5


def test_sequences_of_different_lengths_prefill_as_each_alone():
    """Three sequences padded to one [B, S] batch, through shuffled block tables: each one's rows
    and cache entries are those of the sequence prefilled alone."""
    m = make_mla(8)
    lens = [40, 17, 29]
    x = tokens(3, 40, seed=2)
    out, cache = prefill(m, x, jnp.array(lens), cache_for(m, lens))
    assert cache.context_lens.tolist() == lens
    for b, n in enumerate(lens):
        alone, c1 = prefill(m, x[b:b + 1, :n], jnp.array([n]), cache_for(m, [n], key=b))
        np.testing.assert_array_equal(np.asarray(out[b, :n]), np.asarray(alone[0]))
        for field in ("latent", "index_keys"):   # the sequence's cached rows, in logical order
            got, want = (np.asarray(getattr(c, field))[np.asarray(c.block_tables)[row]]
                         for c, row in ((cache, b), (c1, 0)))
            np.testing.assert_array_equal(got.reshape(-1, got.shape[-1])[:n], want.reshape(-1, got.shape[-1])[:n])
    # padding is never cached: the blocks no table names stay zero
    used = np.unique(np.concatenate([np.asarray(cache.block_tables)[b, :-(-n // 32)] for b, n in enumerate(lens)]))
    spare = np.setdiff1d(np.arange(cache.latent.shape[0]), used)
    assert spare.size and not np.asarray(cache.latent)[spare].any()


@pytest.mark.parametrize("topk", [8, -1])
def test_decode_is_the_absorbed_form_of_the_same_attention(topk):
    m = make_mla(topk)
    lens = [40, 23]
    x = tokens(2, 41, seed=3)
    _, cache = prefill(m, x[:, :40], jnp.array(lens), cache_for(m, [41, 24]))
    nxt = jnp.stack([x[0, 40], x[1, 23]])
    out, after = decode(m, nxt, cache)
    assert out.shape == (2, DIM) and after.context_lens.tolist() == [41, 24]
    for b, n in enumerate(lens):
        seq = jnp.concatenate([x[b, :n], nxt[b:b + 1]])
        keep = np.ones(n + 1, bool)
        if topk > 0:   # the indexer's choice for the new token (its decode path equals prefill's last row)
            keep = chosen(np.asarray(index_choice(m, seq))[-1:], n + 1)[0]
        # the absorbed form as DeepSeek rounds it: the same sums (on DeepGEMM's GPU the bf16
        # tensor-core sums' order may move a rounding)
        assert jax_dg.calc_diff(f64(out[b]), reference_decode(m, seq, keep, absorbed=True)) < \
            (1e-5 if on_deep_gemm() else 1e-7)
        assert jax_dg.calc_diff(f64(out[b]), reference_decode(m, seq, keep, absorbed=False)) < ABSORBED
        # and within the two forms' FP8 difference of prefill's row for the same token
        whole, _ = prefill(m, seq[None], jnp.array([n + 1]), cache_for(m, [n + 1]))
        assert jax_dg.calc_diff(f64(out[b]), f64(whole[0, n])) < (1e-2 if on_deep_gemm() else FORMS)


def test_decode_writes_the_new_latent_and_nothing_else():
    m = make_mla(8)
    x = tokens(2, 30, seed=4)
    _, cache = prefill(m, x[:, :29], jnp.array([29, 12]), cache_for(m, [64, 64]))
    _, after = decode(m, jnp.stack([x[0, 29], x[1, 12]]), cache)
    rows, _, _ = m.latent(jnp.stack([x[0, 29], x[1, 12]]), jnp.array([29, 12]))
    flat_before = np.asarray(cache.latent).reshape(-1, m.latent_bytes)
    flat = np.asarray(after.latent).reshape(-1, m.latent_bytes)
    tables = np.asarray(cache.block_tables)
    slots = [tables[0, 0] * 32 + 29, tables[1, 0] * 32 + 12]
    np.testing.assert_array_equal(flat[slots], np.asarray(rows))
    np.testing.assert_array_equal(np.delete(flat, slots, 0), np.delete(flat_before, slots, 0))


def test_decode_on_a_full_table_keeps_its_length():
    m = make_mla(8)
    x = tokens(2, 65, seed=5)
    _, cache = prefill(m, x[:, :64], jnp.array([64, 5]), cache_for(m, [64, 64]))   # sequence 0: full
    assert cache.max_len == 64
    out, after = decode(m, x[:, 64], cache)
    assert after.context_lens.tolist() == [64, 6]
    assert np.isfinite(f64(out)).all()
    tables = np.asarray(cache.block_tables)
    np.testing.assert_array_equal(np.asarray(after.latent)[tables[0]], np.asarray(cache.latent)[tables[0]])


def test_yarn_sets_the_softmax_scale_and_the_rotation():
    rope = nn.RoPE(dim=ROPE, max_seq_len=163840, original_seq_len=4096, factor=40.0)
    m = make_mla(8, rope=rope)
    assert m.softmax_scale == pytest.approx((NOPE + ROPE) ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    x = tokens(1, 6)[0]
    _, _, q_pe = m.queries(x, jnp.arange(6))
    plain = make_mla(8)   # the same weights (same seed) without YaRN: other rotations past position 0
    _, _, q_plain = plain.queries(x, jnp.arange(6))
    np.testing.assert_array_equal(np.asarray(q_pe[0]), np.asarray(q_plain[0]))
    assert not np.array_equal(np.asarray(q_pe[5]), np.asarray(q_plain[5]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="`kv_lora_rank` must be a multiple of 128"):
        nn.MLA(DIM, 2, q_lora_rank=128, kv_lora_rank=200, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`rope` rotates 16"):
        nn.MLA(DIM, 2, q_lora_rank=128, rope=nn.RoPE(dim=16), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`index_topk`"):
        nn.MLA(DIM, 2, q_lora_rank=128, index_topk=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`scale_fmt`"):
        nn.MLA(DIM, 2, q_lora_rank=128, scale_fmt="e8m0", rngs=nnx.Rngs(0))


def test_prefill_in_chunks_of_queries_is_prefill_at_once(monkeypatch):
    """Past SCORE_BYTES of float32 scores prefill runs its queries in chunks (V3.2's 128 heads
    over long prompts): every row as the dense form gives it, the cache the same."""
    from jax_dg.nn import attention
    m = make_mla(8)
    lens = [40, 29]
    x = tokens(2, 40, seed=6)
    whole, c1 = prefill(m, x, jnp.array(lens), cache_for(m, lens))
    monkeypatch.setattr(attention, "SCORE_BYTES", 2 * HEADS * 40 * 4 * 7)   # 7 queries a chunk
    assert attention.rows_per_chunk(2, HEADS, 40) == 7
    chunked, c2 = nnx.jit(lambda m, x, lens, c: m.prefill(x, lens, c))(m, x, jnp.array(lens), cache_for(m, lens))
    np.testing.assert_array_equal(np.asarray(chunked), np.asarray(whole))
    np.testing.assert_array_equal(np.asarray(c2.latent), np.asarray(c1.latent))
