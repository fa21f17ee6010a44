"""Torch emulation of DeepGEMM's grouped GEMMs (same signatures as deep_gemm's).

Rows DeepGEMM leaves unspecified (-1 rows of the contiguous layout, rows past masked_m) are
written as 0 here, which is one of the values the contract allows.
"""

from __future__ import annotations

import torch

from jax_dg.backends.torch_emu.common import check_dims, dequant, matmul
from jax_dg.contracts import LEGACY_MK_ALIGNMENT

__all__ = ["m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
           "k_grouped_fp8_gemm_nt_contiguous",
           "m_grouped_bf16_gemm_nt_contiguous", "m_grouped_bf16_gemm_nn_contiguous",
           "m_grouped_bf16_gemm_nt_masked", "k_grouped_bf16_gemm_tn_contiguous",
           "get_mk_alignment_for_contiguous_layout",
           "set_mk_alignment_for_contiguous_layout"]

# DeepGEMM's BLOCK_M cap for contiguous layouts; the reference computes row by row, so it
# only records it (the ops set it as they set DeepGEMM's).
_mk_alignment = [LEGACY_MK_ALIGNMENT]


def get_mk_alignment_for_contiguous_layout() -> int:
    return _mk_alignment[0]


def set_mk_alignment_for_contiguous_layout(value: int) -> None:
    _mk_alignment[0] = int(value)


def _psum_rows(psum: torch.Tensor, m: int) -> torch.Tensor:
    """Per-row group ids (-1: in no group) of DeepGEMM's psum layout: group j holds rows
    [align(psum[j-1], A), psum[j]), A the current mk alignment."""
    a = _mk_alignment[0]
    ids = torch.full((m,), -1, dtype=torch.int32, device=psum.device)
    start = 0
    for j, end in enumerate(psum.tolist()):
        ids[start:max(start, min(end, m))] = j
        start = -(-end // a) * a
    return ids


def _contiguous(x, w, d, grouped_layout, use_psum_layout=False):
    if use_psum_layout:
        grouped_layout = _psum_rows(grouped_layout, d.shape[0])
    out = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
    for g in range(w.shape[0]):
        rows = grouped_layout == g
        out[rows] = matmul(x[rows], w[g].T)
    d.copy_(out)


def _masked(x, w, d, masked_m):
    rows = torch.arange(x.shape[1], device=x.device)[None, :] < masked_m[:, None].to(x.device)
    d.copy_(torch.where(rows[:, :, None], matmul(x, w.mT), 0))


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, compiled_dims="nk",
                                     disable_ue8m0_cast=False, use_psum_layout=False,
                                     expected_m_for_psum_layout=None) -> None:
    """d[r] = a[r] @ b[grouped_layout[r]].T; rows with id -1 (padding) -> 0. With
    use_psum_layout, grouped_layout [G] holds each group's end row."""
    check_dims(compiled_dims)
    _check(use_psum_layout or expected_m_for_psum_layout is None, "not expected_m_for_psum_layout")
    _contiguous(dequant(*a, 1, 128), dequant(*b, 128, 128), d, grouped_layout, use_psum_layout)


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, compiled_dims="nk",
                                 disable_ue8m0_cast=False) -> None:
    """d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T; the remaining rows -> 0."""
    check_dims(compiled_dims)
    _masked(dequant(*a, 1, 128), dequant(*b, 128, 128), d, masked_m)


def k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks, ks_tensor, c=None, recipe=(1, 1, 128),
                                     compiled_dims="mn") -> None:
    """d[g] = c[g] + A_g @ B_g.T; A_g is a[0]'s block g viewed [M, ks[g]], scaled by a[1][m, kb]."""
    check_dims(compiled_dims)
    (av, sfa), (bv, sfb) = a, b
    _, m, n = d.shape
    out = c.float().clone() if c is not None else torch.zeros(d.shape, device=d.device)
    av, bv, off = av.reshape(-1), bv.reshape(-1), 0
    for g, kg in enumerate(ks):
        if kg:
            blocks = slice(off // 128, (off + kg) // 128)
            x = dequant(av[off * m:(off + kg) * m].view(m, kg), sfa[:, blocks], 1, 128)
            y = dequant(bv[off * n:(off + kg) * n].view(n, kg), sfb[:, blocks], 1, 128)
            out[g] += x @ y.T
        off += kg
    d.copy_(out)


def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims="nk",
                                      use_psum_layout=False, expected_m_for_psum_layout=None) -> None:
    check_dims(compiled_dims)
    _check(use_psum_layout or expected_m_for_psum_layout is None, "not expected_m_for_psum_layout")
    _contiguous(a.float(), b.float(), d, grouped_layout, use_psum_layout)


def m_grouped_bf16_gemm_nn_contiguous(a, b, d, grouped_layout, compiled_dims="nk",
                                      use_psum_layout=False) -> None:
    """b [G, K, N] (MN-major B): DeepGEMM runs the nt kernel on b.transpose(1, 2)."""
    m_grouped_bf16_gemm_nt_contiguous(a, b.transpose(1, 2), d, grouped_layout, compiled_dims,
                                      use_psum_layout)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"Assertion error (torch emulation of deep_gemm): {what}")


def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims="nk") -> None:
    check_dims(compiled_dims)
    _masked(a.float(), b.float(), d, masked_m)



def k_grouped_bf16_gemm_tn_contiguous(a, b, d, ks, ks_tensor, c=None, compiled_dims="mn") -> None:
    """d[g] = c[g] + a[rows_g].T @ b[rows_g] (float32); DeepGEMM requires c."""
    check_dims(compiled_dims)
    _check(c is not None, "c.has_value()")
    out, off = c.float().clone(), 0
    for g, kg in enumerate(ks):
        if kg:
            out[g] += a[off:off + kg].float().T @ b[off:off + kg].float()
        off += kg
    d.copy_(out)
