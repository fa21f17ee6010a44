"""fp8_gemm_nt: the bridge path against the pure-JAX reference, bad inputs, and (GPU) DeepGEMM."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from tests.conftest import bits, device_copies, digest, run, same_bits, to_torch

# K not a multiple of 128 where the contract allows (K % 16 == 0): 208, 576.
CPU_SHAPES = [(1, 256, 512), (64, 320, 384), (130, 2112, 1024), (128, 576, 7168), (7, 200, 208), (3, 64, 576)]


def make_inputs(keys, m, n, k):
    x = jax.random.normal(keys(), (m, k), jnp.bfloat16)
    w = jax.random.normal(keys(), (n, k), jnp.bfloat16)
    return x, w, jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(w)


def unquantised(x, w):
    return np.asarray(x, np.float32) @ np.asarray(w, np.float32).T


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
    from jax_dg.backends import torch_emu
    _, _, a, b = make_inputs(keys, 8, 128, 128)
    real = torch_emu.fp8_gemm_nt
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure 1234")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_emu, "fp8_gemm_nt", flaky)
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


# --- Layout variants (nn / tn / tt) and BF16 / cuBLASLt GEMMs --------------------------------
# A layout names how the arrays are stored: a "n" = [M, K], "t" = [K, M]; b "t" = [N, K], "n" = [K, N].

def store(layout, x, w):
    """(a, b) holding x [M, K] and w [N, K] in `layout` (scales transposed with their values)."""
    t = lambda p: (p[0].T, p[1].T) if isinstance(p, tuple) else p.T  # noqa: E731
    return (t(x) if layout[0] == "t" else x), (t(w) if layout[1] == "n" else w)


@pytest.mark.parametrize("layout", ["nn", "tn", "tt"])
@pytest.mark.parametrize("channel", [False, True])
def test_fp8_layouts_equal_nt_on_the_same_values(keys, layout, channel):
    m, n, k = 48, 128, 320
    x, w, a, b = make_inputs(keys, m, n, k)
    kw = {}
    if channel:  # per-channel b, float32 d accumulated onto c
        b = jax_dg.per_token_cast_to_fp8(w)
        kw = dict(c=jax.random.normal(keys(), (m, n), jnp.float32))
    fn = getattr(jax_dg, f"fp8_gemm_{layout}")
    f = lambda a, b: fn(a, b, **kw)  # noqa: E731
    a_l, b_l = store(layout, a, b)
    before = digest(a_l, b_l)
    d = run("auto", f, a_l, b_l)
    assert digest(a_l, b_l) == before, "inputs were written"
    nt = run("xla", lambda a, b: jax_dg.fp8_gemm_nt(a, b, **kw), a, b)
    assert d.shape == (m, n) and d.dtype == (jnp.float32 if channel else jnp.bfloat16)
    assert jax_dg.calc_diff(d, nt) < 1e-6
    np.testing.assert_array_equal(np.asarray(run("xla", f, a_l, b_l)), np.asarray(nt))
    expected = unquantised(x, w) + (np.asarray(kw["c"]) if channel else 0)
    assert jax_dg.calc_diff(d, expected) < 1e-3


@pytest.mark.parametrize("layout,case,arg", [
    ("nn", "b_scales_not_transposed", "b[1]"), ("tn", "a_scales_not_transposed", "a[1]"),
    ("tt", "m_align", "a[0]"), ("nn", "k_mismatch", "b[0]"), ("tn", "c_needs_channel_recipe", "c"),
])
def test_fp8_layouts_bad_inputs(keys, layout, case, arg):
    _, _, a, b = make_inputs(keys, 32, 128, 256)
    a, b = store(layout, a, b)
    kw = {}
    if case == "b_scales_not_transposed":
        b = (b[0], b[1].T)
    elif case == "a_scales_not_transposed":
        a = (a[0], a[1].T)
    elif case == "m_align":
        a = (a[0][:, :24], a[1][:, :24])
    elif case == "k_mismatch":
        b = (b[0][:128], b[1][:1])
    elif case == "c_needs_channel_recipe":
        kw = dict(c=jnp.zeros((32, 128), jnp.float32))
    fn = getattr(jax_dg, f"fp8_gemm_{layout}")
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"fp8_gemm_{layout}: `{arg}`")):
        jax.jit(lambda a, b: fn(a, b, **kw)).trace(a, b)


def bf16_inputs(keys, m, n, k):
    return (jax.random.normal(keys(), (m, k), jnp.bfloat16),
            jax.random.normal(keys(), (n, k), jnp.bfloat16))


@pytest.mark.parametrize("family", ["bf16_gemm", "cublaslt_gemm"])
@pytest.mark.parametrize("layout", ["nt", "nn", "tn", "tt"])
def test_bf16_gemms_match_reference(keys, family, layout):
    m, n, k = 40, 96, 192
    x, w = bf16_inputs(keys, m, n, k)
    fn = getattr(jax_dg, f"{family}_{layout}")
    a, b = store(layout, x, w)
    c = jax.random.normal(keys(), (m, n), jnp.float32)
    before = digest(a, b, c)
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    # bfloat16 d without c; float32 d accumulated onto c (c's dtype picks out_dtype).
    for f, expected, dtype in ((fn, exact, jnp.bfloat16),
                               (lambda a, b, c=c: fn(a, b, c=c), exact + np.asarray(c), jnp.float32)):
        d = run("auto", f, a, b)
        assert d.shape == (m, n) and d.dtype == dtype
        ref = run("xla", f, a, b)
        np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(ref, np.float32),
                                   rtol=1e-5 if dtype == jnp.float32 else 2 ** -7, atol=1e-4)
        assert jax_dg.calc_diff(d, expected) < 1e-5
    assert digest(a, b, c) == before, "inputs were written"


def test_bf16_gemm_bf16_accumulator_is_donated(keys):
    x, w = bf16_inputs(keys, 16, 64, 128)
    c = jax.random.normal(keys(), (16, 64), jnp.bfloat16)
    f = lambda a, b, c: jax_dg.bf16_gemm_nt(a, b, c=c)  # noqa: E731
    d = jax.jit(f, donate_argnums=2)(x, w, c + 0)
    assert d.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(d), np.asarray(run("xla", f, x, w, c)))


@pytest.mark.parametrize("fn,case,arg", [
    ("bf16_gemm_nt", "k_align", "a"), ("bf16_gemm_tn", "m_align", "a"), ("bf16_gemm_nt", "dtype", "a"),
    ("bf16_gemm_nt", "c_dtype", "c"), ("bf16_gemm_nt", "out_dtype", "out_dtype"),
    ("cublaslt_gemm_nn", "k_mismatch", "b"), ("bf16_gemm_nn", "rank", "b"),
])
def test_bf16_gemms_bad_inputs(keys, fn, case, arg):
    x, w = bf16_inputs(keys, 16, 64, 128)
    a, b = store(fn[-2:], x, w)
    kw = {}
    if case == "k_align":
        a, b = a[:, :96], b[:, :96]
    elif case == "m_align":
        a = a[:, :12]
    elif case == "dtype":
        a = a.astype(jnp.float32)
    elif case == "c_dtype":
        kw = dict(c=jnp.zeros((16, 64), jnp.float32), out_dtype=jnp.bfloat16)
    elif case == "out_dtype":
        kw = dict(out_dtype=jnp.float16)
    elif case == "k_mismatch":
        b = b[:64]
    elif case == "rank":
        b = b[None]
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"{fn}: `{arg}`")):
        jax.jit(lambda a, b: getattr(jax_dg, fn)(a, b, **kw)).trace(a, b)


def test_cublaslt_has_no_deep_gemm_alignment_rules(keys):
    x, w = bf16_inputs(keys, 5, 12, 40)  # K % 64 != 0, M % 8 != 0: fine for cuBLASLt
    d = run("auto", jax_dg.cublaslt_gemm_tn, x.T, w.T)
    assert jax_dg.calc_diff(d, np.asarray(x, np.float32) @ np.asarray(w, np.float32).T) < 1e-5


# --- GPU: layouts, BF16, cuBLASLt -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nn", "tn", "tt"])
def test_gpu_fp8_layouts_raise_on_sm90_and_run_the_torch_emulation(keys, layout):
    from jax_dg.core.device import family as arch_family
    if arch_family() != "sm90":
        pytest.skip("the clear error is SM90's; SM100 runs these kernels")
    x, w, a, b = make_inputs(keys, 128, 512, 512)
    a_l, b_l = store(layout, a, b)
    fn = getattr(jax_dg, f"fp8_gemm_{layout}")
    with pytest.raises(jax_dg.UnsupportedArchError, match=f"`fp8_gemm_{layout}` has a DeepGEMM kernel only on sm100"):
        jax.block_until_ready(jax.jit(fn)(a_l, b_l))
    d = run("torch", fn, a_l, b_l)  # the torch emulation through the bridge, on the GPU
    assert jax_dg.calc_diff(d, run("xla", fn, a_l, b_l)) < 1e-6
    assert jax_dg.calc_diff(d, unquantised(x, w)) < 1e-3


def _gpu_bf16_check(keys, family, layout, m, n, k, out_dtype, accumulate, threshold, repeats=20):
    import deep_gemm
    import torch
    x, w = bf16_inputs(keys, m, n, k)
    a, b = store(layout, x, w)
    c = (jax.random.normal(keys(), (m, n), jnp.float32) * 32).astype(out_dtype) if accumulate else None
    before = digest(a, b, c)
    fn = getattr(jax_dg, f"{family}_{layout}")
    f = jax.jit(lambda a, b, c: fn(a, b, c=c, out_dtype=out_dtype))
    d = f(a, b, c)
    expected = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    if accumulate:
        expected = expected + np.asarray(c, np.float32)
    assert jax_dg.calc_diff(d, np.asarray(jnp.asarray(expected).astype(out_dtype), np.float32)) < threshold
    # deep_gemm from torch on the same buffers (a [K, M] / b [K, N] go in as they are stored:
    # deep_gemm's nn / tn / tt transpose them, exactly as the op's call does).
    tdtype = torch.float32 if out_dtype == jnp.float32 else torch.bfloat16
    d_t = to_torch(c).clone() if accumulate else torch.empty((m, n), dtype=tdtype, device="cuda")
    getattr(deep_gemm, f"{family}_{layout}")(to_torch(a), to_torch(b), d_t, c=d_t if accumulate else None)
    torch.cuda.synchronize()
    view = d_t if tdtype == torch.float32 else d_t.view(torch.int16)
    assert bits(d) == view.cpu().numpy().tobytes()
    assert all(bits(f(a, b, c)) == bits(d) for _ in range(repeats))
    assert digest(a, b, c) == before, "inputs were written"


# DeepGEMM's test_bf16 enumerate_normal (SM90): forward K-major; dgrad with b MN-major (nn);
# wgrad with both MN-major (tn), float32 accumulated or bfloat16.
GPU_BF16 = [
    ("nt", 1, 2112, 7168, jnp.bfloat16, False), ("nt", 128, 24576, 1536, jnp.bfloat16, False),
    ("nt", 4096, 7168, 2048, jnp.bfloat16, True), ("nt", 4096, 256, 7168, jnp.float32, False),
    ("nn", 4096, 7168, 2112, jnp.bfloat16, False), ("tn", 2112, 4096, 7168, jnp.float32, True),
    ("tn", 576, 4096, 7168, jnp.bfloat16, False), ("tt", 512, 1536, 4096, jnp.bfloat16, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,m,n,k,out_dtype,accumulate", GPU_BF16)
def test_gpu_bf16_gemm_matches_deep_gemm_from_torch(keys, layout, m, n, k, out_dtype, accumulate):
    _gpu_bf16_check(keys, "bf16_gemm", layout, m, n, k, out_dtype, accumulate, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,m,n,k,out_dtype,accumulate", [
    ("nt", 4096, 2112, 7168, jnp.bfloat16, False), ("nn", 128, 7168, 2048, jnp.float32, False),
    ("tn", 2112, 4096, 7168, jnp.float32, True), ("tt", 256, 576, 7168, jnp.bfloat16, False),
])
def test_gpu_cublaslt_gemm_matches_deep_gemm_from_torch(keys, layout, m, n, k, out_dtype, accumulate):
    # DeepGEMM's thresholds: 6e-7, 1e-5 for bfloat16 accumulation.
    threshold = 1e-5 if accumulate and out_dtype == jnp.bfloat16 else 6e-7
    _gpu_bf16_check(keys, "cublaslt_gemm", layout, m, n, k, out_dtype, accumulate, threshold)


# --- fp8_gemm_nt_skip_head_mid: the GEMM around each head's middle columns --------------------

def _heads(d, splits):
    left, mid, right = splits
    return np.asarray(d, np.float32).reshape(d.shape[0], -1, left + mid + right)


@pytest.mark.parametrize("splits,given", [((64, 64, 128), False), ((128, 0, 64), False),
                                          ((32, 16, 32), True)])
def test_skip_head_mid_matches_reference_and_keeps_the_middle(keys, splits, given):
    """Upstream's test (apply_skip_head_mid): the plain GEMM's heads with the middle inserted;
    d's middle columns are kept when d is given, zero otherwise."""
    m, n, k = 40, 384, 256
    left, mid, right = splits
    _, _, a, b = make_inputs(keys, m, n, k)
    width = n + n // (left + right) * mid
    d0 = jax.random.normal(keys(), (m, width), jnp.bfloat16) if given else None
    fn = lambda a, b, *d: jax_dg.fp8_gemm_nt_skip_head_mid(a, b, splits, d=d[0] if d else None)  # noqa: E731
    args = (a, b) + ((d0,) if given else ())
    before = digest(*args)
    out = run("auto", fn, *args)
    assert out.shape == (m, width) and out.dtype == jnp.bfloat16
    assert digest(*args) == before, "inputs were written"
    assert jax_dg.calc_diff(out, run("xla", fn, *args)) < 1e-6   # the pure-JAX reference
    plain = run("auto", jax_dg.fp8_gemm_nt, a, b)
    heads, want = _heads(out, splits), np.asarray(plain, np.float32).reshape(m, -1, left + right)
    np.testing.assert_array_equal(heads[:, :, :left], want[:, :, :left])
    np.testing.assert_array_equal(heads[:, :, left + mid:], want[:, :, left:])
    middle = _heads(d0, splits)[:, :, left:left + mid] if given else 0
    np.testing.assert_array_equal(heads[:, :, left:left + mid], middle)


