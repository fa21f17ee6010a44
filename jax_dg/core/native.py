"""jax_dg's own kernels (kernels/*.cu) as native, typed XLA FFI custom calls (ffi/native.cc).

No Python, GIL or torch runs at execution time: the CUDA handlers launch the kernels on XLA's
stream (and are command-buffer compatible, so XLA may capture and replay them), the CPU
handlers are C++ implementations of the same contract, bitwise equal.

The functions here are only the custom calls: they check nothing (their callers do; the
handlers refuse what would read or write out of bounds, as an XLA error). Optional int32
arrays (lo/hi) that are absent travel as zero-size arrays with a `has_*` attribute. The
in-place kernels alias their first input to their output: XLA writes into that buffer when the
input is a temporary (and copies it first when it must keep the input, e.g. a parameter not
donated).
"""

from __future__ import annotations

import jax  # keep ahead of the extension: loading it first crashed jax's import once
import jax.numpy as jnp

from jax_dg.core import _native

PREFIX = "jax_dg_native_"
# short name -> custom-call target, from the handler table (ffi/native.cc): registered with
# XLA by jax_dg.core.registry
TARGETS: dict[str, str] = {t.removeprefix(PREFIX): t for t in _native.handlers()}


def handlers() -> dict:
    """target -> {platform: handler capsule}: the CPU handler of every kernel, and the CUDA
    one where built."""
    return _native.handlers()


def cuda_built() -> bool:
    """Whether the CUDA handlers were built (a CUDA toolkit at install)."""
    return _native.cuda_built()


def max_k() -> int:
    """The top-k kernel's largest k (on every platform, CUDA built or not)."""
    return _native.max_k()


def call_count() -> int:
    """Native handler entries so far, every platform: a replayed CUDA graph adds none."""
    return _native.call_count()


def _optional(x):
    """(array, present): an absent int32 array as a zero-size one (no fill kernel)."""
    return (jnp.zeros((0,), jnp.int32), False) if x is None else (x, True)


def topk(logits, lo, hi, *, k: int, cols: int, sorted: bool, rows: int | None = None) -> jax.Array:
    """int32 [rows, k]: row r's columns of its k largest logits among lo[r] <= c <
    min(hi[r], cols) (lo/hi: int32 [rows] or None; clamped to [0, cols]) with logits > -inf
    (NaN never): value descending, then column ascending (+0.0 above -0.0); not `sorted`, the
    same set in column order; -1 past the candidates. logits: float32 [R, S], cols <= S (S is
    the row stride), rows <= R (default R). k <= max_k()."""
    rows = logits.shape[0] if rows is None else rows   # may be symbolic (jax.export)
    lo, has_lo = _optional(lo)
    hi, has_hi = _optional(hi)
    # Rows over 32768 keys are split over independent CTAs on the GPU, their candidates kept in
    # a scratch result (kernels/topk_split.h; zero bytes where rows are never split): sized on
    # every platform alike, so a program's shapes do not depend on where it was traced.
    per_row = _native.topk_scratch_bytes(int(cols), int(k), bool(sorted))
    scratch = jax.ShapeDtypeStruct((rows, per_row), jnp.uint8)
    call = jax.ffi.ffi_call(TARGETS["topk"],
                            (jax.ShapeDtypeStruct((rows, int(k)), jnp.int32), scratch),
                            vmap_method="sequential")
    out, _ = call(logits, lo, hi, cols=int(cols), sorted=bool(sorted), has_lo=has_lo, has_hi=has_hi)
    return out


