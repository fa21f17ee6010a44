"""Torch reference of jax_dg's own top-k kernel (kernels/topk.cu): the same contract, exact."""

from __future__ import annotations

import torch

__all__ = ["topk_rows"]


def topk_rows(logits: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None,
              out: torch.Tensor, cols: int, sorted: bool = True) -> None:
    """out[r] (int32 [rows, k]) = the columns of row r's k largest logits among columns
    lo[r] <= c < min(hi[r], cols) with logits > -inf, value descending then index ascending
    (a stable sort in lax.top_k's total order, +0.0 above -0.0), or in column order when not
    `sorted`; -1 past the candidates."""
    rows, k = out.shape
    x = logits[:rows, :cols].float().contiguous()
    col = torch.arange(cols, device=x.device)[None, :]
    ok = x > float("-inf")                      # NaN and -inf are not candidates
    if lo is not None:
        ok &= col >= lo.long()[:, None]
    if hi is not None:
        ok &= col < hi.long()[:, None]
    # lax.top_k's total order (+0.0 above -0.0): the float's bits as an order-preserving int
    bits = x.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    none = torch.iinfo(torch.int32).min          # below every candidate's key
    key = torch.where(ok, key, none)
    take = min(k, cols)
    keys, idx = torch.sort(key, dim=1, descending=True, stable=True)
    keys, idx = keys[:, :take], idx[:, :take]
    idx = torch.where(keys > none, idx, cols)
    if not sorted:   # the same set in column order, -1 (cols, here) last
        idx = torch.sort(idx, dim=1).values
    out.fill_(-1)
    out[:, :take] = torch.where(idx < cols, idx, -1).to(torch.int32)
