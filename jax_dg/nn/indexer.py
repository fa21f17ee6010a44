"""LightningIndexer: DeepSeek V3.2's sparse-attention indexer as an NNX module on jax_dg.

Per query token t and cached key s the indexer scores  I(t, s) = sum_h w(t, h) * ReLU(q(t, h) . k(s))
with H small heads sharing one key, and keeps each query's top-k keys for the sparse attention.
Prefill scores a sequence against itself (causal) with `jax_dg.indexer_topk`; decode scores one
new token per sequence against a paged FP8 key cache with `jax_dg.paged_indexer_topk`, after
writing the token's key into the cache (`jax_dg.paged.update_kv_cache`).

As DeepSeek V3.2's reference (inference/model.py, `Indexer`): q from the attention's compressed
query (q_lora_rank) through wq_b, k from the hidden state through wk and a LayerNorm; RoPE on the
first rope_head_dim dimensions of both (non-interleaved, as V3.2's indexer); a Hadamard rotation
of both before the FP8 cast; q cast per (token, head), its scale folded into the head weights
with H^-1/2 and D^-1/2; k cast per token. Simplified here, and why: RoPE has one base and no
YaRN scaling (the scores' ranking, not the context extension, is what this module is about);
the casts use float32 scales, DeepGEMM's SM90 contract (V3.2 can use UE8M0 ones, and SM100's
kernels want MX scales: not handled here); wq_b and wk are FP8Linear, weights_proj stays bf16.
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dg.nn.linear import FP8Linear
from jax_dg.operands import paged
from jax_dg.operands.indexer import causal_ks_ke, fold_q_scale, per_row_cast_to_fp8
from jax_dg.ops.topk import indexer_topk, paged_indexer_topk


class IndexerCache(tp.NamedTuple):
    """A batch of sequences' indexer keys in DeepGEMM's paged FP8 layout (a pytree).

    kv_cache      uint8 [num_blocks, block_size, 1, head_dim + 4] (jax_dg.paged's layout)
    block_tables  int32 [B, max_blocks]: sequence b's logical block j is physical block [b, j]
    context_lens  int32 [B]: tokens cached per sequence
    """
    kv_cache: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def max_len(self) -> int:
        return self.block_tables.shape[1] * self.block_size


@functools.lru_cache(maxsize=4)
def _hadamard(d: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order d (a power of two), scaled to be orthonormal: a
    constant of the trace, not module state."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def _rope(x: jax.Array, positions: jax.Array, dims: int, theta: float) -> jax.Array:
    """Rotate-half RoPE on the first `dims` features of x [..., T, (H,) D] at positions [T]."""
    half = dims // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freqs                     # [T, half]
    if x.ndim == 3:                                                             # [T, H, D]
        angle = angle[:, None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32)
    a, b = xf[..., :half], xf[..., half:dims]
    rotated = jnp.concatenate([a * cos - b * sin, a * sin + b * cos, xf[..., dims:]], axis=-1)
    return rotated.astype(x.dtype)


class LightningIndexer(nnx.Module):
    """DeepSeek V3.2's lightning indexer (see the module doc).

    dim: the hidden size; q_lora_rank: the attention's compressed query size; n_heads x
    head_dim FP8 heads (prefill: 16, 32 or 64 heads of 64 or 128; decode: 32 or 64 heads of
    128, DeepGEMM's paged kernel on SM90); topk keys kept per query. Input rows are tokens:
    x [T, dim] (2-D).
    """

    def __init__(self, dim: int, q_lora_rank: int, *, n_heads: int = 64, head_dim: int = 128,
                 rope_head_dim: int = 64, topk: int = 2048, rope_theta: float = 10000.0,
                 param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
        if head_dim & (head_dim - 1):
            raise ValueError(f"LightningIndexer: `head_dim` must be a power of two (the Hadamard "
                             f"rotation), got {head_dim}")
        self.n_heads, self.head_dim, self.rope_head_dim = n_heads, head_dim, rope_head_dim
        self.topk, self.rope_theta = topk, rope_theta
        self.wq_b = FP8Linear(q_lora_rank, n_heads * head_dim, param_dtype=param_dtype, rngs=rngs)
        self.wk = FP8Linear(dim, head_dim, param_dtype=param_dtype, rngs=rngs)
        self.k_norm = nnx.LayerNorm(head_dim, param_dtype=jnp.float32, rngs=rngs)
        # float32 glue at full precision, as torch computes it (XLA's default on GPU is TF32)
        self.weights_proj = nnx.Linear(dim, n_heads, use_bias=False, param_dtype=param_dtype,
                                       precision=jax.lax.Precision.HIGHEST, rngs=rngs)

    def _rotate(self, x: jax.Array) -> jax.Array:
        return jnp.matmul(x.astype(jnp.float32), _hadamard(self.head_dim),
                          precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """bfloat16 [T, head_dim]: the keys of tokens x [T, dim] at positions [T] (unquantised)."""
        k = self.k_norm(self.wk(x).astype(jnp.float32)).astype(jnp.bfloat16)
        return self._rotate(_rope(k, positions, self.rope_head_dim, self.rope_theta))

    def queries(self, x: jax.Array, qr: jax.Array, positions: jax.Array):
        """(FP8 q [T, H, D] without its scale, float32 head weights [T, H] with the q scale,
        H^-1/2 and D^-1/2 folded in) of tokens x [T, dim] with compressed queries qr [T, q_lora_rank]."""
        t = x.shape[0]
        q = self.wq_b(qr).reshape(t, self.n_heads, self.head_dim)
        q = self._rotate(_rope(q, positions, self.rope_head_dim, self.rope_theta))
        q_fp8, q_scale = per_row_cast_to_fp8(q.reshape(t * self.n_heads, self.head_dim))
        w = self.weights_proj(x).astype(jnp.float32) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        return (q_fp8.reshape(t, self.n_heads, self.head_dim),
                fold_q_scale(w, q_scale.reshape(t, self.n_heads)))

    def prefill(self, x: jax.Array, qr: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One sequence of T tokens, causal: (int32 [T, topk] key positions per query, best
        first, -1 past its t + 1 keys; the keys [T, head_dim] for the caller's cache)."""
        t = x.shape[0]
        positions = jnp.arange(t, dtype=jnp.int32)
        k = self.keys(x, positions)
        q, w = self.queries(x, qr, positions)
        ks, ke = causal_ks_ke(t, t)
        return indexer_topk((q, None), per_row_cast_to_fp8(k), w, ks, ke, self.topk), k

    def decode(self, x: jax.Array, qr: jax.Array, cache: IndexerCache) -> tuple[jax.Array, IndexerCache]:
        """One new token per sequence (x [B, dim], qr [B, q_lora_rank]) at position
        cache.context_lens: its key written into the cache, then (int32 [B, topk] cached token
        positions per sequence, best first, -1 past its length; the updated cache). The block
        tables must name a block of the sequence's own for that position (jax_dg.paged's
        build_block_tables fills unused entries with block 0); a sequence at max_len takes no
        new key and keeps its length."""
        b = x.shape[0]
        pos = cache.context_lens
        # A sequence whose table is full takes no new token (its slot would wrap into another
        # sequence's block): its key is not written and its length stays.
        room = pos < cache.max_len
        block = jnp.take_along_axis(cache.block_tables, jnp.minimum(pos // cache.block_size,
                                    cache.block_tables.shape[1] - 1)[:, None], axis=1)[:, 0]
        slots = jnp.where(room, block * cache.block_size + pos % cache.block_size, -1)
        kv_cache = paged.update_kv_cache(cache.kv_cache, self.keys(x, pos), slots)
        lens = jnp.where(room, pos + 1, pos)
        q, w = self.queries(x, qr, pos)
        idx = paged_indexer_topk((q.reshape(b, 1, self.n_heads, self.head_dim), None), kv_cache, w,
                                 lens, cache.block_tables, self.topk, max_model_len=cache.max_len)
        return idx, IndexerCache(kv_cache, cache.block_tables, lens)
