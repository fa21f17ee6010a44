"""Torch emulation of DeepGEMM's non-paged MQA-logits kernels (deep_gemm 2.5.0 signatures).

Like DeepGEMM, `fp8_fp4_mqa_logits` allocates and returns a row-padded view (so callers copy
it out), leaves what DeepGEMM leaves unwritten unwritten (filled with NaN here, so a caller
that forgets to clean it is caught), and refuses what DeepGEMM refuses.
"""

from __future__ import annotations

import torch

from jax_dg.backends.torch_emu.device import padded_empty
from jax_dg.contracts import align

__all__ = ["fp8_fp4_mqa_logits", "get_sparse_mqa_logits_metadata",
           "fp8_fp4_sparse_mqa_logits"]

BLOCK_KV = 256
# Scores held at once ([rows, H, N] float32 elements).
_CHUNK_ELEMENTS = 1 << 23   # scores per chunk: 64 MiB in float64


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"Assertion error (torch emulation of deep_gemm): {what}")


def weighted_relu_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h relu(q[m, h] . k[n]) * w[m, h] for float32 q [M, H, D], k [N, D], w [M, H] -> [M, N]."""
    m, h, _ = q.shape
    n = k.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_ELEMENTS // max(h * n, 1))
    k64 = k.double()
    for r0 in range(0, m, rows):
        # float64 sums: the result does not depend on the chunking or the BLAS's split (common.matmul)
        s = torch.einsum("mhd,nd->mhn", q[r0:r0 + rows].double(), k64).float().relu_()
        out[r0:r0 + rows] = torch.einsum("mhn,mh->mn", s.double(), w[r0:r0 + rows].double())
    return out


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                       max_seqlen_k=0, logits_dtype=None):
    """DeepGEMM's SM90 contract: logits[i, n] = (sum_h relu(q[i,h] . kv[n]) * w[i,h]) * kv_sf[n].

    Full form ([S, SK] view of a [align(S, 128/H), align(SK+256, 64)] buffer): every column is
    written; with clean_logits the columns outside [ks, ke) are -inf. Compressed form
    (max_seqlen_k > 0, clean_logits must be False): column t = position ks + t for
    t < min(ke, SK) - ks; the rest of the row is never written (NaN here).
    """
    (q_fp, q_sf), (kv_fp, kv_sf) = q, kv
    _check(q_sf is None, "not is_mx_sf (SM90 takes no q scale: fold it into weights)")
    seq_len, num_heads, head_dim = q_fp.shape
    seq_len_kv = kv_fp.shape[0]
    _check(head_dim in (32, 64, 128), "head_dim == 32 or head_dim == 64 or head_dim == 128")
    _check(num_heads in (16, 32, 64), "num_heads == 16 or num_heads == 32 or num_heads == 64")
    _check(q_fp.dtype == torch.float8_e4m3fn and kv_fp.dtype == torch.float8_e4m3fn, "qk e4m3")
    _check(kv_fp.shape[1] == head_dim, "head_dim == _head_dim")
    _check(tuple(kv_sf.shape) == (seq_len_kv,) and kv_sf.dtype == torch.float32, "kv_sf [SK] fp32")
    _check(tuple(weights.shape) == (seq_len, num_heads) and weights.dtype == torch.float32,
           "weights [S, H] fp32")
    ks, ke = cu_seq_len_k_start, cu_seq_len_k_end
    _check(ks.dtype == torch.int32 and ke.dtype == torch.int32 and ks.numel() == seq_len
           and ke.numel() == seq_len, "ks/ke int32 [S]")
    _check(max_seqlen_k >= 0, "max_seqlen_k >= 0")
    compressed = max_seqlen_k > 0
    _check(not (compressed and clean_logits), "not clean_logits")
    dtype = torch.float32 if logits_dtype is None else logits_dtype
    _check(dtype in (torch.float32, torch.bfloat16), "logits_dtype == kFloat32 or kBFloat16")
    width = align(max_seqlen_k, BLOCK_KV) if compressed else align(seq_len_kv + BLOCK_KV, 64)
    storage = padded_empty((align(seq_len, 128 // num_heads), width), dtype, q_fp.device)
    logits = storage[:seq_len, :max_seqlen_k if compressed else seq_len_kv]

    scores = weighted_relu_scores(q_fp.float(), kv_fp.float(), weights.float()) * kv_sf[None, :]
    # DeepGEMM reads keys [ks, ke) unchecked; here ranges are brought into 0 <= ks <= ke <= SK,
    # as jax_dg's ops do before the kernel (so both references define the same result).
    ks64 = ks.long().clamp(0, seq_len_kv)
    ke64 = torch.maximum(ke.long().clamp(max=seq_len_kv), ks64)
    if not compressed:
        if clean_logits:
            pos = torch.arange(seq_len_kv, device=scores.device)[None, :]
            scores = scores.masked_fill((pos < ks64[:, None]) | (pos >= ke64[:, None]), float("-inf"))
        logits.copy_(scores)
        return logits
    lens = ke64.clamp(max=seq_len_kv) - ks64
    _check(bool((lens <= max_seqlen_k).all()),
           "max_seqlen_k >= ke - ks (DeepGEMM does not check: it would write past the row)")
    t = torch.arange(max_seqlen_k, device=scores.device)[None, :]
    pos = ks64[:, None] + t
    ok = (t < lens[:, None]) & (pos >= 0)
    if seq_len_kv:
        gathered = scores.gather(1, pos.clamp(0, seq_len_kv - 1))
        logits.copy_(torch.where(ok, gathered.to(dtype), logits))
    return logits


# --- Sparse (SM100-only in DeepGEMM): jax_dg's own metadata and the gather-of-dense formula -------

def get_sparse_mqa_logits_metadata(cu_seq_len_k_start, cu_seq_len_k_end, num_kv_tokens,
                                   sparse_kv_block_indices, qk_dtype, sparse_block_kv,
                                   use_unaligned_ks=False):
    """The reference's metadata: int32 [ks | ke | indices] as bytes (DeepGEMM's is opaque)."""
    ks = cu_seq_len_k_start.to(torch.int32).reshape(-1)
    ke = cu_seq_len_k_end.to(torch.int32).reshape(-1)
    idx = sparse_kv_block_indices.to(torch.int32).reshape(-1)
    _check(sparse_block_kv in (8, 16), "sparse_block_kv == 8 or sparse_block_kv == 16")
    return torch.cat([ks, ke, idx]).view(torch.uint8)


def _unpack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    exps = sf.contiguous().view(torch.uint8).view(*sf.shape, 4).to(torch.int32)
    return (exps << 23).view(torch.float32)


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, (b >> 4) & 0xF], dim=-1).flatten(-2)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=packed.device)
    mag = table[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def mx_dequant(values: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    x = _unpack_fp4(values) if values.dtype in (torch.int8, torch.uint8) else values.float()
    return x * _unpack_ue8m0(sf).repeat_interleave(x.shape[-1] // 4, dim=-1)


def fp8_fp4_sparse_mqa_logits(q, kv, weights, metadata, num_max_sparse_blocks, sparse_block_kv,
                              use_unaligned_ks=False):
    """bf16 [M, nmsb*sbk]: column j*sbk+o scores token idx[i,j]*sbk + ks%sbk + o. Invalid
    columns are unspecified in DeepGEMM; here they hold NaN."""
    (q_fp, q_sf), (kv_fp, kv_sf) = q, kv
    m, _, _ = q_fp.shape
    nmsb, sbk = num_max_sparse_blocks, sparse_block_kv
    meta = metadata.view(torch.int32)
    ks, ke = meta[:m].long(), meta[m:2 * m].long()
    idx = meta[2 * m:2 * m + m * nmsb].view(m, nmsb).long()
    qf = mx_dequant(q_fp, q_sf)
    kf = mx_dequant(kv_fp, kv_sf)
    o = torch.arange(sbk, device=qf.device)
    token = (idx[:, :, None] * sbk + (ks % sbk)[:, None, None] + o).reshape(m, nmsb * sbk)
    nvb = ((ke - ks).clamp(min=0) + sbk - 1).div(sbk, rounding_mode="floor").clamp(max=nmsb)
    col = torch.arange(nmsb * sbk, device=qf.device)[None, :]
    valid = (col < (nvb * sbk)[:, None]) & (token >= ks[:, None]) & (token < ke[:, None])
    k_sel = kf[token.clamp(0, max(kf.shape[0] - 1, 0))]
    s = torch.einsum("mhd,mcd->mhc", qf, k_sel).relu_()
    logits = torch.einsum("mhc,mh->mc", s, weights.float())
    out = torch.full((align(m, 2), align(nmsb * sbk, 512)), float("nan"), dtype=torch.bfloat16,
                     device=qf.device)[:m, :nmsb * sbk]
    out.copy_(torch.where(valid, logits, torch.nan).to(torch.bfloat16))
    return out
