"""DeepSeek-V3.2's two config files parse into one configuration with DeepSeek's semantics."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("flax.nnx")

from jax_dg.nn.config import ConfigError, DeepSeekV32Config, RopeScaling, load_config  # noqa: E402
from tests.nn.checkpoints import DEEPSEEK_V32_CONFIG, HF_V32_CONFIG  # noqa: E402


def test_both_files_of_the_shipped_model_agree():
    hf, ds = load_config(HF_V32_CONFIG), load_config(DEEPSEEK_V32_CONFIG)
    # The files differ only in what DeepSeek's inference chooses at run time (max_seq_len: its
    # ModelArgs default 16384; the Hugging Face file names the model's 163840) and in what one
    # of them does not carry (the MTP layer count, rms_norm_eps's default is the same 1e-6).
    assert dataclasses.replace(hf, max_seq_len=ds.max_seq_len, num_nextn_predict_layers=0) == ds
    assert hf.max_seq_len == 163840 and ds.max_seq_len == 16384
    for c in (hf, ds):
        assert c.fp8_weights and c.use_ue8m0 and c.gate_bias and c.norm_topk_prob
        assert c.yarn and c.rope_scaling == RopeScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
        assert c.qk_head_dim == 192 and c.scoring_func == "sigmoid" and c.routed_scaling_factor == 2.5
        assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 8, 8, 4)
        assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 2048)
        assert [c.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
        mscale = 0.1 * math.log(40) + 1
        assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-12)


def test_yarn_only_past_the_original_length():
    from jax_dg.nn.rope import RoPE
    assert load_config(HF_V32_CONFIG).rope == RoPE(dim=64, theta=10000.0, max_seq_len=163840,
                                                   original_seq_len=4096, factor=40.0, beta_fast=32.0,
                                                   beta_slow=1.0, mscale=1.0)
    c = load_config(HF_V32_CONFIG, max_seq_len=4096)
    assert not c.yarn and not c.rope.yarn and c.softmax_scale == 192 ** -0.5
    assert not load_config({**HF_V32_CONFIG, "rope_scaling": None}).yarn


def test_config_files_on_disk(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_V32_CONFIG))
    (tmp_path / "ds.json").write_text(json.dumps(DEEPSEEK_V32_CONFIG))
    assert load_config(tmp_path) == load_config(HF_V32_CONFIG)
    assert load_config(tmp_path / "ds.json") == load_config(DEEPSEEK_V32_CONFIG)


def test_gate_bias_softmax_and_bf16_checkpoints():
    v2 = {**HF_V32_CONFIG, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
          "norm_topk_prob": False, "quantization_config": None}
    c = load_config(v2)
    assert not c.gate_bias and not c.norm_topk_prob and not c.fp8_weights and c.scale_fmt is None
    small = load_config({**DEEPSEEK_V32_CONFIG, "dim": 2048, "dtype": "bf16", "scale_fmt": None,
                         "score_func": "softmax"})
    assert not small.gate_bias and not small.norm_topk_prob and not small.use_ue8m0


@pytest.mark.parametrize("change, field", [
    ({"quantization_config": {"quant_method": "fp8", "scale_fmt": "e5m2"}}, "scale_fmt"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"n_group": 7}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"rope_scaling": {**HF_V32_CONFIG["rope_scaling"], "mscale_all_dim": 0.7}}, "rope_scaling"),
    ({"rope_scaling": {"type": "linear", "factor": 4}}, "rope_scaling"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_refused_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        load_config({**HF_V32_CONFIG, **change})


def test_unknown_format_is_refused():
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config({"n_layers": 2})
    with pytest.raises(ConfigError, match="dtype"):
        DeepSeekV32Config.from_deepseek({**DEEPSEEK_V32_CONFIG, "dtype": "fp4"})
