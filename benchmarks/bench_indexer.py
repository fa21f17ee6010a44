"""The indexer step (MQA logits + top-k): deep_gemm + torch.topk vs jax_dg in jit vs plain jnp.

    python benchmarks/bench_indexer.py        (needs a CUDA device and deep_gemm)

DeepSeek V3.2's lightning indexer, H64, D128, k 2048, one run, contenders interleaved:
  prefill  S2048/SK8192 and S4096/SK32768, causal ranges as in DeepGEMM's test
           torch:   deep_gemm.fp8_fp4_mqa_logits(clean_logits=True) + torch.topk(logits, k)
           fused:   jax_dg.indexer_topk (one custom call: logits land in a scratch buffer that
                    only jax_dg's top-k kernel reads; no cleaning, no copy)
           composed: jax_dg.topk_indices(jax_dg.mqa_logits(...)) in one jit
           jnp:     the same math in jax.numpy + lax.top_k
  decode   paged, next_n 1, block 64, B64/B256 at ctx 8192 and 32768; schedule metadata
           computed inside every contender (as a decode step does once per step)
  top-k alone, on the same logits: torch.topk vs jax_dg.topk_indices vs lax.top_k.
"jax_dg graph": the fused step jitted with compiler_options={"xla_gpu_graph_min_graph_size": 1},
so that XLA captures it as a command buffer even where the program has fewer than the 5 commands
XLA's default asks for (a lone decode op has 4: docs/runtime.md).
Ratios: torch time / jax_dg time (> 1: jax_dg is faster). "unsorted": both routes asked for
the set only (torch.topk(sorted=False); jax_dg sorted=False: ascending key order, no sort).
"""

from __future__ import annotations

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot

import jax
import jax.numpy as jnp
import numpy as np
import torch

import bench_mqa
import bench_paged_mqa
import deep_gemm
import jax_dg

K = 2048
PREFILL = [(2048, 8192), (4096, 32768)]
DECODE = [(64, 8192), (64, 32768), (256, 8192), (256, 32768)]
to_torch = bench_mqa.to_torch


def prefill(s, sk):
    q, kv, w, ks, ke = bench_mqa.inputs(s, sk)
    tq, tkv, tw, tks, tke = to_torch(q[0]), (to_torch(kv[0]), to_torch(kv[1])), to_torch(w), to_torch(ks), to_torch(ke)

    def torch_route(sorted_):
        logits = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=True, max_seqlen_k=0)
        return torch.topk(logits, K, dim=1, sorted=sorted_)[1]
    args = (q, kv, w, ks, ke)
    n = 20 if s * sk <= 2048 * 8192 else 5
    row, fused = time_step("prefill", f"S{s} SK{sk}", torch_route,
                           lambda *a, sorted: jax_dg.indexer_topk(*a, K, sorted=sorted),
                           lambda *a: jax_dg.topk_indices(jax_dg.mqa_logits(*a), K),
                           lambda *a: jax.lax.top_k(bench_mqa.plain_jnp(*a), K)[1],
                           args, n)
    # the same selected values as torch's route
    idx = to_torch(fused(*args)).long()
    logits = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=True, max_seqlen_k=0)
    tv = torch.topk(logits, K, dim=1)[0]
    assert torch.equal(torch.where(idx >= 0, logits.gather(1, idx.clamp(min=0)), float("-inf")), tv)
    # top-k alone on the same (full, cleaned) logits
    lj = jax.jit(lambda *a: jax_dg.mqa_logits(*a))(*args)
    tl = to_torch(lj)
    mine = jax.jit(lambda x: jax_dg.topk_indices(x, K))
    mine_u = jax.jit(lambda x: jax_dg.topk_indices(x, K, sorted=False))
    lax_k = jax.jit(lambda x: jax.lax.top_k(x, K)[1])
    tk = timing.compare({"torch.topk": (lambda: torch.topk(tl, K, dim=1), timing.torch_sync),
                         "jax_dg": (lambda: mine(lj), timing.jax_sync),
                         "lax.top_k": (lambda: lax_k(lj), timing.jax_sync),
                         "torch.topk unsorted": (lambda: torch.topk(tl, K, dim=1, sorted=False), timing.torch_sync),
                         "jax_dg unsorted": (lambda: mine_u(lj), timing.jax_sync)}, n)
    del logits, tl
    torch.cuda.empty_cache()
    return [
        row,
        {"step": "top-k only", "shape": f"S{s} SK{sk}", "torch_us": tk["torch.topk"],
         "jax_dg_us": tk["jax_dg"], "jnp_us": tk["lax.top_k"],
         "torch/jax_dg": tk["torch.topk"] / tk["jax_dg"], "jnp/jax_dg": tk["lax.top_k"] / tk["jax_dg"],
         "torch_unsorted_us": tk["torch.topk unsorted"], "unsorted_us": tk["jax_dg unsorted"],
         "unsorted/unsorted": tk["torch.topk unsorted"] / tk["jax_dg unsorted"]},
    ]


