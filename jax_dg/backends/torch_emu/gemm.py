"""Torch emulation of DeepGEMM's GEMM kernels (same signatures as deep_gemm's)."""

from __future__ import annotations

from jax_dg.backends.torch_emu.common import check_dims, dequant, matmul

__all__ = ["fp8_gemm_nt"]

_DEFAULT_RECIPE = (1, 128, 128)


def _fp8_operands(a, b, recipe):
    (av, sfa), (bv, sfb) = a, b
    gm, gn, gk = recipe or _DEFAULT_RECIPE
    return dequant(av, sfa, gm, gk), dequant(bv, sfb, gn, gk)


def fp8_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                disable_ue8m0_cast=False) -> None:
    """d = a @ b.T (+ c), FP8 operands with block scales, fp32 accumulation."""
    check_dims(compiled_dims)
    x, w = _fp8_operands(a, b, recipe)
    out = matmul(x, w.T)
    if c is not None:
        out = out + c.float()
    d.copy_(out)


__all__ += ["fp8_gemm_nt_skip_head_mid"]


def fp8_gemm_nt_skip_head_mid(a, b, d, head_splits, recipe=None, compiled_dims="nk",
                              disable_ue8m0_cast=False) -> None:
    """a @ b.T's columns, (left + right) per head, written around each head's `mid` columns of
    d [M, N + N / (left + right) * mid], which are not touched."""
    check_dims(compiled_dims)
    left, mid, right = head_splits
    x, w = _fp8_operands(a, b, recipe)
    m, n = x.shape[0], w.shape[0]
    out = matmul(x, w.T).view(m, n // (left + right), left + right)
    heads = d.view(m, n // (left + right), left + mid + right)
    heads[:, :, :left] = out[:, :, :left].to(d.dtype)
    heads[:, :, left + mid:] = out[:, :, left:].to(d.dtype)


# --- Layout variants: DeepGEMM's nn / tn / tt are nt on transposed views ----------------------
# (a "t" operand is stored [K, M], a "n" b is stored [K, N]; scales transpose with their values)

def _t(x):
    return (x[0].T, x[1].T) if isinstance(x, tuple) else x.T


def _layouts(nt, prefix):
    def variant(layout):
        a_t, b_n = layout[0] == "t", layout[1] == "n"

        def fn(a, b, d, *args, **kwargs):
            return nt(_t(a) if a_t else a, _t(b) if b_n else b, d, *args, **kwargs)
        fn.__name__ = fn.__qualname__ = f"{prefix}_{layout}"
        return fn
    return variant("nn"), variant("tn"), variant("tt")


fp8_gemm_nn, fp8_gemm_tn, fp8_gemm_tt = _layouts(fp8_gemm_nt, "fp8_gemm")


def bf16_gemm_nt(a, b, d, c=None, compiled_dims="nk") -> None:
    """d = a @ b.T (+ c), float32 accumulation."""
    check_dims(compiled_dims)
    out = matmul(a.float(), b.float().T)
    if c is not None:
        out = out + c.float()
    d.copy_(out)


def cublaslt_gemm_nt(a, b, d, c=None) -> None:
    bf16_gemm_nt(a, b, d, c)


bf16_gemm_nn, bf16_gemm_tn, bf16_gemm_tt = _layouts(bf16_gemm_nt, "bf16_gemm")
cublaslt_gemm_nn, cublaslt_gemm_tn, cublaslt_gemm_tt = _layouts(cublaslt_gemm_nt, "cublaslt_gemm")

__all__ += ["fp8_gemm_nn", "fp8_gemm_tn", "fp8_gemm_tt",
            "bf16_gemm_nt", "bf16_gemm_nn", "bf16_gemm_tn", "bf16_gemm_tt",
            "cublaslt_gemm_nt", "cublaslt_gemm_nn", "cublaslt_gemm_tn", "cublaslt_gemm_tt"]
