"""Paged KV caches in DeepGEMM's block layout, and block tables, in JAX.

DeepGEMM's paged MQA-logits kernels read an FP8 key cache of shape
`uint8 [num_blocks, block_size, 1, D + 4]`. The 4-D shape is only a view: each block is
`block_size * (D + 4)` bytes holding first the block's `block_size` FP8 rows (token-major,
`block_size * D` bytes), then their `block_size` float32 dequantisation scales
(`block_size * 4` bytes), not one scale after each row. With MX scales (SM100) the 4 bytes
of a token are its packed UE8M0 exponents (int32) instead of a float32.

Rows are quantised as DeepGEMM's tests do (`kv_cache_cast_to_fp8`): per token,
`sf = max(amax(|k|), 1e-4) / 448`, values `k * (1 / sf)` cast to float8_e4m3fn; with
`use_ue8m0`, sf rounded up to a power of two first (DeepSeek V3.2's `scale_fmt: ue8m0`).

A block table `int32 [B, max_blocks]` maps the logical block `i` of sequence `b` (tokens
`i*block_size ... (i+1)*block_size - 1`) to a physical block of the cache. JAX arrays are
always contiguous, so torch's concern about block tables whose last stride is not 1 does not
arise here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dg.contracts import KV_SCALE_BYTES as SCALE_BYTES
from jax_dg.core.checks import Checker
from jax_dg.operands.quant import FP8, cast_with_scale, scale_for

__all__ = [
    "pack_kv_cache", "unpack_kv_cache", "quantize_kv_cache", "dequantize_kv_cache",
    "kv_cache_from_rows", "kv_cache_from_sequences", "update_kv_cache", "slot_mapping",
    "decode_slots", "build_block_tables",
]


def check_kv_cache(ck: Checker, kv_cache, arg: str = "kv_cache", *, d: int | None = None,
                   block_sizes: tuple[int, ...] | None = None, where: str = "") -> tuple[int, int, int]:
    """The one check of a paged cache's shape: uint8 [num_blocks, block_size, 1, D + 4] with
    num_blocks >= 1, D > 0 (or q's D when given) and block_size in `block_sizes` (when given;
    `where` names the architecture in the message). Returns (num_blocks, block_size, D)."""
    ck.ndim(kv_cache, arg, 4, "[num_blocks, block_size, 1, D + 4]")
    ck.dtype(kv_cache, arg, jnp.uint8)
    nb, blk, heads, dp4 = kv_cache.shape
    ck.that(heads == 1, arg, "must have one KV head: shape [num_blocks, block_size, 1, D + 4]",
            tuple(kv_cache.shape))
    if d is None:
        ck.that(dp4 > SCALE_BYTES, arg, "must have a last dim D + 4 with D > 0", tuple(kv_cache.shape))
    else:
        ck.that(dp4 == d + SCALE_BYTES, arg, f"must have last dim D + 4 = {d + SCALE_BYTES} (D = {d} "
                "from q; each token's 4 extra bytes are its scale)", tuple(kv_cache.shape))
    if block_sizes is not None:
        ck.that(blk in block_sizes, arg, f"must have a block size (dim 1) in {block_sizes}"
                + (f" on {where}" if where else ""), blk)
    ck.that(nb >= 1, arg, "must have at least one block", tuple(kv_cache.shape))
    return nb, blk, dp4 - SCALE_BYTES


@jax.jit
def pack_kv_cache(values: jax.Array, scales: jax.Array) -> jax.Array:
    """Packs FP8 rows and their scales into DeepGEMM's paged block layout.

    values: float8_e4m3fn [num_blocks, block_size, D] (or int8 [.., D/2], packed MXFP4)
    scales: float32 [num_blocks, block_size] (or int32 packed UE8M0 for MX caches)
    Returns uint8 [num_blocks, block_size, 1, D + 4] (D/2 + 4 for packed FP4).
    """
    ck = Checker("pack_kv_cache")
    ck.ndim(values, "values", 3, "[num_blocks, block_size, D]")
    ck.dtype(values, "values", FP8, jnp.int8)
    nb, blk, d = values.shape
    ck.tensor(scales, "scales", [jnp.float32, jnp.int32], (nb, blk), "[num_blocks, block_size]")
    v = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(nb, blk * d)
    s = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(nb, blk * SCALE_BYTES)
    return jnp.concatenate([v, s], axis=1).reshape(nb, blk, 1, d + SCALE_BYTES)


@functools.partial(jax.jit, static_argnames=("mx_scales", "value_dtype"))
def unpack_kv_cache(kv_cache: jax.Array, *, mx_scales: bool = False,
                    value_dtype=FP8) -> tuple[jax.Array, jax.Array]:
    """Inverse of `pack_kv_cache`: (values [num_blocks, block_size, D] of `value_dtype`
    (float8_e4m3fn, or int8 for packed MXFP4), float32 scales [num_blocks, block_size],
    or int32 packed UE8M0 with `mx_scales`)."""
    check_kv_cache(Checker("unpack_kv_cache"), kv_cache)
    nb, blk, _, dp4 = kv_cache.shape
    d = dp4 - SCALE_BYTES
    block = kv_cache.reshape(nb, blk * dp4)          # one block: blk rows of d bytes, then blk scales
    values = jax.lax.bitcast_convert_type(block[:, :blk * d].reshape(nb, blk, d), value_dtype)
    scales = jax.lax.bitcast_convert_type(block[:, blk * d:].reshape(nb, blk, SCALE_BYTES),
                                          jnp.int32 if mx_scales else jnp.float32)
    return values, scales


def _quantize_rows(k: jax.Array, use_ue8m0: bool = False) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (float8 [..., D], float32 scales [...]): one scale per row (token),
    bit-exact with DeepGEMM's `kv_cache_cast_to_fp8` (jax_dg.operands.quant's formulas)."""
    x = k.astype(jnp.float32)
    sf = scale_for(jnp.abs(x).max(axis=-1, keepdims=True), use_ue8m0)
    return cast_with_scale(x, sf), sf[..., 0]


