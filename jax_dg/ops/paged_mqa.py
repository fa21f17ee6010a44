"""Paged MQA logits (the DeepSeek V3.2 indexer's decode step), schedule metadata, sparse variants.

DeepGEMM's `fp8_fp4_paged_mqa_logits` scores every cached token of every request for each of
its next_n query rows; `get_paged_mqa_logits_metadata` splits that work over the SMs. Both
sized things (the number of schedule slots, the output width) are static: the slot count
comes from the target device at trace time (`device.target()`), the width from `max_model_len`.

What jax_dg adds to DeepGEMM's contract (2.5.0, SM90), so that outputs are fully defined:
- context_lens may be 1-D [B] (row j of request b is then valid for
  t < context_lens[b] - next_n + j + 1, vLLM's convention) or 2-D [B, next_n]; both reach
  the kernel as 2-D, as 2.5.0 requires.
- DeepGEMM scores all rows of a request up to its *last* row's length, so a row is cut to that
  length (its tail is -inf), and negative lengths count as 0.
- DeepGEMM's padded allocation lands in the custom call's result (jax_dg.runtime.landing, no
  copy), as does the schedule the call makes when none is given (a second, scratch result),
  so the call allocates nothing torch keeps and can be captured into a CUDA graph; with
  clean_logits the op's finish then runs jax_dg's
  kernel (a native call in XLA) that writes -inf at positions t >= a row's length (DeepGEMM
  2.5.0 leaves real values and unwritten memory there), in place and nowhere else
  (kernels/neg_inf.cu), and slices [rows, max_model_len] out. `clean_logits=False` skips the
  kernel (those positions are then unspecified).
- Block size 32: DeepGEMM reads block-table entries in pairs, so the table is padded to an
  even width and entries past each request's blocks are set to block 0 (a valid id).
- Values DeepGEMM uses as addresses are brought into range by jax_dg's own kernel before
  DeepGEMM's (`PAGED_SANITISE`, kernels/paged_sanitise.cu: one launch over the [B] lengths
  and the [B, max_blocks] table, a second for a given schedule): a block-table entry
  outside [0, num_blocks) ends its request's context at that block (the rows are -inf from its
  first token on, and paged_indexer_topk never picks it; the entry itself is replaced by block
  0), and lengths are clamped to min(max_model_len, max_blocks * block_size). So no value can
  make the kernel read or write out of bounds. Under `jax_dg.checked()` these raise instead.
- With `schedule_metadata=None` the call computes the schedule of the sanitised lengths itself
  (DeepGEMM's metadata kernel, on the same stream; per shard when sharded over requests). A
  caller-supplied schedule must come from the same context_lens (as with DeepGEMM); it is
  bounded to the sanitised lengths in the same call (a second launch; the identity on
  DeepGEMM's own schedule; SM90, next_n <= 2), since one made for longer rows would send the
  kernel past them; elsewhere (varlen, next_n 4), where sanitising changed a length, it is replaced by
  the schedule of the sanitised lengths (DeepGEMM's algorithm in XLA, bit-exact). Checked mode
  also verifies that it is the schedule of context_lens.
JAX arrays are always contiguous: torch's concern about block tables whose last stride is not
1 does not arise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg import contracts
from jax_dg.backends import deep_gemm
from jax_dg.core.checks import Checker
from jax_dg.core import device, native, values
from jax_dg.core.op import REQUIRED, Op, bcast, exposes, fold_rows, shaped
from jax_dg.core.sharding import Layout, Sharding
from jax_dg.ops.mqa import check_logits_dtype, logits_buffer, qk_dtype_name
from jax_dg.operands.paged import check_kv_cache
from jax_dg.reference import paged_mqa as ref

__all__ = ["fp8_fp4_paged_mqa_logits", "fp8_fp4_paged_sparse_mqa_logits",
           "get_paged_mqa_logits_metadata", "get_paged_mqa_page_sizes",
           "get_paged_sparse_mqa_logits_metadata", "has_deep_gemm_sparse_mqa",
           "mqa_logits_mx_inputs", "mqa_logits_use_mx_scales", "native_next_n_supported",
           "paged_mqa_logits"]

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
I32 = jnp.int32
UNIT_UE8M0_X4 = 0x7F7F7F7F          # four UE8M0 exponents of 2**0
SPARSE_KERNELS = ("fp8_fp4_sparse_mqa_logits", "fp8_fp4_paged_sparse_mqa_logits",
                  "get_sparse_mqa_logits_metadata", "get_paged_sparse_mqa_logits_metadata")


def next_n_ok(t: device.Target, next_n: int) -> bool:
    """Whether target `t`'s paged kernel takes next_n query rows per request."""
    if t.arch == "sm90":
        return next_n in t.api.sm90_paged_next_n
    return contracts.next_n_ok(next_n, t.arch)


def page_sizes(t: device.Target) -> tuple[int, ...]:
    """KV block sizes (tokens) target `t`'s paged kernels take."""
    return t.api.sm90_page_sizes if t.arch == "sm90" else contracts.page_sizes(t.arch)


def native_next_n_supported(next_n: int) -> bool:
    """Whether the target's paged MQA-logits kernel takes next_n query rows per request.
    SM90 implements 1, 2 and 4 (DeepGEMM 2.8: 1 and 2); SM100/SM120 any. Otherwise flatten to
    one row per query."""
    return next_n_ok(device.target(), Checker("native_next_n_supported").static_int(next_n, "next_n", 1))


def get_paged_mqa_page_sizes() -> tuple[int, ...]:
    """KV block sizes (tokens) the target's paged MQA-logits kernels take: 32 and 64 (DeepGEMM
    2.8 on SM90, and SM120: only 64). Larger storage blocks must be split into one of these."""
    return page_sizes(device.target())


