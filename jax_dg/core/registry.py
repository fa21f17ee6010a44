"""The op registry: every op jax_dg runs, by name, and the custom-call targets they lower to.

Filled explicitly, once: jax_dg/__init__.py registers its public functions, and with each the
ops it exposes (`exposes`); an op declared anywhere else (a test's, a benchmark's) is
registered by whoever declares it. Declaring an `Op` registers nothing.

Registering an op registers its bridge target with XLA on every platform (and the
command-buffer twin where the op is graph-safe); the first registration also registers
jax_dg's own kernels' targets (jax_dg.core.native). Derived from the registry: the op a
call-site record names (the bridge, the warm-up), the targets export needs, the functions
`python -m jax_dg info` and the documentation check list, and the differentiable functions an
error names.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax  # keep ahead of the extension: loading it first crashes jax's import (see tests)

from jax_dg.core import _bridge, native

GRAPH_SUFFIX = "_graph"   # the command-buffer-compatible twin of an op's target

_OPS: dict[str, Any] = {}          # op name -> Op (test-only ops start with "_")
_PUBLIC: dict[str, Any] = {}       # jax_dg's public names -> objects
_NATIVE: list[str] = []            # jax_dg's own kernels' targets, once registered


def register(*ops: Any) -> None:
    """Registers op records: each op's targets with XLA, and the op by name. Registering the
    same op again changes nothing; another op of a taken name is an error."""
    _register_native()
    for op in ops:
        _add(op)


def register_public(names: Mapping[str, Any]) -> None:
    """Registers jax_dg's public face ({name: object}) and the ops its functions expose
    (`exposes`)."""
    _PUBLIC.update(names)
    register(*(op for obj in names.values() for op in getattr(obj, "__jax_dg_ops__", ())))


def _add(op) -> None:
    known = _OPS.get(op.name)
    if known is op:
        return
    if known is not None:
        raise ValueError(f"jax_dg: two ops are named {op.name!r}")
    if op.run is not None:
        handlers = (_bridge.handlers(), _bridge.graph_handlers() if op.graph_safe else None)
        for suffix, table in zip(("", GRAPH_SUFFIX), handlers):
            for platform, handler in (table or {}).items():
                jax.ffi.register_ffi_target(op.ffi_name + suffix, handler, platform=platform)
    _OPS[op.name] = op


def _register_native() -> None:
    if _NATIVE:
        return
    for target, handlers in native.handlers().items():
        for platform, capsule in handlers.items():
            jax.ffi.register_ffi_target(target, capsule, platform=platform)
        _NATIVE.append(target)


def op(name: str):
    """The registered op of that name (what a call-site record names)."""
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"jax_dg: no op {name!r} is registered (jax_dg.core.registry.register)") from None


def is_registered(op) -> bool:
    return _OPS.get(op.name) is op


def ops() -> dict[str, Any]:
    """Every registered op by name (test-only ops start with "_")."""
    return dict(_OPS)


def public() -> dict[str, Any]:
    """jax_dg's public names and what they are (functions, classes, the `paged` and `interop`
    modules' functions as "paged.<name>", ...)."""
    return dict(_PUBLIC)


def functions() -> dict[str, Callable]:
    """The public functions, by name (what `python -m jax_dg info` and docs/api.md list)."""
    return {n: f for n, f in _PUBLIC.items() if callable(f) and not isinstance(f, type)}


def targets() -> list[str]:
    """Every custom-call target jax_dg registered: the bridge's, with the command-buffer twins
    of graph-safe ops, and jax_dg's own kernels'."""
    bridge = [op.ffi_name + suffix for op in _OPS.values() if op.run is not None
              for suffix in ("", GRAPH_SUFFIX) if op.graph_safe or not suffix]
    return sorted(set(bridge) | set(_NATIVE))


def differentiable() -> list[str]:
    """The registered public functions jax.grad goes through: those marked differentiable and
    those whose every op declares a reverse-mode rule."""
    return sorted(name for name, fn in functions().items() if hasattr(fn, "__jax_dg_ops__")
                  and (fn.__jax_dg_differentiable__
                       or all(op.vjp is not None for op in fn.__jax_dg_ops__)))
