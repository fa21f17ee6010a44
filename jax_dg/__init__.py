"""jax_dg: DeepGEMM's kernels as XLA FFI custom calls for JAX.

A call, top to bottom (docs/architecture.md draws it). While tracing (the trace-time half: the
ops, core), an op's public function binds its Op record for the call's one target
(core.device): the arguments are checked, and the shape rule returns the result types with the
plan, once; core.dispatch, the one resolver, says what runs (DeepGEMM, its torch emulation,
jax_dg's own kernel, or the pure-JAX reference); core.site carries what was decided to the
bridge as one versioned call-site record; what follows DeepGEMM's call (the -inf fill, the
top-k, the zero rows) is composed in XLA as native calls. At run time (the run-time half,
jax_dg.runtime, which alone imports torch) XLA calls ffi/bridge.cc, which hands DLPack views and
XLA's stream to the site's prepared closure: the DeepGEMM call and nothing else. jax_dg's own
kernels run as typed FFI handlers (ffi/<kernel>.cc): no Python, capturable in CUDA graphs.

Layers, top to bottom; a module imports only from its own layer or the layers below it
(tests/test_layering.py enforces it, that there is no import cycle, and where torch is
imported):

  nn         jax_dg.nn.*: Flax NNX layers on the ops (the optional `flax` extra: nothing
             imports it, and `import jax_dg` does not)
  public     jax_dg (this file: the public names, and the op registry filled from them),
             jax_dg.__main__ (`python -m jax_dg info | warmup`)
  ops        jax_dg.ops.*: one module per kernel family: its Op records and public functions;
             jax_dg.operands.*: what users make the ops' operands with (quant, scales,
             routing, paged, indexer); jax_dg.tools.*: what works around the ops (warmup,
             exporting, interop between torch and JAX arrays, capability queries)
  runtime    jax_dg.runtime.*: the run-time half, beside the ops (nothing of jax_dg imports it;
             the bridge's C++ handler does, at its first call): the bridge's Python half
             (bridge), what a run function receives (run), the guards around it (guards),
             DeepGEMM's allocations landed in XLA's buffers (landing)
  core       jax_dg.core.*: the trace-time half: the Op record and its call (op), its declared
             statics (statics), the op registry (registry), the call-site record (site), the
             resolver (dispatch), jax_dg's own kernels' custom calls (native), derivatives,
             sharding, checks and errors, index values (values), the device and the trace's
             target (device), backend selection (backend)
  reference  jax_dg.reference.*: the pure-JAX references (the test oracle, backend "xla")
  backends   jax_dg.backends.*: DeepGEMM's API: deep_gemm (the installed package, resolved
             across versions; a leaf that imports nothing of jax_dg), emulated (the device the
             emulations emulate) and torch_emu (DeepGEMM's kernels emulated in plain torch: the
             CPU backend)
  numerics   jax_dg.numerics: DeepGEMM's FP8 quantisation arithmetic in jax.numpy (scale factor,
             UE8M0 rounding, the cast), the one piece of math the product and the pure-JAX
             reference share (imports jax and at most contracts; the backends do not use it)
  contracts  jax_dg.contracts: DeepGEMM's sizes and buffer layouts as plain data (no imports)

"Reference" means the pure-JAX oracle only; the torch backend is an emulation. The references
never borrow from the product: jax_dg.operands, jax_dg.tools and ops.linear never import
jax_dg.reference (only the ops' declarations name it, as their `reference=`, the "xla"
backend). Import order matters: jax is imported before the compiled extensions.
"""

import jax  # noqa: F401  (must precede the extensions, see jax_dg/core/registry.py)

from jax_dg.operands import paged  # jax_dg.paged: pack/unpack paged KV caches, build block tables
from jax_dg.tools.capability import (
    DeepGemmQuantScaleFMT,
    has_deep_gemm,
    is_blackwell_deep_gemm_used,
    is_deep_gemm_e8m0_used,
    is_deep_gemm_supported,
    should_auto_disable_deep_gemm,
)
from jax_dg.core.backend import ENV as BACKEND_ENV
from jax_dg.core.backend import use_backend
from jax_dg.core.checks import (ArgumentError, NotDifferentiableError, UnsupportedArchError,
                               UnsupportedBackendError)
from jax_dg.core.values import checked  # data-dependent index values raise instead of being clamped
from jax_dg.tools.exporting import export_safety_checks
from jax_dg.tools.warmup import warmup
from jax_dg.operands.indexer import (
    causal_ks_ke,
    fold_q_scale,
    per_row_cast_to_fp8,
    varlen_causal_ks_ke,
)
# each kernel family's public functions: its module's __all__ (a new op's function is exported
# where it is declared)
from jax_dg.ops.cast import *  # noqa: F401,F403
from jax_dg.ops.einsum import *  # noqa: F401,F403
from jax_dg.ops.gemm import *  # noqa: F401,F403
from jax_dg.ops.grouped import *  # noqa: F401,F403
from jax_dg.ops.linear import *  # noqa: F401,F403
from jax_dg.ops.mhc import *  # noqa: F401,F403
from jax_dg.ops.moe_gate import *  # noqa: F401,F403
from jax_dg.ops.mqa import *  # noqa: F401,F403
from jax_dg.ops.paged_mqa import *  # noqa: F401,F403
from jax_dg.ops.topk import *  # noqa: F401,F403
from jax_dg.operands.quant import calc_diff, ceil_to_ue8m0, pack_ue8m0_to_int
from jax_dg.operands.routing import (
    ContiguousLayout,
    MaskedLayout,
    combine_from_contiguous,
    combine_from_masked,
    contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_theoretical_mk_alignment_for_contiguous_layout,
    masked_layout,
    mk_alignment_scope,
    permute_to_contiguous,
    permute_to_masked,
    psum_layout,
    set_mk_alignment_for_contiguous_layout,
)
from jax_dg.operands.scales import (
    MNMajor,
    get_col_major_tma_aligned_tensor,
    get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    mn_major_logical,
    transform_sf_into_required_layout,
)

__version__ = "0.1.0"

# What a user calls (what `python -m jax_dg info` lists): the names above, jax_dg.paged and
# jax_dg.interop.
__all__ = sorted([n for n, v in list(globals().items()) if not n.startswith("_")
                  and (not isinstance(v, type(jax)) or n == "paged")] + ["interop"])


def __getattr__(name: str):
    # jax_dg.interop (torch <-> JAX arrays) imports torch: loaded when first used, so that
    # `import jax_dg` and tracing need no torch (the run time of a DeepGEMM op imports it)
    if name == "interop":
        from jax_dg.tools import interop
        return interop
    raise AttributeError(f"module 'jax_dg' has no attribute {name!r}")


# jax_dg's one op registry, filled here: the public names, and the ops their functions expose
from jax_dg.core import registry  # noqa: E402

registry.register_public({**{n: globals()[n] for n in __all__ if n in globals()},
                          **{f"paged.{n}": getattr(paged, n) for n in paged.__all__}})