def mqa_logits_use_mx_scales() -> bool:
    """Whether the target's MQA-logits kernels take only MX-scaled inputs (SM100: MXFP8/MXFP4
    with packed UE8M0 scales, bf16 weights)."""
    return device.target().arch == "sm100"


def mqa_logits_mx_inputs(q: jax.Array, q_scale: jax.Array | None, weights: jax.Array):
    """(q_scale, weights) adapted to the target's MQA-logits kernels, as vLLM's wrapper does.

    Off SM100: returned unchanged. On SM100: an FP8 q without scales (its per-token scale
    folded into weights) gets unit MX scales int32 [q.shape[:-1]] (exact: relu commutes with
    a positive scale) and the weights become bfloat16.
    """
    if not mqa_logits_use_mx_scales():
        return q_scale, weights
    if q_scale is None:
        q_scale = jnp.full(q.shape[:-1], UNIT_UE8M0_X4, I32)
    return q_scale, weights.astype(jnp.bfloat16)


def has_deep_gemm_sparse_mqa() -> bool:
    """Whether the installed DeepGEMM provides the sparse-indexer kernels
    (fp8_fp4_(paged_)sparse_mqa_logits and their metadata; DeepGEMM >= 2.8, SM100-only)."""
    return all(deep_gemm.lookup(name) is not None for name in SPARSE_KERNELS)


# --- schedule metadata ------------------------------------------------------------------------

def schedule_buffer(t: device.Target, slots: int) -> jax.ShapeDtypeStruct:
    """The custom-call result DeepGEMM's int32 [slots + 1, 2] schedule allocation lands in on
    target `t` (jax_dg.runtime.landing; on CUDA the rows of torch's whole 2 MiB segment)."""
    segmented = t.platform == "cuda"
    return jax.ShapeDtypeStruct((contracts.landing_rows(slots + 1, 2, 4, segmented), 2), I32)


def _metadata_shapes(context_lens, indices, *, target, num_sms):
    return [schedule_buffer(target, num_sms)]


def _metadata_run(rt, context_lens, indices, out, *, block_kv, num_sms):
    kw = {} if indices is None else {"indices": indices}
    rt.land(out, lambda: rt.dg.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, **kw))


def _metadata_finish(outs, inputs, *, num_sms):
    return (outs[0][:num_sms + 1],)


def _metadata_reference(context_lens, indices, *, num_sms):
    if indices is not None:
        return ref.paged_mqa_logits_varlen_metadata(context_lens, indices, num_sms=num_sms)
    return ref.paged_mqa_logits_metadata(context_lens, num_sms=num_sms)


SM90, SM100 = frozenset({"sm90"}), frozenset({"sm100"})

GET_PAGED_MQA_LOGITS_METADATA = Op(
    name="get_paged_mqa_logits_metadata",
    args=("context_lens", "indices"),
    statics={"block_kv": REQUIRED, "num_sms": REQUIRED},
    shapes=_metadata_shapes,
    run=_metadata_run,
    reference=_metadata_reference,
    finish=_metadata_finish,
    symbols=("get_paged_mqa_logits_metadata",),
    arg_archs={"indices": SM100},   # the varlen form
    graph_safe=SM90,   # its one allocation lands in XLA's buffer
)


def _check_context_lens(ck: Checker, context_lens, b: int | None = None) -> None:
    ck.dtype(context_lens, "context_lens", I32)
    ck.that(context_lens.ndim in (1, 2), "context_lens", "must be [B] or [B, next_n]",
            tuple(context_lens.shape))
    if b is not None:
        ck.that(context_lens.shape[0] == b, "context_lens", f"must have B = {b} rows (q's batch)",
                tuple(context_lens.shape))


def _check_indices(ck: Checker, indices, rows: int, next_n: int) -> None:
    ck.tensor(indices, "indices", [I32], (rows,), "[rows] (request id of each query row)")
    ck.that(next_n == 1, "indices", "needs next_n == 1 (one query row per entry)", next_n)


@exposes(GET_PAGED_MQA_LOGITS_METADATA)
def get_paged_mqa_logits_metadata(context_lens: jax.Array, block_size: int, num_sms: int | None = None,
                                  indices: jax.Array | None = None, *, next_n: int | None = None) -> jax.Array:
    """Schedule metadata for paged MQA logits: int32 [slots + 1, 2].

    context_lens: int32 [B, next_n] (only the last column counts) or [B] (then `next_n`, default 1,
        says how many query rows each request has). Lengths are counted in [0, 2**24]
        (contracts.MAX_CONTEXT_LEN): beyond, an int32 sum of every request's splits overflows.
    block_size: the KV cache's block size in tokens (32 or 64 on SM90).
    num_sms: SMs to schedule for; default: the target device's (jax_dg.core.device.target()),
        which is what the logits kernel checks the metadata against. slots = num_sms, halved on SM90 for
        next_n = 4 (one task per 2-SM cluster).
    indices: int32 [rows], request id per query row: the varlen form (SM100 in DeepGEMM).
    On the GPU this is DeepGEMM's own kernel; elsewhere its exact algorithm (bit-exact).
    """
    ck = Checker("get_paged_mqa_logits_metadata")
    t = device.target()
    GET_PAGED_MQA_LOGITS_METADATA.gate(t, ["context_lens"] + ([] if indices is None else ["indices"]))
    _check_context_lens(ck, context_lens)
    if context_lens.ndim == 2:
        ck.that(next_n is None or next_n == context_lens.shape[1], "next_n",
                f"must match context_lens' next_n = {context_lens.shape[1]}", next_n)
        next_n = context_lens.shape[1]
    next_n = 1 if next_n is None else ck.static_int(next_n, "next_n", 1)
    ck.that(context_lens.shape[0] >= 1, "context_lens", "must have at least one row",
            tuple(context_lens.shape))
    block_size = ck.static_int(block_size, "block_size")
    sizes = page_sizes(t)
    ck.that(block_size in sizes, "block_size", f"must be one of {sizes} on {t.arch}", block_size)
    num_sms = t.num_sms if num_sms is None else ck.static_int(num_sms, "num_sms", 1)
    lens = context_lens if context_lens.ndim == 2 else context_lens[:, None]
    # negative lengths count as 0; lengths past MAX_CONTEXT_LEN as that (an int32 sum of every
    # request's splits overflows near 2**31: DeepGEMM's and the references' would disagree)
    lens = jnp.clip(lens, 0, contracts.MAX_CONTEXT_LEN)
    if indices is not None:
        _check_indices(ck, indices, context_lens.shape[0], next_n)
    slots = contracts.schedule_slots(num_sms, next_n, t.arch, varlen=indices is not None)
    (meta,) = GET_PAGED_MQA_LOGITS_METADATA(lens, indices, target=t, block_kv=block_size, num_sms=slots)
    return meta


