"""`python -m jax_dg info`: what jax_dg sees here and what each public function runs on;
`python -m jax_dg warmup [SCRIPT]`: compiles a script's DeepGEMM kernels ahead (jax_dg.warmup).

`info` reports the platform, jax/jaxlib/torch versions, the devices with their arch, where deep_gemm
was found and its version (or why it was not, with the install hint), for each function a user
calls what a call runs here (DeepGEMM or jax_dg's CUDA kernel natively, jax_dg's C++ kernel on
CPU, DeepGEMM's torch emulation, the pure-JAX reference, or an error, and why), and
DeepGEMM's JIT cache folder.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import platform
import sys
from typing import Any


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return f"not importable ({type(e).__name__}: {e})"


# What a call of a kernel function does here, as `info` names it. "reference" means the pure-JAX
# oracle only (jax_dg/reference), as everywhere in jax_dg.
MODES = {
    "native": "DeepGEMM's kernel, or jax_dg's own CUDA kernel, on this GPU",
    "cpu kernel": "jax_dg's own kernel as C++ on the CPU (bitwise its CUDA twin)",
    "emulated": "DeepGEMM's kernel emulated in torch, through the FFI bridge",
    "reference": "the pure-JAX reference traced in place of the op (no custom call)",
    "raises": "an error while tracing",
}


def op_status(op, platform_name: str, family: str | None, backend: str) -> tuple[str, str]:
    """(what a call does here: one of MODES, why) for one Op record, as
    jax_dg.core.dispatch.resolve decides it for a call traced on this platform."""
    from jax_dg import contracts
    from jax_dg.backends import deep_gemm, emulated
    from jax_dg.core import backend as selection
    from jax_dg.core import dispatch
    from jax_dg.core.device import Target
    where = "cuda" if platform_name == "gpu" else platform_name
    concrete = selection.concrete(backend, where)
    api = (deep_gemm.api() if concrete == "deep_gemm" and where == "cuda" else None) or emulated.api()
    t = Target(concrete, where, family or contracts.EMULATED_ARCH, 0, api)
    how = dispatch.resolve(op, (), t, requested=backend)
    if how.runs == "raises":
        return "raises", f"{type(how.error).__name__}: {how.why}"
    native = how.runs == "deep_gemm" or (how.runs == "native" and where == "cuda")
    forms = [f"with `{arg}`: {', '.join(sorted(archs))} only" for arg, archs in op.arg_archs.items()
             if native and family not in archs]
    mode = ("native" if native else "cpu kernel" if how.runs == "native"
            else "emulated" if how.runs == "torch" else "reference")
    return mode, how.why + (f" ({'; '.join(forms)})" if forms else "")


_RANK = {"raises": 0, "reference": 1, "emulated": 2, "cpu kernel": 3, "native": 4}


def _helper_how(fn) -> str:
    """What a function without a kernel of its own is, for `info`."""
    runs = getattr(fn, "__jax_dg_runs__", None)
    if runs:
        return runs
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None and inspect.isgeneratorfunction(wrapped):
        return "a context manager: sets what functions traced inside it do (part of jit's cache key)"
    return "pure JAX (no custom call)"


def function_status(fn, platform_name: str, family: str | None, backend: str) -> tuple[str, str, list]:
    """(mode, why, op names) for a public function: its ops' least capable mode; "helper" for the
    functions with no kernel of their own (plain jax.numpy, or Python around it)."""
    ops = getattr(fn, "__jax_dg_ops__", ())
    if not ops:
        return "helper", _helper_how(fn), []
    found = [(op, *op_status(op, platform_name, family, backend)) for op in ops]
    op, mode, how = min(found, key=lambda f: _RANK[f[1]])
    if len(found) > 1 and mode == "native":
        how = "DeepGEMM: " + ", ".join(h.removeprefix("DeepGEMM: ") for _, _, h in found)
    return mode, how, [o.name for o in ops]


def public_functions() -> list[tuple[str, Any]]:
    """(name, function) of what a user calls: the registry's public functions (jax_dg's, and
    jax_dg.paged's as "paged.<name>")."""
    import jax_dg  # noqa: F401  (fills the registry)
    from jax_dg.core import registry
    return sorted(registry.functions().items())


