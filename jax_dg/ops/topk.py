"""The indexer's selection: per-row top-k of logits, and the whole indexer step.

- `topk_indices(logits, k)`: the columns of each row's k largest logits, by jax_dg's own kernel
  (a native FFI handler: kernels/topk.cu on CUDA, a radix select over keys held in registers,
  a row split over a cluster of CTAs when long, then a sort of the k survivors; its C++ twin
  on CPU), exact and deterministic: the same indices in the same order
  as `lax.top_k` documents (value descending, lower index first on ties; XLA's own GPU top-k
  keeps that tie order only for short rows: it splits rows of 32k keys and more).
  `sorted=False` gives the same set in column order without the sort. -inf, NaN and columns
  outside an optional [ks, ke) range are not candidates; slots past a row's candidates are -1.
- `indexer_topk(q, kv, weights, ks, ke, k)`: DeepGEMM's MQA logits call, then that kernel,
  composed in XLA (core.op.composed): the logits land in a scratch result that only the
  selection reads (it never becomes a JAX array); the selection ignores positions outside
  [ks, ke) itself, so no -inf fill runs. `paged_indexer_topk` is the same for the paged decode
  step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg.core import device, native, values
from jax_dg.core.checks import Checker
from jax_dg.core.op import REQUIRED, Op, bcast, composed, exposes, fold_rows
from jax_dg.core.sharding import Layout, Sharding
from jax_dg.ops import mqa, paged_mqa
from jax_dg.reference import mqa as ref_mqa
from jax_dg.reference import paged_mqa as ref_paged
from jax_dg.reference import topk as ref

__all__ = ["indexer_topk", "paged_indexer_topk", "topk_indices"]

F32 = jnp.float32
I32 = jnp.int32
MAX_K = 4096       # kernels/topk.cu sorts the survivors in shared memory


def _check_sorted(ck: Checker, sorted) -> bool:
    return ck.static_bool(sorted, "sorted")


def _check_k(ck: Checker, k) -> int:
    k = ck.static_int(k, "k", minimum=1)
    ck.that(k <= MAX_K, "k", f"must be <= {MAX_K}", k)
    return k


# --- topk over a logits array -----------------------------------------------------------------

def _topk_shapes(logits, lo, hi, *, k):
    ck = Checker("topk_indices")
    ck.ndim(logits, "logits", 2, "[M, N]")
    ck.dtype(logits, "logits", F32)
    m = logits.shape[0]
    for x, name in ((lo, "ks"), (hi, "ke")):
        if x is not None:
            ck.tensor(x, name, [I32], (m,), "[M]")
    return [jax.ShapeDtypeStruct((m, k), I32)]


def _topk_native(logits, lo, hi, *, k, sorted):
    return native.topk(logits, lo, hi, k=k, cols=logits.shape[1], sorted=sorted, rows=logits.shape[0])


def _topk_reference(logits, lo, hi, *, k, sorted):
    return ref.topk_rows(logits, lo, hi, rows=logits.shape[0], cols=logits.shape[1], k=k, sorted=sorted)


def _topk_batch(size, batched, inputs, *, k, sorted):
    """vmap: batches of rows fold into the rows (one kernel)."""
    x = bcast(inputs["logits"], batched["logits"], size)
    lo, hi = (None if inputs.get(n) is None else bcast(inputs[n], batched[n], size).reshape(-1)
              for n in ("lo", "hi"))
    (idx,) = TOPK(fold_rows(x), lo, hi, k=k, sorted=sorted)
    return (idx.reshape(size, -1, k),)


TOPK = Op(
    name="topk_rows",
    args=("logits", "lo", "hi"),
    statics={"k": REQUIRED, "sorted": REQUIRED},
    shapes=_topk_shapes,
    native=_topk_native,
    reference=_topk_reference,
    own_kernels=("topk",),
    batch=_topk_batch,
    # rows split with no collective; a row's columns are never split
    sharding=Sharding(lambda names, **static: Layout({"logits": "m n", "lo": "m", "hi": "m"}, ["m k"]),
                      free=frozenset({"m"})),
)


@exposes(TOPK)
def topk_indices(logits: jax.Array, k: int, *, offsets: jax.Array | None = None,
                 ks: jax.Array | None = None, ke: jax.Array | None = None,
                 sorted: bool = True) -> jax.Array:
    """int32 [M, k]: the columns of the k largest logits of each row of float32 [M, N]
    (bfloat16 logits are widened to float32 first, exactly: the selection is the same; the
    kernel reads float32, so that costs one conversion pass).

    Exactly lax.top_k's indices and order (value descending, the lower column first among
    equal values), except that -inf, NaN and columns outside [ks[i], ke[i]) (when given, int32
    [M]) are never selected: their slots, after a row's candidates, are -1.
    ks, ke outside [0, N] select as if clamped to it (the kernel clamps them; no column
       outside the row is read); under `jax_dg.checked()` ks < 0 or ke > N raises instead.
    offsets: int32 [M] added to every selected column (the compressed logits form: column t
       is key ks + t, so offsets=ks gives key positions); -1 stays -1. Never used as an
       address (int32 arithmetic, wrapping).
    k: static, 1 <= k <= 4096 (k > N leaves at least k - N slots -1).
    sorted: False returns the same set in column order (ascending; -1 slots last) and skips
       the sort: what a sparse attention over the selected keys needs, and faster.
    """
    ck = Checker("topk_indices")
    ck.array(logits, "logits")
    if logits.dtype == jnp.bfloat16:
        logits = logits.astype(F32)
    k = _check_k(ck, k)
    for x, name in ((ks, "ks"), (ke, "ke"), (offsets, "offsets")):
        if x is not None:
            ck.array(x, name)
    if offsets is not None:
        ck.tensor(offsets, "offsets", [I32], (logits.shape[0],) if logits.ndim == 2 else (), "[M]")
    sorted = _check_sorted(ck, sorted)
    # The kernel clamps [ks, ke) to [0, N) itself (kernels/topk.cu): checked mode only.
    if ks is not None:
        ks = values.require("topk_indices", "ks", ks >= 0, "must be >= 0 (a column)", ks)
    if ke is not None:
        n = logits.shape[1]
        ke = values.require("topk_indices", "ke", ke <= n, f"must be <= N = {n} (columns)", ke)
    call = TOPK.bind(logits, ks, ke, k=k, sorted=sorted)
    if 0 in logits.shape:
        idx = jnp.full((logits.shape[0], k), -1, I32)
    else:
        (idx,) = call()
    return idx if offsets is None else _offset(idx, offsets)


def _offset(idx, offsets):
    """Selected columns plus a per-row offset (compressed logits: key = ks + column); -1 stays."""
    return jnp.where(idx >= 0, idx + offsets[:, None], -1)


# --- the indexer step: MQA logits and top-k, composed ---------------------------------------
#
# DeepGEMM's logits call (the logits op's record: shapes, plan and run) lands the logits in a
# scratch result that never becomes an array; jax_dg's top-k kernel reads it in place (a
# native call composed in XLA, in the op's finish). The selection ignores positions outside
# [ks, ke) itself, so no -inf fill runs.

LOGITS = mqa.FP8_MQA_LOGITS


def _logits_static(*, k, sorted, max_seqlen_k, **plan) -> dict:
    """The logits op's statics for the indexer's scratch: float32, left uncleaned."""
    return dict(max_seqlen_k=max_seqlen_k, clean_logits=False, logits_dtype="float32", **plan)


def _indexer_finish(outs, inputs, *, k, sorted, kernel_width):
    """Top-k over the scratch as the kernel wrote it: the full form (kernel_width 0), or the
    compressed one (asked for, or DeepGEMM 2.8's only form), whose column t is key ks + t."""
    (scratch,) = outs
    ks, ke, n = inputs["cu_seqlen_ks"], inputs["cu_seqlen_ke"], inputs["kv"].shape[0]
    m = inputs["q"].shape[0]
    if not kernel_width:
        return (native.topk(scratch, ks, ke, k=k, cols=n, sorted=sorted, rows=m),)
    # compressed: column t is key ks + t, written for t < lens
    idx = native.topk(scratch, None, mqa.compressed_lens(ks, ke, n), k=k, cols=kernel_width,
                      sorted=sorted, rows=m)
    return (_offset(idx, ks),)


def _indexer_reference(q, kv, kv_sf, weights, ks, ke, *, k, sorted, max_seqlen_k):
    logits = ref_mqa.mqa_logits(q, kv, kv_sf, weights, ks, ke, max_seqlen_k=max_seqlen_k)
    idx = ref.topk_rows(logits, None, None, rows=logits.shape[0], cols=logits.shape[1], k=k,
                        sorted=sorted)
    return (_offset(idx, ks) if max_seqlen_k else idx,)


def _indexer_batch(size, batched, inputs, *, k, sorted, max_seqlen_k):
    if batched["kv"] or batched["kv_sf"]:
        return None
    q, w, ks, ke = (bcast(inputs[n], batched[n], size)
                    for n in ("q", "weights", "cu_seqlen_ks", "cu_seqlen_ke"))
    (idx,) = INDEXER_TOPK(fold_rows(q), inputs["kv"], inputs["kv_sf"], fold_rows(w), ks.reshape(-1),
                          ke.reshape(-1), k=k, sorted=sorted, max_seqlen_k=max_seqlen_k)
    return (idx.reshape(size, -1, k),)


INDEXER_TOPK = composed(
    LOGITS,
    name="indexer_topk",
    statics={"k": REQUIRED, "sorted": REQUIRED, "max_seqlen_k": REQUIRED},
    base_static=_logits_static,
    reference=_indexer_reference,
    own_kernels=("topk",),
    batch=_indexer_batch,
    finish=_indexer_finish,
    sharding=mqa.query_sharding(lambda static: "m k"),
)


@exposes(INDEXER_TOPK)
def indexer_topk(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, k: int, *,
                 max_seqlen_k: int | None = None, sorted: bool = True) -> jax.Array:
    """The lightning indexer's step: int32 [M, k] key positions of each query's k best keys.

    Equal to topk_indices(mqa_logits(q, kv, weights, ks, ke, max_seqlen_k=...), k) (with
    offsets=ks in the compressed form), computed without handing the logits back: DeepGEMM
    writes them into a scratch buffer that only the selection reads. Arguments as for
    `mqa_logits`; k static, 1 <= k <= 4096. Slots past a row's valid keys are -1. The scratch
    logits are float32 (the selection kernel's input; there is no logits_dtype here).
    sorted=False: the same set in ascending key order, without the sort (see topk_indices).
    """
    q, kv, kv_sf, weights, cu_seqlen_ks, cu_seqlen_ke, width = mqa.mqa_arguments(
        "indexer_topk", q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)
    ck = Checker("indexer_topk")
    k = _check_k(ck, k)
    call = INDEXER_TOPK.bind(q, kv, kv_sf, weights, cu_seqlen_ks, cu_seqlen_ke, k=k,
                             sorted=_check_sorted(ck, sorted), max_seqlen_k=width)
    if 0 in q.shape[:1] or kv.shape[0] == 0:
        return jnp.full((q.shape[0], k), -1, I32)
    (idx,) = call()
    return idx


# --- the paged decode step: paged logits and top-k, composed ----------------------------------

PAGED_LOGITS = paged_mqa.PAGED_MQA_LOGITS


def _paged_static(*, k, sorted, max_model_len, slots, **plan) -> dict:
    """The paged logits op's statics for the decode step's scratch: float32, uncleaned."""
    return dict(max_model_len=max_model_len, clean_logits=False, slots=slots,
                logits_dtype="float32", **plan)


def _paged_finish(outs, inputs, *, k, sorted, max_model_len):
    lens = inputs["context_lens"].reshape(-1)
    return (native.topk(outs[0], None, lens, k=k, cols=max_model_len, sorted=sorted,
                        rows=lens.shape[0]),)


def _paged_reference(q, q_sf, kv_cache, weights, context_lens, block_tables, schedule_metadata,
                     indices, *, k, sorted, max_model_len):
    logits = ref_paged.paged_mqa_logits(q, q_sf, kv_cache, weights, context_lens, block_tables,
                                        max_model_len=max_model_len)
    return ref.topk_rows(logits, None, context_lens.reshape(-1), rows=logits.shape[0],
                         cols=max_model_len, k=k, sorted=sorted)


def _paged_batch(size, batched, inputs, *, k, sorted, max_model_len, slots):
    if batched["kv_cache"] or any(inputs.get(n) is not None for n in ("q_sf", "indices", "schedule_metadata")):
        return None
    q, w, lens, table = (bcast(inputs[n], batched[n], size)
                         for n in ("q", "weights", "context_lens", "block_tables"))
    (idx,) = PAGED_INDEXER_TOPK(fold_rows(q), None, inputs["kv_cache"], fold_rows(w), fold_rows(lens),
                                fold_rows(table), None, None, k=k, sorted=sorted,
                                max_model_len=max_model_len, slots=slots)
    return (idx.reshape(size, -1, k),)


PAGED_INDEXER_TOPK = composed(
    PAGED_LOGITS,
    name="paged_indexer_topk",
    statics={"k": REQUIRED, "sorted": REQUIRED, "max_model_len": REQUIRED, "slots": REQUIRED},
    base_static=_paged_static,
    reference=_paged_reference,
    own_kernels=("topk",),
    batch=_paged_batch,
    finish=_paged_finish,
    sharding=paged_mqa.request_sharding("bj k"),
)


@exposes(PAGED_INDEXER_TOPK, paged_mqa.PAGED_SANITISE)
def paged_indexer_topk(q, kv_cache, weights, context_lens, block_tables, k: int, *,
                       max_model_len=None, schedule_metadata=None, indices=None,
                       sorted: bool = True) -> jax.Array:
    """The indexer's decode step: int32 [B * next_n, k] token positions of each query row's k
    best cached tokens (-1 past a row's length), without handing the logits back.

    Equal to topk_indices(paged_mqa_logits(...), k); arguments as for `paged_mqa_logits` (q:
    the FP8 values or a (values, scales) pair).
    """
    q = tuple(q) if isinstance(q, (tuple, list)) else (q, None)
    t = device.target()
    arrays, static = paged_mqa.paged_arguments("paged_indexer_topk", t, q, kv_cache, weights,
                                               context_lens, block_tables, schedule_metadata,
                                               max_model_len, indices)
    ck = Checker("paged_indexer_topk")
    k = _check_k(ck, k)
    (idx,) = PAGED_INDEXER_TOPK(*arrays, target=t, k=k, sorted=_check_sorted(ck, sorted), **static)
    return idx
