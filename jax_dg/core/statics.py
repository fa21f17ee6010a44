"""An op's statics as one declared record (jax_dg.core.op.Op.statics): what a record function
receives of them.

Every function of an op record (shapes, run, reference, finish, batch, sharding layout, vjp)
is called with only the statics it names as keyword-only parameters (all of them if it takes
**kwargs; the shape rule may also name `target`, the run function and the finish the plan's
entries). So a static is declared once, on the op, and reaches exactly the functions that use
it: adding one changes no other signature.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping

REQUIRED = inspect.Parameter.empty   # a declared static without a default


@functools.cache
def _keywords(fn: Callable) -> frozenset[str] | None:
    """The keyword-only parameters `fn` takes (None: it takes any keyword, **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY)


def pick(fn: Callable, static: Mapping[str, Any]) -> dict:
    """The statics `fn` names: every record function receives only those, so a static added to
    an op's declaration reaches the functions that use it and no other signature changes."""
    names = _keywords(fn)
    return dict(static) if names is None else {k: v for k, v in static.items() if k in names}
