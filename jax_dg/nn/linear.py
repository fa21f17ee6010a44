"""FP8Linear: nnx.Linear's interface and parameters on jax_dg.fp8_linear."""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dg.ops.linear import fp8_linear

default_kernel_init = nnx.initializers.lecun_normal()


class FP8Linear(nnx.Module):
    """y = x @ kernel (+ bias) with DeepSeek V3's FP8 recipe: x per token (1 x 128), the kernel
    per 128 x 128 block, forward, dgrad and wgrad all FP8 GEMMs on DeepGEMM (jax_dg.fp8_linear).

    Parameters as nnx.Linear's (kernel [in_features, out_features], optional bias), so a
    checkpoint of one loads into the other; `kernel_metadata` carries sharding annotations the
    same way (e.g. `{"out_sharding": (None, "model")}`). in_features and out_features must be
    multiples of 16 (FP8 rows of 16 bytes). The output is bfloat16 (the recipe's), the bias is
    added in float32 and rounded once.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 param_dtype=jnp.bfloat16, kernel_init=default_kernel_init,
                 bias_init=nnx.initializers.zeros_init(), rngs: nnx.Rngs,
                 kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
                 bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({})):
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                                **kernel_metadata)
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata) \
            if use_bias else nnx.data(None)
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, x: jax.Array) -> jax.Array:
        # DeepGEMM's NT layout wants the kernel as [out, in]: XLA folds the transpose into the
        # per-block quantiser that reads the kernel anyway.
        y = fp8_linear(x, self.kernel[...].T)
        if self.bias is None:
            return y
        return (y.astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(y.dtype)
