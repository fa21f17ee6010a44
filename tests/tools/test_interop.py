"""jax_dg.tools.interop: zero-copy exchange with torch (CPU here; CUDA streams in the GPU test), and
the error a torch tensor handed to an op raises."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_dg
from jax_dg.tools import interop


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_round_trips_share_memory(dtype):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype)
    x = interop.to_jax(t)
    assert x.shape == (4, 6) and jnp.dtype(x.dtype).name == str(dtype).removeprefix("torch.")
    assert x.unsafe_buffer_pointer() == t.data_ptr()                  # a view, not a copy
    back = interop.to_torch(x)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    y = jnp.arange(12, dtype=jnp.float32).reshape(3, 4).astype(jnp.dtype(x.dtype))
    ty = interop.to_torch(y)
    assert ty.data_ptr() == y.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(interop.to_jax(ty)).view(np.uint8), np.asarray(y).view(np.uint8))


def test_grad_and_strides_are_handled_and_said():
    interop._warned.clear()
    t = torch.ones(3, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="detached"):
        x = interop.to_jax(t)
    assert x.shape == (3, 4)
    s = torch.arange(12.0).reshape(3, 4).t()                         # non-contiguous
    with pytest.warns(UserWarning, match="contiguous"):
        y = interop.to_jax(s)
    np.testing.assert_array_equal(np.asarray(y), s.numpy())
    with warnings.catch_warnings():                                  # said once per kind
        warnings.simplefilter("error")
        interop.to_jax(torch.ones(2, 2, requires_grad=True))


def test_wrong_types():
    with pytest.raises(TypeError, match="torch.Tensor"):
        interop.to_jax(np.ones(3))
    with pytest.raises(TypeError, match="jax.Array"):
        interop.to_torch(torch.ones(3))


def test_torch_callable_takes_and_returns_torch_pytrees():
    a = jax_dg.per_token_cast_to_fp8(jax.random.normal(jax.random.PRNGKey(0), (64, 256), jnp.bfloat16))
    b = jax_dg.per_block_cast_to_fp8(jax.random.normal(jax.random.PRNGKey(1), (128, 256), jnp.bfloat16))
    want = np.asarray(jax_dg.fp8_gemm_nt(a, b), np.float32)
    f = interop.torch_callable(jax.jit(lambda a, b, scale=1.0: {"d": jax_dg.fp8_gemm_nt(a, b), "n": 3}))
    ta = tuple(interop.to_torch(x) for x in a)
    tb = tuple(interop.to_torch(x) for x in b)
    out = f(ta, tb, scale=2.0)
    assert isinstance(out["d"], torch.Tensor) and out["n"] == 3
    np.testing.assert_array_equal(out["d"].float().numpy(), want)


def test_a_torch_tensor_given_to_an_op_names_interop():
    a = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    sf = torch.ones(64, 2)
    b = jax_dg.per_block_cast_to_fp8(jnp.ones((128, 256), jnp.bfloat16))
    with pytest.raises(jax_dg.ArgumentError, match=r"`a\[0\]`.*torch tensor.*jax_dg.tools.interop"):
        jax_dg.fp8_gemm_nt((a, sf), b)
    with pytest.raises(jax_dg.ArgumentError, match="jax_dg.tools.interop"):
        jax_dg.topk_indices(torch.zeros(4, 8), 2)
    with pytest.raises(jax_dg.ArgumentError, match="jax_dg.tools.interop"):
        jax_dg.bf16_gemm_nt(torch.zeros(64, 128, dtype=torch.bfloat16), jnp.zeros((64, 128), jnp.bfloat16))


@pytest.mark.gpu
def test_gpu_exchange_orders_streams_without_a_device_sync():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.randn(4096, 4096, device="cuda")
        t = t @ t                                    # queued on a non-default stream
        x = interop.to_jax(t)                        # the consumer waits for it, the host does not
    got = np.asarray(jnp.sum(x))
    torch.cuda.synchronize()
    assert np.allclose(got, t.sum().item(), rtol=1e-3)
    y = jnp.ones((2048, 2048)) * 3
    with torch.cuda.stream(side):
        ty = interop.to_torch(y)
        assert float((ty * 2).sum()) == 2048 * 2048 * 6
