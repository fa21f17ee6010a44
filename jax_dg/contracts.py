"""DeepGEMM's contracts as plain data: sizes, block shapes and buffer layouts.

The one neutral module that the ops (trace time), the torch emulation (the backend it checks)
and the pure-JAX reference (the oracle) all read, so that neither reference borrows a fact
from the other. Plain Python only: it imports nothing, not even jax.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align(a: int, b: int) -> int:
    return cdiv(a, b) * b


# --- devices ----------------------------------------------------------------------------------

ARCH_FAMILIES = {9: "sm90", 10: "sm100", 12: "sm120"}   # compute-capability major -> family
DEEP_GEMM_ARCHS = frozenset({"sm90", "sm100"})          # where DeepGEMM has kernels
EMULATED_ARCH = "sm90"     # the contract the references emulate off the GPU
EMULATED_VERSION = (2, 5)  # the DeepGEMM release whose layouts the references emulate
DEFAULT_NUM_SMS = 132      # H100 / H200 SXM: what the references schedule for without a GPU

# --- grouped GEMMs ----------------------------------------------------------------------------

LEGACY_MK_ALIGNMENT = 128  # DeepGEMM's kLegacyMKAlignmentForContiguousLayout
MASKED_BLOCK_M = 128       # SM90 masked kernels: Mmax must be a multiple

# --- hyper-connection pre-norm GEMM -----------------------------------------------------------

HC_BLOCK_K = 64


def hc_split_bounds(k: int, num_split: int) -> list[tuple[int, int]]:
    """K ranges of tf32_hc_prenorm_gemm's splits: whole 64-wide blocks, the remainder going to
    the first splits (DeepGEMM's rule)."""
    per, rem = divmod(k // HC_BLOCK_K, num_split)
    bounds, start = [], 0
    for s in range(num_split):
        end = start + per + (s < rem)
        bounds.append((start * HC_BLOCK_K, end * HC_BLOCK_K))
        start = end
    return bounds


# --- MQA logits buffers: DeepGEMM allocates them row- and column-padded ------------------------

MQA_BLOCK_QH = 128         # query rows x heads per block: rows are aligned to 128 / H
MQA_BLOCK_KV = 256         # keys per block: the kernels write whole blocks, hence the slack


LOGITS_DTYPES = ("float32", "bfloat16")   # logits_dtype of the MQA-logits kernels
LOGITS_ITEMSIZE = {"float32": 4, "bfloat16": 2}
LEGACY_LOGITS_STRIDE_ALIGN = 64  # elements, whatever the dtype (DeepGEMM <= 2.5, the references)
LOGITS_ROW_BYTES = 1024          # DeepGEMM >= 2.6: row stride a multiple of 1024 bytes


def logits_stride_align(version: tuple[int, int], logits_dtype: str) -> int:
    """Row-stride alignment (elements) of the logits DeepGEMM `version` allocates: 64 up to
    2.5 (both dtypes), 1024 bytes from 2.6 (256 float32 or 512 bfloat16 elements)."""
    if version < (2, 6):
        return LEGACY_LOGITS_STRIDE_ALIGN
    return LOGITS_ROW_BYTES // LOGITS_ITEMSIZE[logits_dtype]


def mqa_logits_layout(rows: int, heads: int, seq_len_kv: int, max_seqlen_k: int,
                      stride_align: int = LEGACY_LOGITS_STRIDE_ALIGN) -> tuple[int, int]:
    """(rows, row stride in elements) of the buffer fp8_fp4_mqa_logits allocates: rows aligned
    to 128/H; full form stride align(SK + 256, stride_align), compressed form
    align(align(max_seqlen_k, 256), stride_align) (see logits_stride_align)."""
    stride = (align(align(max_seqlen_k, MQA_BLOCK_KV), stride_align) if max_seqlen_k
              else align(seq_len_kv + MQA_BLOCK_KV, stride_align))
    return align(rows, MQA_BLOCK_QH // heads), stride


def paged_logits_layout(rows: int, max_context_len: int,
                        stride_align: int = LEGACY_LOGITS_STRIDE_ALIGN) -> tuple[int, int]:
    """(rows, row stride in elements) of the buffer fp8_fp4_paged_mqa_logits allocates:
    align(align(max_context_len, 256), stride_align) (float32 rows: align(L, 256) in every
    version)."""
    return rows, align(align(max_context_len, MQA_BLOCK_KV), stride_align)


# torch's CUDA caching allocator asks for whole segments (c10/cuda/CUDACachingAllocator.cpp):
# requests up to 1 MiB take a 2 MiB segment, up to 10 MiB a 20 MiB one, larger ones are rounded
# up to 2 MiB. An allocation lands in an XLA buffer only if the buffer holds the whole segment,
# so the XLA buffer gets the rows that cover it: at most 2 MiB of slack from 10 MiB on, a 2 or
# 20 MiB buffer below (memory XLA reuses; what a copy would cost is a kernel per call, and a
# call that cannot be captured into a CUDA graph).
TORCH_SMALL_SEGMENT = 2 << 20
TORCH_MID_SEGMENT = 20 << 20
TORCH_ROUND_LARGE = 2 << 20
TORCH_MIN_LARGE_ALLOC = 10 << 20


def torch_segment_bytes(nbytes: int) -> int:
    """The segment torch's caching allocator requests for an allocation of `nbytes`."""
    size = max(512, align(nbytes, 512))
    if size <= 1 << 20:
        return TORCH_SMALL_SEGMENT
    if size < TORCH_MIN_LARGE_ALLOC:
        return TORCH_MID_SEGMENT
    return align(size, TORCH_ROUND_LARGE)


def lands(rows: int, segmented: bool) -> bool:
    """Whether a padded allocation of `rows` rows is routed into the XLA buffer (decided while
    tracing): always, but for a symbolic row count on torch's CUDA allocator (jax.export),
    whose segment size the trace cannot know: such a buffer is copied."""
    if not segmented:
        return True
    try:
        int(rows)
    except Exception:   # noqa: BLE001  jax's InconclusiveDimensionOperation and kin
        return False
    return True


def landing_rows(rows: int, stride: int, itemsize: int, segmented: bool) -> int:
    """Rows of the XLA buffer a padded [rows, stride] allocation lands in: its own rows, or
    (segmented, i.e. torch's CUDA allocator) enough rows to hold torch's whole segment."""
    if not segmented or not lands(rows, segmented):
        return rows
    rows = int(rows)
    return max(rows, cdiv(torch_segment_bytes(rows * stride * itemsize), stride * itemsize))


# --- paged MQA logits -------------------------------------------------------------------------

SPLIT_KV = 256             # tokens per schedule split (SM90 paged kernel)
# Context lengths the paged schedule counts with, at most: the schedule sums every request's
# splits in int32 (DeepGEMM's kernel and the pure-JAX reference), which lengths near 2**31
# overflow; 2**24 tokens keeps the sum exact for up to 2**15 requests of that length.
MAX_CONTEXT_LEN = 1 << 24
# jax_dg's sanitising kernel (kernels/paged_sanitise.cu): the lengths it bounds
# (min(max_model_len, max_blocks * block_size)) keep ceil(len / SPLIT_KV) in int32.
MAX_PAGED_LIMIT = 1 << 30
MX_HEAD_DIM = 128          # MX scales: four UE8M0 bytes (one int32) per row, one per 32 elements
# The paged FP8 key cache, uint8 [num_blocks, block_size, 1, D + KV_SCALE_BYTES]: each block
# holds its block_size D-byte rows (token-major), then their block_size scales of
# KV_SCALE_BYTES each (float32, or packed UE8M0 int32 with MX scales).
KV_SCALE_BYTES = 4


def page_sizes(arch: str) -> tuple[int, ...]:
    """KV block sizes (tokens) the paged MQA-logits kernels take on `arch`."""
    return (64,) if arch == "sm120" else (32, 64)


def next_n_ok(next_n: int, arch: str) -> bool:
    """Query rows per request the paged kernel takes: SM90 1, 2 or 4; SM100/SM120 any."""
    return next_n in (1, 2, 4) if arch == "sm90" else next_n >= 1


def schedule_slots(num_sms: int, next_n: int, arch: str, varlen: bool = False) -> int:
    """Scheduler tasks of the paged kernel: SM90 next_n=4 runs one per 2-SM cluster."""
    return num_sms // (2 if arch == "sm90" and next_n == 4 and not varlen else 1)


# --- sparse MQA logits (SM100 kernels) and the metadata buffer jax_dg hands around ------------
#
#   uint8 [ header | backend part ]
#   header:       int32 vectors, concatenated, padded to META_ALIGN bytes:
#                   non-paged: ks [M], ke [M], sparse_kv_block_indices [M * nmsb]
#                   paged:     context_lens [M], sparse_kv_block_indices [M * nmsb]
#   backend part: DeepGEMM's opaque schedule on SM100, or the references' own table, then zeros.
#
# The header lets every backend produce fully defined output (-inf where a column scores no key).

SPARSE_BLOCKS = (8, 16)                                   # sparse_block_kv
SPARSE_SPLIT_KV = {"float8_e4m3fn": 512, "int8": 640}     # by qk dtype (MXFP8, packed MXFP4)
META_ALIGN = 256


def sparse_header_vectors(paged: bool) -> int:
    """int32 vectors of length M before the block indices: (ks, ke) or (context_lens,)."""
    return 1 if paged else 2


def sparse_header_used(m: int, nmsb: int, paged: bool) -> int:
    """Bytes of the header's int32 data (before its padding)."""
    return 4 * m * (sparse_header_vectors(paged) + nmsb)


def sparse_header_bytes(m: int, nmsb: int, paged: bool) -> int:
    return align(sparse_header_used(m, nmsb, paged), META_ALIGN)


def deep_gemm_sparse_metadata_bytes(m: int, nmsb: int, sbk: int, qk_dtype: str, num_sms: int,
                                    paged: bool) -> int:
    """Size of DeepGEMM's sparse schedule (upstream layout/sparse_mqa_logits.cuh)."""
    per_split = SPARSE_SPLIT_KV[qk_dtype] // sbk
    s_max = m * cdiv(nmsb, per_split) if paged else cdiv(m, 2) * cdiv(2 * nmsb, per_split)
    return 16 + s_max * (16 + per_split * 8) + align(s_max, num_sms) * 16


def reference_sparse_table_bytes(m: int, nmsb: int, paged: bool) -> int:
    """The references' backend part: the header's vectors again (non-paged), or an int32
    [M, nmsb, 2] table of (cache slot, valid tokens) per candidate block (paged)."""
    return 8 * m * nmsb if paged else sparse_header_used(m, nmsb, paged)


def sparse_metadata_bytes(m: int, nmsb: int, sbk: int, qk_dtype: str, num_sms: int,
                          paged: bool) -> int:
    backend = max(deep_gemm_sparse_metadata_bytes(m, nmsb, sbk, qk_dtype, num_sms, paged),
                  reference_sparse_table_bytes(m, nmsb, paged))
    return sparse_header_bytes(m, nmsb, paged) + backend
