"""The Python half of the FFI bridge (the C++ half is ffi/bridge.cc).

XLA calls the generic handler with a `site` attribute: a JSON string naming the op, the
backend, which optional arguments are present, whether the call may be captured into a CUDA
graph, and the op's static attributes. The handler asks `_prepare(site, platform)` once per
call site for a callable and caches it; every call then passes XLA's stream, device ordinal and
torch views of the argument and result buffers to it.

Capture: an op declared graph-safe (Op.graph_safe) is lowered to a second target whose CUDA
handler is command-buffer compatible. XLA may then run the call under stream capture on its
trace stream and replay the recorded kernels without calling Python at all; the call is guarded
(runtime.capture_guard) so that a torch allocation under capture is an error, never a
use-after-free on replay.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import jax  # keep ahead of the extension: loading it first crashes jax's import (see tests)
import torch

from jax_dg.core import _bridge
from jax_dg.core import backend as selection
from jax_dg.core import runtime

_HANDLERS = _bridge.handlers()
_GRAPH_HANDLERS = _bridge.graph_handlers()
GRAPH_SUFFIX = "_graph"   # the command-buffer-compatible twin of an op's target
_REGISTERED: set[str] = set()
_OPS: dict[str, Any] = {}  # op name -> Op (jax_dg.core.op)


def register_op(op) -> str:
    """Registers `op`'s custom-call target on every platform; returns the target's name."""
    name = f"jax_dg_{op.name}"
    _OPS[op.name] = op
    if name not in _REGISTERED:
        for platform, handler in _HANDLERS.items():
            jax.ffi.register_ffi_target(name, handler, platform=platform)
        if op.graph_safe:
            for platform, handler in _GRAPH_HANDLERS.items():
                jax.ffi.register_ffi_target(name + GRAPH_SUFFIX, handler, platform=platform)
        _REGISTERED.add(name)
    return name


def registered_targets() -> list[str]:
    """Every custom-call target jax_dg registered (graph-safe twins included)."""
    return sorted(_REGISTERED | {n + GRAPH_SUFFIX for n in _REGISTERED
                                 if _OPS[n.removeprefix("jax_dg_")].graph_safe})


def registered_ops() -> dict[str, Any]:
    """Every registered op by name (test-only ops start with "_")."""
    return dict(_OPS)


def encode_site(op_name: str, backend: str, present: str, static: dict, graph: bool = False) -> str:
    """The `site` attribute: everything the backend needs that is not a buffer."""
    return json.dumps([op_name, backend, present, static, graph], sort_keys=True,
                      separators=(",", ":"))


def call_count() -> int:
    """Handler entries so far (every platform): a replayed CUDA graph adds none."""
    return _bridge.call_count()


def _frozen(value):
    """JSON lists back into the tuples they were given as (statics are decoded once, here)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _prepare(site: str, platform: str) -> Callable:
    op_name, backend, present, static, graph = json.loads(site)
    static = _frozen(static)
    op = _OPS[op_name]
    dg = selection.namespace(backend, platform, op.symbols)
    run_op = op.run

    # One flat closure per call site: this runs on every call, keep it lean.
    if "0" in present:
        slots = [c == "1" for c in present]

        def run(ins: tuple, outs: tuple) -> None:
            it = iter(ins)
            run_op(dg, *[next(it) if p else None for p in slots], *outs, **static)
    else:
        def run(ins: tuple, outs: tuple) -> None:
            run_op(dg, *ins, *outs, **static)

    if graph:
        run = runtime.capture_guard(op_name, platform, run)
    if platform != "cuda":
        return lambda stream, device, ins, outs: run(ins, outs)

    C = torch._C
    get_device, set_device = C._cuda_getDevice, C._cuda_setDevice
    get_stream, set_stream = C._cuda_getCurrentStream, C._cuda_setStream
    xla = [None, None]   # XLA's last stream (pointer) and its torch (id, device, type)

    def run_on_xla_stream(stream: int, device: int, ins: tuple, outs: tuple) -> None:
        # DeepGEMM launches on torch's current stream: make it XLA's (and the device XLA's)
        # for the call, then give torch its own back.
        if stream != xla[0]:
            xla[1], xla[0] = runtime.torch_stream(stream, device), stream
        prev_device = get_device()
        if prev_device != device:
            set_device(device)
        prev = get_stream(device)
        set_stream(*xla[1])
        try:
            run(ins, outs)
        finally:
            set_stream(*prev[:3])
            if prev_device != device:
                set_device(prev_device)

    return run_on_xla_stream


def clear_caches() -> None:
    """Drops cached call sites and buffer views (e.g. after changing backends in a test)."""
    _bridge.clear_caches()


def cache_sizes() -> tuple[int, int]:
    return _bridge.cache_sizes()


_bridge.install(_prepare, runtime.retype)
