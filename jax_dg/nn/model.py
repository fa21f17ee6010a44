"""Transformer: DeepSeek V3.2's decoder as an NNX module (inference/model.py's `Transformer`):
token embedding, the blocks, a final RMSNorm and the output head, with the paged caches of
every layer for prefill and decode.

As DeepSeek's: the embedding is bf16; the head is a float32 linear on the normalised hidden state
widened to float32 (DeepSeek keeps lm_head in float32 "for easier computation of logits"), at
full float32 precision; prefill returns the logits of each sequence's last token (what greedy
generation needs), decode those of the token it takes. Every layer's cache shares one set of
block tables and lengths (MLACache per layer, each with its own copy of both: a pytree of
arrays, donated whole between steps).
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dg.nn.attention import MLACache
from jax_dg.nn.block import Block

if tp.TYPE_CHECKING:
    from jax_dg.nn.config import DeepSeekV32Config


class Transformer(nnx.Module):
    """DeepSeek V3.2's decoder of `cfg` (jax_dg.nn.config.DeepSeekV32Config); fp8_weights
    defaults to whether the checkpoint stores FP8 weights (load one with jax_dg.nn.load_checkpoint).
    n_layers: build only the first n_layers blocks (a slice of the model, e.g. for a test)."""

    def __init__(self, cfg: DeepSeekV32Config, *, rngs: nnx.Rngs, fp8_weights: bool | None = None,
                 n_layers: int | None = None, param_dtype=jnp.bfloat16):
        n = cfg.num_hidden_layers if n_layers is None else n_layers
        if not 1 <= n <= cfg.num_hidden_layers:
            raise ValueError(f"Transformer: `n_layers` must lie in [1, {cfg.num_hidden_layers}], got {n}")
        self.vocab_size = cfg.vocab_size
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=jnp.bfloat16, rngs=rngs)
        self.layers = nnx.List([Block.from_config(cfg, i, rngs=rngs, fp8_weights=fp8_weights,
                                                  param_dtype=param_dtype) for i in range(n)])
        self.norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, param_dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, param_dtype=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST, rngs=rngs)

    def init_cache(self, block_tables: jax.Array, num_blocks: int, block_size: int = 64) -> list[MLACache]:
        """Every layer's empty cache for sequences laid out by block_tables
        (jax_dg.paged.build_block_tables) over num_blocks blocks of block_size tokens."""
        return [layer.attn.init_cache(block_tables, num_blocks, block_size) for layer in self.layers]

    def _logits(self, h: jax.Array) -> jax.Array:
        return self.head(self.norm(h).astype(jnp.bfloat16).astype(jnp.float32))

    def prefill(self, tokens: jax.Array, lens: jax.Array, caches: list[MLACache]):
        """Sequences tokens [B, S] (int; sequence b's first lens[b], the rest padding), each from
        position 0: (float32 [B, vocab] logits of each sequence's last token, the caches with
        every layer's entries written)."""
        h = self.embed(tokens)
        out = []
        for layer, cache in zip(self.layers, caches):
            h, cache = layer.prefill(h, lens, cache)
            out.append(cache)
        last = jnp.take_along_axis(h, (jnp.asarray(lens) - 1).clip(0)[:, None, None], axis=1)[:, 0]
        return self._logits(last), out

    def decode(self, tokens: jax.Array, caches: list[MLACache]):
        """One token per sequence, tokens [B] at the cached lengths: (float32 [B, vocab] logits,
        the caches with it written)."""
        h = self.embed(tokens)
        out = []
        for layer, cache in zip(self.layers, caches):
            h, cache = layer.decode(h, cache)
            out.append(cache)
        return self._logits(h), out

    def generate(self, tokens: jax.Array, lens: jax.Array, caches: list[MLACache], steps: int):
        """Greedy generation: prefill, then steps - 1 decode steps in one lax.fori_loop (jit it
        to run the loop as one program). Returns (int32 [B, steps] tokens: the argmax after the
        prompt, then after each generated token; the caches, holding the prompts and all but the
        last generated token)."""
        logits, caches = self.prefill(tokens, lens, caches)
        out = jnp.zeros((tokens.shape[0], steps), jnp.int32).at[:, 0].set(jnp.argmax(logits, -1))

        def body(i, carry):
            caches, out = carry
            logits, caches = self.decode(out[:, i], caches)
            return caches, out.at[:, i + 1].set(jnp.argmax(logits, -1))
        caches, out = jax.lax.fori_loop(0, steps - 1, body, (caches, out))
        return out, caches
