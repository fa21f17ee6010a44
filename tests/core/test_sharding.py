"""Sharding rules from the Op records, on 8 host devices (a subprocess: the device count is
fixed when jax starts): results equal to unsharded, and no collective in the compiled HLO
where the rule needs none (a K-sharded GEMM: one all-reduce)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = ["fp8_gemm_nt/M", "fp8_gemm_nt/N", "fp8_gemm_nt/K", "bf16_gemm_nt/M", "bf16_gemm_nt/N",
         "m_grouped_fp8_masked/G", "m_grouped_fp8_contiguous/M", "mqa_logits/M", "paged_mqa_logits/B",
         "cast_tokens/M", "cast_tokens_transposed/M", "cast_blocks/M", "fp8_linear/M", "indivisible"]


@pytest.fixture(scope="module")
def eight_devices():
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      " --xla_force_host_platform_device_count=8").strip(),
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-m", "tests.core.sharded_cases", "8"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    return res


@pytest.mark.parametrize("name", CASES)
def test_sharded_on_eight_host_devices(eight_devices, name):
    assert f"case {name} ok" in eight_devices.stdout, eight_devices.stdout[-2000:] + eight_devices.stderr[-4000:]
