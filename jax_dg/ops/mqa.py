"""MQA logits without paging (DeepSeek V3.2's lightning indexer) and its sparse SM100 variant.

    logits[i, n] = sum_h weights[i, h] * relu(q[i, h] . kv[n]) * kv_scale[n],   n in [ks[i], ke[i])

DeepGEMM (2.5.0, SM90) allocates the logits itself, a buffer with padded rows and columns. The
custom call's result is declared with that layout and DeepGEMM's allocation lands in it
(jax_dg.runtime.landing: no copy, nothing torch keeps, so the call can be captured into a CUDA
graph). With clean_logits the op's
finish then runs jax_dg's own kernel, a native call after DeepGEMM's in XLA, in place: -inf at
the invalid positions of the logical [M, N] block and only there (kernels/neg_inf.cu), so every
element the op returns is defined; the finish slices that block out, a slice XLA fuses into
whatever reads the logits (a returned array costs that one copy; `indexer_topk` reads the
padded buffer itself).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dg import contracts
from jax_dg.contracts import SPARSE_BLOCKS, SPARSE_SPLIT_KV
from jax_dg.core.checks import Checker
from jax_dg.core import device, native, values
from jax_dg.core.op import REQUIRED, Op, bcast, exposes, fold_rows, shaped
from jax_dg.core.sharding import Layout, Sharding
from jax_dg.operands.indexer import fold_q_scale
from jax_dg.reference import mqa as ref

__all__ = ["fp8_fp4_mqa_logits", "fp8_fp4_sparse_mqa_logits", "get_sparse_mqa_logits_metadata",
           "mqa_logits"]

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32
I32 = jnp.int32
HEAD_DIMS = (32, 64, 128)
NEG_INF = float("-inf")


# --- fp8_fp4_mqa_logits -------------------------------------------------------------------------

def logits_buffer(t: device.Target, rows: int, stride: int,
                  logits_dtype: str = "float32") -> jax.ShapeDtypeStruct:
    """The custom-call result a padded [rows, stride] logits allocation lands in on target `t`
    (jax_dg.runtime.landing): more rows where torch's CUDA allocator rounds the allocation up."""
    segmented = t.platform == "cuda"
    itemsize = contracts.LOGITS_ITEMSIZE[logits_dtype]
    return jax.ShapeDtypeStruct((contracts.landing_rows(rows, stride, itemsize, segmented), stride),
                                logits_dtype)


def check_logits_dtype(ck: Checker, logits_dtype) -> str:
    """logits_dtype as its jnp name: float32 or bfloat16 (DeepGEMM's two logits types)."""
    name = ck.dtype_name(logits_dtype, "logits_dtype")
    ck.that(name in contracts.LOGITS_DTYPES, "logits_dtype", "must be float32 or bfloat16", name)
    return name


def _mqa_logits_shapes(q, kv, kv_sf, weights, ks, ke, *, target, max_seqlen_k, logits_dtype):
    ck = Checker("mqa_logits")
    ck.ndim(q, "q[0]", 3, "[M, H, D]")
    ck.dtype(q, "q[0]", FP8)
    m, h, d = q.shape
    api = target.api
    heads = api.sm90_mqa_heads
    ck.that(h in heads, "q[0]", f"must have H (heads) in {heads} (the SM90 kernel of DeepGEMM "
            f"{api.release}; 2.5.0's also ran 16; pad the heads with zero weights otherwise)", h)
    ck.that(d in HEAD_DIMS, "q[0]", f"must have D (head dim) in {HEAD_DIMS}", d)
    ck.ndim(kv, "kv[0]", 2, "[N, D]")
    ck.dtype(kv, "kv[0]", FP8)
    n = kv.shape[0]
    ck.that(kv.shape[1] == d, "kv[0]", f"must be [N, D] with q's D = {d}", tuple(kv.shape))
    ck.tensor(kv_sf, "kv[1]", [F32], (n,), "[N] (one scale per key row)")
    ck.tensor(weights, "weights", [F32], (m, h), "[M, H]")
    ck.tensor(ks, "cu_seqlen_ks", [I32], (m,), "[M]")
    ck.tensor(ke, "cu_seqlen_ke", [I32], (m,), "[M]")
    # What the kernel is asked for: the form and type asked, where the target's DeepGEMM has
    # them; else (2.8) the compressed form N wide and float32, which the finish turns into what
    # was asked (kernel_width 0: the full form written)
    kernel_width = max_seqlen_k or (0 if api.mqa_full_form else n)
    kernel_dtype = logits_dtype if logits_dtype in api.logits_dtypes(FP8_MQA_LOGITS.name) else "float32"
    # the layout of the target's DeepGEMM (the references keep 2.5's); the plan: whether
    # DeepGEMM's allocation lands in the result (contracts.lands)
    rows, stride = contracts.mqa_logits_layout(
        m, h, n, kernel_width, contracts.logits_stride_align(target.version, kernel_dtype))
    return shaped([logits_buffer(target, rows, stride, kernel_dtype)],
                  lands=contracts.lands(rows, target.platform == "cuda"),
                  kernel_width=kernel_width, kernel_dtype=kernel_dtype)


