"""The thin call: each op call is checked, shaped and planned once while tracing, and carried to
the bridge as one versioned call-site record; one resolver says what runs."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.core import dispatch, device, registry
from jax_dg.core import op as ops
from jax_dg.core.site import Site, SiteError
from jax_dg.ops import mqa, topk
from jax_dg.tools.warmup import ffi_eqns

FP8 = jnp.float8_e4m3fn


@contextlib.contextmanager
def counting(op, *fields):
    """Counts calls of the record's `fields` (the shape rule, ...) while the block runs."""
    counts, saved = {f: 0 for f in fields}, {f: getattr(op, f) for f in fields}

    def wrap(field, fn):
        @functools.wraps(fn)   # the statics it names are fn's
        def counted(*args, **kwargs):
            counts[field] += 1
            return fn(*args, **kwargs)
        return counted
    try:
        for f in fields:
            object.__setattr__(op, f, wrap(f, saved[f]))
        yield counts
    finally:
        for f in fields:
            object.__setattr__(op, f, saved[f])


def mqa_inputs(m=64, n=256, h=32, d=64):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(k[0], (m, h, d)).astype(FP8)
    kv = (jax.random.normal(k[1], (n, d)).astype(FP8), jax.random.uniform(k[2], (n,), jnp.float32, 0.5, 1))
    w = jax.random.normal(k[3], (m, h), jnp.float32)
    ks = jnp.zeros((m,), jnp.int32)
    ke = jnp.arange(m, dtype=jnp.int32) + n - m + 1
    return q, kv, w, ks, ke


@contextlib.contextmanager
def counting_targets(monkeypatch):
    """Counts the trace targets computed (jax_dg.core.device.target) while the block runs."""
    n, real = [0], device.target

    def target():
        n[0] += 1
        return real()
    monkeypatch.setattr(device, "target", target)
    yield n


@pytest.mark.parametrize("clean", [True, False])
def test_mqa_logits_is_shaped_and_planned_once_per_traced_call_for_one_target(clean, monkeypatch):
    args = mqa_inputs()
    with counting(mqa.FP8_MQA_LOGITS, "shapes") as n, counting_targets(monkeypatch) as targets:
        jax.jit(lambda *a: jax_dg.mqa_logits(*a, clean_logits=clean)).trace(*args)
    assert n == {"shapes": 1} and targets == [1]


def test_the_compressed_form_and_the_indexer_are_shaped_once(monkeypatch):
    args = mqa_inputs()
    with counting(mqa.FP8_MQA_LOGITS, "shapes") as n, counting_targets(monkeypatch) as targets:
        jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=64)).trace(*args)
    assert n == {"shapes": 1} and targets == [1]
    with counting(topk.INDEXER_TOPK, "shapes") as n, \
            counting(mqa.FP8_MQA_LOGITS, "shapes") as inner, counting_targets(monkeypatch) as targets:
        jax.jit(lambda *a: jax_dg.indexer_topk(*a, 16)).trace(*args)
    assert n == {"shapes": 1} and targets == [1]
    assert inner == {"shapes": 1}   # the composed op reuses the logits record once


def test_the_paged_call_decides_for_one_target(monkeypatch):
    from tests.ops.test_paged_mqa import make_case
    q, cache, w, lens, table = make_case([300, 40], 1, 32, 64, 64, two_d=False)
    with counting_targets(monkeypatch) as targets:
        jax.jit(lambda *a: jax_dg.paged_mqa_logits(*a)).trace(q, cache, w, lens, table)
    assert targets == [1]   # the public function's checks, the sanitising and the logits call


def test_a_native_op_is_shaped_once_and_has_no_run_function():
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 100))
    with counting(topk.TOPK, "shapes") as n:
        jax.jit(lambda x: jax_dg.topk_indices(x, 5)).trace(x)
    assert n == {"shapes": 1}
    assert topk.TOPK.run is None


def test_a_gemm_is_shaped_once_and_plans_its_scale_layouts():
    k = jax.random.split(jax.random.PRNGKey(2), 2)
    a = jax_dg.per_token_cast_to_fp8(jax.random.normal(k[0], (64, 256)).astype(jnp.bfloat16))
    b = jax_dg.per_block_cast_to_fp8(jax.random.normal(k[1], (128, 256)).astype(jnp.bfloat16))
    gemm = jax_dg.ops.gemm.FP8_GEMM["nt"]
    with counting(gemm, "shapes") as n:
        jaxpr = jax.make_jaxpr(lambda a, b: jax_dg.fp8_gemm_nt(a, b))(a, b)
    assert n == {"shapes": 1}
    (eqn,) = ffi_eqns(jaxpr.jaxpr)
    site = Site.decode(str(dict(eqn.params["attributes"])["site"]))
    # the run function's statics and the rule's plan, nothing it does not name (out_dtype)
    assert site.static == {"recipe": (1, 128, 128), "compiled_dims": None, "mn_major": (True, False)}


