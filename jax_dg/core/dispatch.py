"""Which implementation runs an op here, and why: the one resolver.

The op call (jax_dg.core.op), `python -m jax_dg info` and the warm-up (jax_dg.tools.warmup)
all ask `resolve`, so what a call does and what jax_dg says it does cannot drift apart; the
bridge asks `kernels` for what the call-site record's backend runs, from the DeepGEMM symbols
the trace resolved (`symbols`, the one place that looks them up).

    runs        what         at run time
    "deep_gemm" DeepGEMM's kernel through the bridge (DLPack views, XLA's stream)
    "torch"     the torch emulation of DeepGEMM's kernel through the same bridge
    "native"    jax_dg's own kernel: a typed XLA FFI handler (C++; CUDA or its CPU twin)
    "xla"       no custom call: the pure-JAX reference is traced in place of the op (asked
                for, or auto off CUDA where torch is not installed)
    "raises"    nothing runs: `error` is raised while tracing
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jax_dg.backends import deep_gemm, optional
from jax_dg.core import backend as selection
from jax_dg.core import native
from jax_dg.core.checks import UnsupportedArchError, UnsupportedBackendError
from jax_dg.core.device import Target


@dataclasses.dataclass(frozen=True)
class Dispatch:
    runs: str
    why: str
    graph: bool = False        # lowered to the command-buffer-compatible target
    error: Exception | None = None
    # the backend the call-site record names (what `kernels` gives the run function): `runs`,
    # or "torch@2.8" where the emulation presents another release than 2.5
    record: str = ""

    @property
    def backend(self) -> str:
        return self.record or self.runs

    def check(self) -> "Dispatch":
        """Raises the resolution's error, if any (at trace time)."""
        if self.error is not None:
            raise self.error
        return self


def symbols(op) -> tuple[dict, list[str]]:
    """({name: callable} of `op`'s DeepGEMM symbols in the installed DeepGEMM (adapted across
    versions, jax_dg.backends.deep_gemm), [the names it lacks])."""
    found = {name: deep_gemm.lookup(name) for name in op.symbols}
    return ({n: f for n, f in found.items() if f is not None},
            [n for n, f in found.items() if f is None])


def kernels(op, backend: str):
    """The kernel namespace `op`'s run function calls for `backend`, the concrete one a
    call-site record carries: the torch emulation (DeepGEMM's API in plain torch), or the
    DeepGEMM symbols `symbols` resolves (one missing raises, naming it)."""
    if backend == "torch@2.8":   # the emulation presenting 2.8, through the adapters 2.8 gets
        from jax_dg.backends.torch_emu import v28
        return deep_gemm.adapted(v28)
    if backend == "torch":
        from jax_dg.backends import torch_emu
        return torch_emu
    found, missing = symbols(op)
    if missing:
        raise deep_gemm.missing_error(missing[0])
    return deep_gemm.Namespace(**found)


def needs(op, given: Sequence[str] = ()) -> frozenset[str]:
    """The architectures with a DeepGEMM kernel for a call that passes `given` arguments."""
    archs = op.archs
    for arg in given:
        archs = archs & op.arg_archs.get(arg, archs)
    return archs


def resolve(op, given: Sequence[str], t: Target, requested: str | None = None) -> Dispatch:
    """How a call of `op` with the `given` arguments, traced for `t`, runs (see the module doc).
    `requested` is the backend asked for (default: the active one)."""
    requested = selection.requested() if requested is None else requested
    how = _resolve(op, given, t, requested)
    # Checked last: a call that cannot run for another reason (the architecture, deep_gemm
    # missing) says that reason, which holds with the kernels built too.
    if how.runs not in ("raises", "xla") and t.platform == "cuda" and op.own_kernels \
            and not native.cuda_built():
        return Dispatch("raises", "jax_dg's CUDA kernels were not built", error=RuntimeError(
            f"jax_dg: `{op.name}` runs jax_dg's own CUDA kernel(s) {', '.join(op.own_kernels)}, "
            "which were not built (no CUDA toolkit when jax_dg was installed): reinstall jax_dg "
            f"where nvcc is found, or trace with {selection.ENV}=xla."))
    return how


