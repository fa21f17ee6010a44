"""Index values the shape functions cannot see: sanitised by default, checked on request.

Some arguments are data that DeepGEMM uses as addresses (MQA key ranges, paged block tables
and lengths, grouped-layout ids, masked_m, the gate's fixed routing and expert counts). Their
values are unknown while tracing, so `ArgumentError` cannot catch them and DeepGEMM does not
check them: out of range, they are out-of-bounds reads or writes on the GPU.

By default each op brings such a vector into range in the jitted program (a clamp or select
on the small index vector, fused by XLA; never a pass over a large operand) and documents the
result of an out-of-range value, on every backend. Under `checked()` (or JAX_DG_CHECK_VALUES=1)
the same ops also raise instead, naming the argument and the rule.

How the checked mode raises. `jax.experimental.checkify` would need every caller to wrap the
whole program in `checkify.checkify(...)` and call `err.throw()` (a bare `checkify.check` inside
`jax.jit` is refused while tracing), so jax_dg cannot put it inside its ops on its own. Here a
check is a host callback (`jax.debug.callback`, one small device-to-host copy of a bool vector
per check and a host round trip): it works inside jit and vmap, around the FFI bridge on every
backend, and raises from the jitted call itself -- on concrete (eager) values as
`jax_dg.ArgumentError`, under jit as the runtime error XLA raises for a failed callback, whose
message carries the same text (`op: \\`arg\\` rule, got ...`). It costs a synchronisation per
check: a debugging mode, not for production steps (and not for jax.export: callbacks are not
serialisable). The checks run after the sanitising, which stays in place, so a failed check
never reaches DeepGEMM with a bad value.

The switch is part of jit's cache key (like `use_backend`): a function jitted once is traced
again when called inside `checked()`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import numpy as np

from jax_dg.core.checks import ArgumentError

ENV = "JAX_DG_CHECK_VALUES"

_context = jax.make_user_context(default_value=None)


def checking() -> bool:
    """Whether ops traced now check index values (the innermost `checked`, else the env var)."""
    value = _context.value
    if value is not None:
        return value
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def checked(enabled: bool = True):
    """Ops traced (or called through jit) inside the block raise when a data-dependent index
    is out of range, naming the argument and its rule, instead of sanitising it silently.
    See jax_dg.core.values for how and what it costs."""
    with _context(bool(enabled)):
        yield


def _fail(op: str, arg: str, rule: str, ok, values) -> None:
    ok, values = np.asarray(ok), np.asarray(values)
    if ok.all():
        return
    where = np.flatnonzero(~ok.reshape(-1))[:4]
    bad = values.reshape(-1)[where] if values.size == ok.size and values.dtype != bool else where
    raise ArgumentError(f"{op}: `{arg}` {rule}, got {bad.tolist()} "
                        f"({int((~ok).sum())} of {ok.size} entries out of range)")


def require(op: str, arg: str, ok: Any, rule: str, values: Any = None) -> None:
    """In checked mode: raise naming `arg` if any entry of the bool array `ok` is False.
    `values` (the same shape as `ok`) supplies the offending entries for the message (else
    their flat positions are given). A no-op otherwise."""
    if not checking():
        return
    values = ok if values is None else values
    if not isinstance(ok, jax.core.Tracer) and not isinstance(values, jax.core.Tracer):
        _fail(op, arg, rule, ok, values)
        return
    jax.debug.callback(lambda o, v: _fail(op, arg, rule, o, v), ok, values)


def key_ranges(op: str, ks, ke, num_keys: int, width: int = 0):
    """(ks, ke), int32 [M], brought into 0 <= ks <= ke <= N (clamps on two [M] vectors, fused by
    XLA): an MQA logits kernel reads keys [ks, ke) unchecked. A row's range becomes
    [clip(ks, 0, N), clip(ke, ks', N)): keys outside [0, N) do not exist, ke <= ks stays an empty
    row. With a `width` (the compressed form) ke is also cut to ks + width, exactly for every
    int32 pair, and never below ks: a longer row would be written into the next one. In checked
    mode ks < 0 or ke > N raises instead, naming cu_seqlen_ks / cu_seqlen_ke."""
    require(op, "cu_seqlen_ks", ks >= 0, "must be >= 0 (a key index)", ks)
    require(op, "cu_seqlen_ke", ke <= num_keys, f"must be <= N = {num_keys} (keys)", ke)
    ks = jax.numpy.clip(ks, 0, num_keys)
    ke = jax.numpy.clip(ke, ks, num_keys)
    if not width:
        return ks, ke
    # ke - ks taken modulo 2**32 (no overflow), then at most width
    span = (jax.lax.bitcast_convert_type(ke, np.uint32)
            - jax.lax.bitcast_convert_type(ks, np.uint32))
    span = jax.numpy.where(ke > ks, jax.numpy.minimum(span, np.uint32(width)), np.uint32(0))
    return ks, ks + span.astype(np.int32)
