"""One jitted m-grouped FP8 call (clean=True, then clean=False) inside a profiler range, for
Nsight Compute: where the cleaning's time goes, kernel by kernel.

    ncu --profile-from-start off --metrics gpu__time_duration.sum \
        python benchmarks/grouped_probe.py [contiguous|masked] [G] [sum(M)]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_dg
from jax_dg.contracts import align

form, g, total = (sys.argv[1:] + ["contiguous", "8", "30400"][len(sys.argv) - 1:])[:3]
g, total = int(g), int(total)
N, K = 4096, 7168
rng = np.random.default_rng(0)
ms = [max(1, int(total / g * rng.uniform(0.7, 1.3))) for _ in range(g)]
key = jax.random.PRNGKey(0)
b = jax.vmap(jax_dg.per_block_cast_to_fp8)(jax.random.normal(key, (g, N, K), jnp.bfloat16))
if form == "contiguous":
    layout = jnp.asarray(np.concatenate([np.r_[np.full(m, i), np.full(align(m, 128) - m, -1)]
                                         for i, m in enumerate(ms)]).astype(np.int32))
    x = jax.random.normal(key, (layout.shape[0], K), jnp.bfloat16)
    a = jax_dg.per_token_cast_to_fp8(jnp.where(layout[:, None] >= 0, x, 0))
    calls = {c: jax.jit(lambda a, b, l, c=c: jax_dg.m_grouped_fp8_gemm_nt_contiguous(a, b, l, clean=c))
             for c in (True, False)}
    args = (a, b, layout)
else:
    max_m = align(max(ms), 128)
    a = jax.vmap(jax_dg.per_token_cast_to_fp8)(jax.random.normal(key, (g, max_m, K), jnp.bfloat16))
    calls = {c: jax.jit(lambda a, b, mm, c=c: jax_dg.m_grouped_fp8_gemm_nt_masked(a, b, mm, total // g,
                                                                                 clean=c))
             for c in (True, False)}
    args = (a, b, jnp.asarray(ms, jnp.int32))
for f in calls.values():
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
torch.cuda.synchronize()
for clean, f in calls.items():
    print(f"--- clean={clean}", flush=True)
    torch.cuda.profiler.start()
    jax.block_until_ready(f(*args))
    torch.cuda.profiler.stop()
