"""DeepSeek-V3.2's configuration files as shipped, and small checkpoints written in exactly the
Hugging Face layout DeepSeek publishes (config.json, sharded *.safetensors,
model.safetensors.index.json, FP8 weights with weight_scale_inv) for the loader's tests."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np

# deepseek-ai/DeepSeek-V3.2-Exp inference/config_671B_v3.2.json
DEEPSEEK_V32_CONFIG = {
    "vocab_size": 129280, "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61,
    "n_dense_layers": 3, "n_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "n_activated_experts": 8, "n_expert_groups": 8, "n_limited_groups": 4, "route_scale": 2.5,
    "score_func": "sigmoid", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "fp8", "scale_fmt": "ue8m0",
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
}

# deepseek-ai/DeepSeek-V3.2-Exp config.json (the Hugging Face checkpoint's)
HF_V32_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64,
    "index_topk": 2048, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.44.2", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def small_config(**changes) -> dict:
    """DeepSeek-V3.2's config.json at a test size: two layers (one dense, one MoE) and the MTP
    layer after them, FP8 weights with UE8M0 scales, YaRN."""
    return {**HF_V32_CONFIG, "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 128,
            "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "first_k_dense_replace": 1, "q_lora_rank": 128, "vocab_size": 512,
            **changes}


def _fp8(rng, out_f, in_f, ue8m0=True):
    values = rng.normal(0, 80, (out_f, in_f)).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    shape = (-(-out_f // 128), -(-in_f // 128))
    scales = 2.0 ** rng.integers(-12, -8, shape) if ue8m0 else rng.uniform(1e-4, 1e-3, shape)
    return values, scales.astype(np.float32)


def hf_tensors(cfg: dict, seed: int = 0, *, attention: bool = False) -> dict[str, np.ndarray]:
    """The tensors of a DeepSeek-V3.2 checkpoint with config.json `cfg`, named and shaped as the
    Hugging Face checkpoint names them (written here from DeepSeek's layout, not from jax_dg's
    tables), random values; every layer's attention part is the indexer only unless `attention`
    (MLA's projections and norms too). Layers past num_hidden_layers are the MTP layers."""
    rng = np.random.default_rng(seed)
    bf16 = lambda *shape: rng.normal(0, 0.5, shape).astype(ml_dtypes.bfloat16)  # noqa: E731
    fp8 = cfg.get("quantization_config") is not None
    ue8m0 = fp8 and cfg["quantization_config"].get("scale_fmt") == "ue8m0"
    t: dict[str, np.ndarray] = {}

    def linear(name, out_f, in_f):
        if fp8:
            t[f"{name}.weight"], t[f"{name}.weight_scale_inv"] = _fp8(rng, out_f, in_f, ue8m0)
        else:
            t[f"{name}.weight"] = bf16(out_f, in_f)

    def mlp(name, inter):
        linear(f"{name}.gate_proj", inter, d)
        linear(f"{name}.up_proj", inter, d)
        linear(f"{name}.down_proj", d, inter)

    d, v = cfg["hidden_size"], cfg["vocab_size"]
    h, hd = cfg["index_n_heads"], cfg["index_head_dim"]
    t["model.embed_tokens.weight"] = bf16(v, d)
    t["model.norm.weight"] = bf16(d)
    t["lm_head.weight"] = bf16(v, d)
    for i in range(cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = bf16(d)
        t[f"{p}.post_attention_layernorm.weight"] = bf16(d)
        linear(f"{p}.self_attn.indexer.wq_b", h * hd, cfg["q_lora_rank"])
        linear(f"{p}.self_attn.indexer.wk", hd, d)
        t[f"{p}.self_attn.indexer.k_norm.weight"] = bf16(hd)
        t[f"{p}.self_attn.indexer.k_norm.bias"] = bf16(hd)
        t[f"{p}.self_attn.indexer.weights_proj.weight"] = bf16(h, d)
        if attention:
            heads, qk = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            q, kv, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
            linear(f"{p}.self_attn.q_a_proj", q, d)
            t[f"{p}.self_attn.q_a_layernorm.weight"] = bf16(q)
            linear(f"{p}.self_attn.q_b_proj", heads * qk, q)
            linear(f"{p}.self_attn.kv_a_proj_with_mqa", kv + rope, d)
            t[f"{p}.self_attn.kv_a_layernorm.weight"] = bf16(kv)
            linear(f"{p}.self_attn.kv_b_proj", heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kv)
            linear(f"{p}.self_attn.o_proj", d, heads * cfg["v_head_dim"])
        if i < cfg["first_k_dense_replace"]:
            mlp(f"{p}.mlp", cfg["intermediate_size"])
            continue
        e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        t[f"{p}.mlp.gate.weight"] = bf16(e, d)
        if cfg.get("topk_method") == "noaux_tc":
            t[f"{p}.mlp.gate.e_score_correction_bias"] = rng.normal(0, 0.1, e).astype(np.float32)
        for j in range(e):
            mlp(f"{p}.mlp.experts.{j}", inter)
        mlp(f"{p}.mlp.shared_experts", inter * cfg["n_shared_experts"])
    return t


def write_checkpoint(folder: pathlib.Path, tensors: dict[str, np.ndarray], config: dict | None = None, *,
                     shards: int = 3, index: bool = True) -> pathlib.Path:
    """`tensors` as DeepSeek publishes them: config.json, `shards` files
    model-0000i-of-0000n.safetensors (names in order, split in runs), and
    model.safetensors.index.json's weight map (left out with index=False)."""
    from safetensors.numpy import save_file
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors, key=lambda n: [int(s) if s.isdigit() else s for s in n.split(".")])
    runs = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for i, run in enumerate(runs):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[j]: tensors[names[j]] for j in run}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({names[j]: file for j in run})
    if index:
        total = int(sum(a.nbytes for a in tensors.values()))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder
