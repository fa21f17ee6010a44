"""What compute-sanitizer's initcheck can see of DeepGEMM's writes (scripts/sanitize.sh probe).

Each step prints a marker, then copies one small output to the host; `sanitize.sh probe` counts
initcheck's reports per step. On the H200 (CUDA 13, DeepGEMM 2.5) every 32-byte sector of a
DeepGEMM GEMM's output is reported uninitialised, whether jax_dg or torch called it, while the
same kernel writing into torch.zeros, XLA's own kernels, jax_dg's top-k kernel and the logits
kernels report nothing: initcheck does not track the GEMMs' TMA stores, so it cannot judge them.
"""

import numpy as np
import jax
import jax.numpy as jnp
import torch

import jax_dg
import deep_gemm


def step(tag):
    print(f"=== STEP {tag}", flush=True)


def as_torch(v):
    if v.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(v, jnp.uint8)).view(torch.float8_e4m3fn)
    return torch.from_dlpack(v)


def main():
    key = jax.random.PRNGKey(0)
    m, n, k = 8, 128, 128
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (n, k), jnp.bfloat16)
    a, b = jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(w)
    jax.block_until_ready((a, b))
    ta, tb = (as_torch(a[0]), as_torch(a[1])), (as_torch(b[0]), as_torch(b[1]))

    step("xla_kernel_output (control: expect 0)")
    np.asarray(jnp.ones((m, n), jnp.bfloat16) * 2)
    step("jax_dg_fp8_gemm_nt (TMA store)")
    np.asarray(jax.jit(jax_dg.fp8_gemm_nt)(a, b))
    step("deep_gemm_from_torch_into_empty (TMA store)")
    d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    deep_gemm.fp8_gemm_nt(ta, tb, d)
    d.cpu()
    step("deep_gemm_from_torch_into_zeros (control: expect 0)")
    d = torch.zeros((m, n), dtype=torch.bfloat16, device="cuda")
    deep_gemm.fp8_gemm_nt(ta, tb, d)
    d.cpu()
    step("jax_dg_bf16_gemm_nt (TMA store)")
    np.asarray(jax.jit(jax_dg.bf16_gemm_nt)(x, w))
    step("jax_dg_topk_indices (jax_dg's kernel)")
    np.asarray(jax.jit(lambda v: jax_dg.topk_indices(v, 512))(jax.random.normal(key, (8, 4096))))
    step("jax_dg_mqa_logits")
    q = jax.random.normal(key, (16, 32, 64)).astype(jnp.float8_e4m3fn)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(key, (256, 64)))
    ks, ke = jax_dg.causal_ks_ke(16, 256)
    np.asarray(jax.jit(jax_dg.mqa_logits)(q, kv, jax.random.normal(key, (16, 32)), ks, ke))
    step("end")


if __name__ == "__main__":
    main()
