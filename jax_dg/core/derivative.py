"""Derivatives of jax_dg's calls: the one backward mechanism (a record's reverse-mode rule
turned into jax.custom_vjp) and the error raised where a call has none.

Every differentiable jax_dg function goes through `with_vjp`: an Op whose record declares a
`vjp`, and the composed layers (jax_dg.ops.linear) alike.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jax_dg.core import registry
from jax_dg.core.checks import NotDifferentiableError

# A reverse-mode rule: (inputs {name: array}, output cotangents[, saved], **static) ->
# {name: input cotangent}; absent names (or None) get zeros (float0 for integer inputs).
Rule = Callable[..., Mapping[str, Any]]


def with_vjp(call: Callable, names: Sequence[str], rule: Rule, static: Mapping[str, Any],
             save: Callable[..., Any] | None = None,
             save_primal: Callable[..., Any] | None = None) -> Callable:
    """`call` over arrays xs (named `names`), with `rule` as its reverse mode (jax.custom_vjp).

    Without `save`: the outputs are `call(*xs)`, the forward pass keeps the inputs, and the
    backward pass runs `rule(inputs, cts, **static)`.

    With `save`: `saved = save(*xs)` (any pytree of arrays) is computed once per forward pass,
    the outputs are `call(*xs, saved)`, and the backward pass runs
    `rule(inputs, cts, saved, **static)`: what both directions read (e.g. an operand quantised
    for the forward GEMM and reused, transposed, by the dgrad) is neither computed twice nor
    recomputed in the backward pass. Not differentiated, the function is call(*xs, save(*xs)),
    or call(*xs, save_primal(*xs)) when given: the part of `saved` the forward GEMM reads (what
    only the backward reads, e.g. transposed casts, is then not computed for inference).

    `inputs` is {name: x}; `cts` has the structure of the outputs; `static` (non-array
    arguments) is closed over by `call` and `save` and handed to `rule` as keywords. The rule
    returns {name: cotangent}: cast to the input's dtype, zeros where absent or None, float0
    for integer inputs (entries for names not in `names`, i.e. absent optional arguments, are
    ignored).
    """
    names = tuple(names)
    if save is None:
        forward = call
    else:
        def forward(*xs):
            return call(*xs, (save_primal or save)(*xs))
    f = jax.custom_vjp(forward)

    def fwd(*xs):
        if save is None:
            return call(*xs), (xs, None)
        saved = save(*xs)
        return call(*xs, saved), (xs, saved)

    def bwd(res, cts):
        xs, saved = res
        inputs = dict(zip(names, xs))
        grads = rule(inputs, cts, **static) if save is None else rule(inputs, cts, saved, **static)
        return tuple(cotangent(x, grads.get(n)) for n, x in zip(names, xs))
    f.defvjp(fwd, bwd)
    return f


def without_derivative(name: str, call: Callable) -> Callable:
    """`call`, raising NotDifferentiableError (not JAX's generic FFI error) when differentiated;
    an op whose outputs are all integers (indices, schedules) has none to give and differentiates
    as jnp.argmax does: float0 tangents, so a model around it trains."""
    f = jax.custom_jvp(call)

    def jvp(primals, tangents):
        out = call(*primals)
        leaves = jax.tree.leaves(out)
        if leaves and not any(jax.numpy.issubdtype(o.dtype, jax.numpy.inexact) for o in leaves):
            return out, jax.tree.map(lambda o: np.zeros(o.shape, jax.dtypes.float0), out)
        raise NotDifferentiableError(
            f"jax_dg: `{name}` has no derivative rule. Differentiable jax_dg functions: "
            f"{', '.join(registry.differentiable())}; or trace the pure-JAX reference with "
            "jax_dg.use_backend('xla') (JAX_DG_BACKEND=xla), which JAX differentiates.")
    f.defjvp(jvp)
    return f


def cotangent(x, g):
    """The cotangent JAX wants for input x: g, zeros where none was computed, float0 for
    integer inputs, None for an absent input."""
    if x is None:
        return None
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return np.zeros(x.shape, jax.dtypes.float0)
    return jax.numpy.zeros_like(x) if g is None else g.astype(x.dtype)
