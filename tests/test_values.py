"""Data-dependent index values (issue 13): out-of-range values give the documented result on
both references (the torch emulation through the bridge, the pure-JAX one) and, on the GPU,
on DeepGEMM (small shapes: the cases `scripts/sanitize.sh values` runs under memcheck); under
jax_dg.checked() each raises naming the argument, eagerly and inside jit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.operands import paged
from jax_dg.core import values
from tests.conftest import on_deep_gemm

FP8 = jnp.float8_e4m3fn
I32 = jnp.int32
INT_MIN = -2 ** 31


def on(backend, fn, *args):
    with jax_dg.use_backend(backend):
        return np.asarray(jax.jit(fn)(*args))


def same_result(fn, bad, good, backends=("auto", "xla")):
    """fn(*bad) on each backend is bitwise fn(*good) on that backend (the documented result),
    and the backends agree to float tolerance (-inf and -1 exactly)."""
    outs = []
    for backend in backends:
        got, want = on(backend, fn, *bad), on(backend, fn, *good)
        np.testing.assert_array_equal(got, want, err_msg=backend)
        outs.append(got)
    a, b = outs[0], outs[-1]
    if jnp.issubdtype(a.dtype, jnp.floating):   # bfloat16 too (numpy's kind "V")
        a, b = a.astype(np.float32), b.astype(np.float32)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
        fin = np.isfinite(a)
        if on_deep_gemm():   # FP8 tensor-core sums: errors scale with the output, DeepGEMM's metric
            assert jax_dg.calc_diff(a[fin], b[fin]) < 1e-3
        else:   # the two backends' sums may round to neighbouring values of the output type
            tol = max(2e-3, float(jnp.finfo(outs[0].dtype).eps))
            np.testing.assert_allclose(a[fin], b[fin], rtol=tol, atol=2e-3)
    else:
        np.testing.assert_array_equal(a, b)
    return outs[0]


def naming(arg: str) -> str:
    """The error-message pattern for `arg`. "a|b": either, where a case has both out of range
    (under jit the checks are host callbacks, which a GPU runs in no set order)."""
    return "|".join(f"`{a}`" for a in arg.split("|"))


def raises_naming(arg, fn, *args):
    """checked(): eagerly an ArgumentError, under jit the runtime error of the compiled check:
    one line, jax_dg's message after XLA's status code."""
    with values.checked():
        with pytest.raises(jax_dg.ArgumentError, match=naming(arg.split("|")[0])):
            fn(*args)   # eagerly the checks run in program order
        # JAX raises a failed program as JaxRuntimeError, as ValueError from jit's C++ fast path
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=naming(arg)) as e:
            jax.block_until_ready(jax.jit(fn)(*args))
    assert re.fullmatch(r"INVALID_ARGUMENT: \w+: `\w+` [^\n]+ \(\d+ of \d+ [a-z ]+\)", str(e.value)), str(e.value)


# --- cases: (fn, bad args, the args whose result the bad ones are documented to give, arg) ----

def mqa_case(compressed: bool):
    rng = np.random.default_rng(1)
    m, n, h, d = 6, 40, 16, 32
    q = jnp.asarray(rng.standard_normal((m, h, d)).astype(np.float32)).astype(FP8)
    kv = jax_dg.per_row_cast_to_fp8(jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16))
    w = jnp.asarray(rng.standard_normal((m, h)).astype(np.float32))
    width = 16 if compressed else None
    ks = jnp.array([-3, INT_MIN, 5, 38, INT_MIN, 50], I32)
    ke = jnp.array([4, 12, 2 ** 31 - 1, 60, INT_MIN, 70], I32)
    good_ks = jnp.clip(ks, 0, n)
    good_ke = jnp.clip(ke, good_ks, n)
    fn = lambda q, kv, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=width)  # noqa: E731
    return fn, (q, kv, w, ks, ke), (q, kv, w, good_ks, good_ke)


def indexer_case():
    fn, bad, good = mqa_case(compressed=True)
    k = lambda q, kv, w, ks, ke: jax_dg.indexer_topk(q, kv, w, ks, ke, 8, max_seqlen_k=16)  # noqa: E731
    return k, bad, good


def topk_case():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((3, 50)).astype(np.float32))
    ks, ke = jnp.array([-7, INT_MIN, 10], I32), jnp.array([20, 2 ** 31 - 1, 80], I32)
    fn = lambda x, ks, ke: jax_dg.topk_indices(x, 8, ks=ks, ke=ke)  # noqa: E731
    return fn, (logits, ks, ke), (logits, jnp.clip(ks, 0, 50), jnp.clip(ke, 0, 50))


def paged_inputs(blk=64, next_n=1, seed=3):
    rng = np.random.default_rng(seed)
    ctx = np.array([150, 64, 200], np.int32)
    table, nb = paged.build_block_tables(ctx, blk, key=seed, num_blocks=12 * 64 // blk)
    cache = paged.quantize_kv_cache(jnp.asarray(rng.standard_normal((nb, blk, 64)), jnp.bfloat16))
    q = jnp.asarray(rng.standard_normal((3, next_n, 32, 64)).astype(np.float32)).astype(FP8)
    w = jnp.asarray(rng.standard_normal((3 * next_n, 32)).astype(np.float32))
    return q, cache, w, jnp.asarray(ctx), np.asarray(table), nb


def paged_table_case(blk=64):
    """-1 and num_blocks in the used blocks of requests 0 and 2: their contexts end there."""
    q, cache, w, ctx, table, nb = paged_inputs(blk)
    bad = table.copy()
    bad[0, 1] = -1                 # request 0: context ends at token blk
    bad[2, 2] = nb + 5             # request 2: at 2 * blk
    bad[1, -1] = INT_MIN           # past request 1's context: never scored
    good_ctx = jnp.asarray(np.minimum(np.asarray(ctx), [blk, 10 ** 6, 2 * blk]).astype(np.int32))
    good_table = np.where((bad < 0) | (bad >= nb), 0, bad)
    fn = lambda q, c, w, lens, t: jax_dg.paged_mqa_logits(q, c, w, lens, t, max_model_len=256)  # noqa: E731
    return fn, (q, cache, w, ctx, jnp.asarray(bad)), (q, cache, w, good_ctx, jnp.asarray(good_table))


def paged_schedule_case():
    """context_lens above max_model_len with the caller's schedule of those lengths."""
    q, cache, w, ctx, table, _ = paged_inputs()
    max_len = 128

    def fn(q, c, w, lens, t):
        meta = jax_dg.get_paged_mqa_logits_metadata(lens, 64)
        return jax_dg.paged_mqa_logits(q, c, w, lens, t, max_model_len=max_len, schedule_metadata=meta)
    good = jnp.minimum(ctx, max_len)
    return fn, (q, cache, w, ctx, jnp.asarray(table)), (q, cache, w, good, jnp.asarray(table))


