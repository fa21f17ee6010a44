"""Hyper-connections: DeepGEMM's pre-norm GEMM (tf32_hc_prenorm_gemm) and Mega mHC (the fused
mHC step + RMSNorm + FP8 cast, SM100 only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.contracts import align
from jax_dg.core.checks import Checker
from jax_dg.core.op import REQUIRED, Op, exposes
from jax_dg.reference import mhc as ref

__all__ = ["mega_mhc", "tf32_hc_prenorm_gemm"]

BF16 = jnp.bfloat16
F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
# DeepGEMM's host limits (csrc/apis/mega_mhc.hpp, layout/mega_mhc.cuh).
NUM_ROUTES = ref.NUM_ROUTES
NUM_HC_OUTPUTS = NUM_ROUTES * (NUM_ROUTES + 2)
HIDDEN_ALIGNMENT = 16 * 64  # kDefaultNumSplits * BLOCK_K
MAX_TOKENS = 1 << 20
SF_LAYOUTS = (None, "gemm", "routed")


def _shapes(x, residual, shifted_prev_mix, post_mix, comb_res_mix, fn, mix_scales, mix_bases,
            rmsnorm_weight, *, hc_mult, num_sinkhorn_iters, with_bf16, sf_layout, shared_sf_block_m):
    ck = Checker("mega_mhc")
    ck.that(hc_mult == NUM_ROUTES, "hc_mult", f"must be {NUM_ROUTES} (DeepGEMM's kNumRoutes)", hc_mult)
    ck.that(num_sinkhorn_iters >= 1, "num_sinkhorn_iters", "must be >= 1", num_sinkhorn_iters)
    ck.that(sf_layout in SF_LAYOUTS, "fp8_sf_layout", f"must be one of {SF_LAYOUTS}", sf_layout)
    ck.that(with_bf16 or sf_layout is not None, "y_bf16",
            "may be False only with an FP8 output (fp8_sf_layout); one output is required")
    if sf_layout == "routed":
        ck.that(shared_sf_block_m > 0, "shared_sf_block_m", "must be > 0 with fp8_sf_layout='routed'",
                shared_sf_block_m)
    else:
        ck.that(shared_sf_block_m == 0, "shared_sf_block_m",
                "is only used with fp8_sf_layout='routed' (leave it 0)", shared_sf_block_m)
    ck.ndim(x, "x", 2, "[T, H]")
    ck.dtype(x, "x", BF16)
    t, h = x.shape
    ck.that(h > 0 and h % HIDDEN_ALIGNMENT == 0, "x", f"must have H % {HIDDEN_ALIGNMENT} == 0 (H > 0)", h)
    ck.that(t <= MAX_TOKENS, "x", f"must have T <= {MAX_TOKENS}", t)
    r = hc_mult
    ck.tensor(residual, "residual", [BF16], (t, r, h), "[T, hc_mult, H]")
    ck.tensor(post_mix, "post_mix", [F32], (t, r, 1), "[T, hc_mult, 1]")
    ck.tensor(comb_res_mix, "comb_res_mix", [F32], (t, r, r), "[T, hc_mult, hc_mult]")
    if shifted_prev_mix is not None:
        ck.tensor(shifted_prev_mix, "shifted_prev_mix", [F32], (t, r, 1), "[T, hc_mult, 1]")
    ck.tensor(fn, "fn", [F32], (NUM_HC_OUTPUTS, r * h), "[hc_mult * (hc_mult + 2), hc_mult * H]")
    ck.tensor(mix_scales, "mix_scales", [F32], (3,), "[3]")
    ck.tensor(mix_bases, "mix_bases", [F32], (NUM_HC_OUTPUTS,), "[hc_mult * (hc_mult + 2)]")
    ck.tensor(rmsnorm_weight, "rmsnorm_weight", [BF16], (h,), "[H]")
    outs = [jax.ShapeDtypeStruct((t, r, h), BF16)]
    if shifted_prev_mix is not None:
        outs.append(jax.ShapeDtypeStruct((t, r, 1), F32))
    outs += [jax.ShapeDtypeStruct((t, r, 1), F32), jax.ShapeDtypeStruct((t, r, r), F32)]
    if with_bf16:
        outs.append(jax.ShapeDtypeStruct((t, h), BF16))
    words = h // ref.HIDDEN_PER_SF_WORD
    if sf_layout is not None:
        outs.append(jax.ShapeDtypeStruct((t, h), FP8))
    if sf_layout == "gemm":
        outs.append(jax.ShapeDtypeStruct((words, align(t, 4)), jnp.int32))
    elif sf_layout == "routed":
        outs.append(jax.ShapeDtypeStruct((t, words), jnp.int32))
        outs.append(jax.ShapeDtypeStruct((words, ref.shared_sf_num_rows(t, shared_sf_block_m)), jnp.int32))
    return outs


def _run(rt, x, residual, shifted_prev_mix, post_mix, comb_res_mix, fn, mix_scales, mix_bases,
          rmsnorm_weight, *outs, hc_mult, hc_norm_eps, hc_pre_eps, hc_post_scale, sinkhorn_eps,
          num_sinkhorn_iters, rmsnorm_eps, rmsnorm_scale, with_bf16, sf_layout, shared_sf_block_m):
    outs = list(outs)
    new_residual = outs.pop(0)
    new_prev_mix = outs.pop(0) if shifted_prev_mix is not None else None
    new_post_mix, new_comb_res_mix = outs.pop(0), outs.pop(0)
    y_bf16 = outs.pop(0) if with_bf16 else None
    y_fp8 = y_gemm_sf = y_routed_sf = y_shared_sf = None
    t = x.shape[0]
    if sf_layout is not None:
        y_fp8 = outs.pop(0)
        if sf_layout == "routed":
            y_routed_sf = outs.pop(0)
        # The physical buffer [words, rows] seen as DeepGEMM's column-major [T, words] view;
        # zeroed first so the rows the kernel leaves alone are deterministic.
        physical = outs.pop(0)
        physical.zero_()
        view = physical.as_strided((t, physical.shape[0]), (1, physical.shape[1]))
        if sf_layout == "gemm":
            y_gemm_sf = view
        else:
            y_shared_sf = view
    rt.dg.mega_mhc(x=x, residual=residual, shifted_prev_mix=shifted_prev_mix, post_mix=post_mix,
                   comb_res_mix=comb_res_mix, fn=fn, mix_scales=mix_scales, mix_bases=mix_bases,
                   hc_mult=hc_mult, hc_norm_eps=hc_norm_eps, hc_pre_eps=hc_pre_eps,
                   hc_post_scale=hc_post_scale, sinkhorn_eps=sinkhorn_eps,
                   num_sinkhorn_iters=num_sinkhorn_iters, rmsnorm_weight=rmsnorm_weight,
                   rmsnorm_eps=rmsnorm_eps, rmsnorm_scale=rmsnorm_scale, new_residual=new_residual,
                   new_prev_mix=new_prev_mix, new_post_mix=new_post_mix,
                   new_comb_res_mix=new_comb_res_mix, y_bf16=y_bf16, y_fp8=y_fp8, y_gemm_sf=y_gemm_sf,
                   y_routed_sf=y_routed_sf, y_shared_sf=y_shared_sf, shared_sf_block_m=shared_sf_block_m)


MEGA_MHC = Op(
    name="mega_mhc",
    args=("x", "residual", "shifted_prev_mix", "post_mix", "comb_res_mix", "fn", "mix_scales",
          "mix_bases", "rmsnorm_weight"),
    statics=dict.fromkeys(("hc_mult", "hc_norm_eps", "hc_pre_eps", "hc_post_scale", "sinkhorn_eps",
                           "num_sinkhorn_iters", "rmsnorm_eps", "rmsnorm_scale", "with_bf16",
                           "sf_layout", "shared_sf_block_m"), REQUIRED),
    shapes=_shapes,
    run=_run,
    reference=ref.mega_mhc,
    symbols=("mega_mhc",),
    archs=frozenset({"sm100"}),
)


@exposes(MEGA_MHC)
def mega_mhc(x, residual, post_mix, comb_res_mix, fn, mix_scales, mix_bases, rmsnorm_weight, *,
             hc_norm_eps, hc_pre_eps, hc_post_scale, sinkhorn_eps, num_sinkhorn_iters, rmsnorm_eps,
             rmsnorm_scale, hc_mult=4, shifted_prev_mix=None, y_bf16=True, fp8_sf_layout=None,
             shared_sf_block_m=0) -> dict:
    """One fused mHC step (DeepGEMM `mega_mhc`, SM100 only): mix the hc_mult residual routes,
    compute the next mixes (24-wide TF32 GEMM + Sinkhorn), RMSNorm, optional FP8 cast.

    x bfloat16 [T, H] (H % 1024 == 0); residual bfloat16 [T, 4, H]; post_mix float32 [T, 4, 1];
    comb_res_mix float32 [T, 4, 4]; fn float32 [24, 4 H]; mix_scales float32 [3];
    mix_bases float32 [24]; rmsnorm_weight bfloat16 [H]; shifted_prev_mix float32 [T, 4, 1] for
    the shifted variant (normalises with it instead of the new pre-mix). Scalars are static.
    hc_mult must be 4 (DeepGEMM's only geometry). The formulas: jax_dg/reference/mhc.py.

    Outputs, as a dict with DeepGEMM's names (DeepGEMM writes caller-owned tensors; here they
    are returned): new_residual [T, 4, H] bf16, new_prev_mix [T, 4, 1] (shifted only),
    new_post_mix [T, 4, 1], new_comb_res_mix [T, 4, 4], y_bf16 [T, H] (if y_bf16), and with
    fp8_sf_layout: y_fp8 float8_e4m3fn [T, H] whose UE8M0 scales (1 x 32 blocks, 4 per int32) are
      "gemm":   y_gemm_sf, int32 [H/128, align(T, 4)]: the physical column-major TMA-aligned
                buffer (logical [T, H/128] = y_gemm_sf[:, :T].T; padding columns are 0);
      "routed": y_routed_sf int32 [T, H/128] row-major, and y_shared_sf int32 [H/128, R] with
                R = ceil(T / shared_sf_block_m) * align(shared_sf_block_m, 128): Mega MoE's
                shared-expert SF pages, token t in column jax_dg.reference.mhc.shared_sf_rows
                (rows no token maps to are 0).
    """
    ck = Checker("mega_mhc")
    hc_mult = ck.static_int(hc_mult, "hc_mult")
    num_sinkhorn_iters = ck.static_int(num_sinkhorn_iters, "num_sinkhorn_iters")
    shared_sf_block_m = ck.static_int(shared_sf_block_m, "shared_sf_block_m", minimum=0)
    outs = list(MEGA_MHC(
        x, residual, shifted_prev_mix, post_mix, comb_res_mix, fn, mix_scales, mix_bases,
        rmsnorm_weight, hc_mult=hc_mult, hc_norm_eps=ck.static_float(hc_norm_eps, "hc_norm_eps"),
        hc_pre_eps=ck.static_float(hc_pre_eps, "hc_pre_eps"),
        hc_post_scale=ck.static_float(hc_post_scale, "hc_post_scale"),
        sinkhorn_eps=ck.static_float(sinkhorn_eps, "sinkhorn_eps"),
        num_sinkhorn_iters=num_sinkhorn_iters, rmsnorm_eps=ck.static_float(rmsnorm_eps, "rmsnorm_eps"),
        rmsnorm_scale=ck.static_float(rmsnorm_scale, "rmsnorm_scale"), with_bf16=ck.static_bool(y_bf16, "y_bf16"),
        sf_layout=fp8_sf_layout,
        shared_sf_block_m=shared_sf_block_m))
    names = ["new_residual"] + (["new_prev_mix"] if shifted_prev_mix is not None else [])
    names += ["new_post_mix", "new_comb_res_mix"] + (["y_bf16"] if y_bf16 else [])
    if fp8_sf_layout == "gemm":
        names += ["y_fp8", "y_gemm_sf"]
    elif fp8_sf_layout == "routed":
        names += ["y_fp8", "y_routed_sf", "y_shared_sf"]
    return dict(zip(names, outs))


# --- the hyper-connection pre-norm GEMM ----------------------------------------------------------

def _prenorm_shapes(x, fn, *, num_split):
    ck = Checker("tf32_hc_prenorm_gemm")
    ck.ndim(x, "x", 2, "[M, K]")
    ck.dtype(x, "x", jnp.bfloat16)
    ck.ndim(fn, "fn", 2, "[N, K]")
    ck.dtype(fn, "fn", F32)
    m, k = x.shape
    n = fn.shape[0]
    ck.that(fn.shape[1] == k, "fn", f"must be [N, K] with x's K = {k}", tuple(fn.shape))
    ck.that(0 < n <= 32 and n % 8 == 0, "fn", "must have 0 < N <= 32 and N % 8 == 0", n)
    ck.that(k > 0 and k % 64 == 0, "x", "must have K a positive multiple of 64", k)
    if num_split is None:
        return [jax.ShapeDtypeStruct((m, n), F32), jax.ShapeDtypeStruct((m,), F32)]
    s = ck.static_int(num_split, "num_split", 1)
    ck.that(s <= k // 64, "num_split", f"must be <= K / 64 = {k // 64} (a split takes whole "
            "64-wide K blocks)", s)
    return [jax.ShapeDtypeStruct((s, m, n), F32), jax.ShapeDtypeStruct((s, m), F32)]


def _prenorm_run(rt, x, fn, d, sqr_sum, *, num_split):
    rt.dg.tf32_hc_prenorm_gemm(x, fn, d, sqr_sum, num_split)


TF32_HC_PRENORM_GEMM = Op(
    name="tf32_hc_prenorm_gemm",
    args=("x", "fn"),
    statics={"num_split": REQUIRED},
    shapes=_prenorm_shapes,
    run=_prenorm_run,
    reference=ref.tf32_hc_prenorm_gemm,
    symbols=("tf32_hc_prenorm_gemm",),
)


@exposes(TF32_HC_PRENORM_GEMM)
def tf32_hc_prenorm_gemm(x, fn, num_split: int | None = None) -> tuple[jax.Array, jax.Array]:
    """out = x.float() @ fn.T (TF32 tensor cores) and sqrsum = x.float().square().sum(-1).

    x: bfloat16 [M, K], K % 64 == 0; fn: float32 [N, K], N <= 32, N % 8 == 0.
    num_split: static int S >= 1 (<= K / 64): K is cut into S ranges of whole 64-wide blocks
    (the remainder to the first ranges) and partials come back per range: out float32
    [S, M, N], sqrsum float32 [S, M]; sum over axis 0 for the totals. None: out [M, N],
    sqrsum [M].
    """
    d, sqr_sum = TF32_HC_PRENORM_GEMM(x, fn, num_split=num_split)
    return d, sqr_sum