# --- dense paged logits -----------------------------------------------------------------------

def _logits_shapes(q, q_sf, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                   indices, *, target, max_model_len, slots, logits_dtype):
    rows = q.shape[0] * q.shape[1]
    # bfloat16 where the target's kernel writes it; else (2.8 on SM90) float32, rounded after
    kernel_dtype = (logits_dtype if logits_dtype in target.api.logits_dtypes(PAGED_MQA_LOGITS.name)
                    else "float32")
    layout = contracts.paged_logits_layout(
        rows, max_model_len, contracts.logits_stride_align(target.version, kernel_dtype))
    # no schedule given: the call makes one, in a second result (a scratch the finish drops)
    scratch = [schedule_buffer(target, slots)] if schedule_metadata is None else []
    return shaped([logits_buffer(target, *layout, kernel_dtype)] + scratch,
                  lands=contracts.lands(rows, target.platform == "cuda"), kernel_dtype=kernel_dtype)


def _logits_run(rt, q, q_sf, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                indices, out, schedule=None, *, max_model_len, slots, lands, kernel_dtype):
    kw = {} if indices is None else {"indices": indices}
    if schedule_metadata is None:   # absent (a trace-time fact): the schedule of exactly these rows
        rt.land(schedule, lambda: rt.dg.get_paged_mqa_logits_metadata(
            context_lens, kv_cache.shape[1], slots, **kw))
        schedule_metadata = schedule[:slots + 1]
    # DeepGEMM's allocation lands in `out` (jax_dg.runtime.landing). Keywords: positional
    # arguments after the 7th changed meaning across DeepGEMM releases.
    rt.land(out, lambda: rt.dg.fp8_fp4_paged_mqa_logits(
        (q, q_sf), kv_cache, weights, context_lens, block_tables, schedule_metadata,
        max_model_len, clean_logits=False, logits_dtype=rt.dtype(kernel_dtype), **kw), lands)


def _logits_finish(outs, inputs, *, max_model_len, clean_logits, logits_dtype, kernel_dtype):
    """The [B * next_n, max_model_len] block; with clean_logits, -inf past each row's length
    written first (in place, jax_dg's own kernel); bfloat16 logits the target's kernel cannot
    write (2.8 on SM90) rounded from its float32 ones, fused by XLA with the slice."""
    buf = outs[0]   # [1]: the schedule made in the call, if any
    lens = inputs["context_lens"].reshape(-1)
    if clean_logits:
        buf = native.neg_inf_outside(buf, None, lens, cols=max_model_len, relative=False)
    out = buf[:lens.shape[0], :max_model_len]
    return (out.astype(logits_dtype) if logits_dtype != kernel_dtype else out,)


def _logits_reference(q, q_sf, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                      indices, *, max_model_len, logits_dtype):
    return ref.paged_mqa_logits(q, q_sf, kv_cache, weights, context_lens, block_tables,
                                max_model_len=max_model_len).astype(logits_dtype)


def _logits_batch(size, batched, inputs, *, max_model_len, clean_logits, slots, logits_dtype):
    """vmap over batches of requests sharing one KV cache: the batch folds into B (one kernel
    over V * B requests, the schedule computed for all of them); a batched cache, MX scales,
    the varlen form or a given schedule: sequential."""
    if batched["kv_cache"] or any(inputs.get(n) is not None for n in ("q_sf", "indices", "schedule_metadata")):
        return None
    q, w, lens, table = (bcast(inputs[n], batched[n], size)
                         for n in ("q", "weights", "context_lens", "block_tables"))
    (out,) = PAGED_MQA_LOGITS(fold_rows(q), None, inputs["kv_cache"], fold_rows(w), fold_rows(lens),
                              fold_rows(table), None, None, max_model_len=max_model_len,
                              clean_logits=clean_logits, slots=slots, logits_dtype=logits_dtype)
    return (out.reshape(size, -1, out.shape[-1]),)


def request_sharding(out: str) -> Sharding:
    """Requests (B) split with no collective, each shard scheduling its own rows (a given
    schedule is the whole batch's: it forbids the split); the cache is every shard's. `out`:
    the factors of the one output, rows first ("bj ...")."""
    return Sharding(lambda names, **static: Layout(
        {"q": "b j h d", "q_sf": "b j h", "kv_cache": "p t o e", "weights": "bj h", "context_lens": "b j",
         "block_tables": "b x", "schedule_metadata": "s y", "indices": "b"}, [out]),
        free=frozenset({"b"}), tied={"bj": ("b", "times", 0)},
        forbid={"b": frozenset({"schedule_metadata"})})


