"""MoE grouped GEMMs: deep_gemm from torch vs jax_dg inside jit vs plain jax.numpy, one run.

    python benchmarks/bench_grouped.py        (needs a CUDA device and deep_gemm)

m_grouped_fp8_gemm_nt_contiguous and m_grouped_fp8_gemm_nt_masked at MoE shapes: G experts in
{8, 32}, sum(M) valid rows in {4096, 32768} (rows per expert ~ sum(M)/G, uneven: x U(0.7, 1.3)),
N 4096, K 7168; a per token, b per block (DeepGEMM's recipe).
  torch        deep_gemm called from torch into a preallocated d
  jax_dg       the jitted op as shipped (clean=True: padding rows / rows past masked_m zeroed
               inside the call by jax_dg's kernel, which writes only those rows; output fully
               defined)
  jax_dg raw   clean=False: the kernel's output as is, as from torch
  jnp          plain jax.numpy: dequantise to bf16 (weights every call, as when they are stored
               in FP8), then one batched dot over experts (contiguous: rows gathered into
               [G, max rows, K] and scattered back; masked: all Mmax rows of every expert)
ratio = torch time / jax_dg time (>= 1: jax_dg as fast); TFLOP/s counts valid rows only. torch,
jax_dg and raw are timed interleaved (timing.compare, best of 7).
`same` checks once that jax_dg's defined rows are bitwise equal to deep_gemm's; `jnp diff` is
calc_diff(jnp, jax_dg) (bf16 operands vs FP8 kernel: ~1e-6 expected).
"""

from __future__ import annotations

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot

import jax
import jax.numpy as jnp
import numpy as np
import torch

import deep_gemm
import jax_dg
from jax_dg.contracts import align
from jax_dg.reference.gemm import dequant

N, K = 4096, 7168
CONFIGS = [(8, 4096), (32, 4096), (8, 32768), (32, 32768)]  # (experts G, valid rows sum(M))
MK = 128  # get_mk_alignment_for_contiguous_layout() on SM90


def to_torch(x):
    if x.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def iterations(flops: float) -> int:
    """Calls per timed sample: about 50 ms of work at ~1 PFLOP/s, 5 to 100."""
    return int(min(100, max(5, 5e4 / (flops / 1e9))))


@jax.jit
def cast_weights(w):
    return jax.vmap(jax_dg.per_block_cast_to_fp8)(w)


@jax.jit
def cast_rows(x):
    return jax.vmap(jax_dg.per_token_cast_to_fp8)(x) if x.ndim == 3 else jax_dg.per_token_cast_to_fp8(x)


def weights(key, g):
    return cast_weights(jax.random.normal(key, (g, N, K), jnp.bfloat16))


def plain_weights(b):
    return dequant(*b, 128, 128).astype(jnp.bfloat16)


@jax.jit
def plain_contiguous(a, b, slots, dest):
    """slots [G, R]: row of a in each expert's slot (M = empty slot); dest: the same, flattened."""
    x = jnp.concatenate([dequant(*a, 1, 128).astype(jnp.bfloat16), jnp.zeros((1, K), jnp.bfloat16)])
    y = jnp.einsum("grk,gnk->grn", x[slots], plain_weights(b), preferred_element_type=jnp.float32)
    d = jnp.zeros((a[0].shape[0], N), jnp.bfloat16)
    return d.at[dest].set(y.reshape(-1, N).astype(jnp.bfloat16), mode="drop")


@jax.jit
def plain_masked(a, b, masked_m):
    x = dequant(*a, 1, 128).astype(jnp.bfloat16)
    d = jnp.einsum("gmk,gnk->gmn", x, plain_weights(b), preferred_element_type=jnp.float32)
    rows = jnp.arange(x.shape[1])[None, :] < masked_m[:, None]
    return jnp.where(rows[:, :, None], d, 0).astype(jnp.bfloat16)


@jax.jit
def device_diff(x, y):
    return jax_dg.calc_diff(x, y)


def expert_rows(rng, g, total):
    return [max(1, int(total / g * rng.uniform(0.7, 1.3))) for _ in range(g)]


