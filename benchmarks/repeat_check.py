"""Same inputs, many calls: every element of every call against float64, and what any error looks like.

    python benchmarks/repeat_check.py                 # grouped GEMM decode tiles, 16 calls each
    python benchmarks/repeat_check.py --calls 64 --tiles 32:e4m3 16:f16

A kernel race shows up as calls that differ from each other by more than rounding. For each bad call this
prints the rows and columns off and fits each bad row's error against every K group's float64 contribution:
an exact fit (residual ~0) with factor a means that group's contribution was scaled by 1 + a, e.g. a
scale read from the wrong group. The seventh session found the stage hand-back race this way.
"""

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import np_ref  # noqa: E402
from jax_w4a8 import ops, quant  # noqa: E402


def make_case(rng, m, k, n, sizes):
    """Rows and weight rows at spread magnitudes, group-128 fp8 activations, int4 weights."""
    w = (rng.standard_normal((len(sizes), n, k)) * np.exp2(rng.uniform(-4, 2, (len(sizes), n, 1)))).astype(np.float32)
    w_packed, w_scale = quant.quantize_w4(w)
    x = (rng.standard_normal((m, k)) * np.exp2(rng.uniform(-3, 3, (m, 1)))).astype(np.float32)
    x8, x_scale = quant.quantize_fp8_groups(x)
    return x8, x_scale, w_packed, w_scale, jnp.asarray(sizes, jnp.int32)


def explain(args, ref, out, bad, rows_of_expert):
    x = np_ref.f64(args[0])
    q = np_ref.unpack_int4(args[2]).astype(np.float64)
    sa, sw = np_ref.f64(args[1]), np_ref.f64(args[3])
    groups = x.shape[1] // 128
    lines = []
    for r in sorted(set(np.nonzero(bad)[0].tolist()))[:3]:
        cols = np.nonzero(bad[r])[0]
        e = rows_of_expert[r]
        contrib = (x[r].reshape(groups, 128)[None] * q[e].reshape(-1, groups, 128)).sum(-1) * sa[r][None] * sw[e]
        d = (out - ref)[r, cols]
        fits = []
        for g in range(groups):
            c = contrib[cols, g]
            a = (d * c).sum() / max((c * c).sum(), 1e-300)
            fits.append((np.linalg.norm(d - a * c) / np.linalg.norm(d), g, a))
        res, g, a = min(fits)
        lines.append(f"row {r}: {len(cols)} columns in {cols.min()}..{cols.max()}, best fit K group {g} "
                     f"x{a:+.3f} (residual {res:.2f})")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--tiles", nargs="+", default=["16:e4m3", "16:f16", "32:e4m3", "32:f16", "64:e4m3"],
                    help="token tile:mma pairs")
    ap.add_argument("--seed", type=int, default=11)
    args_ns = ap.parse_args()
    if jax.devices()[0].platform != "gpu":
        sys.exit("repeat_check.py exercises the CUDA kernels: run it on a GPU")
    m, k, n, sizes = 64, 7168, 512, [2] * 32  # decode: 2 rows for each of 32 experts
    rows_of_expert = np.repeat(np.arange(len(sizes)), sizes)
    args = make_case(np.random.default_rng(args_ns.seed), m, k, n, sizes)
    ref = np_ref.grouped_gemm(*args)
    bound = 2e-3 * np.abs(ref).max(axis=1, keepdims=True)
    worst = 0
    for spec in args_ns.tiles:
        tile, mma = spec.split(":")
        fn = jax.jit(functools.partial(ops.w4a8_grouped_gemm, out_dtype=jnp.float32, impl="ffi",
                                       tile_tokens=int(tile), mma=mma))
        bad_calls = 0
        for call in range(args_ns.calls):
            out = np.asarray(fn(*args), np.float64)
            bad = np.abs(out - ref) > bound
            if bad.any():
                bad_calls += 1
                print(f"tile {tile} {mma} call {call}: " + " | ".join(explain(args, ref, out, bad, rows_of_expert)))
        print(f"tile {tile} {mma}: {bad_calls} of {args_ns.calls} calls with elements off", flush=True)
        worst = max(worst, bad_calls)
    sys.exit(1 if worst else 0)


if __name__ == "__main__":
    main()
