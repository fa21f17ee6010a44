"""Concurrency (issue 13): 8 Python threads calling different jitted jax_dg programs at once
give results bitwise equal to a single-threaded run, and finish (a deadlock between the GIL,
XLA's threads and torch's stream state fails the test by its timeout instead of hanging it).
On the CPU through the torch emulation; on the GPU through DeepGEMM and jax_dg's top-k kernel.
Under compute-sanitizer run it with `scripts/sanitize.sh threads`: the sanitizer's host
backtraces take the GIL inside CUDA launches and deadlock it (docs/testing.md)."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dg
from tests.conftest import bits
from tests.test_values import CASES

# Value cases' in-range inputs: MQA logits, the indexer, paged logits, grouped GEMMs, top-k.
FROM_CASES = ("mqa_full", "indexer_topk", "paged_block_tables", "grouped_fp8", "grouped_bf16",
              "masked_fp8", "topk_indices")


def programs():
    progs = {}
    for name in FROM_CASES:
        fn, _, good = CASES[name][0]()
        progs[name] = (jax.jit(fn), good)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
    a, b = jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(y)
    progs["fp8_gemm_nt"] = (jax.jit(jax_dg.fp8_gemm_nt), (a, b))
    progs["bf16_gemm_nt"] = (jax.jit(jax_dg.bf16_gemm_nt), (x, y))
    return progs


def run_threads(threads: int = 8, calls: int = 30, timeout_s: float = 300.0):
    progs = programs()
    names = sorted(progs)
    want = {n: bits(progs[n][0](*progs[n][1])) for n in names}   # single thread (and compiles)
    errors: list[str] = []
    barrier = threading.Barrier(threads)

    def worker(i):
        name = names[i % len(names)]
        fn, args = progs[name]
        try:
            barrier.wait(timeout_s)
            for c in range(calls):
                if bits(fn(*args)) != want[name]:
                    errors.append(f"thread {i} ({name}) call {c}: result differs")
        except Exception as e:   # reported below: a thread's failure must fail the test
            errors.append(f"thread {i} ({name}): {type(e).__name__}: {e}")

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    deadline = time.monotonic() + timeout_s
    for t in pool:
        t.start()
    for t in pool:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(pool) if t.is_alive()]
    assert not stuck, f"threads {stuck} still running after {timeout_s} s: deadlock?"
    assert not errors, errors[:8]
    assert len(names) >= threads   # each thread ran a different program


def test_threads_on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        run_threads(calls=10)


@pytest.mark.gpu
def test_gpu_threads_call_different_programs_concurrently():
    run_threads(calls=30, timeout_s=240.0)
