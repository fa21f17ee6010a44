"""What an op's run function receives first (`rt`, a `Run`): the call's kernels and jax_dg's torch
helpers. Run functions are written in the op modules against this object alone, so the
trace-time half imports no torch:

    rt.dg                       DeepGEMM's API: the symbols the trace resolved
                                (jax_dg.core.dispatch), or the torch emulation of that contract
    rt.land(out, make, lands)   DeepGEMM's own allocation placed in XLA's result `out`
                                (jax_dg.runtime.landing)
    rt.dtype, rt.dims, rt.mn_major_view, rt.row_aligned, rt.write_sparse_metadata, ...
                                the helpers below: dtypes by name, DeepGEMM's keywords, views
                                of XLA's buffers, the sparse metadata, one-pass cleaning

Cached constants keep the hot path free of allocations.
"""

from __future__ import annotations

from typing import Callable

import torch

from jax_dg import contracts
from jax_dg.runtime import landing


def dims(compiled_dims: str | None) -> dict:
    """DeepGEMM's `compiled_dims` keyword when the caller chose one (None: DeepGEMM's default)."""
    return {} if compiled_dims is None else {"compiled_dims": compiled_dims}


def dtype(name: str) -> torch.dtype:
    """torch's dtype of a jnp dtype name ("float8_e4m3fn", "int8", ...)."""
    return getattr(torch, name)


# --- scales as DeepGEMM wants them: MN-major, TMA-aligned views of XLA buffers --------------

_MN_MAJOR: dict = {}


def mn_major_view(physical: torch.Tensor, mn: int) -> torch.Tensor:
    """The logical [(G,) MN, K'] scales DeepGEMM's get_mn_major_tma_aligned_tensor returns as
    they are (no allocation, no transpose): a strided view of the physical buffer
    [(G,) K', align(MN, 4)] built in the jitted program (jax_dg.operands.scales)."""
    key = (physical.data_ptr(), tuple(physical.shape), mn)
    view = _MN_MAJOR.get(key)
    if view is None:
        *g, k, amn = physical.shape
        size, stride = (mn, k), (1, amn)
        if g:
            size, stride = (g[0], mn, k), (k * amn, 1, amn)
        if len(_MN_MAJOR) >= 4096:
            _MN_MAJOR.clear()
        view = _MN_MAJOR[key] = physical.as_strided(size, stride)
    return view


# --- output cleaning: -inf at invalid positions, fused with the copy out --------------------

_COLUMNS: dict = {}
_NEG_INF: dict = {}


def neg_inf(like: torch.Tensor) -> torch.Tensor:
    """A 0-d -inf tensor of `like`'s dtype on its device (cached)."""
    key = (like.device, like.dtype)
    value = _NEG_INF.get(key)
    if value is None:
        value = _NEG_INF[key] = torch.full((), float("-inf"), dtype=like.dtype, device=like.device)
    return value


