"""bfloat16 MQA logits (`logits_dtype=`, both non-paged forms and paged), their buffer layout and
landing, top-k over them, and the fp8_fp4_mqa_logits signature probe (DeepGEMM >= 2.8 has no
clean_logits). CPU: the bridge against the pure-JAX reference under jit; GPU: DeepGEMM's own
cases (tests/test_attention.py at 88965b0) and bitwise against deep_gemm called from torch."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg import contracts
from jax_dg.backends import deep_gemm as dgb
from jax_dg.runtime import landing
from tests.conftest import run, same_bits, to_torch
from tests.ops.test_mqa import make_inputs, valid_of, varied_ranges
from tests.ops.test_paged_mqa import lens_2d, make_case

BF16 = jnp.bfloat16


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def assert_bf16_of(out, full):
    """`out` (bfloat16) is `full` (float32, the same bridge) rounded once: bitwise."""
    assert out.dtype == BF16
    np.testing.assert_array_equal(f32(out).view(np.uint32), f32(full.astype(BF16)).view(np.uint32))


# --- CPU: non-paged --------------------------------------------------------------------------------

@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("h,d", [(32, 128), (64, 64)])
def test_mqa_bf16_matches_reference_under_jit(keys, h, d, compressed):
    m, n = 41, 300
    q, kv, w = make_inputs(keys, m, n, h, d)
    ks, ke = varied_ranges(keys, m, n)
    msk = int((ke - ks).max()) if compressed else None
    f = lambda dt: (lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk, logits_dtype=dt))  # noqa: E731
    out = run("auto", f(BF16), q, kv, w, ks, ke)
    expect = run("xla", f(BF16), q, kv, w, ks, ke)
    assert out.shape == (m, msk or n) and expect.dtype == BF16
    valid = valid_of(ks, ke, msk or n, compressed)
    np.testing.assert_array_equal(np.isneginf(f32(out)), ~valid)
    np.testing.assert_array_equal(np.isneginf(f32(expect)), ~valid)
    assert jax_dg.calc_diff(f32(out)[valid], f32(expect)[valid]) < 1e-5
    np.testing.assert_allclose(f32(out)[valid], f32(expect)[valid], rtol=2 ** -7, atol=1e-2)
    assert_bf16_of(out, run("auto", f(jnp.float32), q, kv, w, ks, ke))
    # the seed call shape takes it too
    seed = run("auto", lambda *a: jax_dg.fp8_fp4_mqa_logits(*a, msk, logits_dtype="bfloat16"),
               q, kv, w, ks, ke)
    np.testing.assert_array_equal(f32(seed).view(np.uint32), f32(out).view(np.uint32))


def test_mqa_bf16_lands_and_nothing_to_score(keys):
    q, kv, w = make_inputs(keys, 64, 700, 64, 128)
    ks, ke = varied_ranges(keys, 64, 700)
    before = dict(landing.STATS)
    run("auto", lambda *a: jax_dg.mqa_logits(*a, logits_dtype=BF16), q, kv, w, ks, ke).block_until_ready()
    assert landing.STATS["landed"] == before["landed"] + 1 and landing.STATS["copied"] == before["copied"]
    empty = jax_dg.mqa_logits((q[0][:0], None), kv, w[:0], ks[:0], ke[:0], logits_dtype=BF16)
    assert empty.shape == (0, 700) and empty.dtype == BF16


def test_layout_follows_the_element_size():
    # DeepGEMM <= 2.5: 64 elements whatever the dtype; >= 2.6: 1024-byte rows
    assert contracts.logits_stride_align((2, 5), "bfloat16") == 64
    assert contracts.logits_stride_align((2, 6), "float32") == 256
    assert contracts.logits_stride_align((2, 8), "bfloat16") == 512
    assert contracts.mqa_logits_layout(2048, 64, 8192, 0, 512) == (2048, 8704)
    assert contracts.mqa_logits_layout(2048, 64, 8192, 0) == (2048, 8448)
    assert contracts.mqa_logits_layout(100, 32, 0, 300, 512) == (100, 512)
    assert contracts.paged_logits_layout(8, 4100, 512) == (8, 4608)
    assert contracts.paged_logits_layout(8, 4100) == contracts.paged_logits_layout(8, 4100, 256) == (8, 4352)
    # the declared buffer: bytes and landing rows from the dtype
    from jax_dg.core import device
    from jax_dg.ops import mqa
    buf = mqa.logits_buffer(device.Target("torch", "cpu", "sm90", 132), 2048, 8448, "bfloat16")
    assert buf.dtype == BF16 and buf.shape == (2048, 8448)


def test_mqa_layout_of_a_newer_deep_gemm_is_declared(monkeypatch):
    """The shape rule declares the buffer the target's DeepGEMM writes: from 2.6 on rows of a
    multiple of 1024 bytes (bfloat16: 512 elements); 2.8 has no full form and no bfloat16 (the
    kernel writes the compressed form N wide in float32, which the finish turns into what was
    asked). The target carries the installed DeepGEMM's version, the shape rule reads it."""
    from jax_dg.core import device
    from jax_dg.ops import mqa
    monkeypatch.setattr(dgb, "version", lambda: "2.8.2")
    monkeypatch.setattr(dgb, "module", lambda: types.SimpleNamespace(get_num_sms=lambda: 132))
    monkeypatch.setattr(device, "platform", lambda: "cuda")
    monkeypatch.setattr(device, "family", lambda: "sm90")
    assert device.target().version == (2, 8)
    avals = (jax.ShapeDtypeStruct((64, 64, 128), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((700, 128), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((700,), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32),
             jax.ShapeDtypeStruct((64,), jnp.int32), jax.ShapeDtypeStruct((64,), jnp.int32))

    def layout(version, dtype):
        t = device.Target("deep_gemm", "cpu", "sm90", 132, dgb.Api.emulating(version))
        static = mqa.FP8_MQA_LOGITS.complete(dict(max_seqlen_k=0, clean_logits=True, logits_dtype=dtype))
        shaped = mqa.FP8_MQA_LOGITS.shape(avals, static, t)
        return shaped.types[0].shape[1], str(shaped.types[0].dtype), shaped.plan["kernel_width"]
    assert layout((2, 6), "bfloat16") == (1024, "bfloat16", 0)
    assert layout((2, 6), "float32") == (1024, "float32", 0)
    assert layout((2, 8), "bfloat16") == layout((2, 8), "float32") == (768, "float32", 700)
    assert layout((2, 5), "bfloat16") == (960, "bfloat16", 0) and layout((2, 5), "float32")[0] == 960


def test_topk_takes_bf16_logits(keys):
    x = jax.random.normal(keys(), (7, 300), jnp.float32).astype(BF16)
    a = run("auto", lambda x: jax_dg.topk_indices(x, 20), x)
    b = run("auto", lambda x: jax_dg.topk_indices(x.astype(jnp.float32), 20), x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fn", ["mqa_logits", "fp8_fp4_mqa_logits"])
@pytest.mark.parametrize("bad", [jnp.float16, "int32", "nonsense"])
def test_bad_logits_dtype_names_the_argument(keys, fn, bad):
    q, kv, w = make_inputs(keys, 8, 64, 32, 64)
    ks, ke = varied_ranges(keys, 8, 64)
    call = (lambda *a: jax_dg.mqa_logits(*a, logits_dtype=bad)) if fn == "mqa_logits" else \
        (lambda *a: jax_dg.fp8_fp4_mqa_logits(*a, None, logits_dtype=bad))
    with pytest.raises(jax_dg.ArgumentError, match=re.escape("`logits_dtype`")):
        jax.jit(call).trace(q, kv, w, ks, ke)


# --- CPU: paged ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctx,next_n,blk,two_d,max_len", [([1, 64, 65, 200], 1, 64, True, 256),
                                                          ([1, 31, 33, 150], 2, 32, False, 300)])
def test_paged_bf16_matches_reference_under_jit(ctx, next_n, blk, two_d, max_len):
    q, cache, w, lens, table = make_case(ctx, next_n, 32, 128, blk, two_d=two_d)
    f = lambda dt: (lambda *a: jax_dg.paged_mqa_logits(*a, max_model_len=max_len, logits_dtype=dt))  # noqa: E731
    out = run("auto", f(BF16), q, cache, w, lens, table)
    expect = run("xla", f(BF16), q, cache, w, lens, table)
    assert out.dtype == BF16 and out.shape == (len(ctx) * next_n, max_len)
    valid = np.arange(max_len)[None, :] < np.minimum(lens_2d(lens, next_n), max_len).reshape(-1, 1)
    np.testing.assert_array_equal(np.isneginf(f32(out)), ~valid)
    np.testing.assert_array_equal(np.isneginf(f32(expect)), ~valid)
    assert jax_dg.calc_diff(f32(out)[valid], f32(expect)[valid]) < 1e-5
    assert_bf16_of(out, run("auto", f(jnp.float32), q, cache, w, lens, table))

    def seed_call(q, cache, w, lens, table):
        meta = jax_dg.get_paged_mqa_logits_metadata(lens, blk, next_n=next_n)
        return jax_dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, meta, max_len,
                                               logits_dtype=BF16)
    seed = run("auto", seed_call, q, cache, w, lens, table)
    np.testing.assert_array_equal(f32(seed).view(np.uint32), f32(out).view(np.uint32))


