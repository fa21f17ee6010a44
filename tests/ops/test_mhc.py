"""mega_mhc: the bridge path against the pure-JAX reference, an independent float64 check,
the SF layouts, bad inputs, and (GPU) DeepGEMM on SM100 or the SM100-only error."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.core.device import family as arch_family
from jax_dg.reference.mhc import shared_sf_rows
from tests.conftest import bits, digest, to_torch, run

# DeepGEMM's test scalars (tests/test_mega_mhc.py)
SCALARS = dict(hc_norm_eps=2e-5, hc_pre_eps=3e-4, hc_post_scale=1.25, sinkhorn_eps=2e-6,
               num_sinkhorn_iters=10, rmsnorm_eps=7e-6, rmsnorm_scale=1.25)


def make_inputs(keys, t, h, shifted):
    """DeepGEMM's make_inputs (numpy-generated: no per-shape compiles on a 2-core CI)."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(keys())).astype(np.uint32))
    r = 4
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    comb = rng.random((t, r, r), np.float32)
    for _ in range(3):
        comb = comb / comb.sum(-1, keepdims=True)
        comb = comb / comb.sum(-2, keepdims=True)
    f32 = lambda v: jnp.asarray(np.asarray(v, np.float32))  # noqa: E731
    args = (f32(rng.standard_normal((t, h))).astype(jnp.bfloat16),
            f32(rng.standard_normal((t, r, h))).astype(jnp.bfloat16),
            f32(sig(rng.standard_normal((t, r, 1)))),
            f32(comb),
            f32(rng.standard_normal((r * (r + 2), r * h)) * 1e-2),
            f32(rng.standard_normal(3) * 0.1),
            f32(rng.standard_normal(r * (r + 2)) * 0.1),
            f32(rng.standard_normal(h) * 0.1 + 1).astype(jnp.bfloat16))
    shifted_prev = f32(sig(rng.standard_normal((t, r, 1)))) if shifted else None
    return args, shifted_prev


def mhc_fn(shifted_prev, **kw):
    def f(*args):
        return jax_dg.mega_mhc(*args, shifted_prev_mix=shifted_prev, **SCALARS, **kw)
    return f


def float64_reference(args, shifted_prev):
    """DeepGEMM's mhc_reference in numpy float64 (bf16 roundings where it rounds)."""
    x, res, post, comb, fn, ms, mb, rw = (np.asarray(a, np.float64) for a in args)
    bf16 = lambda v: np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16), np.float64)  # noqa: E731
    r, h = 4, x.shape[1]
    nr = bf16(x[:, None] * post + np.einsum("tij,tih->tjh", comb, res))
    mixes = nr.reshape(len(x), -1) @ fn.T / np.sqrt((nr ** 2).sum((1, 2)) / (r * h) + SCALARS["hc_norm_eps"])[:, None]
    mixes = mixes * np.concatenate([[ms[0]] * r, [ms[1]] * r, [ms[2]] * r * r]) + mb
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    prev = sig(mixes[:, :r])[:, :, None] + SCALARS["hc_pre_eps"]
    post_new = (sig(mixes[:, r:2 * r]) * SCALARS["hc_post_scale"])[:, :, None]
    v = mixes[:, 2 * r:].reshape(-1, r, r)
    v = np.exp(v - v.max(-1, keepdims=True))
    eps = SCALARS["sinkhorn_eps"]
    v = v / v.sum(-1, keepdims=True) + eps
    v = v / (v.sum(-2, keepdims=True) + eps)
    for _ in range(SCALARS["num_sinkhorn_iters"] - 1):
        v = v / (v.sum(-1, keepdims=True) + eps)
        v = v / (v.sum(-2, keepdims=True) + eps)
    p = prev if shifted_prev is None else np.asarray(shifted_prev, np.float64)
    ni = bf16((nr * p).sum(1))
    y = ni / np.sqrt((ni ** 2).mean(1) + SCALARS["rmsnorm_eps"])[:, None] * rw * SCALARS["rmsnorm_scale"]
    return dict(new_residual=nr, new_prev_mix=prev, new_post_mix=post_new, new_comb_res_mix=v, y_bf16=y)


LAYOUTS = [(None, 0), ("gemm", 0), ("routed", 224), ("routed", 64)]


