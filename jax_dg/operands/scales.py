"""DeepGEMM's scale-factor layouts (where a kernel wants its scales, and how they are stored).

JAX arrays have no strides, so where DeepGEMM returns a strided tensor these functions return
its *physical buffer*: an array whose row-major memory is the storage DeepGEMM's tensor views.
DeepGEMM's MN-major, TMA-aligned scale tensors of logical shape [..., MN, K'] live in a buffer
P[..., K', align(MN, 4)] with `sf == P[..., :MN].swapaxes(-1, -2)` (`mn_major_logical` gives
that view back). DeepGEMM leaves the padding columns MN..align(MN, 4) uninitialised; here
they are 0. Contiguous results (k-grouped packing, 128 x 128 SFB) are returned as they are.

The functions are pure jax.numpy (jittable; every size argument is a static Python int).
On a GPU the `@pytest.mark.gpu` tests check them bitwise against deep_gemm's own.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_dg import numerics
from jax_dg.contracts import align, cdiv
from jax_dg.core import device
from jax_dg.core.checks import Checker

__all__ = [
    "ceil_to_ue8m0", "pack_ue8m0_to_int", "get_tma_aligned_size", "mn_major_logical",
    "get_mn_major_tma_aligned_tensor", "get_col_major_tma_aligned_tensor",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor", "transform_sf_into_required_layout",
    "MNMajor",
]

F32 = jnp.float32


def ceil_to_ue8m0(x: jax.Array) -> jax.Array:
    """Rounds |x| (float32) up to the next power of two, as DeepGEMM's UE8M0 scales do."""
    Checker("ceil_to_ue8m0").floating(x, "x")
    return numerics.ceil_to_ue8m0(x)


def pack_ue8m0_to_int(x: jax.Array) -> jax.Array:
    """Packs 4 power-of-two float32 scales (last axis) into one int32 of exponent bytes."""
    ck = Checker("pack_ue8m0_to_int")
    ck.dtype(x, "x", jnp.float32)
    ck.that(len(x.shape) >= 1 and x.shape[-1] % 4 == 0, "x", "must have a last axis divisible by 4",
            tuple(x.shape))
    return _pack_ue8m0(x)


