"""What DeepGEMM writes for grouped-contiguous layouts that break its alignment contract (GPU).

For each layout below, the m-grouped contiguous GEMM runs on DeepGEMM (through jax_dg, with
clean=False: d exactly as DeepGEMM wrote it) and every run of rows with one id is matched
against a[r] @ b[g].T for each group g (the pure-JAX reference) and against 0. It prints which
group each run was computed with, then checks the rule jax_dg's checked mode and docs state
(docs/api.md, "Grouped-contiguous layouts"): a block of A rows is computed with the group of its
first row; on SM90's FP8 kernel a 64-row slice that opens with padding is left 0.

    python scripts/grouped_layout_probe.py            # FP8 and BF16, A = 128
    python scripts/grouped_layout_probe.py --fp8-only
    python scripts/grouped_layout_probe.py --backend torch   # a dry run on CPU: the emulation
                                                            # computes rows by their own ids

Exit status 0 when the rule predicts every routed row, 1 otherwise (the lines marked "!!").
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_dg
from jax_dg.backends import deep_gemm

A, SLICE, K, N, G = 128, 64, 256, 128, 3


def layouts() -> dict[str, np.ndarray]:
    m = 4 * A
    out = {}
    x = np.repeat(np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32), 64)              # 64-row groups
    out["64-row groups (a group opens mid-block)"] = x
    x = np.full(m, -1, np.int32)
    x[:A] = 0
    x[A + 2:2 * A] = 1                                                              # block opens with padding
    x[2 * A:3 * A] = 2
    out["a block that opens with padding, then group 1"] = x
    x = np.full(m, -1, np.int32)
    x[:10], x[70:A] = 0, 0                                                          # slice 64..127 opens with -1
    x[A:A + 64], x[A + 64:2 * A] = 1, 2                                             # second slice another group
    out["a 64-row slice that opens with padding; a group opening a slice"] = x
    x = np.repeat(np.array([0, 1, 2, 0], np.int32), A)
    x[5], x[A + 60:A + 64], x[3 * A + 100:] = -1, -1, -1                           # allowed: padding inside
    out["padding inside groups' blocks (the contract allows it)"] = x
    return out


def operands(m: int, fp8: bool):
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(k[0], (m, K), jnp.bfloat16)
    w = jax.random.normal(k[1], (G, N, K), jnp.bfloat16)
    if fp8:
        return jax_dg.per_token_cast_to_fp8(x), jax.vmap(jax_dg.per_block_cast_to_fp8)(w)
    return x, w


def gemm(fp8: bool, a, b, layout, backend: str):
    fn = jax_dg.m_grouped_fp8_gemm_nt_contiguous if fp8 else jax_dg.m_grouped_bf16_gemm_nt_contiguous
    with jax_dg.use_backend(backend), jax_dg.mk_alignment_scope(A):
        f = jax.jit(lambda a, b, l: fn(a, b, l, clean=False))
        return np.asarray(f(a, b, jnp.asarray(layout)).astype(jnp.float32))


def which(row: np.ndarray, per_group: list[np.ndarray]) -> str:
    if not np.any(row):
        return "0"
    errs = [float(np.abs(row - ref).max() / max(np.abs(ref).max(), 1e-6)) for ref in per_group]
    g = int(np.argmin(errs))
    return f"group {g}" if errs[g] < 2e-2 else f"other (best: group {g}, rel. error {errs[g]:.2g})"


def predicted(layout: np.ndarray, r: int, fp8: bool) -> str:
    """The rule the docs state, for row r."""
    first = layout[r // A * A]
    if fp8 and layout[r // SLICE * SLICE] < 0:
        return "0"
    if first < 0:
        return "0"   # the block is skipped
    return f"group {first}"


def probe(fp8: bool, backend: str) -> bool:
    ok = True
    kind = "FP8" if fp8 else "BF16"
    for name, layout in layouts().items():
        m = layout.shape[0]
        a, b = operands(m, fp8)
        got = gemm(fp8, a, b, layout, backend)
        per_group = [gemm(fp8, a, b, np.full(m, g, np.int32), "xla") for g in range(G)]
        print(f"== {kind}, A = {A}: {name}")
        runs = np.flatnonzero(np.diff(layout, prepend=layout[0] - 1)).tolist() + [m]
        for s, e in zip(runs[:-1], runs[1:]):
            # within a run, rows may differ (a slice boundary): report sub-runs of one answer
            answers = [which(got[r], [pg[r] for pg in per_group]) for r in range(s, e)]
            t = s
            while t < e:
                u = t
                while u < e and answers[u - s] == answers[t - s]:
                    u += 1
                want = {predicted(layout, r, fp8) for r in range(t, u)}
                routed = layout[t] >= 0
                mark = ""
                if routed and want != {answers[t - s]}:
                    mark, ok = "  !! the rule predicted " + "/".join(sorted(want)), False
                print(f"  rows {t:4d}-{u - 1:4d}  id {layout[t]:2d} -> {answers[t - s]}{mark}")
                t = u
    return ok


def main() -> int:
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "deep_gemm"
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind}; backend {backend}; deep_gemm "
          f"{deep_gemm.version() if deep_gemm.module() is not None else 'not found'}")
    ok = probe(True, backend)
    if "--fp8-only" not in sys.argv:
        ok = probe(False, backend) and ok
    print("RULE HOLDS: every routed row as predicted" if ok else
          "RULE BROKEN: see the !! lines (tell jax_dg's checked rule and emulation)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
