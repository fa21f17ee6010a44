"""GPU: every element of what the ops that promise fully defined outputs return is written by a
kernel before anything reads it. This file is compute-sanitizer initcheck's target
(scripts/sanitize.sh initcheck): each case runs the op in jit on random data and then reads
every element of its results in one XLA reduction, so an element no kernel wrote is reported
there, and a read of unwritten memory inside the op is reported in the op's own kernels. No
oracle runs here (torch.topk, for one, reports its own workspace: docs/testing.md); the values
are checked against DeepGEMM and the references in tests/ops/. Without the sanitizer each case
checks what it can see: two calls bitwise equal, no NaN, -inf exactly at the invalid positions.

Not here: the GEMMs and grouped GEMMs, whose outputs DeepGEMM writes with TMA stores, which
initcheck does not track (scripts/initcheck_probe.py shows it for deep_gemm called from torch
too); memcheck and the sentinel-filled output tests cover those."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from tests.conftest import UNDER_SANITIZER
from tests.ops.test_mqa import gpu_inputs, make_inputs, valid_of, varied_ranges
from tests.ops.test_paged_mqa import gpu_case

UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@jax.jit
def read_all(x):
    """One pass that reads all of x: (sum of every element's bits, count of values no op
    returns (NaN; an index < -1), count of the marked ones (-inf; -1)). Every result is
    computed from x: a constant result would be copied from a module global, whose
    initialisation initcheck does not see."""
    u = jax.lax.bitcast_convert_type(x, UINT[x.dtype.itemsize]).astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.sum(u), jnp.sum(jnp.isnan(x)), jnp.sum(x == -jnp.inf)
    return jnp.sum(u), jnp.sum(x < -1), jnp.sum(x == -1)


def mqa_case(keys, ranges, **kw):
    if ranges == "causal":
        q, kv, w, ks, ke = gpu_inputs(keys, 1024, 4096, 64, 128)
    else:   # ks > 0 too: invalid positions on both sides of a row's range
        q, kv, w = make_inputs(keys, 1000, 5000, 64, 128)
        ks, ke = varied_ranges(keys, 1000, 5000)
    width = kw.pop("max_seqlen_k", None)
    if width == "max":
        width = int((ke - ks).max())
    n = width or kv[0].shape[0]
    invalid = int((~valid_of(ks, ke, n, width is not None)).sum())
    return (lambda: jax_dg.mqa_logits(q, kv, w, ks, ke, max_seqlen_k=width, **kw)), invalid


def paged_case(next_n, **kw):
    q, cache, w, lens, table, max_len = gpu_case(64, next_n, 64, avg=4096, seed=next_n)
    invalid = int((max_len - np.minimum(np.asarray(lens), max_len)).sum())
    return (lambda: jax_dg.paged_mqa_logits(q, cache, w, lens, table, max_model_len=max_len, **kw)), invalid


def indexer_case(keys, sorted):
    q, kv, w, ks, ke = gpu_inputs(keys, 1024, 4096, 64, 128)
    return (lambda: jax_dg.indexer_topk(q, kv, w, ks, ke, 2048, sorted=sorted)), None


def paged_indexer_case():
    q, cache, w, lens, table, max_len = gpu_case(64, 1, 64, avg=4096, seed=3)
    return (lambda: jax_dg.paged_indexer_topk(q, cache, w, lens, table, 2048, max_model_len=max_len)), None


def topk_case(keys):
    x = jax.random.normal(keys(), (512, 8192), jnp.float32)
    ks = jax.random.randint(keys(), (512,), 0, 2048)
    ke = jnp.minimum(ks + jax.random.randint(keys(), (512,), 100, 8192), 8192).astype(jnp.int32)
    return (lambda: jax_dg.topk_indices(x, 1024, ks=ks, ke=ke)), None


def metadata_case():
    _, _, _, lens, _, _ = gpu_case(64, 2, 64, avg=4096, seed=5)
    return (lambda: jax_dg.get_paged_mqa_logits_metadata(lens, 64)), None


CASES = {
    "mqa_full": lambda keys: mqa_case(keys, "causal"),
    "mqa_full_bf16": lambda keys: mqa_case(keys, "causal", logits_dtype=jnp.bfloat16),
    "mqa_full_varied": lambda keys: mqa_case(keys, "varied"),
    "mqa_compressed": lambda keys: mqa_case(keys, "varied", max_seqlen_k="max"),
    "mqa_compressed_cut": lambda keys: mqa_case(keys, "varied", max_seqlen_k=1000),
    "paged_next_n_1": lambda keys: paged_case(1),
    "paged_next_n_2": lambda keys: paged_case(2),
    "paged_bf16": lambda keys: paged_case(2, logits_dtype=jnp.bfloat16),
    "indexer_topk": lambda keys: indexer_case(keys, True),
    "indexer_topk_unsorted": lambda keys: indexer_case(keys, False),
    "paged_indexer_topk": lambda keys: paged_indexer_case(),
    "topk_indices": topk_case,
    "paged_metadata": lambda keys: metadata_case(),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_every_returned_element_is_written(keys, case):
    call, invalid = CASES[case](keys)
    f = jax.jit(call)
    first = [tuple(int(v) for v in read_all(x)) for x in jax.tree.leaves(f())]
    again = [tuple(int(v) for v in read_all(x)) for x in jax.tree.leaves(f())]
    if UNDER_SANITIZER and first != again:
        # under initcheck DeepGEMM's logits kernels are not repeatable, called from torch too
        # (docs/testing.md); plain runs assert it
        warnings.warn(f"{case}: two calls differ under the sanitizer", stacklevel=1)
    else:
        assert first == again, f"{case}: two calls differ"
    for bits, bad, marked in first:
        assert bad == 0, f"{case}: {bad} NaN (or indices < -1) in the result"
    if invalid is not None:
        assert first[0][2] == invalid, f"{case}: {first[0][2]} -inf, {invalid} invalid positions"
