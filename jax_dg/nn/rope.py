"""Rotary position embeddings with YaRN, as DeepSeek V3.2 computes them (inference/model.py:
`precompute_freqs_cis`, `apply_rotary_emb`, and MLA's softmax scale).

The frequencies of a head's `dim` rotary features are theta^(-2i/dim), i < dim/2. When the model
serves longer sequences than it was trained on (max_seq_len > original_seq_len) YaRN rescales
them: the dimensions that turn fewer than beta_slow times over original_seq_len tokens are
divided by `factor`, those that turn more than beta_fast times keep theirs, and a linear ramp
between the two correction dimensions blends the two; the attention's softmax scale is then
multiplied by (0.1 * mscale * ln(factor) + 1)^2. DeepSeek computes all of it in float32, the
angles as position * frequency; so does this module, at the positions asked for (no table of
max_seq_len rows as a constant of the trace).

Two layouts of the rotated pairs, both DeepSeek's: `interleaved=True` pairs features (2i, 2i+1)
(MLA's q_pe and k_pe); `interleaved=False` pairs (i, i + dim/2) (V3.2's indexer: DeepSeek's
November 2025 fix of its inference code).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RoPE:
    """DeepSeek V3.2's rotary embedding of `dim` features (qk_rope_head_dim), with its YaRN
    parameters under DeepSeek's ModelArgs names (Hugging Face's config.json: rope_theta and
    rope_scaling's factor, original_max_position_embeddings, beta_fast, beta_slow, mscale).

    YaRN applies when max_seq_len > original_seq_len (`yarn`); otherwise the plain frequencies.
    Hashable: a static attribute of an nnx.Module and of a jit.
    """
    dim: int = 64
    theta: float = 10000.0
    max_seq_len: int = 4096
    original_seq_len: int = 4096
    factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0

    def __post_init__(self):
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RoPE: `dim` must be a positive even number (rotated pairs), got {self.dim}")
        if not self.theta > 1:
            raise ValueError(f"RoPE: `theta` must be > 1, got {self.theta}")
        if self.max_seq_len <= 0 or self.original_seq_len <= 0:
            raise ValueError(f"RoPE: `max_seq_len` and `original_seq_len` must be positive, got "
                             f"{self.max_seq_len} and {self.original_seq_len}")
        if self.yarn and not (self.factor > 0 and self.beta_fast > 0 and self.beta_slow > 0):
            raise ValueError(f"RoPE: with YaRN (max_seq_len > original_seq_len) `factor`, `beta_fast` "
                             f"and `beta_slow` must be positive, got {self.factor}, {self.beta_fast}, "
                             f"{self.beta_slow}")

    @property
    def yarn(self) -> bool:
        """Whether the frequencies and the softmax scale are YaRN's (max_seq_len > original_seq_len)."""
        return self.max_seq_len > self.original_seq_len

    def inv_freq(self) -> np.ndarray:
        """float32 [dim / 2]: the rotation per position of each pair (radians), in float32 steps
        as DeepSeek's (a constant of the trace)."""
        f32 = np.float32
        freqs = f32(1.0) / np.power(f32(self.theta), np.arange(0, self.dim, 2, dtype=f32) / f32(self.dim))
        if not self.yarn:
            return freqs
        low, high = self.correction_range()
        if low == high:    # DeepSeek's guard: a ramp of one step
            high += 0.001
        ramp = np.clip((np.arange(self.dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
        smooth = f32(1) - ramp
        return (freqs / f32(self.factor) * (f32(1) - smooth) + freqs * smooth).astype(f32)

    def correction_range(self) -> tuple[int, int]:
        """YaRN's (low, high) correction dimensions: the pairs that turn beta_fast times and
        beta_slow times over original_seq_len positions, clamped to [0, dim - 1]."""
        def dim_of(rotations):
            return self.dim * math.log(self.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))
        low, high = math.floor(dim_of(self.beta_fast)), math.ceil(dim_of(self.beta_slow))
        return max(low, 0), min(high, self.dim - 1)

    def attention_scale(self) -> float:
        """The factor YaRN puts on the attention's softmax scale: mscale'^2 with
        mscale' = 0.1 * mscale * ln(factor) + 1 (1.0 without YaRN)."""
        if not self.yarn:
            return 1.0
        m = 0.1 * self.mscale * math.log(self.factor) + 1.0
        return m * m

    def softmax_scale(self, head_dim: int) -> float:
        """MLA's softmax scale for q.k over `head_dim` features (qk_nope + qk_rope):
        head_dim^-1/2, times attention_scale() under YaRN."""
        return head_dim ** -0.5 * self.attention_scale()

    def freqs_cis(self, positions: jax.Array) -> jax.Array:
        """complex64 [..., dim / 2]: e^(i * position * inv_freq) at int positions [...]."""
        angle = jnp.asarray(positions).astype(jnp.float32)[..., None] * self.inv_freq()
        return jax.lax.complex(jnp.cos(angle), jnp.sin(angle))

    def __call__(self, x: jax.Array, positions: jax.Array, *, interleaved: bool = True) -> jax.Array:
        """x [T, ..., dim] rotated at positions [T] (see apply_rotary_emb for the axes)."""
        return apply_rotary_emb(x, self.freqs_cis(positions), interleaved=interleaved)


def precompute_freqs_cis(rope: RoPE) -> jax.Array:
    """complex64 [max_seq_len, dim / 2]: DeepSeek's table, row t = rope.freqs_cis(t)."""
    return rope.freqs_cis(jnp.arange(rope.max_seq_len, dtype=jnp.int32))


def apply_rotary_emb(x: jax.Array, freqs_cis: jax.Array, *, interleaved: bool = True) -> jax.Array:
    """x [..., D] rotated by freqs_cis (complex [..., D / 2]), in float32, returned in x's dtype.

    freqs_cis's leading axes are x's leading axes (those that hold positions, e.g. [T] or
    [B, S]); x's axes between them and the last are broadcast (heads): x [T, H, D] or [T, D]
    with freqs_cis [T, D / 2]. interleaved: pairs (2i, 2i + 1) (MLA), else (i, i + D / 2) (the
    V3.2 indexer).
    """
    d = x.shape[-1]
    if freqs_cis.ndim < 1 or 2 * freqs_cis.shape[-1] != d:
        raise ValueError(f"apply_rotary_emb: `x`'s last axis ({d}) must be twice `freqs_cis`'s "
                         f"({freqs_cis.shape[-1] if freqs_cis.ndim else None})")
    lead = freqs_cis.ndim - 1
    if lead > x.ndim - 1 or any(f not in (1, s) for f, s in zip(freqs_cis.shape[:-1], x.shape[:lead])):
        raise ValueError(f"apply_rotary_emb: `freqs_cis` {freqs_cis.shape} must match `x` {x.shape} "
                         f"on its leading axes (positions), with x's head axes after them")
    f = freqs_cis.reshape(freqs_cis.shape[:-1] + (1,) * (x.ndim - 1 - lead) + (d // 2,))
    cos, sin = jnp.real(f).astype(jnp.float32), jnp.imag(f).astype(jnp.float32)
    xf = x.astype(jnp.float32)
    if interleaved:
        pairs = xf.reshape(x.shape[:-1] + (d // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2:]
    re, im = a * cos - b * sin, a * sin + b * cos
    out = jnp.stack([re, im], -1).reshape(x.shape) if interleaved else jnp.concatenate([re, im], -1)
    return out.astype(x.dtype)
