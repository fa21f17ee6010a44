"""One timing method for every contender: many back-to-back calls, then one device sync.

Host wall-clock over n calls / n, median of several repeats, after warm-up (DeepGEMM compiles
each kernel variant on first use). Work queued by torch and by XLA is timed identically.
"""

from __future__ import annotations

import json
import os
import statistics
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
    return statistics.median(samples)


def torch_sync(_out=None) -> None:
    import torch
    torch.cuda.synchronize()


def jax_sync(out) -> None:
    import jax
    jax.block_until_ready(out)


def report(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Prints a table (last, so it ends the device tool's output); appends JSON to $OUT/bench.jsonl."""
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench.jsonl"), "a") as f:
            f.write(json.dumps({"title": title, "rows": rows}) + "\n")
    print(f"\n== {title} ==")
    print("  ".join(f"{h:>{max(len(h), 10)}}" for _, h in columns))
    for r in rows:
        cells = []
        for key, h in columns:
            v = r.get(key, "")
            cells.append(f"{v:>{max(len(h), 10)}.3f}" if isinstance(v, float) else f"{v!s:>{max(len(h), 10)}}")
        print("  ".join(cells))