@pytest.mark.parametrize("shifted", [False, True], ids=["normal", "shifted"])
@pytest.mark.parametrize("layout,block_m", LAYOUTS, ids=["bf16", "gemm_sf", "routed_224", "routed_64"])
@pytest.mark.parametrize("t,h", [(1, 1024), (65, 2048)])
def test_matches_reference_under_jit(keys, t, h, layout, block_m, shifted):
    args, shifted_prev = make_inputs(keys, t, h, shifted)
    before = digest(args, shifted_prev)
    f = mhc_fn(shifted_prev, fp8_sf_layout=layout, shared_sf_block_m=block_m)
    out = run("auto", f, *args)
    ref = run("xla", f, *args)
    assert digest(args, shifted_prev) == before, "inputs were written"
    assert sorted(out) == sorted(ref)
    assert ("new_prev_mix" in out) == shifted
    for name in out:
        assert out[name].shape == ref[name].shape and out[name].dtype == ref[name].dtype, name
        a, b = np.asarray(out[name].astype(jnp.float32)), np.asarray(ref[name].astype(jnp.float32))
        if out[name].dtype == jnp.int32:
            np.testing.assert_array_equal(out[name], ref[name], err_msg=name)
        else:
            assert jax_dg.calc_diff(a, b) < 1e-6, name
    # Independent float64 check with DeepGEMM's thresholds
    ref64 = float64_reference(args, shifted_prev)
    for name, value in ref64.items():
        if name in out:
            assert jax_dg.calc_diff(np.asarray(out[name].astype(jnp.float32)), value) < 5e-5, name
    if layout is None:
        return
    # FP8 y: per-token 1 x 32 UE8M0 blocks of y_bf16; the SF layouts hold the same scales
    packed = out["y_routed_sf"] if layout == "routed" else jax_dg.mn_major_logical(out["y_gemm_sf"], t)
    exps = np.asarray(jax.lax.bitcast_convert_type(packed, jnp.uint8)).reshape(t, -1).astype(np.int64)
    scale = np.exp2(exps - 127.0)
    y8 = np.asarray(out["y_fp8"].astype(jnp.float32)) * np.repeat(scale, 32, axis=1)
    assert jax_dg.calc_diff(y8, np.asarray(out["y_bf16"].astype(jnp.float32))) < 1e-3  # E4M3 rounding
    if layout == "gemm":
        assert out["y_gemm_sf"].shape == (h // 128, -(-t // 4) * 4)
        assert (np.asarray(out["y_gemm_sf"])[:, t:] == 0).all()
    else:
        rows = np.asarray(shared_sf_rows(t, block_m))
        shared = np.asarray(out["y_shared_sf"])
        np.testing.assert_array_equal(shared[:, rows].T, np.asarray(out["y_routed_sf"]))
        untouched = np.ones(shared.shape[1], bool)
        untouched[rows] = False
        assert (shared[:, untouched] == 0).all()


def test_fp8_only_output(keys):
    args, shifted_prev = make_inputs(keys, 33, 1024, True)
    f = mhc_fn(shifted_prev, y_bf16=False, fp8_sf_layout="gemm")
    out = run("auto", f, *args)
    ref = run("xla", f, *args)
    assert "y_bf16" not in out
    np.testing.assert_array_equal(bits(out["y_fp8"]), bits(ref["y_fp8"]))


def test_shared_sf_rows_match_deep_gemms_formula():
    # tests/test_mega_mhc.py's extra_sf_rows
    for t, block_m in [(300, 224), (1000, 64), (130, 256)]:
        token = np.arange(t)
        i = token % block_m
        expect = token // block_m * (-(-block_m // 128) * 128) + i // 128 * 128 + i % 32 * 4 + i % 128 // 32
        np.testing.assert_array_equal(np.asarray(shared_sf_rows(t, block_m)), expect)


def test_zero_tokens(keys):
    args, _ = make_inputs(keys, 0, 1024, False)
    out = run("auto", mhc_fn(None, fp8_sf_layout="routed", shared_sf_block_m=64), *args)
    assert out["y_bf16"].shape == (0, 1024) and out["y_shared_sf"].shape == (8, 0)


def test_repeated_calls_are_bitwise_identical(keys):
    args, shifted_prev = make_inputs(keys, 64, 1024, True)
    f = jax.jit(mhc_fn(shifted_prev, fp8_sf_layout="gemm"))
    first = {k: bits(v) for k, v in f(*args).items()}
    assert all({k: bits(v) for k, v in f(*args).items()} == first for _ in range(5))


@pytest.mark.parametrize("case,arg", [
    ("x_dtype", "x"), ("hidden", "x"), ("residual_shape", "residual"), ("post_shape", "post_mix"),
    ("comb_dtype", "comb_res_mix"), ("fn_shape", "fn"), ("scales", "mix_scales"),
    ("bases", "mix_bases"), ("norm_weight", "rmsnorm_weight"), ("shifted", "shifted_prev_mix"),
    ("hc_mult", "hc_mult"), ("iters", "num_sinkhorn_iters"), ("layout", "fp8_sf_layout"),
    ("no_output", "y_bf16"), ("block_m_missing", "shared_sf_block_m"),
    ("block_m_unused", "shared_sf_block_m"),
])
def test_bad_inputs_fail_at_trace_time_naming_the_argument(keys, case, arg):
    args, _ = make_inputs(keys, 8, 1024, False)
    args = list(args)
    kw = dict(SCALARS)
    names = ["x", "residual", "post_mix", "comb_res_mix", "fn", "mix_scales", "mix_bases", "rmsnorm_weight"]
    if case == "x_dtype":
        args[0] = args[0].astype(jnp.float32)
    elif case == "hidden":
        args[0], args[1], args[4], args[7] = args[0][:, :512], args[1][..., :512], args[4][:, :2048], args[7][:512]
    elif case == "residual_shape":
        args[1] = args[1][:, :3]
    elif case == "post_shape":
        args[2] = args[2][..., 0]
    elif case == "comb_dtype":
        args[3] = args[3].astype(jnp.bfloat16)
    elif case == "fn_shape":
        args[4] = args[4][:20]
    elif case == "scales":
        args[5] = args[5][:2]
    elif case == "bases":
        args[6] = args[6][:23]
    elif case == "norm_weight":
        args[7] = args[7].astype(jnp.float32)
    elif case == "shifted":
        kw["shifted_prev_mix"] = jnp.ones((8, 4), jnp.float32)
    elif case == "hc_mult":
        kw["hc_mult"] = 2
    elif case == "iters":
        kw["num_sinkhorn_iters"] = 0
    elif case == "layout":
        kw["fp8_sf_layout"] = "col"
    elif case == "no_output":
        kw["y_bf16"] = False
    elif case == "block_m_missing":
        kw["fp8_sf_layout"] = "routed"
    elif case == "block_m_unused":
        kw["fp8_sf_layout"], kw["shared_sf_block_m"] = "gemm", 64
    del names
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"mega_mhc: `{arg}`")):
        jax.jit(lambda *a: jax_dg.mega_mhc(*a, **kw)).trace(*args)


