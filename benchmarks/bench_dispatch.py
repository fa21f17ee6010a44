"""Per-execution host cost: a jitted function holding ONE op, jax_dg vs plain XLA of the same
GPU time (and deep_gemm from torch eager), one run.

    python benchmarks/bench_dispatch.py [--quick] [--cases gemm_small,mqa,...]
                                        (needs a CUDA device and deep_gemm)
    python benchmarks/bench_dispatch.py --cpu-smoke     (tiny shapes on the CPU: the logic only)

Each contender is one call: jax_dg = one execution of a jitted one-op function, xla = one
execution of a jitted bf16 jnp.dot, torch = one deep_gemm call from torch eager. 50 executions:
  waited     the result waited on after each execution (block_until_ready; torch:
             torch.cuda.synchronize), us per execution
  pipelined  50 dispatched, then one wait, us per execution
  busy       GPU-busy us per execution (union of the kernel intervals of a torch.profiler CUDA
             timeline of 50 pipelined executions, as in timeline.py)
Both protocols are timed interleaved over all contenders of a case, best of >= 5 repeats after
warm-up (timing.compare). Cases: the control jnp.dot bf16 2048^3 (JAX's own cost);
fp8_gemm_nt 64x2112x7168 and mqa_logits S2048 SK8192 (full form, returned) against torch;
indexer_topk S2048 SK8192 k2048 and topk_indices [2048, 8192] k2048 (jax_dg's own kernel).
Each jax_dg case gets a plain-XLA control of about its GPU time: a square bf16 jnp.dot whose
size is calibrated on a profiled ladder of sizes (busy us of both in the table; `busy diff`
= jax_dg - control). "extra waited/pipelined" = jax_dg us - control us: the host cost jax_dg
adds to an XLA execution (target <= 10 us); the ratio columns (plotted) are us / control us.

Where the bridge has its probe (jax_dg.runtime.bridge.probe), the waited executions of jax_dg are
run once more with it on, time.monotonic_ns() taken before each call and after its wait, and
each is broken down (medians, us): dispatch-entry (the call until XLA enters jax_dg's handler),
entry-gil (waiting for the GIL), gil-ready (call site and DLPack views), ready-done (the Python
run function, DeepGEMM's host path included), done-exit, exit-wait (handler return until the
wait returns); `handlers` per execution and the distinct handler `threads`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

if "--cpu-smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"   # before jax starts

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot
import timeline   # the environment, the cases' inputs and the profiler helpers

import jax
import jax.numpy as jnp

from jax_dg.runtime import bridge

EXECS = 50
CONTROL_SIZE = 2048
LADDER = [256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
QUICK_LADDER = [512, 1024, 2048, 4096, 8192]   # fewer XLA compiles (each autotunes its dot)
SMOKE_LADDER = [16, 32, 64, 128, 256]
LADDER_EXECS = 10
# (case, timeline's case key, against torch too)
CASES = [("fp8_gemm_nt", "gemm_small", True), ("mqa_logits", "mqa", True),
         ("indexer_topk", "indexer_topk", False), ("topk_indices", "topk_indices", False)]
SEGMENTS = [("d_entry_us", 1, 0), ("entry_gil_us", 2, 1), ("gil_ready_us", 3, 2),
            ("ready_done_us", 4, 3), ("done_exit_us", 5, 4)]   # (key, end field, start field)
DOT = jax.jit(jnp.dot)


@dataclass
class Contender:
    case: str
    who: str           # "jax_dg", "torch" or "xla"
    shape: str
    call: Callable[[], object]
    sync: Callable[[object], None]
    row: dict = field(default_factory=dict)


def dot_call(s: int) -> Callable[[], object]:
    kx, ky = jax.random.split(jax.random.PRNGKey(s))
    x = jax.random.normal(kx, (s, s), jnp.bfloat16)
    y = jax.random.normal(ky, (s, s), jnp.bfloat16)
    return lambda: DOT(x, y)


def warm(calls, times: int = 3) -> None:
    for call, sync in calls:
        out = None
        for _ in range(times):
            out = call()
        sync(out)


def busy_per_exec(env, calls, execs: int) -> list[float]:
    """GPU-busy us per execution of each (call, sync), `execs` pipelined executions each, one
    profiler session (timeline.record). --cpu-smoke: the pipelined wall us stands in."""
    if env.smoke:
        return [timing.per_call_us(call, sync, execs, repeats=1, warmup=1) for call, sync in calls]
    groups = timeline.record([(timeline.batch(call, execs), sync) for call, sync in calls])
    return [timeline.stats(g, execs)["busy_us"] for g in groups]


def size_for(target: float, ladder: list[tuple[int, float]], unit: int) -> int:
    """The square dot size whose GPU time is about `target` us: log-log interpolation on the
    measured ladder (made monotone), a cube-root step beyond its ends."""
    pts, top = [], 0.0
    for s, b in sorted(ladder):
        top = max(top, b, 1e-3)
        pts.append((s, top))
    target = max(target, 1e-3)
    if target <= pts[0][1]:
        s = pts[0][0] * (target / pts[0][1]) ** (1 / 3)
    elif target >= pts[-1][1]:
        s = pts[-1][0] * (target / pts[-1][1]) ** (1 / 3)
    else:
        s = pts[-1][0]
        for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
            if b0 <= target <= b1:
                s = s0 if b1 <= b0 else math.exp(
                    math.log(s0) + (math.log(target) - math.log(b0)) * (math.log(s1) - math.log(s0))
                    / (math.log(b1) - math.log(b0)))
                break
    return max(unit, int(round(s / unit)) * unit)


def calibrate(env, targets: dict[str, float], quick: bool) -> dict[str, tuple[int, Callable, float]]:
    """{case: (size, call, busy us)}: a bf16 dot per case of about the case's GPU time; one
    refinement step where the first pick is off by more than 15 %."""
    sizes_ladder, unit = (SMOKE_LADDER, 16) if env.smoke else (QUICK_LADDER if quick else LADDER, 128)
    calls = [dot_call(s) for s in sizes_ladder]
    warm([(c, timing.jax_sync) for c in calls])
    measured = busy_per_exec(env, [(c, timing.jax_sync) for c in calls], LADDER_EXECS)
    ladder = list(zip(sizes_ladder, measured))
    print("control ladder (bf16 dot size: GPU busy us): "
          + ", ".join(f"{s}: {b:.1f}" for s, b in ladder), flush=True)
    del calls
    sizes = {case: size_for(t, ladder, unit) for case, t in targets.items()}
    for attempt in range(2):
        calls = {case: dot_call(s) for case, s in sizes.items()}
        warm([(c, timing.jax_sync) for c in calls.values()])
        busy = dict(zip(calls, busy_per_exec(env, [(c, timing.jax_sync) for c in calls.values()],
                                              LADDER_EXECS)))
        off = {case: busy[case] / max(targets[case], 1e-3) for case in calls}
        print(f"controls (try {attempt + 1}): " + ", ".join(
            f"{case}: dot {sizes[case]}^3 {busy[case]:.1f} us for {targets[case]:.1f} us"
            for case in calls), flush=True)
        if attempt or all(abs(r - 1) <= 0.15 for r in off.values()):
            break
        sizes = {case: (sizes[case] if abs(off[case] - 1) <= 0.15 else
                        max(unit, int(round(sizes[case] * off[case] ** (-1 / 3) / unit)) * unit))
                 for case in calls}
    return {case: (sizes[case], calls[case], busy[case]) for case in calls}


def probe_available() -> bool:
    if not hasattr(bridge, "probe"):
        return False
    try:
        bridge.probe(False)
        return True
    except Exception as e:   # an extension built before the probe
        print(f"(bridge probe unavailable: {e!r})")
        return False


def stamped(c: Contender, execs: int, probe: bool):
    """`execs` waited executions with time.monotonic_ns() before each call and after its wait;
    with the probe on where asked. Returns (stamps, probe events)."""
    stamps, events = [], []
    c.sync(c.call())
    if probe:
        bridge.probe(True)
    try:
        for _ in range(execs):
            t0 = time.monotonic_ns()
            c.sync(c.call())
            stamps.append((t0, time.monotonic_ns()))
        if probe:
            events = list(bridge.probe_events())
    finally:
        if probe:
            bridge.probe(False)
    return stamps, events


def breakdown(stamps, events) -> dict:
    """Medians (us) per execution of the probe's segments; the handler entries of an execution
    are those that entered between its call and its wait's return (several: each segment is
    summed over them, dispatch-entry is to the first, exit-wait from the last)."""
    ev = sorted(events, key=lambda e: e[1])
    seg = {k: [] for k, _, _ in SEGMENTS}
    seg["exit_wait_us"] = []
    handlers = []
    for t0, t1 in stamps:
        mine = [e for e in ev if t0 <= e[1] <= t1]
        handlers.append(len(mine))
        if not mine:
            continue
        seg["d_entry_us"].append(mine[0][1] - t0)
        for key, end, start in SEGMENTS[1:]:
            seg[key].append(sum(e[end] - e[start] for e in mine))
        seg["exit_wait_us"].append(t1 - mine[-1][5])
    out = {k: statistics.median(v) / 1e3 if v else float("nan") for k, v in seg.items()}
    out["handlers"] = statistics.median(handlers) if handlers else float("nan")
    out["threads"] = len({e[0] for e in events})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 repeats of the timing (else 10)")
    ap.add_argument("--cases", default="", help=f"comma-separated subset of "
                    f"{','.join(c for c, _, _ in CASES)} (the 2048^3 control always runs)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (logic only)")
    args = ap.parse_args(argv)
    env = timeline.setup("benchmarks/bench_dispatch.py", args.cpu_smoke)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()] or [c for c, _, _ in CASES]
    unknown = sorted(set(chosen) - {c for c, _, _ in CASES})
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {','.join(c for c, _, _ in CASES)}")
    execs = 5 if env.smoke else EXECS
    repeats = 2 if env.smoke else (5 if args.quick else 10)
    probe = probe_available()
    print(timeline.header(env) + f"; {execs} executions per sample, best of {repeats}; "
          f"bridge probe {'on' if probe else 'absent'}", flush=True)

    # The contenders: the 2048^3 control, then each case's jax_dg (and torch) call.
    control_size = 256 if env.smoke else CONTROL_SIZE
    groups: dict[str, list[Contender]] = {
        "control": [Contender("control", "xla", f"bf16 dot {control_size}^3", dot_call(control_size),
                              timing.jax_sync)]}
    t0 = time.perf_counter()
    warm([(c.call, c.sync) for c in groups["control"]])
    for name, key, with_torch in CASES:
        if name not in chosen:
            continue
        try:
            case = timeline.build(env, key)
            cs = [Contender(name, "jax_dg", case.shape, case.jax_call, timing.jax_sync)]
            if with_torch:
                cs.append(Contender(name, "torch", case.shape, case.torch_call, env.tsync))
            warm([(c.call, c.sync) for c in cs])   # DeepGEMM compiles each kernel on first use
        except Exception as e:   # one failing case must not cost the others (a GPU run is dear)
            traceback.print_exc()
            print(f"!! {name}: skipped ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        groups[name] = cs
    print(f"built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)

    # A plain-XLA control of the same GPU time per jax_dg case.
    jax_dg_of = {name: cs[0] for name, cs in groups.items() if name != "control"}
    targets = dict(zip(jax_dg_of, busy_per_exec(env, [(c.call, c.sync) for c in jax_dg_of.values()], execs)))
    for name, (size, call, _) in calibrate(env, targets, args.quick).items():
        groups[name].append(Contender(name, "xla", f"bf16 dot {size}^3", call, timing.jax_sync))
    every = [c for cs in groups.values() for c in cs]

    # (a) waited and (b) pipelined, interleaved within each case
    for name, cs in groups.items():
        runs = {}
        for c in cs:
            runs[f"{c.who} waited"] = (lambda c=c: c.sync(c.call()), lambda _out: None)
            runs[f"{c.who} pipelined"] = (c.call, c.sync)
        t = timing.compare(runs, execs, repeats=repeats)
        for c in cs:
            c.row.update(case=name, who=c.who, shape=c.shape, waited_us=t[f"{c.who} waited"],
                         pipelined_us=t[f"{c.who} pipelined"])
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)

    # the waited executions once more, stamped (and broken down by the probe for jax_dg)
    for c in every:
        stamps, events = stamped(c, execs, probe and c.who == "jax_dg")
        c.row["waited_med_us"] = statistics.median(t1 - t0 for t0, t1 in stamps) / 1e3
        if c.who == "jax_dg" and probe:
            c.row.update(breakdown(stamps, events))

    # (c) GPU busy per execution, every contender in one profiler session
    for c, b in zip(every, busy_per_exec(env, [(c.call, c.sync) for c in every], execs)):
        c.row["busy_us"] = b

    rows = []
    for name, cs in groups.items():
        control = cs[-1].row   # the xla contender of the case (the case itself for "control")
        for c in cs:
            r = c.row
            if c.who != "xla" or name == "control":
                r["waited/control"] = r["waited_us"] / control["waited_us"]
                r["pipelined/control"] = r["pipelined_us"] / control["pipelined_us"]
            if c.who != "xla":
                r["extra_waited_us"] = r["waited_us"] - control["waited_us"]
                r["extra_pipelined_us"] = r["pipelined_us"] - control["pipelined_us"]
                r["busy_diff_us"] = r["busy_us"] - control["busy_us"]
            rows.append(r)
    print("\nextra host us per execution, jax_dg vs a plain-XLA jnp.dot of about the same GPU time "
          "(target <= 10 us):")
    for name, cs in groups.items():
        if name != "control":
            j, x = cs[0].row, cs[-1].row
            print(f"  {name:14s} waited {j['extra_waited_us']:+8.1f}  pipelined {j['extra_pipelined_us']:+8.1f}"
                  f"   (GPU busy jax_dg {j['busy_us']:.1f} us, control {x['shape']} {x['busy_us']:.1f} us)")
    plot.write("bench_dispatch", "per-execution host cost: one op per jitted function, 50 executions", rows, [
        ("case", "case"), ("who", "who"), ("shape", "shape"), ("waited_us", "waited us"),
        ("pipelined_us", "pipelined us"), ("busy_us", "GPU busy us"), ("waited_med_us", "waited median us"),
        ("extra_waited_us", "extra waited us"), ("extra_pipelined_us", "extra pipelined us"),
        ("busy_diff_us", "busy diff us"), ("waited/control", "waited/control"),
        ("pipelined/control", "pipelined/control"), ("handlers", "handlers"), ("threads", "threads"),
        ("d_entry_us", "dispatch-entry"), ("entry_gil_us", "entry-gil"), ("gil_ready_us", "gil-ready"),
        ("ready_done_us", "ready-done"), ("done_exit_us", "done-exit"), ("exit_wait_us", "exit-wait")],
        label=lambda r: f"{r['case']} {r['who']}", ratios=["waited/control", "pipelined/control"],
        ylabel="us / plain-XLA control us of about the same GPU time (1: no extra cost)")


if __name__ == "__main__":
    main()
