"""jax_dg's fused FP8 casts (jax_dg.ops.cast, kernels/cast_fp8.cu and its C++ twin) are bitwise
the separate quantisers they replace: jax_dg.operands.quant's formulas (bitwise DeepGEMM's) with the
MN-major layout and the transposes in XLA, and the op's pure-JAX reference; and bitwise
DeepGEMM's own torch quantisers on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from jax_dg.core import native
from jax_dg.ops import cast as product   # the quantisers
from jax_dg.operands.scales import MNMajor, mn_major_physical
from jax_dg.ops.cast import CAST_FP8, cast_blocks, cast_tokens
from tests.conftest import digest, run
from tests.operands.test_quant import KINDS, edge_input, jnp_bits

BF16, F32 = jnp.bfloat16, jnp.float32


def separate(x, use_ue8m0, per_block, valid=None):
    """What the fused cast replaces, for x [R, C]: today's quantisers, the scales' MN-major
    layout and the transposes, in XLA."""
    r = x.shape[0]
    if valid is not None:
        x = jnp.where(jnp.arange(r)[:, None] < valid, x, 0).astype(x.dtype)
    xt = jnp.pad(x, ((0, -(-r // 16) * 16 - r), (0, 0))).T
    if per_block:
        q, s = product.per_block_cast_to_fp8(x, use_ue8m0)
        return q, s, jnp.pad(q, ((0, xt.shape[1] - r), (0, 0))).T, s.T
    q, s = product.per_token_cast_to_fp8(x, use_ue8m0)
    qt, st = product.per_token_cast_to_fp8(xt, use_ue8m0)
    return q, mn_major_physical(s), qt, mn_major_physical(st)


def fused(x, use_ue8m0, per_block, valid=None):
    if per_block:
        (q, s), (qt, st) = cast_blocks(x, transposed=True, use_ue8m0=use_ue8m0)
        return q, s, qt, st
    (q, s), (qt, st) = cast_tokens(x, transposed=True, use_ue8m0=use_ue8m0, valid_rows=valid)
    return q, s.physical, qt, st.physical


def assert_bits(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_array_equal(jnp_bits(g), jnp_bits(w))


SHAPES = [(33, 208), (5, 16), (130, 1008), (128, 256), (1, 7168), (300, 272)]


@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fused_cast_is_bitwise_the_separate_quantisers(dtype, use_ue8m0, per_block):
    """Random, all-zero, tiny, huge and mixed-magnitude inputs; rows and columns off the
    128 grid (the transposed cast's rows padded to 16)."""
    rng = np.random.default_rng(3)
    f = jax.jit(lambda x: fused(x, use_ue8m0, per_block))
    g = jax.jit(lambda x: separate(x, use_ue8m0, per_block))
    for shape in SHAPES:
        if per_block and shape[0] % 16:
            continue
        for kind in KINDS:
            x = edge_input(kind, shape, dtype, rng)
            assert_bits(f(x), g(x))


@pytest.mark.parametrize("per_block", [False, True])
def test_native_is_bitwise_the_ops_reference(keys, per_block, cpu_device):
    """The C++ twin (what the CPU runs) against the op's pure-JAX reference (the xla backend)."""
    x = jax.random.normal(keys(), (3, 144, 400), F32).astype(BF16) * 5
    valid = None if per_block else jnp.array([0, 77, 500], jnp.int32)   # clamped to [0, R]
    call = lambda x, v: CAST_FP8(x, v, per_block=per_block, ue8m0=False, rows_out=True,   # noqa: E731
                                 cols_out=True)
    assert_bits(run("torch", call, x, valid), run("xla", call, x, valid))


def test_valid_rows_read_past_as_zero(keys):
    x = jax.random.normal(keys(), (2, 200, 256), BF16)
    valid = jnp.array([77, 200], jnp.int32)
    (q, s), (qt, st) = jax.jit(lambda x, v: cast_tokens(x, transposed=True, valid_rows=v))(x, valid)
    for b in range(2):
        assert_bits((q[b], s.physical[b], qt[b], st.physical[b]),
                    separate(x[b], False, False, valid=int(valid[b])))


def test_vmap_folds_into_one_launch(keys):
    x = jax.random.normal(keys(), (4, 64, 256), BF16)
    f = lambda x: cast_tokens(x, transposed=True)     # noqa: E731
    mapped = jax.jit(jax.vmap(f))
    assert_bits(jax.tree.leaves(mapped(x)), jax.tree.leaves(jax.jit(f)(x)))
    assert mapped.lower(x).as_text().count("jax_dg_native_cast_fp8") == 1


def test_rows_only_and_transposed_only(keys):
    x = jax.random.normal(keys(), (100, 384), BF16)
    rows, none = cast_tokens(x)
    assert none is None and isinstance(rows[1], MNMajor) and rows[1].mn == 100
    skip, cols = cast_tokens(x, transposed=True, rows=False)
    assert skip is None
    want = separate(x, False, False)
    assert_bits((rows[0], rows[1].physical, cols[0], cols[1].physical), want)
    np.testing.assert_array_equal(np.asarray(rows[1].logical()), np.asarray(product.per_token_cast_to_fp8(x)[1]))


def test_inputs_unwritten_and_repeats_identical(keys):
    x = jax.random.normal(keys(), (256, 512), F32)
    before = digest(x)
    f = jax.jit(lambda x: fused(x, False, False))
    first = f(x)
    for _ in range(3):
        assert_bits(f(x), first)
    assert digest(x) == before


def test_nan_blocks_stay_nan():
    x = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    x[3, 5] = np.nan
    q, s, qt, st = fused(jnp.asarray(x), False, False)
    assert np.isnan(np.asarray(s)[0, 3]) and not np.isnan(np.asarray(s)[1, 3])
    assert np.isnan(np.asarray(q[3, :128].astype(F32))).all() and not np.isnan(np.asarray(q[3, 128:].astype(F32))).any()
    assert np.isnan(np.asarray(st)[0, 5]) and np.isnan(np.asarray(qt[5].astype(F32))).all()


def test_bad_inputs_name_the_argument():
    with pytest.raises(jax_dg.ArgumentError, match=r"x.*C % 16"):
        cast_tokens(jnp.zeros((4, 200), BF16))
    with pytest.raises(jax_dg.ArgumentError, match=r"x.*float32 or bfloat16|x.*dtype"):
        cast_tokens(jnp.zeros((4, 256), jnp.float16))
    with pytest.raises(jax_dg.ArgumentError, match=r"x"):
        cast_tokens(jnp.zeros((256,), BF16))
    with pytest.raises(jax_dg.ArgumentError, match=r"valid_rows"):
        cast_tokens(jnp.zeros((2, 4, 256), BF16), valid_rows=jnp.zeros((3,), jnp.int32))
    with pytest.raises(jax_dg.ArgumentError, match=r"x.*R % 16"):
        cast_blocks(jnp.zeros((100, 256), BF16), transposed=True)
    with pytest.raises(jax_dg.ArgumentError, match=r"rows"):
        cast_tokens(jnp.zeros((4, 256), BF16), rows=False)


def test_gemms_take_mn_major_scales_as_they_are(keys):
    """fp8_gemm_nt and the masked grouped GEMM: MN-major scales give the logical path's bits,
    with no layout op in the program."""
    x = jax.random.normal(keys(), (96, 256), BF16)
    w = jax.random.normal(keys(), (128, 256), BF16)
    b = product.per_block_cast_to_fp8(w)
    got = jax.jit(lambda x: jax_dg.fp8_gemm_nt(cast_tokens(x)[0], b))(x)
    want = jax.jit(lambda x: jax_dg.fp8_gemm_nt(product.per_token_cast_to_fp8(x), b))(x)
    np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)))
    xg = jax.random.normal(keys(), (2, 128, 256), BF16)
    wg = jax.vmap(product.per_block_cast_to_fp8)(jax.random.normal(keys(), (2, 128, 256), BF16))
    mm = jnp.array([50, 128], jnp.int32)
    got = jax.jit(lambda x: jax_dg.m_grouped_fp8_gemm_nt_masked(cast_tokens(x)[0], wg, mm, 64))(xg)
    want = jax.jit(lambda x: jax_dg.m_grouped_fp8_gemm_nt_masked(
        jax.vmap(product.per_token_cast_to_fp8)(x), wg, mm, 64))(xg)
    np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)))
    with pytest.raises(jax_dg.ArgumentError, match=r"b\[1\].*MN-major"):
        jax_dg.fp8_gemm_nt(cast_tokens(x)[0], (b[0], MNMajor(mn_major_physical(b[1]), 1)))


