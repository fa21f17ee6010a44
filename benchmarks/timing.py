"""One timing method for every contender: many back-to-back calls, then one device sync.

Host wall-clock over n calls / n, best of several repeats (at least 5), after warm-up (DeepGEMM
compiles each kernel variant on first use). Work queued by torch and by XLA is timed identically.
What a benchmark writes (its table and plot): plot.py.
"""

from __future__ import annotations

import os
import time
from typing import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")


def per_call_us(run: Callable[[], object], sync: Callable[[object], None], n: int,
                repeats: int = 5, warmup: int = 3) -> float:
    out = None
    for _ in range(warmup):
        out = run()
    sync(out)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            out = run()
        sync(out)
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return min(samples)


def compare(contenders: dict, n: int, repeats: int = 5, warmup: int = 3) -> dict:
    """Per-call microseconds of each contender {name: (run, sync)}, timed interleaved: every
    repeat times each contender in turn (n back-to-back calls, one sync; the order rotates from
    repeat to repeat), best repeat kept."""
    best = {name: float("inf") for name in contenders}
    for name, (run, sync) in contenders.items():
        out = None
        for _ in range(warmup):
            out = run()
        sync(out)
    names = list(contenders)
    for r in range(repeats):
        # the order rotates each repeat: no contender always runs first (after the sync gap)
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, sync = contenders[name]
            t0 = time.perf_counter()
            for _ in range(n):
                out = run()
            sync(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


def torch_sync(_out=None) -> None:
    """torch's device sync (none where there is no CUDA device: the --tiny CPU runs)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def captured(step: Callable[[], object], warmup: int = 3) -> Callable[[], None]:
    """`step` captured once in a torch CUDA graph, after `warmup` eager runs (deep_gemm compiles
    its kernels and torch's allocator settles first): the graph's replay."""
    import torch
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def jax_sync(out) -> None:
    import jax
    jax.block_until_ready(out)
