"""One jax_dg top-k call on indexer-sized logits, for a profiler (e.g. Nsight Compute):

    ncu -k regex:TopkKernel -c 1 --launch-skip 1 python benchmarks/topk_probe.py [rows] [cols] [k]
"""

import sys

import jax
import jax.numpy as jnp

import jax_dg

rows, cols, k = (int(a) for a in (sys.argv[1:] + ["2048", "8192", "2048"][len(sys.argv) - 1:]))
x = jax.random.normal(jax.random.PRNGKey(0), (rows, cols), jnp.float32)
f = jax.jit(lambda x: jax_dg.topk_indices(x, k))
jax.block_until_ready(f(x))
jax.block_until_ready(f(x))
