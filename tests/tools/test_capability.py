"""Capability oracles: per device, env switches, the scale-format oracle, the model table."""

from __future__ import annotations

import pytest

import jax_dg
from jax_dg.tools import capability
from jax_dg.core import device


from tests.core.test_device import A100, B200, B300, CPU, H200, RTX


@pytest.fixture
def env(monkeypatch):
    """deep_gemm 'installed' with an fp8_gemm_nt, default switches, a fresh oracle cache."""
    monkeypatch.setattr(capability, "_deep_gemm_importable", lambda: True)
    monkeypatch.setattr(capability, "_has_fp8_gemm_nt", lambda: True)
    monkeypatch.delenv(capability.ENV_USE_DEEP_GEMM, raising=False)
    monkeypatch.delenv(capability.ENV_USE_DEEP_GEMM_E8M0, raising=False)
    capability.DeepGemmQuantScaleFMT.clear_oracle_cache()
    yield monkeypatch
    capability.DeepGemmQuantScaleFMT.clear_oracle_cache()


def test_supported_per_device(env):
    assert [jax_dg.is_deep_gemm_supported(d) for d in (H200, B200, B300, RTX, A100, CPU)] == \
        [True, True, True, False, False, False]
    env.setenv(capability.ENV_USE_DEEP_GEMM, "0")
    assert not jax_dg.is_deep_gemm_supported(H200)
    env.setenv(capability.ENV_USE_DEEP_GEMM, "1")
    env.setattr(capability, "_deep_gemm_importable", lambda: False)
    assert not jax_dg.is_deep_gemm_supported(H200)


def test_blackwell_used(env):
    assert [jax_dg.is_blackwell_deep_gemm_used(d) for d in (H200, B200, B300, RTX, A100, CPU)] == \
        [False, True, True, False, False, False]
    env.setenv(capability.ENV_USE_DEEP_GEMM, "0")
    assert not jax_dg.is_blackwell_deep_gemm_used(B200)


def test_e8m0_used(env):
    assert jax_dg.is_deep_gemm_e8m0_used(H200) and jax_dg.is_deep_gemm_e8m0_used(B200)
    assert not jax_dg.is_deep_gemm_e8m0_used(CPU)
    env.setenv(capability.ENV_USE_DEEP_GEMM_E8M0, "0")
    assert not jax_dg.is_deep_gemm_e8m0_used(H200)
    env.delenv(capability.ENV_USE_DEEP_GEMM_E8M0)
    env.setattr(capability, "_has_fp8_gemm_nt", lambda: False)
    assert not jax_dg.is_deep_gemm_e8m0_used(H200)


def test_scale_format_oracle_per_device_and_cached(env):
    fmt = jax_dg.DeepGemmQuantScaleFMT
    assert fmt.from_oracle(H200) is fmt.FLOAT32_CEIL_UE8M0
    assert fmt.from_oracle(B200) is fmt.UE8M0
    assert fmt.from_oracle(CPU) is fmt.FLOAT32
    env.setenv(capability.ENV_USE_DEEP_GEMM_E8M0, "0")
    assert fmt.from_oracle(H200) is fmt.FLOAT32_CEIL_UE8M0, "decided once per device"
    fmt.clear_oracle_cache()
    fmt.init_oracle_cache(H200)
    assert fmt.from_oracle(H200) is fmt.FLOAT32
    assert [m.name for m in fmt] == ["FLOAT32", "FLOAT32_CEIL_UE8M0", "UE8M0"]


def test_should_auto_disable_deep_gemm_table():
    for model in capability.DEEP_GEMM_EXCLUDED_MODEL_TYPES:
        assert jax_dg.should_auto_disable_deep_gemm(model, B200)
        assert jax_dg.should_auto_disable_deep_gemm(model, B300)
        assert jax_dg.should_auto_disable_deep_gemm(model, RTX)
        assert not jax_dg.should_auto_disable_deep_gemm(model, H200)
        assert not jax_dg.should_auto_disable_deep_gemm(model, CPU)
    assert "qwen3_5_moe_text" in capability.DEEP_GEMM_EXCLUDED_MODEL_TYPES
    assert not jax_dg.should_auto_disable_deep_gemm("deepseek_v3", B200)
    assert not jax_dg.should_auto_disable_deep_gemm(None, B200)


def test_real_devices_of_this_process():
    import jax
    from jax_dg.backends import deep_gemm
    for dev in jax.devices():
        supported = jax_dg.is_deep_gemm_supported(dev)
        if dev.platform != "gpu":
            assert not supported and device.arch(dev) is None
        else:   # a CUDA device: supported exactly where its family has DeepGEMM and it imports
            family_ok = device.family(dev) in ("sm90", "sm100")
            assert supported == (family_ok and deep_gemm.module() is not None), (dev, supported)
            assert device.arch(dev).startswith("sm")
    assert jax_dg.is_deep_gemm_supported() == jax_dg.is_deep_gemm_supported(0)
    assert isinstance(jax_dg.has_deep_gemm(), bool)
    if deep_gemm.module() is not None:   # an importable deep_gemm is an installed one
        assert jax_dg.has_deep_gemm()