def test_paged_bad_logits_dtype_names_the_argument():
    q, cache, w, lens, table = make_case([10, 70], 1, 32, 64, 64, two_d=False)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape("paged_mqa_logits: `logits_dtype`")):
        jax.jit(lambda *a: jax_dg.paged_mqa_logits(*a, logits_dtype=jnp.float16)).trace(q, cache, w, lens, table)


def test_paged_bf16_folds_under_vmap():
    q, cache, w, lens, table = make_case([10, 70, 130], 1, 32, 64, 64, two_d=False)
    f = lambda q, w, lens, table: jax_dg.paged_mqa_logits(q, cache, w, lens, table, logits_dtype=BF16)  # noqa: E731
    stacked = [jnp.stack([x, x]) for x in (q, w, lens, table)]
    out = run("auto", jax.vmap(f), *stacked)
    one = run("auto", f, q, w, lens, table)
    assert out.dtype == BF16
    np.testing.assert_array_equal(f32(out[1]).view(np.uint32), f32(one).view(np.uint32))


# --- the fp8_fp4_mqa_logits signature probe (no clean_logits in DeepGEMM >= 2.8) ------------------

def fake_module(fn):
    return types.SimpleNamespace(fp8_fp4_mqa_logits=fn, __version__="x")


class PybindLike:
    """A pybind11 builtin as inspect sees one: no signature, the signature line in __doc__."""
    __signature__ = "not inspectable"   # inspect.signature raises TypeError, as for a builtin

    def __init__(self, doc, impl):
        self.__doc__, self._impl = doc, impl

    def __call__(self, *args, **kwargs):
        return self._impl(*args, **kwargs)


