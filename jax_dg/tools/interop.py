"""Torch interop for scripts that mix JAX and PyTorch: zero-copy array exchange through DLPack.

- `to_jax(tensor)`: a jax.Array viewing the tensor's memory.
- `to_torch(array)`: a torch.Tensor viewing the array's memory.
- `torch_callable(fn)`: `fn` (a JAX function, jitted or not) taking and returning torch tensors,
  pytrees included.

Both directions go through the DLPack protocol, whose consumer passes its stream to the
producer: on CUDA the producer's pending work is ordered before the consumer's by a stream
wait (an event), never by a device synchronisation. FP8 tensors keep their dtype
(float8_e4m3fn / float8_e5m2); where this jax/torch pair cannot exchange FP8 by DLPack, the
bytes travel as uint8 and are re-typed (one device copy on the JAX side, said in a warning).
torch is imported on first use (the `torch` extra). Tensors that require grad are detached (JAX has its own autodiff) and non-contiguous tensors
are made contiguous (a copy): both are said in a warning, once per kind.

jax_dg ops take jax.Arrays only: a torch tensor handed to one raises `ArgumentError` pointing
here.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_dg.backends import optional
from jax_dg.core.checks import is_torch_tensor as _is_tensor

_warned: set[str] = set()


def _torch():
    """torch, imported on first use (the `torch` extra)."""
    return optional.torch("jax_dg.interop")


@functools.cache
def _fp8() -> dict:
    torch = _torch()
    return {torch.float8_e4m3fn: jnp.float8_e4m3fn, torch.float8_e5m2: jnp.float8_e5m2}


def _note(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"jax_dg.tools.interop: {message}", stacklevel=3)


def to_jax(tensor) -> jax.Array:
    """The tensor as a jax.Array on the same device, sharing its memory (see the module doc for
    the cases that copy or detach)."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"jax_dg.tools.interop.to_jax: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.requires_grad:
        _note("grad", "a tensor that requires grad was detached (gradients do not flow from JAX "
              "back to torch autograd)")
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        _note("contiguous", "a non-contiguous tensor was made contiguous (a copy) before the "
              "exchange: DLPack views of JAX arrays are dense")
        tensor = tensor.contiguous()
    try:
        return jax.dlpack.from_dlpack(tensor)
    except (TypeError, ValueError, RuntimeError, BufferError):
        if tensor.dtype not in _fp8():
            raise
    _note("fp8", "this jax/torch pair exchanges no FP8 by DLPack: the bytes travel as uint8 "
          "and are re-typed on the JAX side (one device copy)")
    raw = jax.dlpack.from_dlpack(tensor.view(torch.uint8))
    return jax.lax.bitcast_convert_type(raw, _fp8()[tensor.dtype])


def to_torch(array: jax.Array):
    """The array as a torch.Tensor on the same device, sharing its memory. Do not write to it:
    XLA may share or reuse an array's buffer as it sees fit."""
    torch = _torch()
    if not isinstance(array, jax.Array):
        raise TypeError(f"jax_dg.tools.interop.to_torch: expected a jax.Array, got {type(array).__name__}")
    try:
        return torch.from_dlpack(array)
    except (TypeError, ValueError, RuntimeError, BufferError):
        fp8 = {v: k for k, v in _fp8().items()}.get(jnp.dtype(array.dtype).type)
        if fp8 is None:
            raise
    _note("fp8", "this jax/torch pair exchanges no FP8 by DLPack: the bytes travel as uint8 "
          "(one device copy on the JAX side) and are re-typed on the torch side")
    return torch.from_dlpack(jax.lax.bitcast_convert_type(array, jnp.uint8)).view(fp8)


def torch_callable(fn: Callable) -> Callable:
    """`fn` for torch callers: torch tensors anywhere in the arguments (pytrees included)
    become jax.Arrays, jax.Arrays in the result become torch tensors; other leaves pass as
    they are. Jit `fn` first for speed: the wrapper itself adds only the exchanges."""
    def call(*args, **kwargs):
        args, kwargs = jax.tree.map(lambda x: to_jax(x) if _is_tensor(x) else x, (args, kwargs),
                                    is_leaf=_is_tensor)
        out = fn(*args, **kwargs)
        return jax.tree.map(lambda x: to_torch(x) if isinstance(x, jax.Array) else x, out)
    call.__wrapped__ = fn
    call.__doc__ = fn.__doc__
    call.__name__ = getattr(fn, "__name__", "torch_callable")
    return call

