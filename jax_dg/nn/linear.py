"""FP8Linear: nnx.Linear's interface on DeepGEMM's FP8 GEMM, with bf16 masters for training or
FP8 weights as DeepSeek's checkpoints store them, for serving.

    FP8Linear(..., fp8_weights=False)   `kernel` [in, out] bf16 master: jax_dg.fp8_linear, the
                                        weight quantised per 128 x 128 block on every call,
                                        forward and backward on DeepGEMM (training)
    FP8Linear(..., fp8_weights=True)    `weight` float8_e4m3fn [out, in] + `weight_scale_inv`
                                        float32 [ceil(out/128), ceil(in/128)], the checkpoint's
                                        tensors as stored: the forward casts x per token and
                                        runs fp8_gemm_nt on them, never re-quantising the weight
    quantize(module) / dequantize(module)   every FP8 layer in `module` (FP8Linear, MoE) from one
                                        form to the other, in place: one call

The stored form's scales are float32 either way; a UE8M0 checkpoint's are powers of two, which
DeepGEMM's SM90 kernels take as they are. `scale_fmt="ue8m0"` (DeepSeek's config) rounds the
activation's scales up to powers of two too (DeepSeek's act_quant with a scale_fmt); the bf16
masters' training recipe (fp8_linear) keeps float32 activation scales. The stored form is for
inference: it has no gradient (an nnx.grad through it raises jax_dg's NotDifferentiableError).
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dg.ops.cast import cast_blocks, cast_tokens
from jax_dg.ops.gemm import fp8_gemm_nt
from jax_dg.ops.linear import fp8_linear

default_kernel_init = nnx.initializers.lecun_normal()
FP8 = jnp.float8_e4m3fn
BLOCK = 128           # DeepSeek's and DeepGEMM's weight blocks: 128 x 128


class StoredFP8(nnx.Variable):
    """A checkpoint's FP8 weight or its block scales (weight_scale_inv), held as stored: inference
    state that no optimiser trains (nnx.Param filters leave it out)."""


def check_scale_fmt(scale_fmt, where: str) -> bool:
    """Whether `scale_fmt` (DeepSeek's config value: None or "ue8m0") asks for UE8M0 scales."""
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"{where}: `scale_fmt` must be None or 'ue8m0' (DeepSeek's), got {scale_fmt!r}")
    return scale_fmt == "ue8m0"


def dequantize_blocks(values: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """FP8 values [..., R, C] times their 128 x 128 block scales [..., ceil(R/128), ceil(C/128)],
    rounded once to `dtype` (DeepSeek's weight_dequant)."""
    r, c = values.shape[-2:]
    full = jnp.repeat(jnp.repeat(scales.astype(jnp.float32), BLOCK, axis=-2), BLOCK, axis=-1)[..., :r, :c]
    return (values.astype(jnp.float32) * full).astype(dtype)


def quantize_blocks(w: jax.Array, ue8m0: bool) -> tuple[jax.Array, jax.Array]:
    """w [..., R, C] (bfloat16 or float32) -> (float8_e4m3fn values, float32 128 x 128 block scales):
    DeepGEMM's per-block quantiser (jax_dg's fused cast), powers of two with `ue8m0`."""
    return cast_blocks(w, use_ue8m0=ue8m0)[0]


def stored_linear(x: jax.Array, weight: jax.Array, scale_inv: jax.Array, ue8m0: bool) -> jax.Array:
    """x [..., K] @ weight[N, K].T on the stored FP8 weight: x cast per token (1 x 128, UE8M0
    scales with `ue8m0`), one fp8_gemm_nt; the weight goes to the kernel as it is. bfloat16 [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    a = cast_tokens(x.reshape(-1, k), use_ue8m0=ue8m0)[0]
    return fp8_gemm_nt(a, (weight, scale_inv)).reshape(*lead, weight.shape[0])


def sharding_metadata(var: nnx.Variable, transpose: bool = False) -> dict:
    """The sharding metadata of `var` for a tensor of the other orientation ([in, out] <->
    [out, in]) when `transpose`; the rest of its metadata is nnx's own."""
    meta = var.get_metadata()
    out = {k: meta[k] for k in ("mesh", "sharding_rules") if meta.get(k) is not None}
    spec = meta.get("out_sharding")
    if spec:
        out["out_sharding"] = tuple(reversed(tuple(spec))) if transpose else tuple(spec)
    return out


class FP8Weights:
    """What the layers holding FP8 GEMM weights share: the two forms and the conversion."""

    def _quantize_own(self, ue8m0: bool | None) -> None:
        raise NotImplementedError

    def _dequantize_own(self) -> None:
        raise NotImplementedError

    @property
    def stored_fp8(self) -> bool:
        raise NotImplementedError

    def quantize(self, *, ue8m0: bool | None = None):
        """This layer and every FP8 layer inside it to stored FP8 (see `quantize`)."""
        return quantize(self, ue8m0=ue8m0)

    def dequantize(self, dtype=None):
        """This layer and every FP8 layer inside it to bf16 masters (see `dequantize`)."""
        return dequantize(self, dtype)


def _layers(module) -> list:
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, FP8Weights)]


