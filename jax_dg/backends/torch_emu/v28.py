"""The torch emulation presenting DeepGEMM 2.8's API (jax_dg.backends.emulated.presenting):
what changed from 2.5's signatures and SM90 contract, over the same emulated kernels.

So a program traced for DeepGEMM 2.8 (the ops plan around what 2.8 lacks: backends.deep_gemm.Api)
runs on a CPU exactly as its calls would reach 2.8: kernels 2.8 removed are absent, keywords it
removed are refused, and its SM90 limits hold (MQA logits: the compressed form only, float32,
32 or 64 heads; paged logits: next_n 1 or 2, 64-token blocks).
"""

from __future__ import annotations

import jax_dg.backends.torch_emu as v25

# 2.5 kernels 2.8 removed (fp8_gemm_nt_skip_head_mid) and legacy names it dropped.
GONE = frozenset({"fp8_gemm_nt_skip_head_mid", "fp8_mqa_logits", "fp8_paged_mqa_logits"})


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"Assertion error (torch emulation of deep_gemm 2.8): {what}")


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, max_seqlen_k,
                       schedule_meta=None):
    """2.8 on SM90: the compressed form only (its tail not cleaned), float32, H in {32, 64}."""
    _check(max_seqlen_k > 0, "max_seqlen_k > 0")
    _check(schedule_meta is None, "not schedule_meta.has_value()")
    _check(q[0].shape[1] in (32, 64), "num_heads == 32 or num_heads == 64")
    return v25.fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                                  clean_logits=False, max_seqlen_k=max_seqlen_k)


def fp8_fp4_paged_mqa_logits(q, fused_kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, indices=None):
    """2.8 on SM90: float32 logits, next_n 1 or 2, 64-token blocks, H in {32, 64}, no varlen."""
    _check(q[0].shape[1] in (1, 2), "next_n == 1 or next_n == 2")
    _check(q[0].shape[2] in (32, 64), "num_heads == 32 or num_heads == 64")
    _check(fused_kv_cache.shape[1] == 64, "block_kv == 64")
    _check(indices is None, "is_varlen == (arch_major == 10)")
    return v25.fp8_fp4_paged_mqa_logits(q, fused_kv_cache, weights, context_lens, block_table,
                                        schedule_meta, max_context_len, clean_logits=False)


def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None):
    _check(indices is None and block_kv == 64, "not is_varlen and block_kv == 64")
    return v25.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)


def einsum(expr, a, b, d, c=None, epilogue_class=None):
    """2.8: no use_cublaslt (the bf16 bhr/bhd forms take cuBLASLt unless deterministic)."""
    _check(epilogue_class is None, "epilogue_class == nullptr (SM90)")
    return v25.einsum(expr, a, b, d, c=c)


def k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks_cpu, grouped_layout, c=None, recipe=(1, 1, 128),
                                     compiled_dims="mn", use_psum_layout=False, epilogue_class=None):
    """2.8's names for 2.5's ks and ks_tensor."""
    _check(not use_psum_layout and epilogue_class is None, "the emulation: no PSUM layout, no epilogue")
    return v25.k_grouped_fp8_gemm_nt_contiguous(a, b, d, ks_cpu, grouped_layout, c=c, recipe=recipe,
                                                compiled_dims=compiled_dims)


def __getattr__(name: str):
    """Every other kernel is 2.5's (same signature); the removed ones are absent."""
    if name in GONE or name.startswith("_"):
        raise AttributeError(name)
    return getattr(v25, name)
