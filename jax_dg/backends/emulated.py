"""The device the emulations emulate (the torch emulation and the pure-JAX references): its SM
count, what DeepGEMM's `get_num_sms` / `set_num_sms` are on the GPU. No torch: a trace for
any backend but DeepGEMM reads it (jax_dg.core.device.target), and the torch emulation's
kernels check their schedules against the same count when they run.

The count is `set_num_sms`'s where set, else the SM count of jax's default device where it is
a CUDA GPU, else contracts.DEFAULT_NUM_SMS (an H100 / H200).
"""

from __future__ import annotations

import functools

import jax

from jax_dg import contracts

_num_sms: int | None = None


def set_num_sms(num_sms: int | None) -> None:
    """Overrides the emulated SM count (None: back to the default)."""
    global _num_sms
    _num_sms = None if num_sms is None else int(num_sms)


def get_num_sms() -> int:
    return _default_num_sms() if _num_sms is None else _num_sms


@functools.cache
def _default_num_sms() -> int:
    """Read once (a trace reads it first; the emulation's kernels then need no jax call)."""
    dev = jax.devices()[0]
    if dev.platform == "gpu" and getattr(dev, "core_count", None):
        return int(dev.core_count)
    return contracts.DEFAULT_NUM_SMS
