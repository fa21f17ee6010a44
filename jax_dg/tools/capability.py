"""Capability oracles: may DeepGEMM run here, and which scale format it wants (per device).

Mirrors vLLM's `vllm.utils.deep_gemm` oracles with jax_dg's switches:

  JAX_DG_USE_DEEP_GEMM=0        never use DeepGEMM (as VLLM_USE_DEEP_GEMM=0); default 1
  JAX_DG_USE_DEEP_GEMM_E8M0=0   no UE8M0 (power-of-two) scales (as VLLM_USE_DEEP_GEMM_E8M0);
                                default 1

Every oracle takes an optional `device` (a jax.Device or a device index; default: jax's first
device) and reads that device's compute capability, so a process with mixed GPUs gets one
answer per device. Environment switches are read on every call.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from typing import Any

from jax_dg.backends import deep_gemm
from jax_dg.core.device import in_family, jax_device

ENV_USE_DEEP_GEMM = "JAX_DG_USE_DEEP_GEMM"
ENV_USE_DEEP_GEMM_E8M0 = "JAX_DG_USE_DEEP_GEMM_E8M0"

# Model types (hf_text_config.model_type) known to lose accuracy with DeepGEMM's E8M0 scale
# format, and the device capability families where DeepGEMM is auto-disabled for them. From
# vLLM's _DEEPGEMM_BLACKWELL_EXCLUDED_MODEL_TYPES (Qwen3.5 text models on Blackwell: SM100
# and SM120 families). Edit this table to extend the list.
DEEP_GEMM_EXCLUDED_MODEL_TYPES: dict[str, tuple[int, ...]] = {
    "qwen3_5_text": (100, 120),
    "qwen3_5_moe_text": (100, 120),
}
SUPPORTED_FAMILIES = (90, 100)  # Hopper, datacenter Blackwell


def _env_flag(name: str, default: bool = True) -> bool:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def has_deep_gemm() -> bool:
    """Whether a DeepGEMM package is installed (not imported): `deep_gemm`, or vLLM's copy."""
    if importlib.util.find_spec("deep_gemm") is not None:
        return True
    try:
        return (importlib.util.find_spec("vllm") is not None
                and importlib.util.find_spec("vllm.third_party.deep_gemm") is not None)
    except (ImportError, ValueError):
        return False


def _deep_gemm_importable() -> bool:
    return deep_gemm.module() is not None


def is_deep_gemm_supported(device: Any = None) -> bool:
    """True when DeepGEMM may run on `device`: a CUDA device of the SM90 or SM100 family,
    JAX_DG_USE_DEEP_GEMM not 0, and a deep_gemm that imports (an installed build made for
    another torch does not count; has_deep_gemm() only says one is installed)."""
    if not _env_flag(ENV_USE_DEEP_GEMM):
        return False
    if not any(in_family(f, device) for f in SUPPORTED_FAMILIES):
        return False
    return _deep_gemm_importable()


def _has_fp8_gemm_nt() -> bool:
    return deep_gemm.lookup("fp8_gemm_nt") is not None


def is_blackwell_deep_gemm_used(device: Any = None) -> bool:
    """True when DeepGEMM runs on `device` and it is a Blackwell-class GPU (major 10: SM100,
    SM103), as vLLM's oldest wrapper reports; supported as in is_deep_gemm_supported."""
    return in_family(100, device) and is_deep_gemm_supported(device)


def is_deep_gemm_e8m0_used(device: Any = None) -> bool:
    """True when DeepGEMM runs on `device` with UE8M0 scales: supported, its fp8_gemm_nt
    resolves, and JAX_DG_USE_DEEP_GEMM_E8M0 is not 0 (vLLM's VLLM_USE_DEEP_GEMM_E8M0)."""
    return (is_deep_gemm_supported(device) and _has_fp8_gemm_nt()
            and _env_flag(ENV_USE_DEEP_GEMM_E8M0))


_ORACLE_CACHE: dict[Any, "DeepGemmQuantScaleFMT"] = {}


def _device_key(device: Any) -> Any:
    dev = jax_device(device)
    return (dev.platform, dev.id)


class DeepGemmQuantScaleFMT(enum.Enum):
    """The scale format FP8 activations should be quantised to for DeepGEMM on a device."""

    FLOAT32 = 0             # float32 scales
    FLOAT32_CEIL_UE8M0 = 1  # float32 scales rounded up to powers of two (SM90 with E8M0)
    UE8M0 = 2               # powers of two packed 4 per int32 (SM100/SM120 with E8M0)

    @classmethod
    def init_oracle_cache(cls, device: Any = None) -> None:
        """Decides the format for `device` once (vLLM's logic) and caches it per device."""
        key = _device_key(device)
        if key in _ORACLE_CACHE:
            return
        use_e8m0 = (_env_flag(ENV_USE_DEEP_GEMM_E8M0) and is_deep_gemm_supported(device)
                    and _has_fp8_gemm_nt())
        if not use_e8m0:
            _ORACLE_CACHE[key] = cls.FLOAT32
        elif in_family(100, device) or in_family(120, device):
            _ORACLE_CACHE[key] = cls.UE8M0
        else:
            _ORACLE_CACHE[key] = cls.FLOAT32_CEIL_UE8M0

    @classmethod
    def from_oracle(cls, device: Any = None) -> "DeepGemmQuantScaleFMT":
        """The cached decision for `device`, deciding it on first use (FLOAT32 without DeepGEMM)."""
        cls.init_oracle_cache(device)
        return _ORACLE_CACHE[_device_key(device)]

    @classmethod
    def clear_oracle_cache(cls) -> None:
        """Forgets every cached decision (after changing the environment switches)."""
        _ORACLE_CACHE.clear()


def should_auto_disable_deep_gemm(model_type: str | None, device: Any = None) -> bool:
    """True if DeepGEMM is known to hurt `model_type` on `device`'s capability family:
    DEEP_GEMM_EXCLUDED_MODEL_TYPES maps model types to the families where it is disabled."""
    if model_type is None:
        return False
    return any(in_family(family, device)
               for family in DEEP_GEMM_EXCLUDED_MODEL_TYPES.get(model_type, ()))
