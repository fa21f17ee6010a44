"""MLA: DeepSeek V3.2's multi-head latent attention with DeepSeek Sparse Attention, as an NNX module.

As DeepSeek V3.2's inference code (inference/model.py, `MLA`, with its November 2025 update):

  q   = wq_b(q_norm(wq_a(x)))          low-rank query: [H, qk_nope + qk_rope] per token
  kv  = wkv_a(x)                       the latent: kv_lora_rank features (kv_norm'd) + one shared
                                       qk_rope key (RoPE, interleaved pairs), per token
  attention over the indexer's top-k cached positions only (index_topk; -1: all positions),
  softmax scale (qk_nope + qk_rope)^-1/2, times YaRN's mscale^2 (jax_dg.nn.rope)

The latent is what the cache holds: per token its kv_lora_rank features cast to FP8 per 128
(scales as `scale_fmt` says: UE8M0 powers of two for V3.2) and its RoPE key in bf16, one row of
kv_lora_rank + 4 * kv_lora_rank / 128 + 2 * qk_rope bytes (656 at V3.2's sizes: FlashMLA's FP8
sparse layout, what DeepSeek deploys; its reference simulates the same precision by casting the
latent to FP8 and back). The cache is paged like the indexer's: [num_blocks, block_size, 1, bytes]
through the same block tables (MLACache holds both caches, the tables and the lengths).

Two forms, as DeepSeek's: prefill (several sequences, padded to [B, S], each from position 0)
expands the latent through wkv_b into per-head keys and values and attends causally within the
indexer's choice (dense scores masked, in float32: the MHA form); decode (one token per sequence)
absorbs wkv_b's key half into the query and its value half into the output and attends over the
gathered latent rows of the chosen positions (the MQA form: no per-head keys are ever formed).
Scores and softmax are float32 from bf16 operands; the probabilities meet the values in bf16, as
DeepSeek's; DeepSeek's reference rounds its einsums' outputs to bf16 where these keep float32
until the attention output. wkv_b's weight for the absorbed form is its dequantised bf16 value
(DeepSeek's weight_dequant), formed in the step.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dg.nn.indexer import IndexerCache, LightningIndexer
from jax_dg.nn.linear import FP8Linear, check_scale_fmt, dequantize_blocks
from jax_dg.nn.rope import RoPE
from jax_dg.operands import paged
from jax_dg.ops.cast import per_token_cast_to_fp8

if tp.TYPE_CHECKING:
    from jax_dg.nn.config import DeepSeekV32Config

LATENT_BLOCK = 128   # the latent's FP8 scale blocks (DeepSeek's act_quant block size)


def latent_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's latent row: FP8 features, a float32 scale per 128, bf16 RoPE key."""
    return kv_lora_rank + 4 * (kv_lora_rank // LATENT_BLOCK) + 2 * rope_dim


def pack_latent(kv_c: jax.Array, k_pe: jax.Array, *, use_ue8m0: bool = False) -> tuple[jax.Array, jax.Array]:
    """Latent features kv_c [N, C] and RoPE keys k_pe [N, R] -> (uint8 rows [N, latent_bytes],
    bfloat16 kv_c as the cache holds it: its FP8 values times their scales)."""
    values, scales = per_token_cast_to_fp8(kv_c.astype(jnp.bfloat16), use_ue8m0=use_ue8m0)
    n = kv_c.shape[0]
    row = jnp.concatenate([jax.lax.bitcast_convert_type(values, jnp.uint8),
                           jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(n, -1),
                           jax.lax.bitcast_convert_type(k_pe.astype(jnp.bfloat16), jnp.uint8).reshape(n, -1)], -1)
    return row, _dequantize(values, scales)


def unpack_latent(rows: jax.Array, kv_lora_rank: int) -> tuple[jax.Array, jax.Array]:
    """uint8 latent rows [..., latent_bytes] -> (bfloat16 kv_c [..., C], bfloat16 k_pe [..., R])."""
    c, lead = kv_lora_rank, rows.shape[:-1]
    nsf = c // LATENT_BLOCK
    values = jax.lax.bitcast_convert_type(rows[..., :c], jnp.float8_e4m3fn)
    scales = jax.lax.bitcast_convert_type(rows[..., c:c + 4 * nsf].reshape(lead + (nsf, 4)), jnp.float32)
    pe = rows[..., c + 4 * nsf:]
    k_pe = jax.lax.bitcast_convert_type(pe.reshape(lead + (pe.shape[-1] // 2, 2)), jnp.bfloat16)
    return _dequantize(values, scales), k_pe


def _dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """FP8 [..., C] times float32 scales [..., C / 128], rounded to bf16 (DeepSeek's kv cache dtype)."""
    lead, c = values.shape[:-1], values.shape[-1]
    blocks = values.astype(jnp.float32).reshape(lead + (c // LATENT_BLOCK, LATENT_BLOCK)) * scales[..., None]
    return blocks.reshape(lead + (c,)).astype(jnp.bfloat16)


class MLACache(tp.NamedTuple):
    """A batch of sequences' attention caches, paged through one set of block tables (a pytree).

    latent        uint8 [num_blocks, block_size, 1, latent_bytes]: each token's latent row
    index_keys    uint8 [num_blocks, block_size, 1, index_head_dim + 4]: the indexer's FP8 keys
                  (jax_dg.paged's layout), or None for attention without an indexer
    block_tables  int32 [B, max_blocks]: sequence b's logical block j is physical block [b, j]
    context_lens  int32 [B]: tokens cached per sequence
    """
    latent: jax.Array
    index_keys: jax.Array | None
    block_tables: jax.Array
    context_lens: jax.Array

    @property
    def block_size(self) -> int:
        return self.latent.shape[1]

    @property
    def max_len(self) -> int:
        return self.block_tables.shape[1] * self.block_size

    @property
    def index(self) -> IndexerCache:
        return IndexerCache(self.index_keys, self.block_tables, self.context_lens)

    def gather_latent(self, positions: jax.Array) -> jax.Array:
        """uint8 [B, K, latent_bytes]: the latent rows of cached positions [B, K] (entries < 0
        read position 0; the caller masks them)."""
        p = jnp.maximum(positions, 0)
        bs, width = self.block_size, self.block_tables.shape[1]
        block = jnp.take_along_axis(self.block_tables, jnp.minimum(p // bs, width - 1), axis=1)
        flat = self.latent.reshape(-1, self.latent.shape[-1])
        return flat[block * bs + p % bs]

    def write_latent(self, rows: jax.Array, slots: jax.Array) -> jax.Array:
        """The latent cache with rows [N, latent_bytes] at slots [N] (slots outside it, -1
        included, dropped)."""
        flat = self.latent.reshape(-1, self.latent.shape[-1])
        n = flat.shape[0]
        slots = jnp.where((slots >= 0) & (slots < n), slots, n)
        return flat.at[slots].set(rows, mode="drop").reshape(self.latent.shape)


def _einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 einsum of bf16 operands: exact products, float32 sums (tensor cores on a GPU; the
    CPU's dot has no bf16 x bf16 -> f32 form, so there the operands are widened first: the same
    products)."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


SCORE_BYTES = 2 ** 31   # prefill's float32 scores [B, H, queries, S] per chunk of queries


def rows_per_chunk(b: int, heads: int, s: int) -> int:
    """Queries per prefill chunk: all of them while the float32 scores of B x H x S x S fit
    SCORE_BYTES (DeepSeek's dense form), else as many as fit (at least one)."""
    return max(1, min(s, SCORE_BYTES // (b * heads * s * 4)))


def _chunked(fn, queries: tuple, rows: int) -> jax.Array:
    """fn over the query axis (1) of each of `queries` in chunks of `rows` (one lax.map: the
    chunks run one after another, their scores never all alive), concatenated back. Each row's
    result is what one call over all rows gives it (attention is per query)."""
    s = queries[0].shape[1]
    if rows >= s:
        return fn(*queries)
    n = -(-s // rows)
    pad = lambda a: jnp.pad(a, [(0, 0), (0, n * rows - s)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    split = lambda a: jnp.moveaxis(pad(a).reshape(a.shape[0], n, rows, *a.shape[2:]), 1, 0)  # noqa: E731
    out = jax.lax.map(lambda chunk: fn(*chunk), tuple(split(a) for a in queries))   # [n, B, rows, ...]
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(out.shape[0], n * rows, *out.shape[3:])[:, :s]


def _masked_softmax(scores: jax.Array, keep: jax.Array) -> jax.Array:
    """softmax over the last axis of the kept scores; a row that keeps none is all zeros."""
    s = jnp.where(keep, scores, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0)), 0)
    total = e.sum(-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1)


class MLA(nnx.Module):
    """DeepSeek V3.2's attention layer (see the module doc). x [..., dim] rows are tokens.

    dim: the hidden size; n_heads heads of qk_nope_head_dim + qk_rope_head_dim (q, k) and
    v_head_dim (v); q_lora_rank and kv_lora_rank (a multiple of 128) the low ranks; rope the
    rotary embedding (qk_rope_head_dim features; YaRN as it says); index_topk the positions the
    indexer keeps per query (-1: no indexer, every causal position), index_n_heads x
    index_head_dim its heads; scale_fmt "ue8m0": every activation cast (the projections', the
    latent's, the indexer's) takes power-of-two scales; fp8_weights: the projections hold FP8
    weights as a checkpoint stores them (FP8Linear's).
    """

    def __init__(self, dim: int, n_heads: int, *, q_lora_rank: int, kv_lora_rank: int = 512,
                 qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, v_head_dim: int = 128,
                 rope: RoPE | None = None, index_topk: int = 2048, index_n_heads: int = 64,
                 index_head_dim: int = 128, scale_fmt: str | None = None, eps: float = 1e-6,
                 fp8_weights: bool = False, param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
        rope = RoPE(dim=qk_rope_head_dim) if rope is None else rope
        if rope.dim != qk_rope_head_dim:
            raise ValueError(f"MLA: `rope` rotates {rope.dim} features, `qk_rope_head_dim` is {qk_rope_head_dim}")
        if kv_lora_rank % LATENT_BLOCK:
            raise ValueError(f"MLA: `kv_lora_rank` must be a multiple of {LATENT_BLOCK} (the latent's FP8 "
                             f"scale blocks), got {kv_lora_rank}")
        if q_lora_rank <= 0:
            raise ValueError(f"MLA: `q_lora_rank` must be positive (V3.2's indexer reads the compressed "
                             f"query), got {q_lora_rank}")
        if index_topk == 0 or index_topk < -1:
            raise ValueError(f"MLA: `index_topk` must be positive or -1 (no indexer), got {index_topk}")
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope, self.index_topk, self.use_ue8m0 = rope, index_topk, check_scale_fmt(scale_fmt, "MLA")
        self.softmax_scale = rope.softmax_scale(qk_nope_head_dim + qk_rope_head_dim)
        lin = dict(fp8_weights=fp8_weights, scale_fmt=scale_fmt, param_dtype=param_dtype, rngs=rngs)
        self.wq_a = FP8Linear(dim, q_lora_rank, **lin)
        self.q_norm = nnx.RMSNorm(q_lora_rank, epsilon=eps, param_dtype=jnp.float32, rngs=rngs)
        self.wq_b = FP8Linear(q_lora_rank, n_heads * (qk_nope_head_dim + qk_rope_head_dim), **lin)
        self.wkv_a = FP8Linear(dim, kv_lora_rank + qk_rope_head_dim, **lin)
        self.kv_norm = nnx.RMSNorm(kv_lora_rank, epsilon=eps, param_dtype=jnp.float32, rngs=rngs)
        self.wkv_b = FP8Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), **lin)
        self.wo = FP8Linear(n_heads * v_head_dim, dim, **lin)
        self.indexer = LightningIndexer(dim, q_lora_rank, n_heads=index_n_heads, head_dim=index_head_dim,
                                        topk=index_topk, rope=rope, scale_fmt=scale_fmt,
                                        fp8_weights=fp8_weights, param_dtype=param_dtype, rngs=rngs) \
            if index_topk > 0 else nnx.data(None)

    @classmethod
    def from_config(cls, cfg: DeepSeekV32Config, *, rngs: nnx.Rngs, fp8_weights: bool | None = None,
                    param_dtype=jnp.bfloat16) -> MLA:
        """The attention of a DeepSeek-V3.2 configuration (jax_dg.nn.config); fp8_weights
        defaults to whether the checkpoint stores FP8 weights."""
        return cls(cfg.hidden_size, cfg.n_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                   qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                   v_head_dim=cfg.v_head_dim, rope=cfg.rope, index_topk=cfg.index_topk,
                   index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, scale_fmt=cfg.scale_fmt,
                   eps=cfg.rms_norm_eps, fp8_weights=cfg.fp8_weights if fp8_weights is None else fp8_weights,
                   param_dtype=param_dtype, rngs=rngs)

    @property
    def latent_bytes(self) -> int:
        return latent_bytes(self.kv_lora_rank, self.qk_rope_head_dim)

    def init_cache(self, block_tables: jax.Array, num_blocks: int, block_size: int) -> MLACache:
        """An empty cache (every length 0) of num_blocks blocks of block_size tokens, for
        sequences laid out by block_tables (jax_dg.paged.build_block_tables). The cache holds
        its own copy of the tables: donating it leaves the caller's."""
        zeros = lambda d: jnp.zeros((num_blocks, block_size, 1, d), jnp.uint8)  # noqa: E731
        keys = None if self.indexer is None else zeros(self.indexer.head_dim + 4)
        return MLACache(zeros(self.latent_bytes), keys, jnp.array(block_tables, jnp.int32, copy=True),
                        jnp.zeros((block_tables.shape[0],), jnp.int32))

    # --- the projections -------------------------------------------------------------------

    def queries(self, x: jax.Array, positions: jax.Array):
        """(compressed query qr [T, q_lora_rank], q_nope [T, H, nope], q_pe [T, H, rope]) of tokens
        x [T, dim] at positions [T]; bf16."""
        qr = self.q_norm(self.wq_a(x)).astype(jnp.bfloat16)
        q = self.wq_b(qr).reshape(x.shape[0], self.n_heads, -1)
        q_nope, q_pe = q[..., :self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]
        return qr, q_nope, self.rope(q_pe, positions, interleaved=True)

    def latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(uint8 latent rows [T, latent_bytes] for the cache, bf16 kv_c [T, C] as the cache holds
        it, bf16 k_pe [T, rope]) of tokens x [T, dim] at positions [T]."""
        kv = self.wkv_a(x)
        kv_c = self.kv_norm(kv[:, :self.kv_lora_rank]).astype(jnp.bfloat16)
        k_pe = self.rope(kv[:, self.kv_lora_rank:], positions, interleaved=True)
        rows, kv_c = pack_latent(kv_c, k_pe, use_ue8m0=self.use_ue8m0)
        return rows, kv_c, k_pe

    def wkv_b_heads(self) -> jax.Array:
        """bf16 [H, nope + v, kv_lora_rank]: wkv_b's weight per head (DeepSeek's weight_dequant
        of a stored FP8 weight; a bf16 master as it is), what the absorbed decode multiplies by."""
        lin = self.wkv_b
        w = dequantize_blocks(lin.weight[...], lin.weight_scale_inv[...]) if lin.stored_fp8 \
            else lin.kernel[...].T.astype(jnp.bfloat16)               # [out, in]
        return w.reshape(self.n_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    # --- prefill ---------------------------------------------------------------------------

    def prefill(self, x: jax.Array, lens: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
        """Sequences x [B, S, dim] (sequence b's first lens[b] rows; the rest padding), each from
        position 0: (bf16 [B, S, dim] (rows past a length: finite, meaningless), the cache with
        every sequence's tokens written and its length lens[b]). The block tables must give each
        sequence room for its lens[b] tokens (tokens past the table are not cached)."""
        b, s, _ = x.shape
        lens = jnp.minimum(jnp.asarray(lens, jnp.int32), s)
        rows = x.reshape(b * s, -1)
        pos = jnp.tile(jnp.arange(s, dtype=jnp.int32), b)
        qr, q_nope, q_pe = self.queries(rows, pos)
        latent, kv_c, k_pe = self.latent(rows, pos)
        valid = jnp.arange(s)[None, :] < lens[:, None]                                   # [B, S]
        slots = jnp.where(valid, paged.slot_mapping(cache.block_tables, cache.block_size, s), -1).reshape(-1)
        index_keys, keep = cache.index_keys, jnp.tril(jnp.ones((s, s), bool))[None]      # [1, S, S]
        if self.indexer is not None:
            idx, keys = jax.vmap(self.indexer.prefill)(x, qr.reshape(b, s, -1))          # [B, S, topk]
            index_keys = paged.update_kv_cache(index_keys, keys.reshape(b * s, -1), slots,
                                               use_ue8m0=self.indexer.use_ue8m0)
            chosen = jnp.zeros((b, s, s + 1), bool).at[
                jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], jnp.where(idx < 0, s, idx)].set(True)
            keep = keep & chosen[..., :s]
        kv = self.wkv_b(kv_c).reshape(b, s, self.n_heads, -1)
        k_nope, v = kv[..., :self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]
        q_nope, q_pe = q_nope.reshape(b, s, self.n_heads, -1), q_pe.reshape(b, s, self.n_heads, -1)
        o = _chunked(lambda q_nope, q_pe, keep: self._mha(q_nope, q_pe, k_nope, k_pe.reshape(b, s, -1), v, keep),
                     (q_nope, q_pe, jnp.broadcast_to(keep, (b, s, s))), rows_per_chunk(b, self.n_heads, s))
        out = self.wo(o.reshape(b * s, -1)).reshape(b, s, -1)
        cache = MLACache(cache.write_latent(latent, slots), index_keys, cache.block_tables,
                         jnp.minimum(lens, cache.max_len))
        return out, cache

    def _mha(self, q_nope, q_pe, k_nope, k_pe, v, keep):
        """Queries [B, C, H, .] over the keys [B, S, ...] they keep (keep [B, C, S]): bf16 [B, C, H, v]."""
        scores = (_einsum("bshd,bthd->bhst", q_nope, k_nope)
                  + _einsum("bshr,btr->bhst", q_pe, k_pe)) * self.softmax_scale
        p = _masked_softmax(scores, keep[:, None]).astype(jnp.bfloat16)
        return _einsum("bhst,bthd->bshd", p, v).astype(jnp.bfloat16)

    # --- decode ----------------------------------------------------------------------------

    def decode(self, x: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
        """One new token per sequence (x [B, dim]) at position cache.context_lens: its latent
        (and its indexer key) written into the cache, then attention over the indexer's choice
        of the cached positions, itself included: (bf16 [B, dim], the updated cache). A sequence
        whose table is full takes no new token (paged.decode_slots) and attends to what it has."""
        b = x.shape[0]
        pos = cache.context_lens
        qr, q_nope, q_pe = self.queries(x, pos)
        latent, _, _ = self.latent(x, pos)
        slots, lens = paged.decode_slots(cache.block_tables, pos, cache.block_size)
        index_keys = cache.index_keys
        if self.indexer is None:
            idx = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (b, cache.max_len))
            idx = jnp.where(idx < lens[:, None], idx, -1)
        else:
            idx, index = self.indexer.decode(x, qr, cache.index)
            index_keys = index.kv_cache
        cache = MLACache(cache.write_latent(latent, slots), index_keys, cache.block_tables, lens)
        kv_c, k_pe = unpack_latent(cache.gather_latent(idx), self.kv_lora_rank)          # [B, K, C], [B, K, R]
        w = self.wkv_b_heads()
        q_abs = _einsum("bhd,hdc->bhc", q_nope, w[:, :self.qk_nope_head_dim]).astype(jnp.bfloat16)
        scores = (_einsum("bhc,bkc->bhk", q_abs, kv_c)
                  + _einsum("bhr,bkr->bhk", q_pe, k_pe)) * self.softmax_scale
        p = _masked_softmax(scores, (idx >= 0)[:, None, :]).astype(jnp.bfloat16)
        o = _einsum("bhk,bkc->bhc", p, kv_c).astype(jnp.bfloat16)
        o = _einsum("bhc,hdc->bhd", o, w[:, self.qk_nope_head_dim:]).astype(jnp.bfloat16)
        return self.wo(o.reshape(b, -1)), cache
