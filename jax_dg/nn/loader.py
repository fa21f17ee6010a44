"""load_checkpoint: a DeepSeek-V3.2 checkpoint in Hugging Face's layout into jax_dg.nn modules.

The layout DeepSeek publishes: `config.json`, sharded `*.safetensors` and
`model.safetensors.index.json` (tensor name -> shard). Linear weights are float8_e4m3fn [out, in]
with `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)] beside them (UE8M0 checkpoints: powers
of two), experts one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`), the
router `mlp.gate.weight` and its bias `mlp.gate.e_score_correction_bias`, norms, the indexer under
`self_attn.indexer`, bf16 elsewhere.

Names: `checkpoint_names(module)` maps every checkpoint tensor onto (a part of) one variable of
the module. Modules jax_dg.nn knows map themselves (FP8Linear, MLP, MoE and its Gate,
LightningIndexer; flax's Linear, LayerNorm, RMSNorm, Embed); any other module is a container
whose attribute names are DeepSeek's inference names (inference/model.py: embed, layers,
attn_norm, attn, ffn_norm, ffn, norm, head; MLA's wq_a, q_norm, ...), renamed to the checkpoint's
by RENAMES, ATTENTION_RENAMES (the attention module's names: kept in step with jax_dg.nn.attention)
and ROOT (the model's top level, under `model.` but the head). Fused and stacked variables take
several tensors each: an MLP's w13 holds gate_proj's rows then up_proj's, an MoE's w13 [E, 2 *
inter, dim] and w2 [E, dim, inter] hold every expert's, scales alike.

The tensors must match the module exactly: before any data is read, every tensor the module needs
must be in the checkpoint (missing), every tensor of the checkpoint must have a place (extra; the
multi-token-prediction layers past num_hidden_layers are left out by default, as DeepSeek's own
inference does), and each must have its place's shape (misshapen) and a dtype that goes there
(FP8 only into stored FP8 weights; bfloat16 / float16 / float32 into any float variable, converted;
UE8M0 scales into float32): CheckpointError names the tensor and the rule.

Loading streams shard by shard (safetensors, memory-mapped): a tensor is read once into host memory
and handed to the device; a variable assembled from several tensors (the stacked experts, a fused
w13) gets one host buffer that its tensors are copied into as they come, put on the device when
complete and dropped. With a mesh (or a variable's own mesh metadata) each variable goes onto
NamedSharding(mesh, its out_sharding) (nnx's annotations): jax.device_put sends each device its
shard. Variables transposed on the way ([in, out] bf16 kernels from [out, in] tensors) are
transposed on the device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing as tp

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from flax.nnx.spmd import get_var_pspec

from jax_dg.nn.gate import Gate, RouterBias
from jax_dg.nn.indexer import LightningIndexer
from jax_dg.nn.linear import FP8Linear, StoredFP8
from jax_dg.nn.moe import MLP, MoE

BLOCK = 128
INDEX_FILE = "model.safetensors.index.json"

# The model's top level (jax_dg.nn's attribute -> the checkpoint's name).
ROOT = {"embed": "model.embed_tokens", "layers": "model.layers", "norm": "model.norm", "head": "lm_head"}
# Blocks and their parts (DeepSeek's convert.py mapping, reversed).
RENAMES = {"attn_norm": "input_layernorm", "attn": "self_attn", "ffn_norm": "post_attention_layernorm",
           "ffn": "mlp", "shared": "shared_experts"}
# The attention's projections and norms (MLA, jax_dg.nn.attention): its owner keeps this in step.
ATTENTION_RENAMES = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
                     "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
                     "wo": "o_proj"}
LOADABLE = (nnx.Param, StoredFP8, RouterBias)      # what a checkpoint holds (not caches, not RNG state)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the module: names the tensor(s) and the rule."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: (part of) a variable, at `index`, transposed or not."""
    var: nnx.Variable
    path: str                    # the variable's path in the module, for messages
    index: tuple = ()
    transpose: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape in the checkpoint."""
        full = np.broadcast_to(np.empty((), np.int8), _value(self.var).shape)[self.index].shape
        return tuple(reversed(full)) if self.transpose else tuple(full)


def _value(var: nnx.Variable):
    return var.get_value()


# --- names ------------------------------------------------------------------------------------------

class _Names:
    """The table being built: checkpoint name -> Slot, and the variables it covers."""

    def __init__(self):
        self.slots: dict[str, Slot] = {}
        self.covered: set[int] = set()

    def add(self, name: str, var: nnx.Variable, path: str, index: tuple = (), transpose: bool = False):
        if name in self.slots:
            raise CheckpointError(f"checkpoint_names: `{name}` would fill both {self.slots[name].path} "
                                  f"and {path}")
        self.slots[name] = Slot(var, path, index, transpose)
        self.covered.add(id(var))


def _rows(lo: int, n: int, scales: bool = False) -> slice:
    """Rows [lo, lo + n) of a weight, or the scale rows that cover them (lo a multiple of 128)."""
    return slice(lo // BLOCK, -(-(lo + n) // BLOCK)) if scales else slice(lo, lo + n)


def _linear(t: _Names, lin: FP8Linear, name: str, path: str, part: tuple[int, int] | None = None):
    """An FP8Linear's tensors: weight (+ weight_scale_inv when stored FP8; the bf16 master's kernel
    [in, out] takes weight [out, in] transposed), bias. `part` = (first row, rows): this tensor
    fills those output rows only (a fused projection)."""
    lo, n = (0, lin.out_features) if part is None else part
    whole = part is None
    if lin.stored_fp8:
        t.add(f"{name}.weight", lin.weight, f"{path}.weight", () if whole else (_rows(lo, n),))
        t.add(f"{name}.weight_scale_inv", lin.weight_scale_inv, f"{path}.weight_scale_inv",
              () if whole else (_rows(lo, n, scales=True),))
    else:
        t.add(f"{name}.weight", lin.kernel, f"{path}.kernel",
              () if whole else (slice(None), _rows(lo, n)), transpose=True)
    if lin.bias is not None:
        t.add(f"{name}.bias", lin.bias, f"{path}.bias", () if whole else (_rows(lo, n),))


def _fused_rows(inter: int, stored: bool, what: str):
    if stored and inter % BLOCK:
        raise CheckpointError(f"checkpoint_names: {what}'s gate_proj and up_proj go into one fused FP8 "
                              f"weight; their scale blocks can only be stacked when the intermediate size "
                              f"({inter}) is a multiple of {BLOCK}")


def _mlp(t: _Names, m: MLP, name: str, path: str):
    n = m.inter_dim
    _fused_rows(n, m.w13.stored_fp8, path or "MLP")
    _linear(t, m.w13, f"{name}.gate_proj", f"{path}.w13", (0, n))
    _linear(t, m.w13, f"{name}.up_proj", f"{path}.w13", (n, n))
    _linear(t, m.w2, f"{name}.down_proj", f"{path}.w2")


def _experts(t: _Names, m: MoE, name: str, path: str):
    """The routed experts, stacked: expert e's gate_proj / up_proj rows of w13[e], down_proj w2[e]."""
    n, stored = m.inter_dim, m.stored_fp8
    _fused_rows(n, stored, path or "MoE")
    for e in range(m.n_experts):
        for proj, var, lo, rows in (("gate_proj", "w13", 0, n), ("up_proj", "w13", n, n),
                                    ("down_proj", "w2", 0, m.dim)):
            base = f"{name}.experts.{e}.{proj}"
            t.add(f"{base}.weight", getattr(m, var), f"{path}.{var}", (e, _rows(lo, rows)))
            if stored:
                t.add(f"{base}.weight_scale_inv", getattr(m, f"{var}_scale_inv"), f"{path}.{var}_scale_inv",
                      (e, _rows(lo, rows, scales=True)))


