"""jax.export: functions using jax_dg ops export with jax_dg's safety-check list, symbolic M,
and run after deserialisation in a fresh process that imports jax_dg."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_dg

FP8 = jnp.float8_e4m3fn


def specs(m):
    a = (jax.ShapeDtypeStruct((m, 256), FP8), jax.ShapeDtypeStruct((m, 2), jnp.float32))
    b = (jax.ShapeDtypeStruct((128, 256), FP8), jax.ShapeDtypeStruct((1, 2), jnp.float32))
    return a, b


def step(a, b, x, w):
    """An FP8 GEMM and a bf16 one, as a model step would call them."""
    return jax_dg.fp8_gemm_nt(a, b), jax_dg.bf16_gemm_nt(x, w)


def test_without_the_list_export_refuses_and_says_why():
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        export.export(jax.jit(jax_dg.fp8_gemm_nt))(*specs(64))


def test_the_list_names_every_target():
    from jax_dg.core import native, registry, values
    names = {c.is_custom_call() for c in jax_dg.export_safety_checks()}
    assert names == set(registry.targets()) >= set(native.TARGETS.values()) | {values.TARGET}
    assert {"jax_dg_fp8_gemm_nt", "jax_dg_fp8_gemm_nt_graph", "jax_dg_fp8_fp4_mqa_logits",
            "jax_dg_native_topk", "jax_dg_native_neg_inf_outside"} <= names


def test_symbolic_m_for_the_gemms_and_mqa_logits():
    m, = export.symbolic_shape("m")
    exp = export.export(jax.jit(jax_dg.fp8_gemm_nt), disabled_checks=jax_dg.export_safety_checks())(*specs(m))
    assert str(exp.out_avals[0].shape) == "(m, 128)"
    q = jax.ShapeDtypeStruct((m, 32, 64), FP8)
    kv = (jax.ShapeDtypeStruct((256, 64), FP8), jax.ShapeDtypeStruct((256,), jnp.float32))
    w, ks = jax.ShapeDtypeStruct((m, 32), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.int32)
    exp = export.export(jax.jit(jax_dg.mqa_logits), disabled_checks=jax_dg.export_safety_checks())(q, kv, w, ks, ks)
    assert str(exp.out_avals[0].shape) == "(m, 256)"


def test_symbolic_m_traced_for_a_gpu_copies_the_logits(monkeypatch):
    # on CUDA whether a logits allocation lands depends on its size: a symbolic M is not
    # compared with anything (the buffer is copied), where it once raised while tracing
    from jax_dg.core import native
    from jax_dg.core.site import Site
    from jax_dg.tools.warmup import ffi_eqns
    from tests.conftest import trace_for_gpu
    trace_for_gpu(monkeypatch, "sm90")
    monkeypatch.setattr(native, "cuda_built", lambda: True)
    m, = export.symbolic_shape("m")
    q = jax.ShapeDtypeStruct((m, 32, 64), FP8)
    kv = (jax.ShapeDtypeStruct((4096, 64), FP8), jax.ShapeDtypeStruct((4096,), jnp.float32))
    w, ks = jax.ShapeDtypeStruct((m, 32), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.int32)
    for f in (lambda *a: jax_dg.mqa_logits(*a), lambda *a: jax_dg.indexer_topk(*a, 64)):
        jaxpr = jax.make_jaxpr(f)(q, kv, w, ks, ks)
        (e,) = ffi_eqns(jaxpr.jaxpr)
        site = Site.decode(str(dict(e.params["attributes"])["site"]))
        assert site.static["lands"] is False and site.backend == "deep_gemm"
        # the copy allocates through torch: the plain target, never captured into a CUDA graph
        assert not site.graph and not str(e.params["target_name"]).endswith("_graph")
    q = jax.ShapeDtypeStruct((64, 32, 64), FP8)   # concrete rows land: the graph-safe target
    w, ks = jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.int32)
    (e,) = ffi_eqns(jax.make_jaxpr(lambda *a: jax_dg.mqa_logits(*a))(q, kv, w, ks, ks).jaxpr)
    assert str(e.params["target_name"]).endswith("_graph")


def test_round_trip_in_a_fresh_process(tmp_path, keys):
    m, = export.symbolic_shape("m")
    a_spec, b_spec = specs(m)
    x_spec = jax.ShapeDtypeStruct((m, 128), jnp.bfloat16)
    w_spec = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    exp = export.export(jax.jit(step), disabled_checks=jax_dg.export_safety_checks())(a_spec, b_spec, x_spec, w_spec)
    (tmp_path / "step.bin").write_bytes(exp.serialize())
    a = jax_dg.per_token_cast_to_fp8(jax.random.normal(keys(), (48, 256), jnp.bfloat16))
    b = jax_dg.per_block_cast_to_fp8(jax.random.normal(keys(), (128, 256), jnp.bfloat16))
    x = jax.random.normal(keys(), (48, 128), jnp.bfloat16)
    w = jax.random.normal(keys(), (64, 128), jnp.bfloat16)
    np.savez(tmp_path / "inputs.npz", a0=np.asarray(a[0].view(jnp.uint8)), a1=np.asarray(a[1]),
             b0=np.asarray(b[0].view(jnp.uint8)), b1=np.asarray(b[1]), x=np.asarray(x.astype(jnp.float32)),
             w=np.asarray(w.astype(jnp.float32)))
    want = [np.asarray(o, np.float32) for o in jax.jit(step)(a, b, x, w)]
    code = f"""
import numpy as np, jax, jax.numpy as jnp
import jax_dg  # registers the custom-call targets
from jax import export
f = export.deserialize(open({str(tmp_path / 'step.bin')!r}, 'rb').read())
z = np.load({str(tmp_path / 'inputs.npz')!r})
fp8 = lambda v: jnp.asarray(v).view(jnp.float8_e4m3fn)
outs = f.call((fp8(z['a0']), jnp.asarray(z['a1'])), (fp8(z['b0']), jnp.asarray(z['b1'])),
              jnp.asarray(z['x']).astype(jnp.bfloat16), jnp.asarray(z['w']).astype(jnp.bfloat16))
np.savez({str(tmp_path / 'outputs.npz')!r}, *[np.asarray(o, np.float32) for o in outs])
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(tmp_path / "outputs.npz")
    for i, w_ in enumerate(want):
        np.testing.assert_array_equal(got[f"arr_{i}"], w_)