def _pack_ue8m0(x: jax.Array) -> jax.Array:
    """The exponent byte of each scale, four to an int32 (first scale in the low byte)."""
    exps = (jax.lax.bitcast_convert_type(x, jnp.int32) >> 23).astype(jnp.uint8)
    exps = exps.reshape(*x.shape[:-1], x.shape[-1] // 4, 4)
    return jax.lax.bitcast_convert_type(exps, jnp.int32)


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """DeepGEMM's TMA alignment: x rounded up to 16 bytes' worth of elements."""
    ck = Checker("get_tma_aligned_size")
    x = ck.dim(x, "x", minimum=0)
    element_size = ck.static_int(element_size, "element_size", minimum=1)
    ck.that(16 % element_size == 0, "element_size", "must divide 16", element_size)
    return align(x, 16 // element_size)


def mn_major_logical(physical: jax.Array, mn: int) -> jax.Array:
    """The logical [..., MN, K'] view of an MN-major physical buffer [..., K', align(MN, 4)]."""
    ck = Checker("mn_major_logical")
    ck.array(physical, "physical")
    ck.that(len(physical.shape) >= 2, "physical", "must be [..., K', align(MN, 4)]", tuple(physical.shape))
    mn = ck.dim(mn, "mn", minimum=0)
    if isinstance(mn, int) and isinstance(physical.shape[-1], int):
        ck.that(mn <= physical.shape[-1], "mn", f"must be <= the buffer's last dim {physical.shape[-1]}", mn)
    return physical[..., :mn].swapaxes(-1, -2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MNMajor:
    """Scales already stored MN-major and TMA-aligned: what vLLM's `column_major_scales` hand
    DeepGEMM. `physical` [..., K', align(MN, 4)] is the buffer; the scales are logical
    [..., MN, K'] (`logical()`). fp8_gemm_nt and the m-grouped FP8 GEMMs take it as a[1] (and
    fp8_gemm_nt as per-channel b[1]) and hand DeepGEMM the buffer as it is: no layout pass per
    GEMM. jax_dg.cast_tokens returns its scales so. A pytree (mn static): it crosses jit and vmap.
    """
    physical: jax.Array
    mn: int = dataclasses.field(metadata=dict(static=True))

    def logical(self) -> jax.Array:
        return mn_major_logical(self.physical, self.mn)

    def logical_type(self) -> jax.ShapeDtypeStruct:
        """The logical scales' shape and dtype, for checks (no array op)."""
        *lead, kb, _ = self.physical.shape
        return jax.ShapeDtypeStruct((*lead, self.mn, kb), self.physical.dtype)


def logical_view(sf):
    """What a shape rule checks of scales: an MNMajor's logical type, other scales as they are."""
    return sf.logical_type() if isinstance(sf, MNMajor) else sf


def mn_major_physical(sf) -> jax.Array:
    """The physical buffer [..., K', align(MN, 4)] of logical [..., MN, K'] scales stored
    MN-major and TMA-aligned (padding columns 0); the inverse of mn_major_logical. An MNMajor
    is that buffer already."""
    if isinstance(sf, MNMajor):
        return sf.physical
    mn = sf.shape[-2]
    pad = [(0, 0)] * (sf.ndim - 1) + [(0, get_tma_aligned_size(mn, 4) - mn)]
    return jnp.pad(sf.swapaxes(-1, -2), pad)


def get_mn_major_tma_aligned_tensor(sf: jax.Array) -> jax.Array:
    """float32 scales [MN, K'] or [B, MN, K'] -> the physical MN-major TMA-aligned buffer
    [(B,) K', align(MN, 4)] (DeepGEMM's tensor of strides (1, align(MN, 4)) is its view)."""
    ck = Checker("get_mn_major_tma_aligned_tensor")
    ck.dtype(sf, "sf", F32)
    ck.that(sf.ndim in (2, 3), "sf", "must be 2-D [MN, K'] or 3-D [B, MN, K']", tuple(sf.shape))
    return mn_major_physical(sf)


def get_col_major_tma_aligned_tensor(x: jax.Array) -> jax.Array:
    """vLLM's wrapper's name for get_mn_major_tma_aligned_tensor (same physical result)."""
    return get_mn_major_tma_aligned_tensor(x)


def _pack_rows(sf: jax.Array) -> jax.Array:
    """[..., K'] float32 -> [..., ceil(K'/4)] int32: exponent bytes, 4 per word, zero-padded."""
    k = sf.shape[-1]
    pad = [(0, 0)] * (sf.ndim - 1) + [(0, align(k, 4) - k)]
    return pack_ue8m0_to_int(jnp.pad(sf, pad))


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: jax.Array) -> jax.Array:
    """Power-of-two float32 scales [(B,) MN, K'] -> packed UE8M0, physical MN-major buffer
    int32 [(B,) ceil(K'/4), align(MN, 4)]: word p of row i holds the exponent bytes of
    sf[i, 4p:4p+4] (little end first; missing ones 0). Logical [.., MN, ceil(K'/4)] =
    mn_major_logical(result, MN).

    Scales must be exact powers of two (UE8M0-cast): like DeepGEMM's torch code this keeps
    each exponent byte; DeepGEMM's CUDA kernel would corrupt neighbouring bytes otherwise.
    """
    ck = Checker("get_mn_major_tma_aligned_packed_ue8m0_tensor")
    ck.dtype(sf, "sf", F32)
    ck.that(sf.ndim in (2, 3), "sf", "must be 2-D [MN, K'] or 3-D [B, MN, K']", tuple(sf.shape))
    return mn_major_physical(_pack_rows(sf))


def get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(
        sf: jax.Array, ks_tensor: jax.Array | None, ks: Sequence[int], gran_k: int) -> jax.Array:
    """K-grouped scales float32 [sum_g K_g / gran_k, MN] (MN-major rows) -> int32
    [sum_g ceil(K_g / gran_k / 4), MN], contiguous: each group packs its own rows 4 per word and
    zero-pads its last word. `ks` (static ints, K_g % gran_k == 0) sizes the groups; `ks_tensor`
    (DeepGEMM's device copy of ks) is accepted for vLLM's wrapper's signature and not read.
    Checks as DeepGEMM: at most 128 groups, MN % 4 == 0."""
    ck = Checker("get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor")
    ck.ndim(sf, "sf", 2, "[sum_g K_g / gran_k, MN]")
    ck.dtype(sf, "sf", F32)
    gran_k = ck.static_int(gran_k, "gran_k", minimum=1)
    ks = [ck.static_int(k, "ks", minimum=0) for k in ks]
    sf_k, mn = sf.shape
    ck.that(len(ks) <= 128, "ks", "may hold at most 128 groups", len(ks))
    ck.that(mn % 4 == 0, "sf", "must have MN % 4 == 0", mn)
    ck.that(all(k % gran_k == 0 for k in ks), "ks", f"must be multiples of gran_k = {gran_k}", ks)
    ck.that(sum(k // gran_k for k in ks) == sf_k, "sf", "must have sum(ks) / gran_k rows",
            (sf_k, sum(ks) // gran_k))
    # One gather: packed row q of group g takes that group's scale rows 4j..4j+3 (j = q's word)
    src, valid, start = [], [], 0
    for k in ks:
        rows = k // gran_k
        word_rows = np.arange(align(rows, 4)).reshape(-1, 4)
        src.append(start + np.minimum(word_rows, max(rows - 1, 0)))
        valid.append(word_rows < rows)
        start += rows
    if not src or sum(len(v) for v in valid) == 0:
        return jnp.zeros((0, mn), jnp.int32)
    src, valid = np.concatenate(src), np.concatenate(valid)
    words = jnp.where(jnp.asarray(valid)[:, :, None], sf[jnp.asarray(src, jnp.int32)], 0.0)
    return pack_ue8m0_to_int(words.swapaxes(1, 2)).reshape(len(src), mn)


def _default_arch() -> str:
    family = device.family()
    return family if family in ("sm90", "sm100", "sm120") else "sm90"


def transform_sf_into_required_layout(sf: jax.Array, mn: int, k: int, recipe, num_groups=None,
                                      is_sfa=None, disable_ue8m0_cast: bool = False, *,
                                      arch: str | None = None) -> jax.Array:
    """The scale layout DeepGEMM's kernels consume, per architecture (DeepGEMM's rules):

    recipe: (gran_m, gran_n, gran_k) with is_sfa (picks gran_m or gran_n), or (gran_mn, gran_k)
    with is_sfa None. sf: [(G,) ceil(MN / gran_mn), ceil(K / gran_k)] float32, or int32 packed
    [(G,) MN, ceil(K / gran_k / 4)].
      SM90 (or disable_ue8m0_cast): float32 (1, 128) -> get_mn_major_tma_aligned_tensor (physical);
          float32 (128, 128) -> unchanged.
      SM100/SM120: float32 (gran_mn, 32 or 128) -> rows broadcast to MN, then
          get_mn_major_tma_aligned_packed_ue8m0_tensor (physical); int32 (1, 32 or 128), logical
          [.., MN, ceil(K / gran_k / 4)] -> its physical MN-major buffer (DeepGEMM requires the
          tensor to be in that layout already and returns it as is).
    The result is always the storage DeepGEMM's kernels read, as a row-major array.
    arch: "sm90" | "sm100" | "sm120"; None takes the default jax device's family (SM90 rules
    when it is not a CUDA GPU). Other combinations raise ArgumentError, as DeepGEMM does.
    """
    ck = Checker("transform_sf_into_required_layout")
    recipe = ck.recipe(recipe, two=True)
    mn = ck.static_int(mn, "mn", minimum=0)
    k = ck.static_int(k, "k", minimum=0)
    disable_ue8m0_cast = ck.static_bool(disable_ue8m0_cast, "disable_ue8m0_cast")
    if num_groups is not None:
        num_groups = ck.static_int(num_groups, "num_groups", minimum=1)
    if len(recipe) == 3:
        ck.that(is_sfa is not None, "is_sfa", "must be given with a 3-element recipe")
        gran_mn, gran_k = (recipe[0] if ck.static_bool(is_sfa, "is_sfa") else recipe[1]), recipe[2]
    else:
        ck.that(is_sfa is None, "is_sfa", "must be None with a 2-element recipe (gran_mn, gran_k)")
        gran_mn, gran_k = recipe
    arch = arch or _default_arch()
    ck.that(arch in ("sm90", "sm100", "sm120"), "arch", "must be 'sm90', 'sm100' or 'sm120'", arch)
    ck.dtype(sf, "sf", F32, jnp.int32)
    is_f32 = sf.dtype == F32
    ck.ndim(sf, "sf", 2 + (num_groups is not None), "[(G,) MN', K']")
    if num_groups is not None:
        ck.that(sf.shape[0] == num_groups, "sf", f"must have num_groups = {num_groups} groups",
                tuple(sf.shape))
    expected = (cdiv(mn, gran_mn), cdiv(k, gran_k * (1 if is_f32 else 4)))
    ck.that(tuple(sf.shape[-2:]) == expected, "sf",
            f"must end in [ceil(MN / {gran_mn}), ceil(K / {gran_k * (1 if is_f32 else 4)})] = {expected}",
            tuple(sf.shape))
    sm90_rules = arch == "sm90" or disable_ue8m0_cast
    if is_f32 and gran_mn == 1 and gran_k == 128 and sm90_rules:
        return mn_major_physical(sf)
    if is_f32 and gran_mn == 128 and gran_k == 128 and sm90_rules:
        return sf
    if is_f32 and gran_k in (32, 128) and not sm90_rules:
        if gran_mn != 1:
            sf = jnp.take(sf, jnp.arange(mn) // gran_mn, axis=-2)
        return mn_major_physical(_pack_rows(sf))
    if not is_f32 and gran_mn == 1 and gran_k in (32, 128) and arch != "sm90":
        return mn_major_physical(sf)  # DeepGEMM takes it as is: already MN-major and aligned
    ck.fail("sf", f"has no DeepGEMM layout transformation on {arch} "
            f"(dtype {jnp.dtype(sf.dtype).name}, gran_mn {gran_mn}, gran_k {gran_k}, "
            f"disable_ue8m0_cast {disable_ue8m0_cast})")
