"""The DeepSeek-V3.2-style block of examples/deepseek_v32_block.py: jax_dg in one jit against the
same block in PyTorch on the same deep_gemm calls (benchmarks/torch_block.py), eager and with its
decode step captured in a torch CUDA graph.

    python benchmarks/bench_block.py                 (a CUDA device and deep_gemm)
    python benchmarks/bench_block.py --tiny          (a smoke run; on CPU both sides run
                                                      jax_dg's torch emulation of deep_gemm)

Steps, one run, contenders interleaved (timing.compare), same weights, random state:
  prefill   one sequence of --seq tokens (the indexer's top-k, the sparse attention, the MoE's
            masked grouped GEMMs)
  decode    one token for each of B sequences with --ctx cached tokens (paged indexer logits +
            top-k, sparse attention over the selected keys, masked MoE); jax_dg donates the
            caches, torch updates them in place; "torch graph" replays the torch step captured
            in a CUDA graph.
  training  forward + backward of the example's toy next-token loss on one sequence of --seq
            tokens: jax_dg's gradients (nnx.value_and_grad in one jit) against torch autograd
            with jax_dg.fp8_linear's recipe written on deep_gemm (torch_block's autograd
            functions); no optimizer update on either side.
Ratios: torch / jax_dg (> 1: jax_dg is faster). "check": the two sides agree (prefill: calc_diff
of the logits; training: the losses' relative difference). "handler entries/step": jax_dg
handlers entered per decode step after the timing (0: XLA replays the step's command buffers).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import timing
import plot

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import jax_dg
import torch_block

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("deepseek_v32_block", ROOT / "examples" / "deepseek_v32_block.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

# A DeepSeek-like width that fits one H200 beside the plain sparse attention's gathers:
# hidden 2048 (16 heads of 128), 64 experts (6 per token), the indexer's 32 heads of 128.
SIZE = dict(dim=2048, heads=16, vocab=8192, experts=64, topk_experts=6, index_topk=512, seq=2048,
            batches=(64, 256), ctx=8192)
TINY = dict(dim=256, heads=4, vocab=512, experts=8, topk_experts=2, index_topk=16, seq=64,
            batches=(2,), ctx=128)


def prefill_row(block, twin, size, n):
    tokens = jax.random.randint(jax.random.PRNGKey(1), (size["seq"],), 0, size["vocab"]).astype(jnp.int32)
    t_tokens = torch.from_dlpack(tokens).long()
    graph, state = nnx.split(block)
    step = jax.jit(lambda st, t: nnx.merge(graph, st).prefill(t)[0])
    want = step(state, tokens)
    got = twin.prefill(t_tokens)[0]
    diff = jax_dg.calc_diff(np.asarray(want, np.float32), got.float().cpu().numpy())
    t = timing.compare({"jax_dg": (lambda: step(state, tokens), timing.jax_sync),
                        "torch": (lambda: twin.prefill(t_tokens)[0], timing.torch_sync)}, n)
    return {"step": "prefill", "shape": f"T{size['seq']}", "jax_dg_us": t["jax_dg"], "torch_us": t["torch"],
            "graph_us": float("nan"), "torch/jax_dg": t["torch"] / t["jax_dg"],
            "graph/jax_dg": float("nan"), "rel_err": diff, "entries": float("nan")}


def train_row(block, size, dg, n):
    twin = torch_block.Block(dg, block).train()
    pattern = example.toy_pattern(size["seq"], size["vocab"])
    t_pattern = torch.from_dlpack(pattern).long()
    graph, state = nnx.split(block)
    step = jax.jit(lambda st, p: example.loss_and_grads(nnx.merge(graph, st), p))

    def torch_step():
        for p in twin.parameters():
            p.grad = None
        loss = twin.loss(t_pattern)
        loss.backward()
        return loss
    loss, t_loss = step(state, pattern)[0], torch_step()
    t = timing.compare({"jax_dg": (lambda: step(state, pattern), timing.jax_sync),
                        "torch": (torch_step, timing.torch_sync)}, n)
    return {"step": "training", "shape": f"T{size['seq']}", "jax_dg_us": t["jax_dg"], "torch_us": t["torch"],
            "graph_us": float("nan"), "torch/jax_dg": t["torch"] / t["jax_dg"],
            "graph/jax_dg": float("nan"), "rel_err": abs(float(loss) - t_loss.item()) / abs(float(loss)),
            "entries": float("nan")}


def decode_state(block, b, ctx, block_size=64):
    """Random caches of b sequences with ctx tokens each and room for more (the JAX arrays)."""
    room = ctx + 1024
    tables, nb = example.paged.build_block_tables(np.full(b, room), block_size)
    k = jax.random.normal(jax.random.PRNGKey(2), (nb, block_size, block.indexer.head_dim), jnp.bfloat16)
    cache = example.nn.IndexerCache(example.paged.quantize_kv_cache(k), tables, jnp.full((b,), ctx, jnp.int32))
    shape = (b, room, block.heads, block.hd)
    k_all = jax.random.normal(jax.random.PRNGKey(3), shape, jnp.bfloat16)
    v_all = jax.random.normal(jax.random.PRNGKey(4), shape, jnp.bfloat16)
    return cache, k_all, v_all


def decode_row(block, twin, size, b, n):
    graph, state = nnx.split(block)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (b,), 0, size["vocab"]).astype(jnp.int32)
    step = jax.jit(lambda st, t, c, k, v: nnx.merge(graph, st).decode_step(t, c, k, v),
                   donate_argnums=(2, 3, 4))
    held = list(decode_state(block, b, size["ctx"]))

    def jax_step():   # the caches go round (donated); the logits are the step's result
        logits, *held[:] = step(state, tokens, *held)
        return logits
    own = torch_block.to_torch
    cache, k_all, v_all = decode_state(block, b, size["ctx"])
    t_state = (own(cache.kv_cache), own(cache.block_tables), own(cache.context_lens))
    t_k, t_v, t_tokens = own(k_all), own(v_all), own(tokens).long()
    del cache, k_all, v_all
    contenders = {"jax_dg": (jax_step, timing.jax_sync),
                  "torch": (lambda: twin.decode_step(t_tokens, t_state, t_k, t_v), timing.torch_sync)}
    if torch.cuda.is_available():
        contenders["graph"] = (timing.captured(lambda: twin.decode_step(t_tokens, t_state, t_k, t_v)),
                               timing.torch_sync)
    t = timing.compare(contenders, n)
    graph_us = t.get("graph", float("nan"))
    calls = handler_entries()
    for _ in range(n):
        jax_step()
    timing.jax_sync(held[0].context_lens)
    entries = (handler_entries() - calls) / n   # after recording: 0 when the step is captured whole
    return {"step": "decode", "shape": f"B{b} ctx{size['ctx']}", "jax_dg_us": t["jax_dg"],
            "torch_us": t["torch"], "graph_us": graph_us, "torch/jax_dg": t["torch"] / t["jax_dg"],
            "graph/jax_dg": graph_us / t["jax_dg"], "rel_err": float("nan"), "entries": entries}


def handler_entries() -> int:
    """jax_dg's handler entries so far (the bridge's and its own kernels')."""
    from jax_dg.core import native
    from jax_dg.runtime import bridge
    return bridge.call_count() + native.call_count()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the example's size: a smoke run")
    args = ap.parse_args(argv)
    size = TINY if args.tiny else SIZE
    dg = torch_block.deep_gemm_or_emulation()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(dg, '__version__', dg.__name__)}, size {size}")
    block = example.Block(size["dim"], size["heads"], size["vocab"], size["experts"], size["topk_experts"],
                          size["index_topk"], rngs=nnx.Rngs(0))
    twin = torch_block.Block(dg, block)
    n = 2 if args.tiny else 10
    rows = [prefill_row(block, twin, size, n)]
    rows += [decode_row(block, twin, size, b, 2 if args.tiny else 20) for b in size["batches"]]
    rows.append(train_row(block, size, dg, n))
    plot.write("bench_block", "DeepSeek-V3.2-style block: jax_dg vs PyTorch on deep_gemm", rows, [
        ("step", "step"), ("shape", "shape"), ("jax_dg_us", "jax_dg us"), ("torch_us", "torch us"),
        ("graph_us", "torch graph us"), ("torch/jax_dg", "torch/jax_dg"), ("graph/jax_dg", "graph/jax_dg"),
        ("rel_err", "check"), ("entries", "handler entries/step")],
        label=lambda r: f"{r['step']} {r['shape']}", ratios=["torch/jax_dg", "graph/jax_dg"])


if __name__ == "__main__":
    main()
