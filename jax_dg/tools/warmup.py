"""Kernel warm-up: DeepGEMM's JIT compiles, run up front with progress.

DeepGEMM compiles each kernel variant (one per kernel, shape and configuration) with nvcc the
first time it is launched, 2.5-5 s each, and caches the cubin on disk in
`$DG_JIT_CACHE_DIR/cache/kernel.<name>.<hash>/` (jax_dg sets `DG_JIT_CACHE_DIR` to
`~/.cache/jax_dg/deep_gemm` unless it is set; DeepGEMM's own default is `~/.deep_gemm`). A
jitted program meets them one by one on its first execution, silently.

`warmup(fn, *example_args, **kwargs)` traces `fn` (ShapeDtypeStructs allowed), collects its
distinct jax_dg custom-call sites (op, static attributes, operand and result shapes: what selects
a DeepGEMM variant), and executes each one alone, in a jitted program of its own, on data of
the exact shapes: floating operands uniform in [0.5, 1), every integer operand (lengths, key
ranges, block tables, group ids, schedules) zero, which is in range for every index argument,
so no replay reads out of bounds. A variant that adds cache entries compiled (the entries name
its kernels); one that adds none hit the cache (on disk, or already loaded by this process).

Limits: a program sharded over a mesh runs its kernels on the shards' shapes, and the jaxpr has
the global ones, so the warm-up compiles the global variants. DeepGEMM reads DG_JIT_CACHE_DIR
once, at its first compile: change it before that, not in between.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from typing import Any, Callable, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jax_dg.backends import deep_gemm
from jax_dg.core import backend as selection
from jax_dg.core import device, native
from jax_dg.core import registry
from jax_dg.core.site import Site

PROGRESS = ("auto", "bar", "lines", "off")


@dataclasses.dataclass
class Variant:
    """One distinct jax_dg custom call of a traced function, and what its warm-up did."""
    op: str
    static: dict
    inputs: dict          # argument name -> "dtype[shape]"
    kind: str             # "deep_gemm" (JIT-compiled), "emulated" (the torch emulation:
                          # nothing to compile); jax_dg's own kernels are built at install
                          # and are not call sites here
    status: str = "pending"   # "compiled", "cached", "skipped" (nothing to compile)
    kernels: list = dataclasses.field(default_factory=list)   # cache entries it added
    seconds: float = 0.0
    sites: int = 1        # call sites in the function with this variant
    _call: Any = dataclasses.field(default=None, repr=False, compare=False)

    def label(self) -> str:
        static = ", ".join(f"{k}={v!r}" for k, v in sorted(self.static.items()))
        operands = ", ".join(f"{k}: {v}" for k, v in self.inputs.items())
        return f"{self.op}({operands}{'; ' + static if static else ''})"

    def outcome(self) -> str:
        if self.status == "compiled":
            names = ", ".join(self.kernels)
            return f"compiled {len(self.kernels)} kernel(s) in {self.seconds:.2f} s: {names}"
        if self.status == "cached":
            return f"cache hit ({self.seconds:.2f} s)"
        return {"emulated": "torch emulation: nothing to compile"}.get(self.kind, self.status)


@dataclasses.dataclass
class Report:
    """What `warmup` found and did."""
    platform: str
    backend: str
    cache_dir: str
    variants: list
    sites: int            # jax_dg call sites found (a loop body counts once)
    run_seconds: float | None = None   # fn's own first run (run_fn=True)

    @property
    def compiled(self) -> list:
        return [v for v in self.variants if v.status == "compiled"]

    @property
    def cached(self) -> list:
        return [v for v in self.variants if v.status == "cached"]

    def summary(self) -> str:
        if not self.variants:
            why = " (JAX_DG_BACKEND=xla traces the pure-JAX references)" if self.backend == "xla" else ""
            return f"no kernels to compile: no jax_dg call sites{why}"
        if not any(v.kind == "deep_gemm" for v in self.variants):
            why = (f"they run the torch emulation on {self.platform}" if self.platform != "cuda"
                   or self.backend == "torch" else "none uses a DeepGEMM kernel")
            return (f"no kernels to compile: {len(self.variants)} variant(s) at {self.sites} "
                    f"jax_dg call site(s), {why}")
        kernels_compiled = sum(len(v.kernels) for v in self.compiled)
        return (f"compiled {kernels_compiled} kernel(s) for {len(self.compiled)} variant(s), "
                f"{len(self.cached)} variant(s) hit the cache; DeepGEMM JIT cache: {self.cache_dir}")

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("platform", "backend", "cache_dir", "sites",
                                             "run_seconds")}
        out["variants"] = [{k: getattr(v, k) for k in ("op", "static", "inputs", "kind", "status",
                                                        "kernels", "seconds", "sites")}
                           for v in self.variants]
        out["summary"] = self.summary()
        return out

    def __str__(self) -> str:
        lines = [_header(self)]
        n = len(self.variants)
        lines += [f"  [{i}/{n}] {v.label()}: {v.outcome()}" for i, v in enumerate(self.variants, 1)]
        if self.run_seconds is not None:
            lines.append(f"  first run of the function: {self.run_seconds:.2f} s")
        lines.append(self.summary())
        return "\n".join(lines)


def cache_dir() -> str:
    """DeepGEMM's JIT cache folder in this process (jax_dg's default is set when DeepGEMM is
    first looked for)."""
    deep_gemm.module()
    return os.environ.get("DG_JIT_CACHE_DIR") or os.path.expanduser("~/.deep_gemm")


def cache_entries(path: str) -> set[str]:
    """The compiled kernels in a cache folder: DeepGEMM 2.x's `cache/kernel.<name>.<hash>`
    folders (its other entries, `tmp/`, are in-flight compiles)."""
    folder = os.path.join(path, "cache")
    try:
        return {e for e in os.listdir(folder) if not e.startswith(".")}
    except FileNotFoundError:
        return set()


def kernel_name(entry: str) -> str:
    """`kernel.sm90_fp8_gemm_1d2d.3f2a...` -> `sm90_fp8_gemm_1d2d` (the entry itself otherwise)."""
    parts = entry.split(".")
    return ".".join(parts[1:-1]) if len(parts) >= 3 and parts[0] == "kernel" else entry


# --- finding the call sites --------------------------------------------------------------------

def _is_array_like(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def trace(fn: Callable, *args, **kwargs):
    """The closed jaxpr of fn(*args, **kwargs): array leaves (ShapeDtypeStructs too) are traced,
    every other leaf (Python ints, strings, None) is passed as it is, as a static argument."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array_like(leaf)]

    def flat(*values):
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        a, k = jax.tree.unflatten(tree, full)
        return fn(*a, **k)
    return jax.make_jaxpr(flat)(*[leaves[i] for i in dynamic])


