"""Paged MQA logits: deep_gemm from torch vs jax_dg in jit vs plain jax.numpy, one run.

    python benchmarks/bench_paged_mqa.py        (needs a CUDA device and deep_gemm)

The DeepSeek V3.2 indexer's decode step: H64, D128, block 64, every request at the full
context, blocks in a random permutation; B64/ctx8192 and B256/ctx32768 at next_n 1, B256/ctx8192
at next_n 2 (MTP: two query rows a request). The schedule
metadata is computed once outside the timed loops for every contender (a decode step reuses it
across layers); only the logits are timed.

DeepGEMM allocates its own logits; jax_dg lands that allocation in XLA's result buffer
(jax_dg.runtime.landing; B64 ctx8192's 2 MiB in a buffer holding torch's 20 MiB segment), writes
-inf past each row's length in place (kernels/neg_inf.cu: nothing to write here, every request
is at the full context) and the returned [rows, max_model_len] array is cut out by one XLA slice
(the pass a returned array costs; "copy us" times a torch copy of the same size alone). jax_dg
with clean_logits=False is timed too. Ratios:
torch time / jax_dg time.
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
from jax_dg.operands import paged

SHAPES = [(64, 8192, 1), (256, 32768, 1), (256, 8192, 2)]   # (B, ctx, next_n)
H, D, BLOCK = 64, 128, 64


def to_torch(x):
    if x.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def inputs(b, ctx, next_n, seed=0):
    lens = np.full((b, next_n), ctx, np.int32)
    table, nb = paged.build_block_tables(lens, BLOCK, key=seed)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    cache = jax.jit(lambda k: paged.quantize_kv_cache(jax.random.normal(k, (nb, BLOCK, D), jnp.bfloat16)))(k1)
    q = jax.random.normal(k2, (b, next_n, H, D), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    w = jax.random.normal(k3, (b * next_n, H), jnp.float32)
    return q, cache, w, jnp.asarray(lens), table


def plain_jnp(q, kv_cache, w, lens, table, max_len):
    """Gather each request's blocks, dequantise to bf16, score in chunks of requests (the
    [B, H, ctx] scores are never materialised at once), scale after the head sum, mask."""
    b, next_n, h, d = q.shape
    nb, blk = kv_cache.shape[:2]
    flat = kv_cache.reshape(nb, blk * (d + 4))
    t = table.shape[1] * blk
    chunk = max(1, min(b, (1 << 29) // (next_n * h * t * 4)))

    def one(args):
        # One request (lax.map's batch_size vmaps this over `chunk` requests at a time).
        qb, wb, lb, tb = args                                       # [n,H,D] [n,H] [n] [W]
        rows = flat[tb]                                             # [W, blk*(D+4)] uint8
        k = jax.lax.bitcast_convert_type(rows[:, :blk * d].reshape(t, d), jnp.float8_e4m3fn)
        sf = jax.lax.bitcast_convert_type(rows[:, blk * d:].reshape(t, 4), jnp.float32)
        s = jnp.einsum("nhd,td->nht", qb.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
        logits = (jnp.maximum(s, 0) * wb[..., None]).sum(1) * sf[None, :]
        pos = jnp.arange(t, dtype=jnp.int32)
        return jnp.where(pos[None, :] < lb[:, None], logits, -jnp.inf)

    out = jax.lax.map(one, (q, w.reshape(b, next_n, h), lens, table), batch_size=chunk)
    return out.reshape(b * next_n, t)[:, :max_len]


def bench_shape(b, ctx, next_n):
    q, cache, w, lens, table = inputs(b, ctx, next_n)
    max_len = table.shape[1] * BLOCK
    meta = jax.jit(lambda l: jax_dg.get_paged_mqa_logits_metadata(l, BLOCK))(lens)
    jax.block_until_ready((q, cache, w, lens, table, meta))
    row = {"shape": f"B{b} ctx{ctx}" + (f" next_n{next_n}" if next_n > 1 else "")}
    n = 200 if b * ctx <= 1 << 20 else 50

    tq, tkv, tw, tl, tt, tm = (to_torch(x) for x in (q, cache, w, lens, table, meta))

    def torch_call():
        # The first 7 positionally, clean_logits by keyword (what the probes ran on 2.5.0).
        return deep_gemm.fp8_fp4_paged_mqa_logits((tq, None), tkv, tw, tl, tt, tm, max_len,
                                                  clean_logits=False)
    def jax_dg_fn(clean):
        return jax.jit(lambda q, kv, w, l, t, m: jax_dg.fp8_fp4_paged_mqa_logits(
            (q, None), kv, w, l, t, m, max_len, clean_logits=clean))
    f, g = jax_dg_fn(True), jax_dg_fn(False)
    args = (q, cache, w, lens, table, meta)
    t = timing.compare({"torch": (torch_call, timing.torch_sync),
                        "jax_dg": (lambda: f(*args), timing.jax_sync),
                        "noclean": (lambda: g(*args), timing.jax_sync)}, n)
    row["torch_us"], row["jax_dg_us"], row["jax_dg_noclean_us"] = t["torch"], t["jax_dg"], t["noclean"]
    h = jax.jit(plain_jnp, static_argnums=5)
    row["jnp_us"] = timing.per_call_us(lambda: h(q, cache, w, lens, table, max_len), timing.jax_sync,
                                       max(n // 20, 3), repeats=3, warmup=1)

    # The output pass alone, on DeepGEMM's padded logits and an XLA-sized buffer.
    src = torch_call()
    out = torch.empty((b * next_n, max_len), dtype=torch.float32, device="cuda")
    row["copy_us"] = timing.per_call_us(lambda: out.copy_(src), timing.torch_sync, n)

    # Sanity: jax_dg's valid logits are DeepGEMM's, bit for bit; the jnp contender agrees.
    got = f(q, cache, w, lens, table, meta)
    torch.cuda.synchronize()
    valid = torch.arange(max_len, device="cuda")[None, :] < tl.reshape(-1, 1)
    assert torch.equal(src[valid].view(torch.int32), to_torch(got)[valid].view(torch.int32))
    ref = h(q, cache, w, lens, table, max_len)
    row["jnp_diff"] = jax_dg.calc_diff(jnp.where(jnp.isfinite(ref), ref, 0), jnp.where(jnp.isfinite(got), got, 0))

    row["torch/jax_dg"] = row["torch_us"] / row["jax_dg_us"]
    row["torch/noclean"] = row["torch_us"] / row["jax_dg_noclean_us"]
    row["jnp/jax_dg"] = row["jnp_us"] / row["jax_dg_us"]
    return row


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}, num_sms {deep_gemm.get_num_sms()}")
    rows = [bench_shape(*shape) for shape in SHAPES]
    plot.write("bench_paged_mqa", "fp8_fp4_paged_mqa_logits", rows, [
        ("shape", "shape"), ("torch_us", "torch us"), ("jax_dg_us", "jax_dg us"),
        ("jax_dg_noclean_us", "no-clean us"), ("jnp_us", "jnp us"), ("torch/jax_dg", "torch/jax_dg"),
        ("torch/noclean", "torch/noclean"), ("jnp/jax_dg", "jnp/jax_dg"), ("copy_us", "copy us"),
("jnp_diff", "jnp diff")],
        label="shape", ratios=["torch/jax_dg", "torch/noclean", "jnp/jax_dg"])


if __name__ == "__main__":
    main()