def _check_keys(ck: Checker, k, ndim: int, layout: str) -> None:
    ck.floating(k, "k")
    ck.ndim(k, "k", ndim, layout)


def _check_table(ck: Checker, block_tables) -> None:
    ck.integer(block_tables, "block_tables")
    ck.ndim(block_tables, "block_tables", 2, "[B, max_blocks]")


def quantize_kv_cache(k: jax.Array, *, use_ue8m0: bool = False) -> jax.Array:
    """Unquantised keys [num_blocks, block_size, D] (or [..., block_size, 1, D]) -> the FP8
    paged cache uint8 [num_blocks, block_size, 1, D + 4] (DeepGEMM's `kv_cache_cast_to_fp8`;
    power-of-two scales with use_ue8m0)."""
    ck = Checker("quantize_kv_cache")
    ck.floating(k, "k")
    if k.ndim == 4 and k.shape[2] == 1:
        k = k[:, :, 0]
    ck.ndim(k, "k", 3, "[num_blocks, block_size, D]")
    return _quantize_kv_cache(k, ck.static_bool(use_ue8m0, "use_ue8m0"))


@functools.partial(jax.jit, static_argnames=("use_ue8m0",))
def _quantize_kv_cache(k: jax.Array, use_ue8m0: bool) -> jax.Array:
    return pack_kv_cache(*_quantize_rows(k, use_ue8m0))


def dequantize_kv_cache(kv_cache: jax.Array, block_tables: jax.Array | None = None) -> jax.Array:
    """float32 keys of an FP8 paged cache: [num_blocks, block_size, D], or with `block_tables`
    [B, max_blocks]: each sequence's keys gathered in logical order, [B, max_blocks * block_size, D]."""
    if block_tables is not None:
        _check_table(Checker("dequantize_kv_cache"), block_tables)
    return _dequantize_kv_cache(kv_cache, block_tables)


@jax.jit
def _dequantize_kv_cache(kv_cache: jax.Array, block_tables: jax.Array | None) -> jax.Array:
    values, scales = unpack_kv_cache(kv_cache)
    k = values.astype(jnp.float32) * scales[..., None]
    if block_tables is None:
        return k
    b, w = block_tables.shape
    return k[block_tables].reshape(b, w * k.shape[1], k.shape[2])


def kv_cache_from_rows(k: jax.Array, slots: jax.Array, num_blocks: int, block_size: int, *,
                       use_ue8m0: bool = False) -> jax.Array:
    """Quantises key rows [N, D] into a fresh paged cache; row i goes to cache slot `slots[i]`
    (= physical block * block_size + offset in the block). Slots outside the cache are dropped;
    slots no row writes hold zeros (value 0, scale 0). use_ue8m0: power-of-two scales."""
    ck = Checker("kv_cache_from_rows")
    _check_keys(ck, k, 2, "[N, D]")
    ck.integer(slots, "slots")
    ck.shape(slots, "slots", k.shape[:1], "[N]")
    return _kv_cache_from_rows(k, slots, ck.static_int(num_blocks, "num_blocks", minimum=1),
                               ck.static_int(block_size, "block_size", minimum=1),
                               ck.static_bool(use_ue8m0, "use_ue8m0"))