def _strict(*names):
    """An implementation taking q, kv, weights, ks, ke and exactly the keywords `names` (a
    pybind11 function raises TypeError for any other)."""
    seen = {}

    def impl(q, kv, weights, ks, ke, **kw):
        if set(kw) - set(names):
            raise TypeError("fp8_fp4_mqa_logits(): incompatible function arguments")
        seen.clear()
        seen.update(kw)
        return "logits"
    return impl, seen


DOC_25 = ("fp8_fp4_mqa_logits(q: tuple[torch.Tensor, Optional[torch.Tensor]], kv: tuple[torch.Tensor, "
          "torch.Tensor], weights: torch.Tensor, cu_seq_len_k_start: torch.Tensor, cu_seq_len_k_end: "
          "torch.Tensor, clean_logits: bool = True, max_seqlen_k: int = 0, logits_dtype: torch.dtype = "
          "torch.float32) -> torch.Tensor\n")
DOC_28 = DOC_25.replace("clean_logits: bool = True, ", "")


@pytest.mark.parametrize("form", ["python", "pybind_doc", "pybind_no_doc"])
@pytest.mark.parametrize("newer", [False, True])
def test_signature_probe(monkeypatch, form, newer):
    names = ("max_seqlen_k", "logits_dtype") + (() if newer else ("clean_logits",))
    impl, seen = _strict(*names)
    if form == "python":
        if newer:
            def fn(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k=0, logits_dtype=None):
                return impl(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                            max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype)
        else:
            def fn(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                   max_seqlen_k=0, logits_dtype=None):
                return impl(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=clean_logits,
                            max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype)
        expect_known = not newer
    else:
        fn = PybindLike((DOC_28 if newer else DOC_25) if form == "pybind_doc" else None, impl)
        expect_known = None if form == "pybind_no_doc" else not newer
    assert dgb.takes_keyword(fn, "clean_logits") is expect_known
    monkeypatch.setattr(dgb, "module", lambda: fake_module(fn))
    call = dgb.lookup("fp8_fp4_mqa_logits")
    assert call is fn if expect_known else call is not fn
    assert call("Q", "KV", "W", "KS", "KE", clean_logits=False, max_seqlen_k=7,
                logits_dtype="bf16") == "logits"
    want = {"max_seqlen_k": 7, "logits_dtype": "bf16"}
    if not newer:
        want["clean_logits"] = False
    assert seen == want


