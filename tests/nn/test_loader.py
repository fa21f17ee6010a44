"""load_checkpoint on small checkpoints written in exactly DeepSeek's Hugging Face layout (config.json,
sharded safetensors, model.safetensors.index.json, FP8 + weight_scale_inv): every tensor lands
where DeepSeek's model reads it (the MoE and MLP loaded compute DeepSeek's math on the raw
tensors), a missing / extra / misshapen / wrongly typed tensor is named before anything is read,
and a mesh gets each variable sharded as annotated (8 host devices, in a subprocess)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("safetensors")

import jax_dg  # noqa: E402
from jax_dg import nn  # noqa: E402
from jax_dg.nn.loader import CheckpointError, checkpoint_names, load_checkpoint  # noqa: E402
from tests.conftest import on_deep_gemm  # noqa: E402
from tests.nn import deepseek_reference as ref  # noqa: E402
from tests.nn.checkpoints import hf_tensors, small_config, write_checkpoint  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Attention(nnx.Module):
    """The attention's indexer alone (MLA's own tensors are the attention module's tests')."""

    def __init__(self, cfg, rngs, **kw):
        self.indexer = nn.LightningIndexer.from_config(cfg, rngs=rngs, **kw)


class Block(nnx.Module):
    def __init__(self, cfg, i, rngs, fp8_weights=None, expert_metadata=None):
        fp8 = cfg.fp8_weights if fp8_weights is None else fp8_weights
        self.attn_norm = nnx.RMSNorm(cfg.hidden_size, param_dtype=jnp.float32, rngs=rngs)
        self.attn = Attention(cfg, rngs, fp8_weights=fp8)
        self.ffn_norm = nnx.RMSNorm(cfg.hidden_size, param_dtype=jnp.float32, rngs=rngs)
        self.ffn = (nn.MoE.from_config(cfg, rngs=rngs, fp8_weights=fp8, expert_metadata=expert_metadata or {})
                    if cfg.is_moe_layer(i) else
                    nn.MLP(cfg.hidden_size, cfg.intermediate_size, fp8_weights=fp8, scale_fmt=cfg.scale_fmt, rngs=rngs))


class Model(nnx.Module):
    """DeepSeek's module names (inference/model.py): embed, layers, norm, head."""

    def __init__(self, cfg, rngs, **kw):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=jnp.bfloat16, rngs=rngs)
        self.layers = nnx.List([Block(cfg, i, rngs, **kw) for i in range(cfg.num_hidden_layers)])
        self.norm = nnx.RMSNorm(cfg.hidden_size, param_dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, param_dtype=jnp.float32, rngs=rngs)


def abstract_model(cfg, **kw):
    return nnx.eval_shape(lambda: Model(cfg, nnx.Rngs(0), **kw))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = small_config()
    tensors = hf_tensors(cfg)
    return write_checkpoint(tmp_path_factory.mktemp("v32"), tensors, cfg), tensors, cfg


def f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def test_every_tensor_lands_where_deepseek_reads_it(checkpoint):
    path, t, raw = checkpoint
    cfg = nn.load_config(path)
    m = load_checkpoint(path, abstract_model(cfg))
    same = np.testing.assert_array_equal
    same(f32(m.embed.embedding[...]), f32(t["model.embed_tokens.weight"]))
    same(f32(m.head.kernel[...]), f32(t["lm_head.weight"]).T)            # nnx.Linear's [in, out]
    assert m.head.kernel[...].dtype == jnp.float32 and m.norm.scale[...].dtype == jnp.float32
    same(f32(m.layers[1].ffn_norm.scale[...]), f32(t["model.layers.1.post_attention_layernorm.weight"]))
    idx = m.layers[0].attn.indexer
    same(f32(idx.wq_b.weight[...]), f32(t["model.layers.0.self_attn.indexer.wq_b.weight"]))
    same(f32(idx.wq_b.weight_scale_inv[...]), t["model.layers.0.self_attn.indexer.wq_b.weight_scale_inv"])
    same(f32(idx.weights_proj.kernel[...]), f32(t["model.layers.0.self_attn.indexer.weights_proj.weight"]).T)
    same(f32(idx.k_norm.bias[...]), f32(t["model.layers.0.self_attn.indexer.k_norm.bias"]))
    moe = m.layers[1].ffn
    same(f32(moe.gate.bias[...]), t["model.layers.1.mlp.gate.e_score_correction_bias"])
    same(f32(moe.w13[...][5, 128:]), f32(t["model.layers.1.mlp.experts.5.up_proj.weight"]))
    same(f32(moe.w2_scale_inv[...][7]), t["model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"])
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(nnx.state(m)))   # nothing abstract left

    # The loaded layers compute DeepSeek's model.py on the raw tensors (gate_proj and up_proj
    # where its Expert and MLP read them, the router's weight and bias).
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 256), jnp.bfloat16)
    xs = np.asarray(x, np.float32)
    pair = lambda name: (t[f"{name}.weight"], t[f"{name}.weight_scale_inv"])  # noqa: E731
    mlp = lambda p: (pair(f"{p}.gate_proj"), pair(f"{p}.up_proj"), pair(f"{p}.down_proj"))  # noqa: E731
    dense = f32(nnx.jit(lambda m, x: m(x))(m.layers[0].ffn, x))
    want = ref.mlp(xs, *mlp("model.layers.0.mlp"), "ue8m0")
    if on_deep_gemm():    # DeepGEMM's float32 tensor-core sums against float64 ones: bf16 ulps
        assert jax_dg.calc_diff(dense, want) < 1e-5
    else:                 # the emulation rounds to the oracle's bfloat16 outputs here (measured: bitwise)
        np.testing.assert_array_equal(dense, want)
    gate = dict(weight=f32(t["model.layers.1.mlp.gate.weight"]), bias=t["model.layers.1.mlp.gate.e_score_correction_bias"],
                topk=2, n_groups=2, topk_groups=1, score_func="sigmoid", route_scale=2.5)
    want = ref.moe(xs, gate, [mlp(f"model.layers.1.mlp.experts.{e}") for e in range(8)],
                   mlp("model.layers.1.mlp.shared_experts"), "ue8m0")
    got = nnx.jit(lambda m, x: m(x))(moe, x)
    assert jax_dg.calc_diff(f32(got), want) < (1e-4 if on_deep_gemm() else 1e-9)   # the MoE tests' bounds