def test_fp8_linear_step_runs_three_casts():
    """Backward: one fused cast of dy for both GEMMs (x's and w's were cast, transposed too,
    in the forward pass); forward alone: two casts, nothing transposed written."""
    import re
    x, w = jnp.zeros((256, 512), BF16), jnp.zeros((384, 512), BF16)
    step = jax.jit(lambda x, w: jax.vjp(jax_dg.fp8_linear, x, w)[1](jnp.ones((256, 384), BF16)))
    targets = lambda hlo: sorted(t.removesuffix("_graph") for t in re.findall(r"custom_call @(\w+)", hlo))  # noqa: E731
    calls = targets(step.lower(x, w).as_text())
    assert calls == ["jax_dg_fp8_gemm_nt"] * 2 + ["jax_dg_native_cast_fp8"] * 3   # y unused
    fwd = jax.jit(jax_dg.fp8_linear).lower(x, w).as_text()
    assert targets(fwd) == ["jax_dg_fp8_gemm_nt"] + ["jax_dg_native_cast_fp8"] * 2
    assert "cols_out = true" not in fwd


# --- GPU: the CUDA kernel -----------------------------------------------------------------------

GPU_SHAPES = [(4096, 7168), (4096, 2048), (7168, 2048), (4096, 2112), (33, 208), (1, 7168),
              (130, 1008), (24576, 1536)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_gpu_kernel_is_bitwise_deep_gemms_and_the_cpu_twins(keys, dtype, use_ue8m0):
    import torch
    from deep_gemm.utils.math import per_block_cast_to_fp8 as dg_block, per_token_cast_to_fp8 as dg_token
    from tests.conftest import on_cpu, to_torch
    assert native.cuda_built()
    rng = np.random.default_rng(5)
    for shape in GPU_SHAPES:
        for kind in KINDS:
            x = edge_input(kind, shape, dtype, rng) if shape[0] * shape[1] < 2 ** 22 else \
                jax.random.normal(keys(), shape, F32).astype(dtype) * 3
            for per_block in (False, True):
                if per_block and shape[0] % 16:
                    continue
                got = jax.jit(lambda x: fused(x, use_ue8m0, per_block))(x)
                assert_bits(got, jax.jit(lambda x: separate(x, use_ue8m0, per_block))(x))
                if shape[0] * shape[1] <= 2 ** 18:
                    cpu = [on_cpu(lambda x, i=i: fused(x, use_ue8m0, per_block)[i], x) for i in range(4)]
                    assert_bits(got, [jnp.asarray(c) for c in cpu])
                # DeepGEMM's own torch quantisers, on the GPU
                tq, ts = (dg_block if per_block else dg_token)(to_torch(x), use_ue8m0=use_ue8m0)
                np.testing.assert_array_equal(jnp_bits(got[0]), tq.view(torch.uint8).cpu().numpy())
                want_s = ts.cpu().numpy()
                got_s = np.asarray(got[1]) if per_block else np.asarray(got[1])[:, :shape[0]].T
                np.testing.assert_array_equal(got_s, want_s)
            if shape == GPU_SHAPES[0] and kind == "random":   # what XLA's GPU code of the formulas gives
                from jax_dg.reference import quant as oracle
                o = jax.jit(lambda x: oracle.per_token_cast_to_fp8(x, use_ue8m0))(x)[0]
                off = int((jnp_bits(o) != jnp_bits(fused(x, use_ue8m0, False)[0])).sum())
                print(f"{shape} {dtype.__name__ if hasattr(dtype, '__name__') else dtype} ue8m0={use_ue8m0}: "
                      f"the pure-JAX formulas on the GPU differ in {off} of {x.size} FP8 values")
            f = jax.jit(lambda x: fused(x, use_ue8m0, False))
            first = f(x)
            for _ in range(3):
                assert_bits(f(x), first)


@pytest.mark.gpu
def test_gpu_fp8_linear_grads_bitwise_the_separate_quantisers(keys):
    """fp8_linear's step on the fused casts gives the bits of the previous formulation
    (tests.ops.test_linear._old_linear: separate casts, transposes in XLA) run with the product
    quantisers (bitwise DeepGEMM's on the GPU), at a DeepSeek shape; the grouped layer too."""
    from tests.ops.test_linear import _old_grouped_linear, _old_linear, assert_bitwise
    x = jax.random.normal(keys(), (4096, 2048), BF16)
    w = (jax.random.normal(keys(), (7168, 2048), F32) * 0.02).astype(BF16)
    ct = jax.random.normal(keys(), (4096, 7168), BF16)
    step = lambda f: jax.jit(lambda x, w, ct: (lambda y, vjp: (y, *vjp(ct)))(*jax.vjp(f, x, w)))  # noqa: E731
    old = lambda x, w: _old_linear(x, w, quant=product)   # noqa: E731
    assert_bitwise(step(jax_dg.fp8_linear)(x, w, ct), step(old)(x, w, ct))
    xg = jax.random.normal(keys(), (4, 256, 1024), BF16)
    wg = (jax.random.normal(keys(), (4, 512, 1024), F32) * 0.02).astype(BF16)
    ctg = jax.random.normal(keys(), (4, 256, 512), BF16)
    mm = jnp.array([0, 77, 256, 130], jnp.int32)
    assert_bitwise(step(lambda x, w: jax_dg.fp8_grouped_linear(x, w, mm, 128))(xg, wg, ctg),
                   step(lambda x, w: _old_grouped_linear(x, w, mm, 128, quant=product))(xg, wg, ctg))


@pytest.mark.gpu
def test_gpu_kernel_small_cases_equal_the_cpu_twin(keys):
    """Small, odd and batched cases (partial tiles, rows past valid_rows, both dtypes, both
    modes, rows-only and transposed-only): the CUDA kernel against its C++ twin. Small enough
    for compute-sanitizer (memcheck, racecheck: scripts/sanitize.sh ... tests/ops/test_cast.py -k small)."""
    from tests.conftest import on_cpu
    for dtype in (BF16, F32):
        for shape, valid in (((1, 5, 16), None), ((3, 130, 272), [0, 129, 7]), ((2, 256, 1008), [256, 100]),
                             ((1, 33, 7168), None)):
            x = jax.random.normal(keys(), shape, F32).astype(dtype) * 4
            v = None if valid is None else jnp.asarray(valid, jnp.int32)
            for per_block, rows_out, cols_out in ((False, True, True), (False, True, False),
                                                  (False, False, True), (True, True, True), (True, True, False)):
                if per_block and (shape[1] % 16 or v is not None):
                    continue
                f = lambda x, v: CAST_FP8(x, v, per_block=per_block, ue8m0=False,   # noqa: E731
                                          rows_out=rows_out, cols_out=cols_out)
                got = jax.jit(f)(x, v)
                want = [on_cpu(lambda x, v, i=i: f(x, v)[i], x, v) for i in range(4)]
                assert_bits(got, [jnp.asarray(w) for w in want])


def test_mn_major_scales_add_no_layout_op_per_gemm(keys):
    """Issue 24's small-GEMM chain: scales cast MN-major feed fp8_gemm_nt with no transpose,
    pad or copy between the cast and the GEMM (logical scales get one layout fusion per GEMM)."""
    import re
    x = jax.random.normal(keys(), (64, 7168), BF16)
    b = product.per_block_cast_to_fp8(jax.random.normal(keys(), (2112, 7168), BF16))
    ops = lambda f: set(re.findall(r"stablehlo\.(\w+)", jax.jit(f).lower(x).as_text()))   # noqa: E731
    fused = ops(lambda x: jax_dg.fp8_gemm_nt(cast_tokens(x)[0], b))
    assert not fused & {"transpose", "pad", "concatenate"}, fused
    logical = ops(lambda x: jax_dg.fp8_gemm_nt(product.per_token_cast_to_fp8(x), b))
    assert {"transpose", "pad"} <= logical     # the layout pass MNMajor saves
