"""The DeepGEMM backend: finds the package lazily and resolves kernels across versions.

Like vLLM's wrapper: an installed `deep_gemm` first, then `vllm.third_party.deep_gemm`;
symbols by name, newest first, legacy names after; arguments adapted where versions differ;
a missing kernel is an error that names it and says how to get it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
import types
from typing import Any, Callable, Mapping

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


def keywords(fn: Callable) -> frozenset[str] | None:
    """The keyword arguments `fn` takes: from its signature, else from the signature line
    pybind11 writes first in its docstring ("f(a: T, name: bool = True) -> R"); None when
    neither says (an overloaded pybind11 function, no docstring, **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):   # pybind11 builtins have no inspectable signature
        params = None
    if params is not None:
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return None
        return frozenset(n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL)
    lines = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    found = re.match(r"\s*[\w.]+\((.*)\)\s*(->.*)?$", lines[0]) if lines else None
    if found is None:
        return None
    return frozenset(re.findall(r"(?:^|[\s,(])(\w+)\s*[:=]", found.group(1)))


def takes_keyword(fn: Callable, name: str) -> bool | None:
    """Whether `fn` takes the keyword argument `name` (None: its signature is unknown)."""
    names = keywords(fn)
    return None if names is None else name in names


def _without(fixed: dict[str, tuple[str, ...]]) -> Callable[[Callable], Callable]:
    """An adapter for a kernel whose newer DeepGEMM dropped keywords that jax_dg passes in 2.5's
    call: `fixed` maps each to the values that mean what the newer kernel always does (e.g.
    clean_logits=False: DeepGEMM >= 2.8 never cleans). A dropped keyword with another value is
    an error: the trace side plans around what the installed DeepGEMM lacks (Api), so it never
    reaches here."""
    def adapt(fn: Callable) -> Callable:
        names = keywords(fn)
        gone = {k: v for k, v in fixed.items() if names is not None and k not in names}
        if names is not None and not gone:
            return fn

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if names is None:   # unknown: 2.5's form first, pybind11's TypeError means "not this one"
                try:
                    return fn(*args, **kwargs)
                except TypeError:
                    pass
            for key, ok in (gone if names is not None else fixed).items():
                if key not in kwargs:
                    continue
                if str(kwargs[key]) in ok:
                    del kwargs[key]
                elif names is not None:   # unknown signature: keep it, the kernel says no
                    raise RuntimeError(f"jax_dg: deep_gemm {version()}'s {key}-less kernel cannot "
                                       f"take {key}={kwargs[key]} (jax_dg plans around it)")
            return fn(*args, **kwargs)
        return call
    return adapt


_FLOAT32 = ("None", "float32", "torch.float32")

