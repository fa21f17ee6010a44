"""Trace-time argument checks: each failure names the op, the argument and the rule."""

from __future__ import annotations

from typing import Any, Iterable

import jax.numpy as jnp
import numpy as np


class ArgumentError(ValueError):
    """Bad input to a jax_dg op, caught while tracing."""


class UnsupportedArchError(RuntimeError):
    """The op has no DeepGEMM kernel on the target GPU's architecture (raised while tracing;
    JAX_DG_BACKEND=torch or xla runs its reference instead)."""


class UnsupportedBackendError(RuntimeError):
    """The backend asked for cannot run here (DeepGEMM on a machine without a CUDA device)."""


class NotDifferentiableError(TypeError):
    """jax.grad / jvp / vjp reached a jax_dg op that has no derivative rule (raised while
    tracing, naming the op and what is differentiable instead)."""


def is_torch_tensor(x: Any) -> bool:
    """Whether x is a torch tensor (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "data_ptr")


INT32_LIMIT = 1 << 31


class Checker:
    """Collects the checks of one op call; `fail` raises ArgumentError("op: `arg` rule, got ...")."""

    def __init__(self, op: str):
        self.op = op

    def fail(self, arg: str, rule: str, got: Any = None) -> None:
        msg = f"{self.op}: `{arg}` {rule}"
        if got is not None:
            msg += f", got {got}"
        raise ArgumentError(msg)

    def that(self, ok: bool, arg: str, rule: str, got: Any = None) -> None:
        if not ok:
            self.fail(arg, rule, got)

    def array(self, x: Any, arg: str) -> None:
        if is_torch_tensor(x):
            self.fail(arg, "must be a jax.Array, not a torch tensor: convert it with "
                      "jax_dg.tools.interop.to_jax (zero-copy), or call the function through "
                      "jax_dg.tools.interop.torch_callable", type(x).__name__)
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            self.fail(arg, "must be an array", type(x).__name__)

    def dtype(self, x: Any, arg: str, *allowed: Any) -> None:
        self.array(x, arg)
        names = [jnp.dtype(d).name for d in allowed]
        self.that(jnp.dtype(x.dtype).name in names, arg,
                  f"must have dtype {' or '.join(names)}", jnp.dtype(x.dtype).name)

    def ndim(self, x: Any, arg: str, ndim: int, layout: str) -> None:
        self.array(x, arg)
        self.that(len(x.shape) == ndim, arg, f"must be {ndim}-D {layout}", tuple(x.shape))

    def shape(self, x: Any, arg: str, expected: Iterable[int], rule: str) -> None:
        self.array(x, arg)
        # ints stay ints; symbolic dimensions (jax.export) stay symbolic
        expected = tuple(int(e) if isinstance(e, (int, np.integer)) else e for e in expected)
        self.that(tuple(x.shape) == expected, arg, f"must have shape {rule} = {expected}",
                  tuple(x.shape))

    def tensor(self, x: Any, arg: str, dtypes: Iterable[Any], shape: Iterable[int], rule: str):
        self.dtype(x, arg, *dtypes)
        self.shape(x, arg, shape, rule)

    def pair(self, x: Any, arg: str, second_optional: bool = False) -> tuple[Any, Any]:
        """Unpacks vLLM's wrapper's (values, scales) tuple convention."""
        if not isinstance(x, (tuple, list)) or len(x) != 2:
            self.fail(arg, "must be a (values, scales) pair", type(x).__name__)
        if x[1] is None and not second_optional:
            self.fail(f"{arg}[1]", "(scales) must be given")
        return x[0], x[1]

    def floating(self, x: Any, arg: str) -> None:
        """An array of a floating dtype (before anything converts it)."""
        self.array(x, arg)
        self.that(jnp.issubdtype(x.dtype, jnp.floating), arg, "must have a floating dtype",
                  jnp.dtype(x.dtype).name)

    def integer(self, x: Any, arg: str) -> None:
        """An array of an integer dtype, bool excluded (before anything converts it)."""
        self.array(x, arg)
        self.that(jnp.issubdtype(x.dtype, jnp.integer), arg, "must have an integer dtype",
                  jnp.dtype(x.dtype).name)

    def dtype_name(self, v: Any, arg: str) -> str:
        """The jnp name of a dtype given as a dtype, a type or a string (ArgumentError if none)."""
        try:
            return jnp.dtype(v).name
        except (TypeError, ValueError):
            self.fail(arg, "must be a dtype (e.g. jnp.bfloat16 or 'float32')", repr(v))

    def static_float(self, v: Any, arg: str) -> float:
        """A static Python number (not bool, not traced), as a float."""
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            self.fail(arg, "must be a static Python number", type(v).__name__)
        return float(v)

    def static_bool(self, v: Any, arg: str) -> bool:
        """A static Python bool (bool() would take 'no', 0.5 or an array's truth)."""
        if not isinstance(v, (bool, np.bool_)):
            self.fail(arg, "must be a Python bool", type(v).__name__)
        return bool(v)

    def recipe(self, v: Any, arg: str = "recipe", two: bool = False) -> tuple[int, ...]:
        """A (gran_m, gran_n, gran_k) triple of positive static ints; with `two`, also a
        (gran_mn, gran_k) pair. Never truncated (int(128.5) would be 128)."""
        sizes = (2, 3) if two else (3,)
        if not isinstance(v, (tuple, list)) or len(v) not in sizes or not all(
                isinstance(r, (int, np.integer)) and not isinstance(r, (bool, np.bool_)) and r > 0
                for r in v):
            form = ("two or three positive ints, (gran_mn, gran_k) or (gran_m, gran_n, gran_k)"
                    if two else "three positive ints (gran_m, gran_n, gran_k)")
            self.fail(arg, f"must be a tuple of {form}", repr(v))
        return tuple(int(r) for r in v)

    def compiled_dims(self, v: Any, arg: str = "compiled_dims") -> str | None:
        """DeepGEMM's `compiled_dims`: the GEMM dims (distinct letters of 'mnk') compiled into
        the kernel as constants; it changes speed, never results. None: DeepGEMM's default."""
        if v is None:
            return None
        self.that(isinstance(v, str) and set(v) <= set("mnk") and len(set(v)) == len(v), arg,
                  "must be a static string of distinct letters of 'mnk' (e.g. 'nk', 'mn')", repr(v))
        return v

    def dim(self, v: Any, arg: str, minimum: int | None = None) -> Any:
        """A static int size, or a symbolic dimension (jax.export), which stays symbolic."""
        if type(v).__module__.startswith("jax") and not hasattr(v, "shape"):   # not a tracer
            return v
        return self.static_int(v, arg, minimum)

    def static_int(self, v: Any, arg: str, minimum: int | None = None) -> int:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            self.fail(arg, "must be a static Python int (it sizes an output)", type(v).__name__)
        v = int(v)
        if minimum is not None:
            self.that(v >= minimum, arg, f"must be >= {minimum}", v)
        self.that(-INT32_LIMIT <= v < INT32_LIMIT, arg,
                  "must fit 32 bits (DeepGEMM's and the kernels' int arguments)", v)
        return v
