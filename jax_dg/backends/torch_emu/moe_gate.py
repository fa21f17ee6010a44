"""Torch emulation of DeepGEMM's `bf16_mega_gate` (same signature and output convention).

See jax_dg/reference/moe_gate.py for the contract. `force_random` rows draw experts from
cuRAND inside the kernel: no deterministic reference exists, so they are refused here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["bf16_mega_gate"]


def _score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()  # threshold 20, as DeepGEMM's sqrt_softplus
    if scoring_func == "identity":
        return logits
    raise RuntimeError(f"bf16_mega_gate: unsupported MoE scoring function {scoring_func!r}")


def bf16_mega_gate(x, weight, num_topk, use_shared_as_routed, num_shared_experts,
                   routed_scaling_factor, ep_rank, scoring_func="sqrtsoftplus", mask=None,
                   bias=None, image_bias=None, image_token_mask=None, fix_routing_mask=None,
                   to_physical_map=None, logical_count=None, unmapped_topk_idx=None,
                   force_random=None, out=None):
    """Gate GEMM + top-k routing; writes `out=(topk_idx int64, topk_weights fp32)` and
    the logical top-k into `unmapped_topk_idx` when given. Returns (topk_idx, topk_weights)."""
    t, e = x.shape[0], weight.shape[0]
    s = num_shared_experts if use_shared_as_routed else 0
    if out is None:
        out = (torch.empty((t, num_topk + s), dtype=torch.int64, device=x.device),
               torch.empty((t, num_topk + s), dtype=torch.float32, device=x.device))
    topk_idx, topk_weights = out
    if t == 0:
        return topk_idx, topk_weights
    if force_random is not None and bool(force_random.any()):
        raise NotImplementedError("bf16_mega_gate (torch emulation): force_random rows are drawn "
                                  "by cuRAND in DeepGEMM's kernel and have no reference")
    logits = x.float() @ weight.float().T
    scores = _score(logits, scoring_func)
    if bias is None and image_bias is None:
        ranking = logits  # every scoring function is increasing: the kernel ranks raw logits
    else:
        b = torch.zeros((1, e), dtype=torch.float32, device=x.device) if bias is None else bias.float()[None]
        if image_bias is not None:
            b = torch.where(image_token_mask[:, None], image_bias.float()[None], b)
        ranking = scores + b
    selected = torch.sort(ranking, dim=1, descending=True, stable=True).indices[:, :num_topk]
    if fix_routing_mask is not None:   # a fixed row with an id outside [0, E) is routed afresh
        fixed = unmapped_topk_idx.long()
        keep = fix_routing_mask & ((fixed >= 0) & (fixed < e)).all(1)
        selected = torch.where(keep[:, None], fixed, selected)
    picked = scores.gather(1, selected)
    weights = picked / (picked.sum(dim=1, keepdim=True) + 1e-20) * routed_scaling_factor
    logical = selected
    if s:
        shared = (e + torch.arange(s, device=x.device)).expand(t, s)
        logical = torch.cat([selected, shared], dim=1)
        weights = torch.cat([weights, torch.ones((t, s), dtype=torch.float32, device=x.device)], dim=1)
    physical = logical
    if to_physical_map is not None:
        token = torch.arange(t, dtype=torch.int64, device=x.device)[:, None]
        spread = (token * 23333 + ep_rank) % (1 << 32)  # the kernel's uint32 arithmetic
        dup = spread % logical_count.long().clamp(1, to_physical_map.shape[1])[logical]
        physical = to_physical_map.long()[logical, dup]
    if mask is not None:
        physical = torch.where(mask[:, None], physical, -1)
        weights = torch.where(mask[:, None], weights, 0.0)
        selected = torch.where(mask[:, None], selected, -1)
    topk_idx.copy_(physical)
    topk_weights.copy_(weights)
    if unmapped_topk_idx is not None:
        unmapped_topk_idx.copy_(selected)
    return topk_idx, topk_weights
