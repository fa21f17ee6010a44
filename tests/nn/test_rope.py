"""jax_dg.nn.rope: DeepSeek V3.2's YaRN frequencies, softmax scale and both rotary layouts against
an independent numpy (float64) statement of the formulas."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax.nnx")

from jax_dg.nn.rope import RoPE, apply_rotary_emb, precompute_freqs_cis  # noqa: E402

# DeepSeek V3.2 as shipped (config.json's rope_scaling; max_position_embeddings 163840)
V32 = RoPE(dim=64, theta=10000.0, max_seq_len=163840, original_seq_len=4096, factor=40.0,
           beta_fast=32, beta_slow=1, mscale=1.0)


def yarn_reference(dim, theta, max_seq_len, original, factor, beta_fast, beta_slow):
    """float64 inverse frequencies from YaRN's definition: pair i turns L / (2 pi theta^(2i/d))
    times over the original length L; the pairs up to the dimension that turns beta_fast times
    keep their frequency, those from the one that turns beta_slow times take 1/factor of it,
    a linear ramp (over whole dimensions: floor and ceil, clamped) in between."""
    i = np.arange(dim // 2, dtype=np.float64)
    base = theta ** (-2 * i / dim)
    if max_seq_len <= original:
        return base
    # the dimension d at which L / (2 pi theta^(d/dim)) = rotations, solved for d
    at = lambda rotations: dim * np.log(original / (2 * np.pi * rotations)) / (2 * np.log(theta))  # noqa: E731
    lo, hi = max(math.floor(at(beta_fast)), 0), min(math.ceil(at(beta_slow)), dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    interpolated = np.clip((i - lo) / (hi - lo), 0, 1)     # 0: keep, 1: divide by factor
    return base * (1 - interpolated) + base / factor * interpolated


def rotate_reference(x, angles, interleaved):
    """x [..., D] float64, angles [..., D/2] broadcast against it: each pair as a complex number
    times e^(i angle)."""
    d = x.shape[-1]
    if interleaved:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : d // 2] + 1j * x[..., d // 2:]
    z = z * np.exp(1j * angles)
    if interleaved:
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    return np.concatenate([z.real, z.imag], -1)


def test_plain_frequencies_without_yarn():
    rope = RoPE(dim=64, max_seq_len=4096, original_seq_len=4096)
    assert not rope.yarn and rope.attention_scale() == 1.0
    assert rope.inv_freq().dtype == np.float32
    np.testing.assert_allclose(rope.inv_freq(), yarn_reference(64, 1e4, 4096, 4096, 40, 32, 1), rtol=1e-6)
    assert rope.softmax_scale(192) == 192 ** -0.5


@pytest.mark.parametrize("rope", [V32, RoPE(dim=64, theta=50000.0, max_seq_len=32768, original_seq_len=8192,
                                            factor=4.0, beta_fast=16, beta_slow=2, mscale=0.707),
                                  RoPE(dim=16, max_seq_len=8192, original_seq_len=4096, factor=2.0)])
def test_yarn_frequencies_and_softmax_scale(rope):
    assert rope.yarn
    want = yarn_reference(rope.dim, rope.theta, rope.max_seq_len, rope.original_seq_len, rope.factor,
                          rope.beta_fast, rope.beta_slow)
    np.testing.assert_allclose(rope.inv_freq(), want, rtol=2e-6)
    m = 0.1 * rope.mscale * math.log(rope.factor) + 1
    assert rope.softmax_scale(192) == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)


def test_v32_correction_range():
    """At V3.2's shipped values the first 10 pairs keep their frequency and pairs 23 on are
    divided by 40."""
    assert V32.correction_range() == (10, 23)
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    inv = V32.inv_freq()
    np.testing.assert_allclose(inv[:11], base[:11], rtol=1e-6)
    np.testing.assert_allclose(inv[23:], base[23:] / 40, rtol=1e-6)
    assert (inv[11:23] < base[11:23]).all() and (inv[11:23] > base[11:23] / 40).all()


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_against_the_reference(interleaved):
    t, h, d = 24, 3, 64
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (t, h, d), jnp.float32))
    positions = np.concatenate([np.arange(12), [4095, 4096, 9000, 65535, 100000, 163839], np.arange(6) * 777])
    got = np.asarray(jax.jit(lambda x, p: V32(x, p, interleaved=interleaved))(x, positions.astype(np.int32)))
    # DeepSeek's angles are float32 products of float32 positions and frequencies
    angles = (positions.astype(np.float32)[:, None] * V32.inv_freq()).astype(np.float64)
    want = rotate_reference(x.astype(np.float64), angles[:, None, :], interleaved)
    # float32 cos/sin and products (measured 2.7e-7 on the CPU)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


def test_the_two_layouts_are_one_rotation_of_permuted_features():
    """Non-interleaved RoPE is interleaved RoPE on features reordered (i, i + D/2) -> (2i, 2i + 1)."""
    x = jax.random.normal(jax.random.PRNGKey(1), (10, 64), jnp.float32)
    pos = jnp.arange(10) * 300
    perm = np.stack([np.arange(32), np.arange(32) + 32], -1).reshape(-1)   # interleaved slot -> feature
    inverse = np.argsort(perm)
    via_interleaved = V32(x[:, perm], pos, interleaved=True)[:, inverse]
    np.testing.assert_allclose(np.asarray(V32(x, pos, interleaved=False)), np.asarray(via_interleaved), atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_scores_depend_on_the_distance_only(interleaved):
    q = jax.random.normal(jax.random.PRNGKey(2), (64,), jnp.float32)
    k = jax.random.normal(jax.random.PRNGKey(3), (64,), jnp.float32)

    def score(m, n):
        return float(jnp.dot(V32(q[None], jnp.array([m]), interleaved=interleaved)[0],
                             V32(k[None], jnp.array([n]), interleaved=interleaved)[0]))
    assert score(50, 20) == pytest.approx(score(1030, 1000), abs=1e-4)
    assert score(7, 7) == pytest.approx(float(jnp.dot(q, k)), abs=1e-4)


def test_dtype_axes_and_table():
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 5, 4, 64), jnp.bfloat16)      # [B, S, H, D]
    pos = jnp.array([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    y = V32(x, pos)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    table = precompute_freqs_cis(RoPE(dim=64, max_seq_len=64))
    assert table.shape == (64, 32) and table.dtype == jnp.complex64
    # a row of DeepSeek's table is freqs_cis at that position; keys without a head axis
    k = x[0, :, 0]
    np.testing.assert_array_equal(np.asarray(apply_rotary_emb(k, table[:5])),
                                  np.asarray(RoPE(dim=64, max_seq_len=64)(k, jnp.arange(5))))
    # vmap over sequences (decode: one position per row)
    per_row = jax.vmap(lambda x, p: V32(x, p))(x, pos)
    np.testing.assert_array_equal(np.asarray(per_row), np.asarray(y))


def test_bad_arguments_name_the_rule():
    with pytest.raises(ValueError, match="`dim` must be a positive even"):
        RoPE(dim=63)
    with pytest.raises(ValueError, match="`factor`"):
        RoPE(dim=64, max_seq_len=8192, original_seq_len=4096, factor=0.0)
    with pytest.raises(ValueError, match="last axis"):
        apply_rotary_emb(jnp.zeros((4, 64)), jnp.zeros((4, 16), jnp.complex64))
    with pytest.raises(ValueError, match="leading axes"):
        apply_rotary_emb(jnp.zeros((4, 2, 64)), jnp.zeros((3, 32), jnp.complex64))
    assert hash(V32) == hash(RoPE(**{f: getattr(V32, f) for f in V32.__dataclass_fields__}))
