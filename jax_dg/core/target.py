"""The device a function traced now targets, and the DeepGEMM contract that applies there.

Static sizes (schedule slots, metadata bytes) and per-architecture rules are decided at trace
time from this, never from a process-wide global.
"""

from __future__ import annotations

import dataclasses

import jax

from jax_dg import backends


@dataclasses.dataclass(frozen=True)
class Target:
    """What a function traced now will run on: the concrete backend, the GPU architecture whose
    DeepGEMM contract applies, and the SM count its kernels schedule for."""
    backend: str     # "deep_gemm", "torch" or "xla"
    platform: str    # "cuda" or "cpu"
    arch: str        # "sm90", "sm100", ...; the references emulate "sm90"
    num_sms: int


def target() -> Target:
    """The target of functions traced now: jax's default platform and the requested backend.

    DeepGEMM on CUDA: its architecture and `deep_gemm.get_num_sms()` (which the logits kernel
    checks the schedule against; `deep_gemm.set_num_sms` changes both). The references
    (CPU, or JAX_DG_BACKEND=torch/xla) emulate the SM90 contract with the CUDA device's SM count,
    or 132 (H100/H200) without one; `jax_dg.backends.torch_ref.set_num_sms` overrides it.
    """
    platform = jax.default_backend()
    platform = "cuda" if platform in ("gpu", "cuda") else platform
    requested = backends.requested()
    if requested == "xla":
        backend = "xla"
    else:
        try:
            backend = backends.resolve(requested, platform)
        except RuntimeError:          # deep_gemm asked for on CPU: the call reports it
            backend = "deep_gemm"
    if backend == "deep_gemm" and platform == "cuda":
        from jax_dg import capability
        from jax_dg.backends import deep_gemm as dg
        mod = dg.module()
        if mod is not None:
            return Target(backend, platform, capability.arch_family(), int(mod.get_num_sms()))
    from jax_dg.backends.torch_ref import paged_mqa as tr
    return Target(backend, platform, tr.EMULATED_ARCH, tr.get_num_sms())
