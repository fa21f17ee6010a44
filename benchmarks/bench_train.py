"""One forward + backward step of fp8_linear (DeepSeek V3's FP8 recipe) at DeepSeek shapes:
jax_dg inside jit vs the same three DeepGEMM calls from torch vs XLA's bf16 jax.vjp of x @ w.T.

    python benchmarks/bench_train.py      (needs a CUDA device and deep_gemm)

torch "gemms" times the three DeepGEMM calls alone (operands quantised beforehand); torch "full"
adds DeepGEMM's own torch quantisers (deep_gemm.utils.math) as a torch training step runs them.
jax_dg's step quantises inside the jitted program. Ratio = torch / jax_dg (target >= 0.95).
"""

from __future__ import annotations

import timing  # noqa: F401
import plot

import jax
import jax.numpy as jnp
import torch

import deep_gemm
import jax_dg
from deep_gemm.utils.math import per_block_cast_to_fp8, per_token_cast_to_fp8

M = 4096
SHAPES = [(7168, 2048), (2112, 7168), (24576, 1536)]


def torch_step(x, w, dy, quantise: bool):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    dx = torch.empty((m, k), dtype=torch.bfloat16, device="cuda")
    dw = torch.zeros((n, k), dtype=torch.float32, device="cuda")
    q = lambda t: per_token_cast_to_fp8(t, use_ue8m0=False)   # noqa: E731
    pre = (q(x), per_block_cast_to_fp8(w, use_ue8m0=False), q(dy), q(dy.t().contiguous()),
           q(x.t().contiguous()))

    def step():
        xq, wq, dyq, dytq, xtq = (q(x), per_block_cast_to_fp8(w, use_ue8m0=False), q(dy),
                                  q(dy.t().contiguous()), q(x.t().contiguous())) if quantise else pre
        deep_gemm.fp8_gemm_nt(xq, wq, y)                                              # forward
        deep_gemm.fp8_gemm_nt(dyq, (wq[0].t().contiguous(), wq[1].t().contiguous()), dx)  # dgrad
        deep_gemm.fp8_gemm_nt(dytq, xtq, dw, c=dw, recipe=(1, 1, 128))                 # wgrad
    return step


def to_torch(x):
    return torch.from_dlpack(x)


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}")
    rows = []
    for n, k in SHAPES:
        ks = jax.random.split(jax.random.PRNGKey(n + k), 3)
        x = jax.random.normal(ks[0], (M, k), jnp.bfloat16)
        w = (jax.random.normal(ks[1], (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        dy = jax.random.normal(ks[2], (M, n), jnp.bfloat16)

        def fp8_step(x, w, dy):
            y, vjp = jax.vjp(jax_dg.fp8_linear, x, w)
            return (y, *vjp(dy))

        def bf16_step(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16), x, w)
            return (y, *vjp(dy))
        def quant_only(x, w, dy):
            """What jax_dg's step does besides the three GEMMs: the five quantisations, the
            transposes, the MN-major scale layouts."""
            from jax_dg.reference.quant import per_block_cast_to_fp8 as pb, per_token_cast_to_fp8 as pt
            from jax_dg.operands.scales import mn_major_physical as phys
            xq, wq, dq, dtq, xtq = pt(x), pb(w), pt(dy), pt(dy.T), pt(x.T)
            return (xq[0], phys(xq[1]), wq, wq[0].T, dq[0], phys(dq[1]), dtq[0], phys(dtq[1]), xtq[0],
                    phys(xtq[1]))
        f, g, h = jax.jit(fp8_step), jax.jit(bf16_step), jax.jit(quant_only)
        tx, tw, tdy = to_torch(x), to_torch(w), to_torch(dy)
        row = {"shape": f"M{M} N{n} K{k}"}
        row["torch_gemms_us"] = timing.per_call_us(torch_step(tx, tw, tdy, False), timing.torch_sync, 20)
        row["torch_full_us"] = timing.per_call_us(torch_step(tx, tw, tdy, True), timing.torch_sync, 20)
        row["jax_dg_us"] = timing.per_call_us(lambda: f(x, w, dy), timing.jax_sync, 20)
        row["xla_bf16_us"] = timing.per_call_us(lambda: g(x, w, dy), timing.jax_sync, 20)
        row["jax_dg_quant_us"] = timing.per_call_us(lambda: h(x, w, dy), timing.jax_sync, 20)
        row["torch_gemms/jax_dg"] = row["torch_gemms_us"] / row["jax_dg_us"]
        row["torch_full/jax_dg"] = row["torch_full_us"] / row["jax_dg_us"]
        row["xla_bf16/jax_dg"] = row["xla_bf16_us"] / row["jax_dg_us"]
        rows.append(row)
    plot.write("bench_train", "fp8_linear forward + backward (3 FP8 GEMMs)", rows, [
        ("shape", "shape"), ("torch_gemms_us", "torch gemms"), ("torch_full_us", "torch full"),
        ("jax_dg_us", "jax_dg"), ("jax_dg_quant_us", "of it quant"), ("xla_bf16_us", "xla bf16"), ("torch_gemms/jax_dg", "tgemms/jax_dg"),
        ("torch_full/jax_dg", "tfull/jax_dg"), ("xla_bf16/jax_dg", "bf16/jax_dg")],
        label="shape", ratios=["torch_gemms/jax_dg", "torch_full/jax_dg", "xla_bf16/jax_dg"],
        ylabel="ratio (other / jax_dg; > 1: jax_dg faster)")


if __name__ == "__main__":
    main()
