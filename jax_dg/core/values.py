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
`jax.jit` is refused while tracing), so jax_dg cannot put it inside its ops on its own. On
concrete (eager) values a check raises `jax_dg.ArgumentError` at once. Under jit it is a
custom call of its own (ffi/check.cc: the bool vector and the values copied to the host and read
there, one synchronisation per check) that the checked value passes through, so what reads the
value next runs after it. A failed check fails the jitted call with the error JAX raises for a
failed program (`jax.errors.JaxRuntimeError`, or `ValueError` from jit's C++ fast path: JAX
carries no Python exception type out of a compiled program), whose text is one line, the jax_dg
message: `INVALID_ARGUMENT: op: \\`arg\\` rule, got ...`. (A Python host callback would bury that text
under JAX's "CpuCallback error" line and a traceback of the caller's frames.) It works inside jit and vmap, on every backend: a
debugging mode, not for production steps. The checks run beside the sanitising, which stays in
place, so a failed check never reaches DeepGEMM with a bad value.

The switch is part of jit's cache key (like `use_backend`): a function jitted once is traced
again when called inside `checked()`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dg.core.checks import ArgumentError

TARGET = "jax_dg_check"   # registered with jax_dg's own kernels (ffi/native.cc's table)

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


def _fail(op: str, arg: str, rule: str, ok, values, rows: bool = False) -> None:
    ok, values = np.asarray(ok), np.asarray(values)
    if ok.all():
        return
    where = np.flatnonzero(~ok.reshape(-1))[:4]
    bad = values.reshape(-1)[where] if values.size == ok.size and values.dtype != bool else where
    got = f"rows {where.tolist()} holding {bad.tolist()}" if rows else bad.tolist()
    raise ArgumentError(f"{op}: `{arg}` {rule}, got {got} "
                        f"({int((~ok).sum())} of {ok.size} {'rows break it' if rows else 'entries out of range'})")


def require(op: str, arg: str, ok: Any, rule: str, values: Any = None, rows: bool = False,
            carry: Any = None) -> Any:
    """In checked mode: raise naming `arg` if any entry of the bool array `ok` is False.
    `values` (the same shape as `ok`) supplies the offending entries for the message (else
    their flat positions are given; `rows`: both). Returns `carry` (default: `values`, else
    `ok`) unchanged; traced in checked mode, it comes out of the check, so that what the caller
    computes from it next runs after the check (and XLA keeps the check). Use the result."""
    carry = (ok if values is None else values) if carry is None else carry
    if not checking():
        return carry
    values = ok if values is None else values
    if not any(isinstance(x, jax.core.Tracer) for x in (ok, values, carry)):
        _fail(op, arg, rule, ok, values, rows)
        return carry
    ok = jnp.asarray(ok).reshape(-1)
    values = jnp.asarray(values).reshape(-1)
    shown = (values.astype(jnp.int32) if values.size == ok.size and values.dtype != jnp.bool_
             else jnp.zeros((0,), jnp.int32))   # [0]: the message gives positions
    carry = jnp.asarray(carry)
    check = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(carry.shape, carry.dtype),
                             input_output_aliases={2: 0}, vmap_method="broadcast_all")
    return check(ok.astype(jnp.uint8), shown, carry, message=f"{op}: `{arg}` {rule}", rows=bool(rows))



def key_ranges(op: str, ks, ke, num_keys: int, width: int = 0):
    """(ks, ke), int32 [M], brought into 0 <= ks <= ke <= N (clamps on two [M] vectors, fused by
    XLA): an MQA logits kernel reads keys [ks, ke) unchecked. A row's range becomes
    [clip(ks, 0, N), clip(ke, ks', N)): keys outside [0, N) do not exist, ke <= ks stays an empty
    row. With a `width` (the compressed form) ke is also cut to ks + width, exactly for every
    int32 pair, and never below ks: a longer row would be written into the next one. In checked
    mode ks < 0 or ke > N raises instead, naming cu_seqlen_ks / cu_seqlen_ke."""
    ks = require(op, "cu_seqlen_ks", ks >= 0, "must be >= 0 (a key index)", ks)
    ke = require(op, "cu_seqlen_ke", ke <= num_keys, f"must be <= N = {num_keys} (keys)", ke)
    ks = jax.numpy.clip(ks, 0, num_keys)
    ke = jax.numpy.clip(ke, ks, num_keys)
    if not width:
        return ks, ke
    # ke - ks taken modulo 2**32 (no overflow), then at most width
    span = (jax.lax.bitcast_convert_type(ke, np.uint32)
            - jax.lax.bitcast_convert_type(ks, np.uint32))
    span = jax.numpy.where(ke > ks, jax.numpy.minimum(span, np.uint32(width)), np.uint32(0))
    return ks, ks + span.astype(np.int32)
