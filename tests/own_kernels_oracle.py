"""Plain-torch specifications of jax_dg's own kernels (kernels/*.cu, ffi/native.cc): the test
oracle their native handlers (CUDA and the C++ CPU twin) are compared with. Not product code:
jax_dg runs the native handlers on every platform."""

from __future__ import annotations

import torch


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


def neg_inf_outside(logits, lo, hi, rows: int, cols: int, relative: bool = False) -> None:
    """logits[r, c] := -inf for r < rows, c < cols outside [lo[r], hi[r]) (lo None: 0), or with
    `relative` outside [0, hi[r] - lo[r]); the valid columns are not touched."""
    hi = hi[:rows]
    lo = torch.zeros_like(hi) if lo is None else lo[:rows]
    if relative:
        lo, hi = torch.zeros_like(hi), hi - lo
    col = torch.arange(cols, device=logits.device)[None, :]
    invalid = (col < lo.to(logits.device).long()[:, None]) | (col >= hi.to(logits.device).long()[:, None])
    logits[:rows, :cols].masked_fill_(invalid, float("-inf"))


def zero_masked_tail(d, masked_m) -> None:
    """d [G, Mmax, ...]: rows masked_m[g] <= r < Mmax of each group := 0."""
    rows = torch.arange(d.shape[1], device=d.device)[None, :] >= masked_m.to(d.device)[:, None]
    d.masked_fill_(rows.reshape(*rows.shape, *[1] * (d.ndim - 2)), 0)


def zero_padding_rows(d, layout, block: int, skip_padding_blocks: bool) -> None:
    """d [M, ...]: rows with layout[r] < 0 := 0, except, with skip_padding_blocks, in blocks of
    `block` rows whose first id is < 0."""
    pad = layout < 0
    if skip_padding_blocks:
        pad &= ~pad[::block].repeat_interleave(block)[:pad.shape[0]]
    d.masked_fill_(pad.reshape(-1, *[1] * (d.ndim - 1)), 0)
