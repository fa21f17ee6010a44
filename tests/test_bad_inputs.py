"""Defects a fuzz of invalid calls found (issue 13's list): each raises ArgumentError naming the
argument, before anything reads the bad value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_dg
from jax_dg import paged

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
    with pytest.raises(jax_dg.ArgumentError, match="`recipe` must be a tuple of three ints"):
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
