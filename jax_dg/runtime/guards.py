"""What wraps every run of a call site (jax_dg.runtime.bridge): the op's name on its errors, and
the capture guard of graph-safe ops."""

from __future__ import annotations

import torch

from jax_dg.core import _bridge


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
    ones that landed in XLA's buffers (jax_dg.runtime.landing: memory torch never keeps)."""
    if platform != "cuda":
        return 0
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
