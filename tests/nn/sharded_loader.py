"""load_checkpoint onto a mesh (run by test_loader.py in a process with 8 host devices): the
experts split over an "expert" axis, a transposed bf16 kernel over "model"; each variable holds
its annotated sharding and the values a load without a mesh gives. Prints `sharded load ok`."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dg import nn
from jax_dg.nn.loader import load_checkpoint
from tests.nn.test_loader import Model


def main(path: str):
    cfg = nn.load_config(path)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("expert", "model"))
    meta = {"out_sharding": ("expert", None, None), "mesh": mesh}
    with jax.set_mesh(mesh):
        m = nnx.eval_shape(lambda: Model(cfg, nnx.Rngs(0), expert_metadata=meta))
    # the head's kernel [in, out] split over "model" on out (a transposed tensor)
    m.head.kernel.set_metadata("out_sharding", (None, "model"))
    load_checkpoint(path, m, mesh=mesh)
    plain = load_checkpoint(path, nnx.eval_shape(lambda: Model(cfg, nnx.Rngs(0))))
    moe = m.layers[1].ffn
    assert moe.w13[...].sharding == NamedSharding(mesh, P("expert", None, None)), moe.w13[...].sharding
    assert moe.w2_scale_inv[...].sharding == NamedSharding(mesh, P("expert", None, None))
    assert len(moe.w13[...].addressable_shards) == 8
    assert moe.w13[...].addressable_shards[0].data.shape == (2, 256, 256)   # 8 experts over 4
    assert m.head.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))
    assert m.head.kernel[...].addressable_shards[0].data.shape == (256, 256)
    for (pa, a), (pb, b) in zip(nnx.to_flat_state(nnx.state(m)), nnx.to_flat_state(nnx.state(plain))):
        assert pa == pb and np.array_equal(np.asarray(a.get_value()).astype(np.float32),
                                           np.asarray(b.get_value()).astype(np.float32)), pa
    # the sharded MoE runs (its grouped GEMMs split over the experts) and agrees with the unsharded one
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 256), jnp.bfloat16)
    y = nnx.jit(lambda m, x: m(x))(moe, x)
    want = nnx.jit(lambda m, x: m(x))(plain.layers[1].ffn, x)
    assert np.array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    print("sharded load ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
