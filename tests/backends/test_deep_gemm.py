"""The DeepGEMM backend: symbol resolution across versions, errors (without a GPU: the error
paths), and the trace-time architecture gate."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest

import jax_dg
from jax_dg.backends import deep_gemm as dg_backend
from jax_dg.core import backend as selection
from jax_dg.core import device
from tests.conftest import trace_for_gpu
from jax_dg.core.device import Target


def test_deep_gemm_on_cpu_fails_at_run_time_with_the_reason(keys):
    x = jax.random.normal(keys(), (16, 128), jnp.bfloat16)
    a, b = jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(x)
    with jax_dg.use_backend("deep_gemm"):
        f = jax.jit(jax_dg.fp8_gemm_nt)
        with pytest.raises(Exception, match="needs a CUDA device"):
            jax.block_until_ready(f(a, b))


def fake_deep_gemm(**symbols):
    m = types.ModuleType("deep_gemm")
    m.__file__ = "/fake/deep_gemm/__init__.py"
    m.__version__ = "0.0-test"
    m.__dict__.update(symbols)
    return m


def test_names_resolve_newest_first_then_legacy(monkeypatch):
    new, old = object(), object()
    monkeypatch.setattr(dg_backend, "module", lambda: fake_deep_gemm(
        fp8_gemm_nt=new, fp8_m_grouped_gemm_nt_masked=old))
    assert dg_backend.lookup("fp8_gemm_nt") is new
    assert dg_backend.lookup("m_grouped_fp8_gemm_nt_masked") is old


def test_legacy_mqa_logits_is_adapted_to_the_tuple_api(monkeypatch):
    seen = {}

    def legacy(q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0):
        seen.update(q=q, clean=clean_logits, msk=max_seqlen_k)
        return "logits"

    monkeypatch.setattr(dg_backend, "module", lambda: fake_deep_gemm(fp8_mqa_logits=legacy))
    fn = dg_backend.lookup("fp8_fp4_mqa_logits")
    assert fn(("Q", None), ("K", "S"), "W", "ks", "ke", clean_logits=False, max_seqlen_k=7) == "logits"
    assert seen == {"q": "Q", "clean": False, "msk": 7}


def test_missing_kernel_error_names_it_and_how_to_install(monkeypatch):
    monkeypatch.setattr(dg_backend, "module", lambda: fake_deep_gemm())
    err = dg_backend.missing_error("fp8_gemm_nt")
    assert "fp8_gemm_nt" in str(err) and "0.0-test" in str(err) and "JAX_DG_BACKEND=torch" in str(err)
    monkeypatch.setattr(dg_backend, "module", lambda: None)
    monkeypatch.setattr(dg_backend, "import_error", lambda: "ModuleNotFoundError: no deep_gemm")
    assert "not importable" in str(dg_backend.missing_error("fp8_gemm_nt"))


def test_namespace_reports_missing_symbols(monkeypatch):
    monkeypatch.setattr(dg_backend, "module", lambda: fake_deep_gemm())
    with pytest.raises(RuntimeError, match="`fp8_gemm_nt` is unavailable"):
        dg_backend.namespace(("fp8_gemm_nt",))
    ns = dg_backend.namespace(())
    with pytest.raises(RuntimeError, match="`bf16_gemm_nt` is unavailable"):
        ns.bf16_gemm_nt


def test_the_deep_gemm_backend_imports_nothing_of_jax_dg():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(dg_backend))
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [n for n in names if n and n.startswith("jax_dg")]


@pytest.mark.parametrize("gpu", ["sm90", "sm80"])
def test_no_kernel_on_the_target_gpu_fails_while_tracing(monkeypatch, gpu):
    """An op traced for a GPU where DeepGEMM lacks its kernel raises UnsupportedArchError at trace
    time (not an XLA runtime error later); the references still trace there."""
    trace_for_gpu(monkeypatch, gpu)
    monkeypatch.setattr(device, "arch", lambda device=None: gpu)
    a = (jnp.zeros((128, 256), jnp.float8_e4m3fn), jnp.ones((1, 256), jnp.float32))  # [K, M], 1x128
    b = (jnp.zeros((128, 256), jnp.float8_e4m3fn), jnp.ones((1, 2), jnp.float32))    # [K, N], 128x128
    x = jnp.zeros((64, 128), jnp.bfloat16)
    fresh = lambda fn: jax.jit(lambda *args: fn(*args))  # noqa: E731  (jit caches traces per function)
    ops = [(jax_dg.fp8_gemm_tn, (a, b))] + ([(jax_dg.bf16_gemm_nt, (x, x))] if gpu == "sm80" else [])
    for fn, args in ops:
        with pytest.raises(jax_dg.UnsupportedArchError,
                           match=rf"`{fn.__name__}` has a DeepGEMM kernel only on .*this GPU is {gpu}"):
            fresh(fn).trace(*args)
        for backend in ("torch", "xla"):
            with jax_dg.use_backend(backend):
                fresh(fn).trace(*args)
    if gpu == "sm90":
        fresh(jax_dg.bf16_gemm_nt).trace(x, x)


def test_jit_cache_dir_is_set_when_unset(monkeypatch):
    monkeypatch.delenv("DG_JIT_CACHE_DIR", raising=False)
    dg_backend.module.cache_clear()
    try:
        dg_backend.module()
        import os
        assert os.environ["DG_JIT_CACHE_DIR"].endswith(os.path.join("jax_dg", "deep_gemm"))
    finally:
        dg_backend.module.cache_clear()
