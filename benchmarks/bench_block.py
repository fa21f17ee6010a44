"""DeepSeek V3.2's block (jax_dg.nn.Block: MLA with the lightning indexer, then the MoE) and each of
its layers: jax_dg in one jit against the same structure in PyTorch on the same deep_gemm calls
(benchmarks/torch_block.py's V32Block), eager and with each decode step captured in a torch CUDA
graph; and the toy example's training step (examples/deepseek_v32_block.py).

    python benchmarks/bench_block.py                 (a CUDA device and deep_gemm)
    python benchmarks/bench_block.py --tiny          (a smoke run; on CPU both sides run
                                                      jax_dg's torch emulation of deep_gemm)

The block as DeepSeek ships V3.2, at a smaller width (SIZE: DeepSeek-V2-Lite's hidden 2048, 16
heads and 64 experts of 1408, 6 per token, 2 shared; V3.2's MLA ranks and head sizes, its
indexer of 64 heads of 128 keeping 2048 positions, YaRN, UE8M0 scales, the weights stored FP8 as
a checkpoint holds them). Rows, contenders interleaved (timing.compare), same weights:
  prefill  block / attention / moe   one sequence of --seq tokens from position 0 (the indexer's
           top-k, DeepSeek's MHA form masked to it, the caches written; the MoE's layout as the
           module picks it for that many tokens)
  decode   block / attention / indexer / moe   one token for each of B sequences with --ctx
           cached tokens (the indexer's paged logits and top-k, the absorbed MLA over the
           gathered FP8 latent rows, the MoE); jax_dg donates the caches, torch writes them in
           place; "torch graph" replays the torch step captured in a CUDA graph. The moe rows
           also give the step's FP8 weight-read floor (the routed experts' and the shared
           expert's FP8 bytes at the measured read bandwidth: bench_moe_decode's).
  training the toy example block's forward + backward (its next-token loss, one sequence)
           against torch autograd with jax_dg.fp8_linear's recipe written on deep_gemm.
Ratios: torch / jax_dg (> 1: jax_dg is faster). "check": the two sides' outputs, calc_diff on the
first call from the same state (training: the losses' relative difference). "handler entries/
step": jax_dg handlers entered per call after the timing (0: XLA replays the step's command
buffers).
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
from bench_moe_decode import read_bandwidth, weight_bytes
from jax_dg import nn, paged
from jax_dg.nn.attention import pack_latent

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("deepseek_v32_block", ROOT / "examples" / "deepseek_v32_block.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

SIZE = dict(dim=2048, heads=16, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, index_heads=64,
            index_dim=128, index_topk=2048, experts=64, topk=6, inter=1408, shared=2, seq=4096,
            batches=(8, 64), ctx=8192, toy=example.SIZE | dict(dim=2048, heads=16, vocab=8192, experts=64,
                                                              topk_experts=6, index_topk=512, seq=2048))
TINY = dict(dim=256, heads=4, q_lora=128, kv_lora=256, nope=64, rope=32, v=64, index_heads=32, index_dim=128,
            index_topk=16, experts=8, topk=2, inter=128, shared=1, seq=64, batches=(2,), ctx=128,
            toy=example.SIZE)
BLOCK_SIZE = 64
COLUMNS = [("step", "step"), ("layer", "layer"), ("shape", "shape"), ("jax_dg_us", "jax_dg us"),
           ("torch_us", "torch us"), ("graph_us", "torch graph us"), ("torch/jax_dg", "torch/jax_dg"),
           ("graph/jax_dg", "graph/jax_dg"), ("floor_us", "floor us"), ("rel_err", "check"),
           ("entries", "handler entries/step")]
NAN = float("nan")


def make_block(s) -> nn.Block:
    """The block as DeepSeek ships V3.2 (YaRN, UE8M0, stored FP8 weights) at the sizes `s`."""
    rngs = nnx.Rngs(0)
    rope = nn.RoPE(dim=s["rope"], max_seq_len=163840, original_seq_len=4096, factor=40.0)
    common = dict(fp8_weights=True, scale_fmt="ue8m0", rngs=rngs)
    attn = nn.MLA(s["dim"], s["heads"], q_lora_rank=s["q_lora"], kv_lora_rank=s["kv_lora"],
                  qk_nope_head_dim=s["nope"], qk_rope_head_dim=s["rope"], v_head_dim=s["v"], rope=rope,
                  index_topk=s["index_topk"], index_n_heads=s["index_heads"], index_head_dim=s["index_dim"],
                  **common)
    moe = nn.MoE(s["dim"], s["inter"], s["experts"], s["topk"], n_shared=s["shared"], gate_bias=False,
                 score_func="softmax", norm_topk_prob=False, **common)   # V2-Lite's router
    return nn.Block(attn, moe, s["dim"], rngs=rngs)


def decode_cache(attn: nn.MLA, b: int, ctx: int) -> nn.MLACache:
    """Caches of b sequences with ctx tokens each and room for more: random latent rows (FP8
    values and UE8M0 scales of random features) and indexer keys."""
    room = ctx + 1024
    tables, nb = paged.build_block_tables(np.full(b, room), BLOCK_SIZE)
    rows = nb * BLOCK_SIZE
    kv_c = jax.random.normal(jax.random.PRNGKey(2), (rows, attn.kv_lora_rank), jnp.bfloat16)
    k_pe = jax.random.normal(jax.random.PRNGKey(3), (rows, attn.qk_rope_head_dim), jnp.bfloat16)
    latent = jax.jit(lambda c, p: pack_latent(c, p, use_ue8m0=True)[0])(kv_c, k_pe)
    keys = jax.random.normal(jax.random.PRNGKey(4), (nb, BLOCK_SIZE, attn.indexer.head_dim), jnp.bfloat16)
    return nn.MLACache(latent.reshape(nb, BLOCK_SIZE, 1, -1), paged.quantize_kv_cache(keys, use_ue8m0=True),
                       tables, jnp.full((b,), ctx, jnp.int32))


def torch_cache(cache: nn.MLACache) -> list[torch.Tensor]:
    own = torch_block.to_torch
    return [own(cache.latent), own(cache.index_keys), own(cache.block_tables), own(cache.context_lens)]


def row(step, layer, shape, t, check=NAN, entries=NAN, floor=NAN) -> dict:
    graph_us = t.get("graph", NAN)
    return {"step": step, "layer": layer, "shape": shape, "jax_dg_us": t["jax_dg"], "torch_us": t["torch"],
            "graph_us": graph_us, "torch/jax_dg": t["torch"] / t["jax_dg"], "graph/jax_dg": graph_us / t["jax_dg"],
            "floor_us": floor, "rel_err": check, "entries": entries}


def diff(a, b) -> float:
    return float(jax_dg.calc_diff(np.asarray(a, np.float32), b.float().cpu().numpy()))


def handler_entries() -> int:
    """jax_dg's handler entries so far (the bridge's and its own kernels')."""
    from jax_dg.core import native
    from jax_dg.runtime import bridge
    return bridge.call_count() + native.call_count()


