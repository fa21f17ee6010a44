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


def ceil_to_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """float32 scales rounded up to powers of two on their bits (DeepGEMM's UE8M0 scales,
    DeepSeek's act_quant with scale_fmt "ue8m0")."""
    bits = sf.float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return (exp.clamp(1, 254) << 23).view(F32)


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False):
    """[M, K] -> (float8 [M, K], float32 [M, ceil(K / 128)]), K zero-padded to 128s."""
    m, k = x.shape
    kp = -(-k // 128) * 128
    v = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, kp // 128, 128)
    sf = v.abs().amax(dim=2).clamp(min=1e-4) * INV_448
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    return (v * (1.0 / sf.unsqueeze(2))).to(FP8).view(m, kp)[:, :k].contiguous(), sf


def dequant_blocks(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """FP8 [(E,) N, K] times its 128 x 128 block scales, rounded once to bf16 (DeepSeek's weight_dequant)."""
    full = sf.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :w.shape[-2], :w.shape[-1]]
    return (w.float() * full).to(BF16)


def per_block_cast_to_fp8(w: torch.Tensor):
    """[(E,) N, K] -> (float8 [(E,) N, K], float32 [(E,) ceil(N / 128), ceil(K / 128)]), the
    blocks zero-padded to 128 x 128 (a padded block's amax and scale are its values')."""
    *e, n, k = w.shape
    np_, kp = -(-n // 128) * 128, -(-k // 128) * 128
    v = torch.nn.functional.pad(w.float(), (0, kp - k, 0, np_ - n)).view(*e, np_ // 128, 128, kp // 128, 128)
    sf = v.abs().amax(dim=(-3, -1)).clamp(min=1e-4) * INV_448
    q = (v * (1.0 / sf[..., :, None, :, None])).to(FP8).view(*e, np_, kp)
    return q[..., :n, :k].contiguous(), sf


def per_row_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False):
    """[N, D] -> (float8 [N, D], float32 [N]): one scale per row (the indexer's)."""
    sf = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-4) * INV_448
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
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
    """FP8Linear: a stored FP8 weight [out, in] with its block scales as held (a checkpoint's);
    bf16 masters (kernel [in, out]) as [out, in], for inference quantised once per 128 x 128
    block, for training (Block.train) a parameter quantised on every call, as jax_dg does.
    Activations cast per token, UE8M0 scales where the layer's scale_fmt says."""

    def __init__(self, dg, module):
        self.dg, self.ue8m0 = dg, module.use_ue8m0
        if module.stored_fp8:
            self.weight = None
            self.w, self.sf = to_torch(module.weight[...]), to_torch(module.weight_scale_inv[...])
        else:
            self.weight = to_torch(module.kernel[...]).T.contiguous()
            self.w, self.sf = per_block_cast_to_fp8(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.weight.requires_grad and torch.is_grad_enabled():
            return FP8LinearFn.apply(x, self.weight, self.dg)
        return _gemm(self.dg, per_token_cast_to_fp8(x, self.ue8m0), (self.w, self.sf))

    def dequantized(self) -> torch.Tensor:
        """bf16 [out, in]: the weight as DeepSeek's weight_dequant gives it (the master as it is)."""
        return self.weight.to(BF16) if self.weight is not None else dequant_blocks(self.w, self.sf)


def rms_norm(x, scale, eps=1e-6):
    """nnx.RMSNorm's float32 result (x times rsqrt(mean(x^2) + eps) * scale, in flax's order)."""
    xf = x.float()
    return xf * (torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale)


def hadamard(d: int, device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(BF16)


class Indexer:
    """jax_dg.nn.LightningIndexer (DeepSeek V3.2's Indexer): RoPE (non-interleaved pairs, YaRN's
    frequencies where the layer's RoPE has them) on the first rope.dim features, the Hadamard
    rotation, per-row FP8 casts (UE8M0 scales with scale_fmt), float32 head weights."""

    def __init__(self, dg, m):
        self.dg, self.h, self.d, self.topk, self.ue8m0 = dg, m.n_heads, m.head_dim, m.topk, m.use_ue8m0
        self.wq_b, self.wk = Linear(dg, m.wq_b), Linear(dg, m.wk)
        self.k_scale, self.k_bias = to_torch(m.k_norm.scale[...]), to_torch(m.k_norm.bias[...])
        self.w_proj = to_torch(m.weights_proj.kernel[...]).float()
        self.rot = hadamard(self.d, self.w_proj.device)
        self.inv_freq, self.rope_dims = torch.from_numpy(m.rope.inv_freq()).to(self.w_proj.device), m.rope.dim

    def _rotate(self, x):
        return (x.float() @ self.rot).to(BF16)

    def _rope(self, x, positions):
        d = self.rope_dims
        return torch.cat([rotary(x[..., :d], positions, self.inv_freq, False), x[..., d:]], -1)

    def keys(self, x, positions):
        k = torch.nn.functional.layer_norm(self.wk(x).float(), (self.d,), self.k_scale, self.k_bias, 1e-6)
        return self._rotate(self._rope(k.to(BF16), positions))

    def queries(self, x, qr, positions):
        t = x.shape[0]
        q = self._rotate(self._rope(self.wq_b(qr).view(t, self.h, self.d), positions))
        q_fp8, q_sf = per_row_cast_to_fp8(q.reshape(t * self.h, self.d), self.ue8m0)
        w = (x.float() @ self.w_proj) * (self.h ** -0.5)
        return q_fp8.view(t, self.h, self.d), w * q_sf.view(t, self.h) * (self.d ** -0.5)

    def prefill(self, x, qr):
        t = x.shape[0]
        pos = torch.arange(t, device=x.device)
        k = self.keys(x, pos)
        q, w = self.queries(x, qr, pos)
        ks = torch.zeros(t, dtype=torch.int32, device=x.device)
        ke = torch.arange(1, t + 1, dtype=torch.int32, device=x.device)
        logits = self.dg.fp8_fp4_mqa_logits((q, None), per_row_cast_to_fp8(k, self.ue8m0), w, ks, ke,
                                            clean_logits=True)
        return topk_indices(logits[:, :t], self.topk), k

    def decode(self, x, qr, cache):
        """cache: (kv_cache uint8 [nb, bs, 1, D + 4], block_tables int32 [B, W], lens int32 [B]),
        updated in place with the new keys (positions lens): (indices [B, topk], new lens)."""
        kv, table, lens = cache
        b, (nb, bs) = x.shape[0], kv.shape[:2]
        pos = lens.long()
        slots = table.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
        write_keys(kv, slots, *per_row_cast_to_fp8(self.keys(x, pos), self.ue8m0))
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


class MLP:
    """jax_dg.nn.MLP: w2(silu(w1 x) * w3 x), w1 and w3 one GEMM (w13)."""

    def __init__(self, dg, m):
        self.w13, self.w2 = Linear(dg, m.w13), Linear(dg, m.w2)

    def __call__(self, x):
        return self.w2(swiglu(self.w13(x)))


def route(x, weight, bias, m):
    """DeepSeek's Gate (jax_dg.nn.Gate's rule) in torch: (experts [T, k], float32 weights [T, k])."""
    t = x.shape[0]
    logits = x.float() @ weight.T
    scores = torch.sigmoid(logits) if m.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    biased = scores if bias is None else scores + bias
    if m.n_groups > 1:
        grouped = biased.view(t, m.n_groups, -1)
        group = grouped.amax(-1) if bias is None else grouped.topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros(t, m.n_groups, dtype=torch.bool, device=x.device)
        keep.scatter_(1, group.topk(m.topk_groups, dim=-1)[1], True)
        biased = grouped.masked_fill(~keep[:, :, None], NEG_INF).view(t, -1)
    experts = torch.topk(biased, m.topk, dim=1)[1]
    weights = scores.gather(1, experts)
    if m.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights * m.route_scale


class MoE:
    """jax_dg.nn.MoE: DeepSeek's gate, dropless experts on deep_gemm's grouped GEMMs in the
    layout the JAX module picks for the token count (masked: [E, align(T, 128)] rows per expert;
    contiguous: experts' rows back to back, each padded to DeepGEMM's alignment), the routed sum
    and the shared experts added in float32 and rounded once. Stored FP8 experts are read as
    held; bf16 masters are quantised once (inference) or per call under autograd (training)."""

    def __init__(self, dg, m):
        from jax_dg.operands.routing import get_mk_alignment_for_contiguous_layout
        self.dg, self.m, self.e, self.k = dg, m, m.n_experts, m.topk
        self.align = get_mk_alignment_for_contiguous_layout()
        self.ue8m0 = m.use_ue8m0 and m.stored_fp8       # the masters' recipe keeps float32 scales
        self.gate = to_torch(m.gate.weight[...])
        self.bias = None if m.gate.bias is None else to_torch(m.gate.bias[...])
        if m.stored_fp8:
            self.w13_weight = self.w2_weight = None
            self.w13 = (to_torch(m.w13[...]), to_torch(m.w13_scale_inv[...]))
            self.w2 = (to_torch(m.w2[...]), to_torch(m.w2_scale_inv[...]))
        else:
            self.w13_weight, self.w2_weight = to_torch(m.w13[...]), to_torch(m.w2[...])
            self.w13, self.w2 = per_block_cast_to_fp8(self.w13_weight), per_block_cast_to_fp8(self.w2_weight)
        self.shared = None if m.shared is None else MLP(dg, m.shared)

    def _grouped(self, a, weight, w, masked_m, hint):
        if weight is not None and weight.requires_grad and torch.is_grad_enabled():
            return FP8GroupedFn.apply(a, weight, masked_m, hint, self.dg)
        g, rows, k = a.shape
        v, sf = per_token_cast_to_fp8(a.reshape(g * rows, k), self.ue8m0)
        return _masked(self.dg, (v.view(g, rows, k), sf.view(g, rows, -1)), w, masked_m, hint)

    def _ranks(self, flat):
        """(per-expert counts, each assignment's rank among its expert's, in token order)."""
        order = torch.argsort(flat, stable=True)
        # (torch.bincount reads its input's max on the host: it cannot be captured in a graph)
        counts = torch.zeros(self.e, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        rank = torch.empty_like(flat)
        rank[order] = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        return counts, rank

    def _masked_experts(self, x, flat):
        t, dim = x.shape
        rows = self.m.capacity(t)
        counts, rank = self._ranks(flat)
        slot = flat * rows + rank
        a = torch.zeros(self.e * rows, dim, dtype=BF16, device=x.device)
        a[slot] = x.repeat_interleave(self.k, dim=0)
        masked_m = counts.int()
        hint = max(1, -(-t * self.k // self.e))
        h = self._grouped(a.view(self.e, rows, dim), self.w13_weight, self.w13, masked_m, hint)
        return self._grouped(swiglu(h), self.w2_weight, self.w2, masked_m, hint).view(self.e * rows, dim)[slot]

    def _contiguous_experts(self, x, flat):
        from jax_dg.operands.routing import max_contiguous_rows
        t, dim = x.shape
        total = max_contiguous_rows(t, self.k, self.e, self.align)
        counts, rank = self._ranks(flat)
        padded = (counts + self.align - 1) // self.align * self.align
        start = torch.cumsum(padded, 0) - padded
        row = start[flat] + rank
        ids = torch.full((total,), -1, dtype=torch.int32, device=x.device)
        ids[row] = flat.int()
        v, sf = per_token_cast_to_fp8(x, self.ue8m0)
        a = (torch.zeros(total, dim, dtype=FP8, device=x.device), torch.zeros(total, sf.shape[1], device=x.device))
        a[0][row], a[1][row] = v.repeat_interleave(self.k, dim=0), sf.repeat_interleave(self.k, dim=0)
        h = torch.empty(total, self.w13[0].shape[1], dtype=BF16, device=x.device)
        self.dg.m_grouped_fp8_gemm_nt_contiguous(a, self.w13, h, ids)
        y = torch.empty(total, dim, dtype=BF16, device=x.device)
        self.dg.m_grouped_fp8_gemm_nt_contiguous(per_token_cast_to_fp8(swiglu(h), self.ue8m0), self.w2, y, ids)
        return y[row]

    def __call__(self, x):
        t, dim = x.shape
        experts, weights = route(x, self.gate, self.bias, self.m.gate)
        flat = experts.reshape(-1)
        layout = self.m.layout_for(t)
        y = (self._masked_experts if layout == "masked" else self._contiguous_experts)(x, flat)
        y = (y.view(t, self.k, dim).float() * weights[:, :, None]).sum(1)
        if self.shared is not None:
            y = y + self.shared(x).float()
        return y.to(BF16)


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
                                   self.moe.shared.w13, self.moe.shared.w2)]

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


# --- DeepSeek V3.2's block (jax_dg.nn.Block): MLA over the indexer's top-k, then MLP or MoE -----

def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """jax_dg.nn.rope's rotation of x [T, (H,) D] at positions [T] (the same float32 frequencies:
    YaRN's where the layer's RoPE has it); pairs (2i, 2i + 1) or (i, i + D/2)."""
    angle = positions.float()[:, None] * inv_freq
    if x.dim() == 3:
        angle = angle[:, None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    xf = x.float()
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    re, im = a * cos - b * sin, a * sin + b * cos
    out = torch.stack([re, im], -1).flatten(-2) if interleaved else torch.cat([re, im], -1)
    return out.to(x.dtype)


def pack_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, ue8m0: bool):
    """jax_dg.nn.attention's latent rows: (uint8 [N, C + 4 C/128 + 2 R], bf16 kv_c as cached)."""
    v, sf = per_token_cast_to_fp8(kv_c, ue8m0)
    held = (v.float().view(v.shape[0], -1, 128) * sf[:, :, None]).view(v.shape).to(BF16)
    return torch.cat([v.view(torch.uint8), sf.view(torch.uint8), k_pe.to(BF16).view(torch.uint8)], -1), held


def unpack_latent(rows: torch.Tensor, c: int):
    """uint8 latent rows [..., L] -> (bf16 kv_c [..., C], bf16 k_pe [..., R])."""
    nsf = c // 128
    sf = rows[..., c:c + 4 * nsf].contiguous().view(F32)
    kv = (rows[..., :c].contiguous().view(FP8).float().unflatten(-1, (nsf, 128)) * sf[..., None]).flatten(-2)
    return kv.to(BF16), rows[..., c + 4 * nsf:].contiguous().view(BF16)


class MLA:
    """jax_dg.nn.MLA as DeepSeek's reference computes it (inference/model.py's MLA, its einsums
    in bf16), on deep_gemm's FP8 GEMMs and the paged caches: prefill of one sequence in the MHA
    form over the indexer's causal top-k, decode in the absorbed form over the gathered latent
    rows of each sequence's top-k (wkv_b dequantised once, as DeepSeek caches it).

    The cache: (latent uint8 [nb, bs, 1, L], index keys uint8 [nb, bs, 1, D + 4] or None, block
    tables int32 [B, W], lengths int32 [B]), updated in place."""

    def __init__(self, dg, m):
        self.dg, self.h, self.c = dg, m.n_heads, m.kv_lora_rank
        self.nope, self.rope_dim, self.ue8m0 = m.qk_nope_head_dim, m.qk_rope_head_dim, m.use_ue8m0
        self.scale = m.softmax_scale
        self.wq_a, self.wq_b, self.wkv_a = Linear(dg, m.wq_a), Linear(dg, m.wq_b), Linear(dg, m.wkv_a)
        self.wkv_b, self.wo = Linear(dg, m.wkv_b), Linear(dg, m.wo)
        self.q_norm, self.kv_norm = to_torch(m.q_norm.scale[...]), to_torch(m.kv_norm.scale[...])
        self.inv_freq = torch.from_numpy(m.rope.inv_freq()).to(self.q_norm.device)
        w = self.wkv_b.dequantized().view(self.h, -1, self.c)
        self.w_nope, self.w_v = w[:, :self.nope].contiguous(), w[:, self.nope:].contiguous()
        self.indexer = None if m.indexer is None else Indexer(dg, m.indexer)

    def _project(self, x, pos):
        qr = rms_norm(self.wq_a(x), self.q_norm).to(BF16)
        q = self.wq_b(qr).view(x.shape[0], self.h, -1)
        q_pe = rotary(q[..., self.nope:], pos, self.inv_freq, True)
        kv = self.wkv_a(x)
        kv_c = rms_norm(kv[:, :self.c], self.kv_norm).to(BF16)
        rows, kv_c = pack_latent(kv_c, rotary(kv[:, self.c:], pos, self.inv_freq, True), self.ue8m0)
        return qr, q[..., :self.nope], q_pe, rows, kv_c

    def prefill(self, x, cache):
        """One sequence x [S, dim] from position 0 into sequence 0 of the cache: bf16 [S, dim]."""
        latent, keys, table, lens = cache
        s, bs = x.shape[0], latent.shape[1]
        pos = torch.arange(s, device=x.device)
        qr, q_nope, q_pe, rows, kv_c = self._project(x, pos)
        slots = table[0, pos // bs].long() * bs + pos % bs
        latent.view(-1, latent.shape[-1])[slots] = rows
        keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        if self.indexer is not None:
            idx, k = self.indexer.prefill(x, qr)
            write_keys(keys, slots, *per_row_cast_to_fp8(k, self.indexer.ue8m0))
            chosen = torch.zeros(s, s + 1, dtype=torch.bool, device=x.device)
            chosen.scatter_(1, torch.where(idx < 0, s, idx).long(), True)
            keep &= chosen[:, :s]
        lens[0] = s
        kv = self.wkv_b(kv_c).view(s, self.h, -1)
        k_pe = rows[:, -2 * self.rope_dim:].contiguous().view(BF16)
        k = torch.cat([kv[..., :self.nope], k_pe[:, None].expand(-1, self.h, -1)], -1)
        scores = torch.einsum("shd,thd->sht", torch.cat([q_nope, q_pe], -1), k) * self.scale
        p = scores.masked_fill(~keep[:, None, :], NEG_INF).softmax(dim=-1)
        o = torch.einsum("sht,thd->shd", p, kv[..., self.nope:])
        return self.wo(o.reshape(s, -1))

    def decode(self, x, cache):
        """One token per sequence x [B, dim] at the cached lengths: bf16 [B, dim]."""
        latent, keys, table, lens = cache
        b, bs, width = x.shape[0], latent.shape[1], table.shape[1]
        pos = lens.long()
        qr, q_nope, q_pe, rows, _ = self._project(x, pos)
        flat = latent.view(-1, latent.shape[-1])
        flat[table.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs] = rows
        if self.indexer is None:
            idx = torch.arange(width * bs, device=x.device).expand(b, -1)
            idx = torch.where(idx <= pos[:, None], idx, -1)
            lens += 1
        else:
            idx, new_lens = self.indexer.decode(x, qr, (keys, table, lens))
            lens.copy_(new_lens)
        p = idx.clamp(min=0).long()
        kv_c, k_pe = unpack_latent(flat[table.gather(1, p // bs).long() * bs + p % bs], self.c)
        q_abs = torch.einsum("bhd,hdc->bhc", q_nope, self.w_nope)
        scores = (torch.einsum("bhc,bkc->bhk", q_abs, kv_c) + torch.einsum("bhr,bkr->bhk", q_pe, k_pe)) * self.scale
        prob = scores.masked_fill((idx < 0)[:, None, :], NEG_INF).softmax(dim=-1)
        o = torch.einsum("bhc,hdc->bhd", torch.einsum("bhk,bkc->bhc", prob, kv_c), self.w_v)
        return self.wo(o.reshape(b, -1))


def write_keys(kv, slots, values, scales):
    """The indexer's FP8 keys into its paged cache (jax_dg.paged's block layout) at slots."""
    nb, bs, _, dp4 = kv.shape
    d = dp4 - 4
    flat = kv.view(nb, bs * dp4)
    blk, off = (slots // bs)[:, None], (slots % bs)[:, None]
    flat[blk, off * d + torch.arange(d, device=kv.device)] = values.view(torch.uint8)
    flat[blk, bs * d + off * 4 + torch.arange(4, device=kv.device)] = scales.float()[:, None].view(torch.uint8)


class V32Block:
    """jax_dg.nn.Block: attn_norm -> MLA -> + x -> ffn_norm -> MLP or MoE -> + x, the residual
    adds in float32 rounded to bf16 (DeepSeek's)."""

    def __init__(self, dg, block):
        self.attn_norm, self.ffn_norm = to_torch(block.attn_norm.scale[...]), to_torch(block.ffn_norm.scale[...])
        self.attn = MLA(dg, block.attn)
        from jax_dg.nn.moe import MoE as JaxMoE
        self.ffn = MoE(dg, block.ffn) if isinstance(block.ffn, JaxMoE) else MLP(dg, block.ffn)

    def _ffn(self, h):
        return (h.float() + self.ffn(rms_norm(h, self.ffn_norm).to(BF16)).float()).to(BF16)

    def prefill(self, x, cache):
        """x [S, dim] (one sequence) -> bf16 [S, dim]; its caches written (sequence 0)."""
        o = self.attn.prefill(rms_norm(x, self.attn_norm).to(BF16), cache)
        return self._ffn((x.float() + o.float()).to(BF16))

    def decode(self, x, cache):
        """x [B, dim] at the cached lengths -> bf16 [B, dim]; the caches updated in place."""
        o = self.attn.decode(rms_norm(x, self.attn_norm).to(BF16), cache)
        return self._ffn((x.float() + o.float()).to(BF16))