def decode(b, ctx):
    q, cache, w, lens, table = bench_paged_mqa.inputs(b, ctx, 1)
    max_len = table.shape[1] * bench_paged_mqa.BLOCK
    tq, tkv, tw, tl, tt = (to_torch(x) for x in (q, cache, w, lens, table))
    nsm = deep_gemm.get_num_sms()
    valid = torch.arange(max_len, device="cuda")[None, :] < tl.reshape(-1, 1)

    def torch_route(sorted_):
        meta = deep_gemm.get_paged_mqa_logits_metadata(tl, bench_paged_mqa.BLOCK, nsm)
        logits = deep_gemm.fp8_fp4_paged_mqa_logits((tq, None), tkv, tw, tl, tt, meta, max_len,
                                                    clean_logits=False)
        # 2.5.0 has no clean for 2-D lengths: -inf past each row's length, as the indexer needs
        logits = logits.masked_fill(~valid, float("-inf"))
        return torch.topk(logits, K, dim=1, sorted=sorted_)[1]
    row, _ = time_step("decode", f"B{b} ctx{ctx}", torch_route,
                       lambda *a, sorted: jax_dg.paged_indexer_topk(*a, K, max_model_len=max_len, sorted=sorted),
                       lambda *a: jax_dg.topk_indices(jax_dg.paged_mqa_logits(*a, max_model_len=max_len), K),
                       lambda *a: jax.lax.top_k(bench_paged_mqa.plain_jnp(*a, max_len), K)[1],
                       (q, cache, w, lens, table), 50 if b * ctx <= 64 * 32768 else 20)
    return [row]


def time_step(step, shape, torch_route, jax_dg_step, composed, plain, args, n):
    """One row: torch's route (sorted and not), jax_dg's fused step (sorted and not), the
    composed jax_dg ops and plain jnp, interleaved; returns it and the sorted fused step."""
    fused = jax.jit(lambda *a: jax_dg_step(*a, sorted=True))
    graph = jax.jit(lambda *a: jax_dg_step(*a, sorted=True),
                    compiler_options={"xla_gpu_graph_min_graph_size": 1})
    unsorted = jax.jit(lambda *a: jax_dg_step(*a, sorted=False))
    composed, plain = jax.jit(composed), jax.jit(plain)
    t = timing.compare({"torch": (lambda: torch_route(True), timing.torch_sync),
                        "fused": (lambda: fused(*args), timing.jax_sync),
                        "graph": (lambda: graph(*args), timing.jax_sync),
                        "composed": (lambda: composed(*args), timing.jax_sync),
                        "torch_unsorted": (lambda: torch_route(False), timing.torch_sync),
                        "unsorted": (lambda: unsorted(*args), timing.jax_sync)}, n)
    t["jnp"] = timing.per_call_us(lambda: plain(*args), timing.jax_sync, 2, repeats=3, warmup=1)
    return {"step": step, "shape": shape, "torch_us": t["torch"], "jax_dg_us": t["fused"],
            "composed_us": t["composed"], "graph_us": t["graph"], "jnp_us": t["jnp"],
            "torch/jax_dg": t["torch"] / t["fused"], "torch/graph": t["torch"] / t["graph"],
            "torch/composed": t["torch"] / t["composed"], "jnp/jax_dg": t["jnp"] / t["fused"],
            "torch_unsorted_us": t["torch_unsorted"], "unsorted_us": t["unsorted"],
            "unsorted/unsorted": t["torch_unsorted"] / t["unsorted"]}, fused


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}, k {K}")
    rows = [r for s, sk in PREFILL for r in prefill(s, sk)]
    rows += [r for b, ctx in DECODE for r in decode(b, ctx)]
    plot.write("bench_indexer", "indexer step (logits + top-k)", rows, [
        ("step", "step"), ("shape", "shape"), ("torch_us", "torch us"), ("jax_dg_us", "jax_dg us"),
        ("composed_us", "composed us"), ("graph_us", "jax_dg graph us"), ("jnp_us", "jnp us"),
        ("torch/jax_dg", "torch/jax_dg"), ("torch/graph", "torch/jax_dg graph"),
        ("torch/composed", "torch/composed"), ("jnp/jax_dg", "jnp/jax_dg"),
        ("torch_unsorted_us", "torch unsorted us"), ("unsorted_us", "unsorted us"),
        ("unsorted/unsorted", "unsorted ratio")],
        label=lambda r: f"{r['step']} {r['shape']}", ratios=["torch/jax_dg", "torch/composed", "unsorted/unsorted"])


if __name__ == "__main__":
    main()
