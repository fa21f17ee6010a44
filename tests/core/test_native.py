"""jax_dg's own kernels as native XLA FFI handlers (ffi/native.cc, jax_dg.core.native).

CPU: the C++ handlers through XLA, bitwise against the torch specifications of the kernels
(tests/own_kernels_oracle.py) and, for the top-k, the pure-JAX oracle; the in-place aliasing; the
errors; the call counter. GPU: the CUDA handlers bitwise against the CPU handlers on the same
inputs, and captured into a CUDA graph whose replays call no handler."""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests import own_kernels_oracle as torch_emu   # the plain-torch specification
from jax_dg.core import native
from jax_dg.reference import paged_mqa as ref_paged
from jax_dg.reference import topk as ref_topk

I32 = jnp.int32
BF16 = jnp.bfloat16
INT_MIN = np.iinfo(np.int32).min


def seed_of(*parts) -> int:
    """A seed from the test's parameters (the same in every process, unlike hash())."""
    return zlib.crc32(repr(parts).encode())


def cpu():
    return jax.devices("cpu")[0]


def gpu():
    return jax.devices("gpu")[0]


def put(tree, device):
    """Committed copies on `device` (jit then runs there); None stays None."""
    return jax.tree.map(lambda a: jax.device_put(a, device), tree)


def bits(x) -> np.ndarray:
    x = np.asarray(jax.device_get(x))
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))


def as_torch(a: np.ndarray) -> torch.Tensor:
    """A torch CPU tensor with a's bits (bfloat16 through uint16)."""
    a = np.ascontiguousarray(a)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def torch_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    a = t.numpy()
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


# --- top-k --------------------------------------------------------------------------------------

_topk = jax.jit(native.topk, static_argnames=("k", "cols", "sorted", "rows"))


