"""Torch emulation of DeepGEMM's paged MQA-logits kernels (same signatures as deep_gemm 2.5.0).

It emulates the SM90 contract (with the SM count of torch_emu.device), including what DeepGEMM leaves undefined: logits are returned as a
view of a [rows, align(max_context_len, 256)] allocation; each request's next_n rows are
scored up to its *last* row's length, and everything after that is NaN (DeepGEMM leaves
unwritten memory there). The sparse kernels (SM100-only in DeepGEMM) use jax_dg's own
metadata encoding (see jax_dg.contracts).
"""

from __future__ import annotations

import torch

from jax_dg.backends.torch_emu.device import allocated, get_num_sms, padded_empty
from jax_dg.backends.torch_emu.mqa import mx_dequant
from jax_dg.contracts import SPLIT_KV

__all__ = [
    "get_paged_mqa_logits_metadata", "fp8_fp4_paged_mqa_logits",
    "get_paged_sparse_mqa_logits_metadata", "fp8_fp4_paged_sparse_mqa_logits",
]

def _expect(ok: bool, condition: str) -> None:
    if not ok:
        raise RuntimeError(f"Assertion error (jax_dg torch emulation of DeepGEMM): {condition}")


def _prefix_schedule(prefix: torch.Tensor, seg: torch.Tensor, hi: int):
    """upper_bound of each seg in the inclusive prefix, clamped to hi."""
    return torch.searchsorted(prefix, seg, right=True).clamp(max=hi)


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [num_sms + 1, 2]; DeepGEMM 2.5.0's scheduler (SM90: atoms = 1, 256-token splits)."""
    _expect(context_lens.dim() == 2, "context_lens.dim() == 2")
    _expect(context_lens.dtype == torch.int32, "context_lens.scalar_type() == torch::kInt")
    _expect(block_kv in (32, 64), "block_kv == 32 or block_kv == 64")
    dev = context_lens.device
    sm = torch.arange(num_sms + 1, device=dev, dtype=torch.int64)
    if indices is not None:
        return allocated(_varlen_metadata(context_lens.reshape(-1).long().clamp(min=0),
                                          indices.reshape(-1), sm))
    b = context_lens.shape[0]
    _expect(b > 0, "batch_size > 0")
    last = context_lens[:, -1].long().clamp(min=0)
    prefix = torch.cumsum((last + SPLIT_KV - 1) // SPLIT_KV, 0)
    total = prefix[-1]
    q, r = total // num_sms, total % num_sms
    sm = sm[:-1]
    seg = sm * q + (sm - (num_sms - r)).clamp(min=0)
    row = _prefix_schedule(prefix, seg, b - 1)
    base = torch.where(row > 0, prefix[(row - 1).clamp(min=0)], 0)
    n = prefix[row] - base
    off = seg - base
    atom = torch.where(n > 0, off // n.clamp(min=1), 0)
    split = torch.where(n > 0, off % n.clamp(min=1), 0)
    out = torch.stack([row + atom, split], 1)
    sentinel = torch.tensor([[b, 0]], device=dev, dtype=torch.int64)
    return allocated(torch.cat([out, sentinel]).to(torch.int32))


def _varlen_metadata(ctx: torch.Tensor, indices: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    m = ctx.shape[0]
    num_sms = sm.shape[0] - 1
    rows, lens, t = [], [], 0
    idx = indices.tolist()
    while t < m:                       # the kernel's atom walk (host loop: a reference)
        paired = t + 1 < m and idx[t] == idx[t + 1]
        rows.append(t)
        lens.append(int(ctx[t + 1] if paired else ctx[t]))
        t += 2 if paired else 1
    atom_rows = torch.tensor(rows + [m], device=ctx.device, dtype=torch.int64)
    prefix = torch.cumsum(torch.tensor(lens, device=ctx.device, dtype=torch.int64)
                          .add(SPLIT_KV - 1).div(SPLIT_KV, rounding_mode="floor"), 0)
    total = prefix[-1]
    q, r = total // num_sms, total % num_sms
    seg = sm * q + (sm - (num_sms - r)).clamp(min=0)
    atom = _prefix_schedule(prefix, seg, len(rows))
    split = seg - torch.where(atom > 0, prefix[(atom - 1).clamp(min=0)], 0)
    return torch.stack([atom_rows[atom], split], 1).to(torch.int32)


def _split_cache(cache: torch.Tensor, value_bytes: int, mx: bool, value_dtype=torch.float8_e4m3fn):
    """uint8 [nb, blk, 1, Dv+4] -> (values [nb, blk, Dv] of value_dtype, scales [nb, blk]: float32,
    or int32 packed UE8M0 with mx)."""
    nb, blk = cache.shape[:2]
    flat = cache.reshape(nb, blk * (value_bytes + 4))
    values = flat[:, :blk * value_bytes].contiguous().view(value_dtype).view(nb, blk, value_bytes)
    sf = flat[:, blk * value_bytes:].contiguous().view(torch.int32 if mx else torch.float32).view(nb, blk)
    return values, sf


def fp8_fp4_paged_mqa_logits(q, fused_kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, clean_logits=False, logits_dtype=None, indices=None):
    q_fp, q_sf = q
    mx = q_sf is not None
    _expect(q_fp.dim() == 4, "q.dim() == 4")
    b, next_n, h, d = q_fp.shape
    _expect(d in (32, 64, 128), "head_dim == 32 or head_dim == 64 or head_dim == 128")
    _expect(q_fp.is_contiguous() and q_fp.dtype == torch.float8_e4m3fn, "q contiguous float8_e4m3fn")
    _expect(next_n in (1, 2, 4), "next_n == 1 or next_n == 2 or next_n == 4")
    nb, blk, heads_kv, dsf = fused_kv_cache.shape
    _expect(blk in (32, 64), "block_kv == 32 or block_kv == 64")
    _expect(heads_kv == 1 and dsf == d + 4, "num_heads_kv == 1 and head_dim_with_sf == head_dim + sizeof(float)")
    _expect(fused_kv_cache.dtype == torch.uint8, "fused_kv_cache.scalar_type() == torch::kByte")
    _expect(tuple(weights.shape) == (b * next_n, h), "weights [batch_size * next_n, num_heads]")
    _expect(block_table.dim() == 2 and block_table.shape[0] == b and block_table.dtype == torch.int32,
            "block_table [batch_size, max_blocks] int32")
    _expect(context_lens.dim() == 2, "context_lens.dim() == 2")
    _expect(tuple(context_lens.shape) == (b, next_n) and context_lens.dtype == torch.int32,
            "context_lens [batch_size, next_n] int32")
    multicast = 2 if next_n == 4 and indices is None else 1
    _expect(tuple(schedule_meta.shape) == (get_num_sms() // multicast + 1, 2),
            "_schedule_meta_size == num_sms / num_kv_multicast + 1 and _meta_info_size == 2")
    _expect(not clean_logits, "not is_context_lens_2d")
    _expect(logits_dtype in (None, torch.float32, torch.bfloat16),
            "logits_dtype == torch::kFloat32 or logits_dtype == torch::kBFloat16")
    if indices is not None:
        _expect(next_n == 1 and tuple(indices.shape) == (b,), "varlen: next_n == 1, indices [batch_size]")
    if mx:
        _expect(tuple(q_sf.shape) == (b, next_n, h) and q_sf.dtype == torch.int32, "q_sf [B, next_n, H] int32")

    values, sf = _split_cache(fused_kv_cache, d, mx)
    width = block_table.shape[1]
    t = width * blk
    cols = min(t, max_context_len)
    # DeepGEMM reads table entries unchecked; here an entry outside [0, nb) ends the request's
    # context at that block, as jax_dg's ops define it (block 0 stands in for it).
    table = block_table.long()
    bad = (table < 0) | (table >= nb)
    first_bad = torch.where(bad, torch.arange(width, device=table.device), width).amin(1)
    table = table.masked_fill(bad, 0)
    qf = mx_dequant(q_fp, q_sf) if mx else q_fp.float()
    w = weights.float().view(b, next_n, h, 1)
    # DeepGEMM scores every row of a request up to its last row's length.
    scored = torch.minimum(context_lens[:, -1].long().clamp(0, cols), first_bad * blk)
    dtype = torch.float32 if logits_dtype is None else logits_dtype
    storage = padded_empty((b * next_n, -(-max_context_len // 256) * 256), dtype, q_fp.device)
    logits = storage[:, :max_context_len]
    step = max(1, (1 << 25) // max(next_n * h * t, 1))   # scores per chunk: 256 MiB in float64
    for b0 in range(0, b, step):
        b1 = min(b, b0 + step)
        rows = table[b0:b1]
        k = (mx_dequant(values[rows], sf[rows]) if mx else values[rows].float()).view(b1 - b0, t, d)
        s = torch.einsum("bnhd,btd->bnht", qf[b0:b1].double(), k.double()).float().relu_()
        out = (s * w[b0:b1]).sum(2)                                # [b, next_n, T]
        if not mx:   # the SM90 kernel scales after the head sum
            out = out * sf[rows].view(b1 - b0, 1, t)
        out = out[..., :cols]
        keep = torch.arange(cols, device=out.device)[None, None, :] < scored[b0:b1, None, None]
        logits[b0 * next_n:b1 * next_n, :cols] = torch.where(keep, out, float("nan")).view(-1, cols)
    return logits


# --- sparse (SM100 in DeepGEMM): the references' own schedule table -----------------------------

def get_paged_sparse_mqa_logits_metadata(context_lens, block_table, indices, page_kv,
                                         sparse_kv_block_indices, qk_dtype, sparse_block_kv):
    """int32 [M, nmsb, 2] as bytes: (cache slot of each candidate block's first token, its valid
    tokens). DeepGEMM's metadata is an opaque schedule; this one only the references read."""
    _expect(qk_dtype in (torch.float8_e4m3fn, torch.int8), "qk_dtype is float8_e4m3fn or int8")
    _expect(sparse_block_kv in (8, 16), "sparse_block_kv == 8 or sparse_block_kv == 16")
    _expect(page_kv % sparse_block_kv == 0, "page_kv % sparse_block_kv == 0")
    m, nmsb = sparse_kv_block_indices.shape
    _expect(context_lens.numel() == m and block_table.shape[0] == m and indices.numel() == m,
            "context_lens / block_table / indices have one entry per query row")
    sbk = sparse_block_kv
    ctx = context_lens.reshape(-1).long().clamp(min=0)
    start = sparse_kv_block_indices.long() * sbk
    nvb = ((ctx + sbk - 1) // sbk).clamp(max=nmsb)
    j = torch.arange(nmsb, device=ctx.device)
    count = torch.where(j[None, :] < nvb[:, None], (ctx[:, None] - start).clamp(0, sbk), 0)
    count = torch.where(start >= 0, count, 0)
    page = torch.gather(block_table.long(), 1, (start // page_kv).clamp(0, block_table.shape[1] - 1))
    table = torch.stack([page * page_kv + start % page_kv, count], -1).to(torch.int32)
    return table.reshape(-1).view(torch.uint8)


def fp8_fp4_paged_sparse_mqa_logits(q, kv_cache, weights, metadata, num_max_sparse_blocks,
                                    sparse_block_kv):
    """bf16 [M, nmsb*sbk] (a view of a padded buffer); columns that score no token hold NaN."""
    q_fp, q_sf = q
    _expect(q_sf is not None, "q_sf is required (packed UE8M0)")
    m, one, h, dq = q_fp.shape
    _expect(one == 1, "q [num_q_tokens, 1, H, D]")
    nmsb, sbk = num_max_sparse_blocks, sparse_block_kv
    table = metadata[:m * nmsb * 8].view(torch.int32).view(m, nmsb, 2).long()
    values, sf = _split_cache(kv_cache, dq, True, q_fp.dtype)
    values, sf = values.view(-1, dq), sf.view(-1)
    o = torch.arange(sbk, device=q_fp.device)
    tok = (table[..., :1] + o).clamp(0, values.shape[0] - 1).view(m, nmsb * sbk)
    k = mx_dequant(values[tok], sf[tok])                               # [M, C, D]
    qf = mx_dequant(q_fp[:, 0], q_sf[:, 0])                            # [M, H, D]
    s = torch.einsum("mhd,mcd->mhc", qf, k).relu_()
    logits = torch.einsum("mhc,mh->mc", s, weights.float())
    keep = (o[None, None, :] < table[..., 1:]).view(m, -1)
    storage = torch.full((m + m % 2, -(-nmsb * sbk // 512) * 512), float("nan"), dtype=torch.bfloat16,
                         device=q_fp.device)
    out = storage[:m, :nmsb * sbk]
    out.copy_(torch.where(keep, logits, float("nan")))
    return out
