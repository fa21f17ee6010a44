"""The generic FFI bridge: buffers reach torch as exact zero-copy views; errors come back."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_dg
from jax_dg.core import registry
from jax_dg.runtime import bridge
from jax_dg.core.op import REQUIRED, Op

SEEN: list[tuple] = []


def _echo_rule(*xs):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]


def _echo_run(dg, *bufs, scale):
    n = len(bufs) // 2
    for x, out in zip(bufs[:n], bufs[n:]):
        SEEN.append((x.dtype, tuple(x.shape), x.device.type, x.is_contiguous(), x.data_ptr(),
                     out.data_ptr()))
        if x.dtype.is_floating_point and x.element_size() > 1:
            out.copy_(x * scale)
        else:
            out.copy_(x)


def _echo_reference(*xs, scale):
    return tuple(x * scale if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > 1 else x
                 for x in xs)


ECHO = {n: Op(name=f"_test_echo{n}", args=tuple(f"x{i}" for i in range(n)), statics={"scale": REQUIRED},
              shapes=_echo_rule,
              run=_echo_run, reference=_echo_reference) for n in (1, 3)}
registry.register(*ECHO.values())

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2,
          jnp.int32, jnp.int64, jnp.uint8, jnp.int8, jnp.bool_]
TORCH = {jnp.bfloat16: torch.bfloat16, jnp.float16: torch.float16, jnp.float32: torch.float32,
         jnp.float8_e4m3fn: torch.float8_e4m3fn, jnp.float8_e5m2: torch.float8_e5m2,
         jnp.int32: torch.int32, jnp.int64: torch.int64, jnp.uint8: torch.uint8,
         jnp.int8: torch.int8, jnp.bool_: torch.bool}


def random_array(key, shape, dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)
    if dtype == jnp.bool_:
        return jax.random.bernoulli(key, 0.5, shape)
    info = jnp.iinfo(dtype)
    return jax.random.randint(key, shape, max(info.min, -1000), min(info.max, 1000), jnp.int32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (4, 0), ()])
def test_buffers_arrive_as_exact_torch_views(keys, dtype, shape):
    if jnp.dtype(dtype) == jnp.int64 and not jax.config.jax_enable_x64:
        pytest.skip("int64 arrays need jax_enable_x64 (see test_int64_with_x64)")
    x = random_array(keys(), shape, dtype)
    SEEN.clear()
    (y,) = jax.jit(lambda x: ECHO[1](x, scale=2.0))(x)
    (ref,) = _echo_reference(x, scale=2.0)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    if x.size == 0:  # XLA elides custom calls whose results are empty
        return
    (t_dtype, t_shape, device, contiguous, _, _), = SEEN
    on = "cpu" if x.devices().pop().platform == "cpu" else "cuda"   # the whole suite runs on a GPU too
    assert (t_dtype, t_shape, device, contiguous) == (TORCH[dtype], shape, on, True)


def test_int64_with_x64(keys):
    code = ("import jax; jax.config.update('jax_enable_x64', True); import jax.numpy as jnp, numpy as np;"
            "from tests.core.test_bridge import ECHO, SEEN;"
            "x = jnp.arange(12, dtype=jnp.int64).reshape(3, 4) * (2**40);"
            "(y,) = jax.jit(lambda x: ECHO[1](x, scale=1.0))(x);"
            "assert y.dtype == jnp.int64 and (np.asarray(y) == np.asarray(x)).all();"
            "assert str(SEEN[0][0]) == 'torch.int64', SEEN; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_several_arguments_and_results_in_order(keys):
    xs = (random_array(keys(), (2, 3), jnp.float32), random_array(keys(), (5,), jnp.int32),
          random_array(keys(), (4, 4), jnp.bfloat16))
    ys = jax.jit(lambda *xs: ECHO[3](*xs, scale=-1.0))(*xs)
    for y, r in zip(ys, _echo_reference(*xs, scale=-1.0)):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(r))


def test_views_are_zero_copy_and_cached(keys):
    x = random_array(keys(), (64, 64), jnp.float32)
    f = jax.jit(lambda x: ECHO[1](x, scale=3.0))
    SEEN.clear()
    for _ in range(3):
        jax.block_until_ready(f(x))
    ptrs = {s[4] for s in SEEN}
    # The argument is the committed buffer of x itself, not a copy.
    assert ptrs == {x.unsafe_buffer_pointer()}
    sites, views = bridge.cache_sizes()
    assert sites >= 1 and 1 <= views <= 4096


def test_exception_in_backend_is_a_jax_error_and_the_process_lives(keys, monkeypatch):
    x = random_array(keys(), (8,), jnp.float32)
    op = ECHO[1]
    calls = {"n": 0}
    real = op.run

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("boom from the backend 4321")
        return real(*args, **kwargs)

    object.__setattr__(op, "run", failing_once)
    bridge.clear_caches()
    try:
        f = jax.jit(lambda x: op(x, scale=5.0))
        with pytest.raises(Exception, match="boom from the backend 4321"):
            jax.block_until_ready(f(x))
        np.testing.assert_array_equal(np.asarray(f(x)[0]), np.asarray(x) * 5)
    finally:
        object.__setattr__(op, "run", real)
        bridge.clear_caches()


def test_jax_is_imported_before_the_extension():
    # Loading the nanobind extension before jax crashed jax's own import on the GPU image.
    code = ("import sys, jax_dg; order = list(sys.modules);"
            "print(order.index('jax') < order.index('jax_dg.core._bridge'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_the_run_time_half_and_torch_load_at_the_first_deep_gemm_call():
    # import jax_dg, tracing, the xla backend and jax_dg's own (C++) kernels import no torch;
    # the bridge's handler imports the run-time half (and torch) when it first runs
    code = """
