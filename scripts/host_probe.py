"""Where a jax_dg call's host time goes, per stage (GPU machine, deep_gemm installed).

    python scripts/host_probe.py            # the breakdown table
    python scripts/host_probe.py --loop S   # S seconds of back-to-back waited executions (for py-spy)

For a small fp8_gemm_nt (64 x 2112 x 7168) and mqa_logits (S2048 SK8192), one op per jitted
function, waited executions with the bridge's probe on: the medians (us) of
  dispatch-entry   the Python call until XLA enters jax_dg's handler
  entry-closure    the handler's C++ part (GIL, site, DLPack views) until the Python closure runs
  stream           torch's current stream and device made XLA's
  run              the op's run function (for the GEMM: the DeepGEMM call)
  in deep_gemm     of which inside DeepGEMM's own functions
  restore          torch's stream given back
  exit-wait        the closure's return until block_until_ready returns (XLA's tail, the GPU)
and the same DeepGEMM call made directly from torch on the same tensors, on torch's own stream
and on XLA's stream (ExternalStream), host time per call: what DeepGEMM's host path costs by
itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

import jax_dg
from jax_dg.runtime import bridge
from jax_dg.tools.interop import to_torch


def gemm_case():
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    a = jax_dg.per_token_cast_to_fp8(jax.random.normal(k[0], (64, 7168), jnp.bfloat16))
    b = jax_dg.per_block_cast_to_fp8(jax.random.normal(k[1], (2112, 7168), jnp.bfloat16))
    return jax.jit(jax_dg.fp8_gemm_nt), (a, b)


def mqa_case():
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    s, n, h, d = 2048, 8192, 64, 128
    q = jax.random.normal(k[0], (s, h, d)).astype(jnp.float8_e4m3fn)
    kv = (jax.random.normal(k[1], (n, d)).astype(jnp.float8_e4m3fn),
          jax.random.uniform(k[2], (n,), jnp.float32, 0.5, 1.0))
    w = jax.random.normal(k[3], (s, h), jnp.float32)
    ks, ke = jax_dg.causal_ks_ke(s, n)
    return jax.jit(jax_dg.mqa_logits), (q, kv, w, ks, ke)


def breakdown(fn, args, execs=300) -> dict:
    for _ in range(20):
        jax.block_until_ready(fn(*args))
    bridge.probe(True)
    calls, waits = [], []
    for _ in range(execs):
        t = time.monotonic_ns()
        out = fn(*args)
        jax.block_until_ready(out)
        calls.append(t)
        waits.append(time.monotonic_ns())
        del out
    events, stages = bridge.probe_events(), bridge.probe_stages()
    bridge.probe(False)
    assert len(events) == len(stages) == execs, (len(events), len(stages))
    rows = {k: [] for k in ("dispatch-entry", "entry-closure", "stream", "run", "in deep_gemm",
                            "restore", "closure-exit", "exit-wait", "total")}
    for c, w, e, st in zip(calls, waits, events, stages):
        _, entry, _, _, _, leave = e
        t0, t1, t2, t3, dg = st
        for key, v in (("dispatch-entry", entry - c), ("entry-closure", t0 - entry), ("stream", t1 - t0),
                       ("run", t2 - t1), ("in deep_gemm", dg), ("restore", t3 - t2),
                       ("closure-exit", leave - t3),
                       ("exit-wait", w - leave), ("total", w - c)):
            rows[key].append(v / 1e3)
    return {k: statistics.median(v) for k, v in rows.items()}


def direct_gemm_us(args, reps=2000) -> dict:
    """deep_gemm.fp8_gemm_nt from torch on the jax_dg operands' torch views: host us per call."""
    import deep_gemm
    (a, sfa), (b, sfb) = args
    ta, tb = to_torch(a), to_torch(b)
    tsfa = deep_gemm.get_mn_major_tma_aligned_tensor(to_torch(sfa))   # as vLLM hands it over
    tsfb = to_torch(sfb)
    d = torch.empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16, device="cuda")
    out = {}
    ext = torch.cuda.ExternalStream(torch.cuda.Stream().cuda_stream)
    for name, stream in (("torch stream", torch.cuda.current_stream()), ("external stream", ext)):
        with torch.cuda.stream(stream):
            for _ in range(20):
                deep_gemm.fp8_gemm_nt((ta, tsfa), (tb, tsfb), d)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps // 5):
                    deep_gemm.fp8_gemm_nt((ta, tsfa), (tb, tsfb), d)
                best = min(best, (time.perf_counter() - t) / (reps // 5) * 1e6)
                torch.cuda.synchronize()
        out[name] = best
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", type=float, default=0.0)
    args = parser.parse_args()
    if args.loop:
        fn, a = gemm_case()
        jax.block_until_ready(fn(*a))
        end = time.monotonic() + args.loop
        while time.monotonic() < end:
            jax.block_until_ready(fn(*a))
        return
    table = {}
    for name, (fn, a) in (("fp8_gemm_nt 64x2112x7168", gemm_case()), ("mqa_logits S2048 SK8192", mqa_case())):
        table[name] = breakdown(fn, a)
    keys = list(next(iter(table.values())))
    print("median us per waited execution, one op per jit (bridge probe on)")
    print(f"{'':28}" + "".join(f"{k:>15}" for k in keys))
    for name, row in table.items():
        print(f"{name:28}" + "".join(f"{row[k]:15.1f}" for k in keys))
    direct = direct_gemm_us(gemm_case()[1])
    print("deep_gemm.fp8_gemm_nt called from torch, host us per call: " +
          ", ".join(f"{k} {v:.1f}" for k, v in direct.items()))


if __name__ == "__main__":
    main()
