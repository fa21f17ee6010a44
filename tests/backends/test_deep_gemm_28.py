"""jax_dg's functions on DeepGEMM 2.8's API, on a CPU: the torch emulation presenting 2.8
(jax_dg.backends.emulated.presenting; its strict signatures, torch_emu/v28.py) against the same
calls on 2.5's API. Where 2.8 dropped what a function offers, the trace composes it from what 2.8
has (the full logits form, bfloat16 logits, skip_head_mid) with the same results, or refuses it
while tracing, naming the release (16 heads, paged next_n 4, 32-token blocks, the varlen form on
SM90)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.backends import emulated
from jax_dg.core import device
from tests.backends import standins
from tests.conftest import run
from tests.ops.test_mqa import make_inputs, varied_ranges
from tests.ops.test_paged_mqa import make_case

BF16 = jnp.bfloat16


def both(fn, *args):
    """fn's results under jit on 2.5's and on 2.8's API (the torch emulation), as numpy."""
    out = {}
    for version in ("2.5", "2.8"):
        with emulated.presenting(version):
            assert device.target().version == tuple(int(x) for x in version.split("."))
            res = run("torch", fn, *args)
        out[version] = [np.asarray(r) for r in (res if isinstance(res, (tuple, list)) else (res,))]
    return out["2.5"], out["2.8"]


def bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("width", [None, 300])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
@pytest.mark.parametrize("clean", [True, False])
def test_mqa_logits_on_28_equal_25(keys, width, dtype, clean):
    """2.8 writes only the compressed form, in float32, its tail uncleaned: the full form is
    gathered from one N wide and bfloat16 rounded after; every valid position bitwise as on 2.5,
    the -inf mask exact."""
    q, kv, w = make_inputs(keys, 48, 500, 32, 64)
    ks, ke = varied_ranges(keys, 48, 500)
    if width:
        ke = jnp.minimum(ke, ks + width)
    f = lambda *a: jax_dg.mqa_logits(*a, max_seqlen_k=width, logits_dtype=dtype,  # noqa: E731
                                     clean_logits=clean)
    (a,), (b,) = both(f, q, kv, w, ks, ke)
    if clean:
        bits_equal(a, b)
    else:   # only the valid positions are defined
        pos = np.arange(a.shape[1])[None, :]
        ks_, ke_ = np.asarray(ks)[:, None], np.asarray(ke)[:, None]
        valid = pos < ke_ - ks_ if width else (pos >= ks_) & (pos < ke_)
        bits_equal(a[valid], b[valid])


@pytest.mark.parametrize("width", [None, 256])
def test_indexer_topk_on_28_equal_25(keys, width):
    """The indexer reads the compressed form 2.8 writes directly (no gather): the same indices."""
    q, kv, w = make_inputs(keys, 40, 600, 64, 128)
    ks, ke = varied_ranges(keys, 40, 600)
    if width:
        ke = jnp.minimum(ke, ks + width)
    f = lambda *a: jax_dg.indexer_topk(*a, 32, max_seqlen_k=width)  # noqa: E731
    (a,), (b,) = both(f, q, kv, w, ks, ke)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_paged_logits_on_28_equal_25(next_n, dtype):
    q, cache, w, lens, table = make_case([1, 64, 65, 200], next_n, 32, 64, 64, two_d=True)
    f = lambda *a: jax_dg.paged_mqa_logits(a[0], *a[1:], max_model_len=256,  # noqa: E731
                                           logits_dtype=dtype)
    (a,), (b,) = both(f, q, cache, w, lens, table)
    bits_equal(a, b)


def test_skip_head_mid_on_28_composes_it(keys):
    """2.8 removed fp8_gemm_nt_skip_head_mid: fp8_gemm_nt, then its columns around each head's
    middle, the middle columns of d kept."""
    x = jax.random.normal(keys(), (64, 256), BF16)
    y = jax.random.normal(keys(), (256, 256), BF16)
    d = jax.random.normal(keys(), (64, 256 + 2 * 64), BF16)
    a, b = jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(y)
    f = lambda a, b, d: jax_dg.fp8_gemm_nt_skip_head_mid(a, b, (64, 64, 64), d=d)  # noqa: E731
    (r25,), (r28,) = both(f, a, b, d)
    bits_equal(r25, r28)
    np.testing.assert_array_equal(r28.reshape(64, 2, 192)[:, :, 64:128].view(np.uint16),
                                  np.asarray(d).reshape(64, 2, 192)[:, :, 64:128].view(np.uint16))


@emulated.presenting("2.8")
def test_what_28_cannot_do_raises_while_tracing(keys):
    q, kv, w = make_inputs(keys, 16, 300, 16, 64)
    ks, ke = varied_ranges(keys, 16, 300)
    with pytest.raises(jax_dg.ArgumentError, match=r"`q\[0\]`.*\(32, 64\).*DeepGEMM 2\.8"):
        jax.jit(jax_dg.mqa_logits).trace(q, kv, w, ks, ke)
    q4, cache, w4, lens, table = make_case([70, 90], 4, 32, 64, 64, two_d=True)
    with pytest.raises(jax_dg.ArgumentError, match=r"next_n in \(1, 2\) on sm90 \(DeepGEMM 2\.8\)"):
        jax.jit(lambda *a: jax_dg.paged_mqa_logits(*a)).trace(q4, cache, w4, lens, table)
    q1, cache32, w1, lens1, table32 = make_case([70, 90], 1, 32, 64, 32, two_d=True)
    with pytest.raises(jax_dg.ArgumentError, match=r"kv_cache.*\(64,\).*DeepGEMM 2\.8"):
        jax.jit(lambda *a: jax_dg.paged_mqa_logits(*a)).trace(q1, cache32, w1, lens1, table32)


def test_the_emulation_presents_28s_signatures():
    """What the bridge calls on 2.8's API is 2.8's: the strict stand-in signatures agree."""
    from jax_dg.backends.torch_emu import v28
    import inspect
    for name in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "einsum",
                 "k_grouped_fp8_gemm_nt_contiguous"):
        want = list(inspect.signature(standins.DEEP_GEMM_28[name]).parameters)
        assert list(inspect.signature(getattr(v28, name)).parameters) == want, name
    assert not hasattr(v28, "fp8_gemm_nt_skip_head_mid")
    with pytest.raises(ValueError, match="2.5, 2.8"):
        with emulated.presenting("2.7"):
            pass