def _gate(t: _Names, g: Gate, name: str, path: str):
    t.add(f"{name}.weight", g.weight, f"{path}.weight")
    if g.bias is not None:
        t.add(f"{name}.e_score_correction_bias", g.bias, f"{path}.bias")


def _flax_linear(t: _Names, lin: nnx.Linear, name: str, path: str):
    t.add(f"{name}.weight", lin.kernel, f"{path}.kernel", transpose=True)
    if lin.bias is not None:
        t.add(f"{name}.bias", lin.bias, f"{path}.bias")


def _norm(t: _Names, norm, name: str, path: str):
    if norm.scale is not None:
        t.add(f"{name}.weight", norm.scale, f"{path}.scale")
    if getattr(norm, "bias", None) is not None:
        t.add(f"{name}.bias", norm.bias, f"{path}.bias")


def _indexer(t: _Names, m: LightningIndexer, name: str, path: str):
    _linear(t, m.wq_b, f"{name}.wq_b", f"{path}.wq_b")
    _linear(t, m.wk, f"{name}.wk", f"{path}.wk")
    _norm(t, m.k_norm, f"{name}.k_norm", f"{path}.k_norm")
    _flax_linear(t, m.weights_proj, f"{name}.weights_proj", f"{path}.weights_proj")


# type -> (its tensors, whether that covers everything below it)
HANDLERS: list[tuple[type, tp.Callable, bool]] = [
    (FP8Linear, _linear, True), (MLP, _mlp, True), (MoE, _experts, False), (Gate, _gate, True),
    (LightningIndexer, _indexer, True), (nnx.Linear, _flax_linear, True), (nnx.LayerNorm, _norm, True),
    (nnx.RMSNorm, _norm, True),
    (nnx.Embed, lambda t, e, name, path: t.add(f"{name}.weight", e.embedding, f"{path}.embedding"), True),
]