# Public name -> adapter of the found callable to the signature jax_dg calls (2.5.0's).
SIGNATURES: dict[str, Callable[[Callable], Callable]] = {
    # >= 2.8: no clean_logits (never cleans), no logits_dtype (float32 on SM90), max_seqlen_k
    # required and 6th: jax_dg passes it by keyword in every version
    "fp8_fp4_mqa_logits": _without({"clean_logits": ("False",), "logits_dtype": _FLOAT32}),
    "fp8_fp4_paged_mqa_logits": _without({"clean_logits": ("False",), "logits_dtype": _FLOAT32}),
    # >= 2.8: the bf16 bhr/bhd forms take cuBLASLt unless deterministic algorithms are on
    "einsum": _without({"use_cublaslt": ("True",)}),
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


def lookup(name: str, dg: Any = None) -> Callable | None:
    """The callable for kernel `name` in the installed DeepGEMM (or in `dg`, a module with
    DeepGEMM's API: the torch emulation presenting 2.8's), adapted to the call jax_dg makes."""
    dg = module() if dg is None else dg
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
    """The resolved DeepGEMM symbols one op needs (what its run function receives as `dg`);
    `_module`: where others are looked up (None: the installed DeepGEMM)."""
    _module: Any = None

    def __getattr__(self, name: str) -> Any:  # symbols outside the op's list, resolved on demand
        fn = lookup(name, self._module)
        if fn is None:
            raise missing_error(name)
        setattr(self, name, fn)
        return fn


def adapted(dg: Any) -> Namespace:
    """`dg` (a module with DeepGEMM's API) as jax_dg calls it: each kernel through the adapter
    of the installed DeepGEMM's (the torch emulation presenting 2.8's API runs the same calls)."""
    ns = Namespace()
    ns._module = dg
    return ns


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
    return _version_tuple(version() or "0.0")


# --- what the installed DeepGEMM offers: the one record the trace side plans with ---------------

TESTED = ((2, 5), (2, 8))   # DeepGEMM versions jax_dg is tested against (GPU suite, golden files)


@dataclasses.dataclass(frozen=True)
class Api:
    """What one DeepGEMM build offers jax_dg, read from the module once: its version and, per
    kernel jax_dg calls, whether it resolves and which keywords it takes. The facts below are
    what the ops plan with while tracing (the form a kernel is called in, or what is composed
    around it where a version dropped a feature); the run functions never ask again.

    Signatures decide where they can (a keyword present or not); the version decides what no
    signature shows (head counts, next_n, buffer strides), and a version newer than any in
    TESTED is taken as the newest tested one there."""
    version: tuple[int, int]
    present: frozenset[str]
    signatures: tuple[tuple[str, frozenset[str] | None], ...]   # (kernel, its keywords or None)

    @functools.cached_property
    def keywords(self) -> Mapping[str, frozenset[str] | None]:
        return dict(self.signatures)

    @classmethod
    def of(cls, dg: Any, version_text: str | None = None) -> "Api":
        text = version_text or getattr(dg, "__version__", "0.0")
        present, kws = set(), {}
        for name in _API_SYMBOLS:
            fn = _find(dg, name)
            if fn is not None:
                present.add(name)
                kws[name] = keywords(fn)
        return cls(_version_tuple(text), frozenset(present), tuple(sorted(kws.items())))

    def has(self, name: str) -> bool:
        return name in self.present

    def lacks(self, name: str) -> bool:
        """Whether this DeepGEMM lacks kernel `name`, one of those the Api reads (others: not
        known here, lookup() tells)."""
        return name in _API_SYMBOLS and name not in self.present

    def takes(self, name: str, keyword: str) -> bool:
        """Whether kernel `name` takes `keyword` (an unknown signature: as its version's)."""
        names = self.keywords.get(name)
        if names is None:
            return self.has(name) and keyword in _ERAS[self.era].get(name, ())
        return keyword in names

    @classmethod
    @functools.cache
    def emulating(cls, version: tuple[int, int]) -> "Api":
        """DeepGEMM `version`'s API as its tested release declares it (the newest tested one not
        newer): what the torch emulation presents, and what a test's target names."""
        era = _ERAS[max([v for v in TESTED if v <= tuple(version)] or [TESTED[0]])]
        return cls(tuple(version), frozenset(era), tuple((n, frozenset(k)) for n, k in sorted(era.items())))

    @property
    def era(self) -> tuple[int, int]:
        """The tested version whose facts apply: the newest tested one not newer than this."""
        return max([v for v in TESTED if v <= self.version] or [TESTED[0]])

    @property
    def release(self) -> str:
        """"2.8" and the like, for messages."""
        return ".".join(map(str, self.version))

    @property
    def untested(self) -> bool:
        return self.version not in TESTED

    # The facts the ops plan with.
    @property
    def mqa_full_form(self) -> bool:
        """fp8_fp4_mqa_logits has the full [M, N] form (max_seqlen_k=0; gone in 2.8)."""
        return self.takes("fp8_fp4_mqa_logits", "clean_logits")

    def logits_dtypes(self, kernel: str) -> tuple[str, ...]:
        """Logits types the SM90 MQA-logits kernel writes (2.8: float32 only)."""
        return ("float32", "bfloat16") if self.takes(kernel, "logits_dtype") else ("float32",)

    @property
    def sm90_mqa_heads(self) -> tuple[int, ...]:
        """Heads the SM90 logits kernels take (2.5.0's kernel ran 16 too; 2.8 asserts 32, 64)."""
        return (16, 32, 64) if self.era < (2, 8) else (32, 64)

    @property
    def sm90_paged_next_n(self) -> tuple[int, ...]:
        """Query rows per request the SM90 paged kernel takes (2.8: 1, 2)."""
        return (1, 2, 4) if self.era < (2, 8) else (1, 2)

    @property
    def sm90_page_sizes(self) -> tuple[int, ...]:
        """KV block sizes (tokens) the SM90 paged kernels take (2.8: 64 only)."""
        return (32, 64) if self.era < (2, 8) else (64,)

    @property
    def sm90_paged_varlen(self) -> bool:
        """Whether the SM90 paged kernels take the varlen form (`indices`; 2.8: SM100 only)."""
        return self.era < (2, 8)

    def facts(self) -> dict[str, str]:
        """What the ops plan with, in words (`python -m jax_dg info`)."""
        return {
            "mqa logits": ("full and compressed forms" if self.mqa_full_form else
                           "compressed form only (the full form gathered from it)")
                          + ", " + "/".join(self.logits_dtypes("fp8_fp4_mqa_logits"))
                          + f", SM90 heads {self.sm90_mqa_heads}",
            "paged logits": "/".join(self.logits_dtypes("fp8_fp4_paged_mqa_logits"))
                            + f", SM90 next_n {self.sm90_paged_next_n}, blocks {self.sm90_page_sizes}",
            "skip_head_mid": "DeepGEMM's" if self.has("fp8_gemm_nt_skip_head_mid")
                             else "fp8_gemm_nt, then XLA",
        }

    @property
    def ensure_zero_padding(self) -> bool:
        """m-grouped contiguous GEMMs zero the padding rows themselves when asked (2.8)."""
        return self.takes("m_grouped_fp8_gemm_nt_contiguous", "ensure_zero_padding")


# Kernels whose presence and keywords the Api reads (public names, as lookup() takes them), and
# their keywords in each tested version (as its bindings declare them): what an unreadable
# pybind11 signature is taken to be, and what the torch emulation presents (Api.emulating).
_GEMM_25 = ("a", "b", "d", "c", "recipe", "recipe_a", "recipe_b", "compiled_dims", "disable_ue8m0_cast")
_M_GROUPED_25 = ("a", "b", "d", "grouped_layout", "recipe", "recipe_a", "recipe_b", "compiled_dims",
                 "disable_ue8m0_cast", "use_psum_layout", "expected_m_for_psum_layout")
_ERAS: dict[tuple[int, int], dict[str, tuple[str, ...]]] = {
    (2, 5): {
        "fp8_gemm_nt": _GEMM_25,
        "fp8_gemm_nt_skip_head_mid": ("a", "b", "d", "head_splits", "recipe", "compiled_dims",
                                      "disable_ue8m0_cast"),
        "fp8_fp4_mqa_logits": ("q", "kv", "weights", "cu_seq_len_k_start", "cu_seq_len_k_end",
                               "clean_logits", "max_seqlen_k", "logits_dtype"),
        "fp8_fp4_paged_mqa_logits": ("q", "fused_kv_cache", "weights", "context_lens", "block_table",
                                     "schedule_meta", "max_context_len", "clean_logits",
                                     "logits_dtype", "indices"),
        "get_paged_mqa_logits_metadata": ("context_lens", "block_kv", "num_sms", "indices"),
        "m_grouped_fp8_gemm_nt_contiguous": _M_GROUPED_25,
        "m_grouped_bf16_gemm_nt_contiguous": ("a", "b", "d", "grouped_layout", "compiled_dims",
                                              "use_psum_layout", "expected_m_for_psum_layout"),
        "k_grouped_fp8_gemm_nt_contiguous": ("a", "b", "d", "ks", "ks_tensor", "c", "recipe",
                                             "compiled_dims"),
        "bf16_gemm_nt": ("a", "b", "d", "c", "compiled_dims"),
        "einsum": ("expr", "a", "b", "d", "c", "use_cublaslt"),
    },
    (2, 8): {
        "fp8_gemm_nt": _GEMM_25 + ("alpha", "epilogue_class"),
        "fp8_fp4_mqa_logits": ("q", "kv", "weights", "cu_seq_len_k_start", "cu_seq_len_k_end",
                               "max_seqlen_k", "schedule_meta"),
        "fp8_fp4_paged_mqa_logits": ("q", "fused_kv_cache", "weights", "context_lens", "block_table",
                                     "schedule_meta", "max_context_len", "indices"),
        "get_paged_mqa_logits_metadata": ("context_lens", "block_kv", "num_sms", "indices"),
        "m_grouped_fp8_gemm_nt_contiguous": _M_GROUPED_25[:-1] + (
            "ensure_zero_padding", "expected_m_for_psum_layout", "epilogue_class"),
        "m_grouped_bf16_gemm_nt_contiguous": ("a", "b", "d", "grouped_layout", "compiled_dims",
                                              "use_psum_layout", "ensure_zero_padding",
                                              "expected_m_for_psum_layout", "epilogue_class"),
        "k_grouped_fp8_gemm_nt_contiguous": ("a", "b", "d", "ks_cpu", "grouped_layout", "c", "recipe",
                                             "compiled_dims", "use_psum_layout", "epilogue_class"),
        "bf16_gemm_nt": ("a", "b", "d", "c", "compiled_dims", "alpha", "epilogue_class"),
        "einsum": ("expr", "a", "b", "d", "c", "epilogue_class"),
        "batched_syrk": ("a", "d"),
        "batched_symm": ("a", "b", "d"),
        "use_deterministic_algorithms": ("enabled",),
        "shutdown": (),
    },
}
_API_SYMBOLS = tuple(dict.fromkeys(n for era in _ERAS.values() for n in era))


def _find(dg: Any, name: str) -> Callable | None:
    for candidate in NAMES.get(name, (name,)):
        fn = getattr(dg, candidate, None)
        if fn is not None:
            return fn
    return None


def _version_tuple(text: str) -> tuple[int, int]:
    found = re.match(r"\s*(\d+)\.(\d+)", str(text))
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


_API: list = [None, None]   # (module, its Api): read once per module


def api() -> Api | None:
    """The installed DeepGEMM's Api (None when none imports)."""
    dg = module()
    if dg is None:
        return None
    if _API[0] is not dg:
        _API[:] = [dg, Api.of(dg, version())]
    return _API[1]
