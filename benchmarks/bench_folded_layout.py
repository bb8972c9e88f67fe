"""Folded activations (``layout="folded"``) vs the standard layout at prefill, one process, rounds interleaved.

    python benchmarks/bench_folded_layout.py [--ms 4096 16384] [--out DIR]   # on the GPU

One EP8 shard of DeepSeek-R1 as in bench_grouped_gemm.py (32 local experts, rows spread evenly): gate+up N=4096
K=7168 and down N=7168 K=2048, UE8M0 activation scales. For each M (routed rows) it times, in interleaved rounds
(``_common.bench_alternating``):

* ``gemm``: the grouped GEMM on activations already quantized: the standard layout at the 128-token e4m3 tiles
  (its preparation folds them, then the GEMM) vs ``x_layout="folded"`` (the GEMM alone);
* ``quantize``: the quantizer's two layouts: gate+up quantizes the M / 8 tokens before they are routed
  (``quantize_fp8_groups``), down the M routed rows' SiLU-mul (``silu_mul_quantize_fp8_groups``);
* ``chain``: what a MoE layer runs: gate+up quantizes the tokens, gathers M rows, runs the GEMM; down quantizes the
  SiLU-mul of its rows and runs the GEMM; each in the two layouts.

Outputs of the two layouts are compared (the same numbers, bit for bit, where both fold).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common as C  # noqa: E402

E = 32
TOP_K = 8
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}


def run(ms, shapes=SHAPES, experts=E):
    import jax
    import jax.numpy as jnp

    from jax_w4a8 import ops, tiling

    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    rows = []
    for shape, (n, k) in shapes.items():
        w = jax.random.randint(jax.random.fold_in(key, 1), (experts, n, k // 2), -128, 128, jnp.int32).astype(jnp.int8)
        ws = jax.random.uniform(jax.random.fold_in(key, 2), (experts, n, k // 128), jnp.float32, 0.5e-2, 1.5e-2)
        for m in ms:
            sizes = jnp.asarray(rng.multinomial(m, np.ones(experts) / experts).astype(np.int32))
            std = jax.jit(functools.partial(ops.w4a8_grouped_gemm, tile_tokens=128, mma="e4m3"))
            fold = jax.jit(functools.partial(ops.w4a8_grouped_gemm, x_layout="folded"))
            if shape == "gate_up":  # tokens quantized before routing, then gathered into M rows
                x = jax.random.normal(jax.random.fold_in(key, m), (m // TOP_K, k), jnp.bfloat16)
                rows_of = jnp.asarray(rng.permutation(m) % (m // TOP_K), jnp.int32)
                q_std = jax.jit(functools.partial(ops.quantize_fp8_groups, ue8m0=True))
                q_fold = jax.jit(functools.partial(ops.quantize_fp8_groups, ue8m0=True, layout="folded"))

                def chain(quantize, gemm, x, w, ws, sizes):
                    a, s = quantize(x)
                    return gemm(jnp.take(a, rows_of, 0), jnp.take(s, rows_of, 0), w, ws, sizes)
            else:  # the SiLU-mul of the routed rows
                x = jax.random.normal(jax.random.fold_in(key, m), (m, 2 * k), jnp.bfloat16)
                q_std = jax.jit(functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=True))
                q_fold = jax.jit(functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=True, layout="folded"))

                def chain(quantize, gemm, x, w, ws, sizes):
                    return gemm(*quantize(x), w, ws, sizes)
            a_std, a_fold = q_std(x), q_fold(x)
            if shape == "gate_up":
                a_std = tuple(jnp.take(v, rows_of, 0) for v in a_std)
                a_fold = tuple(jnp.take(v, rows_of, 0) for v in a_fold)
            plan = tiling.plan_grouped_gemm(m, experts, n, k)
            r = dict(shape=shape, M=m, N=n, K=k, plan_folds=tiling.folds_activations(plan))
            t = C.bench_alternating({"standard": (std, [(*a_std, w, ws, sizes)]),
                                     "folded": (fold, [(*a_fold, w, ws, sizes)])})
            r.update(gemm_standard_us=t["standard"] * 1e6, gemm_folded_us=t["folded"] * 1e6)
            t = C.bench_alternating({"standard": (q_std, [(x,)]), "folded": (q_fold, [(x,)])})
            r.update(quantize_standard_us=t["standard"] * 1e6, quantize_folded_us=t["folded"] * 1e6)
            c_std = jax.jit(functools.partial(chain, q_std, std))
            c_fold = jax.jit(functools.partial(chain, q_fold, fold))
            t = C.bench_alternating({"standard": (c_std, [(x, w, ws, sizes)]), "folded": (c_fold, [(x, w, ws, sizes)])})
            r.update(chain_standard_us=t["standard"] * 1e6, chain_folded_us=t["folded"] * 1e6)
            y0 = np.asarray(c_std(x, w, ws, sizes).astype(jnp.float32))
            y1 = np.asarray(c_fold(x, w, ws, sizes).astype(jnp.float32))
            r["bitwise_equal"] = bool(np.array_equal(y0, y1))
            r["max_abs_diff"] = float(np.abs(y0 - y1).max())
            r["TFLOPs_folded_gemm"] = 2 * m * n * k / (r["gemm_folded_us"] * 1e-6) / 1e12
            rows.append(r)
            print(" ".join(f"{k_}={v:.1f}" if isinstance(v, float) else f"{k_}={v}" for k_, v in r.items()),
                  flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[4096, 16384], help="routed rows (multiples of 8)")
    ap.add_argument("--out", default=None, help="folder for folded_layout.json")
    ap.add_argument("--small", action="store_true", help="4 experts, N 256, K 512 / 256: a smoke run (CPU)")
    args = ap.parse_args()
    rows = run(args.ms, {"gate_up": (256, 512), "down": (512, 256)}, 4) if args.small else run(args.ms)
    if args.out:
        C.save_json(C.out_dir(args.out) / "folded_layout.json",
                    dict(rows=rows, command="python benchmarks/bench_folded_layout.py " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
