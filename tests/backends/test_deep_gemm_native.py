"""DeepGEMM called from C++ (jax_dg.backends.deep_gemm_native): why it is off where it cannot be
built, and (GPU, DeepGEMM >= 2.8 with its sources) its handlers against deep_gemm called from
torch, bitwise, with one DeepGEMM runtime between them."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dg.backends import deep_gemm, deep_gemm_native as native
from tests.backends import standins


@pytest.fixture
def fresh(monkeypatch):
    native.library.cache_clear()
    yield monkeypatch
    native.library.cache_clear()


def test_off_without_deep_gemm(fresh):
    fresh.setattr(deep_gemm, "module", lambda: None)
    assert native.library() is None and native.why() == "deep_gemm does not import"


def test_off_where_deep_gemm_ships_no_sources(fresh, tmp_path):
    mod = standins.deep_gemm_25()
    mod.__file__ = str(tmp_path / "deep_gemm" / "__init__.py")   # a wheel without csrc/
    fresh.setattr(deep_gemm, "module", lambda: mod)
    fresh.setattr(deep_gemm, "version", lambda: "2.5.0")
    assert native.library() is None and "ships no C++ sources" in native.why()


def test_off_when_turned_off(fresh):
    fresh.setenv("JAX_DG_DEEP_GEMM_NATIVE", "0")
    assert native.library() is None and "JAX_DG_DEEP_GEMM_NATIVE=0" in native.why()


def test_an_old_gcc_is_named(fresh, tmp_path):
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\n[ \"$1\" = -dumpfullversion ] && echo 12.2.0 && exit 0\n"
                    "echo 'g++ (Debian 12.2.0) 12.2.0'; echo 'Copyright (C) 2022 Free Software Foundation'\n")
    fake.chmod(0o755)
    fresh.setenv("CXX", str(fake))
    assert native._compiler() == f"{fake} is GCC 12.2.0: GCC >= 13 is needed (C++20 <format>; set CXX)"


# --- GPU: DeepGEMM >= 2.8 with its sources and DeepJIT's headers ------------------------------------

def _library():
    lib = native.library()
    if lib is None:
        pytest.skip(f"the native path is off here: {native.why()}")
    for name in native.HANDLERS:
        for graph in (False, True):
            jax.ffi.register_ffi_target(f"jax_dg_dg_{name}" + ("_graph" if graph else ""),
                                        native.handler(name, graph), platform="CUDA")
    return lib


def _t2j(t):
    import torch
    if t.dtype == torch.float8_e4m3fn:
        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(t.view(torch.uint8)), jnp.float8_e4m3fn)
    return jax.dlpack.from_dlpack(t.contiguous())


@pytest.mark.gpu
def test_gpu_fp8_gemm_nt_bitwise_and_one_runtime():
    import deep_gemm as dg
    import torch
    from deep_gemm.utils.math import per_block_cast_to_fp8, per_token_cast_to_fp8
    lib = _library()
    assert native._shared_runtime(lib), "two DeepGEMM runtimes in one process"
    m, n, k = 128, 2112, 7168
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    (aq, asf), (bq, bsf) = per_token_cast_to_fp8(a, use_ue8m0=False), per_block_cast_to_fp8(b, use_ue8m0=False)
    want = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    dg.fp8_gemm_nt((aq, asf), (bq, bsf), want)
    asf_mn = torch.zeros(asf.shape[1], (m + 3) // 4 * 4, device="cuda")   # MN-major, as jax_dg lays it
    asf_mn[:, :m] = asf.T
    call = jax.jit(lambda *x: jax.ffi.ffi_call("jax_dg_dg_fp8_gemm_nt", jax.ShapeDtypeStruct((m, n), jnp.bfloat16))(
        *x, compiled_dims="nk"))
    calls = native.calls()
    got = torch.from_dlpack(call(_t2j(aq), _t2j(asf_mn), _t2j(bq), _t2j(bsf)))
    assert torch.equal(got, want) and native.calls() == calls + 1


@pytest.mark.gpu
def test_gpu_mqa_logits_into_xlas_buffer_bitwise():
    import deep_gemm as dg
    import torch
    _library()
    s, sk, h, d = 512, 2048, 64, 128
    q = torch.randn(s, h, d, device="cuda").to(torch.float8_e4m3fn)
    kv = torch.randn(sk, d, device="cuda")
    kvs = kv.abs().amax(1) / 448
    kvq = (kv / kvs[:, None]).to(torch.float8_e4m3fn)
    w = torch.randn(s, h, device="cuda")
    ks = torch.zeros(s, dtype=torch.int32, device="cuda")
    ke = torch.arange(s, dtype=torch.int32, device="cuda") + sk - s + 1
    want = dg.fp8_fp4_mqa_logits((q, None), (kvq, kvs), w, ks, ke, sk)
    block_q = 128 // h
    rows, stride = -(-s // block_q) * block_q, -(-sk // 256) * 256
    call = jax.jit(lambda *x: jax.ffi.ffi_call(
        "jax_dg_dg_sm90_mqa_logits", jax.ShapeDtypeStruct((rows, stride), jnp.float32))(
        *x, block_q=block_q, block_kv=256))
    got = torch.from_dlpack(call(*map(_t2j, (q, kvq, kvs, w, ks, ke))))[:s, :sk]
    valid = torch.arange(sk, device="cuda")[None] < (ke - ks)[:, None]
    assert torch.equal(got[valid], want[valid])