def timed(jax_step, torch_step, n, *, graph: bool):
    """timing.compare of jax_dg's step, torch's and (graph, on a GPU) torch's step replayed from
    a CUDA graph; then jax_dg's handler entries per call."""
    contenders = {"jax_dg": (jax_step, timing.jax_sync), "torch": (torch_step, timing.torch_sync)}
    if graph and torch.cuda.is_available():
        contenders["graph"] = (timing.captured(torch_step), timing.torch_sync)
    t = timing.compare(contenders, n)
    calls = handler_entries()
    out = None
    for _ in range(n):
        out = jax_step()
    timing.jax_sync(out)
    return t, (handler_entries() - calls) / n


def prefill_rows(block, twin, s, n):
    x = jax.random.normal(jax.random.PRNGKey(1), (1, s["seq"], s["dim"]), jnp.bfloat16)
    lens = jnp.array([s["seq"]], jnp.int32)
    tables, nb = paged.build_block_tables(np.array([s["seq"]]), BLOCK_SIZE)
    t_x = torch_block.to_torch(x[0])
    shape = f"T{s['seq']}"
    rows = []
    for layer in ("block", "attention", "moe"):
        mod = {"block": block, "attention": block.attn, "moe": block.ffn}[layer]
        rival = {"block": twin, "attention": twin.attn, "moe": twin.ffn}[layer]
        graph, state = nnx.split(mod)
        if layer == "moe":
            step = jax.jit(lambda st, x: nnx.merge(graph, st)(x))
            want = step(state, x[0])
            got = rival(t_x)
            t, entries = timed(lambda: step(state, x[0]), lambda: rival(t_x), n, graph=False)
        else:
            step = jax.jit(lambda st, x, c: nnx.merge(graph, st).prefill(x, lens, c), donate_argnums=(2,))
            held = [mod_cache(block, tables, nb)]
            t_state = torch_cache(mod_cache(block, tables, nb))
            want, held[0] = step(state, x, held[0])
            want = want[0]
            got = rival.prefill(t_x, t_state)

            def jax_step():
                out, held[0] = step(state, x, held[0])
                return out
            t, entries = timed(jax_step, lambda: rival.prefill(t_x, t_state), n, graph=False)
        rows.append(row("prefill", layer, shape, t, diff(want, got), entries))
    return rows


