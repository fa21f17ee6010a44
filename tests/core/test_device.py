"""The device module: per-device architecture and the target of a trace."""

from __future__ import annotations

import types

import pytest

import jax_dg
from jax_dg import contracts
from jax_dg.backends.torch_emu import device as emulated
from jax_dg.core import device


def gpu(cc: str, id: int = 0):
    return types.SimpleNamespace(platform="gpu", compute_capability=cc, id=id, device_kind="fake")


CPU = types.SimpleNamespace(platform="cpu", id=0, device_kind="cpu")
H200, B200, B300, RTX, A100 = gpu("9.0", 0), gpu("10.0", 1), gpu("10.3", 2), gpu("12.0", 3), gpu("8.0", 4)


def test_arch_per_device():
    assert device.arch(H200) == "sm90" and device.family(H200) == "sm90"
    assert device.arch(B300) == "sm103" and device.family(B300) == "sm100"
    assert device.family(RTX) == "sm120" and device.family(A100) == "sm80"
    assert device.arch(CPU) is None and device.family(CPU) is None
    assert device.capability(gpu("gfx942")) is None
    assert device.in_family(100, B300)
    assert not device.in_family(100, H200)


def test_target_off_the_gpu_emulates_sm90_with_the_references_sm_count():
    if device.platform() != "cpu":
        pytest.skip("the CPU target (the GPU's is tested by test_target_on_the_gpu)")
    t = device.target()
    assert (t.backend, t.platform, t.arch) == ("torch", "cpu", contracts.EMULATED_ARCH)
    assert t.num_sms == contracts.DEFAULT_NUM_SMS
    emulated.set_num_sms(78)
    try:
        assert device.target().num_sms == 78
    finally:
        emulated.set_num_sms(None)
    with jax_dg.use_backend("xla"):
        assert device.target().backend == "xla"


@pytest.mark.gpu
def test_target_on_the_gpu_is_deep_gemm_with_its_sm_count():
    from jax_dg.backends import deep_gemm
    t = device.target()
    assert (t.backend, t.platform) == ("deep_gemm", "cuda")
    assert t.arch == device.family() and t.num_sms == int(deep_gemm.module().get_num_sms()) > 0
    with jax_dg.use_backend("torch"):
        assert device.target().backend == "torch" and device.target().platform == "cuda"
