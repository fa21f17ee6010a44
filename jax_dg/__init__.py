"""jax_dg: DeepGEMM's kernels as XLA FFI custom calls for JAX.

Import order matters: jax is imported before the compiled bridge (jax_dg.core.bridge).
"""

import jax  # noqa: F401  (must precede the extension, see jax_dg/core/bridge.py)

from jax_dg.backends import ENV as BACKEND_ENV
from jax_dg.backends import use_backend
from jax_dg.core.checks import ArgumentError, UnsupportedArchError
from jax_dg.ops.gemm import fp8_gemm_nt
from jax_dg.quant import (
    calc_diff,
    ceil_to_ue8m0,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
)

# MQA logits (non-paged) and the indexer helpers
from jax_dg.indexer import (
    causal_ks_ke,
    fold_q_scale,
    per_row_cast_to_fp8,
    topk_indices,
    varlen_causal_ks_ke,
)
from jax_dg.ops.mqa import (
    fp8_fp4_mqa_logits,
    fp8_fp4_sparse_mqa_logits,
    get_sparse_mqa_logits_metadata,
    mqa_logits,
)

# Paged MQA logits (the indexer's decode step), schedule metadata, paged KV-cache helpers
from jax_dg.ops.paged_mqa import (
    fp8_fp4_paged_mqa_logits,
    fp8_fp4_paged_sparse_mqa_logits,
    get_paged_mqa_logits_metadata,
    get_paged_mqa_page_sizes,
    get_paged_sparse_mqa_logits_metadata,
    has_deep_gemm_sparse_mqa,
    mqa_logits_mx_inputs,
    mqa_logits_use_mx_scales,
    native_next_n_supported,
    paged_mqa_logits,
)
from jax_dg import paged  # jax_dg.paged: pack/unpack paged KV caches, build block tables

# GEMM family: FP8/BF16 layouts, cuBLASLt, grouped (MoE), einsum, hyper-connection
from jax_dg.ops.einsum import einsum, fp8_einsum
from jax_dg.ops.gemm import (
    bf16_gemm_nn,
    bf16_gemm_nt,
    bf16_gemm_tn,
    bf16_gemm_tt,
    cublaslt_gemm_nn,
    cublaslt_gemm_nt,
    cublaslt_gemm_tn,
    cublaslt_gemm_tt,
    fp8_gemm_nn,
    fp8_gemm_tn,
    fp8_gemm_tt,
)
from jax_dg.ops.grouped import (
    fp8_m_grouped_gemm_nt_masked,
    k_grouped_fp8_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_masked,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
)
from jax_dg.ops.hyperconnection import tf32_hc_prenorm_gemm

# MoE gate, mHC, layouts and routing, capability oracles
from jax_dg.capability import (
    DeepGemmQuantScaleFMT,
    has_deep_gemm,
    is_blackwell_deep_gemm_used,
    is_deep_gemm_e8m0_used,
    is_deep_gemm_supported,
    should_auto_disable_deep_gemm,
)
from jax_dg.layout import (
    get_col_major_tma_aligned_tensor,
    get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_theoretical_mk_alignment_for_contiguous_layout,
    get_tma_aligned_size,
    mk_alignment_scope,
    mn_major_logical,
    pack_ue8m0_to_int,
    set_mk_alignment_for_contiguous_layout,
    transform_sf_into_required_layout,
)
from jax_dg.ops.mhc import mega_mhc
from jax_dg.ops.moe_gate import bf16_mega_gate
from jax_dg.routing import (
    ContiguousLayout,
    MaskedLayout,
    combine_from_contiguous,
    combine_from_masked,
    contiguous_layout,
    masked_layout,
    permute_to_contiguous,
    permute_to_masked,
)

__version__ = "0.1.0"
