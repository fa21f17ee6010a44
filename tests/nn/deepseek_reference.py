"""DeepSeek-V3.2's inference semantics (deepseek-ai/DeepSeek-V3.2-Exp inference/model.py and
kernel.py), written independently in numpy as the oracle of jax_dg.nn's layers: act_quant (with
its scale_fmt), the FP8 linear on stored weights, the gate, the experts, the MoE's float32 sum.

Products are summed in float64 and rounded where DeepSeek's code rounds (its GEMMs' bfloat16
outputs, the SwiGLU's bfloat16 activations, the MoE's single rounding at the end).
Weights are given as the checkpoint stores them: per expert, w1 / w3 / w2 FP8 [out, in] with
float32 128 x 128 block scales.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
INV_448 = np.float32(1 / 448)


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def round_scale(s: np.ndarray) -> np.ndarray:
    """kernel.py's fast_round_scale: 2 ** ceil(log2(s)) on the float32 bits."""
    bits = s.astype(np.float32).view(np.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
    return ((exp + 127) << 23).astype(np.int32).view(np.float32)


def act_quant(x: np.ndarray, scale_fmt: str | None = None):
    """kernel.py's act_quant: per 128 columns, s = max(amax, 1e-4) / 448 (a power of two when
    scale_fmt is set), y = clamp(x / s) as float8_e4m3fn. x [M, K], K % 128 == 0."""
    m, k = x.shape
    blocks = np.asarray(x, np.float32).reshape(m, k // 128, 128)
    s = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)) * INV_448
    if scale_fmt is not None:
        s = round_scale(s)
    y = np.clip(blocks / s[..., None], -448, 448).astype(FP8)
    return y.reshape(m, k), s.astype(np.float32)


def dequant(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """FP8 [R, C] times its 128 x 128 block scales, in float64."""
    r, c = values.shape
    full = np.repeat(np.repeat(scales.astype(np.float64), 128, 0), 128, 1)[:r, :c]
    return values.astype(np.float64) * full


def linear(x: np.ndarray, weight: np.ndarray, scale: np.ndarray, scale_fmt: str | None = None) -> np.ndarray:
    """model.py's linear on an FP8 weight: act_quant(x), fp8_gemm -> bfloat16 (as float32)."""
    q, s = act_quant(x, scale_fmt)
    a = q.astype(np.float64) * np.repeat(s.astype(np.float64), 128, 1)
    return bf16(a @ dequant(weight, scale).T)


def mlp(x, w1, w3, w2, scale_fmt=None) -> np.ndarray:
    """model.py's Expert / MLP: w2(silu(w1(x)) * w3(x)), each (values, scales)."""
    g = linear(x, *w1, scale_fmt).astype(np.float64)
    u = linear(x, *w3, scale_fmt).astype(np.float64)
    return linear(bf16(g / (1 + np.exp(-g)) * u), *w2, scale_fmt)


def gate(x, weight, bias, topk, n_groups, topk_groups, score_func, route_scale, norm_topk_prob=None):
    """model.py's Gate: (weights [T, topk], expert indices [T, topk]), in float64."""
    logits = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    if score_func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    biased = scores if bias is None else scores + np.asarray(bias, np.float64)
    t = x.shape[0]
    if n_groups > 1:
        g = biased.reshape(t, n_groups, -1)
        group = g.max(-1) if bias is None else np.sort(g, -1)[..., -2:].sum(-1)
        keep = np.argsort(-group, axis=1, kind="stable")[:, :topk_groups]
        mask = np.ones((t, n_groups), bool)
        np.put_along_axis(mask, keep, False, axis=1)
        biased = np.where(mask[..., None], -np.inf, g).reshape(t, -1)
    idx = np.argsort(-biased, axis=1, kind="stable")[:, :topk]
    w = np.take_along_axis(scores, idx, 1)
    if norm_topk_prob if norm_topk_prob is not None else score_func == "sigmoid":
        w = w / w.sum(-1, keepdims=True)
    return w * route_scale, idx


def moe(x, gate_args, experts, shared, scale_fmt=None) -> np.ndarray:
    """model.py's MoE.forward: a float32 buffer, each chosen expert's bfloat16 output times its
    weight added in, the shared experts' output added, rounded to bfloat16 once.
    experts: per expert (w1, w3, w2) as (values, scales); shared: the same or None."""
    weights, idx = gate(x, **gate_args)
    y = np.zeros(x.shape, np.float32)
    for e, ws in enumerate(experts):
        rows, slot = np.nonzero(idx == e)
        if len(rows):
            out = mlp(x[rows], *ws, scale_fmt)
            np.add.at(y, rows, (out * weights[rows, slot, None]).astype(np.float32))
    if shared is not None:
        y += mlp(x, *shared, scale_fmt)
    return bf16(y)


# --- the indexer (model.py's Indexer, after DeepSeek's November 2025 RoPE fix) -----------------

def hadamard(d: int) -> np.ndarray:
    """Sylvester's Hadamard matrix times d^-1/2 (fast_hadamard_transform's order and scale)."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def rope_half(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """apply_rotary_emb(x, freqs_cis, interleaved=False): pairs (i, i + D/2) of x [T, ..., D]
    rotated by angles [T, D/2] (float32 angles, as DeepSeek's table holds them)."""
    d = x.shape[-1]
    a = angles.astype(np.float64).reshape(angles.shape[:1] + (1,) * (x.ndim - 2) + angles.shape[1:])
    z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * a)
    return np.concatenate([z.real, z.imag], -1)


def indexer_scores(x, qr, positions, p, *, inv_freq, n_heads, head_dim, scale_fmt=None):
    """model.py's Indexer.forward on one sequence of T tokens at `positions`: the index scores
    [T, T] (causal positions only, -inf elsewhere). p: wq_b and wk as (FP8 values, scales),
    k_norm_weight, k_norm_bias, weights_proj (bf16 [H, dim]); inv_freq float32 [rope_dim / 2]."""
    t = x.shape[0]
    angles = (positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None]).astype(np.float32)
    r = 2 * inv_freq.shape[0]
    hd = hadamard(head_dim)
    q = linear(qr, *p["wq_b"], scale_fmt).reshape(t, n_heads, head_dim)
    q = bf16(np.concatenate([bf16(rope_half(q[..., :r], angles)), q[..., r:]], -1) @ hd)
    k = linear(x, *p["wk"], scale_fmt).astype(np.float64)
    mu, var = k.mean(-1, keepdims=True), k.var(-1, keepdims=True)
    k = bf16((k - mu) / np.sqrt(var + 1e-6) * p["k_norm_weight"] + p["k_norm_bias"])
    k = bf16(np.concatenate([bf16(rope_half(k[:, :r], angles)), k[:, r:]], -1) @ hd)
    q8, qs = act_quant(q.reshape(t * n_heads, head_dim), scale_fmt)
    k8, ks = act_quant(k, scale_fmt)
    w = (np.asarray(x, np.float32) @ np.asarray(p["weights_proj"], np.float32).T).astype(np.float32)
    w = (w * np.float32(n_heads ** -0.5)) * qs[:, 0].reshape(t, n_heads) * np.float32(head_dim ** -0.5)
    dots = np.einsum("thd,sd->tsh", q8.astype(np.float64).reshape(t, n_heads, head_dim), k8.astype(np.float64))
    scores = (np.maximum(dots, 0) * w[:, None, :].astype(np.float64)).sum(-1) * ks[None, :, 0]
    return np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
