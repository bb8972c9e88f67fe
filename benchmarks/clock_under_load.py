"""SM clock and board power while one op runs back to back on the GPU (nvidia-smi sampled every 50 ms).

    python benchmarks/clock_under_load.py [--seconds 2.5] [--ops prefill decode]

prefill (the default): the grouped GEMM at M = 4096 (gate+up, 32 experts; UE8M0 activation scales, which the
128-token e4m3 kernel folds into the codes, and float32 ones, which it does not) and XLA's fp8 dot_general at
4096 x 7168 x 7168. decode: the fp8 einsum at one token (o_proj, 7168 x 7168, kv_a; UE8M0 codes), the decode
kernels, which ncu times faster alone than a loop runs them (benchmarks/back_to_back.py). Prints
per op: the benchmark harness's time, the back-to-back time per call, the median / min / max SM clock over the
steady part of the run, the median power, the throttle reasons (0x4: software power cap) and the temperature.
A kernel that `ncu` times faster in one launch than the loop does may be clocked down at the power cap.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import back_to_back  # noqa: E402
from probe_kernels import _grouped_case  # noqa: E402

from jax_w4a8 import ops, quant  # noqa: E402

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active,temperature.gpu"


def measure(label, fn, args, seconds):
    jf = jax.jit(fn)
    jax.block_until_ready(jf(*args))
    t = C.bench(fn, [args]) * 1e6
    time.sleep(1.5)  # idle first, so that every op starts from the same clock
    with tempfile.TemporaryFile("w+") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=log)
        time.sleep(0.3)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(50):
                out = jf(*args)
            jax.block_until_ready(out)
            n += 50
        per_call = (time.perf_counter() - t0) / n * 1e6
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
        log.seek(0)
        rows = [line.split(",") for line in log if line.strip()]
    rows = rows[len(rows) // 4:]  # the steady part
    clk, pw = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    print(f"{label}: harness {t:.1f} us, back to back {per_call:.1f} us/call; SM clock median {statistics.median(clk):.0f} "
          f"MHz (min {min(clk):.0f}, max {max(clk):.0f}), power median {statistics.median(pw):.0f} W, throttle reasons "
          f"{sorted({r[2].strip() for r in rows})}, {rows[-1][3].strip()} C", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.5, help="back-to-back run per op")
    p.add_argument("--ops", nargs="+", choices=("prefill", "decode"), default=["prefill"])
    args = p.parse_args()
    key = jax.random.key(0)
    if "decode" in args.ops:
        for name, n, k in (("o_proj", 7168, 16384), ("square", 7168, 7168), ("kv_a", 576, 7168)):
            measure(f"einsum {name} M=1", back_to_back.linear,
                    (*back_to_back.activations(key, 1, k), *back_to_back.weights(jax.random.fold_in(key, 1), n, k)),
                    args.seconds)
    if "prefill" not in args.ops:
        return
    x, xs, w, ws, sizes = _grouped_case(key, 4096, 4096, 7168, 0, e=32)
    measure("gate_up M=4096 UE8M0 (folded)", ops.w4a8_grouped_gemm, (x, quant.ceil_to_ue8m0(xs), w, ws, sizes),
            args.seconds)
    measure("gate_up M=4096 float32 scales (plain)", ops.w4a8_grouped_gemm, (x, xs, w, ws, sizes), args.seconds)
    xa = jax.random.normal(key, (4096, 7168), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    wa = jax.random.normal(jax.random.fold_in(key, 1), (7168, 7168), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),  # noqa: E731
                                           preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    measure("xla fp8 dot 4096 x 7168 x 7168", dot, (xa, wa), args.seconds)


if __name__ == "__main__":
    main()
