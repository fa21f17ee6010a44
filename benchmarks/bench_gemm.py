"""fp8_gemm_nt: deep_gemm from torch vs jax_dg inside jit vs plain jax.numpy, one run.

    python benchmarks/bench_gemm.py        (needs a CUDA device and deep_gemm)

Big shapes: time per call, ratio = torch time / jax_dg time (target >= 0.98).
Small shapes: also a chain of R independent calls inside one jitted function, per op,
against torch's own per-call cost in a Python loop (target: jax_dg <= torch + 10 us).
"""

from __future__ import annotations

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot

import jax
import jax.numpy as jnp
import torch

import deep_gemm
import jax_dg
from jax_dg.reference.gemm import dequant

BIG = [(4096, 7168, 16384), (4096, 24576, 1536)]
SMALL = [(128, 4096, 7168), (64, 2112, 7168)]
CHAIN = 32


def to_torch(x):
    if x.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def plain_jnp(a, b):
    x = dequant(*a, 1, 128).astype(jnp.bfloat16)
    w = dequant(*b, 128, 128).astype(jnp.bfloat16)
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def inputs(key, m, n, k, count=1):
    ks = jax.random.split(key, count + 1)
    w = jax.random.normal(ks[0], (n, k), jnp.bfloat16)
    b = jax_dg.per_block_cast_to_fp8(w)
    a = [jax_dg.per_token_cast_to_fp8(jax.random.normal(kk, (m, k), jnp.bfloat16)) for kk in ks[1:]]
    return a, b


def bench_shape(m, n, k, chain):
    a_list, b = inputs(jax.random.PRNGKey(m * 7 + n + k), m, n, k, CHAIN if chain else 1)
    a = a_list[0]
    flops = 2 * m * n * k
    row = {"shape": f"M{m} N{n} K{k}"}

    ta = [(to_torch(x), to_torch(s)) for x, s in a_list]
    tb = (to_torch(b[0]), to_torch(b[1]))
    d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    n_iter = 100 if flops > 1e11 else 200  # long runs: first-dispatch latency amortised
    row["torch_us"] = timing.per_call_us(lambda: deep_gemm.fp8_gemm_nt(ta[0], tb, d),
                                         timing.torch_sync, n_iter)
    f = jax.jit(jax_dg.fp8_gemm_nt)
    row["jax_dg_us"] = timing.per_call_us(lambda: f(a, b), timing.jax_sync, n_iter)
    g = jax.jit(plain_jnp)
    row["jnp_us"] = timing.per_call_us(lambda: g(a, b), timing.jax_sync, max(n_iter // 4, 5))
    row["torch/jax_dg"] = row["torch_us"] / row["jax_dg_us"]
    row["jnp/jax_dg"] = row["jnp_us"] / row["jax_dg_us"]
    row["jax_dg_TFLOPs"] = flops / row["jax_dg_us"] / 1e6
    if chain:
        def torch_chain():
            for x in ta:
                deep_gemm.fp8_gemm_nt(x, tb, d)
        row["torch_chain_us"] = timing.per_call_us(torch_chain, timing.torch_sync, 20) / CHAIN
        fc = jax.jit(lambda a_list, b: [jax_dg.fp8_gemm_nt(x, b) for x in a_list])
        row["jax_dg_chain_us"] = timing.per_call_us(lambda: fc(a_list, b), timing.jax_sync, 20) / CHAIN
        row["chain_overhead_us"] = row["jax_dg_chain_us"] - row["torch_chain_us"]
    return row


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}")
    rows = [bench_shape(m, n, k, chain=False) for m, n, k in BIG]
    rows += [bench_shape(m, n, k, chain=True) for m, n, k in SMALL]
    plot.write("bench_gemm", "fp8_gemm_nt", rows, [
        ("shape", "shape"), ("torch_us", "torch us"), ("jax_dg_us", "jax_dg us"),
        ("jnp_us", "jnp us"), ("torch/jax_dg", "torch/jax_dg"), ("jnp/jax_dg", "jnp/jax_dg"),
        ("jax_dg_TFLOPs", "TFLOP/s"), ("torch_chain_us", "torch/op chain"),
        ("jax_dg_chain_us", "jax_dg/op chain"), ("chain_overhead_us", "overhead us")],
        label="shape", ratios=["torch/jax_dg", "jnp/jax_dg"])


if __name__ == "__main__":
    main()
