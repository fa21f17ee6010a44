"""One op = one declaration; registration, lowering and backend dispatch derive from it.

    fp8_gemm_nt = Op(
        name="fp8_gemm_nt",
        args=("a", "sfa", "b", "sfb", "c"),          # array arguments, None allowed
        rule=_rule,          # (*avals, **static) -> output ShapeDtypeStructs; raises ArgumentError
        call=_call,          # (kernels, *in_tensors, *out_tensors, **static): runs the kernel
        reference=_ref,      # (*arrays, **static) -> outputs, in jax.numpy (the test oracle)
        kernels=("fp8_gemm_nt",),                  # DeepGEMM symbols `call` uses
        aliases={"c": 0},                          # input that XLA may donate to output 0
    )

`call` is written against DeepGEMM's own API: `kernels` is either the resolved deep_gemm
module (CUDA) or jax_dg's torch reference of the same contract (CPU, or any device when
asked), so one function serves both. Absent optional arguments reach it as None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax

from jax_dg import backends
from jax_dg.core import bridge
from jax_dg.core.target import target


ALL_ARCHS = frozenset({"sm90", "sm100"})  # where DeepGEMM runs


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    name: str
    args: tuple[str, ...]
    rule: Callable[..., Sequence[jax.ShapeDtypeStruct]]
    call: Callable[..., None]
    reference: Callable[..., Any]
    kernels: tuple[str, ...] = ()
    aliases: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # How jax.vmap maps over the custom call; "sequential" is always correct.
    vmap_method: str = "sequential"
    # Ops whose DeepGEMM kernel exists only on some architectures: {"sm100"}.
    archs: frozenset[str] = ALL_ARCHS
    target: str = ""

    def __post_init__(self):
        object.__setattr__(self, "target", bridge.register_op(self))

    def __call__(self, *arrays: Any, **static: Any):
        if len(arrays) != len(self.args):
            raise TypeError(f"{self.name}: expected {len(self.args)} arrays, got {len(arrays)}")
        out_types = tuple(self.rule(*arrays, **static))
        backend = backends.requested()
        if backend == "xla":
            outs = self.reference(*arrays, **static)
            return outs if isinstance(outs, tuple) else (outs,)
        t = target()  # no DeepGEMM kernel on this GPU: say so now, not when it runs
        if t.backend == "deep_gemm" and t.platform == "cuda" and t.arch not in self.archs:
            from jax_dg.backends.deep_gemm import arch_error
            raise arch_error(self)
        present = "".join("0" if a is None else "1" for a in arrays)
        given = [a for a in arrays if a is not None]
        index = {n: i for i, n in enumerate(n for n, a in zip(self.args, arrays) if a is not None)}
        aliases = {index[n]: o for n, o in self.aliases.items() if n in index}
        site = bridge.encode_site(self.name, backend, present, static)
        fn = jax.ffi.ffi_call(self.target, out_types, input_output_aliases=aliases,
                              vmap_method=self.vmap_method)
        return tuple(fn(*given, site=site))
