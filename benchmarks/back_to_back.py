"""Per-call time of an fp8 einsum linear in two kinds of loop, to tell a kernel's own time from a loop's costs.

    python benchmarks/back_to_back.py [--linears o_proj kv_a] [--tokens 1] [--calls 40]
    python benchmarks/back_to_back.py --shape 64 256   # any N K (the CPU handlers too: a smoke run)
    python benchmarks/back_to_back.py --linears o_proj --trace   # + each kernel's time inside the loop
    python benchmarks/back_to_back.py --linears kv_a --floor     # + a trivial XLA op and a trivial custom call

For each linear ("md,nd->mn", recipe (1, 128, 128), UE8M0 codes, two weight sets in turn so that the weights
come from HBM) it prints:
  chain        the benchmarks' harness (``_common.bench``): each call's inputs wait on the previous call's
               output (an optimization barrier and a one-element add), as layers of a model do;
  independent  one jitted program of ``--calls`` calls on distinct activations, nothing between them;
  slope        the time that ``--calls`` more independent calls add, over their number: the per-call cost
               without the program's fixed launch and wait.
With ``--trace``, the independent program runs once more under the JAX profiler (CUPTI on a GPU) and each
kernel name in it gets its count, its median duration and the median gap from one kernel's end to the next
one's start on the same stream: a kernel slower in the loop than alone, or idle time between kernels. XLA's
command buffers (CUDA graphs) stay on while tracing (``--xla_enable_command_buffers_during_profiling``), so
the trace shows what the timed loops ran; ``--trace-op-by-op`` leaves XLA's default, which runs them op by op
while profiling (true kernel times, other gaps).
Compare with the kernel alone under ncu (``benchmarks/profile_case.py``). H200, thirty-fifth session, o_proj
at one token: chain 50.6 us, slope 41.8, the kernel alone 33.2 (kv_a 13.4, 11.6, 6.7): the gap is not the chain's.
"""

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_fp8_einsum import LINEARS  # noqa: E402

from jax_w4a8 import ops, quant  # noqa: E402


def weights(key, n, k):
    """Random [n, k] weights as e4m3 codes with UE8M0 128 x 128 block scales as uint8 codes [ceil(n/128), k/128]."""
    w8, ws = quant.quantize_fp8_blocks(jax.random.normal(key, (n, k), jnp.float32) * 0.05, ue8m0=True)
    return w8, quant.encode_ue8m0(ws)


def activations(key, m, k):
    """Random [m, k] activations as e4m3 codes with UE8M0 1 x 128 group scales as uint8 codes [m, k/128]."""
    x8, xs = quant.quantize_fp8_groups(jax.random.normal(key, (m, k), jnp.float32), ue8m0=True)
    return x8, quant.encode_ue8m0(xs)


def linear(x8, xs, w8, ws):
    """The einsum "md,nd->mn" on the operands above: bfloat16 [m, n]."""
    return ops.fp8_einsum("md,nd->mn", x8, xs, w8, ws)


def _program_seconds(fn, args, rounds=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_times(fn, inputs, shared=(), calls=40, trace=False):
    """(chain, independent, slope) in microseconds per call of ``fn(*inputs[i], *shared)``, and with ``trace``
    the :func:`_common.summarize_kernels` of the independent program's kernels (else None). ``inputs``: at least
    ``2 * calls`` tuples of per-call arguments (distinct, so that XLA cannot merge calls); ``shared``: arguments
    of every call (a linear's two weight sets are taken in turn: pass them in ``inputs``' tuples instead)."""
    chain = C.bench(fn, [(*inputs[i], *shared) for i in range(2)]) * 1e6

    def many(count):
        return jax.jit(lambda ins, sh: [fn(*ins[i], *sh) for i in range(count)])

    program = many(calls)
    once = _program_seconds(program, (inputs[:calls], shared))
    twice = _program_seconds(many(2 * calls), (inputs[:2 * calls], shared))
    kernels = C.summarize_kernels(C.trace_kernels(lambda: program(inputs[:calls], shared))) if trace else None
    return chain, once / calls * 1e6, (twice - once) / calls * 1e6, kernels


def measure(n, k, m=1, calls=40, trace=False):
    """:func:`loop_times` of an m x k by n x k linear, two weight sets taken in turn."""
    key = jax.random.key(0)
    ws = [weights(jax.random.fold_in(key, i), n, k) for i in range(2)]
    xs = [activations(jax.random.fold_in(key, 100 + i), m, k) for i in range(2 * calls)]
    return loop_times(linear, [(*xs[i], *ws[i % 2]) for i in range(2 * calls)], calls=calls, trace=trace)


def floors(calls=40, trace=False):
    """:func:`loop_times` of two trivial ops, {name: times}: an XLA op (``v * 2`` on 128 bf16 values: one
    fusion) and a custom call (``ops.quantize_fp8_groups`` of one 128-value group: one small kernel). What a
    loop costs per call beyond the kernels, for an XLA kernel and for a custom call (a custom call in XLA's
    command buffers is a child graph of its own). XLA may merge the independent XLA ops into fewer kernels
    (``--trace`` shows it); the chain keeps them apart."""
    key = jax.random.key(1)
    vs = [(jax.random.normal(jax.random.fold_in(key, i), (1, 128), jnp.bfloat16),) for i in range(2 * calls)]
    return {"xla v*2 (128)": loop_times(lambda v: v * 2, vs, calls=calls, trace=trace),
            "custom call (quantize 128)": loop_times(ops.quantize_fp8_groups, vs, calls=calls, trace=trace)}


def _print(name, times, trace):
    chain, independent, slope, kernels = times
    print(f"{name:26s} chain {chain:7.1f} | independent {independent:7.1f} | slope {slope:7.1f}", flush=True)
    if trace and not kernels:
        print("  trace: no device kernel events (a CPU run, or a profiler without CUPTI)", flush=True)
    for kname, (count, dur, gap) in sorted((kernels or {}).items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        gap_text = "   -" if gap is None else f"{gap:6.2f}"
        print(f"  {count:4d} x {dur:8.2f} us, gap after {gap_text} us  {kname[:90]}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--linears", nargs="+", choices=sorted(LINEARS), default=["o_proj", "square", "kv_a", "q_a"])
    ap.add_argument("--shape", nargs=2, type=int, metavar=("N", "K"), help="one linear of this shape instead")
    ap.add_argument("--tokens", type=int, default=1, help="M, the tokens per call (default 1)")
    ap.add_argument("--calls", type=int, default=40, help="calls per independent program (default 40)")
    ap.add_argument("--trace", action="store_true", help="each kernel's time and gap inside the independent program")
    ap.add_argument("--trace-op-by-op", action="store_true",
                    help="with --trace: let XLA run its command buffers op by op while profiling (its default)")
    ap.add_argument("--floor", action="store_true",
                    help="also a trivial XLA op and a trivial custom call: the loop's own cost per call for each")
    args = ap.parse_args(argv)
    if args.trace and not args.trace_op_by_op:
        C.keep_command_buffers_while_profiling()  # before the backend starts (jax.devices() below)
    cases = {f"{args.shape[0]}x{args.shape[1]}": tuple(args.shape)} if args.shape else \
        {name: LINEARS[name] for name in args.linears}
    print(f"{jax.devices()[0].device_kind}, M = {args.tokens}, us per call", flush=True)
    if args.floor:
        for name, times in floors(args.calls, args.trace).items():
            _print(name, times, args.trace)
    for name, (n, k) in cases.items():
        _print(name, measure(n, k, args.tokens, args.calls, args.trace), args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
