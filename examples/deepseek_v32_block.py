"""A small DeepSeek-V3.2-style decoder block on jax_dg.nn: prefill, a jitted decode loop over a
paged FP8 key cache, and a few training steps.

    python examples/deepseek_v32_block.py              # DeepGEMM on a GPU, the torch emulation on CPU
    JAX_DG_BACKEND=xla python examples/deepseek_v32_block.py   # pure JAX, no custom call
    python -m jax_dg warmup examples/deepseek_v32_block.py     # compile its DeepGEMM kernels ahead

The block: RMSNorm -> the lightning indexer picks each query's top-k keys -> attention over
those keys only (sparse attention in plain JAX) -> RMSNorm -> MoE, with residuals, between a toy
embedding and output head. Prefill runs a whole sequence causally; decode runs
`lax.fori_loop` over new tokens in one jit, each step writing the indexer's paged FP8 cache and
the attention's K/V; training is a few optax steps on a toy next-token task.

What it simplifies of DeepSeek V3.2, and why: the attention is plain multi-head attention over
the selected keys (V3.2's MLA compresses K/V into a latent; the indexer -> sparse attention
dataflow, which is what jax_dg serves, is the same); that attention has no RoPE of its own (V3.2
decouples a RoPE part of q and k; positions reach this block through the indexer's RoPE and the
causal selection, which is what the decode loop has to reproduce); the indexer's own training
loss (a KL term against the dense attention) is left out, so its weights get no gradient here
(its top-k is an index); the gate is DeepSeek V3's (jax_dg.nn.moe: sigmoid scores, the bias for
the choice only, group-limited routing) at a toy size: one group, one shared expert; the
indexer's simplifications are jax_dg.nn.indexer's.

Checks (exit status 1 if one fails): the prefill output against the same block traced with
JAX_DG_BACKEND=xla (calc_diff), decode's logits for the prefilled positions against prefill's,
and the training loss going down.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # room for DeepGEMM beside XLA

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jax_dg  # noqa: E402
from jax_dg import nn, paged  # noqa: E402

# Prefill logits vs the pure-JAX reference (the same FP8 recipe, exact float32 sums). The torch
# emulation's sums agree to float32 rounding (measured 1.5e-4). DeepGEMM's FP8 tensor-core sums
# differ from exact ones in the last bits, the FP8 casts between layers turn some of those into
# one-ulp (6%) steps, and the indexer's and router's top-k turn near-ties into other keys and
# experts: measured 7.9e-3 on the H200 with 16 of 48 keys kept.
MAX_DIFF = {"cpu": 2e-3, "gpu": 2e-2}


def max_diff() -> float:
    """MAX_DIFF for the platform jax runs on (DeepGEMM's bound on any accelerator)."""
    return MAX_DIFF.get(jax.default_backend(), MAX_DIFF["gpu"])
# Decode vs prefill for one token: the two paths round differently (the emulation's float32 sums
# depend on the row count; vmap changes it), and a near-tie top-k pick (an indexer key, an MoE
# expert) can flip on one ulp. Measured 2.3e-4 at the default size.
MAX_DECODE_DIFF = 5e-3
SIZE = dict(dim=256, heads=4, vocab=512, experts=8, topk_experts=2, index_topk=64, seq=64, new=4, batch=2)


class Block(nnx.Module):
    def __init__(self, dim, heads, vocab, experts, topk_experts, index_topk, *, rngs):
        self.heads, self.hd = heads, dim // heads
        self.embed = nnx.Embed(vocab, dim, param_dtype=jnp.bfloat16, rngs=rngs)
        self.norm1, self.norm2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.wq_a = nn.FP8Linear(dim, 128, rngs=rngs)          # the compressed query (q_lora_rank)
        self.wq_b = nn.FP8Linear(128, dim, rngs=rngs)
        self.wkv = nn.FP8Linear(dim, 2 * dim, rngs=rngs)
        self.wo = nn.FP8Linear(dim, dim, rngs=rngs)
        self.indexer = nn.LightningIndexer(dim, 128, n_heads=32, head_dim=128, topk=index_topk, rngs=rngs)
        self.moe = nn.MoE(dim, dim, experts, topk_experts, rngs=rngs)
        self.head = nn.FP8Linear(dim, vocab, rngs=rngs)

    def _attend(self, q, k, v, idx):
        """q [T, H, hd] attends to its selected keys k/v [S, H, hd] (idx [T, topk], -1 unused)."""
        kk, vv = k[jnp.maximum(idx, 0)], v[jnp.maximum(idx, 0)]            # [T, topk, H, hd]
        hi = jax.lax.Precision.HIGHEST   # float32 as torch computes it (XLA's GPU default: TF32)
        s = jnp.einsum("thd,tkhd->thk", q.astype(jnp.float32), kk.astype(jnp.float32), precision=hi)
        s = jnp.where((idx >= 0)[:, None, :], s * self.hd ** -0.5, -jnp.inf)
        return jnp.einsum("thk,tkhd->thd", jax.nn.softmax(s, axis=-1), vv.astype(jnp.float32), precision=hi)

    def _after_attention(self, x, o):
        """The attention's output projection and the MoE, each added to the residual x [T, dim]."""
        o = o.reshape(x.shape[0], -1).astype(jnp.bfloat16)
        x = (x.astype(jnp.float32) + self.wo(o).astype(jnp.float32)).astype(jnp.bfloat16)
        return x.astype(jnp.float32) + self.moe(self.norm2(x).astype(jnp.bfloat16)).astype(jnp.float32)

    def prefill(self, tokens):
        """Logits [T, vocab] of one sequence, causal; and what decode caches (indexer keys, K, V)."""
        x = self.embed(tokens)
        h = self.norm1(x).astype(jnp.bfloat16)
        qr = self.wq_a(h)
        idx, keys = self.indexer.prefill(h, qr)
        kv = self.wkv(h).reshape(x.shape[0], 2, self.heads, self.hd)
        q = self.wq_b(qr).reshape(x.shape[0], self.heads, self.hd)
        y = self._after_attention(x, self._attend(q, kv[:, 0], kv[:, 1], idx))
        return self.head(y.astype(jnp.bfloat16)), (keys, kv[:, 0], kv[:, 1])

    def decode_step(self, tokens, cache, k_all, v_all):
        """One token per sequence (tokens [B]) at position cache.context_lens: logits [B, vocab]."""
        x = self.embed(tokens)
        h = self.norm1(x).astype(jnp.bfloat16)
        qr = self.wq_a(h)
        pos = cache.context_lens
        idx, cache = self.indexer.decode(h, qr, cache)
        kv = self.wkv(h).reshape(x.shape[0], 2, self.heads, self.hd)
        b = jnp.arange(x.shape[0])
        k_all, v_all = k_all.at[b, pos].set(kv[:, 0]), v_all.at[b, pos].set(kv[:, 1])
        q = self.wq_b(qr).reshape(-1, self.heads, self.hd)
        o = jax.vmap(lambda q, k, v, i: self._attend(q[None], k, v, i[None])[0])(q, k_all, v_all, idx)
        y = self._after_attention(x, o)   # as prefill: the same roundings on both paths
        return self.head(y.astype(jnp.bfloat16)), cache, k_all, v_all


def prefill_cache(block, tokens, total: int, block_size: int = 64):
    """Prefill `tokens` [B, S] (each sequence on its own): (logits [B, S, vocab], the indexer's
    paged cache and the attention's K and V [B, total, H, hd], with room up to `total` tokens)."""
    b, s = tokens.shape
    logits, (keys, ks, vs) = jax.vmap(lambda t: block.prefill(t))(tokens)
    tables, nb = paged.build_block_tables(np.full(b, total), block_size)
    cache = nn.IndexerCache(paged.kv_cache_from_sequences(keys, tables, block_size, nb), tables,
                            jnp.full((b,), s, jnp.int32))
    room = lambda a: jnp.zeros((b, total) + a.shape[2:], a.dtype).at[:, :s].set(a)  # noqa: E731
    return logits, cache, room(ks), room(vs)


def decode(block, tokens, new: int, block_size: int = 64):
    """Prefill `tokens` [B, S] (each sequence on its own), then `new` greedy tokens per sequence in
    one jitted lax.fori_loop. Returns (prefill logits [B, S, vocab], generated [B, new])."""
    b, s = tokens.shape
    logits, cache, k_all, v_all = prefill_cache(block, tokens, s + new, block_size)
    out = jnp.zeros((b, new), jnp.int32)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def body(i, carry):
        tok, cache, k_all, v_all, out = carry
        out = out.at[:, i].set(tok)
        lg, cache, k_all, v_all = block.decode_step(tok, cache, k_all, v_all)
        return jnp.argmax(lg, axis=-1).astype(jnp.int32), cache, k_all, v_all, out
    carry = jax.lax.fori_loop(0, new, body, (first, cache, k_all, v_all, out))
    return logits, carry[-1]


def toy_pattern(seq: int, vocab: int):
    """The toy task's sequence: token t + 1 follows token t of a repeating pattern."""
    return jnp.arange(seq + 1, dtype=jnp.int32) * 7 % vocab


def loss_and_grads(block, pattern):
    """The next-token loss on `pattern` [S + 1] and its gradients (forward + backward)."""
    def loss_fn(block):
        logits, _ = block.prefill(pattern[:-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), pattern[1:]).mean()
    return nnx.value_and_grad(loss_fn)(block)


def train(block, steps: int, seq: int, vocab: int):
    """A few adam steps on a toy task (the next token of a repeating pattern): the losses."""
    pattern = toy_pattern(seq, vocab)
    opt = nnx.Optimizer(block, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(block, opt):
        loss, grads = loss_and_grads(block, pattern)
        opt.update(block, grads)
        return loss
    return [float(step(block, opt)) for _ in range(steps)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=SIZE["seq"])
    ap.add_argument("--new", type=int, default=SIZE["new"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--index-topk", type=int, default=SIZE["index_topk"], help="keys the indexer keeps")
    return ap.parse_args(argv)


def make_block(args) -> Block:
    return Block(SIZE["dim"], SIZE["heads"], SIZE["vocab"], SIZE["experts"], SIZE["topk_experts"],
                 args.index_topk, rngs=nnx.Rngs(0))


def warmup_jobs(argv=None):
    """What `python -m jax_dg warmup examples/deepseek_v32_block.py [-- args]` compiles ahead:
    main()'s programs at its sizes (token shapes only; the block's weights are captured)."""
    args = parse_args(argv)
    block = make_block(args)
    b, s = SIZE["batch"], args.seq
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
    nxt = jax.ShapeDtypeStruct((b,), jnp.int32)
    graph, state = nnx.split(block)   # the gradient's module must come from inside the trace
    return [("prefill + decode loop", lambda t: decode(block, t, args.new), (tokens,), {}),
            ("decode step after prefill", lambda t, n: first_step(block, t, n), (tokens, nxt), {}),
            ("training step (forward + backward)",
             lambda st, p: loss_and_grads(nnx.merge(graph, st), p),
             (state, jax.ShapeDtypeStruct((s + 1,), jnp.int32)), {})]


def main(argv=None) -> int:
    args = parse_args(argv)
    block = make_block(args)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (SIZE["batch"], args.seq), 0, SIZE["vocab"])
    ok = True

    t0 = time.perf_counter()
    run = nnx.jit(lambda blk, t: decode(blk, t, args.new))
    logits, generated = jax.block_until_ready(run(block, tokens))
    print(f"prefill {tokens.shape} + decode {args.new} tokens: {time.perf_counter() - t0:.1f} s "
          f"(compile included); generated {np.asarray(generated)[0].tolist()}")
    with jax_dg.use_backend("xla"):
        ref_logits, _ = jax.vmap(lambda t: block.prefill(t))(tokens)
    diff = jax_dg.calc_diff(logits, ref_logits)
    limit = max_diff()
    print(f"prefill logits vs pure-JAX reference: calc_diff {diff:.2e} (max {limit:g})")
    ok &= diff < limit

    # A decode step on the prompt's cache gives the logits prefill gives for the same token at
    # the same position (the same token on both sides: an argmax may flip on rounding).
    nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    full, _ = nnx.jit(lambda blk, t: jax.vmap(blk.prefill)(t))(block, jnp.concatenate([tokens, nxt[:, None]], 1))
    lg, *_ = decode_first(block, tokens, nxt)
    diff = jax_dg.calc_diff(lg, full[:, -1])
    print(f"decode step vs prefill at the same position: calc_diff {diff:.2e} (max {MAX_DECODE_DIFF:g})")
    ok &= diff < MAX_DECODE_DIFF

    losses = train(block, args.steps, args.seq, SIZE["vocab"])
    print("training loss: " + " -> ".join(f"{v:.3f}" for v in losses))
    ok &= losses[-1] < losses[0]
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def first_step(block, tokens, nxt):
    """The decode step of token nxt [B] after prefilling `tokens` [B, S] (its logits first)."""
    _, cache, k_all, v_all = prefill_cache(block, tokens, tokens.shape[1] + 1)
    return block.decode_step(nxt, cache, k_all, v_all)


decode_first = nnx.jit(first_step)


if __name__ == "__main__":
    sys.exit(main())
