"""One op = one declaration; registration, lowering, arch gating and dispatch derive from it.

    FP8_GEMM_NT = Op(
        name="fp8_gemm_nt",
        args=("a", "sfa", "b", "sfb", "c"),   # array arguments, None allowed (absent)
        rule=_rule,          # trace time: (*avals, **static) -> output ShapeDtypeStructs;
                             #   raises ArgumentError naming the argument
        run=_run,            # run time, torch side: (dg, *in_tensors, *out_tensors, **static)
        reference=_ref,      # (*arrays, **static) -> outputs in jax.numpy (oracle, backend "xla")
        symbols=("fp8_gemm_nt",),             # DeepGEMM symbols `run` uses
        aliases={"c": 0},                     # input that XLA may donate to output 0
        archs=frozenset({"sm90", "sm100"}),   # where DeepGEMM has the kernel
        arg_archs={},                         # arguments whose kernel form needs other archs
        graph_safe=frozenset({"sm90"}),       # where the call may be captured into a CUDA graph
        view=None,           # (results, {arg: array}, **static) -> what the op returns, when
                             #   the custom call's results are physical buffers (padded, scratch)
    )

`run` is written against DeepGEMM's own API: `dg` is either the resolved DeepGEMM symbols
(CUDA) or jax_dg's torch reference of the same contract (CPU, or any device when asked), so one
function serves both. Absent optional arguments reach it as None; static attributes arrive as
they were given (tuples stay tuples).

`view` exists for DeepGEMM calls that allocate their own padded output: the rule declares the
custom call's results as DeepGEMM lays them out (so the allocation can land in them, see
jax_dg.core.landing) and `view` cuts the logical arrays out of them in XLA, where the slice
fuses into whatever reads it. Batching, sharding and derivatives all see the viewed outputs.

`graph_safe` names where `run` allocates nothing on torch's side and launches the same work on
every call (DeepGEMM architectures, or "torch" for the torch reference): there the op lowers to
the command-buffer-compatible target, so XLA may capture it into a CUDA graph (see
jax_dg.core.bridge). Everywhere else it keeps the plain handler.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jax_dg import contracts
from jax_dg.core import backend as selection
from jax_dg.core import bridge, device, sharding
from jax_dg.core.checks import Checker, NotDifferentiableError, UnsupportedArchError, is_torch_tensor

DIFFERENTIABLE = ("bf16_gemm_{nt,nn,tn,tt}", "cublaslt_gemm_{nt,nn,tn,tt}", "fp8_linear",
                  "fp8_grouped_linear")


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    name: str
    args: tuple[str, ...]
    rule: Callable[..., Sequence[jax.ShapeDtypeStruct]]
    run: Callable[..., None]
    reference: Callable[..., Any]
    symbols: tuple[str, ...] = ()
    aliases: Mapping[str, int] = dataclasses.field(default_factory=dict)
    archs: frozenset[str] = contracts.DEEP_GEMM_ARCHS
    arg_archs: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    graph_safe: frozenset[str] = frozenset()
    # Reverse-mode rule: (inputs {name: array or None}, output cotangents, **static) ->
    # {name: input cotangent}; absent names get zeros. None: differentiating raises.
    vjp: Callable[..., Mapping[str, Any]] | None = None
    # Batching rule for jax.vmap: (axis_size, batched {name: bool}, inputs {name: array or None},
    # **static) -> outputs with the batch axis first (a vmapped axis folded into the kernel),
    # or None where it cannot fold (then: one call per batch element, in a loop).
    batch: Callable[..., Any] | None = None
    # Sharding rule (jax_dg.core.sharding.Sharding): which dimensions split with no collective,
    # which are contracted; None: XLA gathers the operands and runs the op whole on each device.
    sharding: Any = None
    # The op's outputs from the custom call's results (see the module docstring); None: as they are.
    view: Callable[..., Sequence[Any]] | None = None
    ffi_name: str = dataclasses.field(default="", init=False)   # the custom-call target

    def __post_init__(self):
        object.__setattr__(self, "ffi_name", bridge.register_op(self))

    def needs(self, given: Sequence[str] = ()) -> frozenset[str]:
        """The architectures with a DeepGEMM kernel for a call that passes `given` arguments."""
        archs = self.archs
        for arg in given:
            archs = archs & self.arg_archs.get(arg, archs)
        return archs

    def captures(self, t: device.Target) -> bool:
        """Whether a call traced for `t` uses the command-buffer-compatible target."""
        return (t.backend == "deep_gemm" and t.platform == "cuda" and t.arch in self.graph_safe) \
            or (t.backend == "torch" and "torch" in self.graph_safe)

    def gate(self, given: Sequence[str] = (), t: device.Target | None = None) -> None:
        """Raises UnsupportedArchError while tracing when DeepGEMM is the target and has no
        kernel for this call on the target GPU. Op.__call__ runs it; a public function whose
        own checks depend on the architecture runs it first."""
        t = device.target() if t is None else t
        needs = self.needs(given)
        if t.backend == "deep_gemm" and t.platform == "cuda" and t.arch not in needs:
            with_args = [a for a in given if a in self.arg_archs]
            form = f" with `{'`, `'.join(with_args)}`" if with_args else ""
            raise UnsupportedArchError(
                f"jax_dg: `{self.name}`{form} has a DeepGEMM kernel only on "
                f"{', '.join(sorted(needs))}; this GPU is {device.arch() or t.arch}. Its reference "
                "runs anywhere: JAX_DG_BACKEND=torch (through the bridge) or JAX_DG_BACKEND=xla "
                "(pure JAX).")

    def __call__(self, *arrays: Any, **static: Any):
        if len(arrays) != len(self.args):
            raise TypeError(f"{self.name}: expected {len(self.args)} arrays, got {len(arrays)}")
        for name, a in zip(self.args, arrays):   # before any rule reads them
            if is_torch_tensor(a):
                Checker(self.name).array(a, name)
        self.rule(*arrays, **static)          # the checks, before any backend is chosen
        backend = selection.requested()
        if backend == "xla":
            outs = self.reference(*arrays, **static)
            return outs if isinstance(outs, tuple) else (outs,)
        given = [n for n, a in zip(self.args, arrays) if a is not None]
        t = device.target()
        self.gate(given, t)
        graph = self.captures(t)
        present = "".join("0" if a is None else "1" for a in arrays)
        index = {n: i for i, n in enumerate(given)}
        aliases = {index[n]: o for n, o in self.aliases.items() if n in index}
        site = bridge.encode_site(self.name, backend, present, static, graph)
        target = self.ffi_name + (bridge.GRAPH_SUFFIX if graph else "")
        slots = [a is not None for a in arrays]

        def plain(xs):
            """The custom call itself, for these arrays' shapes (global, or a shard's)."""
            it = iter(xs)
            full = [next(it) if p else None for p in slots]
            types = tuple(self.rule(*full, **static))
            fn = jax.ffi.ffi_call(target, types, input_output_aliases=aliases,
                                  vmap_method="sequential")   # only where no batching rule applies
            outs = tuple(fn(*xs, site=site))
            if self.view is not None:
                outs = tuple(self.view(outs, dict(zip(self.args, full)), **static))
            return outs

        def call(*xs):
            return plain(xs)
        if self.sharding is not None:
            call = sharding.partitioned(self.name, self.sharding, given, static, plain)
        if self.batch is not None or self.sharding is not None:   # custom_partitioning has no vmap
            call = self._with_batching(call, given, static)
        call = self._with_vjp(call, given, static) if self.vjp else self._without_derivative(call)
        return call(*(a for a in arrays if a is not None))

    def _with_batching(self, call, names: list[str], static: dict):
        """`call` under jax.vmap: the record's rule folds the batch into the kernel; where it
        returns None, one call per batch element (lax.map: a loop in the HLO)."""
        f = jax.custom_batching.custom_vmap(call)
        rule = self.batch or (lambda *args, **kwargs: None)

        @f.def_vmap
        def vmap_rule(axis_size, in_batched, *xs):
            outs = rule(axis_size, dict(zip(names, in_batched)), dict(zip(names, xs)), **static)
            if outs is None:
                outs = _sequential(call, axis_size, in_batched, xs)
            return tuple(outs), (True,) * len(outs)
        return f

    def _without_derivative(self, call):
        """`call`, raising NotDifferentiableError (not JAX's generic FFI error) when differentiated."""
        f = jax.custom_jvp(call)
        name = self.name

        def jvp(primals, tangents):
            raise NotDifferentiableError(
                f"jax_dg: `{name}` has no derivative rule. Differentiable jax_dg functions: "
                f"{', '.join(DIFFERENTIABLE)}; or trace the pure-JAX reference with "
                "jax_dg.use_backend('xla') (JAX_DG_BACKEND=xla), which JAX differentiates.")
        f.defjvp(jvp)
        return f

    def _with_vjp(self, call, names: list[str], static: dict):
        """`call` with the record's reverse-mode rule (inputs are saved; outputs are not)."""
        f = jax.custom_vjp(call)
        rule = self.vjp

        def fwd(*xs):
            return call(*xs), xs

        def bwd(xs, cts):
            grads = rule(dict(zip(names, xs)), cts, **static)
            return tuple(_cotangent(x, grads.get(n)) for n, x in zip(names, xs))
        f.defvjp(fwd, bwd)
        return f


def exposes(*ops: Op):
    """Marks a public function as the user-facing form of `ops` (`python -m jax_dg info` reports
    what each public function runs on from them)."""
    def mark(fn):
        fn.__jax_dg_ops__ = ops
        return fn
    return mark


def _cotangent(x, g):
    """The cotangent JAX wants for input x: g, zeros where none was computed, float0 for
    integer inputs."""
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return np.zeros(x.shape, jax.dtypes.float0)
    return jax.numpy.zeros_like(x) if g is None else g.astype(x.dtype)


def _sequential(call, axis_size: int, in_batched, xs):
    """One call per batch element: batched arguments are mapped over, the others closed over."""
    mapped = [x for x, b in zip(xs, in_batched) if b]

    def one(ys):
        it = iter(ys)
        return call(*[next(it) if b else x for x, b in zip(xs, in_batched)])
    return jax.lax.map(one, mapped)


def bcast(x, batched: bool, size: int):
    """x with the vmapped axis in front: as it is when batched, else broadcast (None stays)."""
    return x if batched or x is None else jax.numpy.broadcast_to(x, (size, *x.shape))


def fold_rows(x):
    """[B, M, ...] -> [B * M, ...]: a vmapped axis folded into the rows."""
    return x.reshape(-1, *x.shape[2:])
