"""Pure-JAX references of every op: the test oracle, and the `JAX_DG_BACKEND=xla` lowering."""
