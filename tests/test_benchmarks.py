"""The benchmarks' shared output (benchmarks/plot.py) on CPU: a table and a PNG of its ratios.

The benchmarks themselves need a GPU and deep_gemm to import; here each one's `plot.write`
call is taken from its source and run on made-up numbers of its own columns."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))
PNG = b"\x89PNG\r\n\x1a\n"


def load_plot():
    spec = importlib.util.spec_from_file_location("benchmarks_plot", BENCH / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot = load_plot()
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib (the [bench] extra) is not installed")

ROWS = [{"shape": "M64 N128", "torch_us": 10.0, "jax_dg_us": 8.0, "torch/jax_dg": 1.25},
        {"shape": "M128 N128", "torch_us": 12.0, "jax_dg_us": 16.0, "torch/jax_dg": 0.75,
         "note": "x"}]
COLUMNS = [("shape", "shape"), ("torch_us", "torch us"), ("jax_dg_us", "jax_dg us"),
           ("torch/jax_dg", "torch/jax_dg"), ("note", "note")]


@needs_matplotlib
def test_write_saves_the_plot_and_prints_the_table_last(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    path = plot.write("bench_fake", "fake op", ROWS, COLUMNS, label="shape", ratios=["torch/jax_dg"],
                      plots=tmp_path / "plots")
    assert path == tmp_path / "plots" / "bench_fake.png"
    assert path.read_bytes().startswith(PNG)
    assert (tmp_path / "out" / "bench_fake.png").read_bytes() == path.read_bytes()
    md = (tmp_path / "out" / "bench_fake.md").read_text()
    assert "| shape | torch us | jax_dg us | torch/jax_dg | note |" in md and "| M64 N128 | 10.000 |" in md
    assert '"name": "bench_fake"' in (tmp_path / "out" / "bench.jsonl").read_text()
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-3:] == plot.table_text("fake op", ROWS, COLUMNS).splitlines()[-3:]
    assert " M128 N128      12.000" in out and "0.750" in out and f"plot: {path}" in out


def test_without_matplotlib_the_table_is_printed_and_the_plot_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    assert plot.write("bench_fake", "fake op", ROWS, COLUMNS, label="shape", ratios=["torch/jax_dg"],
                      plots=tmp_path) is None
    out = capsys.readouterr().out
    assert "(plot bench_fake.png skipped: matplotlib is not installed" in out
    assert "== fake op ==" in out and "1.250" in out
    assert not list(tmp_path.iterdir())


def plot_call(script: pathlib.Path) -> ast.Call:
    calls = [n for n in ast.walk(ast.parse(script.read_text())) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == "plot.write"]
    assert len(calls) == 1, f"{script.name}: one plot.write call (every benchmark writes through it)"
    return calls[0]


def test_every_benchmark_writes_through_the_shared_helper():
    assert {s.name for s in SCRIPTS} >= {"bench_gemm.py", "bench_grouped.py", "bench_small.py",
                                         "bench_train.py", "bench_mqa.py", "bench_paged_mqa.py",
                                         "bench_indexer.py"}
    for script in SCRIPTS:
        compile(script.read_text(), str(script), "exec")
        call = plot_call(script)
        assert ast.literal_eval(call.args[0]) == script.stem   # plots/<script name>.png
        assert "timing.report" not in script.read_text() and "timing.plot" not in script.read_text()


@needs_matplotlib
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.stem)
def test_each_benchmarks_plot_on_made_up_numbers(script, tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    call = plot_call(script)
    name, title, columns = (ast.literal_eval(call.args[i]) for i in (0, 1, 3))
    kwargs = {k.arg: eval(compile(ast.Expression(k.value), script.name, "eval"), {})  # noqa: S307
              for k in call.keywords}
    keys = [k for k, _ in columns]
    assert set(kwargs["ratios"]) <= set(keys), "every plotted ratio is in the table"
    rows = [{k: 0.5 + 0.25 * (i + j) for j, k in enumerate(keys)} for i in range(3)]
    path = plot.write(name, title, rows, columns, plots=tmp_path, **kwargs)
    assert path == tmp_path / f"{script.stem}.png" and path.read_bytes().startswith(PNG)


def run_tiny(name, monkeypatch, tmp_path):
    """benchmarks/<name>.py --tiny in this process (its imports are the benchmarks' own modules),
    writing to tmp_path: the rows it wrote."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.plot, "PLOTS", tmp_path)
    bench.main(["--tiny"])
    return json.loads((tmp_path / "bench.jsonl").read_text().splitlines()[-1])["rows"]


def test_bench_block_runs_tiny_on_cpu(monkeypatch, tmp_path):
    """bench_block.py's harness end to end at toy sizes, both sides on jax_dg's torch emulation
    of deep_gemm (the benchmark itself needs a GPU; this keeps its code running): the V3.2 block
    and each layer, prefill and decode, and the toy block's training step."""
    pytest.importorskip("flax.nnx")
    rows = run_tiny("bench_block", monkeypatch, tmp_path)
    assert [(r["step"], r["layer"]) for r in rows] == [
        ("prefill", "block"), ("prefill", "attention"), ("prefill", "moe"), ("decode", "block"),
        ("decode", "attention"), ("decode", "indexer"), ("decode", "moe"), ("training", "toy block")]
    checks = {(r["step"], r["layer"]): r["rel_err"] for r in rows}
    assert all(v < 2e-3 for k, v in checks.items() if k[1] not in ("indexer", "toy block"))   # calc_diff
    assert checks[("decode", "indexer")] < 0.05        # the share of top-k positions that differ
    assert checks[("training", "toy block")] < 1e-3    # the losses' relative difference
    moe = next(r for r in rows if r["step"] == "decode" and r["layer"] == "moe")
    assert moe["floor_us"] > 0


def test_bench_decode_runs_tiny_on_cpu(monkeypatch, tmp_path):
    """bench_decode.py's token loop (jax_dg in one jit, the torch route) at small shapes."""
    rows = run_tiny("bench_decode", monkeypatch, tmp_path)
    assert [r["shape"] for r in rows] == ["B2 ctx256 next_n1", "B2 ctx256 next_n2"]
    assert all(r["jax_dg_us"] > 0 and r["torch_us"] > 0 for r in rows)


@pytest.mark.parametrize("stored", [False, True])
def test_the_torch_v32_block_is_jax_dg_nn_block(stored):
    """benchmarks/torch_block.py's V32Block (bench_block's PyTorch rival of jax_dg.nn.Block, on
    deep_gemm's API: here jax_dg's torch emulation) computes the same block from the same weights:
    the caches it writes are byte for byte jax_dg's (the FP8 latent rows, the indexer's keys), its
    outputs within DeepSeek's bf16 einsums of jax_dg's float32 attention sums. With the
    checkpoint's stored FP8 weights and UE8M0 scales, and with bf16 masters."""
    pytest.importorskip("flax.nnx")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jax_dg
    from tests.conftest import on_deep_gemm
    from tests.nn.test_block import cache_for, make_block
    spec = importlib.util.spec_from_file_location("torch_block", BENCH / "torch_block.py")
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    block = make_block(fp8_weights=stored, scale_fmt="ue8m0" if stored else None)
    twin = tb.V32Block(tb.deep_gemm_or_emulation(), block)
    s = 40
    x = jax.random.normal(jax.random.PRNGKey(1), (1, s + 1, 256), jnp.bfloat16)
    want, cache = nnx.jit(lambda m, x, c: m.prefill(x, jnp.array([s]), c))(block, x[:, :s], cache_for(block.attn, [s + 1]))
    empty = cache_for(block.attn, [s + 1])
    state = [tb.to_torch(a) for a in (empty.latent, empty.index_keys, empty.block_tables, empty.context_lens)]
    got = twin.prefill(tb.to_torch(x[0, :s]), state)
    # measured 4.4e-4 (bf16 einsums and softmax against float32 ones, through the MoE's FP8 casts)
    limit = 1e-2 if on_deep_gemm() else 2e-3
    assert jax_dg.calc_diff(np.asarray(want[0], np.float32), got.float().cpu().numpy()) < limit
    if not on_deep_gemm():   # the same projections on both sides: the same bytes
        np.testing.assert_array_equal(state[0].numpy(), np.asarray(cache.latent))
        np.testing.assert_array_equal(state[1].numpy(), np.asarray(cache.index_keys))
    want, after = nnx.jit(lambda m, x, c: m.decode(x, c))(block, x[:, s], cache)
    got = twin.decode(tb.to_torch(x[:, s]), state)
    assert state[3].tolist() == after.context_lens.tolist() == [s + 1]
    assert jax_dg.calc_diff(np.asarray(want, np.float32), got.float().cpu().numpy()) < limit
