"""The DeepGEMM backend: finds the package lazily and resolves kernels across versions.

Like vLLM's wrapper: an installed `deep_gemm` first, then `vllm.third_party.deep_gemm`;
symbols by name, newest first, legacy names after; arguments adapted where versions differ;
a missing kernel is an error that names it and says how to get it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import types
from typing import Any, Callable

INSTALL_HINT = (
    "Install DeepGEMM built for your torch (e.g. `pip install deep_gemm` from "
    "https://github.com/deepseek-ai/DeepGEMM, or a wheel such as tokenspeed-deepgemm), "
    "or run the torch emulation with JAX_DG_BACKEND=torch."
)

# Public name -> names to try, newest first (DeepGEMM renamed kernels across releases). Only
# DeepGEMM >= 2.0 names: 1.x kernels (gemm_fp8_fp8_bf16_nt, ...) take no `c`/`recipe` and want
# scales already in TMA-aligned column-major layout, which these calls do not provide.
NAMES: dict[str, tuple[str, ...]] = {
    "fp8_gemm_nt": ("fp8_gemm_nt", "fp8_fp4_gemm_nt"),
    "fp8_gemm_nn": ("fp8_gemm_nn", "fp8_fp4_gemm_nn"),
    "fp8_gemm_tn": ("fp8_gemm_tn", "fp8_fp4_gemm_tn"),
    "fp8_gemm_tt": ("fp8_gemm_tt", "fp8_fp4_gemm_tt"),
    "m_grouped_fp8_gemm_nt_contiguous": ("m_grouped_fp8_gemm_nt_contiguous",
                                         "m_grouped_fp8_fp4_gemm_nt_contiguous"),
    "m_grouped_fp8_gemm_nt_masked": ("m_grouped_fp8_gemm_nt_masked",
                                     "fp8_m_grouped_gemm_nt_masked",
                                     "m_grouped_fp8_fp4_gemm_nt_masked"),
    "get_mn_major_tma_aligned_tensor": ("get_mn_major_tma_aligned_tensor",
                                        "get_col_major_tma_aligned_tensor"),
    "get_mk_alignment_for_contiguous_layout": ("get_mk_alignment_for_contiguous_layout",
                                               "get_m_alignment_for_contiguous_layout"),
    "m_grouped_bf16_gemm_nt_masked": ("m_grouped_bf16_gemm_nt_masked",
                                      "bf16_m_grouped_gemm_nt_masked"),
}


def _adapt_mqa_logits(legacy: Callable) -> Callable:
    # DeepGEMM < 2.4: fp8_mqa_logits(q, kv, ...) takes q alone and has no logits_dtype.
    def call(q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0, logits_dtype=None):
        if q[1] is not None or str(logits_dtype) not in ("None", "float32", "torch.float32"):
            raise RuntimeError("jax_dg: this DeepGEMM's fp8_mqa_logits takes no q scale and "
                               "returns float32 logits only")
        return legacy(q[0], kv, weights, ks, ke, clean_logits=clean_logits,
                      max_seqlen_k=max_seqlen_k)
    return call


def _adapt_paged_mqa_logits(legacy: Callable) -> Callable:
    # fp8_paged_mqa_logits(q, kv_cache, ...) takes q alone and has no logits_dtype.
    def call(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
             clean_logits=False, logits_dtype=None, **kwargs):
        if q[1] is not None or str(logits_dtype) not in ("None", "float32", "torch.float32"):
            raise RuntimeError("jax_dg: this DeepGEMM's fp8_paged_mqa_logits takes no q scale and "
                               "returns float32 logits only")
        return legacy(q[0], kv_cache, weights, context_lens, block_table, schedule_meta,
                      max_context_len, clean_logits=clean_logits, **kwargs)
    return call


# Public name -> (legacy name, adapter turning the legacy callable into the new signature).
ADAPTED: dict[str, tuple[str, Callable[[Callable], Callable]]] = {
    "fp8_fp4_mqa_logits": ("fp8_mqa_logits", _adapt_mqa_logits),
    "fp8_fp4_paged_mqa_logits": ("fp8_paged_mqa_logits", _adapt_paged_mqa_logits),
}


def takes_keyword(fn: Callable, name: str) -> bool | None:
    """Whether `fn` takes the keyword argument `name`: from its signature, else from the
    signature line pybind11 writes first in its docstring ("f(a: T, name: bool = True) -> R");
    None when neither says (an overloaded pybind11 function, no docstring)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):   # pybind11 builtins have no inspectable signature
        params = None
    if params is not None:
        return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    lines = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    found = re.match(r"\s*[\w.]+\((.*)\)\s*(->.*)?$", lines[0]) if lines else None
    if found is None:
        return None
    return re.search(rf"(^|[\s,(]){re.escape(name)}\s*[:=]", found.group(1)) is not None


