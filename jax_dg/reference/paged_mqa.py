"""Pure-JAX references of the paged MQA-logits family: schedule metadata, dense and sparse logits.

The schedule-metadata reference is DeepGEMM 2.5.0's algorithm (scheduler/paged_mqa_logits.cuh,
SM90: one next_n atom per request, 256-token splits), bit-exact. The logits references follow
the formula of DeepGEMM's tests on the dequantised keys:

    logits[b*next_n + j, t] = sum_h relu(q[b, j, h] . k[b, t]) * weights[b*next_n + j, h]
                              for t < context_lens[b, j], -inf elsewhere,

with k[b, t] the float32 key of token t of sequence b read through `block_tables`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg import contracts
from jax_dg.contracts import SPLIT_KV
from jax_dg.reference.mqa import mx_dequant, pack_sparse_header, sparse_columns, weighted_relu_logits

SCALE_BYTES = contracts.KV_SCALE_BYTES   # each token's scale in a cache block (the layout)
_CHUNK_BYTES = 1 << 28    # per-chunk working set of the logits references
NEG_INF = float("-inf")


# --- schedule metadata --------------------------------------------------------------------

def _upper_bound(prefix: jax.Array, x: jax.Array) -> jax.Array:
    """int32: how many entries of the sorted `prefix` are <= each x (searchsorted, right)."""
    small = prefix.shape[0] * x.shape[0] <= 1 << 22          # cheaper to compile and run
    return jnp.searchsorted(prefix, x, side="right", method="compare_all" if small else "scan"
                            ).astype(jnp.int32)


def paged_mqa_logits_metadata(context_lens: jax.Array, *, num_sms: int,
                              split_kv: int = SPLIT_KV) -> jax.Array:
    """int32 [num_sms + 1, 2]: (first batch row, first 256-token split) of each SM's work.

    Only the last column of `context_lens` [B, next_n] counts. Work is the total number of
    splits, divided as evenly as possible (the last `total % num_sms` SMs take one more);
    the last row is the sentinel (B, 0). All-zero lengths give (B - 1, 0) everywhere but the
    sentinel, as DeepGEMM 2.5.0 does.
    """
    b = context_lens.shape[0]
    last = jnp.maximum(context_lens[:, -1].astype(jnp.int32), 0)
    prefix = jnp.cumsum((last + split_kv - 1) // split_kv)          # inclusive, int32
    total = prefix[-1]
    q, r = total // num_sms, total % num_sms
    sm = jnp.arange(num_sms, dtype=jnp.int32)
    seg = sm * q + jnp.maximum(sm - (num_sms - r), 0)
    row = jnp.minimum(_upper_bound(prefix, seg), b - 1)
    base = jnp.where(row > 0, prefix[jnp.maximum(row - 1, 0)], 0)
    n = prefix[row] - base
    off = seg - base
    safe = jnp.maximum(n, 1)
    atom = jnp.where(n > 0, off // safe, 0)
    split = jnp.where(n > 0, off % safe, 0)
    slots = jnp.stack([row + atom, split], axis=1)
    return jnp.concatenate([slots, jnp.array([[b, 0]], jnp.int32)]).astype(jnp.int32)


def varlen_atoms(indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Varlen form: rows pair up when consecutive rows share a request id. Returns
    (atom start flags [M] bool, paired flags [M] bool) computed the way DeepGEMM walks them:
    from each run of equal ids, rows (0, 1), (2, 3), ... pair and an odd last row is alone."""
    m = indices.shape[0]
    pos = jnp.arange(m, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), indices[1:] != indices[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, pos, 0))
    start = (pos - run_start) % 2 == 0
    nxt = jnp.concatenate([indices[1:], indices[-1:]])
    paired = start & (pos + 1 < m) & (nxt == indices)
    return start, paired


