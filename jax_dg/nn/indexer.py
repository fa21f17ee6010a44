"""LightningIndexer: DeepSeek V3.2's sparse-attention indexer as an NNX module on jax_dg.

Per query token t and cached key s the indexer scores  I(t, s) = sum_h w(t, h) * ReLU(q(t, h) . k(s))
with H small heads sharing one key, and keeps each query's top-k keys for the sparse attention.
Prefill scores a sequence against itself (causal) with `jax_dg.indexer_topk`; decode scores one
new token per sequence against a paged FP8 key cache with `jax_dg.paged_indexer_topk`, after
writing the token's key into the cache (`jax_dg.paged.update_kv_cache`).

As DeepSeek V3.2's inference code (inference/model.py, `Indexer`, with its November 2025 RoPE
fix): q from the attention's compressed query (q_lora_rank) through wq_b, k from the hidden
state through wk and a LayerNorm; RoPE (jax_dg.nn.rope, YaRN as the configuration says) on the
first rope.dim features of both, pairs (i, i + dim/2) (not interleaved, unlike MLA's); a
Hadamard rotation of both; q cast to FP8 per (token, head), k per token, both with UE8M0
(power-of-two) scales when scale_fmt is "ue8m0"; the head weights weights_proj(x) in float32
(DeepSeek holds that bf16 checkpoint tensor as float32), times H^-1/2, times q's scale (folded
in: SM90's kernel takes no q scale; exact with power-of-two scales), times D^-1/2. wq_b and wk
are FP8Linear (bf16 masters or the checkpoint's FP8 weights), weights_proj stays bf16 as stored.
One difference remains, and why: the keys' scales are DeepGEMM's paged layout (one float32 per
token, SM90's), not SM100's packed MX scales.
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dg.nn.linear import FP8Linear, check_scale_fmt
from jax_dg.nn.rope import RoPE
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


class LightningIndexer(nnx.Module):
    """DeepSeek V3.2's lightning indexer (see the module doc).

    dim: the hidden size; q_lora_rank: the attention's compressed query size; n_heads x
    head_dim FP8 heads (prefill: 16, 32 or 64 heads of 64 or 128; decode: 32 or 64 heads of
    128, DeepGEMM's paged kernel on SM90); topk keys kept per query; rope: the rotary embedding
    (its dim rotated features, YaRN as it says; default plain RoPE of 64 features, theta 1e4);
    scale_fmt "ue8m0": power-of-two scales on q's and k's FP8 casts (the cache's too);
    fp8_weights: wq_b and wk hold FP8 weights as a checkpoint stores them. Input rows are
    tokens: x [T, dim] (2-D).
    """

    def __init__(self, dim: int, q_lora_rank: int, *, n_heads: int = 64, head_dim: int = 128,
                 topk: int = 2048, rope: RoPE | None = None, scale_fmt: str | None = None,
                 fp8_weights: bool = False, param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
        rope = RoPE(dim=64) if rope is None else rope
        if head_dim & (head_dim - 1):
            raise ValueError(f"LightningIndexer: `head_dim` must be a power of two (the Hadamard "
                             f"rotation), got {head_dim}")
        if rope.dim > head_dim:
            raise ValueError(f"LightningIndexer: `rope` rotates {rope.dim} features, more than "
                             f"`head_dim` = {head_dim}")
        self.n_heads, self.head_dim, self.topk, self.rope = n_heads, head_dim, topk, rope
        self.use_ue8m0 = check_scale_fmt(scale_fmt, "LightningIndexer")
        lin = dict(fp8_weights=fp8_weights, scale_fmt=scale_fmt, param_dtype=param_dtype, rngs=rngs)
        self.wq_b = FP8Linear(q_lora_rank, n_heads * head_dim, **lin)
        self.wk = FP8Linear(dim, head_dim, **lin)
        self.k_norm = nnx.LayerNorm(head_dim, epsilon=1e-6, param_dtype=jnp.float32, rngs=rngs)
        # the checkpoint's bf16 weight, computed in float32 at full precision as DeepSeek's
        # (XLA's GPU default for float32 is TF32)
        self.weights_proj = nnx.Linear(dim, n_heads, use_bias=False, dtype=jnp.float32, param_dtype=param_dtype,
                                       precision=jax.lax.Precision.HIGHEST, rngs=rngs)

    @classmethod
    def from_config(cls, cfg, *, rngs: nnx.Rngs, fp8_weights: bool | None = None,
                    param_dtype=jnp.bfloat16) -> LightningIndexer:
        """The indexer of a DeepSeek-V3.2 configuration (jax_dg.nn.config): its heads, top-k, the
        shared RoPE, scale_fmt; fp8_weights defaults to whether the checkpoint stores FP8 weights."""
        return cls(cfg.hidden_size, cfg.q_lora_rank, n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim,
                   topk=cfg.index_topk, rope=cfg.rope, scale_fmt=cfg.scale_fmt,
                   fp8_weights=cfg.fp8_weights if fp8_weights is None else fp8_weights,
                   param_dtype=param_dtype, rngs=rngs)

    def _rotate(self, x: jax.Array) -> jax.Array:
        return jnp.matmul(x.astype(jnp.float32), _hadamard(self.head_dim),
                          precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the first rope.dim features of x [T, (H,) head_dim], pairs (i, i + dim/2)."""
        d = self.rope.dim
        return jnp.concatenate([self.rope(x[..., :d], positions, interleaved=False), x[..., d:]], axis=-1)

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """bfloat16 [T, head_dim]: the keys of tokens x [T, dim] at positions [T] (unquantised)."""
        k = self.k_norm(self.wk(x).astype(jnp.float32)).astype(jnp.bfloat16)
        return self._rotate(self._rope(k, positions))

    def cast_keys(self, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys [T, head_dim] -> (FP8 values, float32 scale per key), as the cache stores them."""
        return per_row_cast_to_fp8(k, use_ue8m0=self.use_ue8m0)

    def queries(self, x: jax.Array, qr: jax.Array, positions: jax.Array):
        """(FP8 q [T, H, D] without its scale, float32 head weights [T, H] with the q scale,
        H^-1/2 and D^-1/2 folded in) of tokens x [T, dim] with compressed queries qr [T, q_lora_rank]."""
        t = x.shape[0]
        q = self.wq_b(qr).reshape(t, self.n_heads, self.head_dim)
        q = self._rotate(self._rope(q, positions))
        q_fp8, q_scale = per_row_cast_to_fp8(q.reshape(t * self.n_heads, self.head_dim), use_ue8m0=self.use_ue8m0)
        w = self.weights_proj(x) * jnp.float32(self.n_heads ** -0.5)     # DeepSeek's order of products
        w = fold_q_scale(w, q_scale.reshape(t, self.n_heads)) * jnp.float32(self.head_dim ** -0.5)
        return q_fp8.reshape(t, self.n_heads, self.head_dim), w

    def prefill(self, x: jax.Array, qr: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One sequence of T tokens, causal: (int32 [T, topk] key positions per query, best
        first, -1 past its t + 1 keys; the keys [T, head_dim] for the caller's cache)."""
        t = x.shape[0]
        positions = jnp.arange(t, dtype=jnp.int32)
        k = self.keys(x, positions)
        q, w = self.queries(x, qr, positions)
        ks, ke = causal_ks_ke(t, t)
        return indexer_topk((q, None), self.cast_keys(k), w, ks, ke, self.topk), k

    def decode(self, x: jax.Array, qr: jax.Array, cache: IndexerCache) -> tuple[jax.Array, IndexerCache]:
        """One new token per sequence (x [B, dim], qr [B, q_lora_rank]) at position
        cache.context_lens: its key written into the cache, then (int32 [B, topk] cached token
        positions per sequence, best first, -1 past its length; the updated cache). The block
        tables must name a block of the sequence's own for that position (jax_dg.paged's
        build_block_tables fills unused entries with block 0); a sequence at max_len takes no
        new key and keeps its length."""
        b = x.shape[0]
        pos = cache.context_lens
        slots, lens = paged.decode_slots(cache.block_tables, pos, cache.block_size)
        kv_cache = paged.update_kv_cache(cache.kv_cache, self.keys(x, pos), slots, use_ue8m0=self.use_ue8m0)
        q, w = self.queries(x, qr, pos)
        idx = paged_indexer_topk((q.reshape(b, 1, self.n_heads, self.head_dim), None), kv_cache, w,
                                 lens, cache.block_tables, self.topk, max_model_len=cache.max_len)
        return idx, IndexerCache(kv_cache, cache.block_tables, lens)
