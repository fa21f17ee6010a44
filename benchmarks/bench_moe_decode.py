"""MoE decode against its FP8 weight-read floor: jax_dg.nn.MoE on stored FP8 weights (a
checkpoint's, never re-quantised) for a decode batch, next to the time to read those weights once.

    python benchmarks/bench_moe_decode.py            (a GPU: DeepSeek's decode, 8 tokens, 64 experts
                                                      of dim 7168 / inter 2048, top-8 of 8 groups)
    python benchmarks/bench_moe_decode.py --tiny     (a smoke run at toy sizes; CPU: the emulation)

The floor: the bytes a step must read, the FP8 values and float32 scales of every expert the batch
routes to (distinct experts of tokens x top-k, counted from the gate's choice on this batch), the
shared expert's and the gate's weight, divided by the device's read bandwidth, measured here (a
jitted sum over a 4 GiB buffer, best of repeats) and, for reference, the H200's nominal 4.8 TB/s.
Contenders, each a decode loop of STEPS calls in one jit (`lax.fori_loop`, each step's output the
next step's input; XLA replays it from command buffers) and each per step:
  masked, contiguous, auto   MoE(fp8_weights=True) in that layout (auto: the module's choice)
  bf16 masters               MoE(fp8_weights=False): the experts re-quantised every call (the
                             training form; what jax_dg's MoE did for decode before)
Columns: us per step, bytes read, floor us (measured bandwidth), step / floor (the issue's target:
at most 1.5 for the stored layouts), floor at 4.8 TB/s.
"""

from __future__ import annotations

import argparse

import timing
import plot

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dg import nn

SIZES = dict(tokens=8, experts=64, dim=7168, inter=2048, topk=8, groups=8, topk_groups=4)
TINY = dict(tokens=8, experts=8, dim=256, inter=128, topk=2, groups=2, topk_groups=1)
STEPS = 16
NOMINAL_TBS = 4.8   # the H200's HBM3e bandwidth, TB/s


def random_fp8(key, shape):
    """FP8 values without NaN (bytes 0x00-0x7D, either sign): no pass over a float copy."""
    mag = jax.random.randint(key, shape, 0, 0x7E, jnp.uint8)
    sign = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.5, shape).astype(jnp.uint8) << 7
    return jax.lax.bitcast_convert_type(mag | sign, jnp.float8_e4m3fn)


def stored_moe(s, key):
    """An MoE with stored FP8 weights filled at random (UE8M0 scales), built abstractly: no bf16
    masters of 3.7 GB on the way."""
    m = nnx.eval_shape(lambda: nn.MoE(s["dim"], s["inter"], s["experts"], s["topk"], n_groups=s["groups"],
                                      topk_groups=s["topk_groups"], route_scale=2.5, fp8_weights=True,
                                      scale_fmt="ue8m0", rngs=nnx.Rngs(0)))
    keys = iter(jax.random.split(key, 32))
    for path, var in nnx.iter_graph(m):
        if not isinstance(var, nnx.Variable):
            continue
        v = var.get_value()
        if v.dtype == jnp.float8_e4m3fn:
            var.set_value(random_fp8(next(keys), v.shape))
        elif "scale_inv" in str(path[-1]):
            var.set_value(2.0 ** jax.random.randint(next(keys), v.shape, -14, -10).astype(jnp.float32))
        else:
            var.set_value(jax.random.normal(next(keys), v.shape, v.dtype) * 0.02)
    return m


def weight_bytes(m, x) -> int:
    """FP8 values and scales of the experts this batch routes to, the shared expert's, the gate's."""
    experts, _ = jax.jit(lambda x: m.route(x))(x)
    used = len(np.unique(np.asarray(experts)))
    per_expert = sum(int(np.prod(v.shape[1:])) * v.dtype.itemsize
                     for v in (m.w13[...], m.w13_scale_inv[...], m.w2[...], m.w2_scale_inv[...]))
    shared = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(m.shared)))
    return used * per_expert + shared + m.gate.weight[...].size * 4, used


def read_bandwidth(gib: float, reps: int) -> float:
    """Bytes per second of a jitted sum over a `gib` GiB uint32 buffer (the read-bound floor)."""
    n = int(gib * 2 ** 30) // 4
    buf = jnp.ones((n,), jnp.uint32)
    f = jax.jit(lambda b: jnp.sum(b, dtype=jnp.uint32))
    us = timing.per_call_us(lambda: f(buf), timing.jax_sync, 4, repeats=reps)
    del buf
    return n * 4 / (us * 1e-6)


def decode_loop(steps, layout):
    @jax.jit
    def loop(state, x):
        m = nnx.merge(*state)

        def step(i, x):
            return m(x, layout=layout) if layout else m(x)
        return jax.lax.fori_loop(0, steps, step, x)
    return loop


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run")
    ap.add_argument("--tokens", type=int, help="decode batch (default 8)")
    ap.add_argument("--experts", type=int, help="routed experts (default 64)")
    args = ap.parse_args(argv)
    s = dict(TINY if args.tiny else SIZES)
    s.update({k: v for k, v in (("tokens", args.tokens), ("experts", args.experts)) if v})
    reps = 2 if args.tiny else 5
    bw = read_bandwidth(0.0625 if args.tiny else 4.0, reps)
    m = stored_moe(s, jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (s["tokens"], s["dim"]), jnp.bfloat16)
    nbytes, used = weight_bytes(m, x)
    floor_us, nominal_us = nbytes / bw * 1e6, nbytes / (NOMINAL_TBS * 1e12) * 1e6
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; {s}; {used} experts routed; "
          f"read bandwidth {bw / 1e12:.2f} TB/s measured; auto layout: {m.layout_for(s['tokens'])}")
    state = nnx.split(m)
    contenders = {layout: (lambda f=decode_loop(STEPS, layout): f(state, x), timing.jax_sync)
                  for layout in ("masked", "contiguous", "auto")}
    masters = nn.dequantize(m)      # the same weights as bf16 masters (quantised every call)
    master_state = nnx.split(masters)
    contenders["bf16 masters"] = (lambda f=decode_loop(STEPS, "masked"): f(master_state, x), timing.jax_sync)
    t = timing.compare(contenders, 1, repeats=reps)
    rows = []
    for name, us in t.items():
        per = us / STEPS
        rows.append({"path": name, "us": per, "MB": nbytes / 1e6, "floor_us": floor_us,
                     "step/floor": per / floor_us, "floor_4.8TBs_us": nominal_us})
    plot.write("bench_moe_decode", f"MoE decode of {s['tokens']} tokens ({s['experts']} experts, dim {s['dim']}, "
               f"inter {s['inter']}, top-{s['topk']}) vs its FP8 weight-read floor, per step", rows,
               [("path", "path"), ("us", "us/step"), ("MB", "weights MB"), ("floor_us", "floor us"),
                ("step/floor", "step/floor"), ("floor_4.8TBs_us", "floor@4.8TB/s us")],
               label="path", ratios=["step/floor"])


if __name__ == "__main__":
    main()
