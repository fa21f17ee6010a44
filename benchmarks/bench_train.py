"""FP8 training at DeepSeek shapes (DeepSeek V3's recipe): one forward + backward step of
fp8_linear and of fp8_grouped_linear (the quantisers alone: bench_quant.py).

    python benchmarks/bench_train.py      (needs a CUDA device and deep_gemm)

Steps (µs, one jit per jax contender):
  torch gemms     the three DeepGEMM calls from torch alone, operands quantised beforehand
  torch full      the same with deep_gemm's torch quantisers in the step
  jax_dg          jax.vjp of jax_dg.fp8_linear (three fused casts, three FP8 GEMMs)
  jax_dg f32 w    the same with float32 master weights (dw stays float32: no convert)
  xla bf16        jax.vjp of x @ w.T in bfloat16
The grouped layer (MoE experts, masked): the bare grouped GEMMs from torch (masked forward and
dgrad, k-grouped wgrad) against jax.vjp of jax_dg.fp8_grouped_linear and XLA's bf16 einsum.
All contenders of a table are timed interleaved in one run (benchmarks/timing.py).
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

M = 4096
SHAPES = [(7168, 2048), (2112, 7168), (24576, 1536)]
GROUPED = [(8, 512, 4096, 7168), (8, 512, 7168, 2048)]     # G, Mmax, N, K (DeepSeek V3's experts)
N_CALLS = 20
BF16 = jnp.bfloat16


def where_it_goes(runs: dict) -> dict:
    """The timeline of jax_dg's step and of torch's bare GEMMs (one CUPTI session): GPU busy and
    idle per step, kernels per step, and jax_dg's kernels with their time (printed)."""
    names = ["torch_gemms", "jax_dg"]
    groups = timeline.record([(timeline.batch(runs[n][0], N_CALLS), runs[n][1]) for n in names])
    s = {n: timeline.stats(g, N_CALLS) for n, g in zip(names, groups)}
    for n in names:
        print(f"  {n}: {s[n]['kernels']:.1f} kernels, busy {s[n]['busy_us']:.1f} us, idle "
              f"{s[n]['idle_us']:.1f} us per step; " + "; ".join(
                  f"{k} x{c:.2g} {us:.1f}us" for k, (c, us) in list(s[n]["per_kernel"].items())[:8]))
    return {"jax_dg_busy_us": s["jax_dg"]["busy_us"], "jax_dg_idle_us": s["jax_dg"]["idle_us"],
            "jax_dg_kernels": s["jax_dg"]["kernels"], "torch_gemms_busy_us": s["torch_gemms"]["busy_us"]}


def torch_step(x, w, dy, quantise: bool):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    dx = torch.empty((m, k), dtype=torch.bfloat16, device="cuda")
    dw = torch.zeros((n, k), dtype=torch.float32, device="cuda")
    q = lambda t: per_token_cast_to_fp8(t, use_ue8m0=False)   # noqa: E731
    wq = per_block_cast_to_fp8(w, use_ue8m0=False)
    pre = (q(x), wq, (wq[0].t().contiguous(), wq[1].t().contiguous()), q(dy), q(dy.t().contiguous()),
           q(x.t().contiguous()))

    def step():
        if quantise:
            wq = per_block_cast_to_fp8(w, use_ue8m0=False)
            ops = (q(x), wq, (wq[0].t().contiguous(), wq[1].t().contiguous()), q(dy),
                   q(dy.t().contiguous()), q(x.t().contiguous()))
        else:
            ops = pre
        xq, wq_, wtq, dyq, dytq, xtq = ops
        deep_gemm.fp8_gemm_nt(xq, wq_, y)                                 # forward
        deep_gemm.fp8_gemm_nt(dyq, wtq, dx)                               # dgrad
        deep_gemm.fp8_gemm_nt(dytq, xtq, dw, c=dw, recipe=(1, 1, 128))    # wgrad
    return step


def linear_steps(n: int, k: int) -> dict:
    key = jax.random.split(jax.random.PRNGKey(n + k), 3)
    x = jax.random.normal(key[0], (M, k), BF16)
    w = (jax.random.normal(key[1], (n, k), jnp.float32) * 0.02).astype(BF16)
    dy = jax.random.normal(key[2], (M, n), BF16)

    def fp8_step(x, w, dy):
        y, vjp = jax.vjp(jax_dg.fp8_linear, x, w)
        return (y, *vjp(dy))

    def bf16_step(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(BF16), x, w)
        return (y, *vjp(dy))
    f, g = jax.jit(fp8_step), jax.jit(bf16_step)
    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))
    w32 = w.astype(jnp.float32)
    runs = {"torch_gemms": (torch_step(tx, tw, tdy, False), timing.torch_sync),
            "torch_full": (torch_step(tx, tw, tdy, True), timing.torch_sync),
            "jax_dg": (lambda: f(x, w, dy), timing.jax_sync),
            "jax_dg_f32w": (lambda: f(x, w32, dy), timing.jax_sync),
            "xla_bf16": (lambda: g(x, w, dy), timing.jax_sync)}
    t = timing.compare(runs, N_CALLS)
    return {"shape": f"M{M} N{n} K{k}", **{f"{name}_us": v for name, v in t.items()}, **where_it_goes(runs),
            "torch_gemms/jax_dg": t["torch_gemms"] / t["jax_dg"],
            "torch_gemms/jax_dg_f32w": t["torch_gemms"] / t["jax_dg_f32w"],
            "torch_full/jax_dg": t["torch_full"] / t["jax_dg"], "xla_bf16/jax_dg": t["xla_bf16"] / t["jax_dg"]}