def logits_case(case: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """float32 [rows, cols] of one kind (see the ids)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if case == "random":
        x[rng.random((rows, cols)) < 0.01] = np.inf
        x[:, 1::7] = x[:, ::7][:, :x[:, 1::7].shape[1]]          # exact duplicates
    elif case == "ties":   # a few distinct values, +0.0 and -0.0 among them
        x = np.round(x * 2) / 2
        x[rng.random((rows, cols)) < 0.3] = 0.0
        x[rng.random((rows, cols)) < 0.3] = -0.0
    elif case == "zeros":  # only +0.0 and -0.0
        x = np.where(rng.random((rows, cols)) < 0.5, np.float32(0.0), np.float32(-0.0))
    elif case == "neg_inf":  # mostly -inf: fewer candidates than k in many rows
        x[rng.random((rows, cols)) < 0.9] = -np.inf
        x[0] = -np.inf
    elif case == "nan":
        x[rng.random((rows, cols)) < 0.3] = np.nan
        x[0] = np.nan
        x[1, ::2] = -np.nan
    elif case == "extremes":  # denormals, +-max, +-inf
        vals = np.array([np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                         1e-45, -1e-45, np.finfo(np.float32).tiny, 0.0, -0.0], np.float32)
        x = vals[rng.integers(0, len(vals), (rows, cols))]
    else:
        raise ValueError(case)
    return x.astype(np.float32)


def ranges(kind: str, rows: int, cols: int, seed: int):
    """(lo, hi) as int32 numpy arrays or None."""
    rng = np.random.default_rng(seed + 1)
    lo = rng.integers(0, cols + 1, rows).astype(np.int32)
    hi = np.minimum(lo + rng.integers(0, cols + 1, rows), cols).astype(np.int32)
    if kind == "none":
        return None, None
    if kind == "lo":
        return lo, None
    if kind == "hi":
        return None, hi
    if kind == "both":
        return lo, hi
    # "wild": out of range on either side, inverted, empty, extreme int32
    lo = rng.integers(-10, cols + 10, rows).astype(np.int32)
    hi = rng.integers(-10, cols + 10, rows).astype(np.int32)
    special = [(-5, cols + 5), (cols + 3, -2), (INT_MIN, np.iinfo(np.int32).max), (3, 3),
               (cols, cols + 1), (-1, 0), (cols - 1, cols)]
    for r, (a, b) in enumerate(special[:rows]):
        lo[r], hi[r] = a, b
    return lo, hi


def torch_topk(x, lo, hi, *, rows, cols, k, sorted):
    out = torch.empty((rows, k), dtype=torch.int32)
    t = lambda a: None if a is None else torch.from_numpy(np.array(a))   # noqa: E731
    torch_emu.topk_rows(torch.from_numpy(np.array(x)), t(lo), t(hi), out, cols, sorted)
    return out.numpy()


def padded(x: np.ndarray, extra_rows: int, extra_cols: int, fill=np.inf) -> np.ndarray:
    """x inside a larger buffer whose other elements would win any selection that read them."""
    rows, cols = x.shape
    buf = np.full((rows + extra_rows, cols + extra_cols), fill, x.dtype)
    buf[:rows, :cols] = x
    return buf


CASES = ["random", "ties", "zeros", "neg_inf", "nan", "extremes"]
# (rows, cols, k, extra rows, extra columns of the buffer)
SHAPES = [(5, 1, 1, 0, 0), (9, 7, 5, 2, 3), (9, 7, 64, 1, 9), (16, 64, 64, 0, 0),
          (16, 300, 1, 3, 5), (16, 300, 299, 0, 0), (16, 300, 300, 1, 1), (16, 300, 301, 4, 60),
          (8, 300, 4096, 0, 0), (8, 5000, 1000, 2, 100), (6, 5000, 4096, 1, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sorted", [True, False], ids=["sorted", "unsorted"])
def test_topk_matches_the_references_bitwise(shape, case, sorted):
    rows, cols, k, er, ec = shape
    seed = seed_of(shape, case)
    x = padded(logits_case(case, rows, cols, seed), er, ec)
    xj = put(jnp.asarray(x), cpu())
    for kind in ("none", "lo", "hi", "both", "wild"):
        lo, hi = ranges(kind, rows, cols, seed)
        loj, hij = put((None if lo is None else jnp.asarray(lo), None if hi is None else jnp.asarray(hi)),
                       cpu())
        got = np.asarray(_topk(xj, loj, hij, k=k, cols=cols, sorted=sorted, rows=rows))
        assert got.shape == (rows, k) and got.dtype == np.int32
        want = torch_topk(x, lo, hi, rows=rows, cols=cols, k=k, sorted=sorted)
        np.testing.assert_array_equal(got, want, err_msg=f"{kind}: != torch specification")
        oracle = ref_topk.topk_rows(xj, loj, hij, rows=rows, cols=cols, k=k, sorted=sorted)
        np.testing.assert_array_equal(got, np.asarray(oracle), err_msg=f"{kind}: != JAX oracle")
        # the contract spelled out: candidates only, distinct, -1 only after them
        valid = got >= 0
        assert (valid[:, 1:] <= valid[:, :-1]).all()
        if not sorted:
            for r in range(rows):
                sel = got[r][valid[r]]
                assert (np.diff(sel) > 0).all()


def test_topk_defaults_to_every_row_and_ranges_longer_than_rows_are_read_in_part():
    x = logits_case("random", 12, 40, 3)
    lo, hi = ranges("both", 12, 40, 3)
    xj = put(jnp.asarray(x), cpu())
    got = np.asarray(jax.jit(lambda x: native.topk(x, None, None, k=8, cols=40, sorted=True))(xj))
    np.testing.assert_array_equal(got, torch_topk(x, None, None, rows=12, cols=40, k=8, sorted=True))
    got = np.asarray(_topk(xj, put(jnp.asarray(lo), cpu()), put(jnp.asarray(hi), cpu()), k=8,
                           cols=40, sorted=False, rows=5))
    np.testing.assert_array_equal(got, torch_topk(x, lo[:5], hi[:5], rows=5, cols=40, k=8, sorted=False))


def test_topk_larger_rows():
    x = logits_case("ties", 64, 8192, 11)
    lo, hi = ranges("both", 64, 8192, 11)
    got = np.asarray(_topk(*put((jnp.asarray(x), jnp.asarray(lo), jnp.asarray(hi)), cpu()), k=2048,
                           cols=8192, sorted=True, rows=64))
    np.testing.assert_array_equal(got, torch_topk(x, lo, hi, rows=64, cols=8192, k=2048, sorted=True))


def test_topk_under_vmap_runs_per_element():
    x = jnp.asarray(logits_case("random", 3 * 4 * 50, 1, 5).reshape(3, 4, 50))
    got = jax.jit(jax.vmap(lambda x: native.topk(x, None, None, k=6, cols=50, sorted=True)))(put(x, cpu()))
    want = [torch_topk(np.asarray(x[i]), None, None, rows=4, cols=50, k=6, sorted=True) for i in range(3)]
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


# --- neg_inf_outside ----------------------------------------------------------------------------

_neg_inf = jax.jit(native.neg_inf_outside, static_argnames=("rows", "cols", "relative"))


def neg_inf_case(dtype, rows, cols, er, ec, seed, has_lo, relative):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows + er, cols + ec)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    x[rng.random(x.shape) < 0.1] = -0.0
    x = x.astype(dtype)
    n = rows + er   # lo/hi longer than rows: only the first rows are read
    if relative:     # the compressed form: 0 <= lo <= hi, hi - lo may pass cols
        lo = rng.integers(0, 3 * cols, n).astype(np.int32)
        hi = (lo + rng.integers(0, cols + 5, n)).astype(np.int32)
    else:
        lo = rng.integers(-5, cols + 5, n).astype(np.int32)
        hi = rng.integers(-5, cols + 5, n).astype(np.int32)   # some inverted
    hi[0] = cols + 100
    if not relative and n > 1:
        lo[1], hi[1] = 0, cols
    return x, (lo if has_lo else None), hi


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@pytest.mark.parametrize("has_lo", [True, False], ids=["lo", "no_lo"])
@pytest.mark.parametrize("shape", [(1, 1, 0, 0), (17, 100, 0, 0), (17, 100, 5, 28), (40, 777, 3, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_neg_inf_outside_matches_the_torch_specification_bitwise(dtype, relative, has_lo, shape):
    rows, cols, er, ec = shape
    x, lo, hi = neg_inf_case(dtype, rows, cols, er, ec, sum(shape), has_lo, relative)
    args = put((jnp.asarray(x), None if lo is None else jnp.asarray(lo), jnp.asarray(hi)), cpu())
    got = _neg_inf(*args, rows=rows, cols=cols, relative=relative)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = as_torch(x)
    torch_emu.neg_inf_outside(want, None if lo is None else torch.from_numpy(lo), torch.from_numpy(hi),
                              rows, cols, relative)
    np.testing.assert_array_equal(bits(got), torch_bits(want))
    xb = bits(x)
    np.testing.assert_array_equal(bits(got)[rows:], xb[rows:])        # rows past `rows`
    np.testing.assert_array_equal(bits(got)[:, cols:], xb[:, cols:])  # columns past `cols`
    np.testing.assert_array_equal(bits(args[0]), xb)                   # the input array kept


# --- zero_masked_tail / zero_padding_rows -------------------------------------------------------

def filled(shape, dtype, seed, nan=True):
    """Values whose bits differ from zero everywhere (NaN and -0.0 among them)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) + 3).astype(np.float32)
    if nan:
        x.reshape(-1)[::5] = np.nan
    x.reshape(-1)[1::7] = -0.0
    return x.astype(dtype)


