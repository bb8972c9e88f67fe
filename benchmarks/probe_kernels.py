"""Quick kernel probes for same-machine A/B runs (one process per library build).

    python benchmarks/probe_kernels.py prefill   # einsum M=4096 square, grouped GEMM at 4k / 16k rows
    python benchmarks/probe_kernels.py decode    # grouped GEMM, up-projection (fused, unfused, composed) to 4096 rows
    python benchmarks/probe_kernels.py small     # latency-bound einsums: kv_a / q_a at 1 and 64 tokens, MLA
                                                 # absorb (128 heads) and V4 wo_a (16 heads) at b = 1 and 64,
                                                 # each next to XLA bf16
    python benchmarks/probe_kernels.py fixed     # a decode grouped GEMM's fixed cost per call: M = 64 routed vs
                                                 # every expert empty (all rows padding), twice, and the
                                                 # timing loop's own floor

32 experts of one EP8 shard of R1 (gate+up N=4096 K=7168, down N=7168 K=2048), plan defaults, random data;
each line ends in a checksum, so two builds can be compared for identical results as well as for speed.
The full tables with peers come from bench_grouped_gemm.py / bench_fp8_einsum.py.
"""

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from jax_w4a8 import ops  # noqa: E402

E = 32
COPY_BW = 4.28e12  # H200 copy bandwidth measured by the benchmarks (bytes/s), for the decode percentages


