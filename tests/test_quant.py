"""The JAX quantisers are bitwise DeepGEMM's (deep_gemm/utils/math.py, re-stated in torch here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_dg


def dg_ceil_to_ue8m0(x):
    bits = x.abs().float().view(torch.int)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    return (exp.clamp(1, 254) << 23).view(torch.float)


def dg_per_token(x, use_ue8m0, gran_k=128):
    m, n = x.shape
    pn = -(-n // gran_k) * gran_k
    xp = torch.zeros((m, pn), dtype=x.dtype)
    xp[:, :n] = x
    xv = xp.view(m, pn // gran_k, gran_k)   # explicit sizes (DeepGEMM's -1 fails for m = 0)
    sf = xv.abs().float().amax(dim=2).view(m, pn // gran_k).clamp(1e-4) / 448.0
    sf = dg_ceil_to_ue8m0(sf) if use_ue8m0 else sf
    values = (xv * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, pn)[:, :n].contiguous()
    return values, sf


def dg_per_block(x, use_ue8m0):
    m, n = x.shape
    xp = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=x.dtype)
    xp[:m, :n] = x
    xv = xp.view(xp.size(0) // 128, 128, xp.size(1) // 128, 128)
    sf = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
    sf = dg_ceil_to_ue8m0(sf) if use_ue8m0 else sf
    values = (xv * (1.0 / sf)).to(torch.float8_e4m3fn)
    return values.view_as(xp)[:m, :n].contiguous(), sf.view(xv.size(0), xv.size(2))


def to_np(t):
    return t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else t.numpy()


def jnp_bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("shape,dtype", [((64, 512), jnp.bfloat16), ((33, 200), jnp.float32),
                                         ((1, 7168), jnp.bfloat16), ((0, 256), jnp.bfloat16)])
def test_per_token_cast_is_bitwise_deep_gemms(keys, shape, dtype, use_ue8m0):
    x = jax.random.normal(keys(), shape, jnp.float32).astype(dtype) * 3
    values, sf = jax.jit(lambda x: jax_dg.per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0))(x)
    tv, tsf = dg_per_token(torch.from_numpy(np.array(x.astype(jnp.float32))).to(
        torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32), use_ue8m0)
    np.testing.assert_array_equal(jnp_bits(values), to_np(tv))
    np.testing.assert_array_equal(np.asarray(sf), to_np(tsf))


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(256, 512), (130, 200), (0, 256)])
def test_per_block_cast_is_bitwise_deep_gemms(keys, shape, use_ue8m0):
    x = jax.random.normal(keys(), shape, jnp.bfloat16)
    values, sf = jax.jit(lambda x: jax_dg.per_block_cast_to_fp8(x, use_ue8m0=use_ue8m0))(x)
    tv, tsf = dg_per_block(torch.from_numpy(np.array(x.astype(jnp.float32))).bfloat16(), use_ue8m0)
    np.testing.assert_array_equal(jnp_bits(values), to_np(tv))
    np.testing.assert_array_equal(np.asarray(sf), to_np(tsf))


def test_ceil_to_ue8m0_and_pack(keys):
    x = jnp.abs(jax.random.normal(keys(), (8, 16))) + 1e-3
    np.testing.assert_array_equal(np.asarray(jax_dg.ceil_to_ue8m0(x)),
                                  dg_ceil_to_ue8m0(torch.from_numpy(np.array(x))).numpy())
    p = jax_dg.pack_ue8m0_to_int(jax_dg.ceil_to_ue8m0(x))
    ref = (dg_ceil_to_ue8m0(torch.from_numpy(np.array(x))).view(torch.int) >> 23).to(torch.uint8).view(torch.int)
    np.testing.assert_array_equal(np.asarray(p), ref.numpy())


def test_calc_diff():
    x = np.random.default_rng(0).normal(size=(100,))
    assert jax_dg.calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert jax_dg.calc_diff(x, -x) == pytest.approx(2.0)
    assert jax_dg.calc_diff(np.zeros(3), np.zeros(3)) == 0.0
    assert float(jax.jit(jax_dg.calc_diff)(x, x * 1.01)) == pytest.approx(jax_dg.calc_diff(x, x * 1.01), rel=1e-3)
