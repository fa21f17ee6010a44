"""jax_dg.warmup and `python -m jax_dg warmup`: call sites found, progress, DeepGEMM's cache."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_dg
from jax_dg import __main__ as cli
from jax_dg.tools import warmup
from tests.test_examples import load

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZES = ["--seq", "48", "--keys", "320", "--topk", "32"]


@pytest.fixture(scope="module")
def example():
    return load("indexer_topk")


def shapes(example, seq=48, keys=320):
    return jax.eval_shape(lambda k: example.make_inputs(k, seq, keys, 64, 128), jax.random.PRNGKey(0))


def on_cpu():
    return jax.default_backend() == "cpu"


@pytest.mark.skipif(not on_cpu(), reason="the CPU report")
def test_on_cpu_nothing_compiles_and_the_call_sites_are_listed(example):
    log = io.StringIO()
    report = jax_dg.warmup(example.indexer_step, *shapes(example), topk=32, log=log)
    text = log.getvalue()
    assert "no kernels to compile" in text and "torch emulation on cpu" in text
    assert report.sites == 1 and [v.op for v in report.variants] == ["indexer_topk"]
    v = report.variants[0]
    assert v.kind == "emulated" and v.status == "skipped" and v.static["k"] == 32
    assert v.inputs["q"] == "float8_e4m3fn[48,64,128]" and v.inputs["cu_seqlen_ke"] == "int32[48]"
    # one line naming the ops, not every variant's signature (the report has those)
    assert len(text.splitlines()) == 1 and "(indexer_topk)" in text and v.label() not in text
    assert "no kernels to compile" in report.summary() and report.summary() in str(report)
    assert v.label() in str(report) and report.cache_dir in str(report)


def test_jitted_and_plain_functions_kwargs_and_repeated_sites(example):
    inputs = shapes(example)
    step = jax.jit(example.indexer_step, static_argnames=("topk", "sorted"))
    jitted = jax_dg.warmup(step, *inputs, topk=16, sorted=False, progress="off")
    plain = jax_dg.warmup(example.indexer_step, *inputs, topk=16, sorted=False, progress="off")
    assert [(v.op, v.static, v.inputs) for v in jitted.variants] == \
           [(v.op, v.static, v.inputs) for v in plain.variants]
    assert jitted.variants[0].static["k"] == 16 and jitted.variants[0].static["sorted"] is False

    def two_steps(*a):   # the same variant twice, another op once: two variants, three sites
        return step(*a, topk=16), jax_dg.mqa_logits(*a), step(*a, topk=16)
    report = jax_dg.warmup(two_steps, *inputs, progress="off")
    assert report.sites == 3 and [v.op for v in report.variants] == ["indexer_topk", "fp8_fp4_mqa_logits"]
    assert [v.sites for v in report.variants] == [2, 1]


def test_call_sites_inside_loops_and_vmap(example):
    (qv, qs), kv, w, ks, ke = shapes(example)
    batched = [jax.ShapeDtypeStruct((3, *x.shape), x.dtype) for x in (qv, qs, w, ks, ke)]

    def per_batch(qv, qs, kv, w, ks, ke):   # vmapped over the queries: folded into one call
        return jax_dg.mqa_logits((qv, qs), kv, w, ks, ke)
    folded = jax_dg.warmup(jax.vmap(per_batch, in_axes=(0, 0, None, 0, 0, 0)),
                           batched[0], batched[1], kv, *batched[2:], progress="off")
    assert folded.variants[0].inputs["q"] == "float8_e4m3fn[144,64,128]"

    def scanned(q, kv, w, ks, ke):          # inside a scan body: found, at the body's shapes
        def body(c, x):
            return c, jax_dg.topk_indices(x, 8)
        return jax.lax.scan(body, 0, jnp.stack([jax_dg.mqa_logits(q, kv, w, ks, ke)] * 2))[1]
    report = jax_dg.warmup(scanned, (qv, qs), kv, w, ks, ke, progress="off")
    # jax_dg's own top-k kernel is built at install: not a call site to warm up
    assert [v.op for v in report.variants] == ["fp8_fp4_mqa_logits"]
    own = warmup.ffi_eqns(jax.make_jaxpr(scanned)(*jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), ((qv, qs), kv, w, ks, ke))).jaxpr, own=True)
    assert [str(e.params["target_name"]) for e in own][-1] == "jax_dg_native_topk"


def test_the_xla_backend_has_no_call_sites(example):
    log = io.StringIO()
    with jax_dg.use_backend("xla"):
        report = jax_dg.warmup(example.indexer_step, *shapes(example), topk=32, log=log)
    assert report.variants == [] and report.sites == 0
    assert "no jax_dg call sites (JAX_DG_BACKEND=xla" in log.getvalue()


def test_run_fn_runs_it_once_on_arrays_only(example):
    inputs = example.make_inputs(jax.random.PRNGKey(1), 48, 320, 64, 128)
    log = io.StringIO()
    report = jax_dg.warmup(example.indexer_step, *inputs, topk=32, run_fn=True, log=log)
    assert report.run_seconds is not None and "first run of the function" in log.getvalue()
    with pytest.raises(ValueError, match="ShapeDtypeStructs"):
        jax_dg.warmup(example.indexer_step, *shapes(example), topk=32, run_fn=True, progress="off")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_a_bar_on_a_terminal_log_lines_otherwise(example, monkeypatch):
    # The bar is drawn before each DeepGEMM variant: take the main job's variant for one (on
    # CPU its replay runs the torch emulation through the bridge).
    monkeypatch.setattr(warmup, "_kind", lambda backend: "deep_gemm")
    inputs = shapes(example)

    def written(log, **kw):
        jax_dg.warmup(example.indexer_step, *inputs, topk=32, log=log, **kw)
        return log.getvalue()
    bar = written(Terminal())
    assert "\r\x1b[K[----" in bar and "] 0/1 indexer_topk: compiling..." in bar
    assert bar.endswith("\n") and "  [1/1] indexer_topk(" in bar   # results stay, the bar goes
    lines = written(io.StringIO())
    assert "\r" not in lines and "  [1/1] indexer_topk(" in lines
    assert len(lines.splitlines()) == 3    # header, the variant, the summary
    assert "\r" in written(io.StringIO(), progress="bar")
    assert written(Terminal(), progress="off") == ""
    assert "\r" not in written(Terminal(), progress="lines")
    with pytest.raises(ValueError, match="progress"):
        jax_dg.warmup(example.indexer_step, *inputs, topk=32, progress="fancy")


def test_a_replay_that_adds_no_cache_entry_is_a_cache_hit(example, monkeypatch, tmp_path):
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warmup, "_kind", lambda backend: "deep_gemm")
    report = jax_dg.warmup(example.indexer_step, *shapes(example), topk=32, progress="off")
    assert report.cache_dir == str(tmp_path)
    assert [v.status for v in report.variants] == ["cached"] and report.variants[0].seconds > 0
    assert "0 kernel(s) for 0 variant(s), 1 variant(s) hit the cache" in report.summary()


def test_cache_entries_are_deep_gemms_kernel_folders(tmp_path):
    assert warmup.cache_entries(str(tmp_path)) == set()
    (tmp_path / "cache" / "kernel.sm90_fp8_mqa_logits.0123abcd").mkdir(parents=True)
    (tmp_path / "tmp").mkdir()   # compiles in flight
    entries = warmup.cache_entries(str(tmp_path))
    assert entries == {"kernel.sm90_fp8_mqa_logits.0123abcd"}
    assert warmup.kernel_name(entries.pop()) == "sm90_fp8_mqa_logits"
    assert warmup.kernel_name("odd") == "odd"


@pytest.mark.skipif(not on_cpu(), reason="the CPU report")
def test_cli_warmup_of_the_example(capsys):
    assert cli.main(["warmup", "--progress", "lines", "examples/indexer_topk.py", *SIZES]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"{job}: no kernels to compile: 1 variant(s) at 1 jax_dg call site(s), they run the torch "
        "emulation on cpu" for job in ("indexer step", "indexer step, unsorted", "mqa_logits")]
    assert err == ""   # nothing compiles on CPU: the summaries say it once, no progress
    assert cli.main(["warmup", "--json", "--progress", "off", "examples/indexer_topk.py", *SIZES]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["job"] for r in reports] == ["indexer step", "indexer step, unsorted", "mqa_logits"]
    assert reports[1]["variants"][0]["static"]["sorted"] is False


def test_cli_warmup_errors(capsys, tmp_path):
    assert cli.main(["warmup", str(tmp_path / "missing.py")]) == 2
    assert "no warm-up script" in capsys.readouterr().err
    script = tmp_path / "plain.py"
    script.write_text("x = 1\n")
    assert cli.main(["warmup", str(script)]) == 2
    assert "defines no warmup_jobs" in capsys.readouterr().err


def test_the_example_warms_up_first(example, capsys):
    assert example.main([*SIZES, "--iters", "1", "--warmup"]) == 0
    captured = capsys.readouterr()
    assert "OK" in captured.out and "jax_dg warm-up" in captured.err


# --- GPU: DeepGEMM compiles once, then its cache answers -----------------------------------------

def _child(cache: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DG_JIT_CACHE_DIR=str(cache), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def _json_from(stdout: str, start: str):
    """The JSON document starting at `start` (DeepGEMM's printf output may surround it)."""
    return json.JSONDecoder().raw_decode(stdout[stdout.index(start):])[0]


# The second run: warm-up through the API, then the jobs for real on concrete inputs; the real run
# must add no cache entry (the warm-up compiled every variant the job launches).
SECOND_RUN = """
import json, os, jax, jax_dg
from jax_dg.tools import warmup
from tests.test_examples import load
ex = load("indexer_topk")
reports = [jax_dg.warmup(fn, *args, progress="lines", **kw) for _, fn, args, kw in ex.warmup_jobs([])]
before = warmup.cache_entries(os.environ["DG_JIT_CACHE_DIR"])
a = ex.parse_args([])
inputs = ex.make_inputs(jax.random.PRNGKey(0), a.seq, a.keys, a.heads, a.dim)
for _, fn, _, kw in ex.warmup_jobs([]):
    jax.block_until_ready(jax.jit(lambda *x: fn(*x, **kw))(*inputs))
after = warmup.cache_entries(os.environ["DG_JIT_CACHE_DIR"])
print(json.dumps({"reports": [r.as_dict() for r in reports], "new": sorted(after - before)}))
"""


@pytest.mark.gpu
def test_gpu_warmup_of_the_main_job_compiles_then_hits_the_cache(tmp_path):
    cache = tmp_path / "dg_cache"
    first = _child(cache, "-m", "jax_dg", "warmup", "--json", "--progress", "lines")
    reports = _json_from(first.stdout, '[\n {\n  "job"')
    variants = [v for r in reports for v in r["variants"]]
    assert all(r["cache_dir"] == str(cache) for r in reports)
    assert {v["kind"] for v in variants} == {"deep_gemm"}
    compiled = [v for v in variants if v["status"] == "compiled"]
    assert compiled and all(v["kernels"] for v in compiled)
    assert {v["status"] for v in variants} <= {"compiled", "cached"}
    assert len(warmup.cache_entries(str(cache))) == sum(len(v["kernels"]) for v in compiled)
    assert "compiled" in first.stderr and "DeepGEMM JIT cache: " + str(cache) in first.stderr

    second = _json_from(_child(cache, "-c", SECOND_RUN).stdout, '{"reports"')
    again = [v for r in second["reports"] for v in r["variants"]]
    assert [v["status"] for v in again] == ["cached"] * len(variants)
    assert all(" 0 kernel(s) for 0 variant(s)" in r["summary"] for r in second["reports"])
    assert second["new"] == []


@pytest.mark.gpu
def test_gpu_warmup_replays_gemm_grouped_and_paged_sites_then_the_step_compiles_nothing():
    # Zero integer operands (masked_m, lengths, block tables; the schedule follows) on real
    # kernels, and the warm-up's variants are the ones the step launches: running it adds no
    # cache entry.
    from tests.ops.test_grouped import cast_a, cast_b
    from tests.ops.test_paged_mqa import gpu_case
    k = jax.random.split(jax.random.PRNGKey(11), 4)
    a = jax_dg.per_token_cast_to_fp8(jax.random.normal(k[0], (128, 512), jnp.bfloat16))
    b = jax_dg.per_block_cast_to_fp8(jax.random.normal(k[1], (256, 512), jnp.bfloat16))
    ga = cast_a(jax.random.normal(k[2], (2, 128, 512), jnp.bfloat16))
    gb = cast_b(jax.random.normal(k[3], (2, 256, 512), jnp.bfloat16))
    masked_m = jnp.asarray([100, 37], jnp.int32)
    q, cache, w, lens, table, max_len = gpu_case(64, 1, 64, avg=2048, seed=3)

    @jax.jit
    def step(a, b, ga, gb, masked_m, q, cache, w, lens, table):
        return (jax_dg.fp8_gemm_nt(a, b), jax_dg.m_grouped_fp8_gemm_nt_masked(ga, gb, masked_m, 64),
                jax_dg.paged_mqa_logits(q, cache, w, lens, table, max_model_len=max_len))
    args = (a, b, ga, gb, masked_m, q, cache, w, lens, table)
    log = io.StringIO()
    report = jax_dg.warmup(step, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args),
                           progress="lines", log=log)
    assert len(report.variants) == 3 and {v.kind for v in report.variants} == {"deep_gemm"}, log.getvalue()
    assert {v.status for v in report.variants} <= {"compiled", "cached"}
    before = warmup.cache_entries(report.cache_dir)
    jax.block_until_ready(step(*args))
    assert warmup.cache_entries(report.cache_dir) == before
