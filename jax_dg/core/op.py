"""One op = one declaration; checking, planning, lowering, dispatch and transforms derive from it.

    FP8_GEMM_NT = Op(
        name="fp8_gemm_nt",
        args=("a", "sfa", "b", "sfb", "c"),   # array arguments, None allowed (absent)
        statics={"out_dtype": REQUIRED, "recipe": REQUIRED, "compiled_dims": None},
                             # the call's static arguments: name -> default (REQUIRED: none)
        shapes=_shapes,      # trace time: (*avals, **the statics it names, and `target`, the
                             #   call's jax_dg.core.device.Target, if it names it) -> the result
                             #   types, or shaped(types, **plan): with what the run function
                             #   and the finish need decided (layouts, landing); checks the
                             #   arguments, raising ArgumentError naming one
        run=_run,            # run time, torch side: (rt, *in_tensors, *out_tensors, the statics
                             #   and plan entries it names): the DeepGEMM call (rt.dg), no
                             #   decision; rt: jax_dg.runtime.run.Run
        reference=_ref,      # (*arrays, **statics it names) -> outputs in jax.numpy (the
                             #   oracle, backend "xla")
        symbols=("fp8_gemm_nt",),             # DeepGEMM symbols `run` uses
        aliases={"c": 0},                     # input that XLA may donate to result 0
        archs=frozenset({"sm90", "sm100"}),   # where DeepGEMM has the kernel
        arg_archs={},                         # arguments whose kernel form needs other archs
        graph_safe=frozenset({"sm90"}),       # where the call may be captured into a CUDA graph
        finish=None,         # (results, {arg: array}, **statics and plan entries it names) ->
                             #   what the op returns, in XLA: slices of padded results,
                             #   jax_dg's own kernels that follow
    )

Every record function receives exactly the statics (and plan entries) it names as keyword-only
parameters (jax_dg.core.statics.pick): a static is declared once, in `statics`, and reaches the
functions that use it.

An op runs either DeepGEMM through the bridge (`run`, written against DeepGEMM's API: `rt.dg` is
the resolved DeepGEMM symbols on CUDA or the torch emulation of the same contract; `rt` gives
the torch-side helpers, so an op module imports no torch) or one of jax_dg's own kernels
(`native`: the lowering to its typed FFI handler, jax_dg.core.native, with no Python at run
time). `jax_dg.core.dispatch.resolve` decides which, once, while tracing.

A call is checked, shaped and planned once (`Op.bind`), for one target (jax_dg.core.device:
platform, backend, architecture, SM count, DeepGEMM version) computed once, and carried to the
bridge as one call-site record (jax_dg.core.site); a shard under custom_partitioning is shaped
and planned for its own shapes. `finish` composes in XLA what follows the custom call: the
logical view of a padded result, or a native kernel over it (the -inf fill, the top-k).
Batching, sharding and derivatives see the finished outputs.

`graph_safe` names where `run` allocates nothing on torch's side and launches the same work on
every call (DeepGEMM architectures, or "torch" for the torch emulation): there the op lowers to
the command-buffer-compatible target, so XLA may capture it into a CUDA graph (see
jax_dg.runtime.bridge). Native ops are always capture-safe on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax

from jax_dg import contracts
from jax_dg.core import derivative, device, dispatch, registry, sharding
from jax_dg.core.checks import Checker, is_torch_tensor
from jax_dg.core.site import Site
from jax_dg.core.statics import REQUIRED, pick  # noqa: F401  (REQUIRED: for records)


@dataclasses.dataclass(frozen=True)
class Shaped:
    """What a shape rule decided: the call's result types and its plan (entries the run
    function and the finish receive as keywords where they name them)."""
    types: tuple
    plan: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def shaped(types: Sequence[jax.ShapeDtypeStruct], **plan: Any) -> Shaped:
    """A shape rule's result with its plan: `return shaped([out], lands=True)`."""
    return Shaped(tuple(types), plan)


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    name: str
    args: tuple[str, ...]
    # The op's statics, one record: name -> default (REQUIRED: none). A call passes only
    # declared names; each record function receives the ones it names (pick).
    statics: Mapping[str, Any]
    shapes: Callable[..., Sequence[jax.ShapeDtypeStruct] | Shaped]
    reference: Callable[..., Any]
    run: Callable[..., None] | None = None
    native: Callable[..., Any] | None = None
    symbols: tuple[str, ...] = ()
    # jax_dg's own kernels the op launches (jax_dg.core.native): its native lowering, or what
    # its finish composes after DeepGEMM's call (e.g. the -inf fill)
    own_kernels: tuple[str, ...] = ()
    aliases: Mapping[str, int] = dataclasses.field(default_factory=dict)
    archs: frozenset[str] = contracts.DEEP_GEMM_ARCHS
    arg_archs: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    graph_safe: frozenset[str] = frozenset()
    # Reverse-mode rule (jax_dg.core.derivative.with_vjp): (inputs {name: array or None},
    # output cotangents, **static) -> {name: input cotangent}. None: differentiating raises.
    vjp: Callable[..., Mapping[str, Any]] | None = None
    # Batching rule for jax.vmap: (axis_size, batched {name: bool}, inputs {name: array or None},
    # **static) -> outputs with the batch axis first (a vmapped axis folded into the kernel),
    # or None where it cannot fold (then: one call per batch element, in a loop).
    batch: Callable[..., Any] | None = None
    # Sharding rule (jax_dg.core.sharding.Sharding): which dimensions split with no collective,
    # which are contracted; None: XLA gathers the operands and runs the op whole on each device.
    sharding: Any = None
    finish: Callable[..., Sequence[Any]] | None = None

    def __post_init__(self):
        if (self.run is None) == (self.native is None):
            raise TypeError(f"Op {self.name}: give exactly one of run (DeepGEMM through the "
                            "bridge) and native (jax_dg's own kernel)")
        if self.native is not None and not self.own_kernels:
            raise TypeError(f"Op {self.name}: a native op names its kernel in own_kernels")
        if not isinstance(self.statics, Mapping):
            raise TypeError(f"Op {self.name}: declare its statics, {{name: default}} ({{}}: none)")

    @property
    def ffi_name(self) -> str:
        """The bridge's custom-call target of a DeepGEMM op (jax_dg.core.registry registers it)."""
        return f"jax_dg_{self.name}"

    def complete(self, static: Mapping[str, Any]) -> dict:
        """The call's statics checked against the declaration, defaults filled in."""
        unknown = sorted(set(static) - set(self.statics))
        missing = sorted(k for k, d in self.statics.items() if d is REQUIRED and k not in static)
        if unknown or missing:
            raise TypeError(f"{self.name}: " + "; ".join(
                ([f"unknown static(s) {', '.join(unknown)}"] if unknown else [])
                + ([f"missing static(s) {', '.join(missing)}"] if missing else []))
                + f" (declared: {', '.join(self.statics) or 'none'})")
        return {**{k: d for k, d in self.statics.items() if d is not REQUIRED}, **static}

    def shape(self, arrays: Sequence[Any], static: Mapping[str, Any], t: device.Target) -> Shaped:
        """The shape rule's result types and plan for these arrays on target `t`."""
        out = self.shapes(*arrays, **pick(self.shapes, {**static, "target": t}))
        out = out if isinstance(out, Shaped) else Shaped(tuple(out))
        assert not out.plan.keys() & static.keys(), f"{self.name}: a plan entry shadows a static"
        return out

    def bind(self, *arrays: Any, target: device.Target | None = None, **static: Any) -> "Call":
        """The call checked, shaped and planned (once) for `target` (default: the target of a
        function traced now): inspect `.types`, then call it."""
        if len(arrays) != len(self.args):
            raise TypeError(f"{self.name}: expected {len(self.args)} arrays, got {len(arrays)}")
        for name, a in zip(self.args, arrays):   # before the shape function reads them
            if is_torch_tensor(a):
                Checker(self.name).array(a, name)
        static = self.complete(static)
        t = device.target() if target is None else target
        out = self.shape(arrays, static, t)
        return Call(self, arrays, static, t, out.types, out.plan)

    def __call__(self, *arrays: Any, target: device.Target | None = None, **static: Any):
        return self.bind(*arrays, target=target, **static)()

    def gate(self, t: device.Target, given: Sequence[str] = ()) -> None:
        """Raises while tracing what a call passing `given` arguments would raise on target `t`
        (UnsupportedArchError, a missing DeepGEMM): for a public function whose own checks
        depend on the architecture."""
        dispatch.resolve(self, given, t).check()


