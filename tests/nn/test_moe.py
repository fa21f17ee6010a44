"""MoE and its Gate against DeepSeek's semantics (tests/nn/deepseek_reference.py, an independent
numpy statement of inference/model.py): the router with and without a bias, sigmoid and softmax;
the experts on stored FP8 weights (float32 and UE8M0 scales) in both layouts, dropless under any
routing; a capacity only when asked, with the dropped count; bf16 masters (training)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jax_dg  # noqa: E402
from jax_dg import nn  # noqa: E402
from tests.conftest import on_deep_gemm  # noqa: E402
from tests.nn import deepseek_reference as ref  # noqa: E402
from tests.nn.hlo import assert_fp8_weights_read_as_stored  # noqa: E402

HI = jax.lax.Precision.HIGHEST


def gate_args(m: nn.MoE) -> dict:
    g = m.gate
    return dict(weight=np.asarray(g.weight[...]), bias=None if g.bias is None else np.asarray(g.bias[...]),
                topk=g.topk, n_groups=g.n_groups, topk_groups=g.topk_groups, score_func=g.score_func,
                route_scale=g.route_scale, norm_topk_prob=g.norm_topk_prob)


def checkpoint_experts(m: nn.MoE):
    """Per expert (w1, w3, w2) as a DeepSeek checkpoint stores them: (FP8 [out, in], scales)."""
    i = m.inter_dim // 128
    w13, s13 = np.asarray(m.w13[...]), np.asarray(m.w13_scale_inv[...])
    w2, s2 = np.asarray(m.w2[...]), np.asarray(m.w2_scale_inv[...])
    return [((w13[e, :m.inter_dim], s13[e, :i]), (w13[e, m.inter_dim:], s13[e, i:]), (w2[e], s2[e]))
            for e in range(m.n_experts)]


def checkpoint_mlp(mlp: nn.MLP):
    n, i = mlp.inter_dim, mlp.inter_dim // 128
    w, s = np.asarray(mlp.w13.weight[...]), np.asarray(mlp.w13.weight_scale_inv[...])
    return (w[:n], s[:i]), (w[n:], s[i:]), (np.asarray(mlp.w2.weight[...]), np.asarray(mlp.w2.weight_scale_inv[...]))


def deepseek_moe(m: nn.MoE, x) -> np.ndarray:
    return ref.moe(np.asarray(x, np.float32), gate_args(m), checkpoint_experts(m),
                   None if m.shared is None else checkpoint_mlp(m.shared), m.scale_fmt)


# --- the gate -------------------------------------------------------------------------------------

@pytest.mark.parametrize("score_func, bias, groups", [
    ("sigmoid", True, (4, 2)),      # V3 / V3.2: a bias, groups scored by their best two
    ("sigmoid", False, (4, 2)),     # no bias: groups scored by their best one
    ("softmax", False, (4, 2)),     # V2-style softmax, group-limited by max, not normalised
    ("softmax", True, (1, 1)),
    ("sigmoid", True, (1, 1)),
])
def test_gate_routes_as_deepseeks(score_func, bias, groups):
    g = nn.Gate(256, 16, 4, n_groups=groups[0], topk_groups=groups[1], score_func=score_func,
                route_scale=2.5, bias=bias, rngs=nnx.Rngs(0))
    if bias:
        g.bias[...] = jax.random.normal(jax.random.PRNGKey(7), (16,), jnp.float32) * 0.5
    assert (g.bias is None) == (not bias) and g.norm_topk_prob == (score_func == "sigmoid")
    x = jax.random.normal(jax.random.PRNGKey(8), (128, 256), jnp.bfloat16)
    experts, weights = jax.jit(lambda x: g(x))(x)
    want_w, want_e = ref.gate(np.asarray(x, np.float32), np.asarray(g.weight[...]),
                              np.asarray(g.bias[...]) if bias else None, 4, groups[0], groups[1],
                              score_func, 2.5)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-6)
    if groups[0] > 1:
        assert all(len(set(e // 4)) <= 2 for e in np.asarray(experts))   # from 2 of 4 groups


def test_group_scores_differ_with_and_without_a_bias():
    """A token whose best group by its maximum is not its best group by its best two: the
    bias-less gate (max) and the biased one with a zero bias (top-2 sum) keep different groups."""
    g = nn.Gate(4, 4, 1, n_groups=2, topk_groups=1, bias=False, rngs=nnx.Rngs(0))
    gb = nn.Gate(4, 4, 1, n_groups=2, topk_groups=1, bias=True, rngs=nnx.Rngs(0))
    g.weight[...] = gb.weight[...] = jnp.eye(4)
    x = jnp.array([[3.0, -3.0, 1.0, 1.0]])      # group 0: max 0.95, sum 1.0; group 1: max 0.73, sum 1.46
    assert int(g(x)[0][0, 0]) == 0 and int(gb(x)[0][0, 0]) in (2, 3)


def test_gate_arguments_are_checked():
    with pytest.raises(ValueError, match="score_func"):
        nn.Gate(64, 8, 2, score_func="relu", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="n_groups"):
        nn.Gate(64, 8, 2, n_groups=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="topk"):
        nn.Gate(64, 8, 5, n_groups=4, topk_groups=2, rngs=nnx.Rngs(0))


# --- the experts on stored FP8 weights ----------------------------------------------------------

def make_moe(**kw):
    kw = {"n_groups": 4, "topk_groups": 2, "route_scale": 2.5, "fp8_weights": True, **kw}
    m = nn.MoE(256, 128, 16, 4, rngs=nnx.Rngs(0), **kw)
    if m.gate.bias is not None:
        m.gate.bias[...] = jax.random.normal(jax.random.PRNGKey(7), (16,), jnp.float32) * 0.1
    return m


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("scale_fmt, gate_bias, score_func", [
    (None, True, "sigmoid"), ("ue8m0", True, "sigmoid"), ("ue8m0", False, "softmax")])
def test_moe_on_stored_weights_is_deepseeks(layout, scale_fmt, gate_bias, score_func):
    m = make_moe(scale_fmt=scale_fmt, gate_bias=gate_bias, score_func=score_func)
    x = jax.random.normal(jax.random.PRNGKey(8), (96, 256), jnp.bfloat16)
    y = nnx.jit(lambda m, x: m(x, layout=layout))(m, x)
    assert y.shape == (96, 256) and y.dtype == jnp.bfloat16
    want = deepseek_moe(m, x)
    # The emulation's float32 GEMM sums round to the float64 oracle's bfloat16 outputs but for a
    # few, and the routed sum is float32 in another order than DeepSeek's expert loop (measured
    # 2.2e-16 to 3.2e-11). On DeepGEMM its tensor-core sums move some bfloat16 outputs by an
    # ulp: the target 1e-4.
    assert jax_dg.calc_diff(np.asarray(y, np.float32), want) < (1e-4 if on_deep_gemm() else 1e-9)


def test_skewed_routing_drops_nothing_unless_a_capacity_is_asked():
    """Every token's first choice is expert 0 (a bias of 10): 256 assignments to one expert,
    dropless in both layouts; with a capacity of 128 rows the masked layout drops 128 and says so."""
    m = make_moe(n_groups=1, topk_groups=1)
    m.gate.bias[...] = jnp.zeros((16,)).at[0].set(10.0)
    x = jax.random.normal(jax.random.PRNGKey(9), (256, 256), jnp.bfloat16)
    want = deepseek_moe(m, x)
    for layout in ("masked", "contiguous", "auto"):
        y, dropped = nnx.jit(lambda m, x: m(x, layout=layout, return_dropped=True))(m, x)
        assert int(dropped) == 0
        assert jax_dg.calc_diff(np.asarray(y, np.float32), want) < (1e-4 if on_deep_gemm() else 1e-9), layout
    assert m.capacity(256) == 256
    y, dropped = nnx.jit(lambda m, x: m(x, layout="masked", capacity=100))(m, x)   # rounded up to 128
    assert int(dropped) == 256 - 128
    assert jax_dg.calc_diff(np.asarray(y, np.float32), want) > 1e-3                # and it shows
    with pytest.raises(ValueError, match="capacity"):
        m(x, layout="contiguous", capacity=128)
    with pytest.raises(ValueError, match="layout"):
        m(x, layout="dense")


def test_auto_layout_takes_the_one_with_fewer_rows():
    stored = nn.MoE(256, 128, 64, 8, fp8_weights=True, rngs=nnx.Rngs(0))
    # 8 tokens x top-8 over 64 experts: 64 * 128 rows either way -> masked (DeepSeek's decode)
    assert stored.layout_for(8) == "masked"
    big = nn.MoE(256, 128, 256, 8, fp8_weights=True, rngs=nnx.Rngs(0))
    assert big.layout_for(8) == "contiguous"           # 256 * 128 masked rows vs 8192
    assert stored.layout_for(4096) == "contiguous"     # a prefill
    assert nn.MoE(256, 128, 64, 8, rngs=nnx.Rngs(0)).layout_for(4096) == "masked"   # masters: differentiable


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_stored_forward_is_the_master_forward_and_reads_the_weights_as_stored(layout):
    m = nn.MoE(256, 128, 8, 2, n_groups=4, topk_groups=2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (40, 256), jnp.bfloat16)
    master = nnx.jit(lambda m, x: m(x, layout=layout))(m, x)
    nn.quantize(m)
    assert m.stored_fp8 and m.shared.w13.stored_fp8 and m.w13[...].dtype == jnp.float8_e4m3fn
    assert m.w13_scale_inv[...].shape == (8, 2, 2) and m.w2_scale_inv[...].shape == (8, 2, 1)
    stored = nnx.jit(lambda m, x: m(x, layout=layout))(m, x)
    # the same FP8 values and scales, the same casts of x and of the SwiGLU: bitwise
    np.testing.assert_array_equal(np.asarray(stored, np.float32), np.asarray(master, np.float32))
    graph, state = nnx.split(m)
    assert_fp8_weights_read_as_stored(lambda s, x: nnx.merge(graph, s)(x, layout=layout), state, x)
    nn.dequantize(m)
    assert not m.stored_fp8 and m.w13[...].dtype == jnp.bfloat16 and m.w13_scale_inv is None


# --- bf16 masters: training -------------------------------------------------------------------------

def dense_moe(m, x):
    """The same MoE computed densely in float32 (every chosen expert on its token, no FP8; the
    SwiGLU activations rounded to bfloat16 as the layer hands them to its second GEMM)."""
    bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    experts, weights = m.route(x)
    xf = x.astype(jnp.float32)
    h = jnp.einsum("td,tkfd->tkf", xf, m.w13[...].astype(jnp.float32)[experts], precision=HI)
    g, u = jnp.split(h, 2, axis=-1)
    y = jnp.einsum("tkf,tkdf->tkd", bf16(jax.nn.silu(g) * u), m.w2[...].astype(jnp.float32)[experts],
                   precision=HI)
    y = (y * weights[..., None]).sum(1)
    s = jnp.matmul(xf, m.shared.w13.kernel[...].astype(jnp.float32), precision=HI)
    g, u = jnp.split(s, 2, axis=-1)
    return y + jnp.matmul(bf16(jax.nn.silu(g) * u), m.shared.w2.kernel[...].astype(jnp.float32), precision=HI)


def test_init_scales():
    m = nn.MoE(256, 128, 64, 2, rngs=nnx.Rngs(0))
    assert abs(float(jnp.std(m.w13[...].astype(jnp.float32))) - 256 ** -0.5) < 0.1 * 256 ** -0.5
    assert abs(float(jnp.std(m.w2[...].astype(jnp.float32))) - 128 ** -0.5) < 0.1 * 128 ** -0.5


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_masters_match_the_dense_math_and_the_reference(layout):
    m = nn.MoE(256, 128, 8, 2, n_groups=4, topk_groups=2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (96, 256), jnp.bfloat16)
    experts, weights = m.route(x)
    assert experts.shape == (96, 2) and np.allclose(np.asarray(weights).sum(1), 1.0, atol=1e-6)
    y = nnx.jit(lambda m, x: m(x, layout=layout))(m, x)
    assert y.shape == (96, 256) and y.dtype == jnp.bfloat16
    # One FP8 GEMM here is ~6.6e-4 from exact (fp8_linear at K 128/256, measured); SwiGLU's
    # product doubles the first one's, the second adds its own: ~2e-3 expected.
    assert jax_dg.calc_diff(y, dense_moe(m, x)) < 3e-3
    with jax_dg.use_backend("xla"):
        want = nnx.jit(lambda m, x: m(x, layout=layout))(m, x)
    # the same recipe: exact but for summation order on the emulation; DeepGEMM's FP8
    # tensor-core sums differ in the last bits and the FP8 cast between the GEMMs turns some into
    # one-ulp (6%) steps (measured 9.4e-4 / 1.2e-3 on the H200): the bound against exact math
    assert jax_dg.calc_diff(y, want) < (3e-3 if on_deep_gemm() else 1e-5)


def test_masked_masters_are_differentiable():
    m = nn.MoE(256, 128, 8, 2, n_groups=4, topk_groups=2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(4), (64, 256), jnp.bfloat16)

    def loss(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)
    grads = nnx.grad(loss)(m, x)
    exact = nnx.grad(lambda m, x: jnp.mean(dense_moe(m, x) ** 2))(m, x)
    for name in ("w13", "w2"):
        g, e = getattr(grads, name)[...], getattr(exact, name)[...]
        assert g.shape == e.shape and jax_dg.calc_diff(g, e) < 2e-2, name   # FP8 backward vs exact
    assert jax_dg.calc_diff(grads.gate.weight[...], exact.gate.weight[...]) < 2e-2


def test_from_config():
    from tests.nn.checkpoints import HF_V32_CONFIG
    cfg = nn.load_config({**HF_V32_CONFIG, "hidden_size": 256, "moe_intermediate_size": 128,
                          "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4})
    m = nnx.eval_shape(lambda: nn.MoE.from_config(cfg, rngs=nnx.Rngs(0)))
    assert m.stored_fp8 and m.use_ue8m0 and m.gate.bias is not None and m.gate.route_scale == 2.5
    assert m.w13.shape == (16, 256, 256) and m.w13_scale_inv.shape == (16, 2, 2)
    assert m.shared.w13.weight.shape == (256, 256)


# --- GPU: stored FP8 experts on DeepGEMM ------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def gpu_moe():
    return nn.MoE(2048, 512, 64, 8, n_groups=8, topk_groups=4, route_scale=2.5, fp8_weights=True,
                  scale_fmt="ue8m0", rngs=nnx.Rngs(0))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, layout, skewed", [
    (8, "auto", False), (8, "masked", True), (8, "contiguous", False),
    (256, "auto", True), (256, "masked", False), (256, "contiguous", True)])
def test_gpu_stored_moe_is_deepseeks(tokens, layout, skewed):
    """DeepSeek's routing (64 experts, 8 groups, top-4 groups, top-8, a bias) at dim 2048 / inter
    512 with UE8M0 scales, decode and prefill sizes, even and skewed routing (every token's first
    choice expert 0): dropless, calc_diff <= 1e-4 against DeepSeek's model.py math (the issue's
    target), the weights read only by DeepGEMM's grouped GEMMs."""
    m = gpu_moe()
    m.gate.bias[...] = (jnp.zeros((64,)).at[0].set(10.0) if skewed
                        else jax.random.normal(jax.random.PRNGKey(7), (64,), jnp.float32) * 0.1)
    x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, 2048), jnp.bfloat16)
    y, dropped = nnx.jit(lambda m, x: m(x, layout=layout, return_dropped=True))(m, x)
    assert int(dropped) == 0
    assert jax_dg.calc_diff(np.asarray(y, np.float32), deepseek_moe(m, x)) < 1e-4
    graph, state = nnx.split(m)
    assert_fp8_weights_read_as_stored(lambda s, x: nnx.merge(graph, s)(x, layout=layout), state, x)
