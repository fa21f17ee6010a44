"""Torch-side helpers for the ops' run functions (code that runs inside the custom call).

Everything in jax_dg that touches torch at run time, other than the backends, lives here: XLA's
stream as a torch stream, one-pass output cleaning, int32 views of metadata buffers. Cached
constants keep the hot path free of allocations.
"""

from __future__ import annotations

import functools

import torch

from jax_dg import contracts

int32 = torch.int32
int64 = torch.int64

# XLA element types that DLPack carries as uint8 (see DlpackType in ffi/bridge.cc), from
# xla/ffi/api/c_api.h (XLA_FFI_DataType, part of the stable FFI ABI).
FP8_BY_XLA_TYPE = {19: torch.float8_e5m2, 20: torch.float8_e4m3fn}


def retype(tensor: torch.Tensor, xla_dtype: int) -> torch.Tensor:
    """The FP8 view of a uint8 DLPack tensor."""
    return tensor.view(FP8_BY_XLA_TYPE[xla_dtype])


def dims(compiled_dims: str | None) -> dict:
    """DeepGEMM's `compiled_dims` keyword when the caller chose one (None: DeepGEMM's default)."""
    return {} if compiled_dims is None else {"compiled_dims": compiled_dims}


def dtype(name: str) -> torch.dtype:
    """torch's dtype of a jnp dtype name ("float8_e4m3fn", "int8", ...)."""
    return getattr(torch, name)


@functools.lru_cache(maxsize=64)
def torch_stream(stream: int, device: int) -> tuple[int, int, int]:
    """(stream_id, device_index, device_type) of XLA's CUDA stream, for torch._C._cuda_setStream."""
    s = torch.cuda.ExternalStream(stream, device=torch.device("cuda", device))
    return (s.stream_id, s.device_index, s.device_type)


# --- capture safety -------------------------------------------------------------------------

class CaptureAllocationError(RuntimeError):
    """A graph-safe op's call allocated torch memory while XLA was capturing it into a CUDA
    graph: the replayed graph would keep using memory torch has freed."""


# Captured and eager entries of graph-safe call sites (what the capture tests and the
# benchmark read).
CAPTURE_STATS = {"captured": 0, "eager": 0}


def is_capturing(platform: str) -> bool:
    """Whether the call runs under stream capture (torch's current stream, set to XLA's)."""
    return platform == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


def allocations(platform: str) -> int:
    """Blocks torch's caching allocator has handed out so far on the current device, but the
    ones that landed in XLA's buffers (jax_dg.core.landing: memory torch never keeps)."""
    if platform != "cuda":
        return 0
    from jax_dg.core import _bridge   # the extension, loaded after jax (see core/bridge.py)
    device = torch.cuda.current_device()
    stats = torch._C._cuda_memoryStats(device)
    return stats["allocation"]["all"]["allocated"] - _bridge.landing_landed_on(device)


def capture_guard(op_name: str, platform: str, run):
    """`run` guarded for capture: under stream capture, an allocation by torch's allocator
    raises CaptureAllocationError naming the op (the kernels it launched would be replayed on
    freed memory). Outside capture it costs one query of the stream's capture state."""
    def guarded(ins, outs):
        if not is_capturing(platform):
            CAPTURE_STATS["eager"] += 1
            return run(ins, outs)
        CAPTURE_STATS["captured"] += 1
        before = allocations(platform)
        run(ins, outs)
        if allocations(platform) != before:
            raise CaptureAllocationError(
                f"jax_dg: `{op_name}` allocated torch memory while XLA captured it into a CUDA "
                "graph; the replay would reuse freed memory. This op is declared graph-safe "
                "(Op.graph_safe) and must not allocate: report it, and run with "
                "XLA_FLAGS=--xla_gpu_enable_command_buffer= meanwhile.")
    return guarded


def named_errors(op_name: str, run):
    """`run` whose exceptions name the op (they reach the user as XLA's error text). torch
    running out of memory inside DeepGEMM gets the advice that fixes it: XLA preallocates 75% of
    the GPU by default, and DeepGEMM's allocations go through torch's allocator beside it."""
    def named(ins, outs):
        try:
            run(ins, outs)
        except torch.OutOfMemoryError as e:
            raise MemoryError(
                f"jax_dg.{op_name}: out of GPU memory inside the call (DeepGEMM allocates through "
                "torch's caching allocator, beside XLA's preallocated pool). Leave torch room: set "
                "XLA_PYTHON_CLIENT_MEM_FRACTION lower (e.g. 0.5) or XLA_PYTHON_CLIENT_PREALLOCATE="
                f"false before jax starts. torch said: {str(e).splitlines()[0]}") from None
        except Exception as e:
            raise RuntimeError(f"jax_dg.{op_name}: {type(e).__name__}: {e}") from e
    return named


# --- scales as DeepGEMM wants them: MN-major, TMA-aligned views of XLA buffers --------------

_MN_MAJOR: dict = {}


@functools.lru_cache(maxsize=16)
def _arch_major(device: int) -> int:
    return torch.cuda.get_device_capability(device)[0]


def arch_major(t: torch.Tensor) -> int:
    """The compute capability's major of the GPU holding `t` (0 on CPU); cached per device."""
    return _arch_major(t.device.index) if t.is_cuda else 0


