"""Small GEMMs, where per-call cost is everything: torch eager, torch CUDA graph, jax_dg in one
jit with XLA's command buffers (CUDA graphs) on and off, and plain jax.numpy, in one run.

    python benchmarks/bench_small.py      (needs a CUDA device and deep_gemm)

Each contender runs R = 64 independent back-to-back GEMMs per step (distinct `a`, one `b`);
the time is per GEMM, best of repeats after warm-up. "graphs off" runs in a child process with
XLA_FLAGS=--xla_gpu_enable_command_buffer= (XLA reads its flags once per process).
Also a decode-style loop: lax.fori_loop of 32 steps, each quantising the activations and running
two FP8 GEMMs (up 7168 -> 4096, down 4096 -> 7168), against the same loop in torch.
"jax_dg mn scales": the same jit with the activations' scales already MN-major (MNMajor, laid
out once outside the timed calls as torch's side does; in the decode loop jax_dg.cast_tokens
makes them so): no scale-layout node per GEMM (issue 24, deliverable 4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot

import jax
import jax.numpy as jnp
import torch

import deep_gemm
import jax_dg
from jax_dg.core import registry
from jax_dg.core.op import Op
from jax_dg.operands.scales import MNMajor, mn_major_physical
from jax_dg.reference.gemm import dequant

# A graph-safe op that does nothing: the fixed cost of one jax_dg call (XLA's custom-call thunk
# and the bridge, Python included), with no kernel and no DeepGEMM host work.
NOOP = Op(name="_bench_noop", args=("x",), statics={},
          shapes=lambda x: [jax.ShapeDtypeStruct((1,), jnp.float32)],
          run=lambda dg, x, out: None, reference=lambda x: jnp.zeros((1,), jnp.float32),
          graph_safe=frozenset({"sm90", "sm100"}))
registry.register(NOOP)

R = 64
FP8_SHAPES = [(m, n, k) for m in (1, 64, 128) for n, k in ((2112, 7168), (4096, 7168), (576, 7168))]
BF16_SHAPES = [(64, 2112, 7168)]
STEPS = 32
DECODE_M = (1, 64)


def to_torch(x):
    if x.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def mn_major(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's MN-major TMA-aligned layout, made once (what vLLM hands DeepGEMM)."""
    return deep_gemm.get_mn_major_tma_aligned_tensor(sf)


def fp8_inputs(m, n, k, seed):
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, R + 1)
    b = jax_dg.per_block_cast_to_fp8(jax.random.normal(ks[0], (n, k), jnp.bfloat16))
    a = [jax_dg.per_token_cast_to_fp8(jax.random.normal(kk, (m, k), jnp.bfloat16)) for kk in ks[1:]]
    return a, b


def plain_jnp_fp8(a, b):
    x = dequant(*a, 1, 128).astype(jnp.bfloat16)
    w = dequant(*b, 128, 128).astype(jnp.bfloat16)
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def torch_contenders(calls):
    """(eager us, graph us) per call for a list of zero-argument torch calls."""
    def eager():
        for c in calls:
            c()
    eager_us = timing.per_call_us(eager, timing.torch_sync, 10) / len(calls)
    eager()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager()
    graph_us = timing.per_call_us(g.replay, timing.torch_sync, 20) / len(calls)
    return eager_us, graph_us