def _sub_jaxprs(params: dict):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns"):
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):
                yield v.jaxpr


def ffi_eqns(jaxpr, own: bool = False) -> list:
    """Every jax_dg bridge ffi_call equation in a jaxpr (with `own`, jax_dg's own kernels' too),
    nested ones included (jit, custom_jvp/vjp/vmap, custom_partitioning, scan, cond, while
    bodies), in program order."""
    found = []
    for eqn in jaxpr.eqns:
        target = str(eqn.params.get("target_name", ""))
        if eqn.primitive.name == "ffi_call" and target.startswith("jax_dg_") and (
                own or target not in native.TARGETS.values()):   # own kernels: built at install
            found.append(eqn)
        for sub in _sub_jaxprs(eqn.params):
            found += ffi_eqns(sub, own)
    return found


def _avals(xs) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) for a in xs)


def _kind(backend: str) -> str:
    """What warm-up does for a bridge call, from its record's backend (resolved at trace time
    by jax_dg.core.dispatch): "deep_gemm" compiles; the torch emulation has nothing to."""
    return "deep_gemm" if backend == "deep_gemm" else "emulated"


def call_sites(fn: Callable, *args, **kwargs) -> tuple[list[Variant], int]:
    """(distinct variants, number of call sites) of the jax_dg custom calls fn makes."""
    eqns = ffi_eqns(trace(fn, *args, **kwargs).jaxpr)
    variants: dict = {}
    for eqn in eqns:
        p = eqn.params
        attrs = dict(p.get("attributes", ()))
        ins, outs = [v.aval for v in eqn.invars], list(p["result_avals"])
        key = (p["target_name"], str(sorted(attrs.items())), _avals(ins), _avals(outs))
        if key in variants:
            variants[key].sites += 1
            continue
        site = Site.decode(str(attrs["site"]))
        op_name, static, kind = site.op, dict(site.static), _kind(site.backend)
        names = [n for n, given in zip(registry.op(op_name).args, site.present) if given]
        variants[key] = Variant(
            op=op_name, static=static, kind=kind,
            inputs={n: f"{a.dtype}[{','.join(map(str, a.shape))}]" for n, a in zip(names, ins)},
            _call=(p, ins, outs, attrs))
    return list(variants.values()), len(eqns)


# --- replaying one call site -------------------------------------------------------------------

def _fill(key, aval):
    """Operand data for a replay: floats in [0.5, 1), integers zero (in range as any index)."""
    if jnp.issubdtype(aval.dtype, jnp.floating):
        return jax.random.uniform(key, aval.shape, jnp.float32, 0.5, 1.0).astype(aval.dtype)
    return jnp.zeros(aval.shape, aval.dtype)


def _replay(variant: Variant):
    """Runs the variant's custom call alone, once, on fresh operands of its shapes."""
    p, ins, outs, attrs = variant._call
    call = jax.ffi.ffi_call(
        p["target_name"], [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outs],
        has_side_effect=p.get("has_side_effect", False), vmap_method=p.get("vmap_method"),
        input_layouts=p.get("input_layouts"), output_layouts=p.get("output_layouts"),
        input_output_aliases=dict(p.get("input_output_aliases", ())))

    @jax.jit
    def program(key):
        keys = jax.random.split(key, max(len(ins), 1))
        return call(*[_fill(k, a) for k, a in zip(keys, ins)], **attrs)
    jax.block_until_ready(program(jax.random.PRNGKey(0)))


