"""Scale-layout helpers against torch re-implementations of DeepGEMM's layout rules (CPU) and
against deep_gemm's own functions, bitwise (GPU)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_dg
from jax_dg.operands import scales as layout
from tests.conftest import to_torch


def cdiv(a, b):
    return -(-a // b)


def aligned(a, b):
    return cdiv(a, b) * b


# --- torch re-implementations of DeepGEMM's rules (csrc/jit_kernels/impls/smxx_layout.hpp,
#     tests/test_layout.py), returning the physical storage of DeepGEMM's strided result --------

def torch_mn_major_storage(sf: torch.Tensor) -> torch.Tensor:
    """get_mn_major_tma_aligned_tensor: empty_strided((B, MN, K'), (T K', 1, T)).copy_(sf);
    the storage (zero-initialised here) seen as [B, K', T]."""
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    b, mn, k = batched.shape
    t = aligned(mn, 4)
    storage = torch.zeros(b * k * t, dtype=sf.dtype)
    out = storage.as_strided((b, mn, k), (t * k, 1, t))
    out.copy_(batched)
    phys = storage.view(b, k, t)
    return phys[0] if sf.dim() == 2 else phys


def torch_packed_ue8m0_storage(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl; its storage
    [B, ceil(K'/4), align(MN, 4)] (padding rows zero, as in the torch emulation)."""
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    ue8m0 = (batched.view(torch.int32) >> 23).to(torch.uint8)
    b, mn, k = batched.shape
    amn, ak = aligned(mn, 4), aligned(k, 4)
    padded = torch.zeros((b, amn, ak), dtype=torch.uint8)
    padded[:, :mn, :k] = ue8m0
    padded = padded.view(-1).view(torch.int32).view(b, amn, ak // 4)
    transposed = torch.zeros((b, ak // 4, amn), dtype=torch.int32)
    transposed.mT[:, :, :] = padded
    return transposed[0] if sf.dim() == 2 else transposed


def torch_packed_logical(sf: torch.Tensor) -> torch.Tensor:
    storage = torch_packed_ue8m0_storage(sf)
    return storage[..., :sf.shape[-2]].mT


def pow2_scales(rng, shape):
    return np.exp2(rng.integers(-30, 10, shape)).astype(np.float32)


def assert_same(jax_array, torch_tensor):
    a = np.asarray(jax_array)
    b = torch_tensor.contiguous().numpy()
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert a.tobytes() == b.tobytes()


# DeepGEMM's enumerate_sf_layout shapes (mn 4096/4097, k 128/7168/7296, groups 1/2/4), trimmed,
# plus small odd ones.
SF_CASES = [(4096, 7168, 1), (4097, 7296, 2), (4097, 128, 4), (1, 256, 1), (5, 640, 3), (130, 7168, 1)]


@pytest.mark.parametrize("mn,k,groups", SF_CASES)
def test_mn_major_tma_aligned_tensor_matches_deep_gemm_rules(mn, k, groups):
    rng = np.random.default_rng(mn + k + groups)
    shape = (mn, cdiv(k, 128)) if groups == 1 else (groups, mn, cdiv(k, 128))
    sf = rng.standard_normal(shape).astype(np.float32)
    out = jax_dg.get_col_major_tma_aligned_tensor(jnp.asarray(sf))
    assert_same(out, torch_mn_major_storage(torch.from_numpy(sf)))
    assert out.shape[-1] == aligned(mn, 4) and out.shape[-2] == shape[-1]
    np.testing.assert_array_equal(np.asarray(jax_dg.mn_major_logical(out, mn)), sf)
    assert_same(jax_dg.get_mn_major_tma_aligned_tensor(jnp.asarray(sf)), torch_mn_major_storage(torch.from_numpy(sf)))


@pytest.mark.parametrize("mn,k,groups", SF_CASES)
def test_packed_ue8m0_tensor_matches_deep_gemm_torch_impl(mn, k, groups):
    rng = np.random.default_rng(mn * 3 + k + groups)
    shape = (mn, cdiv(k, 128)) if groups == 1 else (groups, mn, cdiv(k, 128))
    sf = pow2_scales(rng, shape)
    out = jax_dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(jnp.asarray(sf))
    assert_same(out, torch_packed_ue8m0_storage(torch.from_numpy(sf)))
    assert out.dtype == jnp.int32 and out.shape[-2:] == (cdiv(shape[-1], 4), aligned(mn, 4))
    # Each byte is the exponent of one scale; jax_dg.pack_ue8m0_to_int packs the same way
    logical = np.asarray(jax_dg.mn_major_logical(out, mn))
    padded = np.pad(sf, [(0, 0)] * (sf.ndim - 1) + [(0, aligned(shape[-1], 4) - shape[-1])])
    np.testing.assert_array_equal(logical, np.asarray(jax_dg.pack_ue8m0_to_int(jnp.asarray(padded))))


def test_packed_ue8m0_under_jit_equals_eager():
    sf = pow2_scales(np.random.default_rng(0), (2, 77, 9))
    f = jax.jit(jax_dg.get_mn_major_tma_aligned_packed_ue8m0_tensor)
    np.testing.assert_array_equal(np.asarray(f(sf)), np.asarray(jax_dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)))


def test_ceil_to_ue8m0_and_pack_are_quants():
    assert jax_dg.ceil_to_ue8m0 is jax_dg.operands.quant.ceil_to_ue8m0 is layout.ceil_to_ue8m0
    assert jax_dg.pack_ue8m0_to_int is jax_dg.operands.quant.pack_ue8m0_to_int
    x = np.array([[0.3, 1.0, 3.0, 1e-30]], np.float32)
    ref_bits = (torch.from_numpy(x).view(torch.int32))
    exp = ((ref_bits >> 23) & 0xFF) + (ref_bits & 0x7FFFFF).bool().int()
    ref = (exp.clamp(1, 254) << 23).view(torch.float32)
    np.testing.assert_array_equal(np.asarray(jax_dg.ceil_to_ue8m0(jnp.asarray(x))), ref.numpy())


# DeepGEMM's enumerate_k_grouped_sf_layout: mn 4096/7168, (groups, avg k) pairs, trimmed
K_GROUPED_CASES = [(4096, (16, 2048), 128), (1024, (72, 384), 128), (256, (128, 256), 128),
                   (512, (5, 256), 32)]


@pytest.mark.parametrize("mn,groups_avg_k,gran_k", K_GROUPED_CASES)
def test_k_grouped_packed_ue8m0_matches_deep_gemm_reference(mn, groups_avg_k, gran_k):
    g, avg_k = groups_avg_k
    rng = np.random.default_rng(mn + g)
    ks = [aligned(int(avg_k * rng.uniform(0.7, 1.3)), gran_k) for _ in range(g)]
    ks[g // 2] = 0  # an empty group
    sf = pow2_scales(rng, (sum(ks) // gran_k, mn))
    pack = jax.jit(lambda sf, kt: jax_dg.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(sf, kt, ks, gran_k))
    out = pack(jnp.asarray(sf), jnp.asarray(ks, jnp.int32))
    packed_ks = [cdiv(k, gran_k * 4) for k in ks]
    assert out.shape == (sum(packed_ks), mn) and out.dtype == jnp.int32
    parts = torch.from_numpy(np.array(out)).split(packed_ks)
    for i, (part, sf_g) in enumerate(zip(parts, torch.from_numpy(sf).split([k // gran_k for k in ks]))):
        assert torch.equal(part, torch_packed_logical(sf_g.T).T), f"group {i}"


@pytest.mark.parametrize("mn,k,groups,recipe,is_sfa,arch", [
    (300, 7168, None, (1, 128, 128), True, "sm90"),     # SFA: MN-major, TMA-aligned
    (300, 7168, 2, (1, 128, 128), True, "sm90"),
    (512, 7168, None, (1, 128, 128), False, "sm90"),    # SFB 128 x 128: unchanged
    (129, 512, 2, (1, 1, 32), False, "sm100"),          # DeepGEMM's test: packed UE8M0
    (129, 512, 2, (1, 1, 128), False, "sm100"),
    (256, 1024, None, (1, 128, 128), False, "sm100"),   # SFB 128 x 128: rows broadcast, packed
    (257, 1024, None, (128, 128), None, "sm120"),
])
def test_transform_sf_into_required_layout_follows_deep_gemms_rules(mn, k, groups, recipe, is_sfa, arch):
    gran_mn = (recipe[0] if is_sfa else recipe[1]) if len(recipe) == 3 else recipe[0]
    gran_k = recipe[-1]
    shape = (cdiv(mn, gran_mn), cdiv(k, gran_k))
    shape = shape if groups is None else (groups, *shape)
    sf = pow2_scales(np.random.default_rng(mn), shape)
    out = jax_dg.transform_sf_into_required_layout(jnp.asarray(sf), mn, k, recipe, groups, is_sfa, arch=arch)
    t = torch.from_numpy(sf)
    if arch == "sm90":
        expected = torch_mn_major_storage(t) if gran_mn == 1 else t
    else:
        broadcast = t if gran_mn == 1 else t.index_select(-2, torch.arange(mn) // gran_mn)
        expected = torch_packed_ue8m0_storage(broadcast)
    assert_same(out, expected)
    if arch != "sm90":  # DeepGEMM's test: an already packed tensor passes through
        logical = jax_dg.mn_major_logical(out, mn)
        again = jax_dg.transform_sf_into_required_layout(logical, mn, k, (1, gran_k), groups, arch=arch)
        np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
    disabled = jax_dg.transform_sf_into_required_layout(jnp.asarray(sf), mn, k, recipe, groups, is_sfa,
                                                        disable_ue8m0_cast=True, arch=arch) \
        if gran_k == 128 and gran_mn in (1, 128) else None
    if disabled is not None:
        assert_same(disabled, torch_mn_major_storage(t) if gran_mn == 1 else t)


@pytest.mark.parametrize("case,fn,arg", [
    ("dtype", "get_mn_major_tma_aligned_tensor", "sf"),
    ("rank", "get_mn_major_tma_aligned_packed_ue8m0_tensor", "sf"),
    ("kg_mn", "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor", "sf"),
    ("kg_rows", "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor", "sf"),
    ("kg_gran", "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor", "ks"),
    ("tf_shape", "transform_sf_into_required_layout", "sf"),
    ("tf_is_sfa", "transform_sf_into_required_layout", "is_sfa"),
    ("tf_recipe", "transform_sf_into_required_layout", "recipe"),
    ("tf_sm90_int", "transform_sf_into_required_layout", "sf"),
    ("tf_sm90_gran32", "transform_sf_into_required_layout", "sf"),
])
def test_bad_inputs_name_the_argument(case, fn, arg):
    sf = jnp.ones((64, 8), jnp.float32)
    call = {
        "dtype": lambda: jax_dg.get_mn_major_tma_aligned_tensor(sf.astype(jnp.bfloat16)),
        "rank": lambda: jax_dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf[0]),
        "kg_mn": lambda: jax_dg.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(sf[:, :6], None, [1024], 128),
        "kg_rows": lambda: jax_dg.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(sf, None, [1024], 128),
        "kg_gran": lambda: jax_dg.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(sf, None, [8100], 128),
        "tf_shape": lambda: jax_dg.transform_sf_into_required_layout(sf, 64, 2048, (1, 128, 128), None, True, arch="sm90"),
        "tf_is_sfa": lambda: jax_dg.transform_sf_into_required_layout(sf, 64, 1024, (1, 128, 128), arch="sm90"),
        "tf_recipe": lambda: jax_dg.transform_sf_into_required_layout(sf, 64, 1024, (1,), arch="sm90"),
        "tf_sm90_int": lambda: jax_dg.transform_sf_into_required_layout(
            jnp.ones((64, 2), jnp.int32), 64, 1024, (1, 128), arch="sm90"),
        "tf_sm90_gran32": lambda: jax_dg.transform_sf_into_required_layout(
            jnp.ones((64, 32), jnp.float32), 64, 1024, (1, 32), arch="sm90"),
    }[case]
    with pytest.raises(jax_dg.ArgumentError, match=re.escape(f"{fn}: `{arg}`")):
        call()


def test_tma_aligned_size():
    assert [jax_dg.get_tma_aligned_size(x, 4) for x in (1, 4, 5, 4097)] == [4, 4, 8, 4100]
    assert jax_dg.get_tma_aligned_size(3, 1) == 16 and jax_dg.get_tma_aligned_size(9, 2) == 16
    with pytest.raises(ValueError):
        jax_dg.get_tma_aligned_size(3, 3)


# --- GPU: bitwise against deep_gemm's own functions --------------------------------------------

def _dg_storage(t: torch.Tensor, mn: int) -> np.ndarray:
    """The logical part [..., K', :MN] of a DeepGEMM MN-major tensor's storage."""
    return t.transpose(-1, -2).contiguous().cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("mn,k,groups", [(4096, 7168, 1), (4097, 7296, 2), (8192, 128, 4), (4097, 7168, 1)])
@pytest.mark.parametrize("with_transpose", [True, False])
def test_gpu_layouts_match_deep_gemm_bitwise(mn, k, groups, with_transpose):
    import deep_gemm
    x = jax.random.normal(jax.random.PRNGKey(mn + k), (groups * mn, k), jnp.bfloat16)
    for use_ue8m0 in (False, True):
        _, sf = jax_dg.per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
        sf = sf if groups == 1 else sf.reshape(groups, mn, -1)
        tsf = to_torch(sf)
        if not with_transpose:  # DeepGEMM's test: an MN-major (non-contiguous) input too
            tsf = tsf.transpose(-1, -2).contiguous().transpose(-1, -2)
        if use_ue8m0:
            ours = jax_dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
            theirs = deep_gemm.get_mn_major_tma_aligned_packed_ue8m0_tensor(tsf)
        else:
            ours = jax_dg.get_mn_major_tma_aligned_tensor(sf)
            theirs = deep_gemm.get_mn_major_tma_aligned_tensor(tsf)
        torch.cuda.synchronize()
        t_al = aligned(mn, 4)
        assert theirs.stride()[-2:] == (1, t_al)
        np.testing.assert_array_equal(np.asarray(ours)[..., :mn], _dg_storage(theirs, mn))
        assert (np.asarray(ours)[..., mn:] == 0).all()
        assert np.asarray(jax_dg.mn_major_logical(ours, mn)).tobytes() == theirs.contiguous().cpu().numpy().tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("mn,recipe,is_sfa", [(300, (1, 128, 128), True), (4096, (1, 128, 128), False)])
def test_gpu_transform_sf_matches_deep_gemm(mn, recipe, is_sfa):
    import deep_gemm
    from jax_dg.core.device import family as arch_family
    k = 7168
    gran_mn = recipe[0] if is_sfa else recipe[1]
    # powers of two: SM100 packs them into UE8M0 bytes
    sf = jnp.asarray(pow2_scales(np.random.default_rng(1), (cdiv(mn, gran_mn), k // 128)))
    ours = jax_dg.transform_sf_into_required_layout(sf, mn, k, recipe, None, is_sfa)
    theirs = deep_gemm.transform_sf_into_required_layout(to_torch(sf), mn, k, recipe, None, is_sfa)
    torch.cuda.synchronize()
    if arch_family() == "sm90" and gran_mn == 1:
        np.testing.assert_array_equal(np.asarray(ours)[..., :mn], _dg_storage(theirs, mn))
    elif arch_family() == "sm90":
        assert np.asarray(ours).tobytes() == theirs.contiguous().cpu().numpy().tobytes()
    else:
        np.testing.assert_array_equal(np.asarray(jax_dg.mn_major_logical(ours, mn)), theirs.cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("mn,g,avg_k", [(4096, 16, 2048), (7168, 8, 4096), (4096, 72, 384)])
def test_gpu_k_grouped_packing_matches_deep_gemm(mn, g, avg_k):
    import deep_gemm
    rng = np.random.default_rng(g)
    ks = [aligned(int(avg_k * rng.uniform(0.7, 1.3)), 128) for _ in range(g)]
    sf = jnp.asarray(pow2_scales(rng, (sum(ks) // 128, mn)))
    ks_tensor = jnp.asarray(ks, jnp.int32)
    ours = jax_dg.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(sf, ks_tensor, ks, 128)
    fn = deep_gemm.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor
    try:
        try:
            theirs = fn(to_torch(sf), to_torch(ks_tensor), ks, 128)           # 2.5: (sf, ks_tensor, ks, gran_k)
        except TypeError:
            theirs = fn(to_torch(sf), to_torch(ks_tensor), ks, 128, 128)      # newer: + k_alignment
        torch.cuda.synchronize()
    except RuntimeError as e:  # DeepGEMM asserts SM100 for this packer in some builds
        pytest.skip(f"deep_gemm's k-grouped packer does not run here: {str(e).splitlines()[0]}")
    assert np.asarray(ours).tobytes() == theirs.contiguous().cpu().numpy().tobytes()
