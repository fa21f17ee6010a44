"""bf16_mega_gate: the bridge path against the pure-JAX reference, DeepGEMM's own routing
checks, the index dtype, bad inputs, and (GPU) DeepGEMM or the SM100-only error."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.core.device import family as arch_family
from tests.conftest import bits, digest, to_torch, run

RSF = 1.5  # DeepGEMM's test routed_scaling_factor


def make_inputs(keys, t, h, e, *, bias=True, image=False, mask=False, fix=False, topk=6,
                physical_map=False, shared=0):
    # DeepGEMM's make_inputs, numpy-generated (no per-shape compiles on a 2-core CI)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(keys())).astype(np.uint32))
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x = jnp.asarray(normal(t, h)).astype(jnp.bfloat16)
    w = jnp.asarray(normal(e, h) * h ** -0.5).astype(jnp.bfloat16)
    kw = {}
    if bias:
        kw["bias"] = jnp.asarray(normal(e))
    if image:
        kw["image_bias"] = jnp.asarray(normal(e))
        kw["image_token_mask"] = jnp.asarray(rng.random(t) < 0.5)
    if mask:
        m = rng.random(t) >= 0.25
        m[0] = True
        kw["mask"] = jnp.asarray(m)
    if fix:
        kw["fix_routing_mask"] = jnp.asarray(np.arange(t) % 3 == 0)
        kw["unmapped_topk_idx"] = jnp.asarray(rng.integers(0, e, (t, topk), dtype=np.int32))
    if physical_map:
        # DeepGEMM's test map: every logical expert, the first 32 duplicated after the last
        n = e + shared
        dup = min(n, 32)
        table = np.full((n, 33), -1, np.int32)
        table[:, 0] = np.arange(n)
        table[:dup, 1] = n + np.arange(dup)
        count = np.ones(n, np.int32)
        count[:dup] = 2
        kw["to_physical_map"], kw["logical_count"] = jnp.asarray(table), jnp.asarray(count)
    return x, w, kw


def gate_fn(topk, scoring_func="sqrtsoftplus", ep_rank=0, **static):
    def f(x, w, kw):
        return jax_dg.bf16_mega_gate(x, w, topk, scoring_func=scoring_func, routed_scaling_factor=RSF,
                                     ep_rank=ep_rank, **kw, **static)
    return f


def check_routing(x, w, kw, weights, idx, topk, scoring_func):
    """DeepGEMM's check_topk_weights, in numpy float64: the selection is the top-k of
    score + bias (up to ties), weights are the normalised unbiased scores."""
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    scores = {"sigmoid": lambda v: 1 / (1 + np.exp(-v)), "identity": lambda v: v,
              "sqrtsoftplus": lambda v: np.sqrt(np.logaddexp(0, v))}[scoring_func](logits)
    e = w.shape[0]
    b = np.asarray(kw["bias"], np.float64)[None] if "bias" in kw else np.zeros((1, e))
    if "image_bias" in kw:
        b = np.where(np.asarray(kw["image_token_mask"])[:, None], np.asarray(kw["image_bias"])[None], b)
    ranking = scores + b
    idx, weights = np.asarray(idx)[:, :topk], np.asarray(weights)[:, :topk]
    active = np.asarray(kw.get("mask", np.ones(x.shape[0], bool)))
    fixed = np.asarray(kw.get("fix_routing_mask", np.zeros(x.shape[0], bool)))
    sel = idx[active]
    assert ((sel >= 0) & (sel < e)).all()
    picked = np.take_along_axis(scores[active], sel, 1)
    ref_w = picked / (picked.sum(1, keepdims=True) + 1e-20) * RSF
    assert jax_dg.calc_diff(weights[active], ref_w) < 1e-11
    ranked = active & ~fixed
    r_idx = idx[ranked]
    assert (np.diff(np.sort(r_idx, 1), axis=1) != 0).all(), "duplicate experts"
    r = ranking[ranked]
    chosen = np.take_along_axis(r, r_idx, 1)
    others = r.copy()
    np.put_along_axis(others, r_idx, -np.inf, 1)
    crossing = others.max(1) - chosen.min(1)
    assert (crossing <= 1e-5 + 1e-5 * np.abs(r).max(1)).all(), "top-k beyond numerical ties"
    if (~active).any():
        assert (np.asarray(idx)[~active] == -1).all() and (weights[~active] == 0).all()


CASES = [
    # (name, make_inputs kwargs, scoring_func)
    ("plain", dict(), "sqrtsoftplus"),
    ("no_bias", dict(bias=False), "sqrtsoftplus"),
    ("sigmoid_image_mask", dict(image=True, mask=True), "sigmoid"),
    ("identity_no_bias", dict(bias=False), "identity"),
    ("fixed_routing", dict(fix=True, image=True), "sqrtsoftplus"),
]


@pytest.mark.parametrize("t,h,e", [(37, 256, 64), (129, 512, 260)])
@pytest.mark.parametrize("name,opts,scoring", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_under_jit(keys, t, h, e, name, opts, scoring):
    topk = 6
    x, w, kw = make_inputs(keys, t, h, e, topk=topk, **opts)
    before = digest(x, w, kw)
    f = gate_fn(topk, scoring)
    weights, idx = run("auto", f, x, w, kw)
    ref_weights, ref_idx = run("xla", f, x, w, kw)
    assert digest(x, w, kw) == before, "inputs were written"
    assert weights.shape == idx.shape == (t, topk)
    assert weights.dtype == jnp.float32 and idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=1e-5, atol=1e-6)
    check_routing(x, w, kw, weights, idx, topk, scoring)
    if "fix_routing_mask" in kw:
        fixed = np.asarray(kw["fix_routing_mask"])
        np.testing.assert_array_equal(np.asarray(idx)[fixed], np.asarray(kw["unmapped_topk_idx"])[fixed])


def test_unmapped_topk_idx_receives_the_logical_routing(keys):
    topk = 4
    x, w, kw = make_inputs(keys, 50, 256, 32, topk=topk, fix=True, mask=True, physical_map=True)
    f = gate_fn(topk, return_unmapped_topk_idx=True)
    weights, idx, unmapped = run("auto", f, x, w, kw)
    ref = run("xla", f, x, w, kw)
    for a, b in zip((idx, unmapped), ref[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref[0]), rtol=1e-5, atol=1e-6)
    active = np.asarray(kw["mask"])
    fixed = np.asarray(kw["fix_routing_mask"]) & active
    assert (np.asarray(unmapped)[~active] == -1).all()
    np.testing.assert_array_equal(np.asarray(unmapped)[fixed], np.asarray(kw["unmapped_topk_idx"])[fixed])
    # physical ids: logical e (first 32 duplicated to e + n) spread by token (ep_rank 0)
    u, p = np.asarray(unmapped)[active], np.asarray(idx)[active]
    assert ((p == u) | (p == u + 32)).all() and (p != u).any()


def test_shared_experts_and_physical_map_with_ep_rank(keys):
    topk, e = 6, 96  # DeepGEMM's GATE_CONFIGS (96, 2, 6)
    x, w, kw = make_inputs(keys, 40, 256, e, topk=topk, shared=2, physical_map=True)
    for rank in (0, 3):
        f = gate_fn(topk, ep_rank=rank, num_shared_experts=2)
        weights, idx = run("auto", f, x, w, kw)
        ref_weights, ref_idx = run("xla", f, x, w, kw)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
        np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=1e-5, atol=1e-6)
        assert idx.shape == (40, topk + 2)
        assert (np.asarray(weights)[:, topk:] == 1.0).all()
        token = np.arange(40)
        for s in range(2):  # shared expert e + s, duplicated when e + s < 32 (never here)
            np.testing.assert_array_equal(np.asarray(idx)[:, topk + s], e + s)
        # duplicate choice: (ep_rank + 23333 t) % count of the logical expert
        logical = np.asarray(run("auto", gate_fn(topk, ep_rank=rank, num_shared_experts=2), x, w,
                                 {k: v for k, v in kw.items() if k not in ("to_physical_map", "logical_count")})[1])
        count = np.asarray(kw["logical_count"])[logical]
        expect = np.asarray(kw["to_physical_map"])[logical, (rank + 23333 * token[:, None]) % count]
        np.testing.assert_array_equal(np.asarray(idx), expect)


def test_ties_go_to_the_smallest_expert_index():
    # DeepGEMM's test: zero inputs, identity scoring, no bias -> experts 0..topk-1 in order
    x, w = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)
    f = gate_fn(8, "identity")
    for backend in ("auto", "xla"):
        weights, idx = run(backend, f, x, w, {})
        np.testing.assert_array_equal(np.asarray(idx), np.broadcast_to(np.arange(8), (8, 8)))


def test_bias_dominates_ranking_but_not_weights(keys):
    # DeepGEMM's test: bias 1e8 everywhere, image tokens -1e8: the ranking is all ties plus
    # the scores' rounding; weights still come from the unbiased scores
    x, w, kw = make_inputs(keys, 64, 256, 128, image=True)
    kw["bias"] = jnp.full((128,), 1e8, jnp.float32)
    kw["image_bias"] = jnp.full((128,), -1e8, jnp.float32)
    weights, idx = run("auto", gate_fn(6), x, w, kw)
    ref_weights, ref_idx = run("xla", gate_fn(6), x, w, kw)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(weights).sum(1), RSF, rtol=1e-5)


def test_zero_tokens():
    x, w = jnp.zeros((0, 256), jnp.bfloat16), jnp.ones((8, 256), jnp.bfloat16)
    weights, idx = run("auto", gate_fn(2, "identity"), x, w, {})
    assert weights.shape == idx.shape == (0, 2)


def test_index_dtype_is_int64_with_x64(keys):
    x, w, kw = make_inputs(keys, 33, 256, 16, topk=3, fix=True)
    f = gate_fn(3, return_unmapped_topk_idx=True)
    with jax.enable_x64(True):
        out = run("auto", f, x, w, kw)
        ref = run("xla", f, x, w, kw)
        assert out[1].dtype == out[2].dtype == jnp.int64
    for a, b in zip(out[1:], ref[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out32 = run("auto", f, x, w, kw)
    assert out32[1].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out32[1]), np.asarray(out[1]))


def test_repeated_calls_are_bitwise_identical(keys):
    x, w, kw = make_inputs(keys, 64, 256, 64, image=True, mask=True)
    f = jax.jit(gate_fn(6))
    first = [bits(o) for o in f(x, w, kw)]
    assert all([bits(o) for o in f(x, w, kw)] == first for _ in range(5))


@pytest.mark.parametrize("case,arg", [
    ("x_dtype", "x"), ("hidden", "x"), ("weight_hidden", "weight"), ("experts", "weight"),
    ("topk", "num_topk"), ("topk_static", "num_topk"), ("scoring", "scoring_func"),
    ("bias_shape", "bias"), ("image_pair", "image_bias"), ("image_mask_dtype", "image_token_mask"),
    ("fix_needs_unmapped", "fix_routing_mask"), ("unmapped_shape", "unmapped_topk_idx"),
    ("mask_shape", "mask"), ("mask_dtype", "mask"), ("ep_rank", "ep_rank"), ("rsf", "routed_scaling_factor"),
    ("shared", "num_shared_experts"), ("map_pair", "to_physical_map"),
    ("return_unmapped", "return_unmapped_topk_idx"),
])
def test_bad_inputs_fail_at_trace_time_naming_the_argument(keys, case, arg):
    x, w, kw = make_inputs(keys, 16, 256, 64)
    topk, extra = 6, {}
    if case == "x_dtype":
        x = x.astype(jnp.float32)
    elif case == "hidden":
        x, w = x[:, :192], w[:, :192]
    elif case == "weight_hidden":
        w = w[:, :128]
    elif case == "experts":
        w, kw = w[:62], {}
    elif case == "topk":
        topk = 33
    elif case == "topk_static":
        topk = jnp.int32(6)
    elif case == "scoring":
        extra["scoring_func"] = "softmax"
    elif case == "bias_shape":
        kw["bias"] = kw["bias"][:32]
    elif case == "image_pair":
        kw["image_bias"] = kw["bias"]
    elif case == "image_mask_dtype":
        kw["image_bias"], kw["image_token_mask"] = kw["bias"], jnp.ones((16,), jnp.int32)
    elif case == "fix_needs_unmapped":
        kw["fix_routing_mask"] = jnp.ones((16,), bool)
    elif case == "unmapped_shape":
        kw["unmapped_topk_idx"] = jnp.zeros((16, 5), jnp.int32)
    elif case == "mask_shape":
        kw["mask"] = jnp.ones((15,), bool)
    elif case == "ep_rank":
        extra["ep_rank"] = -1
    elif case == "mask_dtype":
        kw["mask"] = jnp.ones((16,), jnp.float32)
    elif case == "rsf":
        extra["routed_scaling_factor"] = float("inf")
    elif case == "shared":
        extra["num_shared_experts"] = 3
    elif case == "map_pair":
        kw["to_physical_map"] = jnp.zeros((64, 2), jnp.int32)
    elif case == "return_unmapped":
        extra["return_unmapped_topk_idx"] = True
    args = dict(scoring_func="sqrtsoftplus", routed_scaling_factor=RSF, ep_rank=0)
    args.update(extra)
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"bf16_mega_gate: `{arg}`")):
        jax.jit(lambda x, w, kw: jax_dg.bf16_mega_gate(x, w, topk, **args, **kw)).trace(x, w, kw)


# --- GPU: DeepGEMM on SM100; the clear error on SM90 -----------------------------------------

@pytest.mark.gpu
def test_gpu_sm90_raises_the_sm100_only_error_and_references_run(keys):
    if arch_family() == "sm100":
        pytest.skip("SM100: DeepGEMM's kernel runs (see the next test)")
    x, w, kw = make_inputs(keys, 128, 4096, 384)
    with pytest.raises(jax_dg.UnsupportedArchError, match=r"bf16_mega_gate.*only on sm100.*JAX_DG_BACKEND=torch"):
        jax.block_until_ready(run("auto", gate_fn(6), x, w, kw))
    weights, idx = run("torch", gate_fn(6), x, w, kw)  # the torch emulation on CUDA tensors
    ref_weights, ref_idx = run("xla", gate_fn(6), x, w, kw)
    check_routing(x, w, kw, weights, idx, 6, "sqrtsoftplus")
    assert jax_dg.calc_diff(weights, ref_weights) < 1e-9


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,e", [(1, 4096, 384), (128, 7168, 384), (4200, 7168, 256), (129, 4352, 260)])
def test_gpu_sm100_matches_deep_gemm_from_torch(keys, t, h, e):
    if arch_family() != "sm100":
        pytest.skip("bf16_mega_gate's DeepGEMM kernel is SM100-only")
    import deep_gemm
    import torch
    x, w, kw = make_inputs(keys, t, h, e, image=True, mask=True)
    before = digest(x, w, kw)
    f = jax.jit(gate_fn(6))
    weights, idx = f(x, w, kw)
    check_routing(x, w, kw, weights, idx, 6, "sqrtsoftplus")
    tk = {k: to_torch(v) for k, v in kw.items()}
    out = (torch.empty((t, 6), dtype=torch.int64, device="cuda"),
           torch.empty((t, 6), dtype=torch.float32, device="cuda"))
    deep_gemm.bf16_mega_gate(to_torch(x), to_torch(w), 6, False, 0, RSF, 0, scoring_func="sqrtsoftplus",
                             out=out, **tk)
    torch.cuda.synchronize()
    assert bits(weights) == out[1].cpu().numpy().tobytes()
    np.testing.assert_array_equal(np.asarray(idx), out[0].cpu().numpy())
    first = [bits(weights), bits(idx)]
    assert all([bits(o) for o in f(x, w, kw)] == first for _ in range(20))
    assert digest(x, w, kw) == before
