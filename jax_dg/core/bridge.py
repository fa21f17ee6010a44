"""The Python half of the FFI bridge (the C++ half is ffi/bridge.cc).

XLA calls the generic handler with a `site` attribute: a JSON string naming the op, the
backend and the op's static attributes. The handler asks `_prepare(site, platform)` once per
call site for a callable and caches it; every call then passes XLA's stream, device ordinal
and torch views of the argument and result buffers to that callable.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import jax  # keep ahead of the extension: loading it first crashes jax's import (see tests)
import torch

from jax_dg.core import _bridge

_HANDLERS = _bridge.handlers()
_REGISTERED: set[str] = set()
_OPS: dict[str, Any] = {}  # op name -> Op (jax_dg.core.op)

# XLA element types that DLPack carries as uint8 (see DlpackType in ffi/bridge.cc).
# XLA_FFI_DataType values from xla/ffi/api/c_api.h (part of the stable FFI ABI).
_FP8_BY_XLA_TYPE = {19: torch.float8_e5m2, 20: torch.float8_e4m3fn}


def _retype(tensor: torch.Tensor, xla_dtype: int) -> torch.Tensor:
    return tensor.view(_FP8_BY_XLA_TYPE[xla_dtype])


def register_op(op) -> str:
    """Registers `op`'s custom-call target on every platform; returns the target name."""
    target = f"jax_dg_{op.name}"
    _OPS[op.name] = op
    if target not in _REGISTERED:
        for platform, handler in _HANDLERS.items():
            jax.ffi.register_ffi_target(target, handler, platform=platform)
        _REGISTERED.add(target)
    return target


def encode_site(op_name: str, backend: str, present: str, static: dict) -> str:
    """The `site` attribute: everything the backend needs that is not a buffer."""
    return json.dumps([op_name, backend, present, static], sort_keys=True, separators=(",", ":"))


def _prepare(site: str, platform: str) -> Callable:
    from jax_dg import backends  # late: backends import this module

    op_name, backend, present, static = json.loads(site)
    op = _OPS[op_name]
    kernels = backends.kernels(backend, platform, op)
    call = op.call

    # One flat closure per call site: this runs on every call, keep it lean.
    if "0" in present:
        slots = [c == "1" for c in present]

        def run(ins: list, outs: list) -> None:
            it = iter(ins)
            call(kernels, *[next(it) if p else None for p in slots], *outs, **static)
    else:
        def run(ins: list, outs: list) -> None:
            call(kernels, *ins, *outs, **static)

    if platform != "cuda":
        return lambda stream, device, ins, outs: run(ins, outs)

    C = torch._C

    def run_on_xla_stream(stream: int, device: int, ins: list, outs: list) -> None:
        # DeepGEMM launches on torch's current stream: make it XLA's (and the device XLA's)
        # for the call, then give torch its own back.
        prev_device = C._cuda_getDevice()
        if prev_device != device:
            C._cuda_setDevice(device)
        prev = C._cuda_getCurrentStream(device)
        C._cuda_setStream(*_torch_stream(stream, device))
        try:
            run(ins, outs)
        finally:
            C._cuda_setStream(*prev[:3])
            if prev_device != device:
                C._cuda_setDevice(prev_device)

    return run_on_xla_stream


@functools.lru_cache(maxsize=64)
def _torch_stream(stream: int, device: int) -> tuple[int, int, int]:
    s = torch.cuda.ExternalStream(stream, device=torch.device("cuda", device))
    return (s.stream_id, s.device_index, s.device_type)


def clear_caches() -> None:
    """Drops cached call sites and buffer views (e.g. after changing backends in a test)."""
    _bridge.clear_caches()


def cache_sizes() -> tuple[int, int]:
    return _bridge.cache_sizes()


_bridge.install(_prepare, _retype)
