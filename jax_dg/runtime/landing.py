"""Landing: the output DeepGEMM allocates itself, placed in XLA's result buffer.

DeepGEMM's logits calls (fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits) take no output
argument: each makes one `torch::empty` of a row- and column-padded buffer and returns a view
of it. jax_dg declares the custom call's result with that padded layout (the op's `finish`
slices the logical array out of it, fused by XLA into whatever reads it) and makes the
allocation land in that result where the trace decided it does (contracts.lands):

Where the allocation goes is one interface, `into(out, make) -> (result, keep)`: run `make`
so that its one allocation takes `out`'s memory if it can (`keep`: what must outlive the result).
`lands_into` picks it once per call site:
- CUDA (`into_cuda_pool`, whatever the kernels): a fresh torch MemPool per call, backed by the
  pluggable allocator that ffi/bridge.cc exports (JaxDgLandingAlloc / JaxDgLandingFree),
  routes this thread's allocations for the duration of the DeepGEMM call only. The allocator
  hands out the armed XLA buffer once, to a request no larger than it (torch asks for its whole
  segment, contracts.torch_segment_bytes), and refuses anything else. After the call the result
  tensor and the pool are dropped, so torch releases the pool's segment (the free function
  releases nothing: the memory is XLA's) and no later call can be handed this buffer again.
- elsewhere the kernels implement it: the torch emulation's `land_into`
  (jax_dg.backends.torch_emu), whose one allocation takes the buffer armed for the thread.

If the allocation did not land (a refused request, a buffer too small to be worth landing, a
DeepGEMM whose layout differs from the declared one), DeepGEMM's own buffer is copied into
the declared layout: the result is the same, one copy slower. STATS counts both outcomes.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from jax_dg.core import _bridge

# run `make`, its one allocation in `out` if it can: (result, what must outlive it)
Into = Callable[[torch.Tensor, Callable[[], torch.Tensor]], "tuple[torch.Tensor, Any]"]

STATS = {"landed": 0, "copied": 0}
_allocator = None
_warned: set = set()


def allocator():
    """torch's handle on jax_dg's pluggable allocator (created once)."""
    global _allocator
    if _allocator is None:
        alloc, free = _bridge.landing_functions()
        _allocator = torch._C._cuda_customAllocator(alloc, free)
    return _allocator


def counts() -> dict:
    """The C++ allocator's counters: requests served, refused, segments released."""
    landed, refused, released = _bridge.landing_counts()
    return {"landed": landed, "refused": refused, "released": released}


def lands_into(platform: str, dg) -> Into:
    """Where a call site's own allocations land: torch's CUDA allocator routed into XLA's buffer
    on CUDA (any kernels that allocate through torch), else the kernels' own landing (the
    torch emulation implements it; DeepGEMM runs on CUDA only)."""
    return into_cuda_pool if platform == "cuda" else dg.land_into


def into_cuda_pool(out: torch.Tensor, make: Callable[[], torch.Tensor]):
    """The landing on CUDA: `make`'s allocations routed to a pool whose allocator hands out
    `out` once; a refused request falls back to torch's own allocator (then copied)."""
    capacity = out.numel() * out.element_size()
    device = out.device.index
    pool = torch.cuda.MemPool(allocator())
    refused = _bridge.landing_refused()            # this thread's: other calls cannot move it
    _bridge.landing_arm(out.data_ptr(), capacity, device)
    C = torch._C
    C._cuda_beginAllocateCurrentThreadToPool(device, pool.id)
    try:
        result = make()
    except RuntimeError:
        if _bridge.landing_refused() == refused:
            raise
        result = None                              # our allocator refused: torch's own below
    finally:
        C._cuda_endAllocateToPool(device, pool.id)
        C._cuda_releasePool(device, pool.id)
        _bridge.landing_disarm()
    if result is None:
        _warn_once("refused", f"jax_dg: torch asked for more than the {capacity}-byte logits "
                   "buffer (its segment rounding differs from contracts.torch_segment_bytes); "
                   "copying DeepGEMM's own buffer instead.")
        result = make()
    return result, pool    # the pool must outlive the result (released once both are dropped)


def land(out: torch.Tensor, make: Callable[[], torch.Tensor], lands: bool, into: Into) -> None:
    """Runs `make` (a DeepGEMM call that allocates its padded result once and returns a
    [rows, cols] view of it) so that the result is `out`'s memory, laid out as `out` is
    ([R, stride]), where the trace decided it `lands` (contracts.lands: out covers torch's
    segment), by `into` (lands_into); else, or if it did not land, copies it into
    out[:rows, :cols] (the copy reads DeepGEMM's whole block, the positions it left unwritten
    included: they are overwritten or never read after, see the ops' finish). `out` must be
    XLA's memory (a custom call's result): torch already tracks its own blocks by address."""
    pool = None
    if not lands:
        result = make()                            # DeepGEMM's own buffer, copied below
    else:
        result, pool = into(out, make)
    rows, cols = result.shape
    landed = result.data_ptr() == out.data_ptr() and result.stride() == (out.stride(0), 1)
    if not landed and result.data_ptr() == out.data_ptr():   # landed, but not in the declared layout
        _warn_once("layout", f"jax_dg: DeepGEMM's logits row stride is {result.stride(0)}, "
                   f"jax_dg declared {out.stride(0)} (a DeepGEMM version it does not know?); "
                   "copying.")
        result = result.clone()
    STATS["landed" if landed else "copied"] += 1
    if not landed:
        out[:rows, :cols].copy_(result)
    del result, pool   # releases the pool's segment (JaxDgLandingFree), never XLA's memory


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
