"""torch is optional (the `torch` extra): what works without it, and what says which extra to
install. A subprocess makes torch unimportable (a meta-path finder that refuses it), as in an
environment where it was never installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import jax_dg
from jax_dg.backends import optional

BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys
    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch.") or name == "deep_gemm":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, NoTorch())
""")


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


def test_import_and_the_xla_backend_work_without_torch():
    res = run_without_torch("""
        import sys, time
        t0 = time.perf_counter()
        import jax, jax.numpy as jnp
        import jax_dg
        assert "torch" not in sys.modules, "import jax_dg imported torch"
        x = jnp.ones((128, 256), jnp.bfloat16)
        with jax_dg.use_backend("xla"):      # every op's pure-JAX reference: no torch
            a = jax_dg.per_token_cast_to_fp8(x)
            b = jax_dg.per_block_cast_to_fp8(x)
            y = jax.jit(jax_dg.fp8_gemm_nt)(a, b)
        idx = jax_dg.topk_indices(jnp.ones((4, 64)), 8)   # jax_dg's own C++ kernel: no torch
        assert "torch" not in sys.modules
        print("ok", y.shape, idx.shape)
    """)
    assert res.returncode == 0 and "ok (128, 128) (4, 8)" in res.stdout, res.stderr[-3000:]


def test_the_emulation_without_torch_names_the_extra():
    res = run_without_torch("""
        import jax.numpy as jnp, jax_dg
        with jax_dg.use_backend("torch"):
            jax_dg.fp8_gemm_nt(jax_dg.per_token_cast_to_fp8(jnp.ones((128, 256))),
                               jax_dg.per_block_cast_to_fp8(jnp.ones((128, 256))))
    """)
    assert res.returncode != 0 and "MissingTorchError" in res.stderr
    assert "pip install 'jax_dg[torch]'" in res.stderr, res.stderr[-3000:]


def test_interop_without_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` raises ImportError
    import jax.numpy as jnp
    with pytest.raises(optional.MissingTorchError, match=r"jax_dg.interop needs torch.*jax_dg\[torch\]"):
        jax_dg.interop.to_torch(jnp.ones(3))
    with pytest.raises(ImportError, match="jax_dg\\[torch\\]"):   # a subclass of ImportError
        optional.torch("the torch emulation")
    assert optional.has_torch() in (True, False)