def _mqa_logits_run(rt, q, kv, kv_sf, weights, ks, ke, out, *, lands, kernel_width, kernel_dtype):
    # DeepGEMM writes its own allocation: land it in `out`. Keywords from the 6th argument on:
    # DeepGEMM >= 2.8 takes max_seqlen_k 6th, 2.5 takes clean_logits there (a positional int
    # would turn into clean_logits=True); >= 2.8 has no clean_logits at all (backends.deep_gemm
    # drops it by signature). DeepGEMM's own cleaning is never asked for: it has none for the
    # compressed form, and jax_dg's -inf kernel (the op's finish) writes the same positions in
    # every version.
    rt.land(out, lambda: rt.dg.fp8_fp4_mqa_logits(
        (q, None), (kv, kv_sf), weights, ks, ke, clean_logits=False, max_seqlen_k=kernel_width,
        logits_dtype=rt.dtype(kernel_dtype)), lands)


def compressed_lens(ks, ke, num_keys: int):
    """Columns DeepGEMM writes per row in the compressed form: min(ke, N) - ks (ke already cut
    to ks + width by mqa_arguments)."""
    return jnp.minimum(ke, num_keys) - ks


def _mqa_logits_finish(outs, inputs, *, max_seqlen_k, clean_logits, logits_dtype, kernel_width,
                       kernel_dtype):
    """The [M, width] block of the padded buffer; with clean_logits, -inf written first (in
    place, jax_dg's own kernel) outside [ks, ke), or past column ke - ks in the compressed form.
    Where the target's DeepGEMM has no full form (2.8) the full [M, N] block is gathered from
    the compressed one the kernel wrote (column j of row i: column j - ks there; -inf outside
    [ks, ke), which clean_logits=False leaves unspecified anyway), and bfloat16 logits it cannot
    write are rounded from its float32 ones: one pass each, fused by XLA with the slice."""
    (buf,) = outs
    ks, ke = inputs["cu_seqlen_ks"], inputs["cu_seqlen_ke"]
    m, n = inputs["q"].shape[0], inputs["kv"].shape[0]
    if max_seqlen_k or not kernel_width:
        cols = max_seqlen_k or n
        if clean_logits:
            buf = native.neg_inf_outside(buf, ks, ke, cols=cols, relative=bool(max_seqlen_k))
        out = buf[:m, :cols]
    else:   # the full form from the compressed one, n wide
        key = jnp.arange(n, dtype=I32)[None, :]
        col = jnp.clip(key - ks[:, None], 0, n - 1)
        valid = (key >= ks[:, None]) & (key < ke[:, None])
        out = jnp.where(valid, jnp.take_along_axis(buf[:m, :n], col, axis=1), NEG_INF)
    return (out.astype(logits_dtype) if logits_dtype != kernel_dtype else out,)


def _mqa_logits_reference(q, kv, kv_sf, weights, ks, ke, *, max_seqlen_k, logits_dtype):
    # bfloat16 logits: DeepGEMM rounds its float32 sums once, on the store
    return ref.mqa_logits(q, kv, kv_sf, weights, ks, ke, max_seqlen_k=max_seqlen_k).astype(logits_dtype)


