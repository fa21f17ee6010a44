"""Torch emulation of DeepGEMM's hyper-connection kernels, `mega_mhc` and `tf32_hc_prenorm_gemm`
(same signatures; they write the caller's outputs).

See jax_dg/reference/mhc.py for the contract. Strided SF outputs are honoured: y_gemm_sf is a
column-major view, y_shared_sf a view whose storage holds Mega MoE's shared-expert SF pages.
"""

from __future__ import annotations

import torch

from jax_dg.contracts import hc_split_bounds

__all__ = ["mega_mhc", "tf32_hc_prenorm_gemm"]


def _sinkhorn(v: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    v = v.softmax(dim=-1) + eps
    v = v / (v.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        v = v / (v.sum(dim=-1, keepdim=True) + eps)
        v = v / (v.sum(dim=-2, keepdim=True) + eps)
    return v


def _ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def _cast_fp8_packed_ue8m0(y: torch.Tensor, gran_k: int = 32):
    """DeepGEMM's per_token_cast_to_fp8(y, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)."""
    t, h = y.shape
    view = y.view(t, h // gran_k, gran_k)
    sf = _ceil_to_ue8m0(view.abs().float().amax(dim=2).clamp(1e-4) / 448.0)
    values = (view * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(t, h)
    packed = (sf.view(torch.int32) >> 23).to(torch.uint8).view(torch.int32)
    return values, packed


def _shared_sf_rows(t: int, block_m: int, device) -> torch.Tensor:
    token = torch.arange(t, device=device)
    i = token % block_m
    return (token // block_m * ((block_m + 127) // 128 * 128) + i // 128 * 128
            + i % 32 * 4 + i % 128 // 32)


@torch.no_grad()
def mega_mhc(x, residual, shifted_prev_mix, post_mix, comb_res_mix, fn, mix_scales, mix_bases,
             hc_mult, hc_norm_eps, hc_pre_eps, hc_post_scale, sinkhorn_eps, num_sinkhorn_iters,
             rmsnorm_weight, rmsnorm_eps, rmsnorm_scale, new_residual, new_prev_mix, new_post_mix,
             new_comb_res_mix, y_bf16=None, y_fp8=None, y_gemm_sf=None, y_routed_sf=None,
             y_shared_sf=None, shared_sf_block_m=0) -> None:
    t, h = x.shape
    if t == 0:
        return
    nr = (x.float().unsqueeze(1) * post_mix
          + torch.einsum("tij,tih->tjh", comb_res_mix.float(), residual.float())).bfloat16()
    new_residual.copy_(nr)
    nrf = nr.float()
    mixes = nrf.flatten(1) @ fn.float().T
    mixes = mixes * torch.rsqrt(nrf.square().sum((1, 2)) / (hc_mult * h) + hc_norm_eps).unsqueeze(1)
    scales = torch.cat((mix_scales[0].expand(hc_mult), mix_scales[1].expand(hc_mult),
                        mix_scales[2].expand(hc_mult * hc_mult)))
    mixes = mixes * scales + mix_bases
    prev = mixes[:, :hc_mult].sigmoid().unsqueeze(2) + hc_pre_eps
    new_post_mix.copy_((mixes[:, hc_mult:2 * hc_mult].sigmoid() * hc_post_scale).unsqueeze(2))
    new_comb_res_mix.copy_(_sinkhorn(mixes[:, 2 * hc_mult:].reshape(-1, hc_mult, hc_mult),
                                     num_sinkhorn_iters, sinkhorn_eps))
    if shifted_prev_mix is not None:
        new_prev_mix.copy_(prev)
        prev = shifted_prev_mix
    ni = (nrf * prev).sum(dim=1).bfloat16().float()
    y = (ni * torch.rsqrt(ni.square().mean(1) + rmsnorm_eps).unsqueeze(1)
         * (rmsnorm_weight.float() * rmsnorm_scale)).bfloat16()
    if y_bf16 is not None:
        y_bf16.copy_(y)
    if y_fp8 is None:
        return
    values, packed = _cast_fp8_packed_ue8m0(y)
    y_fp8.copy_(values)
    if y_gemm_sf is not None:
        y_gemm_sf.copy_(packed)
    if y_routed_sf is not None:
        y_routed_sf.copy_(packed)
    if y_shared_sf is not None:
        rows = (t + shared_sf_block_m - 1) // shared_sf_block_m * ((shared_sf_block_m + 127) // 128 * 128)
        pages = torch.as_strided(y_shared_sf, (rows, h // 128), y_shared_sf.stride(),
                                 y_shared_sf.storage_offset())
        pages[_shared_sf_rows(t, shared_sf_block_m, x.device)] = packed


# --- the hyper-connection pre-norm GEMM -----------------------------------------------------------

def tf32_hc_prenorm_gemm(a, b, d, sqr_sum, num_splits=None) -> None:
    """d = a.float() @ b.T and sqr_sum = sum(a.float()**2, -1), per split of K when num_splits
    is given (split s takes whole 64-wide K blocks, the remainder going to the first splits)."""
    x, w = a.float(), b.float()
    if num_splits is None:
        d.copy_(x @ w.T)
        sqr_sum.copy_(x.square().sum(-1))
        return
    for s, (start, end) in enumerate(hc_split_bounds(a.shape[1], num_splits)):
        d[s].copy_(x[:, start:end] @ w[:, start:end].T)
        sqr_sum[s].copy_(x[:, start:end].square().sum(-1))
