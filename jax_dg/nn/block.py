"""DeepSeek V3.2's transformer block as an NNX module: attention (MLA with the indexer) and a
feed-forward layer (jax_dg.nn.moe's dense SwiGLU MLP or MoE), each after an RMSNorm, each added
to the residual stream (inference/model.py's `Block`).

DeepSeek's Block carries the residual beside the layer output and adds it inside the next
RMSNorm (in float32, rounded to bf16 once); adding it here at the end of each sub-layer gives the
same bf16 stream, add for add. Rows are tokens: prefill takes sequences padded to [B, S] with their
lengths, decode one token per sequence [B, dim]; the feed-forward layer sees them as [rows, dim].
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dg.nn.attention import MLA, MLACache
from jax_dg.nn.moe import MLP, MoE

if tp.TYPE_CHECKING:
    from jax_dg.nn.config import DeepSeekV32Config


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    """x + y summed in float32, rounded once to bf16 (DeepSeek's residual add)."""
    return (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(jnp.bfloat16)


class Block(nnx.Module):
    """attn_norm -> attn (MLA) -> + residual -> ffn_norm -> ffn (MLP or MoE) -> + residual.

    attn: the layer's MLA; ffn: its MLP or MoE (an MoE runs dropless, its default layout);
    dim: the hidden size; eps: the RMSNorms' epsilon.
    """

    def __init__(self, attn: MLA, ffn: MLP | MoE, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(dim, epsilon=eps, param_dtype=jnp.float32, rngs=rngs)
        self.attn = attn
        self.ffn_norm = nnx.RMSNorm(dim, epsilon=eps, param_dtype=jnp.float32, rngs=rngs)
        self.ffn = ffn

    @classmethod
    def from_config(cls, cfg: DeepSeekV32Config, layer: int, *, rngs: nnx.Rngs, fp8_weights: bool | None = None,
                    param_dtype=jnp.bfloat16) -> Block:
        """Layer `layer` of a DeepSeek-V3.2 configuration: MLA, then the dense MLP for the first
        first_k_dense_replace layers, the MoE after (fp8_weights: as MoE.from_config)."""
        fp8 = cfg.fp8_weights if fp8_weights is None else fp8_weights
        attn = MLA.from_config(cfg, rngs=rngs, fp8_weights=fp8, param_dtype=param_dtype)
        ffn = MoE.from_config(cfg, rngs=rngs, fp8_weights=fp8, param_dtype=param_dtype) if cfg.is_moe_layer(layer) \
            else MLP(cfg.hidden_size, cfg.intermediate_size, fp8_weights=fp8, scale_fmt=cfg.scale_fmt,
                     param_dtype=param_dtype, rngs=rngs)
        return cls(attn, ffn, cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs)

    def _ffn(self, h: jax.Array) -> jax.Array:
        rows = h.reshape(-1, h.shape[-1])
        y = self.ffn(self.ffn_norm(rows).astype(jnp.bfloat16))
        return add(rows, y).reshape(h.shape)

    def prefill(self, x: jax.Array, lens: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
        """Sequences x [B, S, dim] (bf16; sequence b's first lens[b] rows), each from position 0:
        (bf16 [B, S, dim], the layer's cache with them written)."""
        o, cache = self.attn.prefill(self.attn_norm(x).astype(jnp.bfloat16), lens, cache)
        return self._ffn(add(x, o)), cache

    def decode(self, x: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
        """One token per sequence, x [B, dim] at position cache.context_lens: (bf16 [B, dim],
        the cache with it written)."""
        o, cache = self.attn.decode(self.attn_norm(x).astype(jnp.bfloat16), cache)
        return self._ffn(add(x, o)), cache
