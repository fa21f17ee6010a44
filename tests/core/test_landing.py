"""Landing (jax_dg.runtime.landing): DeepGEMM's own logits allocation placed in XLA's result buffer.

CPU: the torch emulation allocates the way DeepGEMM does (one padded buffer per call) and
implements the landing interface itself (its `land_into`); the C++ allocator functions torch's MemPool calls on CUDA are exercised
directly. GPU: pointers, no reuse across calls, the pool's release (tests/ops/test_mqa.py).
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_dg
from jax_dg import contracts
from jax_dg.backends.torch_emu import device as ref_device
from jax_dg.core import _bridge
from jax_dg.runtime import landing
from tests.conftest import check_released

F32 = torch.float32


def reference_call(rows: int, stride: int, logical: tuple[int, int], value: float = 1.0):
    """A stand-in for a DeepGEMM logits call: one padded allocation, a logical view of it."""
    def make():
        buf = ref_device.padded_empty((rows, stride), F32, "cpu")
        buf[:logical[0], :logical[1]] = value
        return buf[:logical[0], :logical[1]]
    return make


def land(out, make, lands=True):
    """The emulation's landing: what a CPU call site lands through (landing.lands_into)."""
    landing.land(out, make, lands, ref_device.land_into)


def test_the_landing_is_the_pool_on_cuda_and_the_kernels_own_elsewhere():
    from jax_dg.backends import torch_emu
    assert landing.lands_into("cuda", torch_emu) is landing.into_cuda_pool
    assert landing.lands_into("cpu", torch_emu) is torch_emu.land_into is ref_device.land_into


def test_lands_in_the_buffer_and_disarms():
    out = torch.zeros(4, 8)
    before = dict(landing.STATS)
    land(out, reference_call(4, 8, (3, 5)))
    assert landing.STATS["landed"] == before["landed"] + 1
    assert torch.all(out[:3, :5] == 1)
    assert torch.isnan(out[3]).all() and torch.isnan(out[:, 5:]).all()   # DeepGEMM's slack
    assert ref_device.arm_landing(None) is None          # released: nothing stays armed


def test_what_the_trace_decided_not_to_land_is_copied():
    out = torch.zeros(4, 8)
    before = dict(landing.STATS)
    land(out, reference_call(4, 8, (3, 5), 4.0), lands=False)
    assert landing.STATS["copied"] == before["copied"] + 1
    assert torch.all(out[:3, :5] == 4)
    assert contracts.lands(1, False) and contracts.lands(4, True)
    sym = jax.export.symbolic_shape("m")[0]
    assert not contracts.lands(sym, True) and contracts.lands(sym, False)


def test_a_larger_allocation_falls_back_to_a_copy():
    out = torch.zeros(4, 8)
    before = dict(landing.STATS)
    land(out, reference_call(5, 8, (3, 5), 2.0))
    assert landing.STATS["copied"] == before["copied"] + 1
    assert torch.all(out[:3, :5] == 2)
    assert ref_device.arm_landing(None) is None


def test_another_layout_is_copied_into_the_declared_one():
    out = torch.zeros(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        land(out, reference_call(4, 6, (3, 5), 3.0))   # stride 6, not 8
    assert torch.all(out[:3, :5] == 3)
    assert any("row stride" in str(w.message) for w in caught) or "layout" in landing._warned


def test_an_error_in_the_call_disarms():
    out = torch.zeros(4, 8)

    def fails():
        raise RuntimeError("kernel refused")
    with pytest.raises(RuntimeError, match="kernel refused"):
        land(out, fails)
    assert ref_device.arm_landing(None) is None


# --- the C++ allocator torch's MemPool calls on CUDA ------------------------------------------

ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


def allocator_functions():
    alloc, free = _bridge.landing_functions()
    return ALLOC(alloc), FREE(free)


def test_allocator_serves_one_request_that_fits():
    alloc, free = allocator_functions()
    base = landing.counts()
    _bridge.landing_arm(0x1000, 4096, 0)
    assert alloc(4096, 0, None) == 0x1000
    assert _bridge.landing_last_request() == 4096
    assert not alloc(16, 0, None)                 # one request per arming
    assert _bridge.landing_disarm() is False      # it was used
    _bridge.landing_arm(0x1000, 4096, 0)
    assert not alloc(4097, 0, None)               # larger than the buffer
    assert not alloc(16, 1, None)                 # another device
    assert _bridge.landing_disarm() is True       # never used
    assert not alloc(16, 0, None)                 # disarmed
    free(0x1000, 4096, 0, None)                   # releases nothing, counts
    now = landing.counts()
    assert now["landed"] == base["landed"] + 1
    assert now["refused"] == base["refused"] + 4
    assert now["released"] == base["released"] + 1


def test_allocator_slot_is_per_thread():
    alloc, _ = allocator_functions()
    _bridge.landing_arm(0x2000, 4096, 0)
    mine = _bridge.landing_refused()
    seen = []
    t = threading.Thread(target=lambda: seen.append(alloc(64, 0, None)))
    t.start()
    t.join()
    assert seen == [None]                         # another thread's request: refused
    assert _bridge.landing_refused() == mine      # ... and counted as that thread's
    assert alloc(64, 0, None) == 0x2000
    _bridge.landing_disarm()


# --- sizes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("nbytes,segment", [
    (1, 2 << 20), (1 << 20, 2 << 20), ((1 << 20) + 1, 20 << 20), ((10 << 20) - 512, 20 << 20),
    (10 << 20, 10 << 20), ((10 << 20) + 1, 12 << 20), (2048 * 8448 * 4, 66 << 20), (33 << 20, 34 << 20),
])
def test_torch_segment_bytes(nbytes, segment):
    assert contracts.torch_segment_bytes(nbytes) == segment