def grouped_steps(groups: int, mmax: int, n: int, k: int) -> dict:
    key = jax.random.split(jax.random.PRNGKey(groups * n + k), 4)
    x = jax.random.normal(key[0], (groups, mmax, k), BF16)
    w = (jax.random.normal(key[1], (groups, n, k), jnp.float32) * 0.02).astype(BF16)
    dy = jax.random.normal(key[2], (groups, mmax, n), BF16)
    masked_m = jax.random.randint(key[3], (groups,), mmax * 3 // 4, mmax + 1, jnp.int32)
    expected = mmax * 7 // 8

    def fp8_step(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: jax_dg.fp8_grouped_linear(x, w, masked_m, expected), x, w)
        return (y, *vjp(dy))

    def bf16_step(x, w, dy):
        f = lambda x, w: jnp.einsum("gmk,gnk->gmn", x, w, preferred_element_type=jnp.float32).astype(BF16)  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))
    # the bare GEMMs' operands, quantised once beforehand by jax_dg (bitwise deep_gemm's)
    (xq, xs), (xtq, xts) = jax_dg.cast_tokens(x, transposed=True, valid_rows=masked_m)
    (wq, ws), (wtq, wts) = jax_dg.cast_blocks(w, transposed=True)
    (gq, gs), (gtq, gts) = jax_dg.cast_tokens(dy, transposed=True, valid_rows=masked_m)
    T = torch.from_dlpack
    u8 = lambda a: T(jax.lax.bitcast_convert_type(a, jnp.uint8)).view(torch.float8_e4m3fn)   # noqa: E731
    a_f = (u8(xq), T(xs.physical).transpose(-1, -2)[:, :mmax])
    b_f = (u8(wq), T(ws))
    a_d = (u8(gq), T(gs.physical).transpose(-1, -2)[:, :mmax])
    b_d = (u8(wtq), T(wts))
    ks = [mmax] * groups
    ks_t = torch.tensor(ks, dtype=torch.int32, device="cuda")
    a_w = (u8(gtq).reshape(-1), T(gts.physical).reshape(-1, n).t())
    b_w = (u8(xtq).reshape(-1), T(xts.physical).reshape(-1, k).t())
    tm = T(masked_m)
    y = torch.empty((groups, mmax, n), dtype=torch.bfloat16, device="cuda")
    dx = torch.empty((groups, mmax, k), dtype=torch.bfloat16, device="cuda")
    dw = torch.zeros((groups, n, k), dtype=torch.float32, device="cuda")

    def torch_gemms():
        deep_gemm.m_grouped_fp8_gemm_nt_masked(a_f, b_f, y, tm, expected)
        deep_gemm.m_grouped_fp8_gemm_nt_masked(a_d, b_d, dx, tm, expected)
        deep_gemm.k_grouped_fp8_gemm_nt_contiguous(a_w, b_w, dw, ks, ks_t, c=dw)
    f, g = jax.jit(fp8_step), jax.jit(bf16_step)
    w32 = w.astype(jnp.float32)
    runs = {"torch_gemms": (torch_gemms, timing.torch_sync),
            "jax_dg": (lambda: f(x, w, dy), timing.jax_sync),
            "jax_dg_f32w": (lambda: f(x, w32, dy), timing.jax_sync),
            "xla_bf16": (lambda: g(x, w, dy), timing.jax_sync)}
    t = timing.compare(runs, N_CALLS)
    return {"shape": f"G{groups} Mmax{mmax} N{n} K{k}", **{f"{name}_us": v for name, v in t.items()},
            **where_it_goes(runs),
            "torch_gemms/jax_dg": t["torch_gemms"] / t["jax_dg"],
            "torch_gemms/jax_dg_f32w": t["torch_gemms"] / t["jax_dg_f32w"], "xla_bf16/jax_dg": t["xla_bf16"] / t["jax_dg"]}


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}")
    rows = [linear_steps(n, k) for n, k in SHAPES] + [grouped_steps(*s) for s in GROUPED]
    plot.write("bench_train", "FP8 training step, forward + backward (fp8_linear; fp8_grouped_linear)", rows, [
        ("shape", "shape"), ("torch_gemms_us", "torch gemms"), ("torch_full_us", "torch full"),
        ("jax_dg_us", "jax_dg"), ("jax_dg_f32w_us", "jax_dg f32 w"), ("xla_bf16_us", "xla bf16"),
        ("torch_gemms_busy_us", "gemms gpu busy"),
        ("jax_dg_busy_us", "jax_dg gpu busy"), ("jax_dg_idle_us", "jax_dg gpu idle"),
        ("jax_dg_kernels", "jax_dg kernels"), ("torch_gemms/jax_dg", "gemms/jax_dg"),
        ("torch_gemms/jax_dg_f32w", "gemms/f32 w"),
        ("torch_full/jax_dg", "tfull/jax_dg"), ("xla_bf16/jax_dg", "bf16/jax_dg")],
        label="shape", ratios=["torch_gemms/jax_dg", "torch_gemms/jax_dg_f32w", "torch_full/jax_dg",
                                "xla_bf16/jax_dg"],
        ylabel="speed ratio (> 1: jax_dg faster; gemms/jax_dg: target >= 0.9)")


if __name__ == "__main__":
    main()
