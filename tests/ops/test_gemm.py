"""fp8_gemm_nt: the bridge path against the pure-JAX reference, bad inputs, and (GPU) DeepGEMM."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from tests.conftest import bits, digest, to_torch

# K not a multiple of 128 where the contract allows (K % 16 == 0): 208, 576.
CPU_SHAPES = [(1, 256, 512), (64, 320, 384), (130, 2112, 1024), (128, 576, 7168), (7, 200, 208), (3, 64, 576)]


def make_inputs(keys, m, n, k):
    x = jax.random.normal(keys(), (m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (n, k), jnp.bfloat16)
    return x, w, jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(w)


def unquantised(x, w):
    return np.asarray(x, np.float32) @ np.asarray(w, np.float32).T


def run(backend, fn, *args):
    with jax_dg.use_backend(backend):
        return jax.jit(fn)(*args)


@pytest.mark.parametrize("m,n,k", CPU_SHAPES)
def test_matches_reference_under_jit(keys, m, n, k):
    x, w, a, b = make_inputs(keys, m, n, k)
    before = digest(a, b)
    d = run("auto", jax_dg.fp8_gemm_nt, a, b)
    ref = run("xla", jax_dg.fp8_gemm_nt, a, b)
    assert d.shape == (m, n) and d.dtype == jnp.bfloat16
    assert digest(a, b) == before, "inputs were written"
    np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(ref, np.float32),
                               rtol=2 ** -7, atol=1e-2)
    assert jax_dg.calc_diff(d, ref) < 1e-6
    assert jax_dg.calc_diff(d, unquantised(x, w)) < 1e-3


def test_accumulate_into_c_with_per_channel_recipe(keys):
    m, n, k = 48, 256, 464
    x, w, a, _ = make_inputs(keys, m, n, k)
    b = jax_dg.per_token_cast_to_fp8(w)  # per-channel b scales [N, ceil(K/128)]: recipe (1, 1, 128)
    c = jax.random.normal(keys(), (m, n), jnp.float32)
    f = lambda a, b, c: jax_dg.fp8_gemm_nt(a, b, c=c)  # noqa: E731
    d = run("auto", f, a, b, c)
    assert d.dtype == jnp.float32
    assert jax_dg.calc_diff(d, unquantised(x, w) + np.asarray(c)) < 1e-3
    np.testing.assert_allclose(np.asarray(d), np.asarray(run("xla", f, a, b, c)), rtol=1e-5, atol=1e-4)
    # Donated accumulator: XLA hands c's buffer to the kernel as d.
    donated = jax.jit(f, donate_argnums=2)(a, b, c + 0)
    np.testing.assert_array_equal(np.asarray(donated), np.asarray(d))


def test_repeated_calls_are_bitwise_identical(keys):
    _, _, a, b = make_inputs(keys, 96, 384, 640)
    f = jax.jit(jax_dg.fp8_gemm_nt)
    first = bits(f(a, b))
    assert all(bits(f(a, b)) == first for _ in range(5))


def test_inside_a_larger_jitted_program(keys):
    x, w, a, b = make_inputs(keys, 32, 256, 256)

    @jax.jit
    def layer(x, b):
        a = jax_dg.per_token_cast_to_fp8(x)
        return jax.nn.gelu(jax_dg.fp8_gemm_nt(a, b).astype(jnp.float32)).sum()

    ref = jax.nn.gelu(jnp.asarray(unquantised(x, w))).sum()
    assert abs(float(layer(x, b)) - float(ref)) < 0.02 * abs(float(ref)) + 1


def test_backend_exception_becomes_jax_error_and_next_call_works(keys, monkeypatch):
    from jax_dg.backends import torch_ref
    _, _, a, b = make_inputs(keys, 8, 128, 128)
    real = torch_ref.fp8_gemm_nt
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure 1234")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_ref, "fp8_gemm_nt", flaky)
    f = jax.jit(jax_dg.fp8_gemm_nt)
    with pytest.raises(Exception, match="injected kernel failure 1234") as info:
        jax.block_until_ready(f(a, b))
    assert not isinstance(info.value, jax_dg.ArgumentError)
    np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(run("xla", jax_dg.fp8_gemm_nt, a, b)))


@pytest.mark.parametrize("case,arg", [
    ("a_dtype", "a[0]"), ("b_dtype", "b[0]"), ("sfa_shape", "a[1]"), ("sfb_shape", "b[1]"),
    ("k_mismatch", "b[0]"), ("sfa_dtype", "a[1]"), ("c_shape", "c"), ("c_needs_channel_recipe", "c"),
    ("not_a_pair", "a"), ("recipe", "recipe"), ("a_rank", "a[0]"), ("k_align", "a[0]"),
    ("out_dtype", "out_dtype"), ("channel_needs_c", "c"),
])
def test_bad_inputs_fail_at_trace_time_naming_the_argument(keys, case, arg):
    _, _, (av, sa), (bv, sb) = make_inputs(keys, 16, 256, 256)
    a, b, kw = (av, sa), (bv, sb), {}
    if case == "a_dtype":
        a = (av.astype(jnp.bfloat16), sa)
    elif case == "b_dtype":
        b = (bv.astype(jnp.float8_e5m2), sb)
    elif case == "sfa_shape":
        a = (av, sa[:, :1].repeat(3, axis=1))
    elif case == "sfb_shape":
        b = (bv, jnp.ones((1, 1), jnp.float32))
    elif case == "k_mismatch":
        b = (bv[:, :128], sb[:, :1])
    elif case == "sfa_dtype":
        a = (av, sa.astype(jnp.bfloat16))
    elif case == "c_shape":
        b = (bv, jnp.ones((256, 2), jnp.float32))
        kw = dict(c=jnp.zeros((16, 248), jnp.float32))
    elif case == "c_needs_channel_recipe":
        kw = dict(c=jnp.zeros((16, 256), jnp.float32))
    elif case == "k_align":
        a, b = (av[:, :200], sa), (bv[:, :200], sb)
    elif case == "out_dtype":
        kw = dict(out_dtype=jnp.float16)
    elif case == "channel_needs_c":
        b = (bv, jnp.ones((256, 2), jnp.float32))
    elif case == "not_a_pair":
        a = av
    elif case == "recipe":
        kw = dict(recipe=(1, 64, 64))
    elif case == "a_rank":
        a = (av[None], sa)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"fp8_gemm_nt: `{arg}`")):
        jax.jit(lambda a, b: jax_dg.fp8_gemm_nt(a, b, **kw)).trace(a, b)


# --- GPU: DeepGEMM's own shapes and thresholds (deep_gemm_facts.md) -------------------------

GPU_NK = [(2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
          (7168, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 128, 4096])
@pytest.mark.parametrize("n,k", GPU_NK)
def test_gpu_matches_deep_gemm_from_torch(keys, m, n, k):
    import deep_gemm
    import torch
    x, w, a, b = make_inputs(keys, m, n, k)
    before = digest(a, b)
    f = jax.jit(jax_dg.fp8_gemm_nt)
    d = f(a, b)
    assert jax_dg.calc_diff(d, unquantised(x, w)) < 1e-3
    # The same inputs through deep_gemm called from torch: bitwise equal.
    d_torch = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    deep_gemm.fp8_gemm_nt((to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1])), d_torch)
    torch.cuda.synchronize()
    assert bits(d) == d_torch.view(torch.int16).cpu().numpy().tobytes()
    first = bits(d)
    assert all(bits(f(a, b)) == first for _ in range(20))
    assert digest(a, b) == before, "inputs were written"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 2112, 7168), (4096, 4096, 7168)])
def test_gpu_accumulate_matches_deep_gemm_from_torch(keys, m, n, k):
    import deep_gemm
    import torch
    x, w, a, _ = make_inputs(keys, m, n, k)
    b = jax_dg.per_token_cast_to_fp8(w)
    c = jax.random.normal(keys(), (m, n), jnp.float32)
    f = jax.jit(lambda a, b, c: jax_dg.fp8_gemm_nt(a, b, c=c))
    d = f(a, b, c)
    assert jax_dg.calc_diff(d, unquantised(x, w) + np.asarray(c)) < 1e-3
    d_torch = to_torch(c).clone()
    deep_gemm.fp8_gemm_nt((to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1])), d_torch,
                          c=d_torch, recipe=(1, 1, 128))
    torch.cuda.synchronize()
    assert bits(d) == d_torch.cpu().numpy().tobytes()
    assert all(bits(f(a, b, c)) == bits(d) for _ in range(5))
