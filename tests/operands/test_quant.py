"""The JAX quantisers are bitwise DeepGEMM's (deep_gemm/utils/math.py, re-stated in torch here).

DeepGEMM's quantisers run on GPU tensors, where torch's `amax / 448.0` multiplies by the float
reciprocal (ATen's div_true_kernel_cuda); its CPU kernel divides, 1 ulp apart in some scales.
The re-statements write the GPU's arithmetic, so these CPU tests check what DeepGEMM gives on
the GPU (and the GPU tests compare with deep_gemm's own functions there)."""

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
    sf = xv.abs().float().amax(dim=2).view(m, pn // gran_k).clamp(1e-4) * (1.0 / 448.0)
    sf = dg_ceil_to_ue8m0(sf) if use_ue8m0 else sf
    values = (xv * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, pn)[:, :n].contiguous()
    return values, sf


def dg_per_block(x, use_ue8m0):
    m, n = x.shape
    xp = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=x.dtype)
    xp[:m, :n] = x
    xv = xp.view(xp.size(0) // 128, 128, xp.size(1) // 128, 128)
    sf = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) * (1.0 / 448.0)
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


# --- the product's quantisers (jax_dg.operands.quant) against the oracle (jax_dg.reference.quant) -------
# Two implementations (the product never imports the oracle: tests/test_layering.py), bitwise
# equal, under jit and eagerly, on the inputs where rounding and clamping decide.

from jax_dg.operands import quant as product  # noqa: E402
from jax_dg.reference import quant as oracle  # noqa: E402


def edge_input(kind: str, shape, dtype, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "zero":
        x = np.zeros(shape, np.float32)
    elif kind == "tiny":        # amax far below the 1e-4 floor, some float32 denormals
        x = x * np.float32(1e-30 if dtype == jnp.float32 else 1e-20)
    elif kind == "huge":        # near the dtype's largest finite value
        x = x * np.float32(3e37 if dtype == jnp.float32 else 1e37)
    elif kind == "mixed":       # blocks of very different magnitudes, exact powers of two, zeros
        x = x * np.float32(10.0) ** rng.integers(-12, 12, shape).astype(np.float32)
        x.flat[::7] = 2.0 ** rng.integers(-20, 20, x.size)[::7]
        x.flat[::11] = 0.0
    return jnp.asarray(x).astype(dtype)


def assert_same_cast(a, b):
    np.testing.assert_array_equal(jnp_bits(a[0]), jnp_bits(b[0]))
    assert a[0].dtype == b[0].dtype == jnp.float8_e4m3fn and a[1].dtype == b[1].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


KINDS = ["random", "zero", "tiny", "huge", "mixed"]
SHAPES = [(33, 200), (5, 16), (130, 1000), (0, 256), (3, 1)]   # K % 128 != 0 but for the empty one


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_product_quantisers_are_bitwise_the_oracles(dtype, use_ue8m0, cpu_device):
    rng = np.random.default_rng(0)
    jitted = {f: jax.jit(f, static_argnums=(1, 2)) for f in (
        jax_dg.per_token_cast_to_fp8, oracle.per_token_cast_to_fp8,
        jax_dg.per_block_cast_to_fp8, oracle.per_block_cast_to_fp8)}
    for shape in SHAPES:
        for kind in KINDS:      # one compilation per shape: the kinds reuse it
            x = edge_input(kind, shape, dtype, rng)
            for gran_k in (128, 7):
                args = (use_ue8m0, gran_k)
                want = jitted[oracle.per_token_cast_to_fp8](x, *args)
                assert_same_cast(jitted[jax_dg.per_token_cast_to_fp8](x, *args), want)
            assert_same_cast(jax_dg.per_token_cast_to_fp8(x, use_ue8m0), oracle.per_token_cast_to_fp8(x, use_ue8m0))
            assert_same_cast(jitted[jax_dg.per_block_cast_to_fp8](x, use_ue8m0, 128),
                             jitted[oracle.per_block_cast_to_fp8](x, use_ue8m0, 128))


@pytest.mark.parametrize("kind", ["zero", "tiny", "huge", "mixed"])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_edge_inputs_are_bitwise_deep_gemms(kind, use_ue8m0):
    """The product on the edge inputs against DeepGEMM's torch code (K % 128 != 0 included)."""
    rng = np.random.default_rng(7)
    for shape in [(33, 200), (130, 300)]:
        x = edge_input(kind, shape, jnp.float32, rng)
        tx = torch.from_numpy(np.array(x))
        for got, (tv, tsf) in ((jax_dg.per_token_cast_to_fp8(x, use_ue8m0), dg_per_token(tx, use_ue8m0)),
                               (jax_dg.per_block_cast_to_fp8(x, use_ue8m0), dg_per_block(tx, use_ue8m0))):
            np.testing.assert_array_equal(jnp_bits(got[0]), to_np(tv))
            np.testing.assert_array_equal(np.asarray(got[1]), to_np(tsf))


def test_ue8m0_helpers_are_bitwise_the_oracles():
    special = np.array([0.0, -0.0, 1e-45, 1e-40, 1.1754942e-38, 1.0, 1.5, 2.0, 3.0, -3.0, 448.0,
                        1e30, 3.4028235e38, np.inf, -np.inf, 2.0 ** -126, 2.0 ** 127], np.float32)
    x = np.concatenate([special, np.random.default_rng(0).standard_normal(47).astype(np.float32)
                        * 10.0 ** np.random.default_rng(1).integers(-30, 30, 47)])
    x = jnp.asarray(x)
    for f in (lambda v: v, jax.jit):
        np.testing.assert_array_equal(np.asarray(f(product.ceil_to_ue8m0)(x)),
                                      np.asarray(f(oracle.ceil_to_ue8m0)(x)))
    np.testing.assert_array_equal(np.asarray(product.ceil_to_ue8m0(x)),
                                  dg_ceil_to_ue8m0(torch.from_numpy(np.array(x))).numpy())
    sf = product.ceil_to_ue8m0(x).reshape(4, 16)
    np.testing.assert_array_equal(np.asarray(product.pack_ue8m0_to_int(sf)),
                                  np.asarray(oracle.pack_ue8m0_to_int(sf)))
    np.testing.assert_array_equal(np.asarray(jax.jit(product.pack_ue8m0_to_int)(sf)),
                                  np.asarray(jax.jit(oracle.pack_ue8m0_to_int)(sf)))


def test_product_and_oracle_are_two_implementations():
    # Only the element-wise formulas (jax_dg.numerics) are shared; the quantisers are not.
    for name in ("per_token_cast_to_fp8", "per_block_cast_to_fp8"):
        assert getattr(jax_dg, name) is not getattr(oracle, name)
    assert product.pack_ue8m0_to_int is not oracle.pack_ue8m0_to_int
    from jax_dg import numerics
    assert product.scale_for is oracle.scale_for is numerics.scale_for
    assert product.FP8 is oracle.FP8 is jnp.float8_e4m3fn and product.FP8_MAX == oracle.FP8_MAX == 448.0