def checkpoint_names(module, *, prefix: str | None = None,
                     renames: tp.Mapping[str, str] | None = None) -> dict[str, Slot]:
    """Checkpoint tensor name -> Slot for every tensor `module` takes (see the module doc).

    prefix: the checkpoint name of `module` itself (e.g. "model.layers.3.mlp" for one MoE);
    None: `module` is the whole model (ROOT names its top level). renames: more attribute ->
    checkpoint names for containers (over RENAMES and ATTENTION_RENAMES).
    """
    table = {**RENAMES, **ATTENTION_RENAMES, **(renames or {})}

    def hf(path: tuple) -> str:
        segs = [str(p) if isinstance(p, int) else
                (ROOT.get(p, table.get(p, p)) if i == 0 and prefix is None else table.get(p, p))
                for i, p in enumerate(path)]
        return ".".join(([prefix] if prefix else []) + segs)

    t = _Names()
    nodes = sorted(nnx.iter_graph(module), key=lambda pn: len(pn[0]))
    claimed: list[tuple] = []
    variables = []
    for path, node in nodes:
        if any(path[:len(c)] == c for c in claimed):
            continue
        if isinstance(node, nnx.Variable):
            if isinstance(node, LOADABLE):
                variables.append((path, node))
            continue
        for cls, handler, whole in HANDLERS:
            if isinstance(node, cls):
                handler(t, node, hf(path), ".".join(map(str, path)))
                if whole:
                    claimed.append(path)
                break
    for path, var in variables:                    # plain variables of containers: by their names
        if id(var) not in t.covered and not any(path[:len(c)] == c for c in claimed):
            t.add(hf(path), var, ".".join(map(str, path)))
    return t.slots


# --- reading --------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F16": np.float16,
                       "F32": np.float32, "F64": np.float64, "F8_E8M0": "ue8m0"}


