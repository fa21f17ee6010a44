"""A decode step's jax_dg work in a token loop: jax_dg in one jit against the torch route, eager
and captured in a torch CUDA graph.

    python benchmarks/bench_decode.py            (a CUDA device and deep_gemm)
    python benchmarks/bench_decode.py --tiny     (a smoke run; on CPU the torch route runs
                                                  jax_dg's torch emulation of deep_gemm)

One step, per token: the indexer's paged logits and top-2048 over an FP8 paged cache (H64 D128,
block 64, next_n rows per request), then the MoE experts' masked grouped FP8 GEMM (per-token
cast of [E, capacity, K] activations, 8 experts of N 4096, K 7168, 16 rows each); the lengths
grow by one a step. At B 64 and 256, ctx 8192 and 32768, next_n 1 and 2, one run:
  jax_dg        `lax.fori_loop` over STEPS tokens in one jit (XLA command buffers on, its
                default): per-step time = loop time / STEPS
  torch         the same step from PyTorch: get_paged_mqa_logits_metadata +
                fp8_fp4_paged_mqa_logits + a mask past each length + torch.topk, a per-token
                cast + m_grouped_fp8_gemm_nt_masked, eager
  torch graph   that step captured once in a torch CUDA graph, replayed STEPS times
Ratios: torch / jax_dg and torch graph / jax_dg (> 1: jax_dg is faster).
"""

from __future__ import annotations

import argparse

import timing
import plot

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_dg
import torch_block
from jax_dg.operands import paged

H, D, BLOCK, K = 64, 128, 64, 2048
EXPERTS, ROWS, N, KDIM = 8, 16, 4096, 7168
SHAPES = [(b, ctx, nn) for b in (64, 256) for ctx in (8192, 32768) for nn in (1, 2)]
TINY = dict(shapes=[(2, 256, 1), (2, 256, 2)], k=64, n=256, kdim=256)
STEPS = 16


def inputs(b, ctx, next_n, n, kdim, room):
    """Random state: FP8 queries, a paged cache with room for `room` more tokens, head weights,
    lengths (ctx each), the MoE activations [E, 128, K] and FP8 expert weights [E, N, K]."""
    lens = np.full(b, ctx + room, np.int32)
    table, nb = paged.build_block_tables(lens, BLOCK, key=0)
    ks = jax.random.split(jax.random.PRNGKey(b * ctx + next_n), 5)
    cache = paged.quantize_kv_cache(jax.random.normal(ks[0], (nb, BLOCK, D), jnp.bfloat16))
    q = jax.random.normal(ks[1], (b, next_n, H, D), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    w = jax.random.normal(ks[2], (b * next_n, H), jnp.float32)
    x = jax.random.normal(ks[3], (EXPERTS, 128, kdim), jnp.bfloat16)
    experts = jax.vmap(jax_dg.per_block_cast_to_fp8)(jax.random.normal(ks[4], (EXPERTS, n, kdim), jnp.bfloat16) * 0.05)
    masked_m = jnp.full((EXPERTS,), ROWS, jnp.int32)
    return q, cache, w, jnp.full((b,), ctx, jnp.int32), table, x, experts, masked_m


def jax_loop(k, max_len, steps):
    def step(i, carry):
        lens, acc, (q, cache, w, table, x, experts, masked_m) = carry
        idx = jax_dg.paged_indexer_topk(q, cache, w, lens, table, k, max_model_len=max_len)
        y = jax_dg.m_grouped_fp8_gemm_nt_masked(jax.vmap(jax_dg.per_token_cast_to_fp8)(x), experts,
                                                masked_m, ROWS)
        acc = acc + idx[:, 0].sum() + y[:, 0, 0].astype(jnp.float32).sum().astype(jnp.int32)
        return lens + 1, acc, (q, cache, w, table, x, experts, masked_m)

    @jax.jit
    def loop(q, cache, w, lens, table, x, experts, masked_m):
        out = jax.lax.fori_loop(0, steps, step, (lens, jnp.zeros((), jnp.int32),
                                                 (q, cache, w, table, x, experts, masked_m)))
        return out[1]
    return loop


def torch_step(dg, k, max_len, state):
    """One step of the torch route on tensors `state` (lens grows in place)."""
    q, cache, w, lens, table, x, (ev, es), masked_m = state
    b, next_n = q.shape[:2]
    ctx = (lens[:, None] - next_n + 1 + torch.arange(next_n, device=lens.device)[None, :]).int()
    meta = dg.get_paged_mqa_logits_metadata(ctx, BLOCK, dg.get_num_sms())
    logits = dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, ctx, table, meta, max_len, clean_logits=False)
    valid = torch.arange(max_len, device=q.device)[None, :] < ctx.reshape(-1, 1)
    idx = torch_block.topk_indices(logits.masked_fill(~valid, float("-inf")), k)
    g, m, kd = x.shape
    xv, xs = torch_block.per_token_cast_to_fp8(x.view(g * m, kd))
    y = torch.empty(g, m, ev.shape[1], dtype=torch.bfloat16, device=x.device)
    dg.m_grouped_fp8_gemm_nt_masked((xv.view(g, m, kd), xs.view(g, m, -1)), (ev, es), y, masked_m, ROWS)
    lens += 1
    return idx, y