def paged_mqa_logits_varlen_metadata(context_lens: jax.Array, indices: jax.Array, *, num_sms: int,
                                     split_kv: int = SPLIT_KV) -> jax.Array:
    """int32 [num_sms + 1, 2] for the varlen form (DeepGEMM's kIsVarlen branch): work items are
    atoms (a row, or two consecutive rows of one request scored up to the second row's
    length); each entry is (first row of the SM's first atom, first split)."""
    ctx = jnp.maximum(context_lens.reshape(-1).astype(jnp.int32), 0)
    m = ctx.shape[0]
    start, paired = varlen_atoms(indices.reshape(-1))
    atom_len = jnp.where(paired, jnp.concatenate([ctx[1:], ctx[-1:]]), ctx)
    num_atoms = start.sum(dtype=jnp.int32)
    # Atoms in order: the rows where one starts, padded with rows of length 0.
    order = jnp.argsort(~start, stable=True).astype(jnp.int32)
    atom_row = jnp.where(jnp.arange(m) < num_atoms, order, m)
    atom_ctx = jnp.where(jnp.arange(m) < num_atoms, atom_len[jnp.minimum(order, m - 1)], 0)
    prefix = jnp.cumsum((atom_ctx + split_kv - 1) // split_kv)
    total = prefix[-1]
    q, r = total // num_sms, total % num_sms
    sm = jnp.arange(num_sms + 1, dtype=jnp.int32)
    seg = sm * q + jnp.maximum(sm - (num_sms - r), 0)
    atom = jnp.minimum(_upper_bound(prefix, seg), num_atoms)
    split = seg - jnp.where(atom > 0, prefix[jnp.maximum(atom - 1, 0)], 0)
    row = jnp.where(atom < num_atoms, atom_row[jnp.minimum(atom, m - 1)], m)
    return jnp.stack([row, split], axis=1).astype(jnp.int32)


# --- the logits call's addresses brought into range ------------------------------------------

def paged_sanitised(context_lens, block_tables, schedule, *, next_n: int, num_blocks: int,
                    block_size: int, limit: int, zero_unused: bool):
    """(ctx int32 [B, next_n], table int32 [B, W'], schedule int32 [S + 1, 2] or None): what
    the paged logits kernel reads as addresses, in range whatever the values (jax_dg's native
    kernel kernels/paged_sanitise.cu, bitwise):
    - context_lens [B] (row j's length lens[b] - next_n + 1 + j) or [B, next_n];
    - a block-table entry outside [0, num_blocks) ends its request's context at that block's
      first token, and is replaced by block 0 (then never scored);
    - the last row's length is cut to `limit` = min(max_model_len, W * block_size), every other
      row's to the last row's;
    - zero_unused (block size 32, entries read in pairs): entries past each request's blocks are
      0 too, over an even width;
    - schedule (DeepGEMM's SM90 walk, next_n <= 2): bounded to those lengths (bounded_schedule)."""
    if context_lens.ndim == 1:   # int32 wrap-around, as the kernels'
        ctx = context_lens[:, None] - next_n + 1 + jnp.arange(next_n, dtype=jnp.int32)[None, :]
    else:
        ctx = context_lens
    width = block_tables.shape[1]
    given = jnp.minimum(jnp.maximum(ctx[:, -1:], 0), limit)
    bad = (block_tables < 0) | (block_tables >= num_blocks)
    first_bad = jnp.min(jnp.where(bad, jnp.arange(width, dtype=jnp.int32)[None, :], width), axis=1,
                        keepdims=True)
    # first_bad capped where it can no longer cut (its product then stays within int32)
    last = jnp.minimum(given, jnp.minimum(first_bad, contracts.cdiv(limit, block_size)) * block_size)
    ctx = jnp.concatenate([jnp.clip(ctx[:, :-1], 0, last), last], axis=1) if next_n > 1 else last
    table = jnp.where(bad, 0, block_tables)
    if zero_unused:
        if width % 2:
            table = jnp.pad(table, ((0, 0), (0, 1)))
        used = jnp.arange(table.shape[1], dtype=jnp.int32)[None, :] < (last + block_size - 1) // block_size
        table = jnp.where(used, table, 0)
    if schedule is not None:
        schedule = bounded_schedule(schedule, last[:, 0], limit)
    return ctx, table, schedule


def bounded_schedule(meta, lens, limit: int):
    """A paged schedule [S + 1, 2] that DeepGEMM's SM90 kernel walks within bounds for these
    lengths [B] (each <= `limit`, static), whatever `meta` holds; DeepGEMM's own schedule of
    `lens` comes back unchanged.

    The kernel (sm90_fp8_paged_mqa_logits.cuh with its scheduler, DeepGEMM 2.5) starts SM s at
    the (row, 256-token split) meta[s] and walks splits in row-major order, one task per split
    and at least one per row, until it reaches meta[s + 1] exactly; it writes logits columns
    [256 y, 256 y + 256) of a task unguarded, and reads context_lens at its start row. So the
    entries are rounded up into the tasks that exist, made non-decreasing, the first at the
    first non-empty row, the starts below row B and the sentinel (B, 0): every task is then
    walked exactly once, by some SM, and nothing past a row's splits or the batch is touched.
    Each task's result depends on its row and blocks alone: the logits are bitwise the same."""
    b = lens.shape[0]
    k = contracts.cdiv(limit, SPLIT_KV) + 1          # splits per row, as a key's radix
    assert (b + 1) * k < 2 ** 31, "paged schedule key overflows int32"
    tasks = jnp.maximum((lens + SPLIT_KV - 1) // SPLIT_KV, 1)   # >= 1 a row
    q = jnp.clip(meta[:, 0], 0, b)
    y = jnp.maximum(meta[:, 1], 0)
    over = y >= jnp.where(q < b, tasks[jnp.minimum(q, b - 1)], 1)
    key = jnp.where(over, jnp.minimum(q + 1, b) * k, q * k + y)      # past a row: the next one
    first = jnp.where(jnp.any(lens > 0), jnp.argmax(lens > 0), b - 1).astype(jnp.int32)
    key = jnp.minimum(key.at[0].set(first * k), (b - 1) * k + tasks[b - 1] - 1).at[-1].set(b * k)
    key = jax.lax.cummax(key)
    return jnp.stack([key // k, key % k], axis=1).astype(jnp.int32)


def split_kv_cache(kv_cache: jax.Array, *, mx_scales: bool = False, value_dtype=jnp.float8_e4m3fn):
    """uint8 [num_blocks, block, 1, D + 4] in DeepGEMM's block layout (each block: its tokens'
    D-byte rows, then their 4-byte scales) -> (values [num_blocks, block, D] of `value_dtype`,
    scales [num_blocks, block]: float32, or int32 packed UE8M0 with `mx_scales`)."""
    nb, blk, _, dp4 = kv_cache.shape
    d = dp4 - SCALE_BYTES
    flat = kv_cache.reshape(nb, blk * dp4)
    values = jax.lax.bitcast_convert_type(flat[:, :blk * d].reshape(nb, blk, d), value_dtype)
    scales = jax.lax.bitcast_convert_type(flat[:, blk * d:].reshape(nb, blk, SCALE_BYTES),
                                          jnp.int32 if mx_scales else jnp.float32)
    return values, scales


def _dequant_q(q: jax.Array, q_sf: jax.Array | None) -> jax.Array:
    return q.astype(jnp.float32) if q_sf is None else mx_dequant(q, q_sf)


def _dequant_k(values: jax.Array, scales: jax.Array, mx: bool) -> jax.Array:
    return mx_dequant(values, scales) if mx else values.astype(jnp.float32) * scales[..., None]


def _chunk(rows: int, bytes_per_row: int) -> int:
    return max(1, min(rows, _CHUNK_BYTES // max(bytes_per_row, 1)))


# --- dense paged logits -----------------------------------------------------------------------

def paged_mqa_logits(q, q_sf, kv_cache, weights, context_lens, block_tables, *,
                     max_model_len: int) -> jax.Array:
    """float32 [B * next_n, max_model_len] for q [B, next_n, H, D] (float8, with optional
    packed UE8M0 scales [B, next_n, H], which also switch the cache's scales to UE8M0),
    kv_cache uint8 [num_blocks, block, 1, D + 4], weights [B * next_n, H],
    context_lens int32 [B, next_n] (row b*next_n + j valid for t < context_lens[b, j]),
    block_tables int32 [B, max_blocks] (an entry outside [0, num_blocks) ends its request's
    context at that block). The varlen form is the case next_n = 1."""
    b, next_n, h, _ = q.shape
    mx = q_sf is not None
    values, scales = split_kv_cache(kv_cache, mx_scales=mx, value_dtype=q.dtype)
    nb, blk = values.shape[:2]
    width = block_tables.shape[1]
    t = width * blk
    qf = _dequant_q(q, q_sf)
    d = qf.shape[-1]
    w = weights.astype(jnp.float32).reshape(b, next_n, h)
    # A table entry outside [0, num_blocks) ends the request's context at that block (the op's
    # documented result): rows are cut to its first token, and block 0 stands in for it.
    bad = (block_tables < 0) | (block_tables >= nb)
    first_bad = jnp.min(jnp.where(bad, jnp.arange(width, dtype=jnp.int32)[None, :], width), axis=1)
    block_tables = jnp.where(bad, 0, block_tables)
    ctx = jnp.minimum(context_lens.reshape(b, next_n), first_bad[:, None] * blk)
    pos = jnp.arange(t, dtype=jnp.int32)

    def one(args):
        qb, wb, cb, tb = args
        k = _dequant_k(values[tb], scales[tb], mx).reshape(t, d)
        logits = weighted_relu_logits(qb, k, wb)                        # [next_n, T]
        return jnp.where(pos[None, :] < cb[:, None], logits, NEG_INF)

    per_row = 4 * t * (next_n * h + 2 * d)
    out = jax.lax.map(one, (qf, w, ctx, block_tables), batch_size=_chunk(b, per_row))
    out = out.reshape(b * next_n, t)
    if t >= max_model_len:
        return out[:, :max_model_len]
    return jnp.pad(out, ((0, 0), (0, max_model_len - t)), constant_values=NEG_INF)


# --- sparse paged logits (SM100 kernels) ------------------------------------------------------
#
# The metadata buffer is described in jax_dg.contracts (paged form: header [context_lens |
# indices], then the backend's part; the references' part is an int32 [M, nmsb, 2] table of
# (cache slot of the candidate block's first token, its valid tokens)).

def paged_sparse_valid(context_lens, sparse_kv_block_indices, sparse_block_kv: int):
    """(logical token [M, nmsb*sbk], valid [M, nmsb*sbk]) of each output column: token
    indices[m, j]*sbk + o, valid for j < min(ceil(len / sbk), nmsb) and 0 <= token < len."""
    ctx = jnp.maximum(context_lens.reshape(-1).astype(jnp.int32), 0)
    return sparse_columns(jnp.zeros_like(ctx), ctx, sparse_kv_block_indices, sparse_block_kv)


def paged_sparse_table(context_lens, block_table, sparse_kv_block_indices, *, page_kv: int,
                       sparse_block_kv: int) -> jax.Array:
    """The references' schedule: int32 [M, nmsb, 2] = (slot of the block's first token, valid tokens)."""
    m, nmsb = sparse_kv_block_indices.shape
    sbk = sparse_block_kv
    _, valid = paged_sparse_valid(context_lens, sparse_kv_block_indices, sbk)
    start = sparse_kv_block_indices.astype(jnp.int32) * sbk
    page_idx = jnp.clip(start // page_kv, 0, block_table.shape[1] - 1)
    page = jnp.take_along_axis(block_table, page_idx, axis=1)
    count = valid.reshape(m, nmsb, sbk).sum(-1, dtype=jnp.int32)
    return jnp.stack([page * page_kv + start % page_kv, count], -1).astype(jnp.int32)


def paged_sparse_mqa_logits_metadata(context_lens, block_table, sparse_kv_block_indices, *,
                                     page_kv: int, sparse_block_kv: int, size: int) -> jax.Array:
    """uint8 [size]: the header, then the references' table, then zeros."""
    m, nmsb = sparse_kv_block_indices.shape
    table = paged_sparse_table(context_lens, block_table, sparse_kv_block_indices, page_kv=page_kv,
                               sparse_block_kv=sparse_block_kv)
    return pack_sparse_header([context_lens.reshape(-1), sparse_kv_block_indices], m, nmsb,
                              paged=True, backend_part=table, size=size)


def paged_sparse_mqa_logits(q, q_sf, kv_cache, weights, metadata, *, num_max_sparse_blocks: int,
                            sparse_block_kv: int) -> jax.Array:
    """bfloat16 [M, nmsb * sbk]: column j*sbk + o scores the o-th token of row m's j-th candidate
    block (read through the metadata's table); columns that score no token are -inf.
    q: MXFP8 float8_e4m3fn [M, 1, H, 128] or packed MXFP4 int8 [M, 1, H, 64], q_sf int32 [M, 1, H]."""
    m, _, h, dq = q.shape
    nmsb, sbk = num_max_sparse_blocks, sparse_block_kv
    header = contracts.sparse_header_bytes(m, nmsb, paged=True)
    table = jax.lax.bitcast_convert_type(
        metadata[header:header + m * nmsb * 8].reshape(m, nmsb, 2, 4), jnp.int32)
    slot, count = table[..., 0], table[..., 1]
    values, scales = split_kv_cache(kv_cache, mx_scales=True, value_dtype=q.dtype)
    flat_v = values.reshape(-1, dq)
    flat_s = scales.reshape(-1)
    o = jnp.arange(sbk, dtype=jnp.int32)
    qf = _dequant_q(q[:, 0], q_sf[:, 0])
    w = weights.astype(jnp.float32)

    def one(args):
        qr, wr, sr, cr = args
        tok = jnp.clip(sr[:, None] + o, 0, flat_v.shape[0] - 1).reshape(-1)
        logits = weighted_relu_logits(qr[None], _dequant_k(flat_v[tok], flat_s[tok], True), wr[None])[0]
        return jnp.where((o[None, :] < cr[:, None]).reshape(-1), logits, NEG_INF)

    d = qf.shape[-1]
    out = jax.lax.map(one, (qf, w, slot, count), batch_size=_chunk(m, 4 * nmsb * sbk * (h + 2 * d)))
    return out.astype(jnp.bfloat16)
