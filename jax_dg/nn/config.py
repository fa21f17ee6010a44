"""DeepSeek-V3.2's configuration: one dataclass from either file DeepSeek ships.

    load_config(path)        a checkpoint folder's `config.json` (Hugging Face's layout) or DeepSeek's
                             own inference config (`config_671B_v3.2.json`), by its keys
    DeepSeekV32Config.from_hf(dict) / .from_deepseek(dict)

Field names are Hugging Face's where it has one (hidden_size, n_routed_experts, ...; n_heads for
its num_attention_heads). What the fields mean is what DeepSeek's V3.2 inference code
(inference/model.py) does with them:

- YaRN: applied when `rope_scaling` is given and max_seq_len > its
  original_max_position_embeddings (model.py: max_seq_len > original_seq_len); the attention's
  softmax scale is then multiplied by (0.1 * mscale * ln(factor) + 1)^2 (`softmax_scale`).
  DeepSeek's code has one mscale: a Hugging Face config whose mscale and mscale_all_dim differ
  is refused rather than read one way or the other.
- scale_fmt "ue8m0": every activation cast rounds its scales up to powers of two (model.py's
  act_quant with a scale_fmt; `use_ue8m0`). The checkpoint's weight scales are float32 either way.
- The gate: `scoring_func` sigmoid or softmax; a load-balancing bias (`e_score_correction_bias`)
  only where the checkpoint carries one (`gate_bias`: Hugging Face's topk_method "noaux_tc";
  model.py keys it on dim == 7168, the one shipped model that has it); chosen weights normalised
  to sum 1 when `norm_topk_prob` (model.py: with sigmoid scores), then times routed_scaling_factor.
- Layers [0, first_k_dense_replace) have a dense MLP of intermediate_size, the others MoE.
- Max sequence length: Hugging Face's max_position_embeddings, DeepSeek's max_seq_len (its
  inference default 16384 when the file has none); pass max_seq_len= to choose another.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing as tp

from jax_dg.nn.rope import RoPE

# DeepSeek's inference ModelArgs defaults for what its config_671B_v3.2.json leaves out.
_DEEPSEEK_DEFAULTS = {"max_seq_len": 4096 * 4, "original_seq_len": 4096, "rope_theta": 10000.0,
                      "rope_factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                      "q_lora_rank": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                      "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64,
                      "index_head_dim": 128, "index_topk": 2048, "n_expert_groups": 1,
                      "n_limited_groups": 1, "score_func": "softmax", "route_scale": 1.0,
                      "dtype": "bf16", "scale_fmt": None, "vocab_size": 102400}


class ConfigError(ValueError):
    """A configuration DeepSeek-V3.2's semantics cannot take: names the field and the rule."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN's parameters (Hugging Face's rope_scaling; DeepSeek's rope_factor, original_seq_len,
    beta_fast, beta_slow, mscale)."""
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclasses.dataclass(frozen=True)
class DeepSeekV32Config:
    """DeepSeek-V3.2's model configuration (see the module doc for what each part means)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    # attention (MLA)
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # the sparse-attention indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # positions
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_seq_len: int
    # experts
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    scoring_func: str
    norm_topk_prob: bool
    gate_bias: bool
    # numerics and storage
    rms_norm_eps: float = 1e-6
    fp8_weights: bool = False          # linear weights stored FP8 with 128 x 128 weight_scale_inv
    scale_fmt: str | None = None       # "ue8m0": power-of-two activation scales
    num_nextn_predict_layers: int = 0  # the multi-token-prediction layers after the last one
    tie_word_embeddings: bool = False

    def __post_init__(self):
        def rule(ok: bool, field: str, text: str):
            if not ok:
                raise ConfigError(f"DeepSeekV32Config: `{field}` {text}, got {getattr(self, field)!r}")
        rule(self.scale_fmt in (None, "ue8m0"), "scale_fmt", "must be None or 'ue8m0'")
        rule(self.scoring_func in ("sigmoid", "softmax"), "scoring_func", "must be 'sigmoid' or 'softmax'")
        rule(self.n_group >= 1 and self.n_routed_experts % self.n_group == 0, "n_group",
             f"must divide n_routed_experts = {self.n_routed_experts}")
        rule(1 <= self.topk_group <= self.n_group, "topk_group", f"must lie in [1, n_group = {self.n_group}]")
        rule(1 <= self.num_experts_per_tok <= self.n_routed_experts // self.n_group * self.topk_group,
             "num_experts_per_tok", "must be at least 1 and at most the experts of topk_group groups")
        rule(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"must lie in [0, num_hidden_layers = {self.num_hidden_layers}]")
        rule(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
             f"must be at least qk_rope_head_dim = {self.qk_rope_head_dim} (the indexer's RoPE part)")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if rs.mscale != rs.mscale_all_dim:
                raise ConfigError(f"DeepSeekV32Config: `rope_scaling` has mscale {rs.mscale} != "
                                  f"mscale_all_dim {rs.mscale_all_dim}; DeepSeek's inference has one mscale")
            if rs.factor <= 0:
                raise ConfigError(f"DeepSeekV32Config: `rope_scaling` must have factor > 0, got {rs.factor}")

    # --- what the fields imply --------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> bool:
        """Whether RoPE is YaRN-scaled: rope_scaling given and max_seq_len beyond its original length."""
        return self.rope.yarn

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale: qk_head_dim^-1/2, times YaRN's mscale squared."""
        return self.rope.softmax_scale(self.qk_head_dim)

    @property
    def rope(self) -> RoPE:
        """The rotary embedding of qk_rope_head_dim features (MLA's and the indexer's), YaRN's
        as rope_scaling and max_seq_len say (jax_dg.nn.rope)."""
        rs = self.rope_scaling
        if rs is None:
            return RoPE(dim=self.qk_rope_head_dim, theta=self.rope_theta, max_seq_len=self.max_seq_len,
                        original_seq_len=self.max_seq_len)
        return RoPE(dim=self.qk_rope_head_dim, theta=self.rope_theta, max_seq_len=self.max_seq_len,
                    original_seq_len=rs.original_max_position_embeddings, factor=rs.factor,
                    beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale)

    @property
    def use_ue8m0(self) -> bool:
        return self.scale_fmt == "ue8m0"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    # --- the two files ---------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: tp.Mapping[str, tp.Any], **overrides) -> DeepSeekV32Config:
        """From a Hugging Face `config.json` dict (model_type deepseek_v32 / deepseek_v3)."""
        get = _getter(d, "config.json")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: `hidden_act` must be 'silu' (DeepSeek's SwiGLU), got {act!r}")
        rs = d.get("rope_scaling")
        scaling = None
        if rs:
            kind = rs.get("type", rs.get("rope_type"))
            if kind != "yarn":
                raise ConfigError(f"config.json: `rope_scaling` must be YaRN's (type 'yarn'), got {kind!r}")
            scaling = RopeScaling(
                factor=float(_need(rs, "factor", "rope_scaling")),
                original_max_position_embeddings=int(_need(rs, "original_max_position_embeddings", "rope_scaling")),
                beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)),
                mscale=float(rs.get("mscale", 1.0)), mscale_all_dim=float(rs.get("mscale_all_dim", rs.get("mscale", 1.0))))
        quant = d.get("quantization_config") or {}
        fp8 = quant.get("quant_method") == "fp8"
        if fp8:
            block = list(quant.get("weight_block_size", [128, 128]))
            if block != [128, 128]:
                raise ConfigError(f"config.json: `quantization_config.weight_block_size` must be "
                                  f"[128, 128] (DeepGEMM's weight blocks), got {block}")
            if quant.get("fmt", "e4m3") != "e4m3":
                raise ConfigError(f"config.json: `quantization_config.fmt` must be 'e4m3', got {quant.get('fmt')!r}")
        fields = dict(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"), moe_intermediate_size=get("moe_intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"), first_k_dense_replace=get("first_k_dense_replace", 0),
            n_heads=get("num_attention_heads"), q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
            index_n_heads=get("index_n_heads", 64), index_head_dim=get("index_head_dim", 128),
            index_topk=get("index_topk", 2048),
            rope_theta=float(get("rope_theta", 10000.0)), rope_scaling=scaling,
            max_seq_len=get("max_position_embeddings"),
            n_routed_experts=get("n_routed_experts"), n_shared_experts=get("n_shared_experts", 0),
            num_experts_per_tok=get("num_experts_per_tok"), n_group=get("n_group", 1),
            topk_group=get("topk_group", 1), routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            scoring_func=get("scoring_func", "softmax"), norm_topk_prob=bool(get("norm_topk_prob", False)),
            gate_bias=d.get("topk_method") == "noaux_tc",
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)), fp8_weights=fp8,
            scale_fmt=quant.get("scale_fmt", d.get("scale_fmt")),
            num_nextn_predict_layers=get("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)))
        return cls(**{**fields, **overrides})

    @classmethod
    def from_deepseek(cls, d: tp.Mapping[str, tp.Any], **overrides) -> DeepSeekV32Config:
        """From DeepSeek's inference config (`config_671B_v3.2.json`'s ModelArgs names), with
        ModelArgs' defaults for the fields it leaves out."""
        d = {**_DEEPSEEK_DEFAULTS, **d}
        get = _getter(d, "DeepSeek's config")
        if get("dtype") not in ("bf16", "fp8"):
            raise ConfigError(f"DeepSeek's config: `dtype` must be 'bf16' or 'fp8', got {d['dtype']!r}")
        n_layers, n_dense = get("n_layers"), get("n_dense_layers", 1)
        dim = get("dim")
        fields = dict(
            vocab_size=get("vocab_size"), hidden_size=dim, intermediate_size=get("inter_dim"),
            moe_intermediate_size=get("moe_inter_dim"), num_hidden_layers=n_layers,
            first_k_dense_replace=n_dense, n_heads=get("n_heads"), q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
            index_n_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"),
            index_topk=get("index_topk"), rope_theta=float(get("rope_theta")),
            rope_scaling=RopeScaling(factor=float(get("rope_factor")),
                                     original_max_position_embeddings=get("original_seq_len"),
                                     beta_fast=float(get("beta_fast")), beta_slow=float(get("beta_slow")),
                                     mscale=float(get("mscale")), mscale_all_dim=float(get("mscale"))),
            max_seq_len=get("max_seq_len"), n_routed_experts=get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts"), num_experts_per_tok=get("n_activated_experts"),
            n_group=get("n_expert_groups"), topk_group=get("n_limited_groups"),
            routed_scaling_factor=float(get("route_scale")), scoring_func=get("score_func"),
            norm_topk_prob=get("score_func") == "sigmoid",
            gate_bias=dim == 7168,     # model.py's Gate: a bias only in the checkpoint that has one
            fp8_weights=get("dtype") == "fp8", scale_fmt=d.get("scale_fmt"))
        return cls(**{**fields, **overrides})


def load_config(source: str | os.PathLike | tp.Mapping[str, tp.Any], **overrides) -> DeepSeekV32Config:
    """The configuration in `source`: a checkpoint folder (its config.json), a JSON file, or an
    already-parsed dict; Hugging Face's format (it has `hidden_size`) or DeepSeek's inference
    format (it has `dim`). `overrides` replace fields (e.g. max_seq_len=...)."""
    if isinstance(source, tp.Mapping):
        d = dict(source)
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            d = json.load(f)
    if "hidden_size" in d:
        return DeepSeekV32Config.from_hf(d, **overrides)
    if "dim" in d:
        return DeepSeekV32Config.from_deepseek(d, **overrides)
    raise ConfigError("load_config: the config has neither `hidden_size` (Hugging Face's config.json) "
                      "nor `dim` (DeepSeek's inference config)")


def _need(d: tp.Mapping, key: str, where: str):
    if key not in d:
        raise ConfigError(f"{where}: `{key}` is required")
    return d[key]


def _getter(d: tp.Mapping, where: str):
    missing = object()

    def get(key: str, default=missing):
        if key in d and d[key] is not None:
            return d[key]
        if default is missing:
            raise ConfigError(f"{where}: `{key}` is required")
        return default
    return get