def _resolve(op, given: Sequence[str], t: Target, requested: str) -> Dispatch:
    if requested == "xla":
        return Dispatch("xla", f"pure-JAX reference ({selection.asked_by(requested)})")
    mine = f" + jax_dg's {', '.join(op.own_kernels)}" if op.own_kernels else ""
    if op.native is not None:
        where = "CUDA" if t.platform == "cuda" else f"its C++ twin on {t.platform}"
        return Dispatch("native", f"jax_dg's own kernel {', '.join(op.own_kernels)} ({where})",
                        graph=t.platform == "cuda")
    if t.backend == "xla":   # auto, off CUDA, without torch
        return Dispatch("xla", f"pure-JAX reference ({t.platform}, no torch: "
                        f"pip install '{optional.EXTRA}' for the emulation through the bridge)")
    if t.platform != "cuda" and t.backend == "deep_gemm":
        return Dispatch("raises", "DeepGEMM needs a CUDA device", error=UnsupportedBackendError(
            f"jax_dg: {selection.asked_by(requested)} runs DeepGEMM, which needs a CUDA device; this call "
            f"runs on {t.platform}. There use_backend('auto') (the torch emulation, or the "
            "pure-JAX reference without torch), 'torch' or 'xla'."))
    if not optional.has_torch():   # the emulation, and DeepGEMM (a torch extension)
        what = "the torch emulation" if t.backend == "torch" else "DeepGEMM"
        return Dispatch("raises", "torch is not installed", error=optional.MissingTorchError(
            f"jax_dg: `{op.name}` runs {what} through the bridge ({selection.asked_by(requested)}), which "
            f"needs torch; {optional.HINT}. Without torch, use_backend('xla') runs the pure-JAX "
            "reference."))
    gone = [s for s in op.symbols if t.api.lacks(s)]
    if t.backend == "torch" and gone:   # the emulation presents the API of a release (emulated)
        return Dispatch("raises", f"emulated DeepGEMM {t.api.release} lacks {', '.join(gone)}",
                        error=RuntimeError(
            f"jax_dg: `{op.name}` calls DeepGEMM's {', '.join(gone)}, which DeepGEMM "
            f"{t.api.release} (the release the torch emulation presents) does not have"))
    if t.backend == "torch":
        why = ("torch emulation through the bridge" +
               (f" ({selection.asked_by(requested)})" if requested == "torch" else f" ({t.platform}: no CUDA device)"))
        record = "" if t.version == (2, 5) else f"torch@{t.api.release}"
        return Dispatch("torch", why + mine + (f", presenting DeepGEMM {t.api.release}" if record else ""),
                        graph="torch" in op.graph_safe, record=record)
    archs = needs(op, given)
    if t.arch not in archs:
        with_args = [a for a in given if a in op.arg_archs]
        form = f" with `{'`, `'.join(with_args)}`" if with_args else ""
        return Dispatch("raises", f"no DeepGEMM kernel on {t.arch} (needs {', '.join(sorted(archs))})",
                        error=UnsupportedArchError(
            f"jax_dg: `{op.name}`{form} has a DeepGEMM kernel only on {', '.join(sorted(archs))}; "
            f"this GPU is {t.arch}. It runs anywhere as {selection.ENV}=torch (DeepGEMM emulated "
            f"in torch, through the bridge) or {selection.ENV}=xla (the pure-JAX reference)."))
    if deep_gemm.module() is None:
        return Dispatch("raises", f"deep_gemm not importable; {deep_gemm.INSTALL_HINT}",
                        error=deep_gemm.missing_error(op.symbols[0] if op.symbols else op.name))
    found, missing = symbols(op)
    if missing:
        return Dispatch("raises", f"deep_gemm {deep_gemm.version()} lacks {', '.join(missing)}; "
                        f"{selection.ENV}=torch or xla runs the reference",
                        error=deep_gemm.missing_error(missing[0]))
    names = ", ".join(getattr(fn, "__name__", s) for s, fn in found.items())
    return Dispatch("deep_gemm", f"DeepGEMM: {names}{mine}", graph=t.arch in op.graph_safe)