# --- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_sm90_raises_the_sm100_only_error_and_references_run(keys):
    if arch_family() == "sm100":
        pytest.skip("SM100: DeepGEMM's kernel runs (see the next test)")
    args, shifted_prev = make_inputs(keys, 64, 4096, True)
    f = mhc_fn(shifted_prev, fp8_sf_layout="gemm")
    with pytest.raises(jax_dg.UnsupportedArchError, match=r"mega_mhc.*only on sm100.*JAX_DG_BACKEND=torch"):
        jax.block_until_ready(run("auto", f, *args))
    out, ref = run("torch", f, *args), run("xla", f, *args)
    for name in ("new_residual", "new_comb_res_mix", "y_bf16"):
        assert jax_dg.calc_diff(out[name].astype(jnp.float32), ref[name].astype(jnp.float32)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("layout,block_m", [("gemm", 0), ("routed", 224)])
@pytest.mark.parametrize("t,h", [(1, 4096), (65, 7168), (4096, 4096)])
def test_gpu_sm100_matches_deep_gemm_from_torch(keys, t, h, layout, block_m, shifted):
    if arch_family() != "sm100":
        pytest.skip("mega_mhc's DeepGEMM kernel is SM100-only")
    import deep_gemm
    import torch
    args, shifted_prev = make_inputs(keys, t, h, shifted)
    f = jax.jit(mhc_fn(shifted_prev, fp8_sf_layout=layout, shared_sf_block_m=block_m))
    out = f(*args)
    ref64 = float64_reference(args, shifted_prev)
    for name, value in ref64.items():
        if name in out:
            assert jax_dg.calc_diff(out[name].astype(jnp.float32), value) < 5e-5, name
    tx = [to_torch(a) for a in args]
    w = h // 128
    d = dict(new_residual=torch.empty_like(tx[1]), new_post_mix=torch.empty_like(tx[2]),
             new_comb_res_mix=torch.empty_like(tx[3]), y_bf16=torch.empty_like(tx[0]),
             y_fp8=torch.empty((t, h), dtype=torch.float8_e4m3fn, device="cuda"))
    if shifted:
        d["new_prev_mix"] = torch.empty_like(tx[2])
    if layout == "gemm":
        buf = torch.zeros((w, -(-t // 4) * 4), dtype=torch.int32, device="cuda")
        d["y_gemm_sf"] = buf.as_strided((t, w), (1, buf.shape[1]))
    else:
        d["y_routed_sf"] = torch.empty((t, w), dtype=torch.int32, device="cuda")
        buf = torch.zeros((w, -(-t // block_m) * (-(-block_m // 128) * 128)), dtype=torch.int32, device="cuda")
        d["y_shared_sf"] = buf.as_strided((t, w), (1, buf.shape[1]))
    deep_gemm.mega_mhc(x=tx[0], residual=tx[1], shifted_prev_mix=None if shifted_prev is None else to_torch(shifted_prev),
                       post_mix=tx[2], comb_res_mix=tx[3], fn=tx[4], mix_scales=tx[5], mix_bases=tx[6],
                       hc_mult=4, rmsnorm_weight=tx[7], shared_sf_block_m=block_m, **SCALARS, **d)
    torch.cuda.synchronize()
    expect = dict(d)
    expect["y_gemm_sf" if layout == "gemm" else "y_shared_sf"] = buf
    for name, value in out.items():
        v = expect[name]
        v = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
        assert bits(out[name]) == v.contiguous().cpu().numpy().tobytes(), name
    first = {k: bits(v) for k, v in out.items()}
    assert all({k: bits(v) for k, v in f(*args).items()} == first for _ in range(20))