@functools.partial(jax.jit, static_argnames=("num_blocks", "block_size", "use_ue8m0"))
def _kv_cache_from_rows(k: jax.Array, slots: jax.Array, num_blocks: int, block_size: int,
                        use_ue8m0: bool = False) -> jax.Array:
    empty = jnp.zeros((num_blocks, block_size, 1, k.shape[1] + SCALE_BYTES), jnp.uint8)
    return _update_kv_cache(empty, k, slots, use_ue8m0)   # all-zero bytes: value 0, scale 0


def update_kv_cache(kv_cache: jax.Array, k: jax.Array, slots: jax.Array, *, use_ue8m0: bool = False) -> jax.Array:
    """The FP8 paged cache with key rows k [N, D] quantised into slots[i] (= physical block *
    block_size + offset, as slot_mapping gives; slots outside the cache, -1 included, are
    dropped), every other slot as it was: a decode step's cache update. Slots must be distinct
    (two rows to one slot would leave a mix of both). Under jit with the cache donated, XLA
    writes the rows in place. use_ue8m0: the rows' scales are powers of two."""
    ck = Checker("update_kv_cache")
    _, _, d = check_kv_cache(ck, kv_cache)
    _check_keys(ck, k, 2, "[N, D]")
    ck.that(k.shape[1] == d, "k", f"must have the cache's D = {d} columns", tuple(k.shape))
    ck.integer(slots, "slots")
    ck.shape(slots, "slots", k.shape[:1], "[N]")
    return _update_kv_cache(kv_cache, k, slots, ck.static_bool(use_ue8m0, "use_ue8m0"))


@functools.partial(jax.jit, static_argnames=("use_ue8m0",))
def _update_kv_cache(kv_cache: jax.Array, k: jax.Array, slots: jax.Array, use_ue8m0: bool = False) -> jax.Array:
    nb, blk, _, dp4 = kv_cache.shape
    d, n = dp4 - SCALE_BYTES, nb * blk
    values, sf = _quantize_rows(k, use_ue8m0)
    slots = jnp.where((slots >= 0) & (slots < n), slots, n).astype(jnp.int32)
    block, off = slots // blk, slots % blk
    rows = jax.lax.bitcast_convert_type(values, jnp.uint8)                    # [N, D]
    scale = jax.lax.bitcast_convert_type(sf, jnp.uint8)                       # [N, 4]
    flat = kv_cache.reshape(nb, blk * dp4)        # a block: blk rows of D bytes, then blk scales
    at_v = off[:, None] * d + jnp.arange(d)                                   # [N, D]
    at_s = blk * d + off[:, None] * SCALE_BYTES + jnp.arange(SCALE_BYTES)     # [N, 4]
    flat = flat.at[block[:, None], at_v].set(rows, mode="drop")
    flat = flat.at[block[:, None], at_s].set(scale, mode="drop")
    return flat.reshape(kv_cache.shape)


def slot_mapping(block_tables: jax.Array, block_size: int, seq_len: int) -> jax.Array:
    """int32 [B, seq_len]: the cache slot of token t of sequence b,
    `block_tables[b, t // block_size] * block_size + t % block_size`."""
    ck = Checker("slot_mapping")
    _check_table(ck, block_tables)
    return _slot_mapping(block_tables, ck.static_int(block_size, "block_size", minimum=1),
                         ck.static_int(seq_len, "seq_len", minimum=0))