@pytest.mark.parametrize("dtype,shape", [(jnp.bfloat16, (5, 12, 64)), (np.float32, (5, 12, 4)),
                                         (jnp.bfloat16, (3, 7, 2, 8)), (np.float32, (1, 1, 32)),
                                         (jnp.bfloat16, (4, 0, 8))],
                         ids=["bf16", "f32", "bf16_4d", "f32_one_row", "empty"])
def test_zero_masked_tail_matches_the_torch_specification_bitwise(dtype, shape):
    g, max_m = shape[:2]
    d = filled(shape, dtype, g * 31 + max_m)
    masked_m = np.array([-3, 0, max_m // 2, max_m, max_m + 9][:g], np.int32)
    args = put((jnp.asarray(d), jnp.asarray(masked_m)), cpu())
    got = jax.jit(native.zero_masked_tail)(*args)
    want = as_torch(d)
    torch_emu.zero_masked_tail(want, torch.from_numpy(masked_m))
    np.testing.assert_array_equal(bits(got), torch_bits(want))
    np.testing.assert_array_equal(bits(args[0]), bits(d))


@pytest.mark.parametrize("skip", [False, True], ids=["all", "skip_padding_blocks"])
@pytest.mark.parametrize("dtype,m,n,block", [(jnp.bfloat16, 64, 64, 8), (np.float32, 37, 8, 4),
                                             (jnp.bfloat16, 130, 8, 128), (np.float32, 9, 4, 1)],
                         ids=["bf16", "f32_ragged", "bf16_big_block", "f32_block1"])
def test_zero_padding_rows_matches_the_torch_specification_bitwise(skip, dtype, m, n, block):
    rng = np.random.default_rng(m * n + block)
    d = filled((m, n), dtype, m)
    layout = rng.integers(-1, 4, m).astype(np.int32)
    layout[:block] = -1                       # a whole padding block
    layout[block:block + 3] = [2, -1, -1][:max(0, min(3, m - block))]   # padding inside a valid block
    if m > 2 * block:
        layout[2 * block:3 * block] = -1
        layout[2 * block] = 0                 # first row valid, the rest padding
    args = put((jnp.asarray(d), jnp.asarray(layout)), cpu())
    got = jax.jit(lambda d, l: native.zero_padding_rows(d, l, block=block, skip_padding_blocks=skip))(*args)
    want = as_torch(d)
    torch_emu.zero_padding_rows(want, torch.from_numpy(layout), block, skip)
    np.testing.assert_array_equal(bits(got), torch_bits(want))
    np.testing.assert_array_equal(bits(args[0]), bits(d))


# --- paged_sanitise: against the pure-JAX reference (reference.paged_mqa.paged_sanitised) --------

INT_MAX = np.iinfo(np.int32).max


def sanitise_case(b: int, w: int, next_n: int, blk: int, one_d: bool, schedule: str, seed: int,
                  slots: int | None = None):
    """(args, statics) of one paged_sanitise call: tables mostly in range with out-of-range
    entries (-1, INT_MIN, num_blocks, INT_MAX) sprinkled in, lengths from INT_MIN to past the
    limit, and no schedule, DeepGEMM's own, one made for longer rows, or noise."""
    rng = np.random.default_rng(seed)
    nb = int(rng.integers(1, 2 * b * w + 2))
    limit = w * blk if rng.random() < 0.5 else int(rng.integers(0, w * blk + 1))
    table = rng.integers(0, nb, (b, w)).astype(np.int32)
    bad = rng.random((b, w)) < 0.03
    table[bad] = rng.choice(np.array([-1, INT_MIN, nb, nb + 7, INT_MAX], np.int64), bad.sum())
    last = rng.integers(-3 * blk, limit + 3 * blk + 1, b)
    last[rng.random(b) < 0.1] = 0
    extreme = rng.random(b) < 0.05
    last[extreme] = rng.choice(np.array([INT_MIN, INT_MAX, INT_MIN + 1], np.int64), extreme.sum())
    last = last.astype(np.int32)
    if one_d:
        lens = last
    else:
        lens = last[:, None] - rng.integers(-2, 3 * next_n, (b, next_n)).astype(np.int32)
        lens[:, -1] = last
    static = dict(next_n=next_n, num_blocks=nb, block_size=blk, limit=limit, zero_unused=blk == 32)
    slots = int(rng.choice([7, 132])) if slots is None else slots
    clipped = jnp.asarray(np.clip(last, 0, limit)[:, None])
    meta = {"none": None,
            "own": ref_paged.paged_mqa_logits_metadata(clipped, num_sms=slots),
            "longer": ref_paged.paged_mqa_logits_metadata(clipped + 3 * blk, num_sms=slots),
            "noise": jnp.asarray(rng.choice(np.array([INT_MIN, -5, 0, 1, 3, b - 1, b, b + 3, INT_MAX],
                                                     np.int64), (slots + 1, 2)).astype(np.int32)),
            }[schedule]
    return (jnp.asarray(lens), jnp.asarray(table), meta), static


SANITISE = [(1, 1, 1, 64), (5, 3, 2, 32), (33, 8, 1, 32), (40, 17, 4, 64), (200, 64, 2, 64),
            (64, 129, 1, 32), (3, 9, 300, 64)]


@pytest.mark.parametrize("shape", SANITISE, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("one_d", [True, False], ids=["1d", "2d"])
@pytest.mark.parametrize("schedule", ["none", "own", "longer", "noise", "noise600"])
def test_paged_sanitise_matches_the_reference_bitwise(shape, one_d, schedule):
    b, w, next_n, blk = shape
    slots = 600 if schedule == "noise600" else None
    for trial in range(3):
        args, static = sanitise_case(b, w, next_n, blk, one_d, schedule.rstrip("0123456789"),
                                     seed_of(shape, one_d, schedule, trial), slots=slots)
        got = on(cpu(), lambda *a: native.paged_sanitise(*a, **static), *args)
        want = on(cpu(), lambda *a: ref_paged.paged_sanitised(*a, **static), *args)
        for name, g, r in zip(("ctx", "table", "schedule"), got, want):
            assert (g is None) == (r is None), name
            if g is not None:
                np.testing.assert_array_equal(g, r, err_msg=f"{name} {static} trial {trial}")
        if schedule == "own":   # DeepGEMM's own schedule of unchanged lengths comes back as it was
            same = np.array_equal(got[0][:, -1], np.clip(np.asarray(args[0]).reshape(b, -1)[:, -1], 0,
                                                         static["limit"]))
            if same:
                np.testing.assert_array_equal(got[2], np.asarray(args[2]))


# --- in place, counted, errors ------------------------------------------------------------------

def entry(hlo: str) -> str:
    return hlo[hlo.index("ENTRY"):]


def in_place_calls():
    """(name, fn of one array, input) for each in-place kernel (the int32 arrays made inside,
    so that the program runs wherever its input is)."""
    lens = lambda: jnp.arange(8, dtype=I32)   # noqa: E731
    return [
        ("neg_inf_outside",
         lambda x: native.neg_inf_outside(x, None, lens(), rows=8, cols=16, relative=False),
         jnp.ones((8, 32), jnp.float32)),
        ("zero_masked_tail", lambda x: native.zero_masked_tail(x, jnp.array([1, 2], I32)),
         jnp.ones((2, 4, 8), BF16)),
        ("zero_padding_rows",
         lambda x: native.zero_padding_rows(x, -lens(), block=4, skip_padding_blocks=True),
         jnp.ones((8, 16), jnp.float32)),
    ]


@pytest.mark.parametrize("i", range(3), ids=["neg_inf_outside", "zero_masked_tail", "zero_padding_rows"])
def test_in_place_kernels_alias_their_input(i):
    name, fn, x = in_place_calls()[i]
    x = put(x, cpu())
    target = native.TARGETS[name]
    # a temporary: written where it is, no copy
    hlo = entry(jax.jit(lambda x: fn(x * 2)).lower(x).compile().as_text())
    assert target in hlo and "output_to_operand_aliasing={{}: (0, {})}" in hlo
    assert not re.search(r"= \S+ copy\(", hlo), hlo
    # a donated parameter: written in place, the very same buffer
    hlo = entry(jax.jit(fn, donate_argnums=0).lower(x).compile().as_text())
    assert not re.search(r"= \S+ copy\(", hlo), hlo
    y = jnp.array(x)
    ptr = y.unsafe_buffer_pointer()
    out = jax.jit(fn, donate_argnums=0)(y)
    assert out.unsafe_buffer_pointer() == ptr
    # a parameter kept by the caller: XLA copies first, the caller's array is unchanged
    before = bits(x)
    out = jax.jit(fn)(x)
    np.testing.assert_array_equal(bits(x), before)
    assert not np.array_equal(bits(out), before)


def test_every_call_enters_a_native_handler_once():
    x = put(jnp.asarray(logits_case("random", 4, 32, 0)), cpu())
    f = jax.jit(lambda x: native.topk(x, None, None, k=3, cols=32, sorted=True))
    jax.block_until_ready(f(x))
    calls = native.call_count()
    for _ in range(3):
        jax.block_until_ready(f(x))
    assert native.call_count() == calls + 3
    g = jax.jit(lambda x: native.neg_inf_outside(x, None, jnp.ones((4,), I32), rows=4, cols=32,
                                                 relative=False))
    jax.block_until_ready(g(x))
    assert native.call_count() == calls + 4


def test_topk_scratch_is_sized_for_split_rows_only():
    """The top-k's scratch result (kernels/topk_split.h): float32 values and int32 columns of a
    row's chunks * k candidates, past 32768 keys, where they fit one CTA (<= 32768); zero bytes
    where rows are never split (one chunk, too many candidates, unsorted rows of 2 chunks: a
    cluster of 2 measured faster). The same on every platform (an exported program's shapes do
    not depend on it)."""
    from jax_dg.core import _native
    sizes = {(32768, 2048, True): 0,                      # one CTA holds the row
             (32769, 2048, True): 2 * 2048 * 8,
             (65536, 2048, False): 0,                     # 2 chunks unsorted: the cluster
             (65537, 2048, False): 3 * 2048 * 8,
             (131072, 4096, True): 4 * 4096 * 8,
             (262144, 4096, False): 8 * 4096 * 8,
             (270000, 4096, True): 0,                     # 9 x 4096 candidates: not split
             (270000, 512, False): 9 * 512 * 8}
    for (cols, k, srt), size in sizes.items():
        assert _native.topk_scratch_bytes(cols, k, srt) == size, (cols, k, srt)
    x = jnp.zeros((3, 40000), jnp.float32)
    text = jax.jit(lambda x: native.topk(x, None, None, k=16, cols=40000, sorted=True)).lower(x).as_text()
    assert "tensor<3x256xui8>" in text   # 2 chunks x 16 candidates x 8 bytes a row


def test_topk_scratch_of_another_size_is_refused():
    """The handler checks the scratch against the shape rule (a custom call made by hand)."""
    x = put(jnp.zeros((3, 40000), jnp.float32), cpu())
    none = jnp.zeros((0,), I32)
    call = jax.ffi.ffi_call(native.TARGETS["topk"], (jax.ShapeDtypeStruct((3, 16), I32),
                                                     jax.ShapeDtypeStruct((3, 8), jnp.uint8)))
    f = jax.jit(lambda x: call(x, none, none, cols=40000, sorted=True, has_lo=False, has_hi=False))
    with pytest.raises(Exception, match=re.escape("scratch [3, 8], expected [3, 256]")):
        jax.block_until_ready(f(x))


def test_module_facts():
    assert native.max_k() == 4096
    assert isinstance(native.cuda_built(), bool)
    from jax_dg.core import _native
    handlers = _native.handlers()
    assert sorted(handlers) == sorted(native.TARGETS.values())
    for platforms in handlers.values():
        assert "cpu" in platforms and ("CUDA" in platforms) == native.cuda_built()


@pytest.mark.parametrize("bad", ["k", "cols", "rows", "lo", "row_bytes", "block", "dtype", "limit",
                                 "negative_limit", "schedule"])
def test_bad_calls_are_xla_errors_not_crashes(bad):
    calls = {
        "k": (lambda x, i: native.topk(x, None, None, k=4097, cols=8, sorted=True), "k = 4097 > 4096"),
        "cols": (lambda x, i: native.topk(x, None, None, k=2, cols=9, sorted=True), "cols = 9"),
        "rows": (lambda x, i: native.topk(x, None, None, k=2, cols=8, sorted=True, rows=5),
                 "output rows 5"),
        "lo": (lambda x, i: native.topk(x, i[:3], None, k=2, cols=8, sorted=True), "lo has 3 elements"),
        "row_bytes": (lambda x, i: native.zero_masked_tail(x.reshape(2, 2, 8)[:, :, :2], i[:2]),
                      "not a multiple of 16"),
        "block": (lambda x, i: native.zero_padding_rows(x, i, block=0, skip_padding_blocks=True),
                  "block = 0"),
        "dtype": (lambda x, i: native.neg_inf_outside(x.astype(jnp.float16), None, i, rows=4, cols=8,
                                                      relative=False), "float32 or bfloat16"),
        "limit": (lambda x, i: native.paged_sanitise(i, i.reshape(4, 1), None, next_n=1, num_blocks=4,
                                                     block_size=64, limit=65, zero_unused=False),
                  "limit = 65 outside [0, max_blocks * block_size = 64]"),
        "negative_limit": (lambda x, i: native.paged_sanitise(i, i.reshape(4, 1), None, next_n=1,
                                                              num_blocks=4, block_size=64, limit=-1,
                                                              zero_unused=False), "limit = -1 outside"),
        "schedule": (lambda x, i: native.paged_sanitise(i, i.reshape(4, 1), i, next_n=1, num_blocks=4,
                                                        block_size=64, limit=64, zero_unused=False),
                     "must both be [S + 1 >= 1, 2]"),
    }
    fn, message = calls[bad]
    args = put((jnp.zeros((4, 8), jnp.float32), jnp.ones((4,), I32)), cpu())
    with pytest.raises(Exception, match=re.escape(message)):
        jax.block_until_ready(jax.jit(fn)(*args))
    # and the process goes on
    ok = jax.jit(lambda x: native.topk(x, None, None, k=1, cols=8, sorted=True))(args[0])
    np.testing.assert_array_equal(np.asarray(ok), 0)


# --- GPU: the CUDA handlers bitwise equal to the CPU handlers; graph replays call no handler -----

def on(device, fn, *args):
    return jax.device_get(jax.jit(fn)(*put(args, device)))


GPU_TOPK = [(2048, 8192, 2048, 0, 0), (2048, 8192, 4096, 3, 64), (64, 65536, 2048, 1, 0),
            (64, 65536, 4096, 0, 17), (128, 40960, 512, 0, 0), (128, 40961, 100, 0, 0),
            (300, 300, 4096, 2, 2), (7, 5, 3, 0, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_TOPK, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sorted", [True, False], ids=["sorted", "unsorted"])
def test_gpu_topk_equals_the_cpu_handler(shape, case, sorted):
    rows, cols, k, er, ec = shape
    seed = seed_of(shape, case)
    x = jnp.asarray(padded(logits_case(case, rows, cols, seed), er, ec))
    kinds = ("none", "lo", "hi", "both", "wild") if rows * cols <= 1 << 22 else ("none", "both", "wild")
    for kind in kinds:
        lo, hi = ranges(kind, rows, cols, seed)
        lo, hi = (None if a is None else jnp.asarray(a) for a in (lo, hi))
        fn = lambda x, lo, hi: native.topk(x, lo, hi, k=k, cols=cols, sorted=sorted, rows=rows)  # noqa: E731
        got, want = on(gpu(), fn, x, lo, hi), on(cpu(), fn, x, lo, hi)
        np.testing.assert_array_equal(got, want, err_msg=f"{kind}: CUDA != CPU")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@pytest.mark.parametrize("has_lo", [True, False], ids=["lo", "no_lo"])
@pytest.mark.parametrize("shape", [(2048, 8192, 0, 0), (2048, 8192, 16, 64), (64, 65536, 1, 3),
                                   (3000, 100, 2, 0)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_neg_inf_outside_equals_the_cpu_handler(dtype, relative, has_lo, shape):
    rows, cols, er, ec = shape
    x, lo, hi = neg_inf_case(dtype, rows, cols, er, ec, sum(shape), has_lo, relative)
    args = (jnp.asarray(x), None if lo is None else jnp.asarray(lo), jnp.asarray(hi))
    # x a parameter: XLA copies it (bitwise) before the in-place call; arithmetic could
    # canonicalize NaN bits differently on the two platforms
    fn = lambda x, lo, hi: native.neg_inf_outside(x, lo, hi, rows=rows, cols=cols,  # noqa: E731
                                                  relative=relative)
    np.testing.assert_array_equal(bits(on(gpu(), fn, *args)), bits(on(cpu(), fn, *args)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 512, 2048), (70000, 2, 8), (3, 4096, 7168)],
                         ids=["16x512x2048", "70000_groups", "3x4096x7168"])
def test_gpu_zero_masked_tail_equals_the_cpu_handler(shape):
    g, max_m = shape[:2]
    d = jnp.asarray(filled(shape, jnp.bfloat16, g))
    masked_m = jnp.asarray(np.random.default_rng(g).integers(-2, max_m + 3, g).astype(np.int32))
    fn = lambda d, m: native.zero_masked_tail(d, m)   # noqa: E731  (copied first, bitwise)
    np.testing.assert_array_equal(bits(on(gpu(), fn, d, masked_m)), bits(on(cpu(), fn, d, masked_m)))


@pytest.mark.gpu
@pytest.mark.parametrize("skip", [False, True], ids=["all", "skip_padding_blocks"])
@pytest.mark.parametrize("m,n,block", [(8192, 2048, 128), (1001, 64, 64), (33, 8, 1)])
def test_gpu_zero_padding_rows_equals_the_cpu_handler(skip, m, n, block):
    rng = np.random.default_rng(m)
    d = jnp.asarray(filled((m, n), jnp.bfloat16, m))
    layout = rng.integers(-1, 8, m).astype(np.int32)
    layout[block:2 * block] = -1
    layout = jnp.asarray(layout)
    fn = lambda d, l: native.zero_padding_rows(d, l, block=block, skip_padding_blocks=skip)  # noqa: E731
    np.testing.assert_array_equal(bits(on(gpu(), fn, d, layout)), bits(on(cpu(), fn, d, layout)))


GPU_SANITISE = [(64, 128, 1, 64), (256, 512, 2, 64), (1000, 2561, 1, 32), (3, 5, 4, 32), (256, 512, 2, 32),
                (7, 40, 130, 64), (4, 9, 300, 32)]   # next_n past a CTA's 128 threads


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SANITISE, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("one_d", [True, False], ids=["1d", "2d"])
@pytest.mark.parametrize("schedule", ["none", "own", "longer", "noise", "noise600", "own300"])
def test_gpu_paged_sanitise_equals_the_cpu_handler(shape, one_d, schedule):
    """Also schedules of 301 and 601 entries: FixSchedule scans them in chunks of 256 with a
    running maximum carried across."""
    b, w, next_n, blk = shape
    slots = {"noise600": 600, "own300": 300}.get(schedule)
    args, static = sanitise_case(b, w, next_n, blk, one_d, schedule.rstrip("0123456789"),
                                 seed_of(shape, one_d, schedule), slots=slots)
    fn = lambda *a: native.paged_sanitise(*a, **static)   # noqa: E731
    want = on(cpu(), fn, *args)
    for _ in range(3):   # repeated calls: the same bits
        got = on(gpu(), fn, *args)
        for name, g, r in zip(("ctx", "table", "schedule"), got, want):
            if r is not None:
                np.testing.assert_array_equal(g, r, err_msg=f"{name}: CUDA != CPU")


@pytest.mark.gpu
def test_gpu_errors_are_xla_errors():
    x = jax.device_put(jnp.zeros((4, 8), jnp.float32), gpu())
    with pytest.raises(Exception, match=re.escape("k = 4097 > 4096")):
        jax.block_until_ready(jax.jit(lambda x: native.topk(x, None, None, k=4097, cols=8, sorted=True))(x))
    got = jax.jit(lambda x: native.topk(x, None, None, k=2, cols=8, sorted=True))(x)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1]] * 4)


CHAIN = 6   # native calls per jitted step: above XLA's default minimum graph size (5)


def _capture_inputs(i: int):
    """One step's inputs (every kernel), scaled by i: new values, same shapes."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(logits_case("ties", 256, 8192, 1)) * (1 + i / 8)
    lo, hi = (jnp.asarray(a) for a in ranges("both", 256, 8192, 1))
    # no NaN: the step computes on these, and NaN bits may differ between the platforms
    d = jnp.asarray(filled((4, 128, 256), jnp.bfloat16, 2, nan=False)) * (1 + i)
    masked_m = jnp.asarray([100, 0, 128, 7], I32)
    layout = jnp.asarray(rng.integers(-1, 4, 512).astype(np.int32))
    p = jnp.asarray(filled((512, 256), jnp.bfloat16, 3, nan=False)) * (1 + i)
    paged_args, _ = sanitise_case(*CAPTURED_SANITISE, seed=i, slots=132)
    return x, lo, hi, d, masked_m, layout, p, paged_args


CAPTURED_SANITISE = (64, 128, 2, 32, False, "longer")   # one shape; values from the step's seed


def captured_sanitise(args):
    return native.paged_sanitise(*args, **sanitise_case(*CAPTURED_SANITISE, seed=0, slots=132)[1])


def _capture_step(inputs):
    out = []
    for j, (x, lo, hi, d, masked_m, layout, p, paged_args) in enumerate(inputs):
        out.append(native.topk(x, lo, hi, k=512 + j, cols=8192, sorted=j % 2 == 0))
        out.append(native.topk(x, None, hi, k=2048, cols=8000, sorted=False))
        out.append(native.neg_inf_outside(x * 2, lo, hi, rows=256, cols=8192, relative=j % 2 == 1))
        out.append(native.zero_masked_tail(d * 1, masked_m))
        out.append(native.zero_padding_rows(p * 1, layout, block=128, skip_padding_blocks=j % 2 == 0))
        out.extend(captured_sanitise(paged_args))
    return out


@pytest.mark.gpu
def test_gpu_captured_replays_call_no_handler_and_equal_the_cpu():
    inputs = put([_capture_inputs(i) for i in range(CHAIN)], gpu())
    # Each kernel once outside any graph first (one custom call per program: below XLA's
    # minimum graph size), as a real program's warm-up would: the first launch of a kernel
    # loads its module (lazy loading), which is then not part of the capture.
    warm = [(lambda x, lo, hi, *_: native.topk(x, lo, hi, k=512, cols=8192, sorted=True)),
            (lambda x, lo, hi, *_: native.topk(x, None, hi, k=2048, cols=8000, sorted=False)),
            (lambda x, lo, hi, *_: native.neg_inf_outside(x, lo, hi, rows=256, cols=8192, relative=False)),
            (lambda x, lo, hi, d, masked_m, *_: native.zero_masked_tail(d, masked_m)),
            (lambda *a: native.zero_padding_rows(a[6], a[5], block=128, skip_padding_blocks=True)),
            (lambda *a: captured_sanitise(a[7]))]
    for fn in warm:
        jax.block_until_ready(jax.jit(fn)(*inputs[0]))
    step = jax.jit(_capture_step)
    calls = native.call_count()
    first = jax.block_until_ready(step(inputs))      # compiles, then records the graph
    second = jax.block_until_ready(step(inputs))
    assert native.call_count() > calls, "the handlers never ran"
    # XLA re-records a traced command when one of its buffers moves; results kept alive make it
    # allocate new ones. Freeing the last results first hands the same addresses back.
    again = None
    for _ in range(2):
        again = None
        again = jax.block_until_ready(step(inputs))
    calls = native.call_count()
    for _ in range(10):
        again = None
        again = jax.block_until_ready(step(inputs))  # same buffers: replays
    assert native.call_count() == calls, "a replay called a native handler"
    want = jax.device_get(jax.jit(_capture_step)(put([_capture_inputs(i) for i in range(CHAIN)], cpu())))
    for name, outs in (("first", first), ("second", second), ("replay", again)):
        for n, (got, ref) in enumerate(zip(jax.device_get(outs), want)):
            np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"{name} output {n}: CUDA != CPU")
    new = put([_capture_inputs(i + CHAIN) for i in range(CHAIN)], gpu())   # new values: re-recorded
    fresh = jax.device_get(step(new))
    want = jax.device_get(jax.jit(_capture_step)(put([_capture_inputs(i + CHAIN) for i in range(CHAIN)], cpu())))
    for n, (got, ref) in enumerate(zip(fresh, want)):
        np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"re-captured output {n}: CUDA != CPU")
