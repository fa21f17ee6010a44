"""examples/deepseek_v32_block.py's Block written in PyTorch on deep_gemm's calls: bench_block.py's
rival, built from the same weights.

What a PyTorch user would write: FP8 weights quantised once, activations cast per token with
DeepGEMM's recipe, `fp8_gemm_nt`, the indexer's `fp8_fp4_mqa_logits` / paged logits with
`torch.topk`, the sparse attention and the MoE routing in torch ops, the experts on
`m_grouped_fp8_gemm_nt_masked`. `dg` is the deep_gemm module on a GPU; on CPU jax_dg's torch
emulation of it (jax_dg.backends.torch_emu, the same API) runs the same code, which is how the
tests check it against the JAX block. Forward only: prefill of one sequence, and a decode step of
B sequences against the paged FP8 indexer cache.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")
BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


# --- DeepGEMM's FP8 casts (deep_gemm/utils/math.py, float32 scales) ---------------------------

def per_token_cast_to_fp8(x: torch.Tensor):
    """[M, K] (K a multiple of 128) -> (float8 [M, K], float32 [M, K / 128])."""
    m, k = x.shape
    v = x.float().view(m, k // 128, 128)
    sf = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    return (v * (1.0 / sf.unsqueeze(2))).to(FP8).view(m, k), sf


def per_block_cast_to_fp8(w: torch.Tensor):
    """[N, K] (multiples of 128) -> (float8 [N, K], float32 [N / 128, K / 128])."""
    n, k = w.shape
    v = w.float().view(n // 128, 128, k // 128, 128)
    sf = v.abs().amax(dim=(1, 3)).clamp(min=1e-4) / 448.0
    return (v * (1.0 / sf[:, None, :, None])).to(FP8).view(n, k), sf


def per_row_cast_to_fp8(x: torch.Tensor):
    """[N, D] -> (float8 [N, D], float32 [N]): one scale per row (the indexer's)."""
    sf = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0
    return (x.float() * (1.0 / sf)).to(FP8), sf.view(-1)


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [M, k]: torch.topk's columns, -1 where the value is -inf or past the row."""
    take = min(k, logits.shape[1])
    v, i = torch.topk(logits, take, dim=1)
    i = torch.where(v > NEG_INF, i, -1).int()
    return torch.nn.functional.pad(i, (0, k - take), value=-1) if take < k else i


def _t(x) -> torch.Tensor:
    """A JAX array's values as a torch tensor of its own (on the array's device)."""
    return torch.from_dlpack(x).clone()


class Linear:
    """FP8Linear: the kernel [in, out] quantised once per 128 x 128 block as [out, in]."""

    def __init__(self, dg, module):
        self.dg = dg
        self.w, self.sf = per_block_cast_to_fp8(_t(module.kernel[...]).T.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.w.shape[0], dtype=BF16, device=x.device)
        self.dg.fp8_gemm_nt(per_token_cast_to_fp8(x), (self.w, self.sf), out)
        return out


def rms_norm(x, scale, eps=1e-6):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale


def rope(x: torch.Tensor, positions: torch.Tensor, dims: int, theta: float) -> torch.Tensor:
    """jax_dg.nn.indexer's rotate-half RoPE on the first `dims` features of x [T, (H,) D]."""
    half = dims // 2
    freqs = theta ** (-torch.arange(half, dtype=F32, device=x.device) / half)
    angle = positions.float()[:, None] * freqs
    if x.dim() == 3:
        angle = angle[:, None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:dims]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, xf[..., dims:]], dim=-1).to(x.dtype)