def paged_topk_case():
    fn, bad, good = paged_table_case()
    k = lambda q, c, w, lens, t: jax_dg.paged_indexer_topk(q, c, w, lens, t, 16, max_model_len=256)  # noqa: E731
    return k, bad, good


def grouped_case(fp8: bool):
    rng = np.random.default_rng(4)
    m, k, n, g = 256, 128, 64, 2
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wt = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    layout = np.repeat(np.array([0, 1], np.int32), 128)
    bad = layout.copy()
    bad[5], bad[130], bad[131], bad[200] = 2, -2, INT_MIN, 2 ** 31 - 1
    good = np.where((bad >= 0) & (bad < g), bad, -1)
    if fp8:
        a = jax_dg.per_token_cast_to_fp8(x)
        b = jax.vmap(jax_dg.per_block_cast_to_fp8)(wt)
        fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous
    else:
        a, b, fn = x, wt, jax_dg.m_grouped_bf16_gemm_nt_contiguous
    return fn, (a, b, jnp.asarray(bad)), (a, b, jnp.asarray(good))


def psum_case(clean: bool):
    """The psum layout's traced offsets, with or without clean: clipped to [0, M] and made
    non-decreasing before DeepGEMM reads them."""
    rng = np.random.default_rng(6)
    m, k, n, g = 384, 128, 64, 3
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wt = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    bad = np.array([200, 100, 2 ** 31 - 1], np.int32)   # decreasing, then past M
    good = np.array([200, 200, m], np.int32)
    fn = lambda a, b, p: jax_dg.m_grouped_bf16_gemm_nt_contiguous(  # noqa: E731
        a, b, p, use_psum_layout=True, clean=clean)
    return fn, (x, wt, jnp.asarray(bad)), (x, wt, jnp.asarray(good))


