"""Where the time goes: deep_gemm from torch vs jax_dg inside jit, from one CUPTI timeline.

    python benchmarks/timeline.py [--quick] [--ops gemm,mqa,...] [--n 20]
                                  (needs a CUDA device and deep_gemm)
    python benchmarks/timeline.py --cpu-smoke     (tiny shapes on the CPU: the logic only)

One representative shape per op of bench_gemm / bench_mqa / bench_paged_mqa / bench_grouped,
plus the indexer's top-k, with the inputs those benchmarks build (their functions, imported).
Each side makes n back-to-back calls (n = 20; jax_dg: n executions of the jitted one-op
function, as a user calls it) under torch.profiler's CUDA activity, which records every kernel
of the process, XLA's included, so both sides are seen the same way. Per call:
  kernels    GPU activities (kernels, memcpy, memset) per call
  busy us    union of their intervals / n
  idle us    (first start to last end) / n - busy: the GPU waiting for the host
  wall us    UNPROFILED: n back-to-back calls then one sync, best of >= 5 repeats after
             warm-up, both sides interleaved (timing.compare)
  entries    jax_dg's handler entries per call (bridge + native), one more sample after the
             timed ones: 0 where XLA replays a recorded command buffer; >= 1 where it runs the
             custom calls, or re-records them because a buffer they touch moved
  jax_dg-only kernels: kernel names (template arguments and XLA's numbering cut off) that
             jax_dg launches more often than torch: "+extra launches per call (jax_dg's us
             per call in that kernel)"
For fp8_gemm_nt 4096x24576x1536, mqa_logits and topk_indices a "chain20" row: the same n calls
unrolled in ONE jitted function (inputs through lax.optimization_barrier so none is merged), per
call: what one execution costs spread over its calls vs one execution per call. A "calls, graph" row
(GPU only): the one-op function jitted with compiler_options {"xla_gpu_graph_min_graph_size": 1},
so that XLA replays it as a command buffer (its default asks for 5 commands, more than a one-op
program has): what the per-execution host path costs.
The kernels of each side are printed per case above the table (and, where $OUT is set,
written to $OUT/timeline_kernels.json).

bench_dispatch.py imports the profiler helpers below (record, stats, short).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

if "--cpu-smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"   # before jax starts

import timing  # noqa: F401  (sets the XLA memory fraction before jax starts)
import plot

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import jax_dg

N_CALLS = 20
TOPK = 2048
CHAIN_KEYS = ("gemm", "mqa", "topk_indices")
GRAPH_OPTIONS = {"xla_gpu_graph_min_graph_size": 1}

# One representative shape per op (the --ops names); --cpu-smoke: tiny ones.
SHAPES = {
    "gemm": (4096, 24576, 1536), "gemm_small": (64, 2112, 7168),
    "mqa": (2048, 8192),
    "paged_b64": (64, 8192, 1), "paged_b256": (256, 32768, 1), "paged_b256_n2": (256, 8192, 2),
    "grouped_contiguous": (8, 4096, 4096, 7168), "grouped_masked": (8, 4096, 4096, 7168),
    "indexer_topk": (2048, 8192, TOPK), "topk_indices": (2048, 8192, TOPK),
}
SMOKE_SHAPES = {
    "gemm": (128, 256, 256), "gemm_small": (64, 128, 256),
    "mqa": (64, 256),
    "paged_b64": (2, 256, 1), "paged_b256": (4, 512, 1), "paged_b256_n2": (4, 256, 2),
    "grouped_contiguous": (2, 256, 256, 256), "grouped_masked": (2, 256, 256, 256),
    "indexer_topk": (64, 256, 32), "topk_indices": (64, 256, 32),
}


# --- the environment: a GPU with deep_gemm, or --cpu-smoke ------------------------------------

@dataclass
class Env:
    dg: object        # deep_gemm; in --cpu-smoke jax_dg's torch emulation (DeepGEMM's API)
    dev: str          # torch device of the torch side
    smoke: bool
    shapes: dict = field(default_factory=dict)

    def tsync(self, _out=None) -> None:
        if not self.smoke:
            torch.cuda.synchronize()


def setup(script: str, smoke: bool) -> Env:
    """The GPU environment, or a clear exit where it is missing; --cpu-smoke: JAX on the CPU
    and `deep_gemm` aliased to jax_dg's torch emulation (same API), so the benchmark modules
    this script imports load and run their input builders."""
    if smoke:
        from jax_dg.backends import torch_emu
        sys.modules["deep_gemm"] = torch_emu
        # CPU numbers mean nothing: keep their plot out of benchmarks/plots
        plot.PLOTS = pathlib.Path(tempfile.gettempdir()) / "jax_dg_cpu_smoke_plots"
        return Env(torch_emu, "cpu", True, SMOKE_SHAPES)
    problems = []
    if jax.default_backend() != "gpu":
        problems.append(f"JAX's backend is {jax.default_backend()!r}, not a CUDA GPU")
    if not torch.cuda.is_available():
        problems.append("torch sees no CUDA device")
    if importlib.util.find_spec("deep_gemm") is None:
        problems.append("deep_gemm is not installed")
    if problems:
        raise SystemExit(f"{script} needs a CUDA device, torch with CUDA and deep_gemm: "
                         f"{'; '.join(problems)}. (--cpu-smoke runs its logic on tiny shapes on the CPU.)")
    import deep_gemm
    return Env(deep_gemm, "cuda", False, SHAPES)


def header(env: Env) -> str:
    dev = jax.devices()[0]
    return (f"device {getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}, "
            f"torch {torch.__version__}, deep_gemm {getattr(env.dg, '__version__', '?')}"
            + (" (--cpu-smoke: torch emulation, tiny shapes)" if env.smoke else ""))


# --- the timeline: torch.profiler's device activities ------------------------------------------

Event = tuple[str, float, float]   # (name, start us, end us)


def device_events(prof, smoke: bool) -> list[Event]:
    """Every GPU activity in the profile (kernels, memcpy, memset; annotations dropped). In
    --cpu-smoke the CPU ops stand in for them (the logic runs, the numbers mean nothing)."""
    want = torch.autograd.DeviceType.CPU if smoke else torch.autograd.DeviceType.CUDA
    out = []
    for e in prof.events():
        if e.device_type != want or getattr(e, "is_user_annotation", False):
            continue
        if "annotation" in str(getattr(e, "activity_type", "") or "").lower():
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(out, key=lambda x: x[1])


_WITH_CPU = [False]   # set where a CUDA-only session recorded nothing (then CPU + CUDA)


def _session(runs, smoke: bool, pause_s: float) -> list[Event]:
    """One profiler session over the runs: a warm-up step (the profiler traces, the results are
    dropped: CUPTI's first-launch costs land there), then the recorded step."""
    activities = ([ProfilerActivity.CPU] if smoke else
                  [ProfilerActivity.CPU, ProfilerActivity.CUDA] if _WITH_CPU[0] else [ProfilerActivity.CUDA])
    gc.collect()
    gc.disable()
    try:
        with profile(activities=activities,
                     schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
            for _ in range(2):
                for i, (run, sync) in enumerate(runs):
                    if i:
                        time.sleep(pause_s)   # a gap on the timeline that separates the runs
                    sync(run())
                time.sleep(pause_s)
                prof.step()
        events = device_events(prof, smoke)
    finally:
        gc.enable()
    if not events and not smoke and not _WITH_CPU[0]:
        print("(timeline: a CUDA-only profile recorded no kernels; CPU + CUDA from here on)", flush=True)
        _WITH_CPU[0] = True
        return _session(runs, smoke, pause_s)
    return events


def split(events: list[Event], gap_us: float) -> list[list[Event]]:
    """Events into groups separated by at least gap_us of idle device."""
    groups, end = [], -math.inf
    for e in events:
        if e[1] - end > gap_us:
            groups.append([])
        groups[-1].append(e)
        end = max(end, e[2])
    return groups


def record(runs: list[tuple[Callable[[], object], Callable[[object], None]]], smoke: bool = False,
           pause_s: float = 0.02, gap_us: float = 5000.0) -> list[list[Event]]:
    """The device events of each run (run, sync), all in one profiler session: the runs are
    separated by a pause of the host and told apart by the idle gap it leaves. Where the gaps
    do not give one group per run (a run with no device work, a stall inside a run), each run
    gets a session of its own. Warm the runs up first (DeepGEMM compiles on first use)."""
    if len(runs) > 1:
        groups = split(_session(runs, smoke, pause_s), gap_us)
        if len(groups) == len(runs):
            return groups
        print(f"(timeline: {len(groups)} gaps for {len(runs)} runs; one profiler session per run)",
              flush=True)
    return [_session([r], smoke, pause_s) for r in runs]


def busy_us(events: list[Event]) -> float:
    """Length of the union of the intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for _, s, e in sorted(events, key=lambda x: x[1]):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def short(name: str) -> str:
    """A kernel's name without `void `, template arguments, parameters and XLA's numbering."""
    s = name.strip().removeprefix("void ")
    s = re.split(r"[<(]", s, maxsplit=1)[0].strip()
    s = re.sub(r"([._]\d+)+$", "", s)
    return s[:64] or name[:64]


def stats(events: list[Event], n: int) -> dict:
    """Per call over n calls: activities, busy, span, idle, and each kernel's (count, us)."""
    busy = busy_us(events)
    span = (max(e for _, _, e in events) - min(s for _, s, _ in events)) if events else 0.0
    per: dict[str, list] = {}
    full: dict[str, float] = {}
    for name, s, e in events:
        c = per.setdefault(short(name), [0, 0.0])
        c[0] += 1
        c[1] += e - s
        full[name] = full.get(name, 0.0) + e - s
    return {"kernels": len(events) / n, "busy_us": busy / n, "span_us": span / n,
            "idle_us": (span - busy) / n,
            "per_kernel": {k: (c / n, t / n) for k, (c, t) in sorted(per.items(), key=lambda x: -x[1][1])},
            # the longest kernel's whole name: do both sides run the same template instance?
            "top_kernel": max(full, key=full.get)[:400] if full else ""}


def extra_kernels(mine: dict, theirs: dict) -> dict:
    """Kernels (short names) `mine` launches more often than `theirs`, per call: {name: (extra
    count, mine's us in all launches of that name)}."""
    out = {}
    for k, (c, t) in mine["per_kernel"].items():
        c0 = theirs["per_kernel"].get(k, (0.0, 0.0))[0]
        if c - c0 > 0.01:
            out[k] = (c - c0, t)
    return out


def describe(extra: dict) -> str:
    return "; ".join(f"{k} +{c:.2g} ({t:.1f}us)" for k, (c, t) in extra.items()) or "-"


# --- the cases: inputs built by the benchmarks' own functions ---------------------------------

@dataclass
class Case:
    key: str
    op: str
    shape: str
    torch_call: Callable[[], object]     # one call, from torch
    jax_call: Callable[[], object]       # one execution of the jitted one-op function
    fn: Callable | None = None           # the op on args, for a chain
    args: tuple = ()


def chain_jit(fn: Callable, n: int):
    """n calls of fn unrolled in one jitted function; each call's inputs pass through
    lax.optimization_barrier first so that XLA merges none of them; every result is returned."""
    def f(*args):
        outs = []
        for _ in range(n):
            args = jax.lax.optimization_barrier(args)
            outs.append(fn(*args))
        return outs
    return jax.jit(f)


def case_gemm(env: Env, key: str) -> Case:
    import bench_gemm
    m, n, k = env.shapes[key]
    a_list, b = bench_gemm.inputs(jax.random.PRNGKey(m * 7 + n + k), m, n, k)
    a = a_list[0]
    to_torch = bench_gemm.to_torch
    ta, tb = (to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1]))
    d = torch.empty((m, n), dtype=torch.bfloat16, device=env.dev)
    f = jax.jit(jax_dg.fp8_gemm_nt)
    return Case(key, "fp8_gemm_nt", f"M{m} N{n} K{k}", lambda: env.dg.fp8_gemm_nt(ta, tb, d),
                lambda: f(a, b), jax_dg.fp8_gemm_nt, (a, b))


