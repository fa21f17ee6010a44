"""The device the emulations emulate (the torch emulation and the pure-JAX references): its SM
count, what DeepGEMM's `get_num_sms` / `set_num_sms` are on the GPU, and the DeepGEMM release
whose API the torch emulation presents (2.5's, or 2.8's: presenting). No torch: a trace for
any backend but DeepGEMM reads it (jax_dg.core.device.target), and the torch emulation's
kernels check their schedules against the same count when they run.

The count is `set_num_sms`'s where set, else the SM count of jax's default device where it is
a CUDA GPU, else contracts.DEFAULT_NUM_SMS (an H100 / H200).
"""

from __future__ import annotations

import contextlib
import functools

import jax

from jax_dg import contracts
from jax_dg.backends import deep_gemm

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


def _parse(version) -> tuple[int, int]:
    if isinstance(version, str):
        version = tuple(int(x) for x in version.split(".")[:2])
    version = tuple(version)
    if version not in deep_gemm.TESTED:
        raise ValueError("jax_dg: the emulation presents DeepGEMM "
                         f"{', '.join('.'.join(map(str, v)) for v in deep_gemm.TESTED)}; "
                         f"not {'.'.join(map(str, version))}")
    return version


# Part of jit's cache key, as jax_dg.use_backend: a function traced for one release is traced
# again for another.
_presented = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def presenting(version: tuple[int, int] | str):
    """Makes the torch emulation present DeepGEMM `version`'s API (a tested one: 2.5, the
    default, or 2.8) to functions traced inside the block: they plan their calls for that
    release, and the calls reach it in its form (jax_dg.backends.torch_emu.v28). So a program
    meant for a GPU with DeepGEMM 2.8 can be checked on a CPU."""
    with _presented(_parse(version)):
        yield


def version() -> tuple[int, int]:
    """The release the emulation presents to what is traced now."""
    return _presented.value or contracts.EMULATED_VERSION


def api() -> deep_gemm.Api:
    """The API the torch emulation presents (what a trace for it plans with)."""
    return deep_gemm.Api.emulating(version())