PAGED_MQA_LOGITS = Op(
    name="fp8_fp4_paged_mqa_logits",
    args=("q", "q_sf", "kv_cache", "weights", "context_lens", "block_tables", "schedule_metadata",
          "indices"),
    statics={"max_model_len": REQUIRED, "clean_logits": REQUIRED, "slots": REQUIRED,
             "logits_dtype": "float32"},
    shapes=_logits_shapes,
    run=_logits_run,
    reference=_logits_reference,
    symbols=("fp8_fp4_paged_mqa_logits",),
    own_kernels=("neg_inf_outside",),
    arg_archs={"q_sf": SM100, "indices": SM100},   # MX scales; the varlen form
    graph_safe=SM90,   # its allocations (logits, schedule) land in XLA's buffers
    batch=_logits_batch,
    finish=_logits_finish,
    sharding=request_sharding("bj l"),
)


def _paged_logits(name, q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                  max_model_len, indices, clean_logits, logits_dtype):
    t = device.target()
    arrays, static = paged_arguments(name, t, q, kv_cache, weights, context_lens, block_tables,
                                     schedule_metadata, max_model_len, indices)
    ck = Checker(name)
    clean_logits = ck.static_bool(clean_logits, "clean_logits")
    (out,) = PAGED_MQA_LOGITS(*arrays, target=t, clean_logits=clean_logits,
                              logits_dtype=check_logits_dtype(ck, logits_dtype), **static)
    return out


def paged_arguments(name, t: device.Target, q, kv_cache, weights, context_lens, block_tables,
                    schedule_metadata, max_model_len, indices):
    """The paged logits op's arrays and static attributes (but clean_logits) from the public
    arguments, checked for target `t`, with lengths and block table as the kernel needs them."""
    ck = Checker(name)
    qv, q_sf = ck.pair(q, "q", second_optional=True)
    PAGED_MQA_LOGITS.gate(t, ["q"] + [n for n, x in (("q_sf", q_sf), ("indices", indices)) if x is not None])
    ck.ndim(qv, "q[0]", 4, "[B, next_n, H, D]")
    ck.dtype(qv, "q[0]", FP8)
    b, next_n, h, d = qv.shape
    ck.that(d in (32, 64, 128), "q[0]", "must have head dim D in (32, 64, 128)", d)
    ck.that(h in (32, 64), "q[0]", "must have H in (32, 64) heads (DeepGEMM's paged kernels)", h)
    ck.that(b >= 1, "q[0]", "must have at least one request (B >= 1)", tuple(qv.shape))
    ck.that(next_n_ok(t, next_n), "q[0]",
            f"must have next_n in {t.api.sm90_paged_next_n} on sm90 (DeepGEMM {t.api.release}); "
            "flatten other next_n to one row per query (next_n = 1)" if t.arch == "sm90" else
            f"must have next_n >= 1 on {t.arch}", next_n)
    mx = q_sf is not None
    if mx:  # the references emulate the target's contract: MX q scales are SM100's
        ck.that(t.arch == "sm100", "q[1]", f"must be None on {t.arch}: DeepGEMM's kernel there "
                "takes no q scale (fold it into `weights`)")
        ck.tensor(q_sf, "q[1]", [I32], (b, next_n, h), "[B, next_n, H] (packed UE8M0)")
        ck.that(d == contracts.MX_HEAD_DIM, "q[0]", "must have D = 128 with MX scales", d)
    nb, blk, _ = check_kv_cache(ck, kv_cache, d=d, block_sizes=page_sizes(t),
                                where=f"{t.arch} (DeepGEMM {t.api.release})" if t.arch == "sm90" else t.arch)
    w_dtypes = [F32, jnp.bfloat16] if t.arch == "sm100" else [F32]
    ck.tensor(weights, "weights", w_dtypes, (b * next_n, h), "[B * next_n, H]")
    _check_context_lens(ck, context_lens, b)
    if context_lens.ndim == 2:
        ck.that(context_lens.shape[1] == next_n, "context_lens",
                f"must be [B, next_n] = {(b, next_n)}", tuple(context_lens.shape))
    ck.ndim(block_tables, "block_tables", 2, "[B, max_blocks]")
    ck.dtype(block_tables, "block_tables", I32)
    ck.that(block_tables.shape[0] == b and block_tables.shape[1] >= 1, "block_tables",
            f"must be [B, max_blocks] with B = {b}, max_blocks >= 1", tuple(block_tables.shape))
    width = block_tables.shape[1]
    max_model_len = width * blk if max_model_len is None else max_model_len
    max_model_len = ck.static_int(max_model_len, "max_model_len", 1)
    if indices is not None:
        _check_indices(ck, indices, b, next_n)
        ck.that(t.arch != "sm90" or t.api.sm90_paged_varlen, "indices", "must be None on sm90 "
                f"with DeepGEMM {t.api.release} (its varlen form is SM100's): pass a [B, next_n] "
                "context_lens instead")
    slots = contracts.schedule_slots(t.num_sms, next_n, t.arch, varlen=indices is not None)
    if schedule_metadata is not None:
        ck.tensor(schedule_metadata, "schedule_metadata", [I32], (slots + 1, 2),
                  f"[slots + 1, 2] for {t.num_sms} SMs and next_n = {next_n} on {t.arch} "
                  "(from get_paged_mqa_logits_metadata with this device's num_sms"
                  + (" and next_n=4" if slots != t.num_sms else "") + ")")

    # Lengths, block table and a given schedule as the kernel reads them: every address in
    # range, whatever the values (one native kernel; checked mode raises instead)
    limit = min(max_model_len, width * blk)
    ck.that(limit <= contracts.MAX_PAGED_LIMIT, "max_model_len",
            f"must be <= {contracts.MAX_PAGED_LIMIT} tokens, or max_blocks * block_size", limit)
    raw = context_lens if context_lens.ndim == 1 else context_lens[:, -1]
    given = jnp.maximum(raw, 0)[:, None]
    if values.checking():
        context_lens, block_tables = _require_in_range(name, context_lens, given, block_tables, nb,
                                                       blk, limit)
    bounded = schedule_metadata is not None and indices is None and next_n <= 2 and _walk_known(t)
    if bounded:   # the schedule's keys (row, split) count in int32
        ck.that((b + 1) * (contracts.cdiv(limit, contracts.SPLIT_KV) + 1) < 2 ** 31, "schedule_metadata",
                "cannot be bounded: B * max_model_len / 256 overflows int32 (pass None)", (b, limit))
    static = dict(next_n=next_n, num_blocks=nb, block_size=blk, limit=limit, zero_unused=blk == 32)
    sched = schedule_metadata if bounded else None
    ctx, block_tables, *fixed = PAGED_SANITISE(context_lens, block_tables, sched, target=t,
                                               one_d=context_lens.ndim == 1, **static)
    if indices is not None:   # request ids of the varlen form: addresses too
        indices = values.require(name, "indices", (indices >= 0) & (indices < b),
                                 f"must lie in [0, B = {b})", indices)
        indices = jnp.clip(indices, 0, b - 1)
    if schedule_metadata is not None:
        schedule_metadata = _trusted_schedule(name, schedule_metadata, given, ctx, indices, slots,
                                              fixed[0] if bounded else None)
    # Without a schedule the call computes its own (DeepGEMM's kernel, on the same stream): the
    # schedule of exactly the rows it scores, also per shard when sharded over requests.
    return ((qv, q_sf, kv_cache, weights, ctx, block_tables, schedule_metadata, indices),
            dict(max_model_len=max_model_len, slots=slots))