def _mqa_logits_batch(size, batched, inputs, *, max_seqlen_k, clean_logits, logits_dtype):
    """vmap over batches of queries with shared keys: the batch folds into M (one kernel over
    B * M query rows); keys batched too: sequential."""
    if batched["kv"] or batched["kv_sf"]:
        return None
    q, w, ks, ke = (bcast(inputs[n], batched[n], size) for n in ("q", "weights", "cu_seqlen_ks", "cu_seqlen_ke"))
    m = q.shape[1]
    (out,) = FP8_MQA_LOGITS(fold_rows(q), inputs["kv"], inputs["kv_sf"], fold_rows(w),
                            ks.reshape(-1), ke.reshape(-1), max_seqlen_k=max_seqlen_k,
                            clean_logits=clean_logits, logits_dtype=logits_dtype)
    return (out.reshape(size, m, -1),)


def query_sharding(out) -> Sharding:
    """Queries (M) split with no collective; the keys are every shard's. out(static): the
    factors of the one output, rows first ("m ...")."""
    return Sharding(lambda names, **static: Layout(
        {"q": "m h d", "kv": "n d", "kv_sf": "n", "weights": "m h", "cu_seqlen_ks": "m",
         "cu_seqlen_ke": "m", "lens": "m"}, [out(static)]), free=frozenset({"m"}))


FP8_MQA_LOGITS = Op(
    name="fp8_fp4_mqa_logits",
    args=("q", "kv", "kv_sf", "weights", "cu_seqlen_ks", "cu_seqlen_ke"),
    statics={"max_seqlen_k": REQUIRED, "clean_logits": REQUIRED, "logits_dtype": "float32"},
    shapes=_mqa_logits_shapes,
    run=_mqa_logits_run,
    reference=_mqa_logits_reference,
    symbols=("fp8_fp4_mqa_logits",),
    own_kernels=("neg_inf_outside",),
    graph_safe=frozenset({"sm90"}),   # its one allocation lands in XLA's buffer
    batch=_mqa_logits_batch,
    finish=_mqa_logits_finish,
    sharding=query_sharding(lambda static: "m w" if static["max_seqlen_k"] else "m n"),
)


def _q_values_and_weights(ck: Checker, q, weights):
    """q as (values, scale | None) or bare values; a float32 q scale is folded into weights."""
    if isinstance(q, (tuple, list)):
        qv, qs = ck.pair(q, "q", second_optional=True)
    else:
        qv, qs = q, None
    ck.array(qv, "q[0]")
    ck.array(weights, "weights")
    if qs is None:
        return qv, weights
    ck.array(qs, "q[1]")
    m, h = (tuple(qv.shape) + (0, 0))[:2]
    ck.that(jnp.dtype(qs.dtype) == F32, "q[1]", "must be float32 (a positive per-token or "
            "per-(token, head) scale, folded into weights: SM90's kernel takes no q scale; "
            "packed int32 UE8M0 MX scales are SM100's format)", jnp.dtype(qs.dtype).name)
    ck.that(tuple(qs.shape) in ((m, h), (m, 1), (m,)), "q[1]",
            f"must have shape [M, H] = {(m, h)}, [M, 1] or [M]", tuple(qs.shape))
    ck.tensor(weights, "weights", [F32], (m, h), "[M, H]")
    return qv, fold_q_scale(weights, qs)