def row(dg, b, ctx, next_n, k, n, kdim, steps, reps):
    room = 4 * steps * (reps + 3) + 8   # the lengths grow every step of every contender
    q, cache, w, lens, table, x, experts, masked_m = inputs(b, ctx, next_n, n, kdim, room)
    max_len = table.shape[1] * BLOCK
    loop = jax_loop(k, max_len, steps)
    args = (q, cache, w, lens, table, x, experts, masked_m)
    own = torch_block.to_torch
    state = (own(q), own(cache), own(w), own(lens), own(table), own(x), (own(experts[0]), own(experts[1])),
             own(masked_m))
    contenders = {"jax_dg": (lambda: loop(*args), timing.jax_sync),
                  "torch": (lambda: [torch_step(dg, k, max_len, state) for _ in range(steps)][-1][0], timing.torch_sync)}
    if torch.cuda.is_available():
        replay = timing.captured(lambda: torch_step(dg, k, max_len, state))
        contenders["graph"] = (lambda: [replay() for _ in range(steps)], timing.torch_sync)
    t = timing.compare(contenders, 1, repeats=reps)
    per = {name: us / steps for name, us in t.items()}
    graph = per.get("graph", float("nan"))
    return {"shape": f"B{b} ctx{ctx} next_n{next_n}", "jax_dg_us": per["jax_dg"], "torch_us": per["torch"],
            "graph_us": graph, "torch/jax_dg": per["torch"] / per["jax_dg"],
            "graph/jax_dg": graph / per["jax_dg"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes: a smoke run")
    args = ap.parse_args(argv)
    dg = torch_block.deep_gemm_or_emulation()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(dg, '__version__', dg.__name__)}, {STEPS} steps a loop")
    shapes, k, n, kdim = (TINY["shapes"], TINY["k"], TINY["n"], TINY["kdim"]) if args.tiny else (SHAPES, K, N, KDIM)
    rows = [row(dg, b, ctx, nn, k, n, kdim, STEPS, 2 if args.tiny else 5) for b, ctx, nn in shapes]
    plot.write("bench_decode", "decode step (paged logits + top-k + masked grouped FP8 GEMM), per step",
               rows, [("shape", "shape"), ("jax_dg_us", "jax_dg us"), ("torch_us", "torch us"),
                      ("graph_us", "torch graph us"), ("torch/jax_dg", "torch/jax_dg"),
                      ("graph/jax_dg", "graph/jax_dg")],
               label="shape", ratios=["torch/jax_dg", "graph/jax_dg"])


if __name__ == "__main__":
    main()