def time_all(row, torch_call, jax_call, raw_call, plain_call, flops):
    """torch, jax_dg and raw timed interleaved (every repeat runs each in turn: the same host
    state for all three); jnp, ~3-5x slower, on its own with fewer calls."""
    n = iterations(flops)
    t = timing.compare({"torch": (torch_call, timing.torch_sync), "jax_dg": (jax_call, timing.jax_sync),
                        "raw": (raw_call, timing.jax_sync)}, n, repeats=7)
    row["torch_us"], row["jax_dg_us"], row["raw_us"] = t["torch"], t["jax_dg"], t["raw"]
    row["jnp_us"] = timing.per_call_us(plain_call, timing.jax_sync, max(3, n // 4), repeats=3, warmup=1)
    row["torch/jax_dg"] = row["torch_us"] / row["jax_dg_us"]
    row["torch/raw"] = row["torch_us"] / row["raw_us"]
    row["jnp/jax_dg"] = row["jnp_us"] / row["jax_dg_us"]
    row["TFLOPs"] = flops / row["jax_dg_us"] / 1e6
    return row


def bench_contiguous(g, total, seed):
    rng = np.random.default_rng(seed)
    ms = expert_rows(rng, g, total)
    layout_np = np.concatenate([np.r_[np.full(m, i), np.full(align(m, MK) - m, -1)]
                                for i, m in enumerate(ms)]).astype(np.int32)
    m_all = layout_np.shape[0]
    slots_np = np.full((g, max(ms)), m_all, np.int32)
    for i in range(g):
        rows = np.flatnonzero(layout_np == i)
        slots_np[i, :rows.size] = rows
    key_a, key_b = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(key_a, (m_all, K), jnp.bfloat16)
    a, b = cast_rows(jnp.where(jnp.asarray(layout_np)[:, None] >= 0, x, 0)), weights(key_b, g)
    layout, slots = jnp.asarray(layout_np), jnp.asarray(slots_np)
    dest = slots.reshape(-1)

    ta, tb, tl = (to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1])), to_torch(layout)
    d = torch.empty((m_all, N), dtype=torch.bfloat16, device="cuda")
    f = jax.jit(jax_dg.m_grouped_fp8_gemm_nt_contiguous)
    f_raw = jax.jit(lambda a, b, l: jax_dg.m_grouped_fp8_gemm_nt_contiguous(a, b, l, clean=False))
    row = {"op": "contiguous", "G": g, "sum(M)": sum(ms), "rows": m_all}
    time_all(row, lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(ta, tb, d, tl),
             lambda: f(a, b, layout), lambda: f_raw(a, b, layout),
             lambda: plain_contiguous(a, b, slots, dest), 2 * sum(ms) * N * K)
    valid = tl >= 0
    out = f(a, b, layout)
    row["same"] = bool(torch.equal(to_torch(out)[valid], d[valid]))
    row["jnp_diff"] = f"{float(device_diff(plain_contiguous(a, b, slots, dest), out)):.1e}"
    return row


def bench_masked(g, total, seed):
    rng = np.random.default_rng(seed)
    ms = expert_rows(rng, g, total)
    max_m = align(max(ms), MK)
    expected_m = max(1, total // g)
    masked_m = jnp.asarray(ms, jnp.int32)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(seed))
    a, b = cast_rows(jax.random.normal(key_a, (g, max_m, K), jnp.bfloat16)), weights(key_b, g)

    ta, tb, tm = (to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1])), to_torch(masked_m)
    d = torch.empty((g, max_m, N), dtype=torch.bfloat16, device="cuda")
    f = jax.jit(lambda a, b, mm: jax_dg.m_grouped_fp8_gemm_nt_masked(a, b, mm, expected_m))
    f_raw = jax.jit(lambda a, b, mm: jax_dg.m_grouped_fp8_gemm_nt_masked(a, b, mm, expected_m, clean=False))
    row = {"op": "masked", "G": g, "sum(M)": sum(ms), "rows": g * max_m}
    time_all(row, lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked(ta, tb, d, tm, expected_m),
             lambda: f(a, b, masked_m), lambda: f_raw(a, b, masked_m),
             lambda: plain_masked(a, b, masked_m), 2 * sum(ms) * N * K)
    valid = torch.arange(max_m, device="cuda")[None, :] < tm[:, None]
    out = f(a, b, masked_m)
    row["same"] = bool(torch.equal(to_torch(out)[valid], d[valid]))
    row["jnp_diff"] = f"{float(device_diff(plain_masked(a, b, masked_m), out)):.1e}"
    return row


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}; N {N}, K {K}")
    rows = []
    for bench in (bench_contiguous, bench_masked):
        for i, (g, total) in enumerate(CONFIGS):
            rows.append(bench(g, total, seed=i))
            torch.cuda.empty_cache()
            print(rows[-1], flush=True)
    plot.write("bench_grouped", "m_grouped_fp8_gemm", rows, [
        ("op", "op"), ("G", "G"), ("sum(M)", "sum(M)"), ("rows", "rows"), ("torch_us", "torch us"),
        ("jax_dg_us", "jax_dg us"), ("raw_us", "raw us"), ("jnp_us", "jnp us"),
        ("torch/jax_dg", "torch/jax_dg"), ("torch/raw", "torch/raw"), ("jnp/jax_dg", "jnp/jax_dg"),
        ("TFLOPs", "TFLOP/s"), ("same", "same"), ("jnp_diff", "jnp diff")],
        label=lambda r: f"{r['op']} G{r['G']} M{r['sum(M)']}", ratios=["torch/jax_dg", "torch/raw", "jnp/jax_dg"])


if __name__ == "__main__":
    main()
