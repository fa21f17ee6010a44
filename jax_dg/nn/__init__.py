"""Flax NNX layers on jax_dg (the optional extra: `pip install jax_dg[flax]`).

    FP8Linear          x @ W on DeepGEMM's FP8 GEMM: bf16 masters with DeepSeek V3's training recipe
                       (forward and backward on DeepGEMM), or FP8 weights as DeepSeek's checkpoints
                       store them (StoredFP8: weight + weight_scale_inv), read as stored
    quantize / dequantize   every FP8 layer of a module from one form to the other: one call
    LightningIndexer   DeepSeek V3.2's indexer: prefill (indexer_topk) and decode against a paged
                       FP8 key cache (paged_indexer_topk), with the cache update
    MoE                DeepSeek's experts: Gate (its router), SwiGLU experts on grouped FP8 GEMMs,
                       dropless (masked: differentiable, decode; contiguous: prefill), shared
                       experts (MLP, also the dense layers' SwiGLU); routed + shared in float32
    DeepSeekV32Config  the model's configuration from config.json or DeepSeek's own (load_config)
    load_checkpoint    a checkpoint in DeepSeek's Hugging Face layout (sharded safetensors, FP8 +
                       weight_scale_inv) into these modules, shard by shard, onto a mesh if given
    MLA                DeepSeek V3.2's multi-head latent attention over the indexer's top-k
                       (DeepSeek Sparse Attention): prefill and absorbed decode on a paged FP8
                       latent cache (MLACache)
    RoPE               DeepSeek V3.2's rotary embedding with YaRN (both pair layouts) and the
                       softmax scale it implies
    Block              DeepSeek V3.2's block: RMSNorm, MLA (with the indexer), RMSNorm, MLP or MoE,
                       residual adds; prefill of padded sequences into the paged caches, decode
    Transformer        embedding, blocks, norm and float32 head: prefill, decode, greedy generate

The top layer: it imports jax_dg's public functions and nothing imports it; `import jax_dg` works
without flax installed.
"""

from __future__ import annotations

try:
    import flax.nnx  # noqa: F401
except ImportError as e:   # say which extra brings it
    raise ImportError("jax_dg.nn needs flax: pip install 'jax_dg[flax]'") from e

from jax_dg.nn.attention import MLA, MLACache
from jax_dg.nn.block import Block
from jax_dg.nn.indexer import IndexerCache, LightningIndexer
from jax_dg.nn.config import DeepSeekV32Config, load_config
from jax_dg.nn.gate import Gate, RouterBias
from jax_dg.nn.linear import FP8Linear, StoredFP8, dequantize, quantize
from jax_dg.nn.loader import CheckpointError, checkpoint_names, load_checkpoint
from jax_dg.nn.model import Transformer
from jax_dg.nn.moe import MLP, MoE
from jax_dg.nn.rope import RoPE

__all__ = ["FP8Linear", "LightningIndexer", "IndexerCache", "MLA", "MLACache", "MoE", "RoPE",
           "MLP", "Gate", "RouterBias", "StoredFP8", "quantize", "dequantize", "DeepSeekV32Config",
           "load_config", "load_checkpoint", "checkpoint_names", "CheckpointError", "Block", "Transformer"]