def _require_in_range(name: str, context_lens, given, block_tables, num_blocks: int, blk: int,
                      limit: int):
    """Checked mode (jax_dg.checked): an out-of-range entry among a request's blocks, or a
    length above `limit` = min(max_model_len, max_blocks * block_size), raises. Returns
    (context_lens, block_tables) through the checks."""
    bad = (block_tables < 0) | (block_tables >= num_blocks)
    used = jnp.arange(block_tables.shape[1], dtype=I32)[None, :] < (given + blk - 1) // blk
    block_tables = values.require(
        name, "block_tables", ~(bad & used), f"entries of a request's blocks (the first "
        f"ceil(context_len / {blk})) must lie in [0, num_blocks = {num_blocks})", block_tables)
    context_lens = values.require(name, "context_lens", given <= limit, f"must be <= {limit} "
                                  "(max_model_len and max_blocks * block_size)", given,
                                  carry=context_lens)
    return context_lens, block_tables


def _trusted_schedule(name, given_meta, given_last, ctx, indices, slots, bounded):
    """The caller's schedule, trusted as DeepGEMM trusts it but made safe for the lengths the
    kernel gets (a schedule made for longer rows would send the kernel past them): on SM90 with
    one atom per row (next_n 1 or 2) `bounded`, the sanitising kernel's fix-up of [slots + 1]
    entries that is the identity for DeepGEMM's own schedule (reference.bounded_schedule);
    otherwise (the varlen form, next_n 4), where sanitising changed a length, the schedule of
    the sanitised lengths (DeepGEMM's algorithm in XLA). Checked mode verifies that it is the
    schedule of context_lens."""
    def schedule(lens):
        if indices is None:
            return ref.paged_mqa_logits_metadata(lens, num_sms=slots)
        return ref.paged_mqa_logits_varlen_metadata(lens, indices, num_sms=slots)
    if values.checking():
        # carried by the schedule the call goes on with, so that XLA keeps the check
        checked = values.require(
            name, "schedule_metadata", jnp.all(given_meta == schedule(given_last))[None],
            "must be get_paged_mqa_logits_metadata(context_lens, block_size) of these context_lens",
            carry=given_meta if bounded is None else bounded)
        given_meta, bounded = (checked, None) if bounded is None else (given_meta, checked)
    if bounded is not None:
        return bounded
    return jnp.where(jnp.all(ctx[:, -1:] == given_last), given_meta, schedule(ctx))


def _walk_known(t: device.Target) -> bool:
    """Whether the paged kernel of target `t` walks a schedule as bounded_schedule models it:
    SM90 in DeepGEMM 2.5 and 2.6 (read from their sources; the emulation follows 2.5). Another
    DeepGEMM keeps the recomputed schedule."""
    return t.arch == "sm90" and (2, 5) <= t.version <= (2, 6)


# --- the call's addresses in range: jax_dg's own kernel -----------------------------------------

def _sanitise_shapes(context_lens, block_tables, schedule_metadata, *, next_n, block_size, limit,
                     zero_unused, one_d):
    b, w = block_tables.shape   # the caller (paged_arguments) checked these
    assert 0 <= limit <= min(w * block_size, contracts.MAX_PAGED_LIMIT), (limit, w, block_size)
    assert context_lens.ndim == (1 if one_d else 2)
    out = [jax.ShapeDtypeStruct((b, next_n), I32),
           jax.ShapeDtypeStruct((b, w + w % 2 if zero_unused else w), I32)]
    return out + ([jax.ShapeDtypeStruct(schedule_metadata.shape, I32)]
                  if schedule_metadata is not None else [])


def _sanitise_outputs(fn):
    """The op's outputs (ctx, table[, schedule]) from `fn` (the native call or the reference),
    which return the absent schedule as None."""
    def call(context_lens, block_tables, schedule_metadata, *, next_n, num_blocks, block_size,
             limit, zero_unused):
        ctx, table, fixed = fn(context_lens, block_tables, schedule_metadata, next_n=next_n,
                               num_blocks=num_blocks, block_size=block_size, limit=limit,
                               zero_unused=zero_unused)
        return (ctx, table) + (() if fixed is None else (fixed,))
    return call


