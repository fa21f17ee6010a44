"""`python -m jax_dg info`."""

from __future__ import annotations

import subprocess
import sys

from jax_dg import __main__ as cli
from jax_dg.core import bridge


def test_collect_lists_every_registered_op_with_its_resolution():
    info = cli.collect()
    names = {o["name"] for o in info["ops"]}
    assert {"fp8_gemm_nt", "bf16_mega_gate", "mega_mhc"} <= names
    assert names == {n for n in bridge._OPS if not n.startswith("_")}
    assert not info["op_import_failures"]
    gate = next(o for o in info["ops"] if o["name"] == "bf16_mega_gate")
    assert gate["archs"] == ["sm100"] and gate["kernels"] == ["bf16_mega_gate"]
    for key in ("jax", "jaxlib", "torch", "platform", "devices", "deep_gemm", "jit_cache_dir"):
        assert key in info
    if info["default_backend"] == "cpu":
        assert not any(o["native"] for o in info["ops"])
        assert {o["mode"] for o in info["ops"]} == {"reference"}
        assert all("torch reference" in o["how"] for o in info["ops"])
        assert info["devices"][0]["arch"] is None


def test_op_status_reasons():
    op = bridge._OPS["bf16_mega_gate"]
    mode, how = cli.op_status(op, "gpu", "sm90", "auto")
    assert mode == "raises" and "UnsupportedArchError" in how and "needs sm100" in how
    assert cli.op_status(op, "gpu", "sm100", "xla") == ("reference", "pure-JAX reference (JAX_DG_BACKEND=xla)")
    assert cli.op_status(op, "cpu", None, "auto")[0] == "reference"
    assert "torch reference" in cli.op_status(op, "cpu", None, "auto")[1]


def test_main_prints_the_report(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "jax_dg" in out and "deep_gemm" in out and "DG_JIT_CACHE_DIR" in out
    assert "bf16_mega_gate" in out and "run natively on DeepGEMM here" in out


def test_python_dash_m_info():
    res = subprocess.run([sys.executable, "-m", "jax_dg", "info"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "jax backend" in res.stdout and "fp8_gemm_nt" in res.stdout
