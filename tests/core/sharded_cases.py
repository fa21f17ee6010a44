"""Sharded jax_dg ops on a mesh (run by test_sharding.py in a process with 8 host devices, and
by the GPU tests on real devices): each case checks the result against the unsharded one and
the compiled HLO for collectives. Prints one line per case: `case <name> ok`."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_dg
from jax_dg.operands import paged

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
FP8 = jnp.float8_e4m3fn


def collectives(f, *args) -> list[str]:
    hlo = jax.jit(f).lower(*args).compile().as_text()
    return [c for c in COLLECTIVES if c in hlo]


def put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def case(name, f, args, sharded_args, *, expect=(), exact=True):
    want = jax.jit(f)(*args)
    got = jax.jit(f)(*sharded_args)
    found = collectives(f, *sharded_args)
    assert sorted(found) == sorted(expect), f"{name}: collectives {found}, expected {list(expect)}"
    if exact:
        assert same(got, want), f"{name}: sharded != unsharded"
    else:
        diff = jax_dg.calc_diff(np.asarray(got, np.float32), np.asarray(want, np.float32))
        assert diff < 1e-4, f"{name}: calc_diff {diff}"
    print(f"case {name} ok", flush=True)


def main(d: int):
    devs = np.array(jax.devices()[:d])
    mesh = Mesh(devs, ("x",))
    key = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    normal = lambda shape, dt=jnp.bfloat16: jax.random.normal(next(key), shape, jnp.float32).astype(dt)  # noqa: E731

    # fp8_gemm_nt on M, on N, on K
    m, n, k = 64 * d, 128 * d, 128 * d
    a = jax_dg.per_token_cast_to_fp8(normal((m, k)))
    b = jax_dg.per_block_cast_to_fp8(normal((n, k)))
    f = jax_dg.fp8_gemm_nt
    case("fp8_gemm_nt/M", f, (a, b), ((put(mesh, a[0], "x"), put(mesh, a[1], "x")), b))
    case("fp8_gemm_nt/N", f, (a, b), (a, (put(mesh, b[0], "x"), put(mesh, b[1], "x"))))
    case("fp8_gemm_nt/K", f, (a, b), ((put(mesh, a[0], None, "x"), put(mesh, a[1], None, "x")),
                                      (put(mesh, b[0], None, "x"), put(mesh, b[1], None, "x"))),
         expect=("all-reduce",) if d > 1 else (), exact=False)
    x, w = normal((m, k)), normal((n, k))
    case("bf16_gemm_nt/M", jax_dg.bf16_gemm_nt, (x, w), (put(mesh, x, "x"), w))
    case("bf16_gemm_nt/N", jax_dg.bf16_gemm_nt, (x, w), (x, put(mesh, w, "x")))

    # m-grouped masked over experts (G), contiguous over rows
    g = d
    xm = normal((g, 128, 256))
    wg = normal((g, 256, 256))
    am = tuple(jax.vmap(jax_dg.per_token_cast_to_fp8)(xm))
    bg = tuple(jax.vmap(jax_dg.per_block_cast_to_fp8)(wg))
    mm = jnp.asarray(np.arange(g) * 17 % 129, jnp.int32)
    fm = lambda a, b, mm: jax_dg.m_grouped_fp8_gemm_nt_masked(a, b, mm, 64)   # noqa: E731
    case("m_grouped_fp8_masked/G", fm, (am, bg, mm),
         (tuple(put(mesh, t, "x") for t in am), tuple(put(mesh, t, "x") for t in bg), put(mesh, mm, "x")))
    rows = 128 * d
    layout = jnp.asarray(np.repeat(np.arange(d) % g, 128) - (np.arange(rows) % 128 > 100), jnp.int32)
    layout = jnp.where(layout < 0, -1, layout)
    xc = jax_dg.per_token_cast_to_fp8(normal((rows, 256)))
    case("m_grouped_fp8_contiguous/M", jax_dg.m_grouped_fp8_gemm_nt_contiguous, (xc, bg, layout),
         ((put(mesh, xc[0], "x"), put(mesh, xc[1], "x")), bg, put(mesh, layout, "x")))

    # mqa_logits over queries, paged logits over requests
    mq, nk, h, dd = 32 * d, 256, 32, 64
    q = normal((mq, h, dd)).astype(FP8)
    kv = jax_dg.per_row_cast_to_fp8(normal((nk, dd)))
    wq = normal((mq, h), jnp.float32)
    ks = jnp.asarray(np.arange(mq) % 7, jnp.int32)
    ke = ks + jnp.asarray(np.arange(mq) * 13 % nk, jnp.int32)
    ke = jnp.minimum(ke, nk)
    fq = lambda q, w, ks, ke: jax_dg.mqa_logits(q, kv, w, ks, ke)   # noqa: E731
    case("mqa_logits/M", fq, (q, wq, ks, ke), tuple(put(mesh, t, "x") for t in (q, wq, ks, ke)))
    bq, blk = 2 * d, 64
    ctx = np.asarray([(37 * i) % 300 + 1 for i in range(bq)], np.int32)
    table, nb = paged.build_block_tables(ctx, blk, key=0, num_blocks=int((-(-ctx // blk)).sum()) + 2)
    cache = paged.quantize_kv_cache(normal((nb, blk, 128)))
    qp = normal((bq, 1, 32, 128)).astype(FP8)
    wp = normal((bq, 32), jnp.float32)
    lens = jnp.asarray(ctx)
    fp = lambda q, w, lens, table: jax_dg.paged_mqa_logits(q, cache, w, lens, table, max_model_len=320)  # noqa: E731
    case("paged_mqa_logits/B", fp, (qp, wp, lens, table), tuple(put(mesh, t, "x") for t in (qp, wp, lens, table)))
    # the indexer's selection over rows, and the fused steps over queries / requests
    ft = lambda x: jax_dg.topk_indices(x, 40)   # noqa: E731
    logits = fq(q, wq, ks, ke)
    case("topk_indices/M", ft, (logits,), (put(mesh, logits, "x"),))
    fi = lambda q, w, ks, ke: jax_dg.indexer_topk(q, kv, w, ks, ke, 40)   # noqa: E731
    case("indexer_topk/M", fi, (q, wq, ks, ke), tuple(put(mesh, t, "x") for t in (q, wq, ks, ke)))
    fpi = lambda q, w, lens, table: jax_dg.paged_indexer_topk(q, cache, w, lens, table, 40, max_model_len=320)  # noqa: E731
    case("paged_indexer_topk/B", fpi, (qp, wp, lens, table), tuple(put(mesh, t, "x") for t in (qp, wp, lens, table)))

    # the fused FP8 casts over rows: values and per-token scales split with no collective; the
    # 128-row-block scales of the transposed and block casts ([M/128, K], [M/128, K/128]) are a
    # factor Shardy cannot tie to the rows, so it gathers them (kilobytes); fp8_linear's forward
    # with its tokens sharded: none (its backward's wgrad contracts the sharded tokens with an
    # accumulator, which fp8_gemm_nt's rule refuses, as before the fused casts)
    xr = normal((128 * d, 384))
    case("cast_tokens/M", jax_dg.cast_tokens, (xr,), (put(mesh, xr, "x"),))
    fc = lambda x: jax_dg.cast_tokens(x, transposed=True)   # noqa: E731
    case("cast_tokens_transposed/M", fc, (xr,), (put(mesh, xr, "x"),), expect=("all-gather",))
    fb = lambda x: jax_dg.cast_blocks(x, transposed=True)   # noqa: E731
    case("cast_blocks/M", fb, (xr,), (put(mesh, xr, "x"),), expect=("all-gather",))
    wl = normal((256, 384))
    case("fp8_linear/M", jax_dg.fp8_linear, (xr, wl), (put(mesh, xr, "x"), wl))

    # shapes that do not split raise, naming the rule
    if d == 1:
        return
    a6 = jax_dg.per_token_cast_to_fp8(normal((6 * d, k)))
    try:
        jax.jit(f)((put(mesh, a6[0], "x"), put(mesh, a6[1], "x")), b)
    except Exception as e:   # raised while compiling: XLA hands the partitioner's error back
        assert "fp8_gemm_nt: dimension `m` = " in str(e) and "multiple of 4" in str(e), e
        print("case indivisible ok", flush=True)
    else:
        raise AssertionError("an M of 6 per shard was accepted")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else len(jax.devices()))
