"""What a compiled program does with its stored FP8 weights: every use of an FP8 parameter,
followed through layout-only instructions, must be one of DeepGEMM's FP8 GEMMs reading it as
it is (no convert, no re-quantising cast, no arithmetic on it)."""

from __future__ import annotations

import re

import jax

GEMMS = {"jax_dg_fp8_gemm_nt", "jax_dg_m_grouped_fp8_gemm_nt_masked", "jax_dg_m_grouped_fp8_gemm_nt_contiguous",
         "jax_dg_fp8_gemm_nt_graph", "jax_dg_m_grouped_fp8_gemm_nt_masked_graph",
         "jax_dg_m_grouped_fp8_gemm_nt_contiguous_graph"}
LAYOUT_ONLY = {"bitcast", "copy", "reshape", "get-tuple-element", "tuple"}
_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"\b([a-z][a-z\-]*)\(")


def _instructions(hlo: str):
    """(name, text, opcode, custom-call target) of each instruction of the entry computation
    (what a fusion does inside is its own: the entry's uses of a weight are what count)."""
    entry = hlo[hlo.index("\nENTRY "):]
    for line in entry.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, rest = m.groups()
        body = rest.split(", metadata=")[0]
        op = next((o for o in _OPCODE.findall(body) if o not in ("f8e4m3fn", "f32", "bf16", "s32")), "?")
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        yield name, body, op, target.group(1) if target else None


def fp8_parameter_uses(fn, *args) -> dict[str, list[str]]:
    """For each float8 parameter of jit(fn)(*args)'s optimised HLO: the instructions that finally
    use it (custom-call targets by name, other opcodes as they are)."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    instrs = list(_instructions(hlo))
    params = [name for name, body, op, _ in instrs if op == "parameter" and body.startswith("f8e4m3fn")]
    assert params, "no float8 parameter in the program"

    def uses(name, seen):
        out = []
        for other, body, op, target in instrs:
            if other in seen or not re.search(rf"%{re.escape(name)}\b(?![\w.\-])", body):
                continue
            if op in LAYOUT_ONLY:
                out += uses(other, seen | {other})
            else:
                out.append(target or op)
        return out
    return {p: uses(p, {p}) for p in params}


def assert_fp8_weights_read_as_stored(fn, *args) -> None:
    for param, users in fp8_parameter_uses(fn, *args).items():
        assert users and set(users) <= GEMMS, f"{param} is used by {users}: not only DeepGEMM's FP8 GEMMs"