def hadamard(d: int, device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(BF16)


class Indexer:
    def __init__(self, dg, m):
        self.dg, self.h, self.d = dg, m.n_heads, m.head_dim
        self.rope_dims, self.theta, self.topk = m.rope_head_dim, m.rope_theta, m.topk
        self.wq_b, self.wk = Linear(dg, m.wq_b), Linear(dg, m.wk)
        self.k_scale, self.k_bias = _t(m.k_norm.scale[...]), _t(m.k_norm.bias[...])
        self.w_proj = _t(m.weights_proj.kernel[...])
        self.rot = hadamard(self.d, self.w_proj.device)

    def _rotate(self, x):
        return (x.float() @ self.rot).to(BF16)

    def keys(self, x, positions):
        k = torch.nn.functional.layer_norm(self.wk(x).float(), (self.d,), self.k_scale, self.k_bias, 1e-6)
        return self._rotate(rope(k.to(BF16), positions, self.rope_dims, self.theta))

    def queries(self, x, qr, positions):
        t = x.shape[0]
        q = self._rotate(rope(self.wq_b(qr).view(t, self.h, self.d), positions, self.rope_dims, self.theta))
        q_fp8, q_sf = per_row_cast_to_fp8(q.reshape(t * self.h, self.d))
        w = (x @ self.w_proj).float() * (self.h ** -0.5 * self.d ** -0.5)
        return q_fp8.view(t, self.h, self.d), w * q_sf.view(t, self.h)

    def prefill(self, x, qr):
        t = x.shape[0]
        pos = torch.arange(t, device=x.device)
        k = self.keys(x, pos)
        q, w = self.queries(x, qr, pos)
        ks = torch.zeros(t, dtype=torch.int32, device=x.device)
        ke = torch.arange(1, t + 1, dtype=torch.int32, device=x.device)
        logits = self.dg.fp8_fp4_mqa_logits((q, None), per_row_cast_to_fp8(k), w, ks, ke, clean_logits=True)
        return topk_indices(logits[:, :t], self.topk), k

    def decode(self, x, qr, cache):
        """cache: (kv_cache uint8 [nb, bs, 1, D + 4], block_tables int32 [B, W], lens int32 [B]),
        updated in place with the new keys (positions lens): (indices [B, topk], new lens)."""
        kv, table, lens = cache
        b, (nb, bs) = x.shape[0], kv.shape[:2]
        pos = lens.long()
        k_fp8, k_sf = per_row_cast_to_fp8(self.keys(x, pos))
        flat = kv.view(nb, bs * (self.d + 4))
        blk = table.gather(1, (pos // bs)[:, None]).long()
        off = (pos % bs)[:, None]
        flat[blk, off * self.d + torch.arange(self.d, device=x.device)] = k_fp8.view(torch.uint8)
        flat[blk, bs * self.d + off * 4 + torch.arange(4, device=x.device)] = k_sf[:, None].view(torch.uint8)
        lens = (lens + 1).view(b, 1)
        q, w = self.queries(x, qr, pos)
        max_len = table.shape[1] * bs
        meta = self.dg.get_paged_mqa_logits_metadata(lens, bs, self.dg.get_num_sms())
        logits = self.dg.fp8_fp4_paged_mqa_logits((q.view(b, 1, self.h, self.d), None), kv, w, lens,
                                                  table, meta, max_len, clean_logits=False)
        valid = torch.arange(max_len, device=x.device)[None, :] < lens
        return topk_indices(logits.masked_fill(~valid, NEG_INF), self.topk), lens.view(b)


class MoE:
    """jax_dg.nn.MoE's masked layout: experts' rows in [E, capacity, dim], masked grouped GEMMs."""

    def __init__(self, dg, m):
        self.dg, self.e, self.k = dg, m.n_experts, m.topk
        self.route_scale, self.m = m.route_scale, m
        assert m.n_groups == 1, "group-limited routing is not written here"
        self.gate, self.bias = _t(m.gate[...]), _t(m.gate_bias[...])
        self.w13 = self._experts(_t(m.w13[...]))
        self.w2 = self._experts(_t(m.w2[...]))
        self.shared_in, self.shared_out = Linear(dg, m.shared_in), Linear(dg, m.shared_out)

    @staticmethod
    def _experts(w):
        qs = [per_block_cast_to_fp8(we) for we in w]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])

    def _grouped(self, a, w, masked_m, hint):
        e, cap, k = a.shape
        aq, asf = per_token_cast_to_fp8(a.view(e * cap, k))
        out = torch.empty(e, cap, w[0].shape[1], dtype=BF16, device=a.device)
        self.dg.m_grouped_fp8_gemm_nt_masked((aq.view(e, cap, k), asf.view(e, cap, -1)), w, out, masked_m, hint)
        return out

    def __call__(self, x):
        t, dim = x.shape
        scores = torch.sigmoid(x.float() @ self.gate.T)
        experts = torch.topk(scores + self.bias, self.k, dim=1).indices
        weights = scores.gather(1, experts)
        weights = weights / weights.sum(-1, keepdim=True) * self.route_scale
        cap = self.m.capacity(t)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.e)
        rank = torch.empty_like(flat)
        rank[order] = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        kept = rank < cap
        slot = torch.where(kept, flat * cap + rank, self.e * cap)   # the last row: dropped
        a = torch.zeros(self.e * cap + 1, dim, dtype=BF16, device=x.device)
        a[slot] = x.repeat_interleave(self.k, dim=0)
        masked_m = counts.clamp(max=cap).int()
        hint = max(1, -(-t * self.k // self.e))
        h = self._grouped(a[:-1].view(self.e, cap, dim), self.w13, masked_m, hint)
        y = self._grouped(swiglu(h), self.w2, masked_m, hint).view(self.e * cap, dim)
        y = torch.cat([y, y.new_zeros(1, dim)])[slot].view(t, self.k, dim).float()
        y = (y * weights[:, :, None]).sum(1).to(BF16)
        shared = self.shared_out(swiglu(self.shared_in(x)))
        return (y.float() + shared.float()).to(BF16)


class Block:
    """The example's Block (same weights, same roundings where the JAX code rounds)."""

    def __init__(self, dg, block):
        self.dg, self.heads, self.hd = dg, block.heads, block.hd
        self.embed = _t(block.embed.embedding[...])
        self.norm1, self.norm2 = _t(block.norm1.scale[...]), _t(block.norm2.scale[...])
        self.wq_a, self.wq_b = Linear(dg, block.wq_a), Linear(dg, block.wq_b)
        self.wkv, self.wo, self.head = Linear(dg, block.wkv), Linear(dg, block.wo), Linear(dg, block.head)
        self.indexer, self.moe = Indexer(dg, block.indexer), MoE(dg, block.moe)

    def _after_attention(self, x, o):
        o = o.reshape(x.shape[0], -1).to(BF16)
        x = (x.float() + self.wo(o).float()).to(BF16)
        y = x.float() + self.moe(rms_norm(x, self.norm2).to(BF16)).float()
        return self.head(y.to(BF16))

    def _attend(self, q, kk, vv, idx):
        """q [T, H, hd] over its selected keys kk / vv [T, K, H, hd] (idx [T, K], -1 unused)."""
        s = torch.einsum("thd,tkhd->thk", q.float(), kk.float()) * self.hd ** -0.5
        s = s.masked_fill((idx < 0)[:, None, :], NEG_INF)
        return torch.einsum("thk,tkhd->thd", torch.softmax(s, dim=-1), vv.float())

    def prefill(self, tokens):
        """tokens [T] (one sequence, causal) -> (logits [T, vocab], (indexer keys, K, V))."""
        x = self.embed[tokens]
        h = rms_norm(x, self.norm1).to(BF16)
        qr = self.wq_a(h)
        idx, keys = self.indexer.prefill(h, qr)
        t = x.shape[0]
        kv = self.wkv(h).view(t, 2, self.heads, self.hd)
        q = self.wq_b(qr).view(t, self.heads, self.hd)
        sel = idx.clamp(min=0).long()
        o = self._attend(q, kv[:, 0][sel], kv[:, 1][sel], idx)
        return self._after_attention(x, o), (keys, kv[:, 0], kv[:, 1])

    def decode_step(self, tokens, cache, k_all, v_all):
        """tokens [B] at positions cache[2] -> logits [B, vocab]; the cache (kv_cache, tables,
        lens) and k_all / v_all [B, total, H, hd] are updated in place."""
        x = self.embed[tokens]
        h = rms_norm(x, self.norm1).to(BF16)
        qr = self.wq_a(h)
        pos = cache[2].long()
        idx, lens = self.indexer.decode(h, qr, cache)
        cache[2].copy_(lens)
        b = torch.arange(x.shape[0], device=x.device)
        kv = self.wkv(h).view(-1, 2, self.heads, self.hd)
        k_all[b, pos], v_all[b, pos] = kv[:, 0], kv[:, 1]
        q = self.wq_b(qr).view(-1, self.heads, self.hd)
        sel = idx.clamp(min=0).long()
        o = self._attend(q, k_all[b[:, None], sel], v_all[b[:, None], sel], idx)
        return self._after_attention(x, o)