def mqa_torch_inputs(args):
    import bench_mqa
    q, kv, w, ks, ke = args
    to_torch = bench_mqa.to_torch
    return to_torch(q[0]), (to_torch(kv[0]), to_torch(kv[1])), to_torch(w), to_torch(ks), to_torch(ke)


def case_mqa(env: Env, key: str) -> Case:
    import bench_mqa
    s, sk = env.shapes[key]
    args = bench_mqa.inputs(s, sk)
    tq, tkv, tw, tks, tke = mqa_torch_inputs(args)

    def op(*a):
        return jax_dg.mqa_logits(*a)
    f = jax.jit(op)
    return Case(key, "mqa_logits", f"S{s} SK{sk} full",
                lambda: env.dg.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke,
                                                  clean_logits=True, max_seqlen_k=0),
                lambda: f(*args), op, args)


def case_paged(env: Env, key: str) -> Case:
    import bench_paged_mqa as bp
    b, ctx, next_n = env.shapes[key]
    q, cache, w, lens, table = bp.inputs(b, ctx, next_n)
    max_len = table.shape[1] * bp.BLOCK
    # the schedule computed once outside the timed calls and given to both (as bench_paged_mqa)
    meta = jax.jit(lambda l: jax_dg.get_paged_mqa_logits_metadata(l, bp.BLOCK))(lens)
    jax.block_until_ready((q, cache, w, lens, table, meta))
    tq, tkv, tw, tl, tt, tm = (bp.to_torch(x) for x in (q, cache, w, lens, table, meta))

    def op(q, kv, w, l, t, m):
        return jax_dg.fp8_fp4_paged_mqa_logits((q, None), kv, w, l, t, m, max_len)
    f = jax.jit(op)
    args = (q, cache, w, lens, table, meta)
    return Case(key, "paged_mqa_logits",
                f"B{b} ctx{ctx}" + (f" next_n{next_n}" if next_n > 1 else "") + " schedule given",
                lambda: env.dg.fp8_fp4_paged_mqa_logits((tq, None), tkv, tw, tl, tt, tm, max_len,
                                                        clean_logits=False),
                lambda: f(*args), op, args)


