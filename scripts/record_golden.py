"""Record DeepGEMM's own outputs for the golden cases (tests/golden/cases.py) on a GPU.

    python scripts/record_golden.py            # write tests/golden/<case>.npz
    python scripts/record_golden.py --check    # regenerate and compare bitwise with the stored files

Each case's seeded inputs are made with jax_dg's quantisers (bitwise DeepGEMM's), then deep_gemm is
called from torch on them, twice: the two outputs must be bitwise equal (DeepGEMM is deterministic on
these shapes) before anything is written. The file records the deep_gemm, torch and jax versions and
the device. With --check nothing is written: inputs and outputs must equal the stored ones bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.golden import cases  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden")


def to_torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype.name == "float8_e4m3fn":
        return torch.from_numpy(x.view(np.uint8).copy()).cuda().view(torch.float8_e4m3fn)
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.uint16).copy()).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.array(x)).cuda()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(jax.numpy.bfloat16)
    return t.numpy()


def record(case: cases.Case, dg) -> tuple[dict, tuple]:
    inputs = case.make(case.seed)
    outs = []
    for _ in range(2):
        t = {k: to_torch(np.asarray(v)) for k, v in inputs.items()}
        outs.append(tuple(to_numpy(o) for o in case.deep_gemm(dg, t)))
        torch.cuda.synchronize()
    for x, y in zip(*outs, strict=True):
        assert x.tobytes() == y.tobytes(), f"{case.name}: deep_gemm's two outputs differ"
    return inputs, outs[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the stored files, write nothing")
    ap.add_argument("--dir", default=HERE)
    ap.add_argument("cases", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    try:
        import deep_gemm
        gpu = torch.cuda.is_available()
    except ImportError as e:
        deep_gemm, gpu, why = None, False, f"{type(e).__name__}: {e}"
    else:
        why = "torch sees no CUDA device"
    if deep_gemm is None or not gpu:
        return fail(why)
    meta = {"deep_gemm": getattr(deep_gemm, "__version__", "?"), "torch": torch.__version__,
            "jax": jax.__version__, "device": torch.cuda.get_device_name(),
            "num_sms": deep_gemm.get_num_sms()}
    bad = 0
    for case in cases.CASES:
        if args.cases and case.name not in args.cases:
            continue
        inputs, outputs = record(case, deep_gemm)
        path = os.path.join(args.dir, f"{case.name}.npz")
        if args.check:
            old_in, old_out, old_meta = cases.load(path)
            same = (old_in.keys() == inputs.keys()
                    and all(old_in[k].tobytes() == np.asarray(inputs[k]).tobytes() for k in inputs)
                    and len(old_out) == len(outputs)
                    and all(x.tobytes() == y.tobytes() for x, y in zip(old_out, outputs)))
            bad += not same
            print(f"{case.name:40s} {'bitwise equal' if same else 'DIFFERS'} to the file "
                  f"(recorded with deep_gemm {old_meta['deep_gemm']})")
        else:
            cases.save(path, inputs, outputs, dict(meta, case=case.name))
            print(f"{case.name:40s} {os.path.getsize(path):8d} bytes  {[o.shape for o in outputs]}")
    return 1 if bad else 0


def fail(why: str) -> int:
    # (the inputs are not checked alone: jax.random's float32 normals differ between CPU and GPU
    # in about 1% of their bytes, and the files were made on a GPU)
    print(f"record_golden.py runs DeepGEMM: it needs deep_gemm on a CUDA GPU ({why}). Without "
          "one, `python -m pytest tests/test_golden.py` checks the torch emulation and the pure-JAX "
          "reference against the stored DeepGEMM outputs.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
