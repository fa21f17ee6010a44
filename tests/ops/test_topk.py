"""The indexer's selection (topk_indices) and the fused indexer steps (indexer_topk,
paged_indexer_topk): exact against lax.top_k through the pure-JAX reference, ties, -inf and
NaN rows, ranges, k past the valid keys, transforms, bad inputs; on the GPU jax_dg's own
kernel bitwise against lax.top_k and against deep_gemm + torch.topk."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.core.checks import ArgumentError
from tests.conftest import check_released, digest, on_cpu, run, to_torch
from tests.ops.test_mqa import gpu_inputs, make_inputs, varied_ranges
from tests.ops.test_paged_mqa import gpu_case, make_case

I32 = jnp.int32


def random_ranges(keys, m, n):
    """Per-row [ks, ke) that start before the row, inside it or past its middle and may end past
    it (the kernel clamps them to the row)."""
    ks = jax.random.randint(keys(), (m,), -5, n // 2).astype(I32)
    ke = jnp.minimum(ks + jax.random.randint(keys(), (m,), 0, n + 10), n + 7).astype(I32)
    return ks, ke


def tricky_logits(keys, m, n, levels=7):
    """Few distinct values (many ties), +0.0 and -0.0, an all -inf row, NaNs, -inf holes."""
    x = jnp.round(jax.random.normal(keys(), (m, n)) * levels) / levels
    x = x.at[0].set(-jnp.inf)
    x = x.at[1, : n // 3].set(jnp.nan)
    x = x.at[2].set(jnp.where(jnp.arange(n) % 2 == 0, 0.0, -0.0))
    x = x.at[3, ::3].set(-jnp.inf)
    return x


@pytest.mark.parametrize("k", [1, 5, 64, 299, 300, 301, 1000])
@pytest.mark.parametrize("ranged", [False, True])
def test_matches_lax_top_k_exactly(keys, k, ranged):
    m, n = 24, 300
    x = tricky_logits(keys, m, n)
    ks, ke = varied_ranges(keys, m, n) if ranged else (None, None)
    f = lambda x, ks, ke: jax_dg.topk_indices(x, k, ks=ks, ke=ke)   # noqa: E731
    got, want = run("auto", f, x, ks, ke), run("xla", f, x, ks, ke)
    np.testing.assert_array_equal(got, want)
    # and the contract spelled out with lax.top_k itself
    xm = np.asarray(x)
    col = np.arange(n)[None, :]
    ok = xm > -np.inf
    if ranged:
        ok &= (col >= np.asarray(ks)[:, None]) & (col < np.asarray(ke)[:, None])
    v, i = jax.lax.top_k(jnp.where(ok, x, -jnp.inf), min(k, n))
    expect = np.full((m, k), -1, np.int32)
    expect[:, :min(k, n)] = np.where(np.asarray(v) > -np.inf, np.asarray(i), -1)
    np.testing.assert_array_equal(got, expect)
    assert (got[0] == -1).all()                          # the -inf row
    assert not np.isin(np.arange(n // 3), got[1]).any()  # NaN is never selected


@pytest.mark.parametrize("ranged", [False, True])
def test_unsorted_is_the_same_set_in_column_order(keys, ranged):
    m, n, k = 24, 300, 100
    x = tricky_logits(keys, m, n)
    ks, ke = varied_ranges(keys, m, n) if ranged else (None, None)
    srt = run("auto", lambda x, ks, ke: jax_dg.topk_indices(x, k, ks=ks, ke=ke), x, ks, ke)
    for backend in ("auto", "xla"):
        got = run(backend, lambda x, ks, ke: jax_dg.topk_indices(x, k, ks=ks, ke=ke, sorted=False), x, ks, ke)
        want = np.sort(np.where(srt < 0, n, srt), axis=1)
        np.testing.assert_array_equal(got, np.where(want == n, -1, want))


def test_offsets_and_ties_order(keys):
    x = jnp.zeros((2, 10)).at[0, 4].set(1.0)
    idx = np.asarray(jax.jit(lambda x: jax_dg.topk_indices(x, 4, offsets=jnp.asarray([100, 0], I32)))(x))
    np.testing.assert_array_equal(idx, [[104, 100, 101, 102], [0, 1, 2, 3]])   # ties: lower column first


def test_repeated_calls_are_identical_and_inputs_unchanged(keys):
    x = tricky_logits(keys, 16, 500)
    before = digest(x)
    f = jax.jit(lambda x: jax_dg.topk_indices(x, 100))
    first = np.asarray(f(x))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(f(x)), first)
    assert digest(x) == before


def test_vmap_folds_into_one_call(keys):
    x = tricky_logits(keys, 12, 200).reshape(3, 4, 200)
    f = jax.jit(jax.vmap(lambda x: jax_dg.topk_indices(x, 17)))
    got = np.asarray(f(x))
    for i in range(3):
        np.testing.assert_array_equal(got[i], np.asarray(jax_dg.topk_indices(x[i], 17)))
    assert f.lower(x).compile().as_text().count("jax_dg_native_topk") == 1


def test_the_ops_bound_on_k_is_the_kernels():
    from jax_dg.core import native
    from jax_dg.ops import topk
    assert native.max_k() == topk.MAX_K


def test_empty_and_bad_inputs():
    assert jax_dg.topk_indices(jnp.zeros((0, 5)), 3).shape == (0, 3)
    assert (np.asarray(jax_dg.topk_indices(jnp.zeros((2, 0)), 3)) == -1).all()
    x = jnp.zeros((4, 8))
    for call, arg in [(lambda: jax_dg.topk_indices(x, 0), "`k`"),
                      (lambda: jax_dg.topk_indices(x, 4097), "`k`"),
                      (lambda: jax_dg.topk_indices(x.astype(jnp.float16), 2), "`logits`"),   # bf16 is widened
                      (lambda: jax_dg.topk_indices(x[0], 2), "`logits`"),
                      (lambda: jax_dg.topk_indices(x, 2, ks=jnp.zeros((3,), I32)), "`ks`"),
                      (lambda: jax_dg.topk_indices(x, 2, ke=jnp.zeros((4,), jnp.float32)), "`ke`"),
                      (lambda: jax_dg.topk_indices(x, 2, offsets=jnp.zeros((5,), I32)), "`offsets`"),
                      (lambda: jax_dg.topk_indices(x, 2, sorted=1), "`sorted`")]:
        with pytest.raises(ArgumentError, match=arg):
            call()


# --- the fused steps ------------------------------------------------------------------------

@pytest.mark.parametrize("width", [None, 400])
def test_indexer_topk_equals_logits_then_topk(keys, width):
    m, n = 40, 700
    q, kv, w = make_inputs(keys, m, n, 32, 64)
    ks, ke = varied_ranges(keys, m, n)
    offsets = ks if width else None

    def fused(q, kv, w, ks, ke):
        return jax_dg.indexer_topk(q, kv, w, ks, ke, 128, max_seqlen_k=width)

    def composed(q, kv, w, ks, ke):
        logits = jax_dg.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=width)
        return jax_dg.topk_indices(logits, 128, offsets=offsets)
    got = run("auto", fused, q, kv, w, ks, ke)
    np.testing.assert_array_equal(got, run("auto", composed, q, kv, w, ks, ke))
    # the reference's logits round differently: compare the selected sets' agreement
    want = run("xla", fused, q, kv, w, ks, ke)
    assert (got == want).mean() > 0.97
    lens = np.minimum(np.asarray(ke) - np.asarray(ks), width or n)
    np.testing.assert_array_equal((got >= 0).sum(1), np.minimum(np.maximum(lens, 0), 128))


def test_indexer_topk_vmap_and_nothing_to_score(keys):
    q, kv, w = make_inputs(keys, 8, 300, 32, 64)
    ks, ke = jax_dg.causal_ks_ke(8, 300)
    qb, wb = jnp.stack([q[0], q[0][::-1]]), jnp.stack([w, -w])
    f = jax.jit(jax.vmap(lambda q, w: jax_dg.indexer_topk((q, None), kv, w, ks, ke, 50)))
    got = np.asarray(f(qb, wb))
    np.testing.assert_array_equal(got[1], np.asarray(jax_dg.indexer_topk((qb[1], None), kv, wb[1], ks, ke, 50)))
    assert f.lower(qb, wb).compile().as_text().count("jax_dg_indexer_topk") == 1
    empty = jax_dg.indexer_topk(q, (kv[0][:0], kv[1][:0]), w, ks * 0, ks * 0, 5)
    assert empty.shape == (8, 5) and (np.asarray(empty) == -1).all()
    with pytest.raises(ArgumentError, match="`k`"):
        jax_dg.indexer_topk(q, kv, w, ks, ke, 0)


def test_paged_indexer_topk_equals_logits_then_topk():
    q, cache, w, lens, table = make_case([300, 64, 1, 200], 2, 32, 64, 64, two_d=True, extra_blocks=5)

    def fused(q, cache, w, lens, table):
        return jax_dg.paged_indexer_topk(q, cache, w, lens, table, 64, max_model_len=320)

    def composed(q, cache, w, lens, table):
        return jax_dg.topk_indices(jax_dg.paged_mqa_logits(q, cache, w, lens, table, max_model_len=320), 64)
    got = run("auto", fused, q, cache, w, lens, table)
    np.testing.assert_array_equal(got, run("auto", composed, q, cache, w, lens, table))
    assert (run("xla", fused, q, cache, w, lens, table) == got).mean() > 0.97
    np.testing.assert_array_equal((got >= 0).sum(1), np.minimum(np.asarray(lens).reshape(-1), 64))


# --- GPU: jax_dg's kernel, bitwise --------------------------------------------------------------

def gpu_logits(key, m, n, ties):
    x = jax.random.normal(key, (m, n), jnp.float32)
    return jnp.round(x * 8) / 8 if ties else x


@pytest.mark.parametrize("n", [1000, 8192, 65536])
def test_rows_starting_past_their_end_select_nothing(keys, n):
    """ks past the row (by a little, by a lot, or beyond ke) leaves no candidate: every slot -1,
    and nothing read past the row (the GPU kernel clamps its first column to the row's length;
    on the GPU this runs the kernel, under memcheck with scripts/sanitize.sh)."""
    x = jax.random.normal(keys(), (4, n), jnp.float32)
    ks = jnp.array([n, n + 3, 2 ** 30, 7], I32)
    ke = jnp.array([n + 100, 2 ** 31 - 1, 2 ** 30 + 5, 5], I32)
    for srt in (True, False):
        got = jax.jit(lambda x, ks, ke: jax_dg.topk_indices(x, 64, ks=ks, ke=ke, sorted=srt))(x, ks, ke)
        np.testing.assert_array_equal(np.asarray(got), -1)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 33, 64, 3000, 4096])
def test_gpu_kernel_at_other_k(keys, k):
    """The sort's edge cases: k of one slot, of fewer slots than threads, and 2048 < k <= 4096
    (eight a thread). Indices equal the C++ CPU twin's, sorted and not."""
    from jax_dg.core import native
    assert native.cuda_built(), "jax_dg's CUDA kernels were not built"
    for ties in (False, True):
        x = gpu_logits(keys(), 64, 8192, ties)
        for srt in (True, False):
            call = lambda x: jax_dg.topk_indices(x, k, sorted=srt)   # noqa: E731
            np.testing.assert_array_equal(np.asarray(jax.jit(call)(x)), on_cpu(call, x))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 8192, 32768, 131072])
