"""The call-site record: what a traced call hands the bridge besides its buffers.

One record per call site, made once at trace time (jax_dg.core.op), carried as the custom
call's one string attribute, decoded once per site by the bridge (jax_dg.runtime.bridge), which
caches the prepared closure under the string. It holds every decision made while tracing:

    op        the Op's name
    backend   the concrete backend that runs it: "deep_gemm" or "torch" (never "auto")
    present   which of the op's optional arguments were given (absent ones reach run as None)
    graph     whether the call lowered to the command-buffer-compatible target
    static    the statics and plan entries (the shape rule's: layouts, whether the logits land, ...)
              the op's run function names, as it receives them (tuples stay tuples)

The encoding is versioned: a record written by another jax_dg version (a serialized export, a
stale cache) fails to decode with a message, never runs with misread fields.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

VERSION = 1


class SiteError(ValueError):
    """A call-site string this jax_dg cannot read (another version, or not a record)."""


@dataclasses.dataclass(frozen=True)
class Site:
    op: str
    backend: str
    present: tuple[bool, ...]
    graph: bool
    static: Mapping[str, Any]

    def encode(self) -> str:
        """The attribute string (deterministic: equal records give equal strings, so XLA and
        the bridge's cache see one site)."""
        return json.dumps({"v": VERSION, "op": self.op, "backend": self.backend,
                           "present": "".join("1" if p else "0" for p in self.present),
                           "graph": self.graph, "static": dict(self.static)},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> "Site":
        try:
            d = json.loads(text)
        except (TypeError, ValueError):
            d = None
        if not isinstance(d, dict) or "v" not in d:
            raise SiteError(f"jax_dg: not a call-site record: {str(text)[:80]!r}")
        version = d["v"]
        if version != VERSION:
            raise SiteError(f"jax_dg: call-site record version {version!r}; this jax_dg reads "
                            f"version {VERSION} (re-export or re-trace with this jax_dg)")
        return cls(op=d["op"], backend=d["backend"],
                   present=tuple(c == "1" for c in d["present"]), graph=bool(d["graph"]),
                   static={k: _frozen(v) for k, v in d["static"].items()})


def _frozen(value):
    """JSON lists back into the tuples they were given as."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value
