"""vmap: batches folded into the kernel where the math allows (one call, no loop in the HLO),
sequential otherwise; results equal to a Python loop over the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.operands import paged
from tests.ops.test_paged_mqa import make_case

FP8 = jnp.float8_e4m3fn
B = 3


def loop(fn, in_axes, *args):
    outs = []
    for i in range(B):
        outs.append(fn(*[jax.tree.map(lambda x: x[i], a) if ax == 0 else a for a, ax in zip(args, in_axes)]))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def check(fn, in_axes, *args, folded: bool):
    f = jax.jit(jax.vmap(fn, in_axes=in_axes))
    got, want = f(*args), loop(fn, in_axes, *args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    hlo = f.lower(*args).compile().as_text()
    assert ("while" not in hlo) == folded, f"folded={folded} but the HLO {'has' if folded else 'lacks'} a loop"
    return hlo


def test_fp8_gemm_folds_a_batch_into_m_and_runs_both_batched_as_one_masked_gemm(keys):
    x = jax.random.normal(keys(), (B, 64, 256), jnp.bfloat16)
    a = jax.vmap(jax_dg.per_token_cast_to_fp8)(x)
    b = jax_dg.per_block_cast_to_fp8(jax.random.normal(keys(), (256, 256), jnp.bfloat16))
    hlo = check(jax_dg.fp8_gemm_nt, (0, None), a, b, folded=True)
    assert hlo.count("jax_dg_fp8_gemm_nt") == 1
    bb = jax.vmap(jax_dg.per_block_cast_to_fp8)(jax.random.normal(keys(), (B, 256, 256), jnp.bfloat16))
    hlo = check(jax_dg.fp8_gemm_nt, (0, 0), a, bb, folded=True)
    assert "jax_dg_m_grouped_fp8_gemm_nt_masked" in hlo
    # the accumulating recipe with a batched c folds too
    bc = jax_dg.per_token_cast_to_fp8(jax.random.normal(keys(), (256, 256), jnp.bfloat16))
    c = jax.random.normal(keys(), (B, 64, 256), jnp.float32)
    check(lambda a, c: jax_dg.fp8_gemm_nt(a, bc, c=c), (0, 0), a, c, folded=True)


@pytest.mark.parametrize("storage,folded", [("nt", True), ("nn", True), ("tn", False), ("tt", False)])
def test_bf16_gemm_folds_an_m_major_batch(keys, storage, folded):
    a_t, b_n = storage[0] == "t", storage[1] == "n"
    a = jax.random.normal(keys(), (B, 128, 64) if a_t else (B, 64, 128), jnp.bfloat16)
    b = jax.random.normal(keys(), (128, 192) if b_n else (192, 128), jnp.bfloat16)
    check(getattr(jax_dg, f"bf16_gemm_{storage}"), (0, None), a, b, folded=folded)


def test_bf16_gemm_both_batched_is_one_masked_grouped_gemm(keys):
    a = jax.random.normal(keys(), (B, 64, 128), jnp.bfloat16)
    b = jax.random.normal(keys(), (B, 192, 128), jnp.bfloat16)
    hlo = check(jax_dg.bf16_gemm_nt, (0, 0), a, b, folded=True)
    assert "jax_dg_m_grouped_bf16_gemm_nt_masked" in hlo


def test_grads_under_vmap_both_ways(keys):
    x = jax.random.normal(keys(), (B, 64, 128), jnp.bfloat16)
    w = jax.random.normal(keys(), (192, 128), jnp.bfloat16)
    loss = lambda x, w: (jax_dg.bf16_gemm_nt(x, w).astype(jnp.float32) ** 2).sum()   # noqa: E731
    per_item = [jax.grad(loss, (0, 1))(x[i], w) for i in range(B)]
    vg = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None)))(x, w)
    for i in range(B):
        np.testing.assert_array_equal(np.asarray(vg[0][i], np.float32), np.asarray(per_item[i][0], np.float32))
    gv = jax.jit(jax.grad(lambda x, w: jax.vmap(loss, in_axes=(0, None))(x, w).sum(), (0, 1)))(x, w)
    assert jax_dg.calc_diff(gv[1].astype(jnp.float32), sum(g[1].astype(jnp.float32) for g in per_item)) < 1e-5


def test_mqa_logits_folds_query_batches_with_shared_keys(keys):
    m, n, h, d = 32, 256, 32, 64
    q = jax.random.normal(keys(), (B, m, h, d), jnp.bfloat16).astype(FP8)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(keys(), (n, d), jnp.bfloat16))
    w = jax.random.normal(keys(), (B, m, h), jnp.float32)
    ks = jax.random.randint(keys(), (B, m), 0, n // 2)
    ke = ks + jax.random.randint(keys(), (B, m), 0, n // 2)
    hlo = check(lambda q, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke), (0, 0, 0, 0), q, w, ks, ke,
                folded=True)
    assert hlo.count("jax_dg_fp8_fp4_mqa_logits") == 1
    check(lambda q, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=128), (0, 0, 0, 0),
          q, w, ks, ke, folded=True)
    kvb = jax.vmap(jax_dg.per_row_cast_to_fp8)(jax.random.normal(keys(), (B, n, d), jnp.bfloat16))
    check(lambda q, kv, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke), (0, 0, 0, 0, 0),
          q, kvb, w, ks, ke, folded=False)


def test_paged_logits_fold_request_batches_sharing_a_cache(keys):
    q, cache, w, lens, table = make_case([300, 64, 1, 200], 2, 32, 64, 64, two_d=True, extra_blocks=12)
    qs = jnp.stack([q, q[::-1], q[:, ::-1]])
    ws = jnp.stack([w, w * 2, -w])
    ls = jnp.stack([lens, lens[::-1], jnp.minimum(lens, 50)])
    ts = jnp.stack([table, table[::-1], table])
    hlo = check(lambda q, w, lens, table: jax_dg.paged_mqa_logits(q, cache, w, lens, table, max_model_len=320),
                (0, 0, 0, 0), qs, ws, ls, ts, folded=True)
    assert hlo.count("jax_dg_fp8_fp4_paged_mqa_logits") == 1
