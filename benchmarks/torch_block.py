"""examples/deepseek_v32_block.py's Block written in PyTorch on deep_gemm's calls: bench_block.py's
rival, built from the same weights.

What a PyTorch user would write: FP8 weights quantised once, activations cast per token with
DeepGEMM's recipe, `fp8_gemm_nt`, the indexer's `fp8_fp4_mqa_logits` / paged logits with
`torch.topk`, the sparse attention and the MoE routing in torch ops, the experts on
`m_grouped_fp8_gemm_nt_masked`. `dg` is the deep_gemm module on a GPU; on CPU jax_dg's torch
emulation of it (jax_dg.backends.torch_emu, the same API) runs the same code, which is how the
tests check it against the JAX block. Prefill of one sequence, a decode step of B sequences
against the paged FP8 indexer cache, and a training step (`Block.train()`: the FP8 layers get
jax_dg.fp8_linear's backward written as torch autograd functions on deep_gemm: dgrad on the
weight's blocks transposed, wgrad along M with the (1, 1, 128) recipe, the experts' wgrad on
the k-grouped GEMM).
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")
BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


# --- DeepGEMM's FP8 casts (deep_gemm/utils/math.py, float32 scales) ---------------------------

# DeepGEMM's `amax / 448.0` as torch computes it on CUDA tensors (a multiplication by the float
# reciprocal, ATen's div_true_kernel_cuda), written out so that the CPU run (--tiny) does the same
INV_448 = 1.0 / 448.0


def per_token_cast_to_fp8(x: torch.Tensor):
    """[M, K] -> (float8 [M, K], float32 [M, ceil(K / 128)]), K zero-padded to 128s."""
    m, k = x.shape
    kp = -(-k // 128) * 128
    v = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, kp // 128, 128)
    sf = v.abs().amax(dim=2).clamp(min=1e-4) * INV_448
    return (v * (1.0 / sf.unsqueeze(2))).to(FP8).view(m, kp)[:, :k].contiguous(), sf


def per_block_cast_to_fp8(w: torch.Tensor):
    """[(E,) N, K] (multiples of 128) -> (float8 [(E,) N, K], float32 [(E,) N / 128, K / 128])."""
    *e, n, k = w.shape
    v = w.float().view(*e, n // 128, 128, k // 128, 128)
    sf = v.abs().amax(dim=(-3, -1)).clamp(min=1e-4) * INV_448
    return (v * (1.0 / sf[..., :, None, :, None])).to(FP8).view(*e, n, k), sf


def per_row_cast_to_fp8(x: torch.Tensor):
    """[N, D] -> (float8 [N, D], float32 [N]): one scale per row (the indexer's)."""
    sf = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-4) * INV_448
    return (x.float() * (1.0 / sf)).to(FP8), sf.view(-1)


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [M, k]: torch.topk's columns, -1 where the value is -inf or past the row."""
    take = min(k, logits.shape[1])
    v, i = torch.topk(logits, take, dim=1)
    i = torch.where(v > NEG_INF, i, -1).int()
    return torch.nn.functional.pad(i, (0, k - take), value=-1) if take < k else i


def deep_gemm_or_emulation():
    """deep_gemm where there is a CUDA device, else jax_dg's torch emulation of its API."""
    if torch.cuda.is_available():
        import deep_gemm
        return deep_gemm
    from jax_dg.backends import torch_emu
    return torch_emu


