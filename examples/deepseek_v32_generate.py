"""DeepSeek-V3.2 as DeepSeek ships it, end to end at a toy size: a checkpoint in DeepSeek's Hugging
Face layout, loaded into jax_dg.nn.Transformer, and greedy generation on DeepGEMM.

    python examples/deepseek_v32_generate.py               (DeepGEMM on a GPU, the torch emulation on CPU)
    JAX_DG_BACKEND=xla python examples/deepseek_v32_generate.py   (pure JAX, no custom call)
    python -m jax_dg warmup examples/deepseek_v32_generate.py     (compile its DeepGEMM kernels ahead)

1. Writes a checkpoint the way DeepSeek publishes V3.2 (config.json with YaRN's rope_scaling,
   `quantization_config` FP8 with UE8M0 scales, the sigmoid router with its correction bias;
   linear weights float8_e4m3fn [out, in] + weight_scale_inv, norms and embeddings bf16, sharded
   *.safetensors + model.safetensors.index.json), from a randomly initialised model.
2. Loads it with jax_dg.nn.load_checkpoint into a Transformer built abstractly (no weights
   initialised): the FP8 weights are held as stored and never re-quantised.
3. Generates greedily for prompts of different lengths: one prefill of the padded batch into the
   paged caches (MLA's FP8 latent rows and the indexer's FP8 keys, through one set of block
   tables), then the decode steps in one jitted lax.fori_loop (on a GPU XLA replays the loop's
   command buffers: no Python per step).

Checks (exit status 1 if one fails): every loaded tensor is the written one, bit for bit; each
prompt's logits in the padded batch are its logits alone; the first decode step's logits are
prefill's for the same token at the same position (the attention's absorbed decode form against
its prefill form: FP8 noise apart, see MAX_FORMS_DIFF).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # room for DeepGEMM beside XLA

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jax_dg  # noqa: E402
from jax_dg import nn, paged  # noqa: E402

# DeepSeek-V3.2's config.json (deepseek-ai/DeepSeek-V3.2-Exp) with its sizes made small: two
# layers (a dense one, then an MoE one), 4 attention heads, 8 experts in 2 groups.
CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_act": "silu",
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 128, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 32,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "norm_topk_prob": True, "topk_method": "noaux_tc",
    "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-06,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
PROMPTS = (37, 12, 24)        # prompt lengths: one padded batch
BLOCK_SIZE = 64
# Decode's logits against prefill's for the same token: MLA's absorbed decode multiplies by
# wkv_b's weight where prefill runs wkv_b's FP8 GEMM on the latent cast per token, with UE8M0's
# coarser scales, through two layers into the logits (measured 4.4e-3 on the CPU emulation).
MAX_FORMS_DIFF = {"cpu": 1e-2, "gpu": 2e-2}
# A prompt's logits alone and in the padded batch: the same rows, but the batch's row counts
# move float32 sums (the emulation's, the head's: measured 2.8e-6 on the CPU); on DeepGEMM the
# grouped GEMMs' expected-rows hint picks another tiling for another batch.
MAX_BATCH_DIFF = {"cpu": 1e-5, "gpu": 1e-3}


def on_platform(limits: dict) -> float:
    """The limit for the platform jax runs on (DeepGEMM's on any accelerator)."""
    return limits.get(jax.default_backend(), limits["gpu"])


def checkpoint_dtype(name: str, value: np.ndarray):
    """The dtype DeepSeek's checkpoint stores `name` in: FP8 weights as they are, their scales
    and the router's correction bias float32, the rest bfloat16."""
    if value.dtype == ml_dtypes.float8_e4m3fn:
        return value.dtype
    if name.endswith((".weight_scale_inv", ".e_score_correction_bias")):
        return np.float32
    return ml_dtypes.bfloat16


def write_checkpoint(folder: pathlib.Path, model: nn.Transformer, config: dict, shards: int = 3) -> dict:
    """The model's weights in DeepSeek's Hugging Face layout (names from nn.checkpoint_names):
    config.json, `shards` safetensors files and the index; returns the tensors written."""
    from safetensors.numpy import save_file
    tensors = {}
    for name, slot in nn.checkpoint_names(model).items():
        value = np.asarray(slot.var.get_value())[slot.index]
        value = value.T if slot.transpose else value
        tensors[name] = np.ascontiguousarray(value.astype(checkpoint_dtype(name, value)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[j]: tensors[names[j]] for j in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({names[j]: file for j in part})
    total = sum(t.nbytes for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return tensors


def load(folder: pathlib.Path) -> nn.Transformer:
    """The checkpoint in `folder` into a Transformer built abstractly (its FP8 weights as stored)."""
    cfg = nn.load_config(folder)
    model = nnx.eval_shape(lambda: nn.Transformer(cfg, rngs=nnx.Rngs(0)))
    return nn.load_checkpoint(folder, model)


def loaded_as_written(model: nn.Transformer, tensors: dict) -> list[str]:
    """Names of the tensors whose place in the loaded model does not hold them bit for bit."""
    bad = []
    for name, slot in nn.checkpoint_names(model).items():
        value = np.asarray(slot.var.get_value())[slot.index]
        value = value.T if slot.transpose else value
        want = tensors[name]
        if value.dtype != want.dtype:   # a float32 variable of a bf16 tensor: exact widening
            value = value.astype(want.dtype)
        if value.tobytes() != want.tobytes():
            bad.append(name)
    return bad


def caches(model: nn.Transformer, lens, room: int):
    """Every layer's empty paged cache for sequences of up to `room` tokens each."""
    tables, num_blocks = paged.build_block_tables(np.full(len(lens), room), BLOCK_SIZE)
    return model.init_cache(tables, num_blocks, BLOCK_SIZE)


def prompts(vocab: int, lens=PROMPTS):
    """(int32 [B, max(lens)] padded prompts, int32 [B] lengths)."""
    tokens = jax.random.randint(jax.random.PRNGKey(1), (len(lens), max(lens)), 0, vocab).astype(jnp.int32)
    mask = jnp.arange(max(lens))[None, :] < jnp.array(lens)[:, None]
    return jnp.where(mask, tokens, 0), jnp.array(lens, jnp.int32)


def generator(model: nn.Transformer, steps: int):
    """generate(state, tokens, lens, caches) in one jit over nnx.split's state (the weights stay
    in the same buffers from call to call), the caches donated."""
    graph, state = nnx.split(model)
    run = jax.jit(lambda st, t, lens, c: nnx.merge(graph, st).generate(t, lens, c, steps), donate_argnums=(3,))
    return lambda t, lens, c: run(state, t, lens, c)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=8, help="tokens to generate per prompt")
    ap.add_argument("--dir", help="write the checkpoint here (default: a temporary folder)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(args.dir or tmp) / "deepseek-v3.2-toy"
        cfg = nn.load_config(CONFIG)
        tensors = write_checkpoint(folder, nn.Transformer(cfg, rngs=nnx.Rngs(0)), CONFIG)
        model = load(folder)
    bad = loaded_as_written(model, tensors)
    print(f"checkpoint: {len(tensors)} tensors ({sum(t.nbytes for t in tensors.values()) / 2**20:.1f} MiB, "
          f"FP8 with UE8M0 scales), loaded: {'bit for bit' if not bad else f'{len(bad)} differ: {bad[:3]}'}")
    ok &= not bad

    tokens, lens = prompts(cfg.vocab_size)
    room = int(lens.max()) + args.new
    t0 = time.perf_counter()
    out, _ = jax.block_until_ready(generator(model, args.new)(tokens, lens, caches(model, lens, room)))
    print(f"prefill {list(PROMPTS)} + {args.new - 1} decode steps in one jit: {time.perf_counter() - t0:.1f} s "
          f"(compile included)")
    for b, n in enumerate(PROMPTS):
        print(f"  prompt of {n} tokens -> {np.asarray(out[b]).tolist()}")

    prefill = nnx.jit(lambda m, t, lens, c: m.prefill(t, lens, c))
    logits, cache = prefill(model, tokens, lens, caches(model, lens, room))
    worst = max(float(jax_dg.calc_diff(prefill(model, tokens[b:b + 1, :n], lens[b:b + 1],
                                               caches(model, lens[b:b + 1], room))[0][0], logits[b]))
                for b, n in enumerate(PROMPTS))
    limit = on_platform(MAX_BATCH_DIFF)
    print(f"each prompt alone vs in the padded batch: logits calc_diff {worst:.1e} (max {limit:g})")
    ok &= worst < limit

    step, _ = nnx.jit(lambda m, t, c: m.decode(t, c))(model, out[:, 0], cache)
    longer = jnp.zeros((tokens.shape[0], tokens.shape[1] + 1), jnp.int32).at[:, :-1].set(tokens)
    longer = longer.at[jnp.arange(len(PROMPTS)), lens].set(out[:, 0])
    whole, _ = prefill(model, longer, lens + 1, caches(model, lens, room))
    diff = float(jax_dg.calc_diff(step, whole))
    limit = on_platform(MAX_FORMS_DIFF)
    print(f"decode step vs prefill at the same position: logits calc_diff {diff:.1e} (max {limit:g})")
    ok &= diff < limit
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def warmup_jobs(argv=None):
    """What `python -m jax_dg warmup examples/deepseek_v32_generate.py [-- args]` compiles ahead:
    main()'s generation program at its sizes (a model of the example's config: the kernels
    depend on the shapes, not on the weights' values)."""
    args = parse_args(argv)
    model = nn.Transformer(nn.load_config(CONFIG), rngs=nnx.Rngs(0))
    tokens, lens = prompts(CONFIG["vocab_size"])
    c = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                     caches(model, lens, int(lens.max()) + args.new))
    shape = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    graph, state = nnx.split(model)
    return [("prefill + decode loop",
             lambda st, t, n, c: nnx.merge(graph, st).generate(t, n, c, args.new),
             (jax.tree.map(shape, state), shape(tokens), shape(lens), c), {})]


if __name__ == "__main__":
    sys.exit(main())