def test_the_table_covers_the_module(checkpoint):
    path, t, raw = checkpoint
    names = checkpoint_names(abstract_model(nn.load_config(path)))
    mtp = {n for n in t if n.startswith("model.layers.2.")}
    assert mtp and names.keys() == t.keys() - mtp       # the MTP layer: left out, as DeepSeek's inference does
    one = checkpoint_names(nnx.eval_shape(lambda: nn.MoE.from_config(nn.load_config(path), rngs=nnx.Rngs(0))),
                           prefix="model.layers.1.mlp")
    assert one.keys() == {n for n in t if n.startswith("model.layers.1.mlp.")}


def test_one_file_without_an_index(tmp_path):
    cfg = small_config(num_nextn_predict_layers=0)
    tensors = hf_tensors(cfg, seed=1)
    path = write_checkpoint(tmp_path, tensors, cfg, shards=1, index=False)
    m = load_checkpoint(path, abstract_model(nn.load_config(path)))
    np.testing.assert_array_equal(f32(m.layers[1].ffn.gate.weight[...]), f32(tensors["model.layers.1.mlp.gate.weight"]))


def test_bf16_checkpoints_load_into_masters(tmp_path):
    cfg = small_config(quantization_config=None, num_nextn_predict_layers=0)
    t = hf_tensors(cfg, seed=2)
    path = write_checkpoint(tmp_path, t, cfg)
    with pytest.raises(CheckpointError, match=r"without FP8 scales, a bf16 checkpoint: build the layers with "
                                              r"fp8_weights=False"):
        load_checkpoint(path, abstract_model(nn.load_config(path), fp8_weights=True))
    cfg = nn.load_config(path)
    assert not cfg.fp8_weights
    m = load_checkpoint(path, abstract_model(cfg))
    lin = m.layers[0].ffn.w13
    assert not lin.stored_fp8 and lin.kernel[...].shape == (256, 512)
    np.testing.assert_array_equal(f32(lin.kernel[...][:, 256:]), f32(t["model.layers.0.mlp.up_proj.weight"]).T)
    np.testing.assert_array_equal(f32(m.layers[1].ffn.w13[...][3, :128]),
                                  f32(t["model.layers.1.mlp.experts.3.gate_proj.weight"]))


@pytest.mark.parametrize("change, message", [
    ("missing", r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight_scale_inv"),
    ("extra", r"no place in the module: `model\.layers\.0\.mlp\.bias`"),
    ("misshapen", r"`model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight` \(model-\d+-of-\d+\.safetensors\) has shape "
                  r"\(64, 256\); its place, layers\.1\.ffn\.w13\[2, 128:256\], takes \(128, 256\)"),
    ("bf16 into fp8", r"`model\.layers\.0\.mlp\.down_proj\.weight` .* is BF16 where the module holds a stored FP8"),
    ("mtp kept", r"no place in the module: `model\.layers\.2\."),
])
def test_a_checkpoint_that_does_not_fit_is_named(tmp_path, checkpoint, change, message):
    _, tensors, raw = checkpoint
    t = dict(tensors)
    ignore = None
    if change == "missing":
        del t["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"]
    elif change == "extra":
        t["model.layers.0.mlp.bias"] = np.zeros(256, np.float32)
    elif change == "misshapen":
        t["model.layers.1.mlp.experts.2.up_proj.weight"] = t["model.layers.1.mlp.experts.2.up_proj.weight"][:64]
    elif change == "bf16 into fp8":
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].astype(ml_dtypes.bfloat16)
    else:
        ignore = lambda name: False  # noqa: E731
    path = write_checkpoint(tmp_path, t, raw)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, abstract_model(nn.load_config(path)), ignore=ignore)


def test_fp8_into_masters_says_how(checkpoint):
    path, _, _ = checkpoint
    with pytest.raises(CheckpointError, match=r"no place in the module: .*weight_scale_inv.* \(the checkpoint "
                                              r"holds these weights in FP8 with their scales: build the layers with "
                                              r"fp8_weights=True, then nn\.dequantize"):
        load_checkpoint(path, abstract_model(nn.load_config(path), fp8_weights=False))


def test_index_naming_a_file_without_the_tensor(tmp_path, checkpoint):
    import json
    _, tensors, raw = checkpoint
    path = write_checkpoint(tmp_path, tensors, raw)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"puts `model\.norm\.weight` in model-00001-of-00003"):
        load_checkpoint(path, abstract_model(nn.load_config(path)))


def test_loaded_onto_a_mesh_of_eight_devices(tmp_path):
    """In a subprocess with 8 host devices (the count is fixed when jax starts)."""
    cfg = small_config()
    write_checkpoint(tmp_path, hf_tensors(cfg, seed=3), cfg)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                                          " --xla_force_host_platform_device_count=8").strip())
    res = subprocess.run([sys.executable, "-m", "tests.nn.sharded_loader", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert "sharded load ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