def quantize(module, *, ue8m0: bool | None = None):
    """Every FP8Linear and MoE in `module` to stored FP8 weights, in place (layers already
    stored are left as they are); returns `module`. The weights are cast per 128 x 128 block as
    the training recipe casts them on each call, so the stored forward computes what the master
    forward did (bitwise with float32 scales). ue8m0: power-of-two weight scales (DeepSeek's
    UE8M0 checkpoints); None takes each layer's scale_fmt."""
    for layer in _layers(module):
        if not layer.stored_fp8:
            layer._quantize_own(ue8m0)
    return module


def dequantize(module, dtype=None):
    """Every FP8Linear and MoE in `module` back to bf16 masters (FP8 values times their block
    scales, rounded once to `dtype`, by default each layer's param_dtype), in place, for training;
    returns `module`."""
    for layer in _layers(module):
        if layer.stored_fp8:
            layer._dequantize_own(dtype)
    return module


class FP8Linear(FP8Weights, nnx.Module):
    """y = x @ W (+ bias) on DeepGEMM's FP8 GEMM with DeepSeek V3's recipe: x per token (1 x
    128), the weight per 128 x 128 block; bfloat16 out, the bias added in float32 and rounded once.

    With bf16 masters (the default) the parameters are nnx.Linear's (kernel [in_features,
    out_features], optional bias), so a checkpoint of one loads into the other, and forward,
    dgrad and wgrad all run on DeepGEMM (jax_dg.fp8_linear). With `fp8_weights=True` the layer
    holds `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out/128),
    ceil(in/128)] as DeepSeek's checkpoints store them (StoredFP8 variables; jax_dg.nn.load_checkpoint
    fills them) and its forward reads them as they are (see the module doc); `quantize()` /
    `dequantize()` convert. `kernel_metadata` carries sharding annotations for the kernel as
    nnx.Linear's (e.g. `{"out_sharding": (None, "model"), "mesh": mesh}`); the stored weight
    takes them transposed, its small scales stay replicated. in_features and out_features must
    be multiples of 16 (FP8 rows of 16 bytes).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 fp8_weights: bool = False, scale_fmt: str | None = None,
                 param_dtype=jnp.bfloat16, kernel_init=default_kernel_init,
                 bias_init=nnx.initializers.zeros_init(), rngs: nnx.Rngs,
                 kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
                 bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({})):
        for v, arg in ((in_features, "in_features"), (out_features, "out_features")):
            if v <= 0 or v % 16:
                raise ValueError(f"FP8Linear: `{arg}` must be a positive multiple of 16 (FP8 rows of "
                                 f"16 bytes), got {v}")
        self.in_features, self.out_features, self.param_dtype = in_features, out_features, param_dtype
        self.scale_fmt = scale_fmt
        self.use_ue8m0 = check_scale_fmt(scale_fmt, "FP8Linear")
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                                **kernel_metadata)
        self.weight = nnx.data(None)
        self.weight_scale_inv = nnx.data(None)
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata) \
            if use_bias else nnx.data(None)
        if fp8_weights:
            self._quantize_own(None)

    @property
    def stored_fp8(self) -> bool:
        return self.weight is not None

    def _quantize_own(self, ue8m0: bool | None) -> None:
        ue8m0 = self.use_ue8m0 if ue8m0 is None else bool(ue8m0)
        q, s = quantize_blocks(self.kernel[...].T, ue8m0)
        self.weight = StoredFP8(q, **sharding_metadata(self.kernel, transpose=True))
        self.weight_scale_inv = StoredFP8(s)
        self.kernel = nnx.data(None)

    def _dequantize_own(self, dtype) -> None:
        w = dequantize_blocks(self.weight[...], self.weight_scale_inv[...], dtype or self.param_dtype)
        self.kernel = nnx.Param(w.T, **sharding_metadata(self.weight, transpose=True))
        self.weight = nnx.data(None)
        self.weight_scale_inv = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.stored_fp8:
            y = stored_linear(x, self.weight[...], self.weight_scale_inv[...], self.use_ue8m0)
        else:
            # DeepGEMM's NT layout wants the kernel as [out, in]: XLA folds the transpose into
            # the per-block quantiser that reads the kernel anyway.
            y = fp8_linear(x, self.kernel[...].T)
        if self.bias is None:
            return y
        return (y.astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(y.dtype)