def _sanitise_batch(size, batched, inputs, **static):
    """vmap: every batch element's requests fold into B (one kernel); with a schedule (each
    element's bounded over its own requests): sequential."""
    if inputs.get("schedule_metadata") is not None:
        return None
    lens, table = (bcast(inputs[n], batched[n], size) for n in ("context_lens", "block_tables"))
    ctx, table = PAGED_SANITISE(fold_rows(lens), fold_rows(table), None, **static)
    return ctx.reshape(size, -1, ctx.shape[-1]), table.reshape(size, -1, table.shape[-1])


def _sanitise_layout(names, *, one_d):
    outs = ["b j", "b w"] + (["s y"] if "schedule_metadata" in names else [])
    return Layout({"context_lens": "b" if one_d else "b j", "block_tables": "b x",
                   "schedule_metadata": "s y"}, outs)


# The paged logits call's lengths, block table and (bounded) schedule, every address in range
# (reference.paged_sanitised says what each holds): requests split with no collective; a given
# schedule is the whole batch's.
PAGED_SANITISE = Op(
    name="paged_sanitise",
    args=("context_lens", "block_tables", "schedule_metadata"),
    statics={"next_n": REQUIRED, "num_blocks": REQUIRED, "block_size": REQUIRED, "limit": REQUIRED,
             "zero_unused": REQUIRED, "one_d": REQUIRED},
    shapes=_sanitise_shapes,
    native=_sanitise_outputs(native.paged_sanitise),
    reference=_sanitise_outputs(ref.paged_sanitised),
    own_kernels=("paged_sanitise",),
    batch=_sanitise_batch,
    sharding=Sharding(_sanitise_layout, free=frozenset({"b"}),
                      forbid={"b": frozenset({"schedule_metadata"})}),
)


@exposes(PAGED_MQA_LOGITS, GET_PAGED_MQA_LOGITS_METADATA, PAGED_SANITISE)
def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                             max_model_len, indices=None, *, clean_logits: bool = True,
                             logits_dtype=jnp.float32) -> jax.Array:
    """MQA logits over a paged FP8 KV cache (DeepGEMM fp8_fp4_paged_mqa_logits; vLLM's wrapper's call).

    q: (values float8_e4m3fn [B, next_n, H, D], None) — on SM100 optionally packed UE8M0 scales
       int32 [B, next_n, H] (see mqa_logits_mx_inputs). H in (32, 64), D in (32, 64, 128),
       next_n in (1, 2, 4) on SM90.
    kv_cache: uint8 [num_blocks, block_size, 1, D + 4] in DeepGEMM's block layout (jax_dg.operands.paged),
       block_size in get_paged_mqa_page_sizes().
    weights: float32 [B * next_n, H].
    context_lens: int32 [B, next_n] (row b*next_n + j valid for t < context_lens[b, j]; the last
       column should be the largest) or [B] (row j valid for t < context_lens[b] - next_n + j + 1).
    block_tables: int32 [B, max_blocks]: logical block i of request b -> physical cache block.
       An entry outside [0, num_blocks) (e.g. -1 for "not allocated") ends the request's
       context at that block: positions from its first token on are -inf (never read).
       context_lens above min(max_model_len, max_blocks * block_size) are clamped to it.
       Under `jax_dg.checked()` both raise instead (see jax_dg.core.values).
    schedule_metadata: from get_paged_mqa_logits_metadata(context_lens, block_size) (static
       shape [slots + 1, 2] for the target device), or None to compute it here.
    max_model_len: static int, the output width.
    indices: int32 [B] request id per row, the varlen form (next_n == 1; SM100 in DeepGEMM).
    clean_logits: fill positions past each row's length with -inf (default); False leaves them
       unspecified and saves jax_dg's -inf kernel.
    logits_dtype: float32 (default) or bfloat16 (each float32 sum rounded once on the store).
    Returns logits_dtype [B * next_n, max_model_len].
    """
    return _paged_logits("fp8_fp4_paged_mqa_logits", q, kv_cache, weights, context_lens,
                         block_tables, schedule_metadata, max_model_len, indices, clean_logits,
                         logits_dtype)


@exposes(PAGED_MQA_LOGITS, GET_PAGED_MQA_LOGITS_METADATA, PAGED_SANITISE)
def paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables, *, max_model_len=None,
                     schedule_metadata=None, indices=None, clean_logits: bool = True,
                     logits_dtype=jnp.float32) -> jax.Array:
    """JAX-style `fp8_fp4_paged_mqa_logits`: q is the FP8 values (or a (values, scales) pair),
    max_model_len defaults to max_blocks * block_size, and the schedule metadata is computed
    here unless given (pass it to reuse one schedule across layers of a decode step)."""
    q = tuple(q) if isinstance(q, (tuple, list)) else (q, None)
    return _paged_logits("paged_mqa_logits", q, kv_cache, weights, context_lens, block_tables,
                         schedule_metadata, max_model_len, indices, clean_logits, logits_dtype)


# --- sparse paged logits (SM100-only kernels) -------------------------------------------------
#
# The metadata buffer (jax_dg.contracts, paged form): header [context_lens | block indices],
# then the backend's own schedule (DeepGEMM's opaque one on SM100; the references' table
# elsewhere). The header lets every backend clean.

def _sparse_metadata_shapes(context_lens, block_table, indices, sparse_kv_block_indices, *, size):
    return [jax.ShapeDtypeStruct((size,), jnp.uint8)]


