"""DeepGEMM golden cases: seeded small inputs, the deep_gemm call from torch that recorded each
output, and the same call through jax_dg.

`scripts/record_golden.py` (on a GPU) writes `tests/golden/<name>.npz` from these: the inputs, deep_gemm's
outputs and the versions that made them. `tests/test_golden.py` replays each file through the torch
reference (the bridge), the pure-JAX reference and, on a GPU, DeepGEMM under jax_dg. So CI, which has
no GPU, still compares both in-repo references with what DeepGEMM itself computed.

Outputs DeepGEMM leaves undefined (padding rows of the grouped layouts) are zeroed on the deep_gemm
side before recording, as jax_dg's default `clean=True` defines them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_dg
from jax_dg import paged

FP8 = jnp.float8_e4m3fn
# npz cannot hold ml_dtypes' float8/bfloat16: such arrays are stored as raw bits.
_BITS = {"float8_e4m3fn": np.uint8, "bfloat16": np.uint16}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[int], dict]             # seed -> named host arrays (the inputs)
    deep_gemm: Callable[[object, dict], tuple]   # (deep_gemm module, torch CUDA tensors) -> outputs
    jax_dg: Callable[[dict], tuple]           # jax arrays -> outputs
    diff: float | None                        # reference vs DeepGEMM: calc_diff bound; None = bitwise
    seed: int = 0


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _fp8_pair(pair) -> tuple[np.ndarray, np.ndarray]:
    return _host(pair[0]), _host(pair[1])


def _normal(seed: int, shape, dtype=jnp.bfloat16) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


# ---- the cases ------------------------------------------------------------------------------------

def _gemm_inputs(seed, m=96, n=256, k=512, per_channel_b=False):
    x, w = _normal(seed, (m, k)), _normal(seed + 1, (n, k))
    a = _fp8_pair(jax_dg.per_token_cast_to_fp8(x))
    b = _fp8_pair((jax_dg.per_token_cast_to_fp8 if per_channel_b else jax_dg.per_block_cast_to_fp8)(w))
    return {"a": a[0], "sa": a[1], "b": b[0], "sb": b[1]}


def _fp8_gemm_dg(dg, t):
    import torch
    d = torch.empty(t["a"].shape[0], t["b"].shape[0], dtype=torch.bfloat16, device="cuda")
    dg.fp8_gemm_nt((t["a"], t["sa"]), (t["b"], t["sb"]), d)
    return (d,)


def _fp8_gemm_acc_inputs(seed):
    ins = _gemm_inputs(seed, m=64, n=384, k=256, per_channel_b=True)
    ins["c"] = _host(_normal(seed + 2, (64, 384), jnp.float32))
    return ins


def _fp8_gemm_acc_dg(dg, t):
    import torch
    d = t["c"].clone()                        # DeepGEMM accumulates in place, as its tests call it
    dg.fp8_gemm_nt((t["a"], t["sa"]), (t["b"], t["sb"]), d, c=d, recipe=(1, 1, 128))
    return (d,)


def _bf16_gemm_inputs(seed):
    return {"a": _host(_normal(seed, (80, 512))), "b": _host(_normal(seed + 1, (256, 512)))}


def _bf16_gemm_dg(dg, t):
    import torch
    d = torch.empty(t["a"].shape[0], t["b"].shape[0], dtype=torch.bfloat16, device="cuda")
    dg.bf16_gemm_nt(t["a"], t["b"], d)
    return (d,)


def _contiguous_inputs(seed, fp8, groups=3, rows=(100, 0, 230), n=256, k=256):
    # Each group's rows padded to DeepGEMM's SM90 alignment (128); padding rows carry -1.
    align = 128
    layout = np.concatenate([np.concatenate([np.full(r, g), np.full(-r % align, -1)])
                             for g, r in enumerate(rows)]).astype(np.int32)
    x, w = _normal(seed, (layout.size, k)), _normal(seed + 1, (groups, n, k))
    if not fp8:
        return {"a": _host(x), "b": _host(w), "layout": layout}
    a = _fp8_pair(jax_dg.per_token_cast_to_fp8(x))
    b = _fp8_pair(jax.vmap(jax_dg.per_block_cast_to_fp8)(w))
    return {"a": a[0], "sa": a[1], "b": b[0], "sb": b[1], "layout": layout}


def _masked_inputs(seed, fp8, groups=3, m_max=128, n=256, k=256):
    x, w = _normal(seed, (groups, m_max, k)), _normal(seed + 1, (groups, n, k))
    masked_m = np.array([37, 0, 128], np.int32)[:groups]
    if not fp8:
        return {"a": _host(x), "b": _host(w), "masked_m": masked_m}
    a = _fp8_pair(jax.vmap(jax_dg.per_token_cast_to_fp8)(x))
    b = _fp8_pair(jax.vmap(jax_dg.per_block_cast_to_fp8)(w))
    return {"a": a[0], "sa": a[1], "b": b[0], "sb": b[1], "masked_m": masked_m}


def _operands(t, fp8):
    """(a, b) as the grouped GEMMs take them, from a case's named arrays (torch or jax)."""
    return ((t["a"], t["sa"]), (t["b"], t["sb"])) if fp8 else (t["a"], t["b"])


