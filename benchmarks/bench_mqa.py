"""mqa_logits: deep_gemm from torch vs jax_dg inside jit vs plain jax.numpy, one run.

    python benchmarks/bench_mqa.py        (needs a CUDA device and deep_gemm)

DeepSeek V3.2 indexer shapes (H=64, D=128), causal prefill masks as in DeepGEMM's test
(ks = 0, ke = arange(S) + SK - S). Rows:
  full         the [S, SK] form, -inf outside [ks, ke) (DeepGEMM's clean_logits=True)
  compressed   the [S, max(ke-ks)] form; torch: DeepGEMM's raw output (tail unwritten),
               jax_dg: the tail set to -inf
ratio = torch time / jax_dg time (target >= 0.98). DeepGEMM allocates its padded output itself;
jax_dg lands that allocation in XLA's result buffer (jax_dg.runtime.landing) and writes -inf at the
invalid positions in place (kernels/neg_inf.cu), so a returned array costs one XLA pass (the
slice; `copy us` times a torch copy of that size alone, `copy %` its share of jax_dg).
Consumed inside the program, the slice fuses into the reader: `max/max` compares DeepGEMM +
amax in torch with mqa_logits(...).max(axis=1) in one jit; `clean us` is that jit's time less
the same with clean_logits=False (what the -inf kernel costs).
The plain jax.numpy contender computes the same formula a block of query rows at a time
(lax.map), never holding [S, H, SK] scores.
A second table times logits_dtype=bfloat16 against float32 at S2048 SK8192 (full form), four
contenders interleaved: deep_gemm from torch and jax_dg, each with both dtypes (bf16/f32 =
bf16 time / f32 time; half the output bytes).
"""

from __future__ import annotations

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot

import jax
import jax.numpy as jnp
import torch

import deep_gemm
import jax_dg

SHAPES = [(2048, 8192), (4096, 32768)]
H, D = 64, 128
# Scores per block of the plain jnp version (float32 elements): 2**28 = 1 GiB.
PLAIN_BLOCK_ELEMENTS = 1 << 28


def to_torch(x):
    if x.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def plain_jnp(q, kv, weights, ks, ke):
    """What one would write in jax.numpy: FP8 -> bf16 (exact) dots with float32 accumulation."""
    (qv, _), (kvv, kv_sf) = q, kv
    m, h, d = qv.shape
    n = kvv.shape[0]
    block = max(1, min(m, PLAIN_BLOCK_ELEMENTS // (h * n)))
    while m % block:
        block -= 1
    k = kvv.astype(jnp.bfloat16)
    pos = jnp.arange(n, dtype=jnp.int32)

    def rows(x):
        qb, wb, ksb, keb = x
        s = jnp.einsum("mhd,nd->mhn", qb.astype(jnp.bfloat16), k, preferred_element_type=jnp.float32)
        logits = jnp.einsum("mhn,mh->mn", jnp.maximum(s, 0.0), wb) * kv_sf[None, :]
        valid = (pos[None, :] >= ksb[:, None]) & (pos[None, :] < keb[:, None])
        return jnp.where(valid, logits, -jnp.inf)

    blocks = (qv.reshape(m // block, block, h, d), weights.reshape(m // block, block, h),
              ks.reshape(m // block, block), ke.reshape(m // block, block))
    return jax.lax.map(rows, blocks).reshape(m, n)


def inputs(s, sk):
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(s + sk), 3)
    q = (jax.random.normal(kq, (s, H, D), jnp.bfloat16).astype(jnp.float8_e4m3fn), None)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(kk, (sk, D), jnp.bfloat16))
    w = jax.random.normal(kw, (s, H), jnp.float32)
    ks, ke = jax_dg.causal_ks_ke(s, sk, include_self=False)
    return q, kv, w, ks, ke


def bench_shape(s, sk):
    q, kv, w, ks, ke = inputs(s, sk)
    tq, tkv, tw, tks, tke = to_torch(q[0]), (to_torch(kv[0]), to_torch(kv[1])), to_torch(w), to_torch(ks), to_torch(ke)
    msk = int((ke - ks).max())
    # Causal: the kernel scores about S * (SK - S/2) (row, key) pairs.
    flops = 2 * H * D * s * (sk - s / 2)
    n_iter = 50 if s * sk <= 2048 * 8192 else 20
    rows = []
    for form, width in (("full", 0), ("compressed", msk)):
        row = {"shape": f"S{s} SK{sk}", "form": form}
        clean = width == 0

        def dg():
            return deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke,
                                                clean_logits=clean, max_seqlen_k=width)
        f = jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=width or None))
        # consumed inside the program (a row max): XLA fuses the slice into the reader
        fr = jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=width or None).max(axis=1))
        # the same without jax_dg's -inf kernel: what the cleaning costs
        fn = jax.jit(lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=width or None,
                                                  clean_logits=False).max(axis=1))
        t = timing.compare({"torch": (dg, timing.torch_sync),
                            "jax_dg": (lambda: f(q, kv, w, ks, ke), timing.jax_sync),
                            "torch+max": (lambda: dg().amax(dim=1), timing.torch_sync),
                            "jax_dg+max": (lambda: fr(q, kv, w, ks, ke), timing.jax_sync),
                            "jax_dg+max no-clean": (lambda: fn(q, kv, w, ks, ke), timing.jax_sync)}, n_iter)
        row["torch_us"], row["jax_dg_us"] = t["torch"], t["jax_dg"]
        row["max/max"] = t["torch+max"] / t["jax_dg+max"]
        row["clean_us"] = t["jax_dg+max"] - t["jax_dg+max no-clean"]
        # The copy alone: DeepGEMM's padded view into a contiguous tensor of the same shape.
        view = dg()
        dst = torch.empty(view.shape, dtype=view.dtype, device="cuda")
        row["copy_us"] = timing.per_call_us(lambda: dst.copy_(view), timing.torch_sync, n_iter)
        del view, dst
        row["torch/jax_dg"] = row["torch_us"] / row["jax_dg_us"]
        row["copy_%"] = 100 * row["copy_us"] / row["jax_dg_us"]
        row["jax_dg_TFLOPs"] = flops / row["jax_dg_us"] / 1e6
        if clean:
            g = jax.jit(plain_jnp)
            row["jnp_us"] = timing.per_call_us(lambda: g(q, kv, w, ks, ke), timing.jax_sync, 5)
            row["jnp/jax_dg"] = row["jnp_us"] / row["jax_dg_us"]
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