@dataclasses.dataclass(frozen=True)
class Call:
    """One traced call of an op: its arguments, statics, target, result types and plan."""
    op: Op
    arrays: tuple
    static: Mapping[str, Any]
    target: device.Target
    types: tuple
    plan: Mapping[str, Any]

    def __call__(self):
        op, static = self.op, dict(self.static)
        given = [n for n, a in zip(op.args, self.arrays) if a is not None]
        how = dispatch.resolve(op, given, self.target).check()
        if how.runs == "xla":
            outs = op.reference(*self.arrays, **pick(op.reference, static))
            return outs if isinstance(outs, tuple) else (outs,)
        plain = self._native() if how.runs == "native" else self._bridged(how, given)
        call = lambda *xs: plain(xs)   # noqa: E731
        if op.sharding is not None:
            call = sharding.partitioned(op.name, op.sharding, given,
                                        pick(op.sharding.layout, static), plain)
        if op.batch is not None or op.sharding is not None:   # custom_partitioning has no vmap
            call = _with_batching(op, call, given, pick(op.batch, static) if op.batch else {})
        call = (derivative.with_vjp(call, given, op.vjp, pick(op.vjp, static)) if op.vjp
                else derivative.without_derivative(op.name, call))
        return call(*(a for a in self.arrays if a is not None))

    def _full(self, xs):
        it = iter(xs)
        return [next(it) if a is not None else None for a in self.arrays]

    def _finish(self, outs, full, plan):
        if self.op.finish is not None:
            outs = self.op.finish(outs, dict(zip(self.op.args, full)),
                                  **pick(self.op.finish, {**self.static, **plan}))
        return tuple(outs)

    def _native(self):
        traced = _avals(self.arrays)

        def plain(xs):
            """The native call for these arrays' shapes (the traced ones, or a shard's): its
            lowering receives the result types if it names `types`."""
            full = self._full(xs)
            types = (self.types if _avals(full) == traced
                     else self.op.shape(full, self.static, self.target).types)
            outs = self.op.native(*full, **pick(self.op.native, {**self.static, "types": types}))
            return self._finish(outs if isinstance(outs, (tuple, list)) else (outs,), full, {})
        return plain

    def _bridged(self, how: dispatch.Dispatch, given: list[str]):
        op, static = self.op, self.static
        if not registry.is_registered(op):
            raise RuntimeError(f"jax_dg: op `{op.name}` is not registered "
                               "(jax_dg.core.registry.register)")
        index = {n: i for i, n in enumerate(given)}
        aliases = {index[n]: o for n, o in op.aliases.items() if n in index}
        traced = _avals(self.arrays)
        # a call whose allocation cannot land (a symbolic row count) copies through torch's
        # allocator: the plain target, never captured
        graph = how.graph and self.plan.get("lands", True)
        target = op.ffi_name + (registry.GRAPH_SUFFIX if graph else "")

        def site_of(full, plan):
            return Site(op.name, how.backend, tuple(a is not None for a in full), graph,
                        pick(op.run, {**static, **plan})).encode()
        here = (self.types, self.plan, site_of(self.arrays, self.plan))

        def plain(xs):
            """The custom call for these arrays' shapes: the traced ones, or a shard's."""
            full = self._full(xs)
            if _avals(full) == traced:
                types, plan, site = here
            else:   # a shard (custom_partitioning): its own shapes and plan
                out = op.shape(full, static, self.target)
                types, plan, site = out.types, out.plan, site_of(full, out.plan)
            fn = jax.ffi.ffi_call(target, types, input_output_aliases=aliases,
                                  vmap_method="sequential")   # only where no batching rule applies
            return self._finish(fn(*xs, site=site), full, plan)
        return plain