def neg_inf_outside(logits, lo, hi, *, rows: int | None = None, cols: int,
                    relative: bool) -> jax.Array:
    """logits (float32 or bfloat16 [R, S]) with -inf at r < rows, c < cols outside [lo[r],
    hi[r]) (lo None: 0), or with `relative` outside [0, hi[r] - lo[r]); ends clamped to
    [0, cols]; every other element as it was. In place (input 0 aliases the result). rows
    None: hi's length (what a symbolic row count needs: jax.export)."""
    lo, has_lo = _optional(lo)
    call = jax.ffi.ffi_call(TARGETS["neg_inf_outside"],
                            jax.ShapeDtypeStruct(logits.shape, logits.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(logits, lo, hi, rows=-1 if rows is None else int(rows), cols=int(cols),
                relative=bool(relative),
                has_lo=has_lo)


def zero_masked_tail(d, masked_m) -> jax.Array:
    """d [G, Mmax, ...] with rows masked_m[g] <= m < Mmax of each group zeroed (masked_m:
    int32 [G], clamped to [0, Mmax]); the rest as it was. In place. A row (d's trailing
    dimensions) must be a multiple of 16 bytes."""
    call = jax.ffi.ffi_call(TARGETS["zero_masked_tail"], jax.ShapeDtypeStruct(d.shape, d.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(d, masked_m)


def zero_padding_rows(d, layout, *, block: int, skip_padding_blocks: bool) -> jax.Array:
    """d [M, ...] with the rows whose layout[r] (int32 [M]) is < 0 zeroed, except, with
    skip_padding_blocks, in blocks of `block` rows whose first row's id is < 0 (left as they
    are); the rest as it was. In place. A row must be a multiple of 16 bytes."""
    call = jax.ffi.ffi_call(TARGETS["zero_padding_rows"], jax.ShapeDtypeStruct(d.shape, d.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(d, layout, block=int(block), skip_padding_blocks=bool(skip_padding_blocks))


def cast_fp8(x, valid_rows, types, *, per_block: bool, ue8m0: bool, rows_out: bool, cols_out: bool):
    """DeepGEMM's FP8 casts of x (bfloat16 or float32 [B, R, C], C % 16 == 0) in one pass:
    (q, sq, qt, sqt) of `types` (jax_dg.ops.cast's shape rule: per token, q with its MN-major
    scales and the per-token cast of x.T; per block, q, its block scales and their transposes;
    shape (0,) where not asked for: rows_out for q, sq, cols_out for qt, sqt). Rows r >=
    valid_rows[b] (int32 [B], or None) are read as 0."""
    valid_rows, has_valid = _optional(valid_rows)
    call = jax.ffi.ffi_call(TARGETS["cast_fp8"], types, vmap_method="sequential")
    return tuple(call(x, valid_rows, per_block=bool(per_block), ue8m0=bool(ue8m0),
                      has_valid=has_valid, rows_out=bool(rows_out), cols_out=bool(cols_out)))


def paged_sanitise(context_lens, block_tables, schedule, *, next_n: int, num_blocks: int,
                   block_size: int, limit: int, zero_unused: bool):
    """(ctx int32 [B, next_n], table int32 [B, W'], schedule or None): the paged logits call's
    lengths, block table and (given) schedule with every value its kernel uses as an address in
    range; jax_dg.reference.paged_mqa.paged_sanitised says what each holds (bitwise the same).
    context_lens: int32 [B] or [B, next_n]; block_tables [B, W]; schedule [S + 1, 2] or None
    (not bounded). W' = W rounded up to even with zero_unused, else W. limit <= W * block_size."""
    b, w = block_tables.shape
    width = w + w % 2 if zero_unused else w
    schedule, fix = _optional(schedule)   # absent: [0] in, [0] out
    types = (jax.ShapeDtypeStruct((b, int(next_n)), jnp.int32),
             jax.ShapeDtypeStruct((b, width), jnp.int32),
             jax.ShapeDtypeStruct(schedule.shape, jnp.int32))
    call = jax.ffi.ffi_call(TARGETS["paged_sanitise"], types, vmap_method="sequential")
    ctx, table, fixed = call(context_lens, block_tables, schedule, num_blocks=int(num_blocks),
                             block_size=int(block_size), limit=int(limit),
                             zero_unused=bool(zero_unused), fix_schedule=fix)
    return ctx, table, fixed if fix else None