def _grouped_case(key, m, n, k, seed, e=E):
    w = jax.random.randint(key, (e, n, k // 2), -128, 128, jnp.int32).astype(jnp.int8)
    ws = jax.random.uniform(jax.random.fold_in(key, 1), (e, n, k // 128), jnp.float32, 0.005, 0.015)
    x = jax.random.normal(jax.random.fold_in(key, 2), (m, k), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    xs = jax.random.uniform(jax.random.fold_in(key, 3), (m, k // 128), jnp.float32, 0.5, 1.5)
    sizes = jnp.asarray(np.random.default_rng(seed).multinomial(m, np.ones(e) / e).astype(np.int32))
    return x, xs, w, ws, sizes


def _checksum(out):
    return float(np.abs(np.asarray(out.astype(jnp.float32))).sum())


def prefill(key):
    m, n, k = 4096, 7168, 7168
    sets = []
    for i in range(2):
        kk = jax.random.fold_in(key, i)
        x = jax.random.normal(kk, (m, k), jnp.bfloat16).astype(jnp.float8_e4m3fn)
        xs = jax.random.uniform(kk, (m, k // 128), jnp.float32, 0.5, 1.5)
        w = jax.random.normal(kk, (n, k), jnp.bfloat16).astype(jnp.float8_e4m3fn)
        ws = jax.random.uniform(kk, (n // 128, k // 128), jnp.float32, 0.5, 1.5)
        sets.append((x, xs, w, ws))
    f = lambda *a: ops.fp8_einsum("md,nd->mn", *a)  # noqa: E731
    t = C.bench(f, sets)
    print(f"einsum M={m} square: {t * 1e6:8.1f} us {2 * m * n * k / t / 1e12:7.1f} TFLOP/s "
          f"checksum {_checksum(jax.jit(f)(*sets[0])):.6e}", flush=True)
    for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
        for m in (4096, 16384):
            sets = [_grouped_case(jax.random.fold_in(key, 10 + i), m, n, k, i) for i in range(2)]
            t = C.bench(ops.w4a8_grouped_gemm, sets)
            print(f"grouped {name} M={m}: {t * 1e6:8.1f} us {2 * m * n * k / t / 1e12:7.1f} TFLOP/s "
                  f"checksum {_checksum(jax.jit(ops.w4a8_grouped_gemm)(*sets[0])):.6e}", flush=True)


def decode(key):
    import bench_grouped_gemm as B

    for name, n, k, ms in (("gate_up", 4096, 7168, (64, 256, 512, 1024, 2048, 4096)),
                           ("down", 7168, 2048, (64, 256, 512))):
        for m in ms:
            sets = [_grouped_case(jax.random.fold_in(key, 100 * m + i), m, n, k, i) for i in range(2)]
            line = f"{name} M={m}:"
            if m <= 512:
                t = C.bench(ops.w4a8_grouped_gemm, sets)
                out = jax.jit(ops.w4a8_grouped_gemm)(*sets[0])
                line += f" gemm {t * 1e6:7.1f} us ({E * n * k / 2 / t / COPY_BW:.0%} copy) cs {_checksum(out):.6e}"
            if name == "gate_up":
                fused_up = functools.partial(ops.w4a8_moe_up, fused=True)  # the fused kernel at every M
                tf = C.bench(fused_up, sets)
                h8, _ = jax.jit(fused_up)(*sets[0])
                tu = C.bench(lambda a, sa, w, s, gs: B._unfused_up(ops, a, sa, w, s, gs, n // 2), sets)
                # the op's composed route (its default above tiling.FUSED_UP_MAX_ROWS rows per expert)
                tc = C.bench(functools.partial(ops.w4a8_moe_up, fused=False), sets)
                line += (f" | fused {tf * 1e6:7.1f} unfused {tu * 1e6:7.1f} x{tu / tf:.2f} composed {tc * 1e6:7.1f}"
                         f" cs {_checksum(h8):.6e}")
            print(line, flush=True)


def small(key):
    from jax_w4a8 import quant

    cases = (("kv_a", "md,nd->mn", 576, 7168, None), ("q_a", "md,nd->mn", 1536, 7168, None),
             ("absorb_q", "bhr,hdr->bhd", 512, 128, 128), ("absorb_o", "bhr,hdr->bhd", 128, 512, 128),
             ("v4_wo_a", "bhr,hdr->bhd", 1024, 4096, 16))
    for name, eq, n, k, h in cases:
        for m in (1, 64):
            sets, bf_sets = [], []
            for i in range(2):
                kk = jax.random.fold_in(key, 1000 * m + i)
                w = jax.random.normal(kk, (n, k) if h is None else (h, n, k), jnp.float32) * 0.02
                x = jax.random.normal(jax.random.fold_in(kk, 1), (m, k) if h is None else (m, h, k), jnp.bfloat16)
                w8, ws = quant.quantize_fp8_blocks(w)
                x8, xs = quant.quantize_fp8_groups(x)
                sets.append((x8, xs, w8, ws))
                bf_sets.append((x, w.astype(jnp.bfloat16)))
            f = lambda *a, eq=eq: ops.fp8_einsum(eq, *a)  # noqa: E731
            t = C.bench(f, sets)
            tb = C.bench(lambda a, b, eq=eq: jnp.einsum(eq, a, b), bf_sets)
            print(f"{name} M={m}: {t * 1e6:7.1f} us | xla_bf16 {tb * 1e6:7.1f} us x{tb / t:.2f} "
                  f"checksum {_checksum(jax.jit(f)(*sets[0])):.6e}", flush=True)


def fixed(key):
    for name, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048)):
        sets = [_grouped_case(jax.random.fold_in(key, i), 64, n, k, i) for i in range(2)]
        empty = [s[:4] + (jnp.zeros_like(s[4]),) for s in sets]
        for label, arg_sets in (("routed", sets), ("all empty", empty)) * 2:
            t = C.bench(ops.w4a8_grouped_gemm, arg_sets)
            print(f"{name} M=64 {label}: {t * 1e6:7.1f} us per call", flush=True)
    t = C.bench(lambda a: a * 2, [(jnp.ones((128,), jnp.float32),)] * 2)
    print(f"timing floor (128-element op): {t * 1e6:.1f} us per call", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("prefill", "decode", "small", "fixed"))
    args = ap.parse_args()
    if jax.devices()[0].platform != "gpu":
        sys.exit("probe_kernels.py times the CUDA kernels: run it on a GPU")
    {"prefill": prefill, "decode": decode, "small": small, "fixed": fixed}[args.what](jax.random.key(0))


if __name__ == "__main__":
    main()
