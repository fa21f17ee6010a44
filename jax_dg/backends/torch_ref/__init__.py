"""The torch reference backend: DeepGEMM's kernel API implemented in plain torch.

Same names, arguments and output conventions as deep_gemm (outputs written into the given
tensors), so an op's `call` runs unchanged on it. It runs on any device; the bridge uses it
on CPU. Each family lives in its own module.
"""

from jax_dg.backends.torch_ref.device import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.gemm import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.mqa import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.paged_mqa import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.moe_gate import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.mhc import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.grouped import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.einsum import *  # noqa: F401,F403
from jax_dg.backends.torch_ref.hyperconnection import *  # noqa: F401,F403
