"""compiled_dims on every DeepGEMM call that takes it (issue 12): the GEMM dims compiled into
the kernel as constants, which changes speed, never results. CPU: each op's result with a
chosen compiled_dims is bitwise the default's, the choice reaches the call site, bad values
raise at trace time naming the argument. GPU: each op with compiled_dims='mnk' is bitwise
equal to deep_gemm called from torch with the same compiled_dims, 5 repeats identical."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from tests.conftest import run, same_bits, to_torch
from tests.ops.test_gemm import bf16_inputs, make_inputs, store
from tests.ops.test_grouped import cast_a, cast_b, contiguous_layout, k_grouped_inputs
from tests.ops.test_grouped_layouts import k_bf16_inputs, psum_of

BF16 = jnp.bfloat16
F32 = jnp.float32
SPLITS = (128, 64, 128)   # DeepGEMM's skip_head_mid case
KS = [256, 0, 384, 128]


def _pair(p):
    return to_torch(p[0]), to_torch(p[1])


# Each case: (keys, gpu) -> (fn(*arrays, compiled_dims), arrays, torch(dg, torch_arrays, dims) ->
# deep_gemm's output, rows: a numpy mask over d's first axis that deep_gemm defines, or None).

def _fp8_gemm(keys, gpu):
    m, n, k = (256, 4096, 7168) if gpu else (64, 128, 256)
    _, _, a, b = make_inputs(keys, m, n, k)
    fn = lambda a, b, dims: jax_dg.fp8_gemm_nt(a, b, compiled_dims=dims)  # noqa: E731

    def torch_call(dg, dims):
        import torch
        d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        dg.fp8_gemm_nt(_pair(a), _pair(b), d, compiled_dims=dims)
        return d
    return fn, (a, b), torch_call, None


def _skip_head_mid(keys, gpu):
    m, n, k = (128, 8192, 512) if gpu else (32, 512, 256)
    _, _, a, b = make_inputs(keys, m, n, k)
    d0 = jax.random.normal(keys(), (m, n + n // 256 * 64), BF16)
    fn = lambda a, b, d, dims: jax_dg.fp8_gemm_nt_skip_head_mid(a, b, SPLITS, d=d, compiled_dims=dims)  # noqa: E731

    def torch_call(dg, dims):
        d = to_torch(d0).clone()
        dg.fp8_gemm_nt_skip_head_mid(_pair(a), _pair(b), d, SPLITS, compiled_dims=dims)
        return d
    return fn, (a, b, d0), torch_call, None


def _bf16_gemm(storage):
    def case(keys, gpu):
        m, n, k = (256, 4096, 4096) if gpu else (64, 128, 256)
        a, b = store(storage, *bf16_inputs(keys, m, n, k))
        op = getattr(jax_dg, f"bf16_gemm_{storage}")
        fn = lambda a, b, dims: op(a, b, compiled_dims=dims)  # noqa: E731

        def torch_call(dg, dims):
            import torch
            d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            getattr(dg, f"bf16_gemm_{storage}")(to_torch(a), to_torch(b), d, compiled_dims=dims)
            return d
        return fn, (a, b), torch_call, None
    return case


MS = [130, 0, 57, 128]   # the m-grouped cases' rows per group (uneven, one empty)


def _grouped_rows(keys, gpu):
    """(ids, x, n, k) of the m-grouped contiguous cases: per-row group ids of MS, a [M, K]."""
    n, k = (4096, 4096) if gpu else (64, 192)
    ids = contiguous_layout(MS)
    return ids, jax.random.normal(keys(), (ids.shape[0], k), BF16), n, k


def _contiguous(fp8, psum):
    def case(keys, gpu):
        ids, x, n, k = _grouped_rows(keys, gpu)
        w = jax.random.normal(keys(), (len(MS), n, k), BF16)
        a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
        layout = jnp.asarray(psum_of(MS) if psum else ids)
        op = jax_dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else jax_dg.m_grouped_bf16_gemm_nt_contiguous
        fn = lambda a, b, l, dims: op(a, b, l, use_psum_layout=psum, compiled_dims=dims)  # noqa: E731

        def torch_call(dg, dims):
            import torch
            d = torch.empty((ids.shape[0], n), dtype=torch.bfloat16, device="cuda")
            kw = dict(use_psum_layout=True) if psum else {}
            if fp8:
                dg.m_grouped_fp8_gemm_nt_contiguous(_pair(a), _pair(b), d, to_torch(layout), compiled_dims=dims, **kw)
            else:
                dg.m_grouped_bf16_gemm_nt_contiguous(to_torch(a), to_torch(b), d, to_torch(layout),
                                                     compiled_dims=dims, **kw)
            return d
        return fn, (a, b, layout), torch_call, ids >= 0
    return case


def _bf16_nn(keys, gpu):
    ids, x, n, k = _grouped_rows(keys, gpu)
    wn = jax.random.normal(keys(), (len(MS), k, n), BF16)
    fn = lambda x, wn, l, dims: jax_dg.m_grouped_bf16_gemm_nn_contiguous(x, wn, l, compiled_dims=dims)  # noqa: E731

    def torch_call(dg, dims):
        import torch
        d = torch.empty((ids.shape[0], n), dtype=torch.bfloat16, device="cuda")
        dg.m_grouped_bf16_gemm_nn_contiguous(to_torch(x), to_torch(wn), d, to_torch(jnp.asarray(ids)),
                                             compiled_dims=dims)
        return d
    return fn, (x, wn, jnp.asarray(ids)), torch_call, ids >= 0


def _masked(fp8):
    def case(keys, gpu):
        g, max_m, n, k = (4, 256, 4096, 4096) if gpu else (4, 128, 64, 192)
        masked_np = np.asarray([100, 0, max_m, 37], np.int32)
        x = jax.random.normal(keys(), (g, max_m, k), BF16)
        w = jax.random.normal(keys(), (g, n, k), BF16)
        a, b = (cast_a(x), cast_b(w)) if fp8 else (x, w)
        op = jax_dg.m_grouped_fp8_gemm_nt_masked if fp8 else jax_dg.m_grouped_bf16_gemm_nt_masked
        fn = lambda a, b, mm, dims: op(a, b, mm, 64, compiled_dims=dims)  # noqa: E731

        def torch_call(dg, dims):
            import torch
            d = torch.empty((g, max_m, n), dtype=torch.bfloat16, device="cuda")
            mm = to_torch(jnp.asarray(masked_np))
            if fp8:
                dg.m_grouped_fp8_gemm_nt_masked(_pair(a), _pair(b), d, mm, 64, compiled_dims=dims)
            else:
                dg.m_grouped_bf16_gemm_nt_masked(to_torch(a), to_torch(b), d, mm, 64, compiled_dims=dims)
            return d
        rows = np.arange(max_m)[None, :] < masked_np[:, None]
        return fn, (a, b, jnp.asarray(masked_np)), torch_call, rows
    return case


def _k_grouped_fp8(keys, gpu):
    m, n = (512, 1024) if gpu else (64, 96)
    a, b, _, _ = k_grouped_inputs(keys, KS, m, n)
    c = jax.random.normal(keys(), (len(KS), m, n), F32)
    fn = lambda a, b, c, dims: jax_dg.k_grouped_fp8_gemm_nt_contiguous(a, b, KS, c=c, compiled_dims=dims)  # noqa: E731

    def torch_call(dg, dims):
        import torch
        d = to_torch(c).clone()
        dg.k_grouped_fp8_gemm_nt_contiguous((to_torch(a[0]), to_torch(a[1]).T), (to_torch(b[0]), to_torch(b[1]).T),
                                            d, KS, torch.tensor(KS, dtype=torch.int32, device="cuda"), c=d,
                                            compiled_dims=dims)
        return d
    return fn, (a, b, c), torch_call, None


def _k_grouped_bf16(keys, gpu):
    m, n = (512, 1024) if gpu else (64, 72)
    a, b, c = k_bf16_inputs(keys, KS, m, n)
    fn = lambda a, b, c, dims: jax_dg.k_grouped_bf16_gemm_tn_contiguous(a, b, KS, c=c, compiled_dims=dims)  # noqa: E731

    def torch_call(dg, dims):
        import torch
        d = to_torch(c).clone()
        dg.k_grouped_bf16_gemm_tn_contiguous(to_torch(a), to_torch(b), d, KS,
                                             torch.tensor(KS, dtype=torch.int32, device="cuda"), d,
                                             compiled_dims=dims)
        return d
    return fn, (a, b, c), torch_call, None


CASES = {
    "fp8_gemm_nt": _fp8_gemm, "fp8_gemm_nt_skip_head_mid": _skip_head_mid,
    **{f"bf16_gemm_{s}": _bf16_gemm(s) for s in ("nt", "nn", "tn", "tt")},
    "m_grouped_fp8_gemm_nt_contiguous": _contiguous(True, False),
    "m_grouped_fp8_gemm_nt_contiguous_psum": _contiguous(True, True),
    "m_grouped_bf16_gemm_nt_contiguous": _contiguous(False, False),
    "m_grouped_bf16_gemm_nt_contiguous_psum": _contiguous(False, True),
    "m_grouped_bf16_gemm_nn_contiguous": _bf16_nn,
    "m_grouped_fp8_gemm_nt_masked": _masked(True), "m_grouped_bf16_gemm_nt_masked": _masked(False),
    "k_grouped_fp8_gemm_nt_contiguous": _k_grouped_fp8, "k_grouped_bf16_gemm_tn_contiguous": _k_grouped_bf16,
}


def _with(fn, dims):
    return lambda *xs: fn(*xs, dims)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_dims_change_nothing_and_reach_the_call(keys, name):
    fn, arrays, _, _ = CASES[name](keys, gpu=False)
    base = run("auto", _with(fn, None), *arrays)
    for dims in ("mnk", "k", ""):
        assert bool(same_bits(run("auto", _with(fn, dims), *arrays), base)), dims
    with jax_dg.use_backend("torch"):
        hlo = jax.jit(_with(fn, "mnk")).lower(*arrays).as_text()
    # the site attribute holds the statics as JSON (quotes escaped as \22 in the HLO text)
    assert '"compiled_dims":"mnk"' in hlo.replace("\\22", '"'), "compiled_dims did not reach the call"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("bad", ["nx", "nn", 3, ["m"]])
def test_bad_compiled_dims_name_the_argument(keys, name, bad):
    fn, arrays, _, _ = CASES[name](keys, gpu=False)
    op = name.removesuffix("_psum")
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"{op}: `compiled_dims`")):
        jax.jit(_with(fn, bad)).trace(*arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_compiled_dims_match_deep_gemm_from_torch(keys, name):
    """compiled_dims='mnk' (every dim a kernel constant; JAX shapes are static anyway): bitwise
    equal to deep_gemm from torch with the same compiled_dims on the rows it defines."""
    import deep_gemm
    import torch
    fn, arrays, torch_call, rows = CASES[name](keys, gpu=True)
    f = jax.jit(_with(fn, "mnk"))
    d = jax.block_until_ready(f(*arrays))
    d_t = torch_call(deep_gemm, "mnk")
    torch.cuda.synchronize()
    ours = to_torch(d)
    if rows is not None:
        mask = torch.from_numpy(np.asarray(rows)).cuda()
        ours, d_t = ours[mask], d_t[mask]
    as_int = (lambda t: t.view(torch.int16)) if d_t.dtype == torch.bfloat16 else (lambda t: t.view(torch.int32))
    assert torch.equal(as_int(ours), as_int(d_t)), "differs from deep_gemm's"
    assert all(bool(same_bits(f(*arrays), d)) for _ in range(5))
