"""Defects a fuzz of invalid calls found (issue 13's list): each raises ArgumentError naming the
argument, before anything reads the bad value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.operands import paged

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


@pytest.mark.parametrize("x", [None, [1.0, 2.0], "x", 3])
@pytest.mark.parametrize("fn", ["per_token_cast_to_fp8", "per_block_cast_to_fp8"])
def test_quantisers_name_a_non_array(fn, x):
    with pytest.raises(jax_dg.ArgumentError, match=f"{fn}: `x` must be an array"):
        getattr(jax_dg, fn)(x)


@pytest.mark.parametrize("gran_k", [0, -128, None, "128", 128.0, True])
def test_quantisers_name_a_bad_gran_k(gran_k):
    with pytest.raises(jax_dg.ArgumentError, match="`gran_k` must"):
        jax_dg.per_token_cast_to_fp8(jnp.ones((2, 256)), gran_k=gran_k)
    with pytest.raises(jax_dg.ArgumentError, match="`gran_k` must"):
        jax.jit(lambda g: jax_dg.per_token_cast_to_fp8(jnp.ones((2, 256)), gran_k=g))(128)


def test_quantisers_take_an_empty_batch_and_reject_integers():
    for fn in (jax_dg.per_token_cast_to_fp8, jax_dg.per_block_cast_to_fp8):
        v, s = fn(jnp.ones((0, 256)))
        assert v.shape == (0, 256) and v.dtype == FP8 and s.shape[1] == 2
    with pytest.raises(jax_dg.ArgumentError, match="`x` must have a floating dtype"):
        jax_dg.per_token_cast_to_fp8(jnp.ones((2, 128), jnp.int32))
    with pytest.raises(jax_dg.ArgumentError, match="`use_ue8m0` must be a Python bool"):
        jax_dg.per_token_cast_to_fp8(jnp.ones((2, 128)), "yes")


@pytest.mark.parametrize("recipe", [(1, 128, 128.5), 5, "x", (1, 128), (True, 128, 128)])
def test_recipe_must_be_three_ints(recipe):
    a = jax_dg.per_token_cast_to_fp8(jnp.ones((16, 128)))
    b = jax_dg.per_block_cast_to_fp8(jnp.ones((16, 128)))
    with pytest.raises(jax_dg.ArgumentError, match="`recipe` must be a tuple of three positive ints"):
        jax_dg.fp8_gemm_nt(a, b, recipe=recipe)


GEMMS_WITH_OUT_DTYPE = ([f"fp8_gemm_{s}" for s in ("nt", "nn", "tn", "tt")]
                        + [f"{f}_{s}" for f in ("bf16_gemm", "cublaslt_gemm") for s in ("nt", "nn", "tn", "tt")])


@pytest.mark.parametrize("name", GEMMS_WITH_OUT_DTYPE + ["einsum"])
def test_out_dtype_nonsense_names_the_argument(name):
    if name == "einsum":
        args = ("bmk,bnk->mn", jnp.ones((2, 64, 64), BF16), jnp.ones((2, 64, 64), BF16))
    elif name.startswith("fp8"):
        q = jax_dg.per_token_cast_to_fp8(jnp.ones((128, 128)))
        args = (q, q)
    else:
        args = (jnp.ones((64, 64), BF16), jnp.ones((64, 64), BF16))
    with pytest.raises(jax_dg.ArgumentError, match="`out_dtype` must be a dtype"):
        getattr(jax_dg, name)(*args, out_dtype="nonsense")


def test_bool_layouts_are_rejected_before_they_are_read():
    w = jnp.ones((2, 64, 64), BF16)
    with pytest.raises(jax_dg.ArgumentError, match="`grouped_layout` must have dtype int32, got bool"):
        jax_dg.m_grouped_bf16_gemm_nt_contiguous(jnp.ones((128, 64), BF16), w, jnp.zeros((128,), bool))
    with pytest.raises(jax_dg.ArgumentError, match="`masked_m` must have dtype int32, got bool"):
        jax_dg.m_grouped_bf16_gemm_nt_masked(jnp.ones((2, 128, 64), BF16), w, jnp.zeros((2,), bool), 4)


def test_k_grouped_ks_out_of_int32_range():
    a = (jnp.zeros((256 * 4,), FP8), jnp.ones((2, 4), F32))
    with pytest.raises(jax_dg.ArgumentError, match=r"`ks` must be multiples of 128 in \[0, 2\*\*31\)"):
        jax_dg.k_grouped_fp8_gemm_nt_contiguous(a, a, [2 ** 31, 256], c=jnp.zeros((2, 4, 4)))


def test_mega_mhc_statics_must_be_numbers(keys):
    from tests.ops.test_mhc import SCALARS, make_inputs
    args, _ = make_inputs(keys, 16, 256, False)
    for name in ("hc_norm_eps", "hc_pre_eps", "rmsnorm_scale"):
        kw = dict(SCALARS, **{name: None})
        with pytest.raises(jax_dg.ArgumentError, match=f"`{name}` must be a static Python number"):
            jax_dg.mega_mhc(*args, **kw)


@pytest.mark.parametrize("block_size", [0, -64, 1.5])
def test_block_tables_need_a_positive_block_size(block_size):
    with pytest.raises(jax_dg.ArgumentError, match="build_block_tables: `block_size` must"):
        paged.build_block_tables([3, 70], block_size)


# --- siblings of the fuzz's defects: the other quantisers, static args once read with int(),
# float() or bool(), and integer arrays converted before they were checked ---------------------

X = jnp.ones((4, 128))
I4 = jnp.zeros((4,), jnp.int32)
BT = jnp.zeros((2, 2), jnp.int32)


@pytest.mark.parametrize("bad", [None, [1.0, 2.0], "x", 3])
@pytest.mark.parametrize("name,call", [
    ("ceil_to_ue8m0", lambda v: jax_dg.ceil_to_ue8m0(v)),
    ("pack_ue8m0_to_int", lambda v: jax_dg.pack_ue8m0_to_int(v)),
    ("per_row_cast_to_fp8", lambda v: jax_dg.per_row_cast_to_fp8(v)),
    ("quantize_kv_cache", lambda v: paged.quantize_kv_cache(v)),
    ("fold_q_scale", lambda v: jax_dg.fold_q_scale(jnp.ones((4, 8)), v)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_other_quantisers_name_a_non_array(name, call, bad):
    with pytest.raises(jax_dg.ArgumentError, match=rf"{name}: `\w+` must"):
        call(bad)


@pytest.mark.parametrize("call,arg", [
    (lambda: jax_dg.per_row_cast_to_fp8(jnp.ones((4, 128), jnp.int32)), "x"),
    (lambda: jax_dg.ceil_to_ue8m0(jnp.ones((4,), jnp.int32)), "x"),
    (lambda: jax_dg.pack_ue8m0_to_int(jnp.ones((4, 6))), "x"),
    (lambda: paged.quantize_kv_cache(jnp.ones((2, 64, 128), jnp.int32)), "k"),
    (lambda: jax_dg.calc_diff(None, None), "x"),
    (lambda: jax_dg.calc_diff(np.ones(4), np.ones(5)), "y"),
])
def test_other_quantisers_name_a_bad_array(call, arg):
    with pytest.raises(jax_dg.ArgumentError, match=f"`{arg}` must"):
        call()


def _mqa_args():
    q = (jnp.zeros((4, 32, 64), FP8), None)
    kv = (jnp.zeros((8, 64), FP8), jnp.ones((8,), F32))
    return q, kv, jnp.ones((4, 32), F32), I4, I4 + 8


W2 = jnp.ones((2, 64, 64), BF16)


@pytest.mark.parametrize("flag", ["no", 1, 0.5])
@pytest.mark.parametrize("arg,call", [
    ("clean", lambda f: jax_dg.m_grouped_bf16_gemm_nt_contiguous(
        jnp.ones((128, 64), BF16), W2, jnp.zeros((128,), jnp.int32), clean=f)),
    ("clean", lambda f: jax_dg.m_grouped_bf16_gemm_nt_masked(
        jnp.ones((2, 128, 64), BF16), W2, jnp.zeros((2,), jnp.int32), 4, clean=f)),
    ("clean_logits", lambda f: jax_dg.mqa_logits(*_mqa_args(), clean_logits=f)),
    ("use_cublaslt", lambda f: jax_dg.einsum("bhr,hdr->bhd", jnp.ones((4, 2, 64), BF16),
                                             jnp.ones((2, 64, 64), BF16), use_cublaslt=f)),
    ("use_ue8m0", lambda f: jax_dg.per_row_cast_to_fp8(X, use_ue8m0=f)),
    ("include_self", lambda f: jax_dg.causal_ks_ke(4, 8, include_self=f)),
    ("include_self", lambda f: jax_dg.varlen_causal_ks_ke(jnp.array([0, 4]), 4, include_self=f)),
    ("even_width", lambda f: paged.build_block_tables([3, 70], 64, even_width=f)),
    ("disable_ue8m0_cast", lambda f: jax_dg.transform_sf_into_required_layout(
        jnp.ones((128, 2)), 128, 256, (1, 128), disable_ue8m0_cast=f)),
])
def test_static_flags_must_be_bools(arg, call, flag):
    with pytest.raises(jax_dg.ArgumentError, match=f"`{arg}` must be a Python bool"):
        call(flag)


@pytest.mark.parametrize("bad", [1.5, "8", None])
@pytest.mark.parametrize("arg,call", [
    ("next_n", lambda v: jax_dg.native_next_n_supported(v)),
    ("x", lambda v: jax_dg.get_tma_aligned_size(v, 4)),
    ("element_size", lambda v: jax_dg.get_tma_aligned_size(8, v)),
    ("mn", lambda v: jax_dg.transform_sf_into_required_layout(jnp.ones((128, 2)), v, 256, (1, 128))),
    ("mn", lambda v: jax_dg.mn_major_logical(jnp.ones((2, 8)), v)),
    ("num_groups", lambda v: jax_dg.get_theoretical_mk_alignment_for_contiguous_layout(8, v or 2.5)),
    ("expected_m", lambda v: jax_dg.get_theoretical_mk_alignment_for_contiguous_layout(v or 2.5)),
    ("num_queries", lambda v: jax_dg.causal_ks_ke(v, 8)),
    ("num_queries", lambda v: jax_dg.varlen_causal_ks_ke(jnp.array([0, 4]), v)),
    ("width", lambda v: paged.build_block_tables([3, 70], 64, width=v or 2.5)),
    ("num_blocks", lambda v: paged.build_block_tables([3, 70], 64, num_blocks=v or 2.5)),
    ("block_size", lambda v: paged.slot_mapping(BT, v, 8)),
    ("seq_len", lambda v: paged.slot_mapping(BT, 64, v)),
    ("num_blocks", lambda v: paged.kv_cache_from_rows(X, I4, v, 64)),
    ("block_size", lambda v: paged.kv_cache_from_sequences(jnp.ones((2, 8, 128)), BT, v, 4)),
])
def test_static_ints_are_never_truncated(arg, call, bad):
    with pytest.raises(jax_dg.ArgumentError, match=f"`{arg}` must be a static Python int"):
        call(bad)


@pytest.mark.parametrize("recipe", [(1, 128.5), 5, "x", (1, 0), (1, 128, 128, 1)])
def test_transform_sf_recipe_must_be_ints(recipe):
    with pytest.raises(jax_dg.ArgumentError, match="`recipe` must be a tuple of two or three"):
        jax_dg.transform_sf_into_required_layout(jnp.ones((128, 2)), 128, 256, recipe)


@pytest.mark.parametrize("v", [None, "1.0", True])
def test_gate_routed_scaling_factor_must_be_a_number(v):
    with pytest.raises(jax_dg.ArgumentError, match="`routed_scaling_factor` must be a static Python number"):
        jax_dg.bf16_mega_gate(jnp.ones((4, 256), BF16), jnp.ones((8, 256), BF16), 2,
                              scoring_func="sigmoid", routed_scaling_factor=v, ep_rank=0)


@pytest.mark.parametrize("dtype", [F32, bool])
@pytest.mark.parametrize("arg,call", [
    ("cu_seqlens_q", lambda d: jax_dg.varlen_causal_ks_ke(jnp.array([0, 3, 8]).astype(d), 8)),
    ("cu_seqlens_k", lambda d: jax_dg.varlen_causal_ks_ke(jnp.array([0, 8]), 8, jnp.array([0, 8]).astype(d))),
    ("context_lens", lambda d: paged.build_block_tables(np.array([3, 70]).astype(d), 64)),
    ("block_tables", lambda d: paged.slot_mapping(BT.astype(d), 64, 8)),
    ("block_tables", lambda d: paged.dequantize_kv_cache(jnp.zeros((2, 64, 1, 132), jnp.uint8), BT.astype(d))),
    ("slots", lambda d: paged.kv_cache_from_rows(X, I4.astype(d), 2, 64)),
])
def test_integer_arrays_are_checked_before_conversion(arg, call, dtype):
    with pytest.raises(jax_dg.ArgumentError, match=f"`{arg}` must have an integer dtype|`{arg}` must hold integer"):
        call(dtype)


@pytest.mark.parametrize("fn", ["mqa_logits", "fp8_fp4_mqa_logits", "indexer_topk"])
@pytest.mark.parametrize("width", [2**31, 2**40])
def test_a_static_beyond_32_bits_is_named(fn, width):
    # the kernels take 32-bit ints: a wider static was an unnamed OverflowError (issue 27's fuzz)
    q = jnp.ones((4, 32, 64), FP8)
    kv = (jnp.ones((16, 64), FP8), jnp.ones((16,), F32))
    w, ks = jnp.ones((4, 32), F32), jnp.zeros((4,), jnp.int32)
    call = {"mqa_logits": lambda: jax_dg.mqa_logits(q, kv, w, ks, ks + 4, max_seqlen_k=width),
            "fp8_fp4_mqa_logits": lambda: jax_dg.fp8_fp4_mqa_logits(q, kv, w, ks, ks + 4, width),
            "indexer_topk": lambda: jax_dg.indexer_topk(q, kv, w, ks, ks + 4, 2, max_seqlen_k=width)}[fn]
    with pytest.raises(jax_dg.ArgumentError, match="`max_seqlen_k` must fit 32 bits"):
        call()


def test_the_paged_schedule_references_agree_at_int32_max_lengths():
    # issue 27's fuzz: lengths near 2**31 overflowed the pure-JAX schedule's int32 sums while
    # the torch emulation's int64 ones did not; both now count lengths up to MAX_CONTEXT_LEN
    from jax_dg import contracts
    lens = jnp.full((266, 1), 2**31 - 1, jnp.int32).at[::7].set(5)
    f = jax.jit(lambda l: jax_dg.get_paged_mqa_logits_metadata(l, 64, 132))
    with jax_dg.use_backend("torch"):
        torch_meta = np.asarray(f(lens))
    with jax_dg.use_backend("xla"):
        xla_meta = np.asarray(f(lens))
        capped = np.asarray(f(jnp.minimum(lens, contracts.MAX_CONTEXT_LEN)))
    np.testing.assert_array_equal(torch_meta, xla_meta)
    np.testing.assert_array_equal(xla_meta, capped)
    assert (np.diff(xla_meta[:-1, 0]) >= 0).all() and xla_meta[-1, 0] == 266   # a real schedule


def test_per_token_scales_given_for_b_say_how_they_were_read():
    x = jnp.ones((64, 256), jnp.bfloat16)
    a = jax_dg.per_token_cast_to_fp8(x)
    b = jax_dg.per_token_cast_to_fp8(jnp.ones((128, 256), jnp.bfloat16))   # per-token, not per-block
    with pytest.raises(jax_dg.ArgumentError, match=r"`c` is required with recipe \(1, 1, 128\).*which "
                       r"b's scales select: b\[1\] \(128, 2\) holds one scale per row.*per_block_cast_to_fp8"):
        jax_dg.fp8_gemm_nt(a, b)
    jax_dg.fp8_gemm_nt(a, jax_dg.per_block_cast_to_fp8(jnp.ones((128, 256), jnp.bfloat16)))


@pytest.mark.parametrize("cast", ["per_block_cast_to_fp8", "per_token_cast_to_fp8"])
def test_a_cast_of_grouped_operands_points_at_vmap(cast):
    w = jnp.ones((2, 128, 256), jnp.bfloat16)
    with pytest.raises(jax_dg.ArgumentError, match=rf"jax.vmap\(jax_dg.{cast}\)\(x\)"):
        getattr(jax_dg, cast)(w)
    values, scales = jax.vmap(getattr(jax_dg, cast))(w)
    assert values.shape == w.shape and scales.shape[0] == 2