def mod_cache(block, tables, nb):
    return block.attn.init_cache(tables, nb, BLOCK_SIZE)


def decode_rows(block, twin, s, b, n, bandwidth):
    x = jax.random.normal(jax.random.PRNGKey(5), (b, s["dim"]), jnp.bfloat16)
    t_x = torch_block.to_torch(x)
    shape = f"B{b} ctx{s['ctx']}"
    rows = []
    for layer in ("block", "attention", "indexer", "moe"):
        mod = {"block": block, "attention": block.attn, "indexer": block.attn.indexer, "moe": block.ffn}[layer]
        rival = {"block": twin, "attention": twin.attn, "indexer": twin.attn.indexer, "moe": twin.ffn}[layer]
        graph, state = nnx.split(mod)
        floor = NAN
        if layer == "moe":
            step = jax.jit(lambda st, x: nnx.merge(graph, st)(x))
            want, got = step(state, x), rival(t_x)
            nbytes, _ = weight_bytes(block.ffn, x)
            floor = nbytes / bandwidth * 1e6
            t, entries = timed(lambda: step(state, x), lambda: rival(t_x), n, graph=True)
        elif layer == "indexer":
            qr = jax.random.normal(jax.random.PRNGKey(6), (b, block.attn.wq_b.in_features), jnp.bfloat16)
            t_qr = torch_block.to_torch(qr)
            step = jax.jit(lambda st, x, qr, c: nnx.merge(graph, st).decode(x, qr, c), donate_argnums=(3,))
            full = decode_cache(block.attn, b, s["ctx"])
            held = [full.index]
            t_state = torch_cache(decode_cache(block.attn, b, s["ctx"]))[1:]
            want, held[0] = step(state, x, qr, held[0])
            got, _ = rival.decode(t_x, t_qr, t_state)

            def jax_step():
                idx, held[0] = step(state, x, qr, held[0])
                return idx
            agree = float(np.mean([len(set(r) & set(g)) / len(r) for r, g in
                                   zip(np.asarray(want), got.cpu().numpy())]))
            t, entries = timed(jax_step, lambda: rival.decode(t_x, t_qr, t_state)[0], n, graph=True)
            rows.append(row("decode", layer, shape, t, 1.0 - agree, entries))
            continue
        else:
            step = jax.jit(lambda st, x, c: nnx.merge(graph, st).decode(x, c), donate_argnums=(2,))
            held = [decode_cache(block.attn, b, s["ctx"])]
            t_state = torch_cache(decode_cache(block.attn, b, s["ctx"]))
            want, held[0] = step(state, x, held[0])
            got = rival.decode(t_x, t_state)

            def jax_step():
                out, held[0] = step(state, x, held[0])
                return out
            t, entries = timed(jax_step, lambda: rival.decode(t_x, t_state), n, graph=True)
        rows.append(row("decode", layer, shape, t, diff(want, got), entries, floor))
    return rows


def train_row(s, dg, n):
    """The toy example block's training step (examples/deepseek_v32_block.py) against torch autograd."""
    size = s["toy"]
    block = example.Block(size["dim"], size["heads"], size["vocab"], size["experts"], size["topk_experts"],
                          size["index_topk"], rngs=nnx.Rngs(0))
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
    return row("training", "toy block", f"T{size['seq']}", t, abs(float(loss) - t_loss.item()) / abs(float(loss)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run")
    ap.add_argument("--no-training", action="store_true", help="leave out the toy block's training row")
    args = ap.parse_args(argv)
    s = TINY if args.tiny else SIZE
    dg = torch_block.deep_gemm_or_emulation()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}, "
          f"deep_gemm {getattr(dg, '__version__', dg.__name__)}, size {s}")
    block = make_block(s)
    twin = torch_block.V32Block(dg, block)
    n = 2 if args.tiny else 10
    bandwidth = read_bandwidth(0.0625 if args.tiny else 4.0, 2 if args.tiny else 5)
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s (the MoE rows' floor)")
    rows = prefill_rows(block, twin, s, 2 if args.tiny else 5)
    for b in s["batches"]:
        rows += decode_rows(block, twin, s, b, 2 if args.tiny else 20, bandwidth)
    if not args.no_training:
        rows.append(train_row(s, dg, n))
    plot.write("bench_block", "DeepSeek-V3.2 block and layers: jax_dg vs PyTorch on deep_gemm", rows, COLUMNS,
               label=lambda r: f"{r['step']} {r['layer']} {r['shape']}", ratios=["torch/jax_dg", "graph/jax_dg"])


if __name__ == "__main__":
    main()