def collect() -> dict[str, Any]:
    """Everything `info` prints, as data (the tests read it)."""
    import jax

    import jax_dg
    from jax_dg.tools import capability, warmup
    from jax_dg.backends import deep_gemm
    from jax_dg.core import backend as selection
    from jax_dg.core import device

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
        info["requested_backend"] = selection.requested()
    except ValueError as e:
        info["requested_backend"] = f"invalid ({e})"
    devices = []
    for dev in jax.devices():
        devices.append({"id": dev.id, "platform": dev.platform, "kind": dev.device_kind,
                        "arch": device.arch(dev), "family": device.family(dev),
                        "deep_gemm_supported": capability.is_deep_gemm_supported(dev)})
    info["devices"] = devices
    dg = deep_gemm.module()
    if dg is None:
        info["deep_gemm"] = {"found": False, "why": deep_gemm.import_error(),
                             "installed": capability.has_deep_gemm(), "hint": deep_gemm.INSTALL_HINT}
    else:
        api = deep_gemm.api()
        info["deep_gemm"] = {"found": True, "module": dg.__name__, "version": deep_gemm.version(),
                             "path": os.path.dirname(getattr(dg, "__file__", "") or ""),
                             "release": api.release, "tested": not api.untested,
                             "as": ".".join(map(str, api.era)), "facts": api.facts()}
    info["jit_cache_dir"] = warmup.cache_dir()
    info["e8m0_used"] = capability.is_deep_gemm_e8m0_used()
    info["scale_format"] = capability.DeepGemmQuantScaleFMT.from_oracle().name
    first = jax.devices()[0]
    family = device.family(first)
    backend = info["requested_backend"]
    functions = []
    for name, fn in public_functions():
        mode, how, ops = function_status(fn, first.platform, family, backend)
        functions.append({"name": name, "ops": ops, "native": mode == "native", "mode": mode,
                          "how": how})
    info["functions"] = functions
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
        tested = ("tested" if dg["tested"] else
                  f"newer than any tested: jax_dg calls it as {dg['as']}, where the calls still fit")
        lines.append(f"              DeepGEMM {dg['release']} ({tested}): "
                     + "; ".join(f"{k} {v}" for k, v in dg["facts"].items()))
    else:
        lines.append(f"deep_gemm     not found: {dg['why']}")
        if any(d["platform"] == "gpu" for d in info["devices"]):   # needed on a GPU only
            lines.append(f"              {dg['hint']}")
    lines.append(f"JIT cache     {info['jit_cache_dir'] or '(unset)'} (DG_JIT_CACHE_DIR)")
    lines.append(f"scales        {info['scale_format']} (E8M0 used: {'yes' if info['e8m0_used'] else 'no'})")
    kernels = [f for f in info["functions"] if f["mode"] != "helper"]
    native = [f for f in kernels if f["native"]]
    modes = sorted({f["mode"] for f in kernels}, key=lambda m: -_RANK[m])
    lines.append(f"functions     {len(native)} of {len(kernels)} kernel functions run natively here; "
                 f"{len(info['functions']) - len(kernels)} helpers have no kernel of their own")
    lines += [f"  {m:<10}  {MODES[m]}" for m in modes]
    width = max((len(f["name"]) for f in info["functions"]), default=0)
    for f in info["functions"]:
        lines.append(f"  {f['name']:<{width}}  {f['mode']:<10}  {f['how']}")
    return "\n".join(lines)


DEFAULT_SCRIPT = "examples/indexer_topk.py"


def load_script(spec: str):
    """A warm-up script: a Python file, or an importable module, defining warmup_jobs(argv)."""
    path = pathlib.Path(spec)
    if not path.exists() and spec == DEFAULT_SCRIPT:   # the repository's, from anywhere
        path = pathlib.Path(__file__).resolve().parents[1] / spec
    if path.suffix == ".py" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"no warm-up script {spec}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(spec)
    if not callable(getattr(module, "warmup_jobs", None)):
        raise AttributeError(f"{spec} defines no warmup_jobs(argv) -> [(name, fn, args, kwargs)]")
    return module


def warmup_main(args) -> int:
    from jax_dg.tools import warmup
    try:
        module = load_script(args.script)
    except (OSError, ImportError, AttributeError) as e:
        print(f"python -m jax_dg warmup: {e}", file=sys.stderr)
        return 2
    from jax_dg.core import device
    # DeepGEMM compiles on CUDA only: elsewhere the stdout summaries below say all there is
    progress = args.progress if device.platform() == "cuda" else "off"
    reports = []
    for name, fn, fn_args, fn_kwargs in module.warmup_jobs(args.script_args):
        if progress != "off":
            print(f"== {name}", file=sys.stderr)
        reports.append((name, warmup.warmup(fn, *fn_args, progress=progress, **fn_kwargs)))
    if args.json:
        print(json.dumps([{"job": name, **r.as_dict()} for name, r in reports], indent=1))
    else:
        for name, r in reports:
            print(f"{name}: {r.summary()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from jax_dg.tools.warmup import PROGRESS
    parser = argparse.ArgumentParser(prog="python -m jax_dg", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", metavar="{info,warmup}")
    commands.add_parser("info", help="what jax_dg sees here (the default)")
    warm = commands.add_parser(
        "warmup", help="compile a script's DeepGEMM kernels ahead, with progress",
        description="Compiles the DeepGEMM kernel variants of the jobs a script declares "
                    "(warmup_jobs(argv) -> [(name, fn, args, kwargs)], arguments may be "
                    "ShapeDtypeStructs), showing progress on stderr; prints each job's summary "
                    "(what compiled, what hit the cache, where the cache lives) on stdout.")
    warm.add_argument("script", nargs="?", default=DEFAULT_SCRIPT,
                      help=f"a .py file or module defining warmup_jobs (default: {DEFAULT_SCRIPT})")
    warm.add_argument("--progress", choices=PROGRESS, default="auto",
                      help="a bar on a terminal, log lines otherwise (auto), or as named")
    warm.add_argument("--json", action="store_true", help="print the reports as JSON")
    warm.add_argument("script_args", nargs=argparse.REMAINDER,
                      help="arguments for the script's warmup_jobs (after the script)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv or ["info"])
    if args.command == "warmup":
        return warmup_main(args)
    print(format_info(collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
