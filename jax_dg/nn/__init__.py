"""Flax NNX layers on jax_dg (the optional extra: `pip install jax_dg[flax]`).

    FP8Linear          x @ kernel with DeepSeek V3's FP8 recipe, forward and backward on DeepGEMM
    LightningIndexer   DeepSeek V3.2's indexer: prefill (indexer_topk) and decode against a paged
                       FP8 key cache (paged_indexer_topk), with the cache update
    MoE                DeepSeek V3's experts: gate, routing, SwiGLU experts on grouped FP8 GEMMs
                       (masked: differentiable; contiguous: prefill), shared experts
    RoPE               DeepSeek V3.2's rotary embedding with YaRN (both pair layouts) and the
                       softmax scale it implies

The top layer: it imports jax_dg's public functions and nothing imports it; `import jax_dg` works
without flax installed.
"""

from __future__ import annotations

try:
    import flax.nnx  # noqa: F401
except ImportError as e:   # say which extra brings it
    raise ImportError("jax_dg.nn needs flax: pip install 'jax_dg[flax]'") from e

from jax_dg.nn.indexer import IndexerCache, LightningIndexer
from jax_dg.nn.linear import FP8Linear
from jax_dg.nn.moe import MoE
from jax_dg.nn.rope import RoPE

__all__ = ["FP8Linear", "LightningIndexer", "IndexerCache", "MoE", "RoPE"]
