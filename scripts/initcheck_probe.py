"""What compute-sanitizer's initcheck can see of DeepGEMM's writes (scripts/sanitize.sh probe).

Each step prints a marker, then copies one small output to the host; `sanitize.sh probe` counts
initcheck's reports per step. On the H200 (CUDA 13, DeepGEMM 2.5) every 32-byte sector of a
DeepGEMM GEMM's output is reported uninitialised, whether jax_dg or torch called it, while the
same kernel writing into torch.zeros, XLA's own kernels, jax_dg's top-k kernel and the logits
kernels report nothing: initcheck does not track the GEMMs' TMA stores, so it cannot judge them.
The reported outputs are checked against the GEMM at the end, so "not written" is ruled out.
The logits step is a small causal case: it says nothing of the padding a larger one leaves.
The last two steps hand a DeepGEMM kernel and jax_dg's top-k kernel memory nobody wrote: they
must report, which shows that initcheck checks the reads of both kinds of kernel.
"""

import numpy as np
import jax
import jax.numpy as jnp
import torch

import jax_dg
import deep_gemm
from jax_dg.tools.interop import to_jax, to_torch


def step(tag):
    print(f"=== STEP {tag}", flush=True)


def main():
    step("setup")
    key = jax.random.PRNGKey(0)
    m, n, k = 8, 128, 128
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (n, k), jnp.bfloat16)
    a, b = jax_dg.per_token_cast_to_fp8(x), jax_dg.per_block_cast_to_fp8(w)
    jax.block_until_ready((a, b))
    ta, tb = (to_torch(a[0]), to_torch(a[1])), (to_torch(b[0]), to_torch(b[1]))
    got = {}   # host copies, checked at the end on the host (no device reads of their own)

    step("xla_kernel_output (control: expect 0)")
    np.asarray(jnp.ones((m, n), jnp.bfloat16) * 2)
    step("jax_dg_fp8_gemm_nt (TMA store)")
    got["jax_dg fp8"] = np.asarray(jax.jit(jax_dg.fp8_gemm_nt)(a, b))
    step("deep_gemm_from_torch_into_empty (TMA store)")
    d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    deep_gemm.fp8_gemm_nt(ta, tb, d)
    got["torch fp8, empty"] = d.cpu()
    step("deep_gemm_from_torch_into_zeros (control: expect 0)")
    d = torch.zeros((m, n), dtype=torch.bfloat16, device="cuda")
    deep_gemm.fp8_gemm_nt(ta, tb, d)
    got["torch fp8, zeros"] = d.cpu()
    step("jax_dg_bf16_gemm_nt (TMA store)")
    got["jax_dg bf16"] = np.asarray(jax.jit(jax_dg.bf16_gemm_nt)(x, w))
    step("jax_dg_topk_indices (jax_dg's kernel)")
    np.asarray(jax.jit(lambda v: jax_dg.topk_indices(v, 512))(jax.random.normal(key, (8, 4096))))
    step("jax_dg_mqa_logits")
    q = jax.random.normal(key, (16, 32, 64)).astype(jnp.float8_e4m3fn)
    kv = jax_dg.per_row_cast_to_fp8(jax.random.normal(key, (256, 64)))
    ks, ke = jax_dg.causal_ks_ke(16, 256)
    np.asarray(jax.jit(jax_dg.mqa_logits)(q, kv, jax.random.normal(key, (16, 32)), ks, ke))

    step("deep_gemm_kernel_reads_torch_empty (control: expect > 0)")
    # slices of fresh large allocations: a small torch.empty may reuse a block written above
    lens = torch.empty(16 << 20, dtype=torch.int32, device="cuda")[:8].view(8, 1)
    deep_gemm.get_paged_mqa_logits_metadata(lens, 64, deep_gemm.get_num_sms())
    torch.cuda.synchronize()
    step("jax_dg_topk_reads_torch_empty (control: expect > 0)")
    junk = to_jax(torch.empty((1024, 4096), device="cuda")[:8])
    np.asarray(jax.jit(lambda v: jax_dg.topk_indices(v, 512))(junk))

    # The reported outputs were written: each is the GEMM (DeepGEMM's thresholds).
    step("values (host only)")
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    for name, out in got.items():
        out = out.float().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, np.float32)
        diff = jax_dg.calc_diff(out, want)
        print(f"{name}: calc_diff {diff:.2e}", flush=True)
        assert diff < (1e-5 if "bf16" in name else 1e-3), name
    step("end")


if __name__ == "__main__":
    main()