def _contiguous_dg(fp8):
    def call(dg, t):
        import torch
        d = torch.zeros(t["a"].shape[0], t["b"].shape[1], dtype=torch.bfloat16, device="cuda")
        fn = dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else dg.m_grouped_bf16_gemm_nt_contiguous
        fn(*_operands(t, fp8), d, t["layout"])
        d[t["layout"] < 0] = 0                 # undefined there: zero, as jax_dg's clean=True
        return (d,)
    return call


def _masked_dg(fp8):
    def call(dg, t):
        import torch
        g, m_max = t["a"].shape[:2]
        d = torch.zeros(g, m_max, t["b"].shape[1], dtype=torch.bfloat16, device="cuda")
        fn = dg.m_grouped_fp8_gemm_nt_masked if fp8 else dg.m_grouped_bf16_gemm_nt_masked
        fn(*_operands(t, fp8), d, t["masked_m"], 128)
        d[torch.arange(m_max, device="cuda")[None, :] >= t["masked_m"][:, None]] = 0
        return (d,)
    return call


def _mqa_inputs(seed, s=128, sk=512, h=32, d=64):
    q = _normal(seed, (s, h, d)).astype(FP8)
    kv = _fp8_pair(jax_dg.per_row_cast_to_fp8(_normal(seed + 1, (sk, d))))
    w = _normal(seed + 2, (s, h), jnp.float32)
    ks, ke = jax_dg.causal_ks_ke(s, sk, include_self=False)
    ks = ks + jax.random.randint(jax.random.PRNGKey(seed + 3), ks.shape, 0, 64, jnp.int32)
    return {"q": _host(q), "kv": kv[0], "skv": kv[1], "w": _host(w), "ks": _host(ks), "ke": _host(ke)}


def _mqa_dg(dg, t):
    out = dg.fp8_fp4_mqa_logits((t["q"], None), (t["kv"], t["skv"]), t["w"], t["ks"], t["ke"],
                                clean_logits=True, max_seqlen_k=0)
    return (out,)


def _paged_inputs(seed, b=8, next_n=2, h=32, d=128, blk=64):  # blk: BLOCK
    rng = np.random.default_rng(seed)
    ctx = rng.integers(150, 700, b).astype(np.int32)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    table, nb = paged.build_block_tables(ctx, blk, key=k1)
    cache = paged.quantize_kv_cache(jax.random.normal(k2, (nb, blk, d), jnp.bfloat16))
    q = jax.random.normal(k3, (b, next_n, h, d), jnp.bfloat16).astype(FP8)
    w = jax.random.normal(k4, (b * next_n, h), jnp.float32)
    lens = ((ctx[:, None] + 1) * rng.random((b, next_n))).astype(np.int32)
    lens[:, -1] = ctx
    return {"q": _host(q), "cache": _host(cache), "w": _host(w), "lens": lens, "table": _host(table)}


# The schedule is recorded for the H200's SM count (a static: the same on every machine), for
# blocks of 64 tokens; the longest context a row of the block table holds is max_len.
NUM_SMS, BLOCK = 132, 64


def _max_len(table) -> int:
    return table.shape[1] * BLOCK


def _paged_dg(dg, t):
    import torch
    meta = dg.get_paged_mqa_logits_metadata(t["lens"], BLOCK, NUM_SMS)
    # The first 7 positionally, as the GPU tests call the 2.5 binding.
    # DeepGEMM cleans 1-D lengths only: the positions past each 2-D length are set to -inf here,
    # as jax_dg's clean_logits=True defines them.
    width = _max_len(t["table"])
    logits = dg.fp8_fp4_paged_mqa_logits((t["q"], None), t["cache"], t["w"], t["lens"], t["table"], meta,
                                         width, clean_logits=False)
    logits[torch.arange(width, device="cuda")[None, :] >= t["lens"].reshape(-1, 1)] = float("-inf")
    return meta, logits


def _paged_jax(a):
    meta = jax_dg.get_paged_mqa_logits_metadata(a["lens"], BLOCK, NUM_SMS)
    return meta, jax_dg.fp8_fp4_paged_mqa_logits((a["q"], None), a["cache"], a["w"], a["lens"], a["table"],
                                                 meta, _max_len(a["table"]))


def _hc_inputs(seed, m=64, n=24, k=1024):
    return {"x": _host(_normal(seed, (m, k))), "fn": _host(_normal(seed + 1, (n, k), jnp.float32))}