def _sparse_metadata_run(rt, context_lens, block_table, indices, sparse_kv_block_indices, out, *,
                         page_kv, qk_dtype, sparse_block_kv):
    m, nmsb = sparse_kv_block_indices.shape
    meta = rt.dg.get_paged_sparse_mqa_logits_metadata(context_lens, block_table, indices, page_kv,
                                                      sparse_kv_block_indices, rt.dtype(qk_dtype),
                                                      sparse_block_kv)
    rt.write_sparse_metadata(out, (context_lens, sparse_kv_block_indices), meta, m, nmsb, paged=True,
                             what="get_paged_sparse_mqa_logits_metadata")


def _sparse_metadata_reference(context_lens, block_table, indices, sparse_kv_block_indices, *,
                               page_kv, sparse_block_kv, size):
    return ref.paged_sparse_mqa_logits_metadata(context_lens, block_table, sparse_kv_block_indices,
                                                page_kv=page_kv, sparse_block_kv=sparse_block_kv,
                                                size=size)


GET_PAGED_SPARSE_MQA_LOGITS_METADATA = Op(
    name="get_paged_sparse_mqa_logits_metadata",
    args=("context_lens", "block_table", "indices", "sparse_kv_block_indices"),
    statics={"page_kv": REQUIRED, "qk_dtype": REQUIRED, "sparse_block_kv": REQUIRED, "size": REQUIRED},
    shapes=_sparse_metadata_shapes,
    run=_sparse_metadata_run,
    reference=_sparse_metadata_reference,
    symbols=("get_paged_sparse_mqa_logits_metadata",),
    archs=frozenset({"sm100"}),
)


def _sparse_logits_shapes(q, q_sf, kv_cache, weights, metadata, *, num_max_sparse_blocks,
                          sparse_block_kv):
    return [jax.ShapeDtypeStruct((q.shape[0], num_max_sparse_blocks * sparse_block_kv), jnp.bfloat16)]


def _sparse_logits_run(rt, q, q_sf, kv_cache, weights, metadata, out, *, num_max_sparse_blocks,
                       sparse_block_kv, clean_logits):
    m, nmsb, sbk = q.shape[0], num_max_sparse_blocks, sparse_block_kv
    logits = rt.dg.fp8_fp4_paged_sparse_mqa_logits((q, q_sf), kv_cache, weights,
                                                 rt.sparse_payload(metadata, m, nmsb, paged=True),
                                                 nmsb, sbk)
    if not clean_logits:
        out.copy_(logits)
        return
    ctx, idx = rt.sparse_header(metadata, m, nmsb, paged=True)
    rt.clean_sparse(out, logits, None, ctx, idx, sbk)


def _sparse_logits_reference(q, q_sf, kv_cache, weights, metadata, *, num_max_sparse_blocks,
                             sparse_block_kv):
    return ref.paged_sparse_mqa_logits(q, q_sf, kv_cache, weights, metadata,
                                       num_max_sparse_blocks=num_max_sparse_blocks,
                                       sparse_block_kv=sparse_block_kv)


PAGED_SPARSE_MQA_LOGITS = Op(
    name="fp8_fp4_paged_sparse_mqa_logits",
    args=("q", "q_sf", "kv_cache", "weights", "metadata"),
    statics={"num_max_sparse_blocks": REQUIRED, "sparse_block_kv": REQUIRED, "clean_logits": REQUIRED},
    shapes=_sparse_logits_shapes,
    run=_sparse_logits_run,
    reference=_sparse_logits_reference,
    symbols=("fp8_fp4_paged_sparse_mqa_logits",),
    archs=frozenset({"sm100"}),
)


def _check_sparse_sizes(ck: Checker, num_max_sparse_blocks, sparse_block_kv) -> tuple[int, int]:
    sbk = ck.static_int(sparse_block_kv, "sparse_block_kv")
    ck.that(sbk in (8, 16), "sparse_block_kv", "must be 8 or 16", sbk)
    nmsb = ck.static_int(num_max_sparse_blocks, "num_max_sparse_blocks", 1)
    ck.that(nmsb % 4 == 0 and nmsb <= 4096, "num_max_sparse_blocks",
            "must be a multiple of 4 and <= 4096", nmsb)
    return nmsb, sbk