# --- progress ----------------------------------------------------------------------------------

class _Progress:
    """A one-line bar redrawn with \\r where `out` is a terminal, else one log line per variant."""

    def __init__(self, out: TextIO, total: int, mode: str):
        tty = bool(getattr(out, "isatty", lambda: False)())
        self.out, self.total = out, total
        self.mode = "off" if mode == "off" else ("bar" if mode == "bar" or (mode == "auto" and tty)
                                                 else "lines")

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def say(self, line: str) -> None:
        if self.mode != "off":
            self._write(("\r\x1b[K" if self.mode == "bar" else "") + line + "\n")

    def start(self, i: int, variant: Variant) -> None:
        if self.mode != "bar":
            return
        width = shutil.get_terminal_size((100, 20)).columns
        filled = round(20 * i / max(self.total, 1))
        text = f"[{'#' * filled}{'-' * (20 - filled)}] {i}/{self.total} {variant.op}: compiling..."
        self._write("\r\x1b[K" + text[:width - 1])

    def done(self, i: int, variant: Variant) -> None:
        self.say(f"  [{i}/{self.total}] {variant.label()}: {variant.outcome()}")


def _header(report: Report) -> str:
    return (f"jax_dg warm-up: {report.sites} jax_dg call site(s), {len(report.variants)} distinct "
            f"variant(s) (platform {report.platform}, JAX_DG_BACKEND={report.backend}); "
            f"DeepGEMM JIT cache: {report.cache_dir} (DG_JIT_CACHE_DIR)")


# --- the warm-up -------------------------------------------------------------------------------

def warmup(fn: Callable, /, *example_args, run_fn: bool = False, progress: str = "auto",
           log: TextIO | None = None, **kwargs) -> Report:
    """Compiles the DeepGEMM kernels `fn(*example_args, **kwargs)` will launch, before its first
    step, with progress: a bar where `log` (default stderr) is a terminal, one line per kernel
    variant otherwise; returns the Report (also written to `log`, ending with its summary).

    `fn` may be jitted or not; array arguments may be jax/numpy arrays or ShapeDtypeStructs,
    and every other argument (ints, strings, ...) is passed as it is. Warm-up's own options are
    `run_fn` (afterwards run fn once on the example arguments, which must then be arrays: XLA's
    compile of fn itself), `progress` ("auto", "bar", "lines", "off") and `log`; every other
    keyword goes to fn. On CPU (the torch emulation) there is nothing to compile: it says so in
    one line naming the ops (the Report lists the variants).
    """
    if progress not in PROGRESS:
        raise ValueError(f"progress={progress!r}: choose one of {', '.join(PROGRESS)}")
    out = sys.stderr if log is None else log
    variants, sites = call_sites(fn, *example_args, **kwargs)
    report = Report(platform=device.platform(), backend=selection.requested(),
                    cache_dir=cache_dir(), variants=variants, sites=sites)
    bar = _Progress(out, len(variants), progress)
    if not any(v.kind == "deep_gemm" for v in variants):
        # nothing to compile (the emulation, or no call site): one line, no variant listing
        # (str(report) and report.variants have them)
        for v in variants:
            v.status = "skipped"
        ops = sorted({v.op for v in variants})
        bar.say(f"jax_dg warm-up (platform {report.platform}, JAX_DG_BACKEND={report.backend}): "
                f"{report.summary()}" + (f" ({', '.join(ops)})" if ops else ""))
        if run_fn:
            _run_once(fn, example_args, kwargs, report, bar)
        return report
    bar.say(_header(report))
    for i, v in enumerate(variants, 1):
        if v.kind != "deep_gemm":
            v.status = "skipped"
        else:
            bar.start(i - 1, v)
            before, t0 = cache_entries(report.cache_dir), time.perf_counter()
            _replay(v)
            v.seconds = time.perf_counter() - t0
            v.kernels = sorted(kernel_name(e) for e in cache_entries(report.cache_dir) - before)
            v.status = "compiled" if v.kernels else "cached"
        bar.done(i, v)
    if run_fn:
        _run_once(fn, example_args, kwargs, report, bar)
    bar.say(report.summary())
    return report


def _run_once(fn, example_args, kwargs, report: Report, bar: _Progress) -> None:
    """warmup(run_fn=True): fn's first run (XLA's compile of fn itself), timed."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((example_args, kwargs))):
        raise ValueError("warmup(run_fn=True) runs fn on the example arguments: give arrays, "
                         "not ShapeDtypeStructs")
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*example_args, **kwargs))
    report.run_seconds = time.perf_counter() - t0
    bar.say(f"  first run of the function: {report.run_seconds:.2f} s")
