"""What a compiled program does with its stored FP8 weights: every use of an FP8 parameter,
followed through layout-only instructions and into called computations (XLA's GPU command
buffers are `call`s), must be one of DeepGEMM's FP8 GEMMs reading it as it is (no convert, no
re-quantising cast, no arithmetic on it)."""

from __future__ import annotations

import dataclasses
import re

import jax

GEMMS = {f"jax_dg_{op}{suffix}" for op in ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_masked",
                                            "m_grouped_fp8_gemm_nt_contiguous") for suffix in ("", "_graph")}
LAYOUT_ONLY = {"bitcast", "copy", "reshape", "get-tuple-element", "tuple"}
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")


@dataclasses.dataclass
class Instr:
    name: str
    op: str
    operands: list[str]
    target: str | None
    called: str | None
    param: int | None


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at text[start]."""
    depth = 0
    for j in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j
    return len(text)


def _opcode_and_operands(rest: str) -> tuple[str, str]:
    """`type opcode(operands), attributes` (the type may be a tuple) -> (opcode, operands text)."""
    after_type = rest[_closing(rest, 0) + 1:].lstrip() if rest.startswith("(") else rest.split(" ", 1)[-1]
    opcode, paren, _ = after_type.partition("(")
    if not paren:
        return "?", ""
    start = len(opcode)
    return opcode.strip(), after_type[start + 1:_closing(after_type, start)]


def _parse(hlo: str) -> tuple[dict[str, list[Instr]], str]:
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
            continue
        m = _LINE.match(line)
        if not m or current is None:
            continue
        name, rest = m.groups()
        opcode, args = _opcode_and_operands(rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        called = re.search(r"(?:to_apply|calls)=%([\w.\-]+)", rest)
        param = re.match(r"parameter\((\d+)\)", f"{opcode}({args})") if opcode == "parameter" else None
        comps[current].append(Instr(name, opcode, re.findall(r"%([\w.\-]+)", args),
                                    target.group(1) if target else None, called.group(1) if called else None,
                                    int(param.group(1)) if param else None))
    return comps, entry


def fp8_parameter_uses(fn, *args) -> dict[str, list[str]]:
    """For each float8 parameter of jit(fn)(*args)'s optimised HLO: what finally uses it
    (custom-call targets by name, other opcodes as they are)."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    comps, entry = _parse(hlo)
    fp8 = {m.group(1) for m in re.finditer(r"%([\w.\-]+) = f8e4m3fn\[[^\]]*\]\S* parameter\(", hlo)}
    params = [i.name for i in comps[entry] if i.op == "parameter" and i.name in fp8]
    assert params, "no float8 parameter in the program"

    def uses(comp: str, name: str) -> list[str]:
        out = []
        for i in comps[comp]:
            if name not in i.operands:
                continue
            if i.op in LAYOUT_ONLY:
                out += uses(comp, i.name)
            elif i.op == "call" and i.called in comps:
                k = i.operands.index(name)
                out += [u for p in comps[i.called] if p.param == k for u in uses(i.called, p.name)]
            else:
                out.append(i.target or i.op)
        return out
    return {p: uses(entry, p) for p in params}


def assert_fp8_weights_read_as_stored(fn, *args) -> None:
    for param, users in fp8_parameter_uses(fn, *args).items():
        assert users and set(users) <= GEMMS, f"{param} is used by {users}: not only DeepGEMM's FP8 GEMMs"
