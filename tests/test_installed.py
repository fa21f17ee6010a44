"""The installed wheel (scripts/test_versions.sh's wheel leg sets JAX_DG_EXPECT_INSTALLED=1): jax_dg
and its compiled FFI modules load from site-packages, not from a source tree, and every module the
wheel ships imports."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import sysconfig

import pytest

import jax_dg

pytestmark = pytest.mark.skipif(os.environ.get("JAX_DG_EXPECT_INSTALLED") != "1",
                                reason="checks an installed wheel (JAX_DG_EXPECT_INSTALLED=1)")

SITE = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}


def in_site_packages(file: str) -> bool:
    return any(site in pathlib.Path(file).resolve().parents for site in SITE)


def test_jax_dg_and_its_ffi_modules_load_from_site_packages():
    from jax_dg.core import _bridge, _check, _native
    for module in (jax_dg, _bridge, _check, _native):
        assert in_site_packages(module.__file__), (module.__file__, SITE)


def test_installed_from_a_wheel_not_editable():
    dist = importlib.metadata.distribution("jax_dg")
    assert "dir_info" not in json.loads(dist.read_text("direct_url.json") or "{}")


def test_every_module_the_wheel_ships_imports():
    files = [f for f in importlib.metadata.files("jax_dg") if f.parts[0] == "jax_dg"]
    assert {f.name.split(".")[0] for f in files if f.suffix == ".so"} == {"_bridge", "_check", "_native"}
    modules = sorted(".".join(f.with_suffix("").parts).removesuffix(".__init__")
                     for f in files if f.suffix == ".py")
    assert {"jax_dg.core.op", "jax_dg.operands.paged", "jax_dg.tools.warmup", "jax_dg.nn.moe"} <= set(modules)
    has_flax = importlib.util.find_spec("flax") is not None
    for name in modules:
        if name.startswith("jax_dg.nn") and not has_flax:   # the optional extra: it says so
            with pytest.raises(ImportError, match=r"jax_dg\[flax\]"):
                importlib.import_module(name)
            continue
        assert in_site_packages(importlib.import_module(name).__file__), name
