"""`python -m jax_dg info`."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax_dg
from jax_dg import __main__ as cli
from jax_dg.core import registry


def test_collect_lists_what_a_user_calls_with_what_it_runs_on():
    info = cli.collect()
    names = {f["name"] for f in info["functions"]}
    assert {"fp8_gemm_nt", "mqa_logits", "paged_mqa_logits", "bf16_mega_gate", "mega_mhc",
            "per_token_cast_to_fp8", "paged.pack_kv_cache"} <= names
    assert not [n for n in names if n.endswith("_varlen") or n.startswith("_")]   # internal records
    assert names <= set(jax_dg.__all__) | {f"paged.{n}" for n in jax_dg.operands.paged.__all__}
    # every registered op is reachable from some public function
    exposed = {op for f in info["functions"] for op in f["ops"]}
    assert exposed == {n for n in registry.ops() if not n.startswith("_")}
    gate = next(f for f in info["functions"] if f["name"] == "bf16_mega_gate")
    assert gate["ops"] == ["bf16_mega_gate"]
    helpers = {f["name"]: f for f in info["functions"] if f["mode"] == "helper"}
    assert "host" in helpers["calc_diff"]["how"] and "pure JAX" not in helpers["calc_diff"]["how"]
    for name in ("use_backend", "checked", "mk_alignment_scope"):
        assert helpers[name]["how"].startswith("a context manager"), helpers[name]
    assert helpers["contiguous_layout"]["how"] == "pure JAX (no custom call)"
    for key in ("jax", "jaxlib", "torch", "platform", "devices", "deep_gemm", "jit_cache_dir"):
        assert key in info
    if info["default_backend"] == "cpu":
        kernels = [f for f in info["functions"] if f["ops"]]
        assert not any(f["native"] for f in kernels)
        # "reference" is the pure-JAX oracle only: neither the emulation nor jax_dg's C++ kernels
        assert {f["mode"] for f in kernels} == {"emulated", "cpu kernel"}
        assert all(("torch emulation" in f["how"]) == (f["mode"] == "emulated") for f in kernels)
        assert next(f for f in kernels if f["name"] == "topk_indices")["how"].startswith(
            "jax_dg's own kernel topk (its C++ twin on cpu")
        assert info["devices"][0]["arch"] is None


def test_op_status_reasons():
    op = registry.op("bf16_mega_gate")
    mode, how = cli.op_status(op, "gpu", "sm90", "auto")
    assert mode == "raises" and "UnsupportedArchError" in how and "needs sm100" in how
    assert cli.op_status(op, "gpu", "sm100", "xla") == ("reference", "pure-JAX reference (JAX_DG_BACKEND=xla)")
    assert cli.op_status(op, "cpu", None, "auto")[0] == "emulated"
    assert "torch emulation" in cli.op_status(op, "cpu", None, "auto")[1]


def test_jax_dgs_own_kernels_are_not_looked_for_in_deep_gemm(monkeypatch):
    # the logits ops declare jax_dg's -inf kernel next to DeepGEMM's: a DeepGEMM that has the
    # logits kernel runs them natively
    from jax_dg.backends import deep_gemm
    from jax_dg.core import native
    ops = registry.ops()
    monkeypatch.setattr(native, "cuda_built", lambda: True)   # as on a GPU install
    monkeypatch.setattr(deep_gemm, "module", lambda: object())
    monkeypatch.setattr(deep_gemm, "lookup", lambda name: (lambda: None) if name == "fp8_fp4_mqa_logits" else None)
    mode, how = cli.op_status(ops["fp8_fp4_mqa_logits"], "gpu", "sm90", "auto")
    assert mode == "native" and "neg_inf_outside" in how and "lacks" not in how
    mode, how = cli.op_status(ops["topk_rows"], "gpu", "sm90", "auto")
    assert mode == "native" and how.startswith("jax_dg's own kernel topk (CUDA)")


def test_a_function_runs_as_its_least_capable_op(monkeypatch):
    from jax_dg.core import native
    monkeypatch.setattr(native, "cuda_built", lambda: True)   # as on a GPU install
    mode, how, names = cli.function_status(jax_dg.paged_mqa_logits, "gpu", "sm100", "torch")
    assert mode == "emulated" and set(names) == {"fp8_fp4_paged_mqa_logits",
                                                  "get_paged_mqa_logits_metadata", "paged_sanitise"}
    assert cli.function_status(jax_dg.fp8_gemm_tn, "gpu", "sm90", "auto")[0] == "raises"


def test_main_prints_the_report(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "jax_dg" in out and "deep_gemm" in out and "DG_JIT_CACHE_DIR" in out
    assert "bf16_mega_gate" in out and "mqa_logits" in out and "run natively here" in out
    gpu = any(d.platform == "gpu" for d in jax.devices())
    if "not found" in out.split("deep_gemm", 2)[-1].splitlines()[0]:
        # the install hint where DeepGEMM would run; on CPU auto already runs the emulation
        assert ("Install DeepGEMM" in out) == gpu and "JAX_DG_BACKEND=torch" not in out


def test_python_dash_m_info():
    res = subprocess.run([sys.executable, "-m", "jax_dg", "info"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "jax backend" in res.stdout and "fp8_gemm_nt" in res.stdout
