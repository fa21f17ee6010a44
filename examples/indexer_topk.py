"""DeepSeek V3.2's lightning indexer as one jitted JAX step: MQA logits -> top-k keys per query.

    python examples/indexer_topk.py                 # DeepGEMM on a GPU, the torch emulation on CPU
    python examples/indexer_topk.py --seq 512 --keys 4096 --topk 512
    JAX_DG_BACKEND=xla python examples/indexer_topk.py   # pure JAX, no custom call
    python -m jax_dg warmup examples/indexer_topk.py     # compile its DeepGEMM kernels ahead

Random bf16 q and k are quantised to FP8 in JAX (q per token and head, its scale folded into the
weights; k per row), a causal prefill mask is built, and `jax_dg.indexer_topk` picks each
query's top-k keys inside one `jax.jit` (DeepGEMM's logits land in a scratch buffer that only
jax_dg's top-k kernel reads). The result is checked against the pure-JAX reference (the same
step traced with JAX_DG_BACKEND=xla): calc_diff of `jax_dg.mqa_logits` on valid positions,
identical -inf masks, the fused indices equal to top-k of those logits, and the share of top-k
indices both agree on. On a GPU with deep_gemm it also times the torch route (deep_gemm's
logits + torch.topk) the same way. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # room for DeepGEMM beside XLA

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_dg  # noqa: E402
from jax_dg.core import device  # noqa: E402

# Thresholds: DeepGEMM's own test bound for FP8 logits vs the dequantised reference, and top-k
# agreement (indices may differ only where two scores tie to within rounding).
MAX_DIFF = 5e-6
MIN_TOPK_AGREEMENT = 0.99
# Defaults: DeepSeek V3.2's indexer (64 heads of 128, top-2048) on a GPU; smaller on CPU.
GPU_SIZE = dict(seq=2048, keys=8192, topk=2048)
CPU_SIZE = dict(seq=256, keys=2048, topk=256)


def make_inputs(key, seq: int, keys: int, heads: int, dim: int):
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (seq, heads, dim), jnp.bfloat16)
    k = jax.random.normal(kk, (keys, dim), jnp.bfloat16)
    q_fp8, q_scale = jax_dg.per_row_cast_to_fp8(q.reshape(seq * heads, dim), use_ue8m0=True)
    q = (q_fp8.reshape(seq, heads, dim), q_scale.reshape(seq, heads))   # folded into weights
    kv = jax_dg.per_row_cast_to_fp8(k)                                   # (e4m3 [N, D], f32 [N])
    weights = jax.random.normal(kw, (seq, heads), jnp.float32) * heads ** -0.5 * dim ** -0.5
    ks, ke = jax_dg.causal_ks_ke(seq, keys)          # query i sees keys [0, keys - seq + i]
    return q, kv, weights, ks, ke


def indexer_step(q, kv, weights, ks, ke, *, topk: int, sorted: bool = True):
    """int32 [S, topk] key positions, best first (-1 past a row's keys); sorted=False: the
    same set in ascending key order, which is all a sparse attention needs (no sort)."""
    return jax_dg.indexer_topk(q, kv, weights, ks, ke, topk, sorted=sorted)


def torch_route(inputs, topk: int):
    """deep_gemm's logits + torch.topk on the same arrays (None without deep_gemm)."""
    try:
        import deep_gemm
        import torch
    except ImportError:
        return None
    (qv, qs), (kvv, kvs), weights, ks, ke = inputs
    w = jax_dg.fold_q_scale(weights, qs)
    as_torch = lambda x: torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(  # noqa: E731
        torch.float8_e4m3fn) if x.dtype == jnp.float8_e4m3fn else torch.from_dlpack(x)
    tq, tkv, tw, tks, tke = as_torch(qv), (as_torch(kvv), as_torch(kvs)), as_torch(w), as_torch(ks), as_torch(ke)

    def run():
        logits = deep_gemm.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=True,
                                              max_seqlen_k=0)
        return torch.topk(logits, topk, dim=1)[1]
    return run, torch.cuda.synchronize


def on_backend(backend: str, fn):
    """fn, traced and run with `backend` wherever it is called: the backend is part of jit's
    cache key, so a jitted function called outside its use_backend block is traced again with
    the default backend (this is how the reference's time once came out as jax_dg's)."""
    def call(*args):
        with jax_dg.use_backend(backend):
            return fn(*args)
    return call


def reference_step(topk: int):
    """The indexer step on the pure-JAX reference (no custom call), however it is called."""
    return on_backend("xla", jax.jit(lambda *a: indexer_step(*a, topk=topk)))


def time_ms(fn, *args, iters: int, sync=jax.block_until_ready) -> float:
    sync(fn(*args))                                          # warm-up (compiles)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        sync(out)
        best = min(best, (time.perf_counter() - t0) / iters * 1e3)
    return best