def jax_rows(graphs: bool) -> dict:
    """jax_dg (and plain jnp) per-call times of every shape in this process's XLA mode."""
    out = {}
    for m, n, k in FP8_SHAPES:
        a, b = fp8_inputs(m, n, k, m + n + k)
        f = jax.jit(lambda a, b: [jax_dg.fp8_gemm_nt(x, b) for x in a])
        out[f"fp8 M{m} N{n} K{k}"] = {"jax_dg": timing.per_call_us(lambda: f(a, b), timing.jax_sync, 10) / R}
        # the scales laid out once, as torch's caller (and vLLM) hand them: no layout node per GEMM
        a_mn = [(x, MNMajor(jax.jit(mn_major_physical)(s), m)) for x, s in a]
        out[f"fp8 M{m} N{n} K{k}"]["jax_dg_mn"] = timing.per_call_us(lambda: f(a_mn, b), timing.jax_sync, 10) / R
        if graphs:
            g = jax.jit(lambda a, b: [plain_jnp_fp8(x, b) for x in a])
            out[f"fp8 M{m} N{n} K{k}"]["jnp"] = timing.per_call_us(lambda: g(a, b), timing.jax_sync, 5) / R
    for m, n, k in BF16_SHAPES:
        ks = jax.random.split(jax.random.PRNGKey(7), R + 1)
        w = jax.random.normal(ks[0], (n, k), jnp.bfloat16)
        xs = [jax.random.normal(kk, (m, k), jnp.bfloat16) for kk in ks[1:]]
        f = jax.jit(lambda xs, w: [jax_dg.bf16_gemm_nt(x, w) for x in xs])
        row = out[f"bf16 M{m} N{n} K{k}"] = {"jax_dg": timing.per_call_us(lambda: f(xs, w), timing.jax_sync, 10) / R}
        if graphs:
            g = jax.jit(lambda xs, w: [jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16) for x in xs])
            row["jnp"] = timing.per_call_us(lambda: g(xs, w), timing.jax_sync, 5) / R
    for m in DECODE_M:
        x, w_up, w_down = decode_inputs(m)
        f = jax.jit(decode_loop)
        out[f"decode M{m}"] = {"jax_dg": timing.per_call_us(lambda: f(x, w_up, w_down), timing.jax_sync, 5) / STEPS}
        f = jax.jit(decode_loop_mn)
        out[f"decode M{m}"]["jax_dg_mn"] = timing.per_call_us(lambda: f(x, w_up, w_down), timing.jax_sync, 5) / STEPS
    xs = [jnp.full((1,), i, jnp.float32) for i in range(R)]
    f = jax.jit(lambda xs: [NOOP(x)[0] for x in xs])
    out["noop"] = {"jax_dg": timing.per_call_us(lambda: f(xs), timing.jax_sync, 20) / R}
    g = jax.jit(lambda xs: [x * 3 + 1 for x in xs])   # XLA's own per-kernel cost, for comparison
    out["xla_tiny"] = {"jax_dg": timing.per_call_us(lambda: g(xs), timing.jax_sync, 20) / R}
    out["closure"] = {"jax_dg": closure_us()}
    return out


def closure_us() -> float:
    """The Python part of one call: the bridge's prepared closure (torch stream switch, capture
    guard, run function) called directly with torch views, no XLA."""
    import time
    from jax_dg.runtime import bridge
    from jax_dg.core.site import Site
    fn = bridge._prepare(Site("_bench_noop", "deep_gemm", (True,), True, {}).encode(), "cuda")
    stream = torch.cuda.Stream()
    ins, outs = (torch.zeros(1, device="cuda"),), (torch.zeros(1, device="cuda"),)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10000):
            fn(stream.cuda_stream, 0, ins, outs)
        best = min(best, (time.perf_counter() - t0) / 10000 * 1e6)
    return best


def decode_inputs(m):
    ks = jax.random.split(jax.random.PRNGKey(m), 3)
    x = jax.random.normal(ks[0], (m, 7168), jnp.bfloat16)
    w_up = jax_dg.per_block_cast_to_fp8(jax.random.normal(ks[1], (4096, 7168), jnp.bfloat16) * 0.02)
    w_down = jax_dg.per_block_cast_to_fp8(jax.random.normal(ks[2], (7168, 4096), jnp.bfloat16) * 0.02)
    return x, w_up, w_down


def decode_loop(x, w_up, w_down):
    def step(_, h):
        u = jax_dg.fp8_gemm_nt(jax_dg.per_token_cast_to_fp8(h), w_up)
        return jax_dg.fp8_gemm_nt(jax_dg.per_token_cast_to_fp8(u), w_down)
    return jax.lax.fori_loop(0, STEPS, step, x)


def decode_loop_mn(x, w_up, w_down):
    """decode_loop with jax_dg.cast_tokens, whose scales are already MN-major (MNMajor)."""
    def step(_, h):
        u = jax_dg.fp8_gemm_nt(jax_dg.cast_tokens(h)[0], w_up)
        return jax_dg.fp8_gemm_nt(jax_dg.cast_tokens(u)[0], w_down)
    return jax.lax.fori_loop(0, STEPS, step, x)


def torch_decode(m):
    from deep_gemm.utils.math import per_token_cast_to_fp8
    x, w_up, w_down = decode_inputs(m)
    h0 = to_torch(x).clone()
    wu = (to_torch(w_up[0]), to_torch(w_up[1]))
    wd = (to_torch(w_down[0]), to_torch(w_down[1]))
    u = torch.empty((m, 4096), dtype=torch.bfloat16, device="cuda")
    h = torch.empty((m, 7168), dtype=torch.bfloat16, device="cuda")

    def step(cur):
        deep_gemm.fp8_gemm_nt(per_token_cast_to_fp8(cur, use_ue8m0=False), wu, u)
        deep_gemm.fp8_gemm_nt(per_token_cast_to_fp8(u, use_ue8m0=False), wd, h)
    steps = [lambda: step(h0)] + [lambda: step(h)] * (STEPS - 1)
    return torch_contenders(steps)     # per step