@functools.partial(jax.jit, static_argnames=("block_size", "seq_len"))
def _slot_mapping(block_tables: jax.Array, block_size: int, seq_len: int) -> jax.Array:
    t = jnp.arange(seq_len, dtype=jnp.int32)
    blocks = block_tables[:, jnp.minimum(t // block_size, block_tables.shape[1] - 1)]
    return blocks * block_size + t % block_size


def decode_slots(block_tables: jax.Array, context_lens: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """A decode step's writes: (int32 [B] the cache slot of each sequence's next token, at
    position context_lens[b]; int32 [B] the lengths after it). A sequence whose table is full
    (context_lens[b] >= max_blocks * block_size) gets slot -1 (update_kv_cache drops it: its
    slot would wrap into another sequence's block) and keeps its length. Every cache of one
    set of block tables (the indexer's keys, the attention's latent) writes through these."""
    ck = Checker("decode_slots")
    _check_table(ck, block_tables)
    ck.integer(context_lens, "context_lens")
    ck.shape(context_lens, "context_lens", block_tables.shape[:1], "[B]")
    return _decode_slots(block_tables, context_lens, ck.static_int(block_size, "block_size", minimum=1))


@functools.partial(jax.jit, static_argnames=("block_size",))
def _decode_slots(block_tables: jax.Array, context_lens: jax.Array, block_size: int):
    pos = context_lens.astype(jnp.int32)
    room = pos < block_tables.shape[1] * block_size
    block = jnp.take_along_axis(block_tables, jnp.clip(pos // block_size, 0, block_tables.shape[1] - 1)[:, None],
                                axis=1)[:, 0]
    slots = jnp.where(room, block * block_size + pos % block_size, -1)
    return slots.astype(jnp.int32), jnp.where(room, pos + 1, pos)


def kv_cache_from_sequences(k: jax.Array, block_tables: jax.Array, block_size: int, num_blocks: int,
                            context_lens: jax.Array | None = None, *, use_ue8m0: bool = False) -> jax.Array:
    """Quantises per-sequence keys [B, S, D] into a paged cache through `block_tables`.

    Token t of sequence b lands in logical block t // block_size of that sequence; tokens at
    t >= context_lens[b] (when given) or beyond the table are not written. use_ue8m0:
    power-of-two scales.
    """
    ck = Checker("kv_cache_from_sequences")
    _check_keys(ck, k, 3, "[B, S, D]")
    _check_table(ck, block_tables)
    if context_lens is not None:
        ck.integer(context_lens, "context_lens")
    return _kv_cache_from_sequences(k, block_tables, ck.static_int(block_size, "block_size", minimum=1),
                                    ck.static_int(num_blocks, "num_blocks", minimum=1), context_lens,
                                    ck.static_bool(use_ue8m0, "use_ue8m0"))


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "use_ue8m0"))
def _kv_cache_from_sequences(k: jax.Array, block_tables: jax.Array, block_size: int, num_blocks: int,
                             context_lens: jax.Array | None = None, use_ue8m0: bool = False) -> jax.Array:
    b, s, d = k.shape
    slots = _slot_mapping(block_tables, block_size, s)
    t = jnp.arange(s, dtype=jnp.int32)[None, :]
    keep = t < block_tables.shape[1] * block_size
    if context_lens is not None:
        keep = keep & (t < context_lens.reshape(b, -1)[:, -1:])
    slots = jnp.where(keep, slots, -1)
    return _kv_cache_from_rows(k.reshape(b * s, d), slots.reshape(-1), num_blocks, block_size, use_ue8m0)


def build_block_tables(context_lens, block_size: int, *, num_blocks: int | None = None,
                       key: jax.Array | None = None, width: int | None = None,
                       even_width: bool | None = None) -> tuple[jax.Array, int]:
    """Block tables for sequences of the given (concrete) lengths: (int32 [B, width], num_blocks).

    Sequence b needs ceil(context_lens[b] / block_size) blocks (for 2-D lengths, the last
    column). Physical blocks are handed out in order (contiguous), or, with a `key` (a JAX
    PRNG key or an int seed), as
    a random permutation of range(num_blocks) (default: exactly the blocks needed) drawn on
    the host from the key's bits (no device work, the same key gives the same table). Unused
    entries hold block 0, a valid id. The width defaults to the longest sequence's block count,
    rounded up to an even number for block_size 32 (DeepGEMM reads those tables in pairs).
    """
    ck = Checker("build_block_tables")
    block_size = ck.static_int(block_size, "block_size", minimum=1)
    ctx = np.asarray(jax.device_get(context_lens))
    ck.that(ctx.dtype != np.bool_ and np.issubdtype(ctx.dtype, np.integer), "context_lens",
            "must hold integer lengths", ctx.dtype.name)   # before astype would truncate floats
    if ctx.ndim == 2:
        ctx = ctx[:, -1]
    ck.that(ctx.ndim == 1, "context_lens", "must be [B] or [B, next_n]", ctx.shape)
    need = -(-np.maximum(ctx.astype(np.int64), 0) // block_size)
    total = int(need.sum())
    num_blocks = max(total, 1) if num_blocks is None else ck.static_int(num_blocks, "num_blocks")
    ck.that(num_blocks >= max(total, 1), "num_blocks", f"must be >= the {total} blocks the "
            "sequences need", num_blocks)
    longest = int(need.max(initial=0))
    w = max(longest, 1) if width is None else ck.static_int(width, "width")
    ck.that(w >= max(longest, 1), "width", f"must be >= {max(longest, 1)}", w)
    if even_width is not None:
        ck.static_bool(even_width, "even_width")
    if (block_size == 32 if even_width is None else even_width) and w % 2:
        w += 1
    if key is None:
        ids = np.arange(num_blocks)
    else:
        if isinstance(key, (int, np.integer)):
            bits = [int(key)]
        else:
            key = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
            bits = np.asarray(key).astype(np.uint32).ravel().tolist()
        ids = np.random.default_rng(bits).permutation(num_blocks)
    ids = ids[:total]
    table = np.zeros((ctx.shape[0], w), np.int32)
    starts = np.concatenate([[0], np.cumsum(need)])
    for b, n in enumerate(need):
        table[b, :n] = ids[starts[b]:starts[b] + n]
    return jnp.asarray(table), num_blocks

