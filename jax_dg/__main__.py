"""`python -m jax_dg info`: what jax_dg sees here and what each op runs on.

Reports the platform, jax/jaxlib/torch versions, the devices with their arch, where deep_gemm
was found and its version (or why it was not), which ops run natively on DeepGEMM here and
which fall back to a reference (and why), and DeepGEMM's JIT cache folder.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return f"not importable ({type(e).__name__}: {e})"


def op_status(op, platform_name: str, family: str | None, backend: str) -> tuple[str, str]:
    """(what a call does here: "native", "reference" or "raises", why) for one registered op."""
    from jax_dg.backends import deep_gemm
    if backend == "xla":
        return "reference", "pure-JAX reference (JAX_DG_BACKEND=xla)"
    if backend == "torch":
        return "reference", "torch reference through the bridge (JAX_DG_BACKEND=torch)"
    if platform_name != "gpu":
        return "reference", f"torch reference through the bridge ({platform_name}: no CUDA device)"
    if family not in op.archs:
        return "raises", (f"UnsupportedArchError: no DeepGEMM kernel on {family} (needs "
                          f"{', '.join(sorted(op.archs))}); JAX_DG_BACKEND=torch or xla runs the reference")
    if deep_gemm.module() is None:
        return "raises", f"deep_gemm not importable; {deep_gemm.INSTALL_HINT}"
    missing = [k for k in op.kernels if deep_gemm.resolve(k) is None]
    if missing:
        return "raises", (f"deep_gemm {deep_gemm.version()} lacks {', '.join(missing)}; "
                          f"JAX_DG_BACKEND=torch or xla runs the reference")
    names = []
    for k in op.kernels:
        fn = deep_gemm.resolve(k)
        names.append(getattr(fn, "__name__", k))
    return "native", "DeepGEMM: " + ", ".join(names)


def _import_all_ops() -> list[str]:
    """Imports every op module so that every op is registered; returns import failures."""
    import importlib
    import pkgutil

    import jax_dg.ops
    failures = []
    for mod in pkgutil.iter_modules(jax_dg.ops.__path__):
        try:
            importlib.import_module(f"jax_dg.ops.{mod.name}")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            failures.append(f"jax_dg.ops.{mod.name}: {type(e).__name__}: {e}")
    return failures


def collect() -> dict[str, Any]:
    """Everything `info` prints, as data (the tests read it)."""
    import jax

    import jax_dg
    from jax_dg import backends, capability
    from jax_dg.backends import deep_gemm
    from jax_dg.core import bridge

    info: dict[str, Any] = {
        "jax_dg": getattr(jax_dg, "__version__", "unknown"),
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "torch": _version("torch"),
        "default_backend": jax.default_backend(),
    }
    try:
        import torch
        info["torch_cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        info["torch_cuda"] = None
    try:
        info["requested_backend"] = backends.requested()
    except ValueError as e:
        info["requested_backend"] = f"invalid ({e})"
    devices = []
    for dev in jax.devices():
        devices.append({"id": dev.id, "platform": dev.platform, "kind": dev.device_kind,
                        "arch": capability.device_arch(dev), "family": capability.arch_family(dev),
                        "deep_gemm_supported": capability.is_deep_gemm_supported(dev)})
    info["devices"] = devices
    dg = deep_gemm.module()
    if dg is None:
        info["deep_gemm"] = {"found": False, "why": deep_gemm.import_error(),
                             "installed": capability.has_deep_gemm(), "hint": deep_gemm.INSTALL_HINT}
    else:
        info["deep_gemm"] = {"found": True, "module": dg.__name__, "version": deep_gemm.version(),
                             "path": os.path.dirname(getattr(dg, "__file__", "") or "")}
    info["jit_cache_dir"] = os.environ.get("DG_JIT_CACHE_DIR")
    info["e8m0_used"] = capability.is_deep_gemm_e8m0_used()
    info["scale_format"] = capability.DeepGemmQuantScaleFMT.from_oracle().name
    info["op_import_failures"] = _import_all_ops()
    first = jax.devices()[0]
    family = capability.arch_family(first)
    backend = info["requested_backend"]
    ops = []
    for name in sorted(n for n in bridge._OPS if not n.startswith("_")):  # "_": test-only ops
        op = bridge._OPS[name]
        mode, how = op_status(op, first.platform, family, backend)
        ops.append({"name": name, "kernels": list(op.kernels), "archs": sorted(op.archs),
                    "native": mode == "native", "mode": mode, "how": how})
    info["ops"] = ops
    return info


def format_info(info: dict[str, Any]) -> str:
    lines = [f"jax_dg {info['jax_dg']}",
             f"platform      {info['platform']}, Python {info['python']}",
             f"versions      jax {info['jax']}, jaxlib {info['jaxlib']}, torch {info['torch']}"
             + (f" (CUDA {info['torch_cuda']})" if info.get("torch_cuda") else ""),
             f"jax backend   {info['default_backend']}; JAX_DG_BACKEND={info['requested_backend']}"]
    for d in info["devices"]:
        arch = f", {d['arch']} ({d['family']} family)" if d["arch"] else ""
        lines.append(f"device {d['id']:<6} {d['kind']} [{d['platform']}]{arch}; "
                     f"DeepGEMM supported: {'yes' if d['deep_gemm_supported'] else 'no'}")
    dg = info["deep_gemm"]
    if dg["found"]:
        lines.append(f"deep_gemm     {dg['version']} ({dg['module']}) at {dg['path']}")
    else:
        lines.append(f"deep_gemm     not found: {dg['why']}")
    lines.append(f"JIT cache     {info['jit_cache_dir'] or '(unset)'} (DG_JIT_CACHE_DIR)")
    lines.append(f"scales        {info['scale_format']} (E8M0 used: {'yes' if info['e8m0_used'] else 'no'})")
    native = [o for o in info["ops"] if o["native"]]
    lines.append(f"ops           {len(native)} of {len(info['ops'])} run natively on DeepGEMM here")
    width = max((len(o["name"]) for o in info["ops"]), default=0)
    for failure in info.get("op_import_failures", []):
        lines.append(f"  (could not import {failure})")
    for o in info["ops"]:
        lines.append(f"  {o['name']:<{width}}  {o['mode']:<9}  {o['how']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_dg", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="info", choices=["info"],
                        help="what to do (default: info)")
    parser.parse_args(argv)
    print(format_info(collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