def test_signature_probe_keeps_other_errors(monkeypatch):
    def broken(q, kv, weights, ks, ke, max_seqlen_k=0, logits_dtype=None):
        raise RuntimeError("Assertion error (csrc/apis/attention.hpp): num_heads == 32")
    monkeypatch.setattr(dgb, "module", lambda: fake_module(broken))
    with pytest.raises(RuntimeError, match="num_heads"):
        dgb.lookup("fp8_fp4_mqa_logits")("Q", "KV", "W", "KS", "KE", clean_logits=False, max_seqlen_k=0)


# --- GPU: DeepGEMM's cases (test_attention.py, 88965b0) -------------------------------------------

def _torch_diff(x, y, valid):
    import torch
    x = torch.where(valid, x.double(), 0.0)
    y = torch.where(valid, y.double(), 0.0)
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


# S in (2048, 4096) x SK in (4096, 8192) x H (64, 32), D 128, upstream's causal masks (disable_cp):
# a few of them, both output forms each.
GPU_MQA = [(2048, 8192, 64), (4096, 4096, 32), (2048, 4096, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("s,sk,h", GPU_MQA)
def test_gpu_mqa_bf16_matches_deep_gemm_from_torch(keys, s, sk, h):
    import deep_gemm
    import torch
    from tests.ops.test_mqa import gpu_inputs, torch_inputs
    q, kv, w, ks, ke = gpu_inputs(keys, s, sk, h, 128)
    tq, tkv, tw, tks, tke = torch_inputs(q, kv, w, ks, ke)
    assert dgb.takes_keyword(deep_gemm.fp8_fp4_mqa_logits, "clean_logits") is True   # 2.5.0
    for msk in (None, int((ke - ks).max())):
        f = jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk, logits_dtype=BF16))
        out = f(q, kv, w, ks, ke)
        ref32 = run("xla", lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=msk), q, kv, w, ks, ke)
        t_out, t_ref = to_torch(out), to_torch(ref32)
        valid = t_ref != float("-inf")
        assert out.dtype == BF16 and torch.equal(t_out == float("-inf"), ~valid)
        # upstream: vs the dequantised float32 reference < 5e-6 (what its bf16 cases assert),
        # and the bf16-reference threshold 1e-3
        assert _torch_diff(t_out, t_ref, valid) < 5e-6
        assert _torch_diff(t_out, t_ref.bfloat16(), valid) < 1e-3
        dg = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=msk is None,
                                          max_seqlen_k=msk or 0, logits_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        assert dg.dtype == torch.bfloat16
        assert torch.equal(t_out.view(torch.int16)[valid], dg.view(torch.int16)[valid]), \
            "not bitwise deep_gemm's"
        for _ in range(20):
            assert bool(same_bits(f(q, kv, w, ks, ke), out))


@pytest.mark.gpu
@pytest.mark.parametrize("b,next_n,h", [(256, 1, 64), (256, 2, 32)])
def test_gpu_paged_bf16_matches_deep_gemm_from_torch(b, next_n, h):
    import deep_gemm
    import torch
    from tests.ops.test_paged_mqa import gpu_case
    q, cache, w, lens, table, max_len = gpu_case(b, next_n, h, avg=8192, seed=b + h + next_n)

    @jax.jit
    def step(q, cache, w, lens, table):
        meta = jax_dg.get_paged_mqa_logits_metadata(lens, 64)
        return meta, jax_dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, meta, max_len,
                                                     logits_dtype=BF16)
    meta, out = step(q, cache, w, lens, table)
    ref32 = run("xla", lambda *a: jax_dg.paged_mqa_logits(*a, max_model_len=max_len), q, cache, w, lens, table)
    valid = torch.arange(max_len, device="cuda")[None, :] < to_torch(lens).reshape(-1, 1)
    t_out = to_torch(out)
    assert out.dtype == BF16 and torch.equal(t_out == float("-inf"), ~valid)
    assert _torch_diff(t_out, to_torch(ref32), valid) < 5e-6
    logits_t = deep_gemm.fp8_fp4_paged_mqa_logits((to_torch(q), None), to_torch(cache), to_torch(w),
                                                  to_torch(lens), to_torch(table), to_torch(meta),
                                                  max_len, clean_logits=False, logits_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert logits_t.dtype == torch.bfloat16
    assert torch.equal(logits_t[valid].view(torch.int16), t_out[valid].view(torch.int16))
    for _ in range(20):
        assert bool(same_bits(step(q, cache, w, lens, table)[1], out))