def _fits(src: str, dst) -> str | None:
    """Why a tensor of safetensors dtype `src` cannot go into a variable of dtype `dst`, or None."""
    dst = np.dtype(dst)
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    if src not in _SAFETENSORS_DTYPES:
        return f"has dtype {src}, which no jax_dg.nn variable takes"
    if dst == fp8:
        return None if src == "F8_E4M3" else (f"is {src} where the module holds a stored FP8 weight "
                                              "(build the layer with fp8_weights=False for a bf16 checkpoint)")
    if src == "F8_E4M3":
        return (f"is FP8 where the module holds a {dst.name} variable (build the layer with "
                "fp8_weights=True, then nn.dequantize(module) for bf16 masters)")
    if src == "F8_E8M0":
        return None if dst == np.float32 else f"holds UE8M0 scales, which go into float32 only, not {dst.name}"
    return None if jnp.issubdtype(dst, jnp.floating) else f"is floating, the variable is {dst.name}"


def _read(f, file: str, name: str) -> np.ndarray:
    """Tensor `name` of the open shard `f` (at `file`) as numpy: safetensors' own numpy reader
    (bfloat16 as ml_dtypes); FP8 tensors, which it cannot type, as a read-only memory map of
    their bytes (ml_dtypes views; UE8M0 scales to float32, exact: powers of two)."""
    dtype = f.get_slice(name).get_dtype()
    if not dtype.startswith("F8_"):
        return f.get_tensor(name)
    with open(file, "rb") as raw:   # the format: u64 header size, JSON header, then the data
        size = int.from_bytes(raw.read(8), "little")
        entry = json.loads(raw.read(size))[name]
    begin, end = entry["data_offsets"]
    data = np.memmap(file, np.uint8, "r", offset=8 + size + begin, shape=(end - begin,))
    shape = tuple(entry["shape"])
    if dtype == "F8_E4M3":
        return data.view(ml_dtypes.float8_e4m3fn).reshape(shape)
    return np.ldexp(np.float32(1), data.astype(np.int32) - 127).reshape(shape)   # F8_E8M0


def _shards(path: str) -> dict[str, str]:
    """Tensor name -> shard file: the index's weight map, or every *.safetensors file's keys."""
    from safetensors import safe_open
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"load_checkpoint: {path} has neither {INDEX_FILE} nor *.safetensors files")
    out = {}
    for file in files:
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            out.update({k: file for k in f.keys()})
    return out


def mtp_layers(path: str) -> tp.Callable[[str], bool]:
    """The default `ignore`: the multi-token-prediction layers (model.layers.{n} for n >=
    config.json's num_hidden_layers), which DeepSeek's inference leaves out too."""
    n = None
    cfg = os.path.join(path, "config.json")
    if os.path.exists(cfg):
        with open(cfg) as f:
            n = json.load(f).get("num_hidden_layers")
    pattern = re.compile(r"model\.layers\.(\d+)\.")

    def ignore(name: str) -> bool:
        m = pattern.match(name)
        return n is not None and m is not None and int(m.group(1)) >= n
    return ignore


def _listing(names) -> str:
    names = sorted(names)
    more = f" (and {len(names) - 8} more)" if len(names) > 8 else ""
    return ", ".join(f"`{n}`" for n in names[:8]) + more


