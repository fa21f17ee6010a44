"""Paired A/B of the paged logits call's sanitising, in one process (GPU, deep_gemm installed).

    python benchmarks/paged_probe.py

The same one-op jitted paged_mqa_logits (schedule given, as bench_paged_mqa) traced twice:
"native" with jax_dg's sanitising kernel (kernels/paged_sanitise.cu, the shipped path) and
"xla" with its pure-JAX reference in its place (jax_dg.reference.paged_mqa.paged_sanitised: the
XLA fusions the previous tree ran), each plain and with command buffers
(xla_gpu_graph_min_graph_size 1); deep_gemm from torch eager; and a control: a jitted `x + 1` on
16 floats (JAX's own per-execution host cost on this machine). Per contender: us per call
(n back-to-back calls, one sync, best of 10, interleaved), jax_dg handler entries per call, and
the outputs of the two traces compared bitwise.
"""

from __future__ import annotations

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)

import jax
import jax.numpy as jnp
import numpy as np

import bench_paged_mqa as bp
import deep_gemm
import jax_dg
from jax_dg.core import native
from jax_dg.runtime import bridge
from jax_dg.ops import paged_mqa as pm

GRAPH = {"xla_gpu_graph_min_graph_size": 1}
N = 20


def entries() -> int:
    return bridge.call_count() + native.call_count()


def xla_sanitise(*arrays, one_d, **static):
    """The pure-JAX reference in the op's place (what XLA fuses)."""
    return pm.PAGED_SANITISE.reference(*arrays, **static)


def case(b, ctx, next_n):
    q, cache, w, lens, table = bp.inputs(b, ctx, next_n)
    max_len = table.shape[1] * bp.BLOCK
    meta = jax.jit(lambda l: jax_dg.get_paged_mqa_logits_metadata(l, bp.BLOCK))(lens)
    args = (q, cache, w, lens, table, meta)
    jax.block_until_ready(args)

    def op(q, kv, w, l, t, m):
        return jax_dg.fp8_fp4_paged_mqa_logits((q, None), kv, w, l, t, m, max_len)
    fns = {}
    real = pm.PAGED_SANITISE
    for name, sanitise in (("xla", xla_sanitise), ("native", real)):
        pm.PAGED_SANITISE = sanitise
        try:   # traced and compiled now; later calls hit the jit cache
            for mode, opts in (("", None), (" graph", GRAPH)):
                f = jax.jit(lambda *a: op(*a), compiler_options=opts)
                jax.block_until_ready(f(*args))
                fns[name + mode] = f
        finally:
            pm.PAGED_SANITISE = real
    outs = {k: np.asarray(f(*args)) for k, f in fns.items()}
    same = all(np.array_equal(outs["native"].view(np.int32), o.view(np.int32)) for o in outs.values())
    tq, tkv, tw, tl, tt, tm = (bp.to_torch(x) for x in (q, cache, w, lens, table, meta))
    x = jnp.ones((16,), jnp.float32)
    plus = jax.jit(lambda x: x + 1)
    runs = {"torch": (lambda: deep_gemm.fp8_fp4_paged_mqa_logits((tq, None), tkv, tw, tl, tt, tm, max_len,
                                                               clean_logits=False), timing.torch_sync),
            "x + 1": (lambda: plus(x), timing.jax_sync)}
    runs.update({k: (lambda f=f: f(*args), timing.jax_sync) for k, f in fns.items()})
    t = timing.compare(runs, N, repeats=10)
    per = {}
    for k, f in fns.items():
        e0 = entries()
        out = None
        for _ in range(N):
            out = f(*args)
        jax.block_until_ready(out)
        per[k] = (entries() - e0) / N
    label = f"B{b} ctx{ctx} next_n{next_n}"
    print(f"{label}: outputs bitwise equal across traces: {same}")
    for k, us in t.items():
        print(f"  {k:14s} {us:8.1f} us/call" + (f"   {per[k]:.0f} handler entries/call" if k in per else ""))


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, deep_gemm {getattr(deep_gemm, '__version__', '?')}")
    for shape in ((64, 8192, 1), (256, 8192, 2)):
        case(*shape)


if __name__ == "__main__":
    main()