import sys, jax, jax.numpy as jnp
import jax_dg
q = jnp.zeros((64, 32, 64), jnp.float8_e4m3fn)
kv = (jnp.zeros((256, 64), jnp.float8_e4m3fn), jnp.ones((256,), jnp.float32))
ks, ke = jax_dg.causal_ks_ke(64, 256)
args = (q, kv, jnp.ones((64, 32)), ks, ke)
jax.jit(jax_dg.mqa_logits).lower(*args)                      # traced for the torch emulation
with jax_dg.use_backend("xla"):
    want = jax.jit(jax_dg.mqa_logits)(*args)
jax_dg.topk_indices(jnp.ones((4, 16)), 2).block_until_ready()
before = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("jax_dg.runtime"))
got = jax.jit(jax_dg.mqa_logits)(*args)
assert (got == want).all()
print(before, "torch" in sys.modules, "jax_dg.runtime.bridge" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["[]", "True", "True"], out.stderr[-3000:]


def test_xla_backend_traces_the_reference_without_custom_call(keys):
    x = random_array(keys(), (4,), jnp.float32)
    with jax_dg.use_backend("xla"):
        hlo = jax.jit(lambda x: ECHO[1](x, scale=2.0)).lower(x).as_text()
    assert "custom_call" not in hlo
    hlo = jax.jit(lambda x: ECHO[1](x, scale=2.0)).lower(x).as_text()
    assert "jax_dg__test_echo1" in hlo


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="choose one of"):
        with jax_dg.use_backend("cuda-magic"):
            pass


def test_one_jitted_function_follows_the_backend_block(keys):
    # use_backend is part of jit's cache key: the same jitted function is traced again.
    x = random_array(keys(), (4,), jnp.float32)
    f = jax.jit(lambda x: ECHO[1](x, scale=2.0))
    assert "jax_dg__test_echo1" in f.lower(x).as_text()
    with jax_dg.use_backend("xla"):
        assert "custom_call" not in f.lower(x).as_text()
    assert "jax_dg__test_echo1" in f.lower(x).as_text()