def masked_case(fp8: bool):
    rng = np.random.default_rng(5)
    g, mmax, k, n = 3, 128, 128, 64
    x = jnp.asarray(rng.standard_normal((g, mmax, k)), jnp.bfloat16)
    wt = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    bad = jnp.array([mmax + 1, -4, 2 ** 31 - 1], I32)
    good = jnp.clip(bad, 0, mmax)
    if fp8:
        a = jax.vmap(jax_dg.per_token_cast_to_fp8)(x)
        b = jax.vmap(jax_dg.per_block_cast_to_fp8)(wt)
        op = jax_dg.m_grouped_fp8_gemm_nt_masked
    else:
        a, b, op = x, wt, jax_dg.m_grouped_bf16_gemm_nt_masked
    fn = lambda a, b, mm: op(a, b, mm, 64)  # noqa: E731
    return fn, (a, b, bad), (a, b, good)


def gate_inputs():
    rng = np.random.default_rng(6)
    t, h, e, topk = 8, 256, 16, 4
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((e, h)) * h ** -0.5, jnp.bfloat16)
    return x, w, t, e, topk


def gate_fn(topk, kw):
    return lambda x, w, *a: jax_dg.bf16_mega_gate(x, w, topk, scoring_func="sigmoid",
                                                  routed_scaling_factor=1.5, ep_rank=1, **kw(*a))


def gate_fix_case():
    x, w, t, e, topk = gate_inputs()
    fix = jnp.asarray(np.arange(t) % 2 == 0)
    idx = np.tile(np.arange(topk, dtype=np.int32), (t, 1))
    idx[0, 1], idx[2, 3] = e, -1          # fixed rows 0 and 2 hold bad ids: routed afresh
    good_fix = fix.at[0].set(False).at[2].set(False)
    fn = gate_fn(topk, kw=lambda f, i: dict(fix_routing_mask=f, unmapped_topk_idx=i))
    good_idx = np.clip(idx, 0, e - 1)
    return fn, (x, w, fix, jnp.asarray(idx)), (x, w, good_fix, jnp.asarray(good_idx))


def gate_count_case():
    x, w, t, e, topk = gate_inputs()
    table = np.stack([np.arange(e), (np.arange(e) + 1) % e], 1).astype(np.int32)
    count = np.full(e, 2, np.int32)
    count[0], count[3], count[5] = 0, 7, INT_MIN
    good = np.clip(count, 1, 2)
    fn = gate_fn(topk, kw=lambda m, c: dict(to_physical_map=m, logical_count=c))
    return fn, (x, w, jnp.asarray(table), jnp.asarray(count)), (x, w, jnp.asarray(table), jnp.asarray(good))


CASES = {
    "mqa_full": (lambda: mqa_case(False), "cu_seqlen_ks|cu_seqlen_ke"),
    "mqa_compressed": (lambda: mqa_case(True), "cu_seqlen_ks|cu_seqlen_ke"),
    "indexer_topk": (indexer_case, "cu_seqlen_ks|cu_seqlen_ke"),
    "topk_indices": (topk_case, "ks"),
    "paged_block_tables": (paged_table_case, "block_tables"),
    "paged_block_tables_32": (lambda: paged_table_case(32), "block_tables"),
    "paged_schedule": (paged_schedule_case, "context_lens"),
    "paged_indexer_topk": (paged_topk_case, "block_tables"),
    "grouped_fp8": (lambda: grouped_case(True), "grouped_layout"),
    "grouped_bf16": (lambda: grouped_case(False), "grouped_layout"),
    "psum": (lambda: psum_case(True), "grouped_layout"),
    "psum_raw": (lambda: psum_case(False), "grouped_layout"),
    "masked_fp8": (lambda: masked_case(True), "masked_m"),
    "masked_bf16": (lambda: masked_case(False), "masked_m"),
    "gate_unmapped": (gate_fix_case, "unmapped_topk_idx"),
    "gate_logical_count": (gate_count_case, "logical_count"),
}
SM100_ONLY = {"gate_unmapped", "gate_logical_count"}