@pytest.mark.parametrize("k", [512, 1024, 2048])
def test_gpu_kernel_equals_lax_top_k_and_torch_topk(keys, n, k):
    import torch
    from jax_dg.core import native
    assert native.cuda_built(), "jax_dg's CUDA kernels were not built"
    m = 256 if n > 32768 else 1024
    for ties in (False, True):
        x = gpu_logits(keys(), m, n, ties)
        ks = jax.random.randint(keys(), (m,), 0, n // 4)
        ke = jnp.minimum(ks + jax.random.randint(keys(), (m,), k // 2, n), n).astype(I32)
        for (lo, hi), srt in itertools.product(((None, None), (ks, ke)), (True, False)):
            call = lambda x, lo, hi: jax_dg.topk_indices(x, k, ks=lo, ke=hi, sorted=srt)   # noqa: E731
            f = jax.jit(call)
            got = f(x, lo, hi)
            # indices: the C++ CPU twin's (and the torch specification's, tested on CPU);
            # values: lax.top_k's. (XLA's GPU
            # top_k splits long rows and then breaks ties in another order; on CPU, and for
            # rows up to 8k here, its indices are these too.)
            np.testing.assert_array_equal(np.asarray(got), on_cpu(call, x, lo, hi))
            want = run("xla", call, x, lo, hi)
            if n <= 8192:
                np.testing.assert_array_equal(np.asarray(got), want)
            g = np.asarray(got)
            xs = np.asarray(x)
            pick = lambda i: np.where(i >= 0, np.take_along_axis(xs, np.maximum(i, 0), 1), -np.inf)  # noqa: E731
            np.testing.assert_array_equal(np.sort(pick(g), 1), np.sort(pick(want), 1))
            for _ in range(20 if n == 8192 else 2):
                assert bool(jnp.array_equal(f(x, lo, hi), got))
        # the same values as torch.topk (its tie order is unspecified: compare values)
        tx = to_torch(x)
        tv, _ = torch.topk(tx, k, dim=1)
        mine = torch.gather(tx, 1, to_torch(jax_dg.topk_indices(x, k)).long())
        assert torch.equal(mine, tv)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 4097, 8191, 12289, 30001, 65536, 140000, 270000])
def test_gpu_every_kernel_shape_equals_the_cpu_twin(keys, n):
    """Each of kernels/topk.cu's shapes (8, 16, 32, 64 keys a thread), its scalar loads (a row
    stride that is not a multiple of 4), a cluster of 2 (65536 keys: 8 rows), rows split over
    independent CTAs (140000 and 270000 keys: ranges cut at chunk edges, chunks without
    candidates, ties across chunks) and the long-row kernel where a split's candidates would not
    fit a CTA (270000 keys, k 4096): tricky values, random ranges, k from 1 to 4096, sorted and
    not, equal to the CPU twin. (Clusters of 4 and 8, which split rows replaced, are compared on
    every row by topk_shapes.cu.)"""
    from jax_dg.core import native
    assert native.cuda_built(), "jax_dg's CUDA kernels were not built"
    m = 8
    x = tricky_logits(keys, m, n, levels=3)
    ks, ke = random_ranges(keys, m, n)
    for k, srt, ranged in itertools.product((1, 777, 4096), (True, False), (False, True)):
        lo, hi = (ks, ke) if ranged else (None, None)
        call = lambda x, lo, hi: jax_dg.topk_indices(x, k, ks=lo, ke=hi, sorted=srt)   # noqa: E731
        got = np.asarray(jax.jit(call)(x, lo, hi))
        np.testing.assert_array_equal(got, on_cpu(call, x, lo, hi), err_msg=f"k {k} sorted {srt} ranged {ranged}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 8191, 30001, 40000])
def test_gpu_rows_past_one_persistent_grid_equal_the_cpu_twin(keys, n):
    """More rows than one persistent grid has clusters (2 an SM): where JaxDgTopkRows picks that
    grid (unsorted rows, and sorted rows of one CTA: all of these) a CTA selects several rows,
    loading the next one while it selects the current one; sorted rows split over a cluster take
    a cluster a row. Sorted rows of 40000 keys are split in two chunks (kernels/topk_split.h:
    700 rows, more clusters of 2 than SMs), both launches crossing rows; unsorted ones take a
    cluster of 2. (topk_shapes.cu compares both grids on every default shape, sorted and not.)"""
    m = 700
    x = tricky_logits(keys, m, n, levels=3)
    x = x.at[m // 2:].set(jax.random.normal(keys(), (m - m // 2, n)))   # rows without ties too
    ks, ke = random_ranges(keys, m, n)
    for k, srt in itertools.product((777, 4096), (True, False)):
        call = lambda x, lo, hi: jax_dg.topk_indices(x, k, ks=lo, ke=hi, sorted=srt)   # noqa: E731
        got = np.asarray(jax.jit(call)(x, ks, ke))
        np.testing.assert_array_equal(got, on_cpu(call, x, ks, ke), err_msg=f"k {k} sorted {srt}")


@pytest.mark.gpu
@pytest.mark.parametrize("s,sk", [(2048, 8192), (1024, 32768)])
def test_gpu_indexer_topk_matches_deep_gemm_and_torch_topk(keys, s, sk):
    import deep_gemm
    import torch
    from jax_dg.runtime import landing
    q, kv, w, ks, ke = gpu_inputs(keys, s, sk, 64, 128)
    before = digest(q, kv, w, ks, ke)
    f = jax.jit(lambda *a: jax_dg.indexer_topk(*a, 2048))
    counts = landing.counts()
    idx = f(q, kv, w, ks, ke)
    jax.block_until_ready(idx)
    now = landing.counts()
    assert now["landed"] > counts["landed"], "the logits did not land in XLA's buffer"
    check_released(now["released"] - counts["released"] == now["landed"] - counts["landed"],
                   "a landed segment stayed in torch's pools (it could be handed out again)")
    assert now["refused"] == counts["refused"]
    # bitwise equal to topk over jax_dg's (= deep_gemm's) logits
    logits = jax.jit(lambda *a: jax_dg.mqa_logits(*a))(q, kv, w, ks, ke)
    want = np.asarray(jax_dg.topk_indices(logits, 2048))
    if not np.array_equal(np.asarray(idx), want):   # say how, for a failure seen only under initcheck
        got, lg = np.asarray(idx), np.asarray(logits)
        rows = np.flatnonzero((got != want).any(axis=1))
        at = lambda i: np.where(i >= 0, np.take_along_axis(lg, np.maximum(i, 0), 1), -np.inf)  # noqa: E731
        r = rows[:4].tolist()
        pytest.fail(f"{rows.size} rows differ from topk_indices(mqa_logits) (rows {r}); same values "
                    f"there: {bool(np.array_equal(at(got)[rows], at(want)[rows]))}; sorted values of "
                    f"the indexer's picks equal: {bool(np.array_equal(np.sort(at(got), 1), np.sort(at(want), 1)))}; "
                    f"mqa_logits bitwise repeatable: "
                    f"{bool(jnp.array_equal(jax.jit(jax_dg.mqa_logits)(q, kv, w, ks, ke), logits))}; "
                    f"indexer repeatable: {bool(jnp.array_equal(f(q, kv, w, ks, ke), idx))}")
    # the values torch.topk selects from deep_gemm's own logits
    tq, tkv = to_torch(q[0]), (to_torch(kv[0]), to_torch(kv[1]))
    dg = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, to_torch(w), to_torch(ks), to_torch(ke),
                                      clean_logits=True, max_seqlen_k=0)
    tv, _ = torch.topk(dg, 2048, dim=1)

    def values_at(indices):   # deep_gemm's logits at the indices, -inf at the -1 slots
        ti = to_torch(indices).long()
        return torch.where(ti >= 0, torch.gather(dg, 1, ti.clamp(min=0)), float("-inf"))
    assert torch.equal(values_at(idx), tv)
    for rep in range(20):
        again = f(q, kv, w, ks, ke)
        if not bool(jnp.array_equal(again, idx)):   # say where, for a failure seen only once
            rows = np.flatnonzero((np.asarray(again) != np.asarray(idx)).any(axis=1))
            same_logits = bool(jnp.array_equal(jax.jit(jax_dg.mqa_logits)(q, kv, w, ks, ke), logits))
            valid = torch.equal(values_at(again), tv)
            r = rows[:8].tolist()
            pytest.fail(f"repeat {rep}: {rows.size} rows differ from the first call (rows {r}, ks "
                        f"{np.asarray(ks)[r].tolist()}, ke {np.asarray(ke)[r].tolist()}); still "
                        f"torch.topk's values: {valid}; mqa_logits bitwise repeatable now: {same_logits}")
    uns = np.asarray(jax.jit(lambda *a: jax_dg.indexer_topk(*a, 2048, sorted=False))(q, kv, w, ks, ke))
    srt = np.asarray(idx)
    want = np.sort(np.where(srt < 0, sk, srt), axis=1)
    np.testing.assert_array_equal(uns, np.where(want == sk, -1, want))
    assert digest(q, kv, w, ks, ke) == before


@pytest.mark.gpu
@pytest.mark.parametrize("b", [64, 256])
def test_gpu_paged_indexer_topk(b):
    import deep_gemm
    import torch
    q, cache, w, lens, table, max_len = gpu_case(b, 1, 64, avg=16384, seed=b)
    f = jax.jit(lambda *a: jax_dg.paged_indexer_topk(*a, 2048, max_model_len=max_len))
    idx = f(q, cache, w, lens, table)
    logits = jax.jit(lambda *a: jax_dg.paged_mqa_logits(*a, max_model_len=max_len))(q, cache, w, lens, table)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(jax_dg.topk_indices(logits, 2048)))
    meta = deep_gemm.get_paged_mqa_logits_metadata(to_torch(lens), 64, deep_gemm.get_num_sms())
    dg = deep_gemm.fp8_fp4_paged_mqa_logits((to_torch(q), None), to_torch(cache), to_torch(w),
                                            to_torch(lens), to_torch(table), meta, max_len,
                                            clean_logits=False)
    valid = torch.arange(max_len, device="cuda")[None, :] < to_torch(lens).reshape(-1, 1)
    dg = torch.where(valid, dg, float("-inf"))
    tv, _ = torch.topk(dg, 2048, dim=1)
    ti = to_torch(idx).long()
    assert torch.equal(torch.where(ti >= 0, torch.gather(dg, 1, ti.clamp(min=0)), float("-inf")), tv)
    for _ in range(5):
        assert bool(jnp.array_equal(f(q, cache, w, lens, table), idx))


def test_indices_differentiate_to_nothing_as_argmax_does():
    """Integer outputs have no tangent: a model that gathers with the indices trains (the
    gradient flows through what it gathers), as with jnp.argmax or lax.top_k's indices."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (8, 64), jnp.float32)

    def picked(x):
        idx = jax_dg.topk_indices(x, 4)
        return jnp.take_along_axis(x, jnp.maximum(idx, 0), axis=1).sum()
    g = np.asarray(jax.grad(picked)(logits))
    top = np.argsort(-np.asarray(logits), axis=1)[:, :4]
    want = np.zeros_like(g)
    np.put_along_axis(want, top, 1.0, axis=1)
    np.testing.assert_array_equal(g, want)
