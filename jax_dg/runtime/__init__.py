"""The run-time half: what runs inside a DeepGEMM op's custom call, on torch tensors.

    bridge   the Python half of the FFI bridge: a call site's prepared closure (its run
             function on XLA's stream), the probe, the caches; ffi/bridge.cc imports it at its
             first call, so `import jax_dg` and tracing import no torch
    run      `Run`, what an op's run function receives first (`rt`): the call's kernels
             (`rt.dg`: DeepGEMM's resolved symbols or the torch emulation) and jax_dg's torch
             helpers (dtypes, MN-major views, sparse metadata, the landing)
    guards   what wraps every run: the op's name on its errors, the capture guard
    landing  DeepGEMM's own allocations placed in XLA's result buffers

Nothing of the trace-time half (jax_dg.core, the ops) imports it: it reads what the trace
decided from the call-site record (jax_dg.core.site) and the registry, and asks the resolver
(jax_dg.core.dispatch.kernels) for the kernels of the record's backend.
"""
