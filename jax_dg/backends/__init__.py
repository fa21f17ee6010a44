"""The kernel namespaces an op's run function is written against (DeepGEMM's API):

  deep_gemm  the installed DeepGEMM, found lazily, symbols resolved across versions (a leaf:
             it imports nothing of jax_dg)
  kernels    jax_dg's own CUDA kernels (kernels/*.cu; the indexer's top-k), where built
  torch_emu  DeepGEMM's API implemented in plain torch (the CPU backend, any device on request),
             and references of jax_dg's own kernels

Which one runs is chosen in jax_dg.core.backend. torch is optional (jax_dg.backends.optional):
imported only by the torch emulation and where DeepGEMM runs.
"""
