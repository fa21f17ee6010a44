"""Pure-JAX references of the MQA-logits family (the DeepSeek V3.2 lightning indexer).

    logits[i, n] = sum_h weights[i, h] * relu(q[i, h] . k[n])        k = kv * kv_scale[n]

valid for n in [ks[i], ke[i]) and -inf elsewhere. Everything is float32 at HIGHEST precision;
the [M, H, N] score tensor is built a block of query rows at a time when it would be large.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg import contracts

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")
# Scores held at once by weighted_relu_logits (float32 elements): 2**26 = 256 MiB.
MAX_SCORE_ELEMENTS = 1 << 26


def weighted_relu_logits(q: jax.Array, k: jax.Array, weights: jax.Array, *,
                         max_elements: int = MAX_SCORE_ELEMENTS) -> jax.Array:
    """`logits[m, n] = sum_h relu(q[m, h] . k[n]) * weights[m, h]` in float32.

    q float32 [M, H, D], k float32 [N, D] (already dequantised), weights float32 [M, H] -> [M, N].
    Never holds more than about `max_elements` scores: larger problems run over blocks of rows.
    """
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    m, h, _ = q.shape
    n = k.shape[0]

    def rows(qb, wb):
        s = jnp.einsum("mhd,nd->mhn", qb, k, precision=HIGHEST)
        return jnp.einsum("mhn,mh->mn", jnp.maximum(s, 0.0), wb, precision=HIGHEST)

    if m * h * n <= max_elements or m <= 1:
        return rows(q, weights)
    block = max(1, max_elements // max(h * n, 1))
    return jax.lax.map(lambda x: rows(x[0][None], x[1][None])[0], (q, weights), batch_size=block)


def valid_mask(ks: jax.Array, ke: jax.Array, n: int) -> jax.Array:
    """[M, n] bool: position j is valid for row i iff ks[i] <= j < ke[i]."""
    pos = jnp.arange(n, dtype=jnp.int32)[None, :]
    return (pos >= ks[:, None]) & (pos < ke[:, None])


def compress(full: jax.Array, ks: jax.Array, ke: jax.Array, width: int) -> jax.Array:
    """Full [M, N] logits -> compressed [M, width]: column t holds position ks[i] + t, valid for
    t < ke[i] - ks[i] (and inside [0, N)); every other column is -inf."""
    n = full.shape[1]
    t = jnp.arange(width, dtype=jnp.int32)[None, :]
    pos = ks[:, None] + t
    ok = (t < (ke - ks)[:, None]) & (pos >= 0) & (pos < n)
    if n == 0:
        return jnp.full((full.shape[0], width), NEG_INF, full.dtype)
    gathered = jnp.take_along_axis(full, jnp.clip(pos, 0, n - 1), axis=1)
    return jnp.where(ok, gathered, NEG_INF)


def mqa_logits(q, kv, kv_sf, weights, ks, ke, *, max_seqlen_k: int = 0) -> jax.Array:
    """The op's oracle: float32 [M, N], or [M, max_seqlen_k] compressed; -inf where invalid.
    Key ranges are first brought into 0 <= ks <= ke <= N, as the op does (in the compressed
    form column t is then key clip(ks, 0, N) + t)."""
    n = kv.shape[0]
    ks = jnp.clip(ks, 0, n)
    ke = jnp.clip(ke, ks, n)
    k = kv.astype(jnp.float32) * kv_sf.astype(jnp.float32)[:, None]
    logits = weighted_relu_logits(q.astype(jnp.float32), k, weights)
    full = jnp.where(valid_mask(ks, ke, k.shape[0]), logits, NEG_INF)
    return compress(full, ks, ke, max_seqlen_k) if max_seqlen_k else full


# --- MX formats (SM100 sparse kernels): FP8/FP4 values with packed UE8M0 block scales ----------

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_ue8m0(sf: jax.Array) -> jax.Array:
    """int32 packed UE8M0 (4 exponent bytes, little-endian) -> float32 [..., 4] powers of two."""
    exps = jax.lax.bitcast_convert_type(sf.astype(jnp.int32), jnp.uint8).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(exps << 23, jnp.float32)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """int8/uint8 [..., D/2] of e2m1 pairs (low nibble first) -> float32 [..., D]."""
    b = jax.lax.bitcast_convert_type(packed, jnp.uint8).astype(jnp.int32) if packed.dtype == jnp.int8 \
        else packed.astype(jnp.int32)
    codes = jnp.stack([b & 0xF, (b >> 4) & 0xF], axis=-1).reshape(*b.shape[:-1], -1)
    mag = jnp.asarray(FP4_VALUES, jnp.float32)[codes & 7]
    return jnp.where((codes & 8) != 0, -mag, mag)


def mx_dequant(values: jax.Array, sf: jax.Array) -> jax.Array:
    """float32 [..., D] from MXFP8 (e4m3 [..., D]) or MXFP4 (int8 [..., D/2]) with int32 [...]
    packed UE8M0 scales: byte j scales the j-th quarter of D (32 elements for D = 128)."""
    x = unpack_fp4(values) if values.dtype in (jnp.int8, jnp.uint8) else values.astype(jnp.float32)
    scales = unpack_ue8m0(sf)
    d = x.shape[-1]
    return x * jnp.repeat(scales, d // 4, axis=-1)


def sparse_columns(ks, ke, indices, sparse_block_kv: int):
    """For each output column (j, o) of the sparse form: the token it scores and whether it is valid.

    token = indices[i, j] * sbk + ks[i] % sbk + o (DeepGEMM's unaligned-ks convention); valid iff
    j < min(ceil(max(ke - ks, 0) / sbk), num_max_sparse_blocks) and ks[i] <= token < ke[i].
    """
    sbk = sparse_block_kv
    m, nmsb = indices.shape
    o = jnp.arange(sbk, dtype=jnp.int32)
    token = (indices[:, :, None] * sbk + (ks % sbk)[:, None, None] + o).reshape(m, nmsb * sbk)
    nvb = jnp.minimum((jnp.maximum(ke - ks, 0) + sbk - 1) // sbk, nmsb)
    col = jnp.arange(nmsb * sbk, dtype=jnp.int32)[None, :]
    valid = (col < (nvb * sbk)[:, None]) & (token >= ks[:, None]) & (token < ke[:, None])
    return token, valid


def sparse_mqa_logits(q, q_sf, kv, kv_sf, weights, ks, ke, indices, *, sparse_block_kv: int):
    """bfloat16 [M, nmsb * sbk]: the dense formula at each column's token, -inf where invalid."""
    qf = mx_dequant(q, q_sf)                       # [M, H, D]
    kf = mx_dequant(kv, kv_sf)                     # [N, D]
    token, valid = sparse_columns(ks, ke, indices, sparse_block_kv)
    n = kf.shape[0]
    k_sel = kf[jnp.clip(token, 0, max(n - 1, 0))]  # [M, C, D]
    s = jnp.einsum("mhd,mcd->mhc", qf, k_sel, precision=HIGHEST)
    logits = jnp.einsum("mhc,mh->mc", jnp.maximum(s, 0.0), weights.astype(jnp.float32),
                        precision=HIGHEST)
    return jnp.where(valid, logits, NEG_INF).astype(jnp.bfloat16)


# --- the sparse metadata buffer (layout in jax_dg.contracts) -----------------------------------

def _bytes(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint8).reshape(-1)


def pack_sparse_header(vectors, m: int, nmsb: int, *, paged: bool, backend_part: jax.Array,
                       size: int) -> jax.Array:
    """uint8 [size]: the header's int32 vectors (ks, ke, indices / context_lens, indices),
    padded, then `backend_part` (int32, the references' schedule), then zeros."""
    head = jnp.concatenate([_bytes(v) for v in vectors])
    header = contracts.sparse_header_bytes(m, nmsb, paged)
    body = _bytes(backend_part)
    return jnp.concatenate([head, jnp.zeros((header - head.shape[0],), jnp.uint8), body,
                            jnp.zeros((size - header - body.shape[0],), jnp.uint8)])


def sparse_header_arrays(metadata: jax.Array, m: int, nmsb: int, *, paged: bool):
    """The header's vectors back: (ks [M], ke [M], indices [M, nmsb]) or
    (context_lens [M], indices [M, nmsb]) when paged."""
    used = contracts.sparse_header_used(m, nmsb, paged)
    head = jax.lax.bitcast_convert_type(metadata[:used].reshape(-1, 4), jnp.int32)
    k = contracts.sparse_header_vectors(paged)
    return tuple(head[i * m:(i + 1) * m] for i in range(k)) + (head[k * m:].reshape(m, nmsb),)