def _hc_dg(dg, t):
    import torch
    m, n = t["x"].shape[0], t["fn"].shape[0]
    d = torch.empty(m, n, dtype=torch.float32, device="cuda")
    s = torch.empty(m, dtype=torch.float32, device="cuda")
    dg.tf32_hc_prenorm_gemm(t["x"], t["fn"], d, s, None)
    return d, s


def _mn_major_inputs(seed):
    return {"sf": _host(jax.random.uniform(jax.random.PRNGKey(seed), (2, 100, 7), jnp.float32))}


CASES = (
    Case("fp8_gemm_nt", lambda s: _gemm_inputs(s), _fp8_gemm_dg,
         lambda a: (jax_dg.fp8_gemm_nt((a["a"], a["sa"]), (a["b"], a["sb"])),), 1e-6, seed=1),
    Case("fp8_gemm_nt_accumulate", _fp8_gemm_acc_inputs, _fp8_gemm_acc_dg,
         lambda a: (jax_dg.fp8_gemm_nt((a["a"], a["sa"]), (a["b"], a["sb"]), c=a["c"]),), 1e-6,
         seed=2),
    Case("bf16_gemm_nt", _bf16_gemm_inputs, _bf16_gemm_dg,
         lambda a: (jax_dg.bf16_gemm_nt(a["a"], a["b"]),), 1e-5, seed=3),
    Case("m_grouped_fp8_gemm_nt_contiguous", lambda s: _contiguous_inputs(s, True), _contiguous_dg(True),
         lambda a: (jax_dg.m_grouped_fp8_gemm_nt_contiguous(*_operands(a, True), a["layout"]),), 1e-6, seed=4),
    Case("m_grouped_bf16_gemm_nt_contiguous", lambda s: _contiguous_inputs(s, False), _contiguous_dg(False),
         lambda a: (jax_dg.m_grouped_bf16_gemm_nt_contiguous(*_operands(a, False), a["layout"]),), 1e-5, seed=5),
    Case("m_grouped_fp8_gemm_nt_masked", lambda s: _masked_inputs(s, True), _masked_dg(True),
         lambda a: (jax_dg.m_grouped_fp8_gemm_nt_masked(*_operands(a, True), a["masked_m"], 128),), 1e-6, seed=6),
    Case("m_grouped_bf16_gemm_nt_masked", lambda s: _masked_inputs(s, False), _masked_dg(False),
         lambda a: (jax_dg.m_grouped_bf16_gemm_nt_masked(*_operands(a, False), a["masked_m"], 128),), 1e-5,
         seed=7),
    Case("fp8_fp4_mqa_logits", _mqa_inputs, _mqa_dg,
         lambda a: (jax_dg.mqa_logits((a["q"], None), (a["kv"], a["skv"]), a["w"], a["ks"], a["ke"]),), 5e-6,
         seed=8),
    Case("fp8_fp4_paged_mqa_logits", _paged_inputs, _paged_dg, _paged_jax, 5e-6, seed=9),
    Case("tf32_hc_prenorm_gemm", _hc_inputs, _hc_dg,
         lambda a: tuple(jax_dg.tf32_hc_prenorm_gemm(a["x"], a["fn"])), 1e-6, seed=10),
    Case("get_mn_major_tma_aligned_tensor", _mn_major_inputs,
         # DeepGEMM's MN-major view, read in memory order (its padding columns are undefined)
         lambda dg, t: (dg.get_mn_major_tma_aligned_tensor(t["sf"]).transpose(-1, -2).contiguous(),),
         lambda a: (jax_dg.get_mn_major_tma_aligned_tensor(a["sf"])[..., :a["sf"].shape[-2]],), None,
         seed=11),
)
BY_NAME = {c.name: c for c in CASES}


# ---- the file format ------------------------------------------------------------------------------

def save(path, inputs: dict, outputs, meta: dict) -> None:
    arrays, dtypes = {}, {}
    for prefix, items in (("in", inputs.items()), ("out", enumerate(outputs))):
        for key, x in items:
            x = np.asarray(x)
            dtypes[f"{prefix}.{key}"] = x.dtype.name
            arrays[f"{prefix}.{key}"] = x.view(_BITS[x.dtype.name]) if x.dtype.name in _BITS else x
    meta = dict(meta, dtypes=dtypes)
    np.savez_compressed(path, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8),
                        **arrays)


def load(path) -> tuple[dict, tuple, dict]:
    """(inputs, outputs, meta) of a golden file, arrays restored to their dtypes."""
    with np.load(path) as f:
        meta = json.loads(f["meta"].tobytes())
        arrays = {k: f[k] for k in f.files if k != "meta"}
    restored = {k: v.view(jnp.dtype(meta["dtypes"][k])) if meta["dtypes"][k] in _BITS else v
                for k, v in arrays.items()}
    inputs = {k[3:]: v for k, v in restored.items() if k.startswith("in.")}
    outputs = tuple(restored[f"out.{i}"] for i in range(sum(k.startswith("out.") for k in restored)))
    return inputs, outputs, meta
