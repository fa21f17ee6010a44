"""Top-k alone on random float32 logits: jax_dg's kernel against torch.topk, lax.top_k and the
memory floor.

    python benchmarks/bench_topk.py        (needs a CUDA device)

Shapes [rows, keys]: the indexer's prefill ([2048, 8192], [4096, 32768]) and decode ([64, 65536],
[256, 131072]) at k 512, 2048 and 4096; one run, contenders interleaved (timing.compare):
  jax_dg sorted / unsorted  jax_dg.topk_indices in jit (sorted=False: the set in column order)
  torch.topk sorted / unsorted, on the same buffer (DLPack)
  lax.top_k                 XLA's own (a full sort at these k), timed with fewer calls
  floor                     the logits' bytes read once at the measured copy bandwidth
                            (a device copy reads and writes them: half its time)
Ratios: torch.topk / jax_dg (> 1: jax_dg is faster), and jax_dg / floor.
"""

from __future__ import annotations

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot

import jax
import jax.numpy as jnp
import torch

import jax_dg

SHAPES = [(2048, 8192), (4096, 32768), (64, 65536), (256, 131072)]
KS = [512, 2048, 4096]


def copy_floor_us(t: torch.Tensor) -> float:
    """Reading t once at the bandwidth of a device-to-device copy of it."""
    dst = torch.empty_like(t)
    return timing.per_call_us(lambda: dst.copy_(t), timing.torch_sync, 20) / 2


def one(rows, cols, k, floor_us):
    x = jax.random.normal(jax.random.PRNGKey(rows + cols), (rows, cols), jnp.float32)
    t = torch.from_dlpack(x)
    srt = jax.jit(lambda x: jax_dg.topk_indices(x, k))
    uns = jax.jit(lambda x: jax_dg.topk_indices(x, k, sorted=False))
    lax_k = jax.jit(lambda x: jax.lax.top_k(x, k)[1])
    # the same selection as torch.topk (values; its tie order is unspecified)
    mine = torch.gather(t, 1, torch.from_dlpack(srt(x)).long())
    assert torch.equal(mine, torch.topk(t, k, dim=1)[0])
    # 20 calls a sample at every shape: with 5, the first launch and the final sync (tens of us)
    # weighed on 100-us kernels (session 13: [256, 131072] 134 us in jit against 100 alone)
    n = 20
    r = timing.compare({"sorted": (lambda: srt(x), timing.jax_sync),
                        "unsorted": (lambda: uns(x), timing.jax_sync),
                        "torch": (lambda: torch.topk(t, k, dim=1), timing.torch_sync),
                        "torch unsorted": (lambda: torch.topk(t, k, dim=1, sorted=False), timing.torch_sync)},
                       n, repeats=7)
    r["lax"] = timing.per_call_us(lambda: lax_k(x), timing.jax_sync, 2, repeats=3, warmup=1)
    return {"shape": f"{rows}x{cols}", "k": k, "sorted_us": r["sorted"], "unsorted_us": r["unsorted"],
            "torch_us": r["torch"], "torch_unsorted_us": r["torch unsorted"], "lax_us": r["lax"],
            "floor_us": floor_us, "torch/sorted": r["torch"] / r["sorted"],
            "torch/unsorted": r["torch unsorted"] / r["unsorted"], "lax/sorted": r["lax"] / r["sorted"],
            "sorted/floor": r["sorted"] / floor_us, "unsorted/floor": r["unsorted"] / floor_us}


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}")
    rows = []
    for m, n in SHAPES:
        floor_us = copy_floor_us(torch.randn(m, n, device="cuda"))
        rows += [one(m, n, k, floor_us) for k in KS]
        torch.cuda.empty_cache()
    plot.write("bench_topk", "top-k alone (float32 logits)", rows, [
        ("shape", "rows x keys"), ("k", "k"), ("sorted_us", "jax_dg us"), ("unsorted_us", "unsorted us"),
        ("torch_us", "torch.topk us"), ("torch_unsorted_us", "torch unsorted us"), ("lax_us", "lax.top_k us"),
        ("floor_us", "floor us"), ("torch/sorted", "torch/jax_dg"), ("torch/unsorted", "unsorted ratio"),
        ("lax/sorted", "lax/jax_dg"), ("sorted/floor", "x floor"), ("unsorted/floor", "unsorted x floor")],
        label=lambda r: f"{r['shape']} k{r['k']}", ratios=["torch/sorted", "torch/unsorted"])


if __name__ == "__main__":
    main()