@exposes(FP8_MQA_LOGITS)
def mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, *, max_seqlen_k: int | None = None,
               clean_logits: bool = True, logits_dtype=jnp.float32) -> jax.Array:
    """The lightning indexer's scores (DeepGEMM fp8_fp4_mqa_logits), usable inside jax.jit.

        logits[i, n] = sum_h weights[i, h] * relu(q[i, h, :] . kv[n, :] * kv_scale[n])

    q: (values float8_e4m3fn [M, H, D], scale or None), or the bare values. H in {16, 32, 64}
       (upstream DeepGEMM: 32, 64), D in {32, 64, 128}. A float32 scale ([M, H], [M, 1] or [M],
       positive) is folded into `weights` here, since SM90's kernel takes none.
    kv: (values float8_e4m3fn [N, D], scale float32 [N]) -- see `jax_dg.per_row_cast_to_fp8`.
    weights: float32 [M, H].
    cu_seqlen_ks, cu_seqlen_ke: int32 [M]; row i scores keys n in [ks[i], ke[i]) (empty if
       ke[i] <= ks[i]); see `jax_dg.causal_ks_ke` / `varlen_causal_ks_ke`. Out-of-range values
       are clamped in the jitted program before DeepGEMM reads them (it does not check them):
       the row's range is [clip(ks, 0, N), clip(ke, that, N)), so keys outside [0, N) are
       never read and in the compressed form column t is key clip(ks, 0, N) + t. Under
       `jax_dg.checked()` ks < 0 or ke > N raises instead, naming the argument.
    max_seqlen_k: None -> the full float32 [M, N] form. A static int > 0 -> the compressed
       [M, max_seqlen_k] form: column t holds key ks[i] + t for t < ke[i] - ks[i]. It should be
       >= max(ke - ks); longer rows keep their first max_seqlen_k keys.
    clean_logits: True (default): every position outside a row's valid range is -inf. False:
       those positions are unspecified (DeepGEMM leaves real scores, stale memory or anything
       in them, NaN included) and only the valid ones may be read; it saves jax_dg's -inf
       kernel. Valid positions are identical either way.
    logits_dtype: float32 (default) or bfloat16: DeepGEMM rounds each float32 sum to bfloat16
       as it stores it (half the output bytes; -inf stays -inf). Static.
    """
    q, kv, kv_sf, weights, cu_seqlen_ks, cu_seqlen_ke, width = mqa_arguments(
        "mqa_logits", q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)
    ck = Checker("mqa_logits")
    dtype = check_logits_dtype(ck, logits_dtype)
    call = FP8_MQA_LOGITS.bind(q, kv, kv_sf, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k=width,
                               logits_dtype=dtype, clean_logits=ck.static_bool(clean_logits, "clean_logits"))
    shape = (q.shape[0], width or kv.shape[0])
    if 0 in shape or kv.shape[0] == 0:  # nothing to score: every position is invalid
        return jnp.full(shape, NEG_INF, dtype)
    (logits,) = call()
    return logits


def mqa_arguments(name: str, q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k):
    """The logits op's arrays (q values, kv values, kv scale, weights, ks, ke) and its static
    width from the public arguments, checked: q's scale folded into the weights, the key
    ranges brought into [0, N] and, with a width, ke cut to ks + width (jax_dg.core.values:
    DeepGEMM checks neither)."""
    ck = Checker(name)
    q, weights = _q_values_and_weights(ck, q, weights)
    kv, kv_sf = ck.pair(kv, "kv")
    for x, arg in ((kv, "kv[0]"), (kv_sf, "kv[1]"), (cu_seqlen_ks, "cu_seqlen_ks"),
                   (cu_seqlen_ke, "cu_seqlen_ke")):
        ck.array(x, arg)
    width = 0 if max_seqlen_k is None else ck.static_int(max_seqlen_k, "max_seqlen_k", minimum=1)
    ck.dtype(cu_seqlen_ks, "cu_seqlen_ks", I32)
    ck.dtype(cu_seqlen_ke, "cu_seqlen_ke", I32)
    if cu_seqlen_ks.shape == cu_seqlen_ke.shape and cu_seqlen_ks.ndim == 1 and kv.ndim == 2:
        # (else the shape rule names what is wrong)
        cu_seqlen_ks, cu_seqlen_ke = values.key_ranges(name, cu_seqlen_ks, cu_seqlen_ke,
                                                       kv.shape[0], width)
    return q, kv, kv_sf, weights, cu_seqlen_ks, cu_seqlen_ke, width


@exposes(FP8_MQA_LOGITS)
def fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k, *,
                       clean_logits: bool = True, logits_dtype=jnp.float32) -> jax.Array:
    """vLLM's wrapper's name and call shape (`fp8_fp4_mqa_logits`): `mqa_logits` with
    `max_seqlen_k` given positionally (None for the full [M, N] form). Unlike DeepGEMM's, the
    compressed tail is -inf unless clean_logits=False."""
    return mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k=max_seqlen_k,
                      clean_logits=clean_logits, logits_dtype=logits_dtype)


# --- sparse (DeepGEMM >= 2.8, SM100 only) ---------------------------------------------------------
#
# The metadata buffer jax_dg hands around is described in jax_dg.contracts (non-paged form:
# header [ks | ke | block indices], then DeepGEMM's opaque schedule on SM100, or the same three
# vectors again from the references). The header lets every backend produce fully defined
# output: invalid columns are set to -inf from it.


