"""Stand-ins for the two DeepGEMM APIs jax_dg is tested against, 2.5.0 and 2.8.2: modules with the
kernels' exact Python signatures (the parameter lists of each version's pybind11 bindings, as its
stub file lists them), for testing how jax_dg reads and maps an installed DeepGEMM without one.

Each kernel records its call and returns what its version returns in shape only; tests that need
numbers run the torch emulation.
"""

from __future__ import annotations

import types

CALLS: list[tuple[str, tuple, dict]] = []


def _module(version: str, fns: dict) -> types.ModuleType:
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = version

    def recording(name, fn):
        def call(*args, **kwargs):
            CALLS.append((name, args, kwargs))
            return fn(*args, **kwargs)
        call.__name__ = name
        call.__signature__ = __import__("inspect").signature(fn)
        return call
    for name, fn in fns.items():
        setattr(mod, name, recording(name, fn))
    return mod


# --- 2.5.0 -------------------------------------------------------------------------------------

def _mqa_25(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True, max_seqlen_k=0,
            logits_dtype=None):
    return "logits"


def _paged_25(q, fused_kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
              clean_logits=False, logits_dtype=None, indices=None):
    return "logits"


def _skip_head_mid(a, b, d, head_splits, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
    return None


def _fp8_gemm_nt_25(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                    disable_ue8m0_cast=False):
    return None


def _m_grouped_25(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                  compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                  expected_m_for_psum_layout=None):
    return None


def _einsum_25(expr, a, b, d, c=None, use_cublaslt=False):
    return None


def _k_grouped_25(a, b, d, ks, ks_tensor, c=None, recipe=(1, 1, 128), compiled_dims="mn"):
    return None


DEEP_GEMM_25 = dict(fp8_fp4_mqa_logits=_mqa_25, fp8_fp4_paged_mqa_logits=_paged_25,
                    fp8_gemm_nt_skip_head_mid=_skip_head_mid, fp8_gemm_nt=_fp8_gemm_nt_25,
                    m_grouped_fp8_gemm_nt_contiguous=_m_grouped_25, einsum=_einsum_25,
                    k_grouped_fp8_gemm_nt_contiguous=_k_grouped_25)


# --- 2.8.2 -------------------------------------------------------------------------------------

def _mqa_28(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k, schedule_meta=None):
    return "logits"


def _paged_28(q, fused_kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
              indices=None):
    return "logits"


def _fp8_gemm_nt_28(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                    disable_ue8m0_cast=False, alpha=None, epilogue_class=None):
    return None


def _m_grouped_28(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                  compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                  ensure_zero_padding=True, expected_m_for_psum_layout=None, epilogue_class=None):
    return None


def _einsum_28(expr, a, b, d, c=None, epilogue_class=None):
    return None


def _k_grouped_28(a, b, d, ks_cpu, grouped_layout, c=None, recipe=(1, 1, 128), compiled_dims="mn",
                  use_psum_layout=False, epilogue_class=None):
    return None


def _batched_syrk(a, d):
    return None


def _batched_symm(a, b, d):
    return None


def _use_deterministic_algorithms(enabled):
    return None


def _shutdown():
    return None


DEEP_GEMM_28 = dict(fp8_fp4_mqa_logits=_mqa_28, fp8_fp4_paged_mqa_logits=_paged_28,
                    fp8_gemm_nt=_fp8_gemm_nt_28, m_grouped_fp8_gemm_nt_contiguous=_m_grouped_28,
                    einsum=_einsum_28, k_grouped_fp8_gemm_nt_contiguous=_k_grouped_28,
                    batched_syrk=_batched_syrk, batched_symm=_batched_symm,
                    use_deterministic_algorithms=_use_deterministic_algorithms, shutdown=_shutdown)


def deep_gemm_25() -> types.ModuleType:
    return _module("2.5.0.post20260629", DEEP_GEMM_25)


def deep_gemm_28(version: str = "2.8.2.post20261020") -> types.ModuleType:
    return _module(version, DEEP_GEMM_28)


class Pybind:
    """A pybind11-like builtin: no inspectable signature, the signature line in its docstring
    (or none)."""

    def __init__(self, fn, doc: str | None):
        self._fn, self.__doc__ = fn, doc

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    @property
    def __signature__(self):   # inspect.signature raises, as on a pybind11 builtin
        raise ValueError("no signature found for builtin")


def as_pybind(mod: types.ModuleType, documented: bool = True) -> types.ModuleType:
    """`mod` with every kernel made pybind11-like: its docstring's first line the signature
    (documented) or no docstring."""
    import inspect
    out = types.ModuleType(mod.__name__)
    out.__version__ = mod.__version__
    for name, fn in vars(mod).items():
        if callable(fn) and not name.startswith("_"):
            doc = f"{name}{inspect.signature(fn)} -> object\n" if documented else None
            setattr(out, name, Pybind(fn, doc))
    return out
