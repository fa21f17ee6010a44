"""The kernel namespaces an op's run function is written against (DeepGEMM's API, `rt.dg`):

  deep_gemm  the installed DeepGEMM, found lazily, symbols resolved across versions (a leaf:
             it imports nothing of jax_dg)
  torch_emu  DeepGEMM's API implemented in plain torch (the CPU backend, any device on request),
             with its own landing of the one allocation a logits call makes
  emulated   the device the emulations emulate (its SM count), without torch

  optional   torch, imported on first use (MissingTorchError names the extra that brings it)

Which one runs is decided while tracing (jax_dg.core.backend, jax_dg.core.dispatch). torch is
optional: imported only by the torch emulation and where DeepGEMM runs.
"""