def columns(like: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [1, n] column indices on `like`'s device (cached)."""
    key = (like.device, n)
    value = _COLUMNS.get(key)
    if value is None:
        value = _COLUMNS[key] = torch.arange(n, dtype=torch.int32, device=like.device)[None]
    return value


def where_valid(out: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor) -> None:
    """out = logits where `valid`, -inf elsewhere: one pass."""
    torch.where(valid, logits, neg_inf(out), out=out)


def row_aligned(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x, or a copy whose rows start `multiple` elements apart (16-byte rows for TMA)."""
    m, h = x.shape
    if h % multiple == 0:
        return x
    padded = torch.zeros((m, contracts.align(h, multiple)), dtype=x.dtype, device=x.device)
    padded[:, :h].copy_(x)
    return padded[:, :h]


# --- the sparse metadata buffer (layout in jax_dg.contracts) ---------------------------------

def write_sparse_metadata(out: torch.Tensor, vectors, meta: torch.Tensor, m: int, nmsb: int,
                          paged: bool, what: str) -> None:
    """Fills jax_dg's uint8 metadata `out`: the header's int32 vectors, then the backend's
    schedule `meta` (any dtype), zeros elsewhere."""
    used = contracts.sparse_header_used(m, nmsb, paged)
    header = contracts.sparse_header_bytes(m, nmsb, paged)
    head, start = out[:used].view(torch.int32), 0
    for v in vectors:
        v = v.reshape(-1)
        head[start:start + v.numel()].copy_(v)
        start += v.numel()
    out[used:header].zero_()
    meta = meta.contiguous().view(torch.uint8).reshape(-1)
    region = out[header:]
    if meta.numel() > region.numel():
        raise RuntimeError(f"jax_dg: {what} returned {meta.numel()} bytes; jax_dg sized "
                           f"{region.numel()} (DeepGEMM's layout changed? see "
                           "jax_dg.contracts.deep_gemm_sparse_metadata_bytes)")
    region[:meta.numel()].copy_(meta)
    region[meta.numel():].zero_()


def sparse_header(metadata: torch.Tensor, m: int, nmsb: int, paged: bool):
    """int32 views of the header's vectors: (ks, ke, indices [M, nmsb]), or
    (context_lens, indices [M, nmsb]) when paged."""
    head = metadata[:contracts.sparse_header_used(m, nmsb, paged)].view(torch.int32)
    k = contracts.sparse_header_vectors(paged)
    return tuple(head[i * m:(i + 1) * m] for i in range(k)) + (head[k * m:].view(m, nmsb),)


def sparse_payload(metadata: torch.Tensor, m: int, nmsb: int, paged: bool) -> torch.Tensor:
    """The backend's part of the metadata (what DeepGEMM's kernel reads)."""
    return metadata[contracts.sparse_header_bytes(m, nmsb, paged):]


def clean_sparse(out: torch.Tensor, logits: torch.Tensor, ks: torch.Tensor | None,
                 ke: torch.Tensor, idx: torch.Tensor, sbk: int) -> None:
    """out = logits where column (j, o) scores a valid key, -inf elsewhere. Column j*sbk + o
    scores key idx[i, j]*sbk + ks[i] % sbk + o, valid for j < min(ceil((ke-ks)/sbk), nmsb) and
    ks <= key < ke (paged: ks None = 0, ke = the context length)."""
    m, nmsb = idx.shape
    if ks is None:
        ks = torch.zeros_like(ke)
    o = torch.arange(sbk, device=out.device, dtype=torch.int32)
    token = (idx[:, :, None] * sbk + (ks % sbk)[:, None, None] + o).view(m, nmsb * sbk)
    nvb = ((ke - ks).clamp(min=0) + (sbk - 1)).div(sbk, rounding_mode="floor").clamp(max=nmsb)
    valid = ((columns(out, nmsb * sbk) < (nvb * sbk)[:, None]) & (token >= ks[:, None])
             & (token < ke[:, None]))
    where_valid(out, valid, logits)


class Run:
    """One call site's run time, made once when the bridge prepares the site: its kernels
    (`dg`), where its own allocations land, and the helpers above."""

    int32 = torch.int32
    int64 = torch.int64
    dims = staticmethod(dims)
    dtype = staticmethod(dtype)
    mn_major_view = staticmethod(mn_major_view)
    row_aligned = staticmethod(row_aligned)
    write_sparse_metadata = staticmethod(write_sparse_metadata)
    sparse_header = staticmethod(sparse_header)
    sparse_payload = staticmethod(sparse_payload)
    clean_sparse = staticmethod(clean_sparse)

    def __init__(self, dg, lands_into: Callable):
        self.dg = dg
        self._lands_into = lands_into

    def land(self, out: torch.Tensor, make: Callable[[], torch.Tensor], lands: bool = True) -> None:
        """`make()` (a DeepGEMM call that allocates its result once) with that allocation
        placed in `out` where the trace decided it `lands`, else copied there
        (jax_dg.runtime.landing.land)."""
        landing.land(out, make, lands, self._lands_into)