def _adapt_mqa_logits_clean(fn: Callable) -> Callable:
    # DeepGEMM >= 2.8 dropped `clean_logits` from fp8_fp4_mqa_logits (max_seqlen_k moved to the
    # 6th place): keep 2.5's keyword call and drop the argument where the kernel has none. jax_dg
    # masks invalid positions itself, so whether such a DeepGEMM cleans changes nothing read.
    takes = takes_keyword(fn, "clean_logits")
    if takes:
        return fn

    @functools.wraps(fn)
    def call(q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0, logits_dtype=None):
        kw = {"max_seqlen_k": max_seqlen_k}
        if logits_dtype is not None:
            kw["logits_dtype"] = logits_dtype
        if takes is None:   # unknown: 2.5's form first, pybind11's TypeError means "not this one"
            try:
                return fn(q, kv, weights, ks, ke, clean_logits=clean_logits, **kw)
            except TypeError:
                pass
        return fn(q, kv, weights, ks, ke, **kw)
    return call


# Public name -> adapter of the found callable to the signature jax_dg calls (2.5.0's).
SIGNATURES: dict[str, Callable[[Callable], Callable]] = {
    "fp8_fp4_mqa_logits": _adapt_mqa_logits_clean,
}


@functools.cache
def module() -> types.ModuleType | None:
    """The deep_gemm module, or None when neither source imports."""
    os.environ.setdefault("DG_JIT_CACHE_DIR", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jax_dg", "deep_gemm"))
    for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
        except Exception:  # a vendored copy can fail in its _C.init(); try the next source
            continue
    return None


def import_error() -> str | None:
    """Why deep_gemm does not import (None when it does), for messages and `info`."""
    try:
        importlib.import_module("deep_gemm")
        return None
    except Exception as e:  # noqa: BLE001 - the message is the point
        return f"{type(e).__name__}: {e}"


def version() -> str | None:
    dg = module()
    return None if dg is None else getattr(dg, "__version__", "unknown")


def lookup(name: str) -> Callable | None:
    """The callable for kernel `name` in the installed DeepGEMM, adapted to the newest API."""
    dg = module()
    if dg is None:
        return None
    for candidate in NAMES.get(name, (name,)):
        fn = getattr(dg, candidate, None)
        if fn is not None:
            return SIGNATURES.get(name, lambda f: f)(fn)
    if name in ADAPTED:
        legacy, adapt = ADAPTED[name]
        fn = getattr(dg, legacy, None)
        if fn is not None:
            return adapt(fn)
    return None


def missing_error(name: str) -> RuntimeError:
    dg = module()
    if dg is None:
        where = f"deep_gemm is not importable ({import_error()})"
    else:
        where = (f"deep_gemm {version()} at {os.path.dirname(dg.__file__)} has no "
                 f"{' / '.join(NAMES.get(name, (name,)))}")
    return RuntimeError(f"jax_dg: DeepGEMM kernel `{name}` is unavailable: {where}. {INSTALL_HINT}")


class Namespace(types.SimpleNamespace):
    """The resolved DeepGEMM symbols one op needs (what its run function receives as `dg`)."""

    def __getattr__(self, name: str) -> Any:  # symbols outside the op's list, resolved on demand
        fn = lookup(name)
        if fn is None:
            raise missing_error(name)
        setattr(self, name, fn)
        return fn


def namespace(symbols: tuple[str, ...]) -> Namespace:
    """A namespace with `symbols` resolved now (a missing one raises, naming it)."""
    found = {}
    for name in symbols:
        fn = lookup(name)
        if fn is None:
            raise missing_error(name)
        found[name] = fn
    return Namespace(**found)


def version_tuple() -> tuple[int, int]:
    """(major, minor) of the installed DeepGEMM; (0, 0) when unknown."""
    parts = (version() or "0.0").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return 0, 0