def topk_agreement(idx: np.ndarray, ref: np.ndarray) -> float:
    """Share of the reference's valid top-k picks that idx picks too (row by row)."""
    hits = total = 0
    for a, b in zip(idx, ref):
        b = b[b >= 0]
        hits += np.intersect1d(a[a >= 0], b, assume_unique=True).size
        total += b.size
    return hits / max(total, 1)


def parse_args(argv=None):
    platform = jax.devices()[0].platform
    size = GPU_SIZE if platform == "gpu" else CPU_SIZE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=size["seq"], help="queries S")
    p.add_argument("--keys", type=int, default=size["keys"], help="keys SK (the last S are the queries)")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=size["topk"])
    p.add_argument("--iters", type=int, default=20 if platform == "gpu" else 2)
    p.add_argument("--warmup", action="store_true",
                   help="compile the DeepGEMM kernels first, with progress (jax_dg.warmup)")
    return p.parse_args(argv)


def warmup_jobs(argv=None):
    """What `python -m jax_dg warmup examples/indexer_topk.py [-- args]` compiles ahead: the
    jitted functions main() runs, at its sizes (shapes only: nothing is computed)."""
    args = parse_args(argv)
    inputs = jax.eval_shape(lambda key: make_inputs(key, args.seq, args.keys, args.heads, args.dim),
                            jax.random.PRNGKey(0))
    return [("indexer step", indexer_step, inputs, {"topk": args.topk}),
            ("indexer step, unsorted", indexer_step, inputs, {"topk": args.topk, "sorted": False}),
            ("mqa_logits", jax_dg.mqa_logits, inputs, {})]


def main(argv=None) -> int:
    platform = jax.devices()[0].platform
    args = parse_args(argv)
    if args.warmup:
        for _, fn, fn_args, fn_kwargs in warmup_jobs(argv):
            jax_dg.warmup(fn, *fn_args, **fn_kwargs)

    concrete = device.target().backend
    print(f"indexer step: S={args.seq} queries x SK={args.keys} keys, H={args.heads}, D={args.dim}, "
          f"top-{args.topk} | {jax.devices()[0].device_kind}, backend {concrete}")

    inputs = make_inputs(jax.random.PRNGKey(0), args.seq, args.keys, args.heads, args.dim)
    step = jax.jit(lambda *a: indexer_step(*a, topk=args.topk))
    unsorted = jax.jit(lambda *a: indexer_step(*a, topk=args.topk, sorted=False))
    logits_fn = jax.jit(lambda *a: jax_dg.mqa_logits(*a))
    idx, logits = step(*inputs), logits_fn(*inputs)
    ref_step = reference_step(args.topk)
    ref_idx = ref_step(*inputs)
    ref_logits = on_backend("xla", jax.jit(lambda *a: jax_dg.mqa_logits(*a)))(*inputs)

    logits, ref_logits = np.asarray(logits), np.asarray(ref_logits)
    valid = ref_logits != -np.inf
    masks_equal = bool(np.array_equal(logits == -np.inf, ~valid))
    diff = jax_dg.calc_diff(logits[valid], ref_logits[valid])
    fused_exact = bool(np.array_equal(np.asarray(idx), np.asarray(jax_dg.topk_indices(jnp.asarray(logits), args.topk))))
    agree = topk_agreement(np.asarray(idx), np.asarray(ref_idx))
    ok = masks_equal and diff < MAX_DIFF and fused_exact and agree >= MIN_TOPK_AGREEMENT

    t_logits = time_ms(logits_fn, *inputs, iters=args.iters)
    t_step = time_ms(step, *inputs, iters=args.iters)
    t_unsorted = time_ms(unsorted, *inputs, iters=args.iters)
    t_ref = time_ms(ref_step, *inputs, iters=args.iters)
    print(f"check vs pure-JAX reference: calc_diff {diff:.1e} (< {MAX_DIFF:g}), -inf masks "
          f"{'identical' if masks_equal else 'DIFFER'}, fused = top-k of the logits: "
          f"{'yes' if fused_exact else 'NO'}, top-k agreement {agree:.2%} (>= {MIN_TOPK_AGREEMENT:.0%})")
    print(f"time per call: mqa_logits {t_logits:.3f} ms, indexer step (logits + top-k) "
          f"{t_step:.3f} ms ({t_unsorted:.3f} ms unsorted), pure-JAX reference step {t_ref:.3f} ms")
    route = torch_route(inputs, args.topk) if platform == "gpu" else None
    if route is not None:
        t_torch = time_ms(lambda: route[0](), iters=args.iters, sync=lambda _: route[1]())
        print(f"torch route (deep_gemm logits + torch.topk): {t_torch:.3f} ms -> jax_dg is "
              f"{t_torch / t_step:.2f}x its speed sorted, {t_torch / t_unsorted:.2f}x unsorted")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