def composed(base: Op, *, name: str, statics: Mapping[str, Any],
             base_static: Callable[..., Mapping[str, Any]], **fields: Any) -> Op:
    """An op that makes `base`'s DeepGEMM call (its shape rule and plan, run, symbols,
    architectures and graph safety) and composes its own `finish` after it, e.g. the indexer:
    the logits call, then jax_dg's top-k over the scratch it lands in. `base_static(**static)`
    maps this op's statics to base's (the plan's entries, passed as keywords too, pass through)."""
    def shapes(*arrays, target, **static):
        return base.shapes(*arrays, **pick(base.shapes, {**base_static(**static), "target": target}))

    def run(rt, *buffers, **static):
        base.run(rt, *buffers, **pick(base.run, base_static(**static)))
    return Op(name=name, args=base.args, statics=statics, shapes=shapes, run=run,
              symbols=base.symbols, archs=base.archs, arg_archs=base.arg_archs,
              graph_safe=base.graph_safe, **fields)


def exposes(*ops: Op, differentiable: bool = False):
    """Marks a public function as the user-facing form of `ops`: registering the function
    (jax_dg.core.registry) registers them, and `python -m jax_dg info` reports what it runs on
    from them. `differentiable`: jax.grad goes through it (its own rule, jax_dg.core.derivative),
    though its ops declare none."""
    def mark(fn):
        fn.__jax_dg_ops__ = ops
        fn.__jax_dg_differentiable__ = differentiable
        return fn
    return mark


def _avals(arrays) -> tuple:
    return tuple(None if a is None else (tuple(a.shape), str(a.dtype)) for a in arrays)


def _with_batching(op: Op, call, names: list[str], static: dict):
    """`call` under jax.vmap: the record's rule folds the batch into the kernel; where it
    returns None, one call per batch element (lax.map: a loop in the HLO)."""
    f = jax.custom_batching.custom_vmap(call)
    rule = op.batch or (lambda *args, **kwargs: None)

    @f.def_vmap
    def vmap_rule(axis_size, in_batched, *xs):
        outs = rule(axis_size, dict(zip(names, in_batched)), dict(zip(names, xs)), **static)
        if outs is None:
            outs = _sequential(call, axis_size, in_batched, xs)
        return tuple(outs), (True,) * len(outs)
    return f


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