@pytest.mark.parametrize("case", CASES)
def test_out_of_range_values_give_the_documented_result(case):
    if case == "psum_raw" and on_deep_gemm():
        pytest.skip("rows in no group are unspecified on DeepGEMM with clean=False (see below)")
    fn, bad, good = CASES[case][0]()
    backends = ("torch", "xla") if case in SM100_ONLY else ("auto", "xla")
    same_result(fn, bad, good, backends)


@pytest.mark.parametrize("case", CASES)
def test_checked_mode_raises_naming_the_argument(case):
    fn, bad, good = CASES[case][0]()
    with jax_dg.use_backend("torch" if case in SM100_ONLY else "auto"):
        raises_naming(CASES[case][1], fn, *bad)
        with values.checked():   # in-range values pass the checks
            jax.block_until_ready(jax.jit(fn)(*good))


def test_checked_mode_names_ke_and_the_schedule():
    fn, (q, kv, w, ks, ke), _ = mqa_case(False)
    raises_naming("cu_seqlen_ke", fn, q, kv, w, jnp.zeros_like(ks), ke)
    q, cache, w, ctx, table, _ = paged_inputs()
    other = jax_dg.get_paged_mqa_logits_metadata(ctx + 300, 64)
    f = lambda q, c, w, lens, t, m: jax_dg.paged_mqa_logits(q, c, w, lens, t, schedule_metadata=m)  # noqa: E731
    raises_naming("schedule_metadata", f, q, cache, w, ctx, jnp.asarray(table), other)


def test_checked_is_part_of_the_jit_cache_key_and_off_by_default(monkeypatch):
    fn, bad, _ = mqa_case(False)
    f = jax.jit(fn)
    f(*bad)                                   # sanitised
    with values.checked(), pytest.raises(Exception, match=naming("cu_seqlen_ks|cu_seqlen_ke")):
        jax.block_until_ready(f(*bad))        # traced again, checked
    f(*bad)
    monkeypatch.setenv(values.ENV, "1")
    assert values.checking()
    with values.checked(False):
        assert not values.checking()
    assert jax_dg.checked is values.checked


def test_compressed_clamp_does_not_overflow_near_int_min():
    ks = jnp.array([INT_MIN, INT_MIN + 1, -1, 2 ** 31 - 1], I32)
    ke = jnp.array([2 ** 31 - 1, 5, 2 ** 31 - 1, INT_MIN], I32)
    from jax_dg.core import values
    ks2, ke2 = values.key_ranges("t", ks, ke, 40)
    ks3, ke3 = values.key_ranges("t", ks, ke, 40, width=16)
    np.testing.assert_array_equal(np.asarray(ks2), [0, 0, 0, 40])
    np.testing.assert_array_equal(np.asarray(ke2), [40, 5, 40, 40])
    np.testing.assert_array_equal(np.asarray(ks3), np.asarray(ks2))
    np.testing.assert_array_equal(np.asarray(ke3), [16, 5, 16, 40])