def child() -> None:
    print(json.dumps(jax_rows(graphs=False)))


def main():
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(deep_gemm, '__version__', '?')}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip(),
               JAX_DG_BENCH_CHILD="1")
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=400)
    off = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else {}
    if res.returncode:
        print("graphs-off child failed:", res.stderr[-2000:])
    on = jax_rows(graphs=True)
    rows = []
    for m, n, k in FP8_SHAPES:
        a, b = fp8_inputs(m, n, k, m + n + k)
        ta = [(to_torch(x), mn_major(to_torch(s))) for x, s in a]
        tb = (to_torch(b[0]), to_torch(b[1]))
        d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        rows.append(("fp8 M{} N{} K{}".format(m, n, k),
                     torch_contenders([lambda x=x: deep_gemm.fp8_gemm_nt(x, tb, d) for x in ta])))
    for m, n, k in BF16_SHAPES:
        ks = jax.random.split(jax.random.PRNGKey(7), R + 1)
        w = to_torch(jax.random.normal(ks[0], (n, k), jnp.bfloat16))
        xs = [to_torch(jax.random.normal(kk, (m, k), jnp.bfloat16)) for kk in ks[1:]]
        d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        rows.append((f"bf16 M{m} N{n} K{k}", torch_contenders([lambda x=x: deep_gemm.bf16_gemm_nt(x, w, d) for x in xs])))
    for m in DECODE_M:
        rows.append((f"decode M{m}", torch_decode(m)))
    print(f"fixed cost of one jax_dg call (no kernel): graphs on {on['noop']['jax_dg']:.2f} us, "
          f"graphs off {off.get('noop', {}).get('jax_dg', float('nan')):.2f} us; of which the Python "
          f"closure {on['closure']['jax_dg']:.2f} us; one tiny XLA fusion for comparison: graphs on "
          f"{on['xla_tiny']['jax_dg']:.2f} us, off {off.get('xla_tiny', {}).get('jax_dg', float('nan')):.2f} us")
    from jax_dg.runtime import guards
    print(f"graph-safe call sites: {guards.CAPTURE_STATS}")
    table = []
    for name, (eager, graph) in rows:
        r = {"shape": name, "torch_eager_us": eager, "torch_graph_us": graph,
             "jax_dg_graphs_us": on[name]["jax_dg"], "jax_dg_no_graphs_us": off.get(name, {}).get("jax_dg", float("nan"))}
        if "jnp" in on[name]:
            r["jnp_us"] = on[name]["jnp"]
        if "jax_dg_mn" in on[name]:
            r["jax_dg_mn_us"] = on[name]["jax_dg_mn"]
            r["mn/torch_graph"] = r["jax_dg_mn_us"] / graph
        r["graphs/torch_graph"] = r["jax_dg_graphs_us"] / graph
        r["torch_eager/graphs"] = eager / r["jax_dg_graphs_us"]
        r["no_graphs-eager_us"] = r["jax_dg_no_graphs_us"] - eager
        table.append(r)
    plot.write("bench_small", "small GEMMs, per call (decode: per step of 2 GEMMs + 2 quantisations)", table, [
        ("shape", "shape"), ("torch_eager_us", "torch eager"), ("torch_graph_us", "torch graph"),
        ("jax_dg_graphs_us", "jax_dg graphs"), ("jax_dg_mn_us", "jax_dg mn scales"),
        ("jax_dg_no_graphs_us", "jax_dg no graphs"),
        ("jnp_us", "jnp"), ("graphs/torch_graph", "graphs/tgraph"), ("mn/torch_graph", "mn/tgraph"),
        ("torch_eager/graphs", "eager/graphs"),
        ("no_graphs-eager_us", "nographs-eager")],
        label="shape", ratios=["graphs/torch_graph", "mn/torch_graph", "torch_eager/graphs"],
        ylabel="ratio (targets: graphs/tgraph <= 1.25, eager/graphs >= 1.5)")


if __name__ == "__main__":
    child() if os.environ.get("JAX_DG_BENCH_CHILD") else main()
