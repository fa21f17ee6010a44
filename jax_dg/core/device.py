"""The one place that knows devices: compute capability, architecture, SM count, and the
target of a trace (what a function traced now will run on).

Static sizes (schedule slots, metadata bytes) and per-architecture rules are decided at trace
time from `target()`, never from a process-wide global.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jax_dg import contracts
from jax_dg.backends import deep_gemm, emulated
from jax_dg.core import backend as selection


def jax_device(device: Any = None):
    """A jax.Device from None (jax's first device), a device index, or a jax.Device."""
    if device is None:
        return jax.devices()[0]
    if isinstance(device, int):
        return jax.devices()[device]
    return device


def capability(device: Any = None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for CPU and other platforms."""
    dev = jax_device(device)
    if dev.platform != "gpu":
        return None
    try:
        major, minor = str(getattr(dev, "compute_capability", None)).split(".")[:2]
        return int(major), int(minor)
    except (TypeError, ValueError):  # e.g. ROCm's "gfx942"
        return None


def arch(device: Any = None) -> str | None:
    """'sm90', 'sm100', 'sm103', ... for a CUDA device; None elsewhere."""
    cap = capability(device)
    return None if cap is None else f"sm{cap[0]}{cap[1]}"


def family(device: Any = None) -> str | None:
    """'sm90' (Hopper), 'sm100' (SM10x), 'sm120' (SM12x), else the arch; None off CUDA."""
    cap = capability(device)
    if cap is None:
        return None
    return contracts.ARCH_FAMILIES.get(cap[0], f"sm{cap[0]}{cap[1]}")


def in_family(family_number: int, device: Any = None) -> bool:
    """vLLM's family test: 100 matches SM100 and SM103 (major 10), 90 matches SM90."""
    cap = capability(device)
    return cap is not None and cap[0] == family_number // 10


def platform() -> str:
    """jax's default platform as the bridge names it: "cuda" or "cpu" (or another)."""
    name = jax.default_backend()
    return "cuda" if name in ("gpu", "cuda") else name


@dataclasses.dataclass(frozen=True)
class Target:
    """What a function traced now will run on: the concrete backend, the GPU architecture whose
    DeepGEMM contract applies, the SM count its kernels schedule for, and the DeepGEMM release
    whose layouts apply."""
    backend: str     # "deep_gemm", "torch" or "xla"
    platform: str    # "cuda" or "cpu"
    arch: str        # "sm90", "sm100", ...; the references emulate contracts.EMULATED_ARCH
    num_sms: int
    # What the DeepGEMM the call reaches offers (backends.deep_gemm.Api): the installed one on
    # "deep_gemm"; the emulated one elsewhere (backends.emulated: 2.5's unless set)
    api: deep_gemm.Api = deep_gemm.Api.emulating(contracts.EMULATED_VERSION)

    @property
    def version(self) -> tuple[int, int]:
        """(major, minor) of the DeepGEMM whose contract and layouts apply."""
        return self.api.version


def target() -> Target:
    """The target of functions traced now: jax's default platform and the requested backend.

    DeepGEMM on CUDA: the device's family, `deep_gemm.get_num_sms()` (which the logits kernel
    checks the schedule against; `deep_gemm.set_num_sms` changes both) and DeepGEMM's version.
    The emulations (CPU, or JAX_DG_BACKEND=torch/xla) emulate the SM90 contract of DeepGEMM
    2.5 with jax_dg.backends.emulated's SM count: the CUDA device's, or 132 (H100/H200) without
    one; `jax_dg.backends.torch_emu.set_num_sms` overrides it.
    """
    where = platform()
    requested = selection.requested()
    concrete = selection.concrete(requested, where)
    if concrete == "deep_gemm" and where == "cuda":
        dg = deep_gemm.module()
        if dg is not None:
            return Target(concrete, where, family(), int(dg.get_num_sms()), deep_gemm.api())
    return Target(concrete, where, contracts.EMULATED_ARCH, emulated.get_num_sms(), emulated.api())