def _check_sparse_block_kv(ck: Checker, sbk) -> int:
    sbk = ck.static_int(sbk, "sparse_block_kv")
    ck.that(sbk in SPARSE_BLOCKS, "sparse_block_kv", f"must be one of {SPARSE_BLOCKS}", sbk)
    return sbk


def qk_dtype_name(ck: Checker, qk_dtype) -> str:
    """The packed Q/K format of the sparse kernels: float8_e4m3fn (MXFP8) or int8 (MXFP4)."""
    try:
        name = jnp.dtype(qk_dtype).name
    except TypeError:
        name = str(qk_dtype).replace("torch.", "")
    ck.that(name in SPARSE_SPLIT_KV, "qk_dtype", "must be float8_e4m3fn (MXFP8) or int8 (packed MXFP4)", name)
    return name


def _sparse_meta_shapes(ks, ke, indices, *, qk_dtype, sparse_block_kv, num_sms):
    ck = Checker("get_sparse_mqa_logits_metadata")
    ck.ndim(ks, "cu_seqlen_ks", 1, "[M]")
    ck.dtype(ks, "cu_seqlen_ks", I32)
    m = ks.shape[0]
    ck.that(m <= 1 << 20, "cu_seqlen_ks", "must have M <= 2**20 rows", m)
    ck.tensor(ke, "cu_seqlen_ke", [I32], (m,), "[M]")
    ck.ndim(indices, "sparse_kv_block_indices", 2, "[M, num_max_sparse_blocks]")
    ck.dtype(indices, "sparse_kv_block_indices", I32)
    ck.that(indices.shape[0] == m, "sparse_kv_block_indices", f"must have M = {m} rows",
            tuple(indices.shape))
    nmsb = indices.shape[1]
    ck.that(nmsb > 0 and nmsb % 4 == 0 and nmsb <= 4096, "sparse_kv_block_indices",
            "must have num_max_sparse_blocks columns, a multiple of 4 in [4, 4096]", nmsb)
    size = contracts.sparse_metadata_bytes(m, nmsb, sparse_block_kv, qk_dtype, num_sms, paged=False)
    return [jax.ShapeDtypeStruct((size,), jnp.uint8)]


def _sparse_meta_run(rt, ks, ke, indices, out, *, num_kv_tokens, qk_dtype, sparse_block_kv):
    m, nmsb = indices.shape
    meta = rt.dg.get_sparse_mqa_logits_metadata(ks, ke, num_kv_tokens, indices, rt.dtype(qk_dtype),
                                                sparse_block_kv, use_unaligned_ks=True)
    rt.write_sparse_metadata(out, (ks, ke, indices), meta, m, nmsb, paged=False,
                             what="get_sparse_mqa_logits_metadata")


def _sparse_meta_reference(ks, ke, indices, *, qk_dtype, sparse_block_kv, num_sms):
    m, nmsb = indices.shape
    size = contracts.sparse_metadata_bytes(m, nmsb, sparse_block_kv, qk_dtype, num_sms, paged=False)
    # The backend's part: the same three vectors (as the torch emulation writes them).
    again = jnp.concatenate([ks, ke, indices.reshape(-1)])
    return ref.pack_sparse_header([ks, ke, indices], m, nmsb, paged=False, backend_part=again,
                                  size=size)


GET_SPARSE_MQA_LOGITS_METADATA = Op(
    name="get_sparse_mqa_logits_metadata",
    args=("cu_seqlen_ks", "cu_seqlen_ke", "sparse_kv_block_indices"),
    statics={"num_kv_tokens": REQUIRED, "qk_dtype": REQUIRED, "sparse_block_kv": REQUIRED,
             "num_sms": REQUIRED},
    shapes=_sparse_meta_shapes,
    run=_sparse_meta_run,
    reference=_sparse_meta_reference,
    symbols=("get_sparse_mqa_logits_metadata",),
    archs=frozenset({"sm100"}),
)


