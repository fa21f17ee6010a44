"""Out of GPU memory inside a call: DeepGEMM allocates through torch's caching allocator beside
XLA's preallocated pool. The user gets a JAX error that names the op and says how to leave torch
room, and the process carries on: the next call, with memory back, works."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from tests.conftest import bits

ADVICE = r"jax_dg\.{op}: out of GPU memory inside the call.*XLA_PYTHON_CLIENT_MEM_FRACTION"


def mqa_inputs(keys, s=128, sk=512, h=32, d=64):
    # Logits of 256 KiB: below the landing threshold, so DeepGEMM allocates them through torch.
    q = jax.random.normal(keys(), (s, h, d), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(keys(), (sk, d), jnp.bfloat16))
    w = jax.random.normal(keys(), (s, h), jnp.float32)
    ks, ke = jax_dg.causal_ks_ke(s, sk)
    return (q, None), kv, w, ks, ke


def fails_once_then_runs(keys, monkeypatch, error: Exception, match: str) -> None:
    """fp8_gemm_nt through the bridge (torch emulation) whose kernel raises `error` once: the
    call fails with a JAX error matching `match`, and the next call runs."""
    from jax_dg.backends import torch_emu
    x = jax.random.normal(keys(), (8, 128), jnp.bfloat16)
    a, b = jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(x)
    real, calls = torch_emu.fp8_gemm_nt, []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_emu, "fp8_gemm_nt", once)
    with jax_dg.use_backend("torch"):
        f = jax.jit(jax_dg.fp8_gemm_nt)
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(f(a, b))
        assert np.isfinite(np.asarray(f(a, b), np.float32)).all()   # the process carries on


def test_torch_out_of_memory_becomes_a_jax_error_naming_the_op(keys, monkeypatch):
    import torch
    fails_once_then_runs(keys, monkeypatch, torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 MiB"), ADVICE.format(op="fp8_gemm_nt"))


def fill_torch_memory() -> list:
    """Takes every byte torch's allocator can still get (largest chunks first)."""
    import torch
    torch.cuda.empty_cache()
    hog, size = [], 1 << 34
    while size >= 512:
        try:
            hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            size //= 2
    return hog


@pytest.mark.gpu
def test_gpu_deep_gemm_out_of_memory_names_the_op_and_the_next_call_works(keys):
    import torch
    args = mqa_inputs(keys)
    f = jax.jit(jax_dg.mqa_logits)
    want = bits(jax.block_until_ready(f(*args)))   # DeepGEMM's kernel compiled and loaded first
    hog = fill_torch_memory()
    try:
        with pytest.raises(Exception, match=ADVICE.format(op="(fp8_fp4_)?mqa_logits")):
            jax.block_until_ready(f(*args))
    finally:
        del hog
        torch.cuda.empty_cache()
    assert bits(jax.block_until_ready(f(*args))) == want


def test_an_exception_whose_message_cannot_be_read_still_fails_the_call_cleanly(keys, monkeypatch):
    class Unprintable(Exception):
        def __str__(self):
            raise ValueError("no message")
    fails_once_then_runs(keys, monkeypatch, Unprintable(), "fp8_gemm_nt|message")
