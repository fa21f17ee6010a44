"""Every benchmark's output, written one way: its table and a bar plot of its ratio columns.

`write(name, title, rows, columns, label=..., ratios=[...])` saves the plot as
benchmarks/plots/<name>.png (and $OUT/<name>.png where $OUT is set: the device tool brings back
only $OUT), appends the rows as JSON to $OUT/bench.jsonl and the table in Markdown to
$OUT/<name>.md (for RESULTS.md), and prints the table last, so it ends the output. Without
matplotlib (the optional `[bench]` extra) the table is still printed and the plot is skipped
with a note. Imports neither jax nor torch: it runs anywhere.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Callable, Sequence

PLOTS = pathlib.Path(__file__).resolve().parent / "plots"

Columns = Sequence[tuple[str, str]]   # (row key, header)


def _cell(value) -> str:
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:.3f}"
    return "" if value is None else str(value)


def table_text(title: str, rows: list[dict], columns: Columns) -> str:
    """The table as the benchmarks print it: right-aligned columns under a `== title ==` line."""
    widths = [max(len(h), 10) for _, h in columns]
    lines = [f"== {title} ==", "  ".join(f"{h:>{w}}" for (_, h), w in zip(columns, widths))]
    lines += ["  ".join(f"{_cell(r.get(k)):>{w}}" for (k, _), w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def table_markdown(title: str, rows: list[dict], columns: Columns) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(h for _, h in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def _labels(rows: list[dict], label: str | Callable[[dict], str]) -> list[str]:
    return [label(r) if callable(label) else str(r[label]) for r in rows]


def bar_plot(path: pathlib.Path, title: str, rows: list[dict], label: str | Callable[[dict], str],
             ratios: Sequence[str], ylabel: str) -> bool:
    """A grouped bar chart of the ratio columns per row, a line at 1; False (nothing written)
    where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = _labels(rows, label)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) * len(ratios)), 4))
    width = 0.8 / len(ratios)
    for i, key in enumerate(ratios):
        values = [r.get(key) for r in rows]
        ax.bar([j + i * width for j in range(len(rows))],
               [v if isinstance(v, (int, float)) else float("nan") for v in values], width, label=key)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(ratios) - 1) / 2 for j in range(len(rows))], labels,
                  rotation=35, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(name: str, title: str, rows: list[dict], columns: Columns, *,
          label: str | Callable[[dict], str], ratios: Sequence[str],
          ylabel: str = "time ratio (other / jax_dg; > 1: jax_dg faster)",
          plots: pathlib.Path | None = None) -> pathlib.Path | None:
    """Writes benchmark `name`'s table and plot (see the module docstring); returns the plot's
    path, or None where it was skipped. `label` is a row key or a function of the row."""
    path = (PLOTS if plots is None else pathlib.Path(plots)) / f"{name}.png"
    out_dir = os.environ.get("OUT")
    if bar_plot(path, title, rows, label, ratios, ylabel):
        print(f"plot: {path}")
        if out_dir:
            copy = pathlib.Path(out_dir) / path.name
            copy.write_bytes(path.read_bytes())
            print(f"plot: {copy}")
    else:
        path = None
        print(f"(plot {name}.png skipped: matplotlib is not installed; pip install -e '.[bench]')")
    if out_dir:
        with open(os.path.join(out_dir, "bench.jsonl"), "a") as f:
            f.write(json.dumps({"name": name, "title": title, "rows": rows}, default=str) + "\n")
        with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
            f.write(table_markdown(title, rows, columns) + "\n")
    print("\n" + table_text(title, rows, columns))
    return path
