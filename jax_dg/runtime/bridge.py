"""The Python half of the FFI bridge (the C++ half is ffi/bridge.cc).

XLA calls the generic handler with a `site` attribute: the call-site record
(jax_dg.core.site: the op, the concrete backend, which optional arguments are present, whether
the call may be captured, the statics and the trace-time plan). The handler imports this
module at its first call (installing its hooks: nothing else imports it, so a process that
runs no DeepGEMM op imports no torch), asks `_prepare(site, platform)` once per call site for a
callable and caches it; every call then passes XLA's stream, device ordinal and torch views of
the argument and result buffers to it.

Capture: an op declared graph-safe (Op.graph_safe) is lowered to a second target whose CUDA
handler is command-buffer compatible. XLA may then run the call under stream capture on its
trace stream and replay the recorded kernels without calling Python at all; the call is guarded
(jax_dg.runtime.guards.capture_guard) so that a torch allocation under capture is an error,
never a use-after-free on replay.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax  # keep ahead of the extension: loading it first crashes jax's import (see tests)
import torch

from jax_dg.core import _bridge
from jax_dg.core import dispatch, registry
from jax_dg.core.site import Site
from jax_dg.core.statics import pick
from jax_dg.runtime import guards, landing
from jax_dg.runtime.run import Run

# XLA element types that DLPack carries as uint8 (see DlpackType in ffi/bridge.cc), from
# xla/ffi/api/c_api.h (XLA_FFI_DataType, part of the stable FFI ABI).
FP8_BY_XLA_TYPE = {19: torch.float8_e5m2, 20: torch.float8_e4m3fn}


def retype(tensor: torch.Tensor, xla_dtype: int) -> torch.Tensor:
    """The FP8 view of a uint8 DLPack tensor."""
    return tensor.view(FP8_BY_XLA_TYPE[xla_dtype])


@functools.lru_cache(maxsize=64)
def torch_stream(stream: int, device: int) -> tuple[int, int, int]:
    """(stream_id, device_index, device_type) of XLA's CUDA stream, for torch._C._cuda_setStream."""
    s = torch.cuda.ExternalStream(stream, device=torch.device("cuda", device))
    return (s.stream_id, s.device_index, s.device_type)


def call_count() -> int:
    """Handler entries so far (every platform): a replayed CUDA graph adds none."""
    return _bridge.call_count()


_STAGES: list | None = None   # with the probe on: (entered, stream set, run returned, left)


def probe(on: bool) -> None:
    """Starts (or stops) recording when each handler entry runs (benchmarks/bench_dispatch.py);
    clears what was recorded. On, call sites are prepared again with a closure that also
    records its own stages (probe_stages)."""
    global _STAGES
    _bridge.probe(bool(on))
    _bridge.clear_caches()
    _STAGES = [] if on else None


def probe_stages() -> list[tuple[int, int, int, int, int]]:
    """(entered the closure, torch's stream set to XLA's, the op's run function returned, left;
    time.monotonic_ns() nanoseconds) and the nanoseconds spent inside DeepGEMM's functions, per
    CUDA call since probe(True)."""
    return list(_STAGES or ())


def probe_events() -> list[tuple[int, int, int, int, int, int]]:
    """(thread, entered, got the GIL, site and views ready, Python returned, left) per handler
    entry since `probe(True)`, in time.monotonic_ns() nanoseconds."""
    return _bridge.probe_events()


def _prepare(text: str, platform: str) -> Callable:
    """The closure the handler calls for one call site (cached by the handler under `text`):
    the record decoded once; what runs at every call is the op's run function and, on CUDA,
    torch's stream and device made XLA's around it."""
    site = Site.decode(text)
    op_name, graph = site.op, site.graph
    op = registry.op(op_name)
    static = pick(op.run, site.static)   # the statics and plan the run function names
    dg = dispatch.kernels(op, site.backend)   # what the trace resolved, for the record's backend
    if _STAGES is not None and platform == "cuda":
        dg = _Timed(dg)
    rt = Run(dg, landing.lands_into(platform, dg))
    run_op = op.run

    # One flat closure per call site: this runs on every call, keep it lean.
    if not all(site.present):
        slots = site.present

        def run(ins: tuple, outs: tuple) -> None:
            it = iter(ins)
            run_op(rt, *[next(it) if p else None for p in slots], *outs, **static)
    else:
        def run(ins: tuple, outs: tuple) -> None:
            run_op(rt, *ins, *outs, **static)

    run = guards.named_errors(op_name, run)
    if graph:
        run = guards.capture_guard(op_name, platform, run)
    if _STAGES is not None and platform == "cuda":
        run = _timed_run(run)
    if platform != "cuda":
        return lambda stream, device, ins, outs: run(ins, outs)

    C = torch._C
    get_device, set_device = C._cuda_getDevice, C._cuda_setDevice
    get_stream, set_stream = C._cuda_getCurrentStream, C._cuda_setStream
    # XLA's streams as torch's (id, device, type), by (pointer, device): a sharded op's devices
    # share this closure, each on its own XLA thread, so the lookup reads into a local
    streams: dict = {}

    def run_on_xla_stream(stream: int, device: int, ins: tuple, outs: tuple) -> None:
        # DeepGEMM launches on torch's current stream: make it XLA's (and the device XLA's)
        # for the call, then give torch its own back.
        xla = streams.get((stream, device))
        if xla is None:
            xla = streams.setdefault((stream, device), torch_stream(stream, device))
        prev_device = get_device()
        if prev_device != device:
            set_device(device)
        prev = get_stream(device)
        set_stream(*xla)
        try:
            run(ins, outs)
        finally:
            set_stream(*prev[:3])
            if prev_device != device:
                set_device(prev_device)

    return _timed_closure(run_on_xla_stream) if _STAGES is not None else run_on_xla_stream


_DG_TIMES: list = []   # (start, end) of each DeepGEMM call in the probed closure's run


class _Timed:
    """A kernel namespace whose every function call is timed into _DG_TIMES (probe only)."""

    def __init__(self, dg):
        self._dg = dg

    def __getattr__(self, name: str):
        fn, now, times = getattr(self._dg, name), time.monotonic_ns, _DG_TIMES

        def call(*args, **kwargs):
            t = now()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append((t, now()))
        return call


_RUN_TIMES: list = []   # (run entered, run returned) of the probed call in flight


def _timed_run(run) -> Callable:
    """The closure's run with its start and end recorded (probe(True) only)."""
    now = time.monotonic_ns

    def timed(ins: tuple, outs: tuple) -> None:
        _DG_TIMES.clear()
        _RUN_TIMES[:] = [now()]
        run(ins, outs)
        _RUN_TIMES.append(now())
    return timed


def _timed_closure(closure) -> Callable:
    """The production closure, its stages recorded around it (probe(True) only): entered,
    torch's stream set (= run entered), run returned, left; and the time inside DeepGEMM."""
    stages, now = _STAGES, time.monotonic_ns

    def timed(stream: int, device: int, ins: tuple, outs: tuple) -> None:
        t0 = now()
        closure(stream, device, ins, outs)
        t1, t2 = _RUN_TIMES
        stages.append((t0, t1, t2, now(), sum(b - a for a, b in _DG_TIMES)))
    return timed


def clear_caches() -> None:
    """Drops cached call sites and buffer views (e.g. after changing backends in a test)."""
    _bridge.clear_caches()


def cache_sizes() -> tuple[int, int]:
    return _bridge.cache_sizes()


_bridge.install(_prepare, retype)
