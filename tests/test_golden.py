"""DeepGEMM's own outputs (tests/golden/*.npz, recorded on an H200 by scripts/record_golden.py) against
jax_dg: the torch reference through the bridge and the pure-JAX reference everywhere (so CI without a
GPU checks both against DeepGEMM itself), and DeepGEMM under jax_dg bitwise on a GPU."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import jax_dg
from tests.golden import cases

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
NAMES = [c.name for c in cases.CASES]


def golden(name):
    return cases.load(os.path.join(HERE, f"{name}.npz"))


def call(case, inputs, backend):
    with jax_dg.use_backend(backend):
        return jax.block_until_ready(jax.jit(case.jax_dg)(inputs))


def assert_matches(got, want, bound, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{what} output {i}"
        if bound is None or not np.issubdtype(w.dtype, np.floating) and w.dtype.kind != "V":
            np.testing.assert_array_equal(g, w, err_msg=f"{what} output {i}: not bitwise DeepGEMM's")
            continue
        g, w = g.astype(np.float64), w.astype(np.float64)
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=f"{what} output {i}: -inf")
        assert np.isfinite(g[~np.isneginf(g)]).all(), f"{what} output {i}: non-finite values"
        diff = jax_dg.calc_diff(np.where(np.isneginf(g), 0, g), np.where(np.isneginf(w), 0, w))
        assert diff < bound, f"{what} output {i}: calc_diff {diff:.3g} >= {bound}"


def test_every_case_has_its_file_and_says_which_deep_gemm_made_it():
    files = sorted(f[:-4] for f in os.listdir(HERE) if f.endswith(".npz"))
    assert files == sorted(NAMES)
    for name in NAMES:
        meta = golden(name)[2]
        assert meta["case"] == name and meta["deep_gemm"].startswith("2.5"), meta
        assert "H200" in meta["device"] or "H100" in meta["device"], meta


@pytest.mark.parametrize("backend", ["torch", "xla"])
@pytest.mark.parametrize("name", NAMES)
def test_references_match_deep_gemm(name, backend):
    case = cases.BY_NAME[name]
    inputs, want, _ = golden(name)
    assert_matches(call(case, inputs, backend), want, case.diff, f"{name} ({backend} reference)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bitwise_deep_gemms_golden_output(name):
    case = cases.BY_NAME[name]
    inputs, want, _ = golden(name)
    got = call(case, inputs, "auto")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.asarray(g).tobytes() == w.tobytes(), f"{name} output {i}: not bitwise DeepGEMM's"
