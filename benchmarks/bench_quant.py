"""The fused FP8 casts of a training step against their memory floor (issue 28), DeepSeek shapes.

    python benchmarks/bench_quant.py      (needs a CUDA device and deep_gemm)

Per operand of an fp8_linear step at M 4096 (x [M, K] and dy [M, N]: per token, with the
transposed per-token cast for the wgrad; w [N, K]: per block, with the transposed blocks for
the dgrad), timed interleaved in one run (benchmarks/timing.py):
  fused           jax_dg.cast_tokens / cast_blocks (one pass, scales written MN-major)
  separate        the quantisers they replaced (per-token / per-block casts, transposes, scale
                  layouts in XLA), one jit
  deep_gemm torch deep_gemm.utils.math's quantisers as a torch training step runs them
                  (`.t().contiguous()` for the transposed operands)
  floor           bytes read and written once at the measured device-copy bandwidth
Columns "us": wall time per call (n back-to-back calls, one sync; a single jitted call also pays
jax's dispatch of an executable); "gpu us": GPU busy time per call from one CUPTI timeline
(benchmarks/timeline.py: the union of the call's kernels), with the kernels per call.
Ratios: fused gpu / floor (target <= 1.5), separate / fused and torch / fused (gpu time; > 1:
fused faster).
"""

from __future__ import annotations

import timing  # noqa: F401
import plot
import timeline   # the CUPTI profiler helpers (record, stats)

import jax
import jax.numpy as jnp
import torch

import deep_gemm
import jax_dg
from deep_gemm.utils.math import per_block_cast_to_fp8, per_token_cast_to_fp8
from jax_dg.operands.scales import mn_major_physical
from jax_dg.reference import quant   # the pure-JAX formulas: what the step ran before the casts

M = 4096
SHAPES = [(7168, 2048), (2112, 7168), (24576, 1536)]
N_CALLS = 20
BF16 = jnp.bfloat16


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), 1 GiB."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timing.per_call_us(lambda: dst.copy_(src), timing.torch_sync, 10)
    return 2 * src.numel() / us / 1e3


def quantisers(n: int, k: int, gbps: float) -> list[dict]:
    key = jax.random.split(jax.random.PRNGKey(n * k), 3)
    x = jax.random.normal(key[0], (M, k), BF16)
    w = (jax.random.normal(key[1], (n, k), jnp.float32) * 0.02).astype(BF16)
    dy = jax.random.normal(key[2], (M, n), BF16)
    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
    q = lambda t: per_token_cast_to_fp8(t, use_ue8m0=False)   # noqa: E731
    rows = []
    for name, a, ta, block in (("x", x, tx, False), ("w", w, tw, True), ("dy", dy, tdy, False)):
        r, c = a.shape
        # read 2 bytes, write 1 byte twice (values and transposed values) per element; scales
        scale_bytes = 4 * (r * c // 128 * 2 if not block else 2 * r * c // 128 ** 2)
        floor_us = (2 * r * c + 2 * r * c + scale_bytes) / gbps / 1e3
        if block:
            fused = jax.jit(lambda a: jax_dg.cast_blocks(a, transposed=True))
            sep = jax.jit(lambda a: (lambda b: (b, b[0].T, b[1].T))(quant.per_block_cast_to_fp8(a)))
            torch_q = lambda: (lambda b: (b, b[0].t().contiguous()))(per_block_cast_to_fp8(tw, use_ue8m0=False))  # noqa: E731
        else:
            fused = jax.jit(lambda a: jax_dg.cast_tokens(a, transposed=True))
            sep = jax.jit(lambda a: [(v, mn_major_physical(s)) for v, s in (
                quant.per_token_cast_to_fp8(a), quant.per_token_cast_to_fp8(a.T))])
            torch_q = (lambda ta=ta: (q(ta), q(ta.t().contiguous())))   # noqa: E731
        runs = {"fused": (lambda: fused(a), timing.jax_sync),
                "separate": (lambda: sep(a), timing.jax_sync),
                "torch": (torch_q, timing.torch_sync)}
        t = timing.compare(runs, N_CALLS)
        groups = timeline.record([(timeline.batch(run, N_CALLS), sync) for run, sync in runs.values()])
        gpu = {name: timeline.stats(g, N_CALLS) for name, g in zip(runs, groups)}
        busy = {name: s["busy_us"] for name, s in gpu.items()}
        rows.append({"operand": f"M{M} N{n} K{k} {name} [{r}, {c}]", "floor_us": floor_us,
                     "fused_us": t["fused"], "fused_gpu_us": busy["fused"],
                     "fused_kernels": gpu["fused"]["kernels"], "separate_gpu_us": busy["separate"],
                     "separate_kernels": gpu["separate"]["kernels"], "torch_gpu_us": busy["torch"],
                     "torch_kernels": gpu["torch"]["kernels"],
                     "fused/floor": busy["fused"] / floor_us, "separate/fused": busy["separate"] / busy["fused"],
                     "torch/fused": busy["torch"] / busy["fused"]})
    return rows


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}")
    gbps = copy_gbps()
    print(f"device copy: {gbps:.0f} GB/s (read + write)")
    rows = [r for n, k in SHAPES for r in quantisers(n, k, gbps)]
    plot.write("bench_quant", "fused FP8 casts vs their memory floor and the separate quantisers", rows, [
        ("operand", "operand"), ("floor_us", "floor"), ("fused_gpu_us", "fused gpu us"),
        ("fused_kernels", "kernels"), ("fused_us", "fused wall us"), ("separate_gpu_us", "separate gpu us"),
        ("separate_kernels", "kernels"), ("torch_gpu_us", "dg torch gpu us"), ("torch_kernels", "kernels"),
        ("fused/floor", "fused/floor"), ("separate/fused", "sep/fused"), ("torch/fused", "torch/fused")],
        label="operand", ratios=["fused/floor", "separate/fused", "torch/fused"],
        ylabel="ratio (fused/floor: target <= 1.5; others > 1: fused faster)")


if __name__ == "__main__":
    main()