# --- the call-site record ----------------------------------------------------------------------

def test_a_site_round_trips():
    site = Site("fp8_fp4_mqa_logits", "torch", (True, False, True), True,
                {"max_seqlen_k": 0, "head_splits": (128, 64, 128), "clean_logits": False,
                 "lands": True, "logits_dtype": "bfloat16", "nested": {"a": [1, 2]}})
    text = site.encode()
    back = Site.decode(text)
    assert back == Site(site.op, site.backend, site.present, site.graph,
                        {**site.static, "nested": {"a": (1, 2)}})
    assert isinstance(back.static["head_splits"], tuple)   # tuples come back as tuples
    assert back.encode() == text                           # one site, one string
    # deterministic: the same record in another key order is the same string
    assert Site(site.op, site.backend, site.present, site.graph,
                dict(reversed(list(site.static.items())))).encode() == text


def test_a_record_of_another_version_or_no_record_is_refused():
    text = Site("x", "torch", (), False, {}).encode().replace('"v":1', '"v":0')
    with pytest.raises(SiteError, match="version 0"):
        Site.decode(text)
    with pytest.raises(SiteError, match="not a call-site record"):
        Site.decode('["x", "torch", "1", {}, false]')   # the list form of earlier versions
    with pytest.raises(SiteError, match="not a call-site record"):
        Site.decode("{not json")


def test_the_traced_call_carries_its_plan_in_the_record():
    args = mqa_inputs()
    jaxpr = jax.make_jaxpr(lambda *a: jax_dg.mqa_logits(*a))(*args)
    sites = [Site.decode(str(dict(e.params["attributes"])["site"])) for e in ffi_eqns(jaxpr.jaxpr)
             if "site" in dict(e.params["attributes"])]
    assert len(sites) == 1
    (site,) = sites
    assert site.op == "fp8_fp4_mqa_logits" and site.backend == "torch"   # concrete, not "auto"
    assert site.present == (True,) * 6 and site.static["lands"] is True
    # the own -inf kernel follows as a native call in XLA, not inside the bridge call
    targets = [str(e.params["target_name"]) for e in ffi_eqns(jaxpr.jaxpr, own=True)]
    assert targets == ["jax_dg_fp8_fp4_mqa_logits", "jax_dg_native_neg_inf_outside"]


# --- one resolver ------------------------------------------------------------------------------

def test_one_resolver_for_the_call_info_and_warm_up():
    from jax_dg import __main__ as cli
    t = device.target()
    for op in registry.ops().values():
        if op.name.startswith("_"):
            continue
        how = dispatch.resolve(op, (), t)
        mode, why = cli.op_status(op, "cpu", None, "auto")
        assert how.why in why, (op.name, how.why, why)
        assert (mode == "raises") == (how.runs == "raises")


def test_the_resolver_names_what_runs():
    t = device.target()
    assert dispatch.resolve(topk.TOPK, (), t).runs == "native"
    assert dispatch.resolve(mqa.FP8_MQA_LOGITS, (), t).runs == "torch"
    how = dispatch.resolve(mqa.FP8_MQA_LOGITS, (), t)
    assert "neg_inf_outside" in how.why   # the own kernel that follows is named
    with jax_dg.use_backend("xla"):
        assert dispatch.resolve(topk.TOPK, (), t).runs == "xla"
    gpu = device.Target("deep_gemm", "cuda", "sm80", 108)
    how = dispatch.resolve(mqa.FP8_MQA_LOGITS, (), gpu, requested="auto")
    assert how.runs == "raises" and isinstance(how.error, jax_dg.UnsupportedArchError)
    cpu = device.Target("deep_gemm", "cpu", "sm90", 132)
    how = dispatch.resolve(mqa.FP8_MQA_LOGITS, (), cpu, requested="deep_gemm")
    with pytest.raises(jax_dg.UnsupportedBackendError, match="needs a CUDA device"):
        how.check()


def test_every_target_is_exportable():
    names = set(registry.targets())
    assert {"jax_dg_fp8_gemm_nt", "jax_dg_fp8_gemm_nt_graph", "jax_dg_native_topk",
            "jax_dg_native_neg_inf_outside"} <= names
    from jax_dg.core import values
    checks = {c.is_custom_call() for c in jax_dg.export_safety_checks()}
    assert checks == names and values.TARGET in names   # the checked mode's check too
    np.testing.assert_equal(sorted(names), registry.targets())


# --- the statics: one declared record ------------------------------------------------------------

def _scaled_shapes(x):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype)]


def _scaled_run(dg, x, out, *, scale):        # names only what it uses
    out.copy_(x * scale)


SCALED = ops.Op(name="_test_scaled", args=("x",), statics={"scale": ops.REQUIRED, "offset": 0.0},
                shapes=_scaled_shapes, run=_scaled_run, reference=lambda x, *, scale: (x * scale,),
                finish=lambda outs, inputs, *, offset: (outs[0] + offset,))