def to_torch(x) -> torch.Tensor:
    """A JAX array's values as a torch tensor of its own, on the array's device (FP8 through a
    uint8 view: DLPack has no FP8 type)."""
    import jax
    import jax.numpy as jnp
    if x.dtype == jnp.float8_e4m3fn:
        return to_torch(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(FP8)
    return torch.from_dlpack(x).clone()


def _gemm(dg, a, b, out_dtype=BF16, c=None, recipe=None):
    """a @ b.T with DeepGEMM's fp8_gemm_nt: a new [M, N] output, or accumulated onto c."""
    out = torch.empty(a[0].shape[0], b[0].shape[0], dtype=out_dtype, device=a[0].device) if c is None else c
    dg.fp8_gemm_nt(a, b, out, c=c, recipe=recipe)
    return out


def _wgrad(dg, g, x):
    """dw = g.T @ x [N, K] float32: both cast along M (rows padded to 16), (1, 1, 128) recipe."""
    pad = -g.shape[0] % 16
    gt = torch.nn.functional.pad(g, (0, 0, 0, pad)).T.contiguous()
    xt = torch.nn.functional.pad(x, (0, 0, 0, pad)).T.contiguous()
    dw = torch.zeros(gt.shape[0], xt.shape[0], dtype=F32, device=g.device)
    return _gemm(dg, per_token_cast_to_fp8(gt), per_token_cast_to_fp8(xt), c=dw, recipe=(1, 1, 128))


class FP8LinearFn(torch.autograd.Function):
    """jax_dg.fp8_linear's recipe: y = x @ w.T, forward and backward FP8 GEMMs."""

    @staticmethod
    def forward(ctx, x, w, dg):
        wq = per_block_cast_to_fp8(w)
        ctx.save_for_backward(x, *wq)
        ctx.dg = dg
        return _gemm(dg, per_token_cast_to_fp8(x), wq)

    @staticmethod
    def backward(ctx, gy):
        x, wv, wsf = ctx.saved_tensors
        g = gy.to(BF16).contiguous()
        dx = _gemm(ctx.dg, per_token_cast_to_fp8(g), (wv.T.contiguous(), wsf.T.contiguous()))
        return dx, _wgrad(ctx.dg, g, x).to(BF16), None


class Linear:
    """FP8Linear: the kernel [in, out] as [out, in]; for inference quantised once per 128 x 128
    block, for training (Block.train) a parameter quantised on every call, as jax_dg does."""

    def __init__(self, dg, module):
        self.dg = dg
        self.weight = to_torch(module.kernel[...]).T.contiguous()
        self.w, self.sf = per_block_cast_to_fp8(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad and torch.is_grad_enabled():
            return FP8LinearFn.apply(x, self.weight, self.dg)
        return _gemm(self.dg, per_token_cast_to_fp8(x), (self.w, self.sf))


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
        self.k_scale, self.k_bias = to_torch(m.k_norm.scale[...]), to_torch(m.k_norm.bias[...])
        self.w_proj = to_torch(m.weights_proj.kernel[...])
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


def _cast_groups(x):
    """[G, M, K] -> per-token FP8 values [G, M, K] and scales [G, M, ceil(K / 128)]."""
    g, m, k = x.shape
    v, sf = per_token_cast_to_fp8(x.reshape(g * m, k))
    return v.view(g, m, k), sf.view(g, m, -1)


def _masked(dg, a, b, masked_m, hint):
    out = torch.empty(a[0].shape[0], a[0].shape[1], b[0].shape[1], dtype=BF16, device=a[0].device)
    dg.m_grouped_fp8_gemm_nt_masked(a, b, out, masked_m, hint)
    return out


class FP8GroupedFn(torch.autograd.Function):
    """jax_dg.fp8_grouped_linear: y[g] = x[g] @ w[g].T over each group's first masked_m rows."""

    @staticmethod
    def forward(ctx, x, w, masked_m, hint, dg):
        wq = per_block_cast_to_fp8(w)
        ctx.save_for_backward(x, masked_m, *wq)
        ctx.dg, ctx.hint = dg, hint
        return _masked(dg, _cast_groups(x), wq, masked_m, hint)

    @staticmethod
    def backward(ctx, gy):
        x, masked_m, wv, wsf = ctx.saved_tensors
        dg, (groups, mmax, k) = ctx.dg, x.shape
        rows = torch.arange(mmax, device=x.device)[None, :, None] < masked_m[:, None, None]
        g = torch.where(rows, gy, 0).to(BF16)
        dx = _masked(dg, _cast_groups(g), (wv.transpose(1, 2).contiguous(), wsf.transpose(1, 2).contiguous()),
                     masked_m, ctx.hint)
        n = g.shape[2]
        qa = _cast_groups(g.transpose(1, 2).contiguous())                    # [G, N, Mmax]
        qb = _cast_groups(torch.where(rows, x, 0).to(BF16).transpose(1, 2).contiguous())
        a = (qa[0].reshape(-1), qa[1].transpose(1, 2).reshape(-1, n))        # scales [G*Mmax/128, N]
        b = (qb[0].reshape(-1), qb[1].transpose(1, 2).reshape(-1, k))
        dw = torch.zeros(groups, n, k, dtype=F32, device=x.device)
        ks = torch.full((groups,), mmax, dtype=torch.int32, device=x.device)
        # DeepGEMM reads the scales as [M, sum(ks) / 128] MN-major: transposed views
        dg.k_grouped_fp8_gemm_nt_contiguous((a[0], a[1].T), (b[0], b[1].T), dw, [mmax] * groups, ks, c=dw)
        return dx, dw.to(BF16), None, None, None


class MoE:
    """jax_dg.nn.MoE's masked layout: experts' rows in [E, capacity, dim], masked grouped GEMMs."""

    def __init__(self, dg, m):
        self.dg, self.e, self.k = dg, m.n_experts, m.topk
        self.route_scale, self.m = m.route_scale, m
        assert m.n_groups == 1, "group-limited routing is not written here"
        self.gate, self.bias = to_torch(m.gate[...]), to_torch(m.gate_bias[...])
        self.w13_weight, self.w2_weight = to_torch(m.w13[...]), to_torch(m.w2[...])
        self.w13, self.w2 = per_block_cast_to_fp8(self.w13_weight), per_block_cast_to_fp8(self.w2_weight)
        self.shared_in, self.shared_out = Linear(dg, m.shared_in), Linear(dg, m.shared_out)

    def _grouped(self, a, weight, w, masked_m, hint):
        if weight.requires_grad and torch.is_grad_enabled():
            return FP8GroupedFn.apply(a, weight, masked_m, hint, self.dg)
        return _masked(self.dg, _cast_groups(a), w, masked_m, hint)

    def __call__(self, x):
        t, dim = x.shape
        scores = torch.sigmoid(x.float() @ self.gate.T)
        experts = torch.topk(scores + self.bias, self.k, dim=1).indices
        weights = scores.gather(1, experts)
        weights = weights / weights.sum(-1, keepdim=True) * self.route_scale
        cap = self.m.capacity(t)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # (torch.bincount reads its input's max on the host: it cannot be captured in a graph)
        counts = torch.zeros(self.e, dtype=flat.dtype, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        rank = torch.empty_like(flat)
        rank[order] = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        kept = rank < cap
        slot = torch.where(kept, flat * cap + rank, self.e * cap)   # the last row: dropped
        a = torch.zeros(self.e * cap + 1, dim, dtype=BF16, device=x.device)
        a[slot] = x.repeat_interleave(self.k, dim=0)
        masked_m = counts.clamp(max=cap).int()
        hint = max(1, -(-t * self.k // self.e))
        h = self._grouped(a[:-1].view(self.e, cap, dim), self.w13_weight, self.w13, masked_m, hint)
        y = self._grouped(swiglu(h), self.w2_weight, self.w2, masked_m, hint).view(self.e * cap, dim)
        y = torch.cat([y, y.new_zeros(1, dim)])[slot].view(t, self.k, dim).float()
        y = (y * weights[:, :, None]).sum(1).to(BF16)
        shared = self.shared_out(swiglu(self.shared_in(x)))
        return (y.float() + shared.float()).to(BF16)


class Block:
    """The example's Block (same weights, same roundings where the JAX code rounds)."""

    def __init__(self, dg, block):
        self.dg, self.heads, self.hd = dg, block.heads, block.hd
        self.embed = to_torch(block.embed.embedding[...])
        self.norm1, self.norm2 = to_torch(block.norm1.scale[...]), to_torch(block.norm2.scale[...])
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

    def parameters(self) -> list[torch.Tensor]:
        """What the JAX block trains (nnx.Param): all but the indexer's weights (its output is
        an index: no gradient reaches them) and the router's bias."""
        return [self.embed, self.norm1, self.norm2, self.moe.gate, self.moe.w13_weight, self.moe.w2_weight] + [
            lin.weight for lin in (self.wq_a, self.wq_b, self.wkv, self.wo, self.head,
                                   self.moe.shared_in, self.moe.shared_out)]

    def train(self) -> "Block":
        """Make the parameters require gradients: the FP8 layers then run their autograd
        functions (weights quantised per call) under grad mode."""
        for p in self.parameters():
            p.requires_grad_(True)
        return self

    def loss(self, pattern: torch.Tensor) -> torch.Tensor:
        """The example's toy task: next-token cross entropy of pattern [S + 1]."""
        logits = self.prefill(pattern[:-1])[0]
        return torch.nn.functional.cross_entropy(logits.float(), pattern[1:].long())

    def prefill(self, tokens):
        """tokens [T] (one sequence, causal) -> (logits [T, vocab], (indexer keys, K, V))."""
        x = self.embed[tokens]
        h = rms_norm(x, self.norm1).to(BF16)
        qr = self.wq_a(h)
        with torch.no_grad():   # indices: nothing to differentiate
            idx, keys = self.indexer.prefill(h.detach(), qr.detach())
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