@pytest.mark.parametrize("case,arg", [("not_dividing", "head_splits"), ("not_static", "head_splits"),
                                      ("negative", "head_splits"), ("d_shape", "d"), ("d_dtype", "d")])
def test_skip_head_mid_bad_inputs(keys, case, arg):
    _, _, a, b = make_inputs(keys, 16, 384, 256)
    splits, d = (64, 32, 128), jnp.zeros((16, 448), jnp.bfloat16)
    if case == "not_dividing":
        splits = (100, 0, 100)
        d = None
    elif case == "not_static":
        splits = (64.0, 32, 128)
    elif case == "negative":
        splits = (64, -32, 128)
    elif case == "d_shape":
        d = jnp.zeros((16, 384), jnp.bfloat16)
    elif case == "d_dtype":
        d = d.astype(jnp.float32)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"fp8_gemm_nt_skip_head_mid: `{arg}`")):
        jax.jit(lambda a, b, d: jax_dg.fp8_gemm_nt_skip_head_mid(a, b, splits, d=d)).trace(a, b, d)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 4096])
@pytest.mark.parametrize("n,k", [(32768, 512), (8192, 512)])
def test_gpu_skip_head_mid_matches_deep_gemm_from_torch(keys, m, n, k):
    """DeepGEMM's own cases (test_attention.py test_gemm_skip_head_mid: head_splits (128, 64,
    128), the plain GEMM's N and K as there): bitwise equal to deep_gemm from torch writing into
    the same d, the middle kept, 20 repeats identical, inputs never written. Compared on the
    device (d is up to 335 MB)."""
    import deep_gemm
    import torch
    splits = (128, 64, 128)
    x, w, a, b = make_inputs(keys, m, n, k)
    d0 = jax.random.normal(keys(), (m, n + n // 256 * 64), jnp.bfloat16)
    inputs = device_copies(a, b, d0)
    f = jax.jit(lambda a, b, d: jax_dg.fp8_gemm_nt_skip_head_mid(a, b, splits, d=d))
    out = f(a, b, d0)
    heads = out.reshape(m, -1, 320)
    got = jnp.concatenate([heads[:, :, :128], heads[:, :, 192:]], axis=-1).reshape(m, n)
    want = jax.jit(lambda x, w: jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32).T))(x, w)
    assert float(jax_dg.calc_diff(got, want)) < 1e-3
    assert bool(same_bits(heads[:, :, 128:192], d0.reshape(m, -1, 320)[:, :, 128:192])), "middle changed"
    d_t = to_torch(d0).clone()
    deep_gemm.fp8_gemm_nt_skip_head_mid((to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1])),
                                        d_t, splits)
    torch.cuda.synchronize()
    assert bool(torch.equal(to_torch(jax.block_until_ready(out)).view(torch.int16), d_t.view(torch.int16)))
    assert all(bool(same_bits(f(a, b, d0), out)) for _ in range(20))
    assert bool(same_bits(inputs, (a, b, d0))), "inputs were written"
