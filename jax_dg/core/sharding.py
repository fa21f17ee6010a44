"""Sharding rules derived from an op's record: how its arrays split over a mesh under jit.

An op declares, per array dimension, a factor name, and which factors split with no collective
(`free`: rows of a GEMM, columns, expert groups, requests), which are contracted (`reduce`:
a sharded K gives partial outputs and one psum), and which follow another factor (`tied`:
scale blocks follow the dimension they scale). Everything else is replicated. From that,
`partitioned` builds a `jax.experimental.custom_partitioning` with a Shardy sharding rule
(Shardy is the default partitioner of jax 0.10 and 0.11; the GSPMD callback is derived too):
each shard runs the op's plain custom call on its local arrays, on its own device and stream.
Shapes that do not split evenly (or not into whole scale blocks) raise ArgumentError while
compiling, naming the op, the dimension and the rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_dg.core.checks import ArgumentError

# A tied factor's size from its primary's: "blocks" ceil(p / q), "aligned" align(p, q), "times" p * q.
TIE_KINDS = ("blocks", "aligned", "times")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The factors of one call (they may depend on the static attributes)."""
    args: Mapping[str, str]                  # array argument -> "f1 f2 ..." (one factor per dim)
    outs: Sequence[str]                      # one factor string per output
    multiple: Mapping[str, int] = dataclasses.field(default_factory=dict)  # local size % q == 0


@dataclasses.dataclass(frozen=True)
class Sharding:
    layout: Callable[..., Layout]            # (present argument names, **static) -> Layout
    free: frozenset[str]
    reduce: frozenset[str] = frozenset()
    tied: Mapping[str, tuple[str, str, int]] = dataclasses.field(default_factory=dict)
    # factor -> arguments that make sharding it wrong: an accumulator a sharded K would add once
    # per shard, a schedule computed for the whole batch
    forbid: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)


def _spec(sharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return (spec + (None,) * ndim)[:ndim]


def _size(mesh, axes) -> int:
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    n = 1
    for a in names:
        n *= mesh.shape[a]
    return n


def plan(op_name: str, rule: Sharding, layout: Layout, names: Sequence[str], mesh,
         shapes: Sequence[tuple[int, ...]], shardings: Sequence[Any]):
    """(primary factor -> mesh axes, arg PartitionSpecs, out PartitionSpecs, reduced axes) for a
    call whose operands arrive with `shardings`; raises ArgumentError for shapes that do not split."""
    primary = lambda f: rule.tied[f][0] if f in rule.tied else f   # noqa: E731
    axes: dict[str, Any] = {}
    used: set = set()
    for name, shape, sharding in zip(names, shapes, shardings):
        for factor, ax in zip(layout.args[name].split(), _spec(sharding, len(shape))):
            f = primary(factor)
            if ax is None or f in axes or (f not in rule.free and f not in rule.reduce):
                continue
            flat = ax if isinstance(ax, tuple) else (ax,)
            if used & set(flat) or _size(mesh, ax) == 1:
                continue                          # a mesh axis shards one factor at most
            axes[f] = ax
            used |= set(flat)
    sizes: dict[str, int] = {}
    for name, shape in zip(names, shapes):
        for factor, n in zip(layout.args[name].split(), shape):
            sizes.setdefault(factor, n)
    for f, ax in list(axes.items()):
        d = _size(mesh, ax)
        n = sizes[f]
        need = [layout.multiple.get(f, 1)] + [q for t, (p, kind, q) in rule.tied.items()
                                              if p == f and kind != "times" and t in sizes]
        for q in need:
            if n % (d * q):
                raise ArgumentError(
                    f"{op_name}: dimension `{f}` = {n} cannot be sharded {d} ways: each shard must "
                    f"hold a multiple of {q} (got {n / d:g}); shard it fewer ways or replicate it")
        blocking = sorted(a for a in rule.forbid.get(f, ()) if a in names)
        if blocking:
            raise ArgumentError(f"{op_name}: dimension `{f}` cannot be sharded with "
                                f"`{'`, `'.join(blocking)}` given (it describes the whole, not a "
                                "shard); replicate that dimension, or leave the argument out")
    part = lambda dims: PartitionSpec(*[axes.get(primary(f)) for f in dims.split()])   # noqa: E731
    arg_specs = [part(layout.args[n]) for n in names]
    out_specs = [part(o) for o in layout.outs]
    reduced = tuple(ax for f, ax in axes.items() if f in rule.reduce)
    return axes, arg_specs, out_specs, reduced


def partitioned(op_name: str, rule: Sharding, names: Sequence[str], static: Mapping[str, Any],
                local_call: Callable[[Sequence[Any]], Sequence[Any]]):
    """`local_call(arrays)` (global shapes when unsharded) as a custom_partitioning that runs it
    on each shard's local arrays, psums partial outputs over sharded contracted dimensions."""
    layout = rule.layout(tuple(names), **static)
    sdy_rule = ", ".join(layout.args[n] for n in names) + " -> " + ", ".join(layout.outs)

    def body(*xs):
        return tuple(local_call(xs))

    f = custom_partitioning(body)

    def shardings_of(arg_shapes):
        return [s.sharding for s in arg_shapes], [tuple(s.shape) for s in arg_shapes]

    def partition(mesh, arg_shapes, result_shape):
        shardings, shapes = shardings_of(arg_shapes)
        _, arg_specs, out_specs, reduced = plan(op_name, rule, layout, names, mesh, shapes, shardings)

        def lower(*xs):
            outs = tuple(local_call(xs))
            for ax in reduced:   # partial products over a sharded K: one sum, in float32
                outs = tuple(jax.lax.psum(o.astype(jnp.float32), ax).astype(o.dtype) for o in outs)
            return outs
        return (mesh, lower, tuple(NamedSharding(mesh, s) for s in out_specs),
                tuple(NamedSharding(mesh, s) for s in arg_specs))

    def infer(mesh, arg_shapes, result_shape):   # GSPMD (jax_use_shardy_partitioner=False)
        shardings, shapes = shardings_of(arg_shapes)
        _, _, out_specs, _ = plan(op_name, rule, layout, names, mesh, shapes, shardings)
        return tuple(NamedSharding(mesh, s) for s in out_specs)

    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=sdy_rule)
    return f
