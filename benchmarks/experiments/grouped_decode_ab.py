"""Timing-loop A/B on the H200: the plan's grouped GEMM vs kernel="decode" (8- and 16-row units) and the 16-token
tile on decode shapes
(batch-1 top-8 of 256 experts, 32 experts at 64-512 rows). Run from the repository root: python benchmarks/experiments/grouped_decode_ab.py"""
import functools, sys
import numpy as np
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import _common as C
from jax_w4a8 import ops, tiling
print("copy bw", C.copy_bandwidth()[0] / 1e12, "floor us", C.harness_floor() * 1e6, flush=True)
rng = np.random.default_rng(0)
key = jax.random.key(0)
CASES = [("top8_up", 8, 256, 4096, 7168, "top8"), ("top8_down", 8, 256, 7168, 2048, "top8"),
         ("up64", 64, 32, 4096, 7168, "uniform"), ("down64", 64, 32, 7168, 2048, "uniform"),
         ("up256", 256, 32, 4096, 7168, "uniform"), ("down256", 256, 32, 7168, 2048, "uniform"),
         ("up512", 512, 32, 4096, 7168, "uniform"), ("down512", 512, 32, 7168, 2048, "uniform"),
         ("top8x4_up", 32, 256, 4096, 7168, "top8"), ("top8x16_up", 128, 256, 4096, 7168, "top8")]
for name, m, e, n, k, routing in CASES:
    g = k // 128
    if routing == "top8":  # m / 8 tokens, each on 8 random experts of e
        sizes = np.zeros(e, np.int32)
        for _ in range(m // 8):
            sizes[rng.choice(e, 8, replace=False)] += 1
    else:
        sizes = rng.multinomial(m, np.ones(e) / e).astype(np.int32)
    busy = np.nonzero(sizes)[0]
    sets = []
    for i in range(2):
        kk = jax.random.fold_in(key, i)
        w = jnp.zeros((e, n, k // 2), jnp.int8).at[busy].set(
            jax.random.randint(kk, (len(busy), n, k // 2), -128, 128, jnp.int32).astype(jnp.int8))
        ws = jax.random.uniform(jax.random.fold_in(kk, 1), (e, n, g), jnp.float32, 0.5e-2, 1.5e-2)
        sets.append((w, ws))
    x8 = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    xs = jax.random.uniform(jax.random.fold_in(key, m + 1), (m, g), jnp.float32, 0.5, 1.5)
    gs = jnp.asarray(sizes)
    wbytes = len(busy) * n * k // 2
    ref = None
    line = f"{name:11s} busy {len(busy):3d} {wbytes / 1e6:6.1f} MB:"
    for label, kw in (("plan", {}), ("decode8", dict(kernel="decode", tile_tokens=8)),
                      ("decode16", dict(kernel="decode", tile_tokens=16)), ("t16", dict(tile_tokens=16)),
                      ("native", dict(kernel="native"))):
        f = jax.jit(functools.partial(ops.w4a8_grouped_gemm, **kw))
        try:
            t = C.bench(f, [(x8, xs, w, s, gs) for w, s in sets])
        except Exception as exc:
            line += f"  {label} {type(exc).__name__}"
            continue
        out = np.asarray(f(x8, xs, *sets[0], gs).astype(jnp.float32))
        if ref is None:
            ref = np.asarray(ops.w4a8_grouped_gemm(x8, xs, *sets[0], gs, tile_tokens=0).astype(jnp.float32))
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        line += f"  {label} {t * 1e6:7.1f} us ({wbytes / t / 1e12:.2f} TB/s, err {err:.1e})"
    print(line, flush=True)