def load_checkpoint(path: str | os.PathLike, module, *, mesh: jax.sharding.Mesh | None = None,
                    prefix: str | None = None, renames: tp.Mapping[str, str] | None = None,
                    ignore: tp.Callable[[str], bool] | None = None):
    """Fills `module`'s variables from the checkpoint folder `path` (see the module doc), in place;
    returns `module`.

    module: typically built abstractly, `nnx.eval_shape(lambda: Model(cfg, rngs=nnx.Rngs(0)))`
    (no weights are initialised), with fp8_weights as the checkpoint stores them
    (DeepSeekV32Config.fp8_weights). mesh: where each variable goes, sharded as its out_sharding
    annotation says (default: a variable's own mesh metadata, else the default device). prefix,
    renames: as checkpoint_names. ignore: checkpoint names to leave out (default: mtp_layers).
    Raises CheckpointError before reading any data when a tensor is missing, extra, misshapen or of
    a dtype its variable does not take.
    """
    from safetensors import safe_open
    path = os.fspath(path)
    slots = checkpoint_names(module, prefix=prefix, renames=renames)
    shards = _shards(path)
    ignore = mtp_layers(path) if ignore is None else ignore
    present = {n: f for n, f in shards.items() if not ignore(n)}
    missing = slots.keys() - present.keys()
    scales_only = lambda names: all(n.endswith(".weight_scale_inv") for n in names)  # noqa: E731
    if missing:
        hint = (" (the checkpoint holds these weights without FP8 scales, a bf16 checkpoint: build the "
                "layers with fp8_weights=False)") if scales_only(missing) else ""
        raise CheckpointError(f"load_checkpoint: the checkpoint lacks {len(missing)} tensor(s) the module "
                              f"needs: {_listing(missing)}{hint}")
    extra = present.keys() - slots.keys()
    if extra:
        hint = (" (the checkpoint holds these weights in FP8 with their scales: build the layers with "
                "fp8_weights=True, then nn.dequantize(module) for bf16 masters)") if scales_only(extra) else ""
        raise CheckpointError(f"load_checkpoint: {len(extra)} tensor(s) of the checkpoint have no place in the "
                              f"module: {_listing(extra)}{hint}")
    by_file: dict[str, list[str]] = {}
    for name, file in sorted(present.items()):
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():               # headers only: every tensor checked before any is read
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    raise CheckpointError(f"load_checkpoint: {INDEX_FILE} puts `{name}` in {file}, which does "
                                          "not hold it")
                sl, slot = f.get_slice(name), slots[name]
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if shape != slot.shape:
                    raise CheckpointError(f"load_checkpoint: `{name}` ({file}) has shape {shape}; its place, "
                                          f"{slot.path}{_where(slot)}, takes {slot.shape}")
                why = _fits(dtype, _value(slot.var).dtype)
                if why:
                    raise CheckpointError(f"load_checkpoint: `{name}` ({file}) {why}")
    pieces: dict[int, int] = {}
    for slot in slots.values():
        pieces[id(slot.var)] = pieces.get(id(slot.var), 0) + 1
    buffers: dict[int, np.ndarray] = {}
    for file, names in by_file.items():
        with safe_open(os.path.join(path, file), framework="numpy") as f:
            for name in names:
                slot = slots[name]
                key = id(slot.var)
                tensor = _read(f, os.path.join(path, file), name)
                if pieces[key] == 1 and not slot.index:
                    _place(slot.var, tensor, mesh, slot.transpose)
                else:
                    val = _value(slot.var)
                    buf = buffers.setdefault(key, np.empty(val.shape, val.dtype))
                    buf[slot.index] = tensor.T if slot.transpose else tensor
                    if pieces[key] == 1:
                        _place(slot.var, buffers.pop(key), mesh, False)
                pieces[key] -= 1
                del tensor
    return module


def _where(slot: Slot) -> str:
    return f"[{', '.join(_index_text(i) for i in slot.index)}]" if slot.index else ""


def _index_text(i) -> str:
    if not isinstance(i, slice):
        return str(i)
    return ":" if i.start is None else f"{i.start}:{i.stop}"


def _place(var: nnx.Variable, host: np.ndarray, mesh, transpose: bool) -> None:
    """The variable's value from host data: on `mesh` (or its own mesh metadata) as its
    out_sharding says, else on the default device; converted to its dtype, transposed on the
    device when asked."""
    val = _value(var)
    mesh = mesh if mesh is not None else var.get_metadata().get("mesh")
    spec = get_var_pspec(var)
    if host.dtype != val.dtype:
        host = host.astype(val.dtype)
    if mesh is None:
        arr = jax.device_put(host)
        arr = arr.T if transpose else arr
    else:
        sharding = jax.sharding.NamedSharding(mesh, spec)
        if transpose:   # put as stored, transposed spec; transposed on the devices into the variable's
            full = tuple(spec) + (None,) * (host.ndim - len(spec))
            src = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*reversed(full)))
            arr = jax.jit(lambda a: a.T, out_shardings=sharding)(jax.device_put(host, src))
        else:
            arr = jax.device_put(host, sharding)
    var.set_value(arr)