def test_landing_rows_hold_the_whole_segment():
    rows, stride = contracts.mqa_logits_layout(2048, 64, 8192, 0)
    assert (rows, stride) == (2048, 8448)
    landed = contracts.landing_rows(rows, stride, 4, segmented=True)
    assert landed * stride * 4 >= contracts.torch_segment_bytes(rows * stride * 4)
    assert (landed - rows) * stride * 4 < (2 << 20) + stride * 4
    assert contracts.landing_rows(rows, stride, 4, segmented=False) == rows
    # below 10 MiB torch takes a 2 MiB (up to 1 MiB) or 20 MiB segment: the buffer covers it
    assert contracts.landing_rows(8, 512, 4, segmented=True) * 512 * 4 == 2 << 20
    assert contracts.landing_rows(64, 8192, 4, segmented=True) * 8192 * 4 == 20 << 20
    assert contracts.landing_rows(8, 512, 4, segmented=False) == 8


# --- through the ops ------------------------------------------------------------------------

def test_mqa_logits_land_on_cpu(keys):
    q = jax.random.normal(keys(), (8, 32, 64)).astype(jnp.float8_e4m3fn)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(keys(), (300, 64)))
    w = jax.random.normal(keys(), (8, 32))
    ks, ke = jax_dg.causal_ks_ke(8, 300)
    before = dict(landing.STATS)
    for width in (None, 320):
        f = jax.jit(lambda q, kv, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=width))
        out = np.asarray(f(q, kv, w, ks, ke))
        with jax_dg.use_backend("xla"):
            want = np.asarray(f(q, kv, w, ks, ke))
        assert np.array_equal(np.isinf(out), np.isinf(want))
        np.testing.assert_allclose(np.where(np.isinf(out), 0, out), np.where(np.isinf(want), 0, want),
                                   rtol=1e-5, atol=1e-4)
    assert landing.STATS["landed"] == before["landed"] + 2
    assert landing.STATS["copied"] == before["copied"]


# --- GPU: torch's MemPool route ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 256, 257, 2559, 2560, 2561, 16896, 16897])   # 2/20 MiB segments, 10 MiB, odd, 66 MiB
def test_gpu_torch_asks_for_the_predicted_segment_and_releases_it(rows):
    stride = 1024
    # XLA's memory, as in a custom call (a torch-allocated `out` would alias a block torch
    # already tracks at that address)
    keep = jnp.full((contracts.landing_rows(rows, stride, 4, True), stride), 7.0, jnp.float32)
    out = torch.from_dlpack(keep)
    before, stats = landing.counts(), dict(landing.STATS)
    for _ in range(3):
        landing.land(out, lambda: torch.zeros((rows, stride), device="cuda")[:rows - 1, :1000],
                     contracts.lands(rows, True), landing.into_cuda_pool)
    now = landing.counts()
    assert _bridge.landing_last_request() == contracts.torch_segment_bytes(rows * stride * 4)
    assert now["landed"] - before["landed"] == 3, "the allocation did not land"
    check_released(now["released"] - before["released"] == 3, "a landed segment stayed in a torch pool")
    assert now["refused"] == before["refused"]
    assert landing.STATS["landed"] - stats["landed"] == 3
    assert bool((out[:rows - 1, :1000] == 0).all()) and bool((out[rows:] == 7).all())
    # torch's own allocations afterwards never get XLA's buffer
    other = torch.empty((rows, stride), device="cuda")
    assert not (out.data_ptr() <= other.data_ptr() < out.data_ptr() + out.numel() * 4)
    del out, keep
