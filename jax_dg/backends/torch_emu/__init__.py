"""The torch emulation backend: DeepGEMM's kernel API implemented in plain torch.

Same names, arguments and output conventions as deep_gemm (outputs written into the given
tensors), so an op's `call` runs unchanged on it. It runs on any device; the bridge uses it
on CPU. Each family lives in its own module. Without torch, importing it raises
MissingTorchError naming the `torch` extra (jax_dg.backends.optional).
"""

from jax_dg.backends import optional

optional.torch("the torch emulation of DeepGEMM (JAX_DG_BACKEND=torch; auto on CPU)")

from jax_dg.backends.torch_emu.device import *  # noqa: F401,F403
from jax_dg.backends.torch_emu.gemm import *  # noqa: F401,F403
from jax_dg.backends.torch_emu.mqa import *  # noqa: F401,F403
from jax_dg.backends.torch_emu.paged_mqa import *  # noqa: F401,F403
from jax_dg.backends.torch_emu.moe_gate import *  # noqa: F401,F403
from jax_dg.backends.torch_emu.mhc import *  # noqa: F401,F403
from jax_dg.backends.torch_emu.grouped import *  # noqa: F401,F403
from jax_dg.backends.torch_emu.einsum import *  # noqa: F401,F403