DTYPE_SHAPE = (2048, 8192)


def bench_logits_dtype(s, sk):
    q, kv, w, ks, ke = inputs(s, sk)
    tq, tkv, tw, tks, tke = to_torch(q[0]), (to_torch(kv[0]), to_torch(kv[1])), to_torch(w), to_torch(ks), to_torch(ke)
    contenders = {}
    for name, tdt, jdt in (("f32", torch.float32, jnp.float32), ("bf16", torch.bfloat16, jnp.bfloat16)):
        f = jax.jit(lambda *a, jdt=jdt: jax_dg.mqa_logits(*a, logits_dtype=jdt))
        contenders[f"torch {name}"] = (lambda tdt=tdt: deep_gemm.fp8_fp4_mqa_logits(
            (tq, None), tkv, tw, tks, tke, clean_logits=True, max_seqlen_k=0, logits_dtype=tdt),
            timing.torch_sync)
        contenders[f"jax_dg {name}"] = (lambda f=f: f(q, kv, w, ks, ke), timing.jax_sync)
    t = timing.compare(contenders, 50)
    rows = []
    for who in ("torch", "jax_dg"):
        rows.append({"shape": f"S{s} SK{sk}", "who": who, "f32_us": t[f"{who} f32"],
                     "bf16_us": t[f"{who} bf16"], "bf16/f32": t[f"{who} bf16"] / t[f"{who} f32"]})
    rows[1]["torch/jax_dg bf16"] = t["torch bf16"] / t["jax_dg bf16"]
    return rows


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}, H={H}, D={D}")
    rows = [r for s, sk in SHAPES for r in bench_shape(s, sk)]
    plot.write("bench_mqa", "mqa_logits", rows, [
        ("shape", "shape"), ("form", "form"), ("torch_us", "torch us"), ("jax_dg_us", "jax_dg us"),
        ("jnp_us", "jnp us"), ("torch/jax_dg", "torch/jax_dg"), ("jnp/jax_dg", "jnp/jax_dg"),
        ("copy_us", "copy us"), ("copy_%", "copy %"), ("max/max", "max/max"),
        ("clean_us", "clean us"), ("jax_dg_TFLOPs", "TFLOP/s")],
        label=lambda r: f"{r['shape']} {r['form']}", ratios=["torch/jax_dg", "max/max"])
    # a second table, printed only (one plot per benchmark)
    print(plot.table_text("mqa_logits: bfloat16 vs float32 logits (full form)", bench_logits_dtype(*DTYPE_SHAPE), [
        ("shape", "shape"), ("who", "caller"), ("f32_us", "f32 us"), ("bf16_us", "bf16 us"),
        ("bf16/f32", "bf16/f32"), ("torch/jax_dg bf16", "torch/jax_dg bf16")]))


if __name__ == "__main__":
    main()