registry.register(SCALED)


def test_a_static_is_declared_once_and_reaches_only_the_functions_that_name_it():
    # `offset` is declared by the record and read by `finish` alone: the shape rule, the run
    # function and the reference never list it
    assert SCALED.statics == {"scale": ops.REQUIRED, "offset": 0.0}
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(jax.jit(lambda x: SCALED(x, scale=2.0, offset=1.0)[0])(x),
                                  2 * np.arange(4.0) + 1)
    np.testing.assert_array_equal(jax.jit(lambda x: SCALED(x, scale=3.0)[0])(x), 3 * np.arange(4.0))
    with pytest.raises(TypeError, match=r"_test_scaled: unknown static\(s\) shift .*declared: scale, offset"):
        SCALED(x, scale=1.0, shift=2)
    with pytest.raises(TypeError, match=r"missing static\(s\) scale"):
        SCALED(x)
    # the record carries the declared defaults: one call site whether or not they were passed
    sites = {Site.decode(str(dict(e.params["attributes"])["site"])).encode()
             for f in (lambda x: SCALED(x, scale=2.0), lambda x: SCALED(x, scale=2.0, offset=0.0))
             for e in ffi_eqns(jax.make_jaxpr(f)(x).jaxpr)}
    assert len(sites) == 1


def test_without_jax_dgs_cuda_kernels_a_gpu_call_says_why_after_the_other_reasons(monkeypatch):
    from jax_dg.backends import deep_gemm
    from jax_dg.core import native
    monkeypatch.setattr(native, "cuda_built", lambda: False)      # installed without nvcc
    monkeypatch.setattr(deep_gemm, "module", lambda: object())
    monkeypatch.setattr(deep_gemm, "lookup", lambda name: (lambda: None))
    sm90 = device.Target("deep_gemm", "cuda", "sm90", 132)
    for op in (mqa.FP8_MQA_LOGITS, topk.TOPK):
        how = dispatch.resolve(op, (), sm90, requested="auto")
        assert how.runs == "raises" and "were not built" in str(how.error)
    how = dispatch.resolve(mqa.FP8_MQA_LOGITS, (), device.Target("deep_gemm", "cuda", "sm80", 108), "auto")
    assert isinstance(how.error, jax_dg.UnsupportedArchError)   # the reason that holds built too
    assert dispatch.resolve(mqa.FP8_MQA_LOGITS, (), sm90, requested="xla").runs == "xla"


# --- one registry ----------------------------------------------------------------------------------

def test_declaring_an_op_registers_nothing_and_an_unregistered_call_says_so():
    op = ops.Op(name="_test_unregistered", args=("x",), statics={"scale": ops.REQUIRED},
                shapes=_scaled_shapes, run=_scaled_run, reference=lambda x, *, scale: (x * scale,))
    assert "_test_unregistered" not in registry.ops()
    assert "jax_dg__test_unregistered" not in registry.targets()
    with pytest.raises(RuntimeError, match="`_test_unregistered` is not registered"):
        jax.jit(lambda x: op(x, scale=2.0)).lower(jnp.arange(4.0))
    registry.register(op)
    assert registry.op("_test_unregistered") is op and "jax_dg__test_unregistered" in registry.targets()
    registry.register(op)   # again: nothing changes
    with pytest.raises(ValueError, match="two ops are named"):
        registry.register(ops.Op(name="_test_unregistered", args=("x",), statics={},
                                 shapes=_scaled_shapes, run=_scaled_run, reference=lambda x: (x,)))


def test_what_the_registry_derives():
    # every op a public function exposes is registered, and every registered public function
    # is one of jax_dg's names
    # (jax_dg.interop, torch's, is loaded on first use)
    assert set(registry.public()) == (set(jax_dg.__all__) - {"interop"}) | {
        f"paged.{n}" for n in jax_dg.paged.__all__}
    exposed = {op.name for fn in registry.functions().values() for op in getattr(fn, "__jax_dg_ops__", ())}
    assert exposed == {n for n in registry.ops() if not n.startswith("_")}
    # a family's public functions are its module's __all__, which jax_dg exports: an exposed
    # function left out of it would be an op no user reaches
    import importlib
    import pkgutil
    for info in pkgutil.iter_modules(jax_dg.ops.__path__):
        module = importlib.import_module(f"jax_dg.ops.{info.name}")
        marked = {n for n, v in vars(module).items() if hasattr(v, "__jax_dg_ops__")
                  and getattr(v, "__module__", None) == module.__name__ and not n.startswith("_")}
        assert marked <= set(module.__all__) <= set(jax_dg.__all__), info.name
    # the differentiable functions: ops with a reverse-mode rule, and the layers marked so
    assert registry.differentiable() == sorted(
        [f"{family}_{s}" for family in ("bf16_gemm", "cublaslt_gemm") for s in ("nt", "nn", "tn", "tt")]
        + ["fp8_linear", "fp8_grouped_linear"])
