"""The device the torch emulation emulates: DeepGEMM's `get_num_sms` / `set_num_sms`.

Its SM count is the CUDA device's when torch sees one, else contracts.DEFAULT_NUM_SMS (an
H200), unless set: the schedule metadata and the paged logits check it as DeepGEMM does.
"""

from __future__ import annotations

import math
import threading

import torch

from jax_dg import contracts

__all__ = ["get_num_sms", "set_num_sms"]   # DeepGEMM's API; arm_landing / padded_empty are jax_dg's

_num_sms: int | None = None


def set_num_sms(num_sms: int | None) -> None:
    """Overrides the emulated SM count (None: back to the default)."""
    global _num_sms
    _num_sms = None if num_sms is None else int(num_sms)


def get_num_sms() -> int:
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return contracts.DEFAULT_NUM_SMS


# --- the one allocation of a logits call, landing in a given buffer ---------------------------
#
# DeepGEMM's logits calls allocate their padded output themselves; on CUDA jax_dg routes that
# allocation into XLA's result buffer with a torch MemPool (jax_dg.core.landing). The reference
# makes its one allocation here, so the same protocol runs on CPU: a buffer armed for the
# current thread is used once if it is large enough, else the reference allocates as usual.

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