@exposes(GET_SPARSE_MQA_LOGITS_METADATA)
def get_sparse_mqa_logits_metadata(cu_seqlen_ks, cu_seqlen_ke, num_kv_tokens: int,
                                   sparse_kv_block_indices, qk_dtype, sparse_block_kv: int, *,
                                   num_sms: int | None = None) -> jax.Array:
    """Metadata for `fp8_fp4_sparse_mqa_logits` (uint8, 1-D; opaque), the call shape of vLLM's wrapper.

    cu_seqlen_ks, cu_seqlen_ke: int32 [M], each row's key range in the packed K.
    num_kv_tokens: static int, N (keys in the packed K).
    sparse_kv_block_indices: int32 [M, num_max_sparse_blocks] (a multiple of 4, <= 4096). Row i
       starts with its min(ceil((ke-ks)/sbk), nmsb) candidate blocks, ascending; block b covers
       keys [b*sbk + ks % sbk, +sbk) (the unaligned-ks convention, always on); the rest of the
       row is padding (repeat the last block).
    qk_dtype: jnp.float8_e4m3fn (MXFP8) or jnp.int8 (packed MXFP4): the format of q and k.
    sparse_block_kv: static int, 8 or 16.
    num_sms: SMs of the device the logits call runs on (sizes DeepGEMM's schedule); default:
       the first JAX device's.
    DeepGEMM has this kernel on SM100 only (>= 2.8); elsewhere use JAX_DG_BACKEND=torch or xla.
    """
    ck = Checker("get_sparse_mqa_logits_metadata")
    for x, name in ((cu_seqlen_ks, "cu_seqlen_ks"), (cu_seqlen_ke, "cu_seqlen_ke"),
                    (sparse_kv_block_indices, "sparse_kv_block_indices")):
        ck.array(x, name)
    t = device.target()
    static = dict(
        num_kv_tokens=ck.static_int(num_kv_tokens, "num_kv_tokens", minimum=0),
        qk_dtype=qk_dtype_name(ck, qk_dtype),
        sparse_block_kv=_check_sparse_block_kv(ck, sparse_block_kv),
        num_sms=ck.static_int(t.num_sms if num_sms is None else num_sms, "num_sms", minimum=1),
    )
    (meta,) = GET_SPARSE_MQA_LOGITS_METADATA(cu_seqlen_ks, cu_seqlen_ke, sparse_kv_block_indices,
                                             target=t, **static)
    return meta


def _sparse_shapes(q, q_sf, kv, kv_sf, weights, metadata, *, num_max_sparse_blocks, sparse_block_kv):
    ck = Checker("fp8_fp4_sparse_mqa_logits")
    ck.ndim(q, "q[0]", 3, "[M, H, D] (D/2 bytes for packed FP4)")
    ck.dtype(q, "q[0]", FP8, jnp.int8)
    m, h, dq = q.shape
    fp4 = jnp.dtype(q.dtype) == jnp.int8
    ck.that(dq == (64 if fp4 else 128), "q[0]",
            "must have D = 128 (64 bytes of packed FP4 pairs when int8)", dq)
    ck.that(0 < h <= 32 and h % 4 == 0, "q[0]", "must have H <= 32 heads, a multiple of 4", h)
    ck.tensor(q_sf, "q[1]", [I32], (m, h), "[M, H] (packed UE8M0, mandatory)")
    ck.ndim(kv, "kv[0]", 2, "[N, D]")
    ck.dtype(kv, "kv[0]", q.dtype)
    ck.that(kv.shape[1] == dq, "kv[0]", f"must be [N, {dq}] like q", tuple(kv.shape))
    ck.tensor(kv_sf, "kv[1]", [I32], (kv.shape[0],), "[N] (packed UE8M0)")
    ck.tensor(weights, "weights", [jnp.bfloat16], (m, h), "[M, H] (bfloat16; q's scale not folded)")
    ck.ndim(metadata, "metadata", 1, "uint8 [bytes] from get_sparse_mqa_logits_metadata")
    ck.dtype(metadata, "metadata", jnp.uint8)
    nmsb, sbk = num_max_sparse_blocks, sparse_block_kv
    ck.that(metadata.shape[0] > contracts.sparse_header_bytes(m, nmsb, paged=False), "metadata",
            f"must come from get_sparse_mqa_logits_metadata with M = {m} rows and "
            f"num_max_sparse_blocks = {nmsb}", tuple(metadata.shape))
    return [jax.ShapeDtypeStruct((m, nmsb * sbk), jnp.bfloat16)]