@exposes(GET_PAGED_SPARSE_MQA_LOGITS_METADATA)
def get_paged_sparse_mqa_logits_metadata(context_lens, block_table, indices, page_kv: int,
                                         sparse_kv_block_indices, qk_dtype, sparse_block_kv: int
                                         ) -> jax.Array:
    """Metadata for fp8_fp4_paged_sparse_mqa_logits (uint8, 1-D; opaque), the call shape of vLLM's wrapper.

    context_lens: int32 [M] (or [M, 1]), one per query row.
    block_table: int32 [M, max_pages], one row per query row (rows of one request identical).
    indices: int32 [M], request id per query row (a request's rows consecutive).
    page_kv: static int, tokens per cache page, a multiple of sparse_block_kv.
    sparse_kv_block_indices: int32 [M, nmsb] logical (context-relative) candidate block ids
       (nmsb a multiple of 4, <= 4096); row m starts with its min(ceil(len / sbk), nmsb) valid
       blocks, strictly increasing; the rest is padding (repeat the last block).
    qk_dtype: jnp.float8_e4m3fn (MXFP8) or jnp.int8 (packed MXFP4): q's and the cache's format.
    sparse_block_kv: static int, 8 or 16.
    DeepGEMM has this kernel on SM100 only (>= 2.8); elsewhere use JAX_DG_BACKEND=torch or xla.
    The buffer's size depends on the target's SM count (`device.target()`).
    """
    ck = Checker("get_paged_sparse_mqa_logits_metadata")
    t = device.target()
    GET_PAGED_SPARSE_MQA_LOGITS_METADATA.gate(t)
    ck.ndim(sparse_kv_block_indices, "sparse_kv_block_indices", 2, "[M, num_max_sparse_blocks]")
    ck.dtype(sparse_kv_block_indices, "sparse_kv_block_indices", I32)
    m, nmsb = sparse_kv_block_indices.shape
    ck.that(nmsb % 4 == 0 and 0 < nmsb <= 4096, "sparse_kv_block_indices",
            "must have num_max_sparse_blocks columns, a multiple of 4 in [4, 4096]", nmsb)
    sbk = _check_sparse_sizes(ck, nmsb, sparse_block_kv)[1]
    ck.that(1 <= m <= 1 << 20, "sparse_kv_block_indices", "must have 1 to 2**20 rows", m)
    ck.dtype(context_lens, "context_lens", I32)
    ck.that(context_lens.size == m and context_lens.ndim in (1, 2), "context_lens",
            f"must be [M] = [{m}] (one length per query row)", tuple(context_lens.shape))
    ck.ndim(block_table, "block_table", 2, "[M, max_pages]")
    ck.dtype(block_table, "block_table", I32)
    ck.that(block_table.shape[0] == m and block_table.shape[1] >= 1, "block_table",
            f"must be [M, max_pages] with M = {m}", tuple(block_table.shape))
    ck.tensor(indices, "indices", [I32], (m,), "[M] (request id per query row)")
    page_kv = ck.static_int(page_kv, "page_kv", 1)
    ck.that(page_kv % sbk == 0, "page_kv", f"must be a multiple of sparse_block_kv = {sbk}", page_kv)
    qk = qk_dtype_name(ck, qk_dtype)
    size = contracts.sparse_metadata_bytes(m, nmsb, sbk, qk, t.num_sms, paged=True)
    (meta,) = GET_PAGED_SPARSE_MQA_LOGITS_METADATA(
        context_lens.reshape(m), block_table, indices, sparse_kv_block_indices, target=t,
        page_kv=page_kv, qk_dtype=qk, sparse_block_kv=sbk, size=size)
    return meta


@exposes(PAGED_SPARSE_MQA_LOGITS)
def fp8_fp4_paged_sparse_mqa_logits(q, kv_cache, weights, metadata, num_max_sparse_blocks: int,
                                    sparse_block_kv: int, *, clean_logits: bool = True) -> jax.Array:
    """MQA logits at candidate blocks only, over a paged MX cache (decode; DeepGEMM SM100 only).

    q: (values [M, 1, H, D'], packed UE8M0 int32 scales [M, 1, H], mandatory): MXFP8
       (float8_e4m3fn, D' = 128) or MXFP4 (int8, D' = 64 bytes of e2m1 pairs, low nibble first);
       H a multiple of 8 up to 32 (bf16 weight rows of whole 16 bytes: JAX rows are contiguous).
    kv_cache: uint8 [pages, page_kv, 1, D' + 4] in DeepGEMM's block layout (jax_dg.operands.paged) with
       packed UE8M0 token scales; a page (page_kv * (D' + 4) bytes) must be a multiple of 512.
    weights: bfloat16 [M, H] (q's scale is not folded in).
    metadata: from get_paged_sparse_mqa_logits_metadata (same M, nmsb; same backend).
    Returns bfloat16 [M, nmsb * sbk]: column j*sbk + o scores token
    sparse_kv_block_indices[m, j]*sbk + o of row m's context, valid for
    j < min(ceil(len / sbk), nmsb) and token < len; other columns are -inf (unspecified with
    clean_logits=False). DeepGEMM has this kernel on SM100 only.
    """
    ck = Checker("fp8_fp4_paged_sparse_mqa_logits")
    t = device.target()
    PAGED_SPARSE_MQA_LOGITS.gate(t)
    qv, q_sf = ck.pair(q, "q")
    ck.ndim(qv, "q[0]", 4, "[M, 1, H, D]")
    ck.dtype(qv, "q[0]", FP8, jnp.int8)
    m, one, h, dq = qv.shape
    fp4 = jnp.dtype(qv.dtype) == jnp.int8
    ck.that(one == 1, "q[0]", "must have next_n = 1 ([M, 1, H, D])", tuple(qv.shape))
    ck.that(dq == (64 if fp4 else 128), "q[0]", "must have D = 128 (64 bytes of packed FP4 pairs "
            "when int8)", dq)
    ck.that(0 < h <= 32 and h % 8 == 0, "q[0]", "must have H a multiple of 8, at most 32", h)
    ck.tensor(q_sf, "q[1]", [I32], (m, 1, h), "[M, 1, H] (packed UE8M0)")
    nmsb, sbk = _check_sparse_sizes(ck, num_max_sparse_blocks, sparse_block_kv)
    _, page_kv, _ = check_kv_cache(ck, kv_cache, d=dq)
    dsf = dq + 4
    ck.that(page_kv % sbk == 0 and (page_kv * dsf) % 512 == 0, "kv_cache",
            f"must have page_kv a multiple of {sbk} and pages of page_kv * {dsf} bytes a "
            "multiple of 512", page_kv)
    ck.tensor(weights, "weights", [jnp.bfloat16], (m, h), "[M, H] (bfloat16)")
    size = contracts.sparse_metadata_bytes(m, nmsb, sbk, jnp.dtype(qv.dtype).name, t.num_sms, paged=True)
    ck.tensor(metadata, "metadata", [jnp.uint8], (size,),
              f"[bytes] from get_paged_sparse_mqa_logits_metadata (M = {m}, nmsb = {nmsb}) "
              "on this device")
    clean_logits = ck.static_bool(clean_logits, "clean_logits")
    (out,) = PAGED_SPARSE_MQA_LOGITS(qv, q_sf, kv_cache, weights, metadata, target=t,
                                     num_max_sparse_blocks=nmsb, sparse_block_kv=sbk,
                                     clean_logits=clean_logits)
    return out