def mn_major_view(physical: torch.Tensor, mn: int) -> torch.Tensor:
    """The logical [(G,) MN, K'] scales DeepGEMM's get_mn_major_tma_aligned_tensor returns as
    they are (no allocation, no transpose): a strided view of the physical buffer
    [(G,) K', align(MN, 4)] built in the jitted program (jax_dg.operands.scales)."""
    key = (physical.data_ptr(), tuple(physical.shape), mn)
    view = _MN_MAJOR.get(key)
    if view is None:
        *g, k, amn = physical.shape
        size, stride = (mn, k), (1, amn)
        if g:
            size, stride = (g[0], mn, k), (k * amn, 1, amn)
        if len(_MN_MAJOR) >= 4096:
            _MN_MAJOR.clear()
        view = _MN_MAJOR[key] = physical.as_strided(size, stride)
    return view


# --- output cleaning: -inf at invalid positions, fused with the copy out --------------------

_COLUMNS: dict = {}
_NEG_INF: dict = {}


def neg_inf(like: torch.Tensor) -> torch.Tensor:
    """A 0-d -inf tensor of `like`'s dtype on its device (cached)."""
    key = (like.device, like.dtype)
    value = _NEG_INF.get(key)
    if value is None:
        value = _NEG_INF[key] = torch.full((), float("-inf"), dtype=like.dtype, device=like.device)
    return value


def columns(like: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [1, n] column indices on `like`'s device (cached)."""
    key = (like.device, n)
    value = _COLUMNS.get(key)
    if value is None:
        value = _COLUMNS[key] = torch.arange(n, dtype=torch.int32, device=like.device)[None]
    return value


def where_valid(out: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor) -> None:
    """out = logits where `valid`, -inf elsewhere: one pass."""
    torch.where(valid, logits, neg_inf(out), out=out)


def row_aligned(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x, or a copy whose rows start `multiple` elements apart (16-byte rows for TMA)."""
    m, h = x.shape
    if h % multiple == 0:
        return x
    padded = torch.zeros((m, contracts.align(h, multiple)), dtype=x.dtype, device=x.device)
    padded[:, :h].copy_(x)
    return padded[:, :h]


# --- the sparse metadata buffer (layout in jax_dg.contracts) ---------------------------------

def write_sparse_metadata(out: torch.Tensor, vectors, meta: torch.Tensor, m: int, nmsb: int,
                          paged: bool, what: str) -> None:
    """Fills jax_dg's uint8 metadata `out`: the header's int32 vectors, then the backend's
    schedule `meta` (any dtype), zeros elsewhere."""
    used = contracts.sparse_header_used(m, nmsb, paged)
    header = contracts.sparse_header_bytes(m, nmsb, paged)
    head, start = out[:used].view(torch.int32), 0
    for v in vectors:
        v = v.reshape(-1)
        head[start:start + v.numel()].copy_(v)
        start += v.numel()
    out[used:header].zero_()
    meta = meta.contiguous().view(torch.uint8).reshape(-1)
    region = out[header:]
    if meta.numel() > region.numel():
        raise RuntimeError(f"jax_dg: {what} returned {meta.numel()} bytes; jax_dg sized "
                           f"{region.numel()} (DeepGEMM's layout changed? see "
                           "jax_dg.contracts.deep_gemm_sparse_metadata_bytes)")
    region[:meta.numel()].copy_(meta)
    region[meta.numel():].zero_()


def sparse_header(metadata: torch.Tensor, m: int, nmsb: int, paged: bool):
    """int32 views of the header's vectors: (ks, ke, indices [M, nmsb]), or
    (context_lens, indices [M, nmsb]) when paged."""
    head = metadata[:contracts.sparse_header_used(m, nmsb, paged)].view(torch.int32)
    k = contracts.sparse_header_vectors(paged)
    return tuple(head[i * m:(i + 1) * m] for i in range(k)) + (head[k * m:].view(m, nmsb),)


def sparse_payload(metadata: torch.Tensor, m: int, nmsb: int, paged: bool) -> torch.Tensor:
    """The backend's part of the metadata (what DeepGEMM's kernel reads)."""
    return metadata[contracts.sparse_header_bytes(m, nmsb, paged):]


def clean_sparse(out: torch.Tensor, logits: torch.Tensor, ks: torch.Tensor | None,
                 ke: torch.Tensor, idx: torch.Tensor, sbk: int) -> None:
    """out = logits where column (j, o) scores a valid key, -inf elsewhere. Column j*sbk + o
    scores key idx[i, j]*sbk + ks[i] % sbk + o, valid for j < min(ceil((ke-ks)/sbk), nmsb) and
    ks <= key < ke (paged: ks None = 0, ke = the context length)."""
    m, nmsb = idx.shape
    if ks is None:
        ks = torch.zeros_like(ke)
    o = torch.arange(sbk, device=out.device, dtype=torch.int32)
    token = (idx[:, :, None] * sbk + (ks % sbk)[:, None, None] + o).view(m, nmsb * sbk)
    nvb = ((ke - ks).clamp(min=0) + (sbk - 1)).div(sbk, rounding_mode="floor").clamp(max=nmsb)
    valid = ((columns(out, nmsb * sbk) < (nvb * sbk)[:, None]) & (token >= ks[:, None])
             & (token < ke[:, None]))
    where_valid(out, valid, logits)
