"""One timing method for every contender: many back-to-back calls, then one device sync.

Host wall-clock over n calls / n, best of several repeats (at least 5), after warm-up (DeepGEMM
compiles each kernel variant on first use). Work queued by torch and by XLA is timed identically.
"""

from __future__ import annotations

import json
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
    repeat times each contender in turn (n back-to-back calls, one sync), best repeat kept."""
    best = {name: float("inf") for name in contenders}
    for name, (run, sync) in contenders.items():
        out = None
        for _ in range(warmup):
            out = run()
        sync(out)
    for _ in range(repeats):
        for name, (run, sync) in contenders.items():
            t0 = time.perf_counter()
            for _ in range(n):
                out = run()
            sync(out)
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


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


def plot(name: str, rows: list[dict], label_key: str, ratio_keys: list[str], ylabel: str) -> None:
    """Bar chart of the ratio columns per row, saved as $OUT/<name>.png (or ./<name>.png);
    skipped with a note where matplotlib is not installed (the optional [bench] extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(plot {name}.png skipped: matplotlib is not installed; pip install jax_dg[bench])")
        return
    labels = [str(r[label_key]) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) * len(ratio_keys)), 4))
    width = 0.8 / len(ratio_keys)
    for i, key in enumerate(ratio_keys):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(key, float("nan")) for r in rows],
               width, label=key)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(ratio_keys) - 1) / 2 for j in range(len(rows))], labels,
                  rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(os.environ.get("OUT", "."), f"{name}.png")
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
