"""The device the torch emulation emulates: DeepGEMM's `get_num_sms` / `set_num_sms`
(jax_dg.backends.emulated's count: the schedule metadata and the paged logits check it as
DeepGEMM does), and where its one output allocation lands (jax_dg's landing interface).
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch

from jax_dg.backends.emulated import get_num_sms, set_num_sms

# DeepGEMM's API, and jax_dg's landing interface (arm_landing / padded_empty are the emulation's own)
__all__ = ["get_num_sms", "set_num_sms", "land_into"]


# --- the one allocation of a logits call, landing in a given buffer ---------------------------
#
# DeepGEMM's logits calls allocate their padded output themselves; on CUDA jax_dg routes that
# allocation into XLA's result buffer with a torch MemPool (jax_dg.runtime.landing). The
# emulation makes its one allocation here and implements the landing itself (`land_into`, for
# the platforms without that pool: the CPU): a buffer armed for the current thread is used once
# if it is large enough, else the emulation allocates as usual.

_landing = threading.local()


def arm_landing(buffer: torch.Tensor | None) -> torch.Tensor | None:
    """Arms (or, with None, disarms) this thread's landing buffer; returns the one that was
    still armed (None if it was used)."""
    previous = getattr(_landing, "buffer", None)
    _landing.buffer = buffer
    return previous


def _armed_view(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor | None:
    """The armed buffer (disarmed) as a [shape] dtype tensor, if it fits; else None."""
    buffer = arm_landing(None)
    nbytes = math.prod(shape) * dtype.itemsize
    if (buffer is not None and buffer.device == torch.device(device) and buffer.is_contiguous()
            and buffer.numel() * buffer.element_size() >= nbytes):
        return buffer.reshape(-1).view(torch.uint8)[:nbytes].view(dtype).view(shape)
    return None


def padded_empty(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The reference's output allocation: in the armed buffer when it fits, filled with NaN
    (what DeepGEMM leaves unwritten is unspecified; NaN catches a caller that reads it)."""
    out = _armed_view(shape, dtype, device)
    if out is None:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return out.fill_(float("nan"))


def allocated(value: torch.Tensor) -> torch.Tensor:
    """`value` in the call's one output allocation (the armed buffer when it fits): for an
    output the reference computes whole, e.g. the schedule metadata."""
    out = _armed_view(tuple(value.shape), value.dtype, value.device)
    return value if out is None else out.copy_(value)


def land_into(out: torch.Tensor, make: Callable[[], torch.Tensor]):
    """jax_dg's landing interface (jax_dg.runtime.landing): runs `make`, whose one allocation
    takes `out`'s memory where it fits; (its result, nothing to keep alive)."""
    arm_landing(out)
    try:
        return make(), None
    finally:
        arm_landing(None)