def _sparse_run(rt, q, q_sf, kv, kv_sf, weights, metadata, out, *, num_max_sparse_blocks,
                sparse_block_kv, clean_logits):
    m, nmsb, sbk = q.shape[0], num_max_sparse_blocks, sparse_block_kv
    logits = rt.dg.fp8_fp4_sparse_mqa_logits((q, q_sf), (kv, kv_sf), rt.row_aligned(weights, 8),
                                             rt.sparse_payload(metadata, m, nmsb, paged=False), nmsb,
                                             sbk, use_unaligned_ks=True)
    if not clean_logits:
        out.copy_(logits)
        return
    ks, ke, idx = rt.sparse_header(metadata, m, nmsb, paged=False)
    rt.clean_sparse(out, logits, ks, ke, idx, sbk)


def _sparse_reference(q, q_sf, kv, kv_sf, weights, metadata, *, num_max_sparse_blocks,
                      sparse_block_kv):
    ks, ke, idx = ref.sparse_header_arrays(metadata, q.shape[0], num_max_sparse_blocks, paged=False)
    return ref.sparse_mqa_logits(q, q_sf, kv, kv_sf, weights, ks, ke, idx,
                                 sparse_block_kv=sparse_block_kv)


FP8_FP4_SPARSE_MQA_LOGITS = Op(
    name="fp8_fp4_sparse_mqa_logits",
    args=("q", "q_sf", "kv", "kv_sf", "weights", "metadata"),
    statics={"num_max_sparse_blocks": REQUIRED, "sparse_block_kv": REQUIRED, "clean_logits": REQUIRED},
    shapes=_sparse_shapes,
    run=_sparse_run,
    reference=_sparse_reference,
    symbols=("fp8_fp4_sparse_mqa_logits",),
    archs=frozenset({"sm100"}),
)


@exposes(FP8_FP4_SPARSE_MQA_LOGITS)
def fp8_fp4_sparse_mqa_logits(q, kv, weights, metadata, num_max_sparse_blocks: int,
                              sparse_block_kv: int, *, clean_logits: bool = True) -> jax.Array:
    """MQA logits at candidate key blocks only (DeepGEMM >= 2.8, SM100), the call shape of vLLM's wrapper.

    q: (values [M, H, D], packed UE8M0 int32 scales [M, H], mandatory): MXFP8 (float8_e4m3fn,
       D = 128) or MXFP4 (int8, 64 bytes of e2m1 pairs, low nibble first); byte j of a scale
       covers the j-th 32 elements of D. H <= 32, a multiple of 4.
    kv: (values [N, D] of q's format, int32 packed UE8M0 [N]).
    weights: bfloat16 [M, H] (q's scale is not folded in).
    metadata: from `get_sparse_mqa_logits_metadata` with the same M and num_max_sparse_blocks.
    Returns bfloat16 [M, num_max_sparse_blocks * sparse_block_kv]: column j*sbk + o scores key
    indices[i, j]*sbk + ks[i] % sbk + o, valid for j < min(ceil((ke-ks)/sbk), nmsb) and
    ks <= key < ke; invalid columns are -inf (unspecified with clean_logits=False).
    DeepGEMM has this kernel on SM100 only; elsewhere use JAX_DG_BACKEND=torch or xla.
    """
    ck = Checker("fp8_fp4_sparse_mqa_logits")
    qv, qs = ck.pair(q, "q")
    kvv, kvs = ck.pair(kv, "kv")
    for x, name in ((qv, "q[0]"), (qs, "q[1]"), (kvv, "kv[0]"), (kvs, "kv[1]"),
                    (weights, "weights"), (metadata, "metadata")):
        ck.array(x, name)
    nmsb = ck.static_int(num_max_sparse_blocks, "num_max_sparse_blocks", minimum=1)
    ck.that(nmsb % 4 == 0 and nmsb <= 4096, "num_max_sparse_blocks",
            "must be a multiple of 4 and <= 4096 (DeepGEMM's sparse kernels)", nmsb)
    sbk = _check_sparse_block_kv(ck, sparse_block_kv)
    (logits,) = FP8_FP4_SPARSE_MQA_LOGITS(qv, qs, kvv, kvs, weights, metadata,
                                          num_max_sparse_blocks=nmsb, sparse_block_kv=sbk,
                                          clean_logits=ck.static_bool(clean_logits, "clean_logits"))
    return logits