def test_references_agree_on_raw_out_of_range_tables():
    """The two references alone (no op sanitising) define an out-of-range entry the same way."""
    import torch
    from jax_dg.backends.torch_emu import paged_mqa as tref
    from jax_dg.reference import paged_mqa as jref
    fn, (q, cache, w, ctx, bad), _ = paged_table_case()
    lens = ctx[:, None]
    want = np.asarray(jref.paged_mqa_logits(q, None, cache, w, lens, bad, max_model_len=256))
    meta = torch.zeros((tref.get_num_sms() + 1, 2), dtype=torch.int32)
    t = lambda x: torch.from_dlpack(x)  # noqa: E731
    qt = t(jax.lax.bitcast_convert_type(q, jnp.uint8)).view(torch.float8_e4m3fn)
    got = tref.fp8_fp4_paged_mqa_logits((qt, None), t(cache), t(w), t(lens), t(bad), meta.to(qt.device),
                                        256).cpu().numpy()
    valid = ~np.isneginf(want)
    np.testing.assert_array_equal(valid, ~np.isnan(got))   # the torch emulation leaves NaN
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-3, atol=2e-3)


# --- GPU: the same cases on DeepGEMM (small shapes), the documented result bitwise -------------

# psum_raw (clean=False) leaves the rows in no group unspecified on DeepGEMM: only its
# offsets' sanitising is defined, which the CPU cases show.
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(set(CASES) - SM100_ONLY - {"psum_raw"}))
def test_gpu_out_of_range_values_give_the_documented_result(case):
    fn, bad, good = CASES[case][0]()
    f = jax.jit(fn)
    want = np.asarray(f(*good))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(*bad)), want)
    with values.checked():
        with pytest.raises(Exception, match=naming(CASES[case][1])):
            jax.block_until_ready(jax.jit(fn)(*bad))


# --- the grouped-contiguous layout: what DeepGEMM computes other than written -------------------
def misaligned_case(layout):
    rng = np.random.default_rng(7)
    m, k, n, g = layout.shape[0], 128, 64, 3
    a = jax_dg.per_token_cast_to_fp8(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16))
    b = jax.vmap(jax_dg.per_block_cast_to_fp8)(jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16))
    return a, b


@pytest.mark.parametrize("form", ["64-row groups", "padding opens a block", "padding opens a slice"])
def test_checked_mode_refuses_a_layout_deepgemm_computes_otherwise(form):
    """A block of A = 128 rows is computed with the group of its first row, and a 64-row slice
    that opens with padding is skipped: such layouts raise under checked(), naming the rows."""
    layout = np.full(256, -1, np.int32)
    if form == "64-row groups":
        layout[:] = np.repeat([0, 1, 2, 0], 64)
    elif form == "padding opens a block":
        layout[130:256] = 1
    else:
        layout[:10], layout[70:128] = 0, 0
    a, b = misaligned_case(layout)
    fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous
    raises_naming("grouped_layout", fn, a, b, jnp.asarray(layout))
    with pytest.raises(jax_dg.ArgumentError, match="first row of its block of A = get_mk_alignment"):
        fn(a, b, layout)   # ids known while tracing: refused with or without checked()


def test_layouts_deepgemm_computes_as_written_pass_the_check():
    """Padding inside a group's block (e.g. ids made -1 as out of range) is computed as written."""
    layout = np.repeat(np.array([0, 2], np.int32), 128)
    layout[5], layout[100:128], layout[200:] = -1, -1, -1
    a, b = misaligned_case(layout)
    fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous
    with values.checked():
        jax.block_until_ready(jax.jit(fn)(a, b, jnp.asarray(layout)))
        jax.block_until_ready(fn(a, b, layout))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(set(CASES) - SM100_ONLY))
def test_gpu_checked_mode_raises_one_line_from_the_device(case):
    """On the GPU the compiled check copies its vector to the host on XLA's stream: the same
    one-line error, and in-range values pass."""
    assert jax.default_backend() == "gpu"
    fn, bad, good = CASES[case][0]()
    raises_naming(CASES[case][1], fn, *bad)
    with values.checked():
        jax.block_until_ready(jax.jit(fn)(*good))


@pytest.mark.gpu
def test_gpu_misaligned_layout_raises_under_checked():
    layout = np.repeat(np.array([0, 1, 2, 0], np.int32), 64)
    a, b = misaligned_case(layout)
    raises_naming("grouped_layout", jax_dg.m_grouped_fp8_gemm_nt_contiguous, a, b, jnp.asarray(layout))
