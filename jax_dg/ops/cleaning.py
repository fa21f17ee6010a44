"""Torch-side output cleaning shared by the op calls (`clean_logits`).

DeepGEMM leaves some logits unwritten or unspecified; the calls copy its result into XLA's
output and write -inf at invalid positions in the same pass. The column indices and the -inf
scalar are cached per device, so the hot path allocates nothing.
"""

from __future__ import annotations

_COLUMNS: dict = {}
_NEG_INF: dict = {}


def neg_inf(like):
    """A 0-d -inf tensor of `like`'s dtype on its device (cached)."""
    key = (like.device, like.dtype)
    value = _NEG_INF.get(key)
    if value is None:
        import torch
        value = _NEG_INF[key] = torch.full((), float("-inf"), dtype=like.dtype, device=like.device)
    return value


def columns(like, n: int):
    """int32 [1, n] column indices on `like`'s device (cached)."""
    key = (like.device, n)
    value = _COLUMNS.get(key)
    if value is None:
        import torch
        value = _COLUMNS[key] = torch.arange(n, dtype=torch.int32, device=like.device)[None]
    return value


def where_valid(out, valid, logits) -> None:
    """out = logits where `valid`, -inf elsewhere: one pass."""
    import torch
    torch.where(valid, logits, neg_inf(out), out=out)


def masked_copy(out, logits, lens) -> None:
    """out[i, t] = logits[i, t] if t < lens[i] else -inf: one pass over the logits."""
    where_valid(out, columns(out, out.shape[1]) < lens.reshape(-1, 1), logits)