def case_grouped(env: Env, key: str) -> Case:
    import bench_grouped as bg
    from jax_dg.contracts import align
    g, total, n, k = env.shapes[key]
    seed = 0
    rng = np.random.default_rng(seed)
    ms = bg.expert_rows(rng, g, total)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(seed))
    b = bg.cast_weights(jax.random.normal(key_b, (g, n, k), jnp.bfloat16))   # bg.weights at N, K
    tb = (bg.to_torch(b[0]), bg.to_torch(b[1]))
    if key == "grouped_contiguous":   # as bench_grouped.bench_contiguous
        layout_np = np.concatenate([np.r_[np.full(m, i), np.full(align(m, bg.MK) - m, -1)]
                                    for i, m in enumerate(ms)]).astype(np.int32)
        m_all = layout_np.shape[0]
        x = jax.random.normal(key_a, (m_all, k), jnp.bfloat16)
        layout = jnp.asarray(layout_np)
        a = bg.cast_rows(jnp.where(layout[:, None] >= 0, x, 0))
        ta, tl = (bg.to_torch(a[0]), bg.to_torch(a[1])), bg.to_torch(layout)
        d = torch.empty((m_all, n), dtype=torch.bfloat16, device=env.dev)
        f = jax.jit(jax_dg.m_grouped_fp8_gemm_nt_contiguous)
        return Case(key, "m_grouped contiguous", f"G{g} sum(M){sum(ms)} rows{m_all} N{n} K{k}",
                    lambda: env.dg.m_grouped_fp8_gemm_nt_contiguous(ta, tb, d, tl),
                    lambda: f(a, b, layout), jax_dg.m_grouped_fp8_gemm_nt_contiguous, (a, b, layout))
    # as bench_grouped.bench_masked
    max_m = align(max(ms), bg.MK)
    expected_m = max(1, total // g)
    masked_m = jnp.asarray(ms, jnp.int32)
    a = bg.cast_rows(jax.random.normal(key_a, (g, max_m, k), jnp.bfloat16))
    ta, tm = (bg.to_torch(a[0]), bg.to_torch(a[1])), bg.to_torch(masked_m)
    d = torch.empty((g, max_m, n), dtype=torch.bfloat16, device=env.dev)

    def op(a, b, mm):
        return jax_dg.m_grouped_fp8_gemm_nt_masked(a, b, mm, expected_m)
    f = jax.jit(op)
    return Case(key, "m_grouped masked", f"G{g} sum(M){sum(ms)} rows{g * max_m} N{n} K{k}",
                lambda: env.dg.m_grouped_fp8_gemm_nt_masked(ta, tb, d, tm, expected_m),
                lambda: f(a, b, masked_m), op, (a, b, masked_m))


def case_indexer(env: Env, key: str) -> Case:
    """The prefill step: DeepGEMM's cleaned logits + torch.topk (sorted) vs jax_dg.indexer_topk
    (as bench_indexer)."""
    import bench_mqa
    s, sk, k = env.shapes[key]
    args = bench_mqa.inputs(s, sk)
    tq, tkv, tw, tks, tke = mqa_torch_inputs(args)

    def torch_route():
        logits = env.dg.fp8_fp4_mqa_logits((tq, None), tkv, tw, tks, tke, clean_logits=True, max_seqlen_k=0)
        return torch.topk(logits, k, dim=1, sorted=True)[1]

    def op(*a):
        return jax_dg.indexer_topk(*a, k)
    f = jax.jit(op)
    return Case(key, "indexer_topk", f"S{s} SK{sk} k{k}", torch_route, lambda: f(*args), op, args)


def case_topk(env: Env, key: str) -> Case:
    """torch.topk vs jax_dg.topk_indices on the same (full, cleaned) logits (as bench_indexer)."""
    import bench_mqa
    s, sk, k = env.shapes[key]
    logits = jax.jit(lambda *a: jax_dg.mqa_logits(*a))(*bench_mqa.inputs(s, sk))
    jax.block_until_ready(logits)
    tl = bench_mqa.to_torch(logits)

    def op(x):
        return jax_dg.topk_indices(x, k)
    f = jax.jit(op)
    return Case(key, "topk_indices", f"[{s}, {sk}] k{k}", lambda: torch.topk(tl, k, dim=1),
                lambda: f(logits), op, (logits,))


BUILDERS = {"gemm": case_gemm, "gemm_small": case_gemm, "mqa": case_mqa,
            "paged_b64": case_paged, "paged_b256": case_paged, "paged_b256_n2": case_paged,
            "grouped_contiguous": case_grouped, "grouped_masked": case_grouped,
            "indexer_topk": case_indexer, "topk_indices": case_topk}


def build(env: Env, key: str) -> Case:
    return BUILDERS[key](env, key)


def batch(call: Callable[[], object], n: int) -> Callable[[], object]:
    """n back-to-back calls; returns the last result (what the sync waits on)."""
    def run():
        out = None
        for _ in range(n):
            out = call()
        return out
    return run


# --- one case: wall (unprofiled), then the timeline --------------------------------------------

def contenders(env: Env, case: Case, n: int) -> dict:
    runs = {"torch": (batch(case.torch_call, n), env.tsync),
            "jax_dg": (batch(case.jax_call, n), timing.jax_sync)}
    if case.key in CHAIN_KEYS and case.fn is not None:
        chained = chain_jit(case.fn, n)
        runs["chain"] = (lambda: chained(*case.args), timing.jax_sync)
    if case.fn is not None and not env.smoke:
        # the same one-op program captured as a command buffer: XLA's default asks for >= 5
        # commands, which a one-op program lacks (docs/runtime.md)
        graphed = jax.jit(case.fn, compiler_options=GRAPH_OPTIONS)
        runs["graph"] = (batch(lambda: graphed(*case.args), n), timing.jax_sync)
    return runs


def wall(runs: dict, n: int, repeats: int) -> dict:
    """Unprofiled us per call: each run is n calls (or one chain of n), then one sync;
    interleaved, best of `repeats` after warm-up (timing.compare with one run per sample)."""
    t = timing.compare(runs, 1, repeats=repeats)
    return {k: v / n for k, v in t.items()}


def handler_entries(runs: dict, n: int) -> dict:
    """jax_dg's handler entries (bridge and native) per call of each jax_dg side, over one more
    sample after the timed ones: 0 where XLA replays a recorded command buffer, one or more where
    it runs (or re-records) the custom calls."""
    from jax_dg.core import native
    from jax_dg.runtime import bridge
    out = {}
    for side, (run, sync) in runs.items():
        if side == "torch":
            continue
        before = bridge.call_count() + native.call_count()
        sync(run())
        out[side] = (bridge.call_count() + native.call_count() - before) / n
    return out


def profile_case(env: Env, runs: dict, n: int) -> dict:
    groups = record(list(runs.values()), smoke=env.smoke)
    return {name: stats(g, n) for name, g in zip(runs, groups)}


def rows_of(case: Case, walls: dict, entries: dict, prof: dict, n: int) -> list[dict]:
    tt = prof["torch"]
    rows = []
    for side, mode in (("jax_dg", "calls"), ("chain", f"chain{n}"), ("graph", "calls, graph")):
        if side not in prof:
            continue
        tj = prof[side]
        rows.append({
            "op": case.op, "shape": case.shape, "mode": mode,
            "torch_kernels": tt["kernels"], "jax_dg_kernels": tj["kernels"],
            "torch_busy_us": tt["busy_us"], "jax_dg_busy_us": tj["busy_us"],
            "torch_idle_us": tt["idle_us"], "jax_dg_idle_us": tj["idle_us"],
            "torch_wall_us": walls["torch"], "jax_dg_wall_us": walls[side],
            "torch/jax_dg": walls["torch"] / walls[side] if walls[side] else float("nan"),
            "busy torch/jax_dg": tt["busy_us"] / tj["busy_us"] if tj["busy_us"] else float("nan"),
            "entries": entries.get(side, float("nan")),
            "jax_dg_only": describe(extra_kernels(tj, tt)),
        })
    return rows


def print_kernels(case: Case, prof: dict, top: int = 12) -> None:
    print(f"-- {case.op} {case.shape}: kernels per call (count x, us)", flush=True)
    for side, st in prof.items():
        print(f"   {side:7s} {st['kernels']:.2f} kernels, busy {st['busy_us']:.1f} us, "
              f"idle {st['idle_us']:.1f} us per call")
        for k, (c, t) in list(st["per_kernel"].items())[:top]:
            print(f"       {c:5.2f} x {t:9.2f} us  {k}")
        print(f"       longest: {st['top_kernel']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 repeats of the wall timing (else 10)")
    ap.add_argument("--ops", default="", help=f"comma-separated subset of {','.join(SHAPES)}")
    ap.add_argument("--n", type=int, default=N_CALLS, help="back-to-back calls per sample (20)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (logic only)")
    args = ap.parse_args(argv)
    env = setup("benchmarks/timeline.py", args.cpu_smoke)
    keys = [k.strip() for k in args.ops.split(",") if k.strip()] or list(SHAPES)
    unknown = [k for k in keys if k not in SHAPES]
    if unknown:
        raise SystemExit(f"--ops: unknown {unknown}; choose from {','.join(SHAPES)}")
    n = args.n if not env.smoke else min(args.n, 4)
    repeats = 2 if env.smoke else (5 if args.quick else 10)
    print(header(env) + f"; {n} calls per sample, best of {repeats}", flush=True)

    # Phase 1: every case's wall time, unprofiled (its warm-up compiles DeepGEMM's kernels);
    # phase 2: the timelines. No wall time is taken after a profiler session.
    todo, rows, details = [], [], {}
    for key in keys:
        t0 = time.perf_counter()
        try:
            case = build(env, key)
            runs = contenders(env, case, n)
            walls = wall(runs, n, repeats)
            entries = handler_entries(runs, n)
        except Exception as e:   # one failing case must not cost the others (a GPU run is dear)
            traceback.print_exc()
            print(f"!! {key}: skipped ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        print(f"{case.op} {case.shape}: wall us per call " + ", ".join(f"{k} {v:.1f}" for k, v in walls.items())
              + "; handler entries per call " + ", ".join(f"{k} {v:g}" for k, v in entries.items())
              + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        todo.append((case, runs, walls, entries))
    for case, runs, walls, entries in todo:
        try:
            prof = profile_case(env, runs, n)
        except Exception as e:
            traceback.print_exc()
            print(f"!! {case.key}: timeline skipped ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        print_kernels(case, prof)
        rows += rows_of(case, walls, entries, prof, n)
        details[f"{case.op} {case.shape}"] = {"wall_us": walls, "entries": entries, "timeline": prof}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "timeline_kernels.json"), "w") as f:
            json.dump(details, f, indent=1)
    plot.write("timeline", "timeline: per call, torch vs jax_dg (CUPTI; wall unprofiled)", rows, [
        ("op", "op"), ("shape", "shape"), ("mode", "jax_dg mode"),
        ("torch_kernels", "torch kernels"), ("jax_dg_kernels", "jax_dg kernels"),
        ("torch_busy_us", "torch busy us"), ("jax_dg_busy_us", "jax_dg busy us"),
        ("torch_idle_us", "torch idle us"), ("jax_dg_idle_us", "jax_dg idle us"),
        ("torch_wall_us", "torch wall us"), ("jax_dg_wall_us", "jax_dg wall us"),
        ("torch/jax_dg", "torch/jax_dg wall"), ("busy torch/jax_dg", "torch/jax_dg busy"),
        ("entries", "jax_dg handler entries per call"), ("jax_dg_only", "jax_dg-only kernels per call")],
        label=lambda r: f"{r['op']} {r['shape']} {r['mode']}",
        ratios=["torch/jax_dg", "busy torch/jax_dg"])


if __name__ == "__main__":
    main()
