"""W4A8 grouped GEMM vs its peers, one EP8 shard of DeepSeek-R1 (32 local experts), one process.

    python benchmarks/bench_grouped_gemm.py [--quick] [--ms 64 256 ...] [--out DIR]  # on the GPU
    python benchmarks/bench_grouped_gemm.py --report DIR/grouped_gemm.json  # RESULTS.md + plot from JSON

Shapes: gate+up N=4096 K=7168 and down N=7168 K=2048; M = routed rows on this GPU spread evenly over
the experts (multinomial), plus skewed routing (4 hot experts take 85% of the rows). Peers measured
in the same process: JAX's Pallas Mosaic-GPU grouped GEMM (bf16, and fp8 with K-major weights; best
of its tile configs), XLA ragged_dot (bf16, fp8, int4 dequantized to bf16 inside jit) and, when torch
imports, torch._grouped_mm (bf16) and torch._scaled_grouped_mm (fp8). Our kernel applies the
group-128 weight scales and the activation scales (``--x-scales``: per token and 128-channel group, powers of
two (UE8M0, DeepSeek-V3.1's recipe; the default) or any float32, or one per tensor as W4AFP8 checkpoints' static
input scales); the fp8 peers apply none. ``--trace-kernels`` adds to each row where a call's device time goes (each kernel
family's time per call from one traced run of the timing loop: the scale / activation preparation, the GEMM, ...).
Rows whose plan folds UE8M0 activation scales (the 128-token e4m3 kernel) also time the same call on activations
folded beforehand (``folded_us``: ``x_layout="folded"``, as the quantizer's ``layout="folded"`` writes them).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common as C  # noqa: E402

E = 32
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}
MS_FULL = [64, 256, 512, 2048, 4096, 16384]
MS_QUICK = [64, 512, 4096, 16384]
SKEWED_MS = [512, 4096]
PALLAS_CONFIGS = [  # block_m, block_n, block_k, max_concurrent_steps, grid_block_n
    (64, 128, 64, 4, 1), (128, 128, 64, 4, 1), (128, 256, 64, 4, 1), (64, 256, 64, 4, 2),
    (128, 128, 64, 4, 4), (192, 128, 64, 4, 2), (128, 128, 128, 4, 1), (64, 128, 128, 6, 1),
]
X_SCALES = {"ue8m0": "per token and 128-channel group, powers of two (UE8M0)",
            "f32": "per token and 128-channel group, float32 (not powers of two)",
            "tensor": "one per tensor"}
FP8_PEAK = 1979e12  # dense fp8 datasheet rate of H100/H200 SXM (a floor for the plot, not a measurement)


def sizes_for(m, routing, rng):
    if routing == "uniform":
        return rng.multinomial(m, np.ones(E) / E).astype(np.int32)
    p = np.full(E, 0.15 / (E - 4))
    p[:4] = 0.85 / 4
    return rng.multinomial(m, p).astype(np.int32)


def experts_with_rows(sizes):
    """How many experts receive rows: the kernels map rows to experts, so only these experts' weights are read."""
    return int(np.count_nonzero(np.asarray(sizes) > 0))


def int4_weight_bytes(sizes, n, k):
    """The int4 weight bytes a call must read: N*K/2 for each expert that receives rows (group scales excluded), as
    BENCHMARKS.md's decode floor (32 x N x K / 2, rows on every expert). At 64 rows over 32 experts, multinomial
    routing leaves about 5 experts without rows; counting their bytes too overstated GB/s by up to 1.23x."""
    return experts_with_rows(sizes) * n * k // 2


def read_floor_us(r, copy_bw):
    """Row ``r``'s int4 weight read floor at copy bandwidth, microseconds (rows of older JSON: every expert)."""
    return r.get("experts_with_rows", E) * r["N"] * r["K"] / 2 / copy_bw * 1e6


def run(args, on_row=None):
    """Measures every case; ``on_row(payload)`` after each row with the rows so far (``complete`` False), so that a
    run stopped by a time limit still leaves its measured rows."""
    import jax
    import jax.numpy as jnp

    from jax_w4a8 import _ffi, ops, quant, tiling

    rng = np.random.default_rng(0)
    cutlass_built = _ffi.built_with_cutlass()
    bw, bw_detail = C.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s {({k: round(v / 1e12, 2) for k, v in bw_detail.items()})}", flush=True)
    floor = C.harness_floor()
    print(f"timing harness floor {floor * 1e6:.1f} us per call (adaptive n)", flush=True)
    torch_ok = C.have_torch() and not args.no_torch
    ms = args.ms or (MS_QUICK if args.quick else MS_FULL)
    rows = []

    def payload(complete):
        return dict(copy_bw=bw, copy_bw_detail=bw_detail, harness_floor_us=floor * 1e6, rows=list(rows),
                    x_scales=args.x_scales, complete=complete,
                    command="python benchmarks/bench_grouped_gemm.py " + " ".join(sys.argv[1:]))
    key = jax.random.key(0)
    for shape, (n, k) in SHAPES.items():
        g = k // 128
        keys = jax.random.split(key, 8)
        w4 = [jax.random.randint(keys[i], (E, n, k // 2), -128, 128, jnp.int32).astype(jnp.int8) for i in range(2)]
        ws = [jax.random.uniform(keys[2 + i], (E, n, g), jnp.float32, 0.5e-2, 1.5e-2) for i in range(2)]
        wb = [jax.random.normal(keys[4 + i], (E, k, n), jnp.bfloat16) for i in range(2)]  # [E, K, N] bf16
        w8t = [jnp.swapaxes(w, 1, 2).astype(jnp.float8_e4m3fn) for w in wb]  # [E, N, K] fp8
        wi4 = [jax.random.randint(keys[6 + i], (E, k, n), -8, 8, jnp.int32).astype(jnp.int4) for i in range(2)]
        cases = [(m, "uniform") for m in ms] + [(m, "skewed") for m in SKEWED_MS if m in ms]
        for m, routing in cases:
            sizes = jnp.asarray(sizes_for(m, routing, rng))
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            x8 = x.astype(jnp.float8_e4m3fn)
            xs = jax.random.uniform(jax.random.fold_in(key, m + 1), (m, g), jnp.float32, 0.5, 1.5)
            xs = {"ue8m0": quant.ceil_to_ue8m0(xs), "f32": xs, "tensor": jnp.asarray(0.8, jnp.float32)}[args.x_scales]
            plan = tiling.plan_grouped_gemm(m, E, n, k)
            ours = jax.jit(ops.w4a8_grouped_gemm)
            label = (plan.kernel if plan.kernel in ("cutlass", "decode") else
                     f"t{plan.tile_tokens}/s{plan.split_k}" + ("/f16" if plan.mma == "f16" else ""))
            r = dict(shape=shape, M=m, routing=routing, N=n, K=k, plan=label)
            t = C.bench(ours, [(x8, xs, w, s, sizes) for w, s in zip(w4, ws)])
            if getattr(args, "trace_kernels", False):
                r.update(trace_call(ours, [(x8, xs, w, s, sizes) for w, s in zip(w4, ws)]))
            got = ours(x8, xs, w4[0], ws[0], sizes).astype(jnp.float32)
            simple = ops.w4a8_grouped_gemm(x8, xs, w4[0], ws[0], sizes, tile_tokens=0).astype(jnp.float32)
            r["rel_err_vs_simple"] = float(jnp.linalg.norm(got - simple) / jnp.linalg.norm(simple))
            flops, wbytes = 2 * m * n * k, int4_weight_bytes(sizes, n, k)
            r.update(ours_us=t * 1e6, TFLOPs=flops / t / 1e12, weight_GBps=wbytes / t / 1e9,
                     frac_copy_bw=wbytes / t / bw, experts_with_rows=experts_with_rows(sizes))
            # the tile heuristic's alternatives, same data (see jax_w4a8.tiling); at an 8-token tile always 16
            for alt in sorted(set(args.tiles) | ({16} if plan.tile_tokens == 8 else set())):
                if alt != plan.tile_tokens:
                    f = jax.jit(functools.partial(ops.w4a8_grouped_gemm, tile_tokens=alt))
                    r[f"t{alt}_us"] = C.bench(f, [(x8, xs, w, s, sizes) for w, s in zip(w4, ws)]) * 1e6
            others = []  # the other kernel families: CUTLASS at prefill sizes, the decode kernel up to 512 rows
            if m >= 2048 and cutlass_built:
                others.append("native" if plan.kernel == "cutlass" else "cutlass")
            if m <= 512:
                others.append("native" if plan.kernel == "decode" else "decode")
            for other in others:  # the decode kernel with both unit sizes (its plan picks one by rows per expert)
                for unit in ((8, 16) if other == "decode" else (None,)):
                    f = jax.jit(functools.partial(ops.w4a8_grouped_gemm, kernel=other, tile_tokens=unit))
                    r[f"kernel_{other}{unit or ''}_us"] = C.bench(f, [(x8, xs, w, s, sizes)
                                                                      for w, s in zip(w4, ws)]) * 1e6
            if plan.kernel == "native" and plan.tile_tokens >= 16:  # the other tensor-core operand format, same tile
                other = "e4m3" if plan.mma == "f16" else "f16"
                f = jax.jit(functools.partial(ops.w4a8_grouped_gemm, mma=other, tile_tokens=plan.tile_tokens))
                r[f"mma_{other}_us"] = C.bench(f, [(x8, xs, w, s, sizes) for w, s in zip(w4, ws)]) * 1e6
                alt_out = f(x8, xs, w4[0], ws[0], sizes).astype(jnp.float32)
                r[f"mma_{other}_rel_err_vs_simple"] = float(jnp.linalg.norm(alt_out - simple) / jnp.linalg.norm(simple))
            if args.x_scales == "ue8m0" and tiling.folds_activations(plan):
                # the same activations as the quantizer's layout="folded" hands them: the GEMM without its
                # preparation pass (ops.w4a8_grouped_gemm x_layout="folded"); the same numbers, bit for bit
                xf, xt = quant.fold_fp8_groups(x8, xs)
                f = jax.jit(functools.partial(ops.w4a8_grouped_gemm, x_layout="folded"))
                r["folded_us"] = C.bench(f, [(xf, xt, w, s, sizes) for w, s in zip(w4, ws)]) * 1e6
                r["folded_bitwise_equal"] = bool(jnp.array_equal(
                    f(xf, xt, w4[0], ws[0], sizes).astype(jnp.float32), got))
            peers = {}
            if args.peers != "none":
                from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as pm
                for dtype_name, lhs, rhs_sets, tr in (("pallas_bf16", x, wb, False), ("pallas_fp8", x8, w8t, True)):
                    best = float("inf")
                    # Every Pallas tile configuration, --quick too: its first two alone put Pallas fp8 1.6x behind its best
                    # at prefill (gate+up M = 4096: 758 vs 469 us on the H200), which flattered every ratio to it.
                    for cfg in PALLAS_CONFIGS:
                        bm, bn, bk, steps, gbn = cfg
                        if n % (bn * gbn) or k % bk:
                            continue
                        try:
                            f = jax.jit(functools.partial(pm.ragged_dot, block_m=bm, block_n=bn, block_k=bk,
                                                          max_concurrent_steps=steps, grid_block_n=gbn,
                                                          transpose_rhs=tr))
                            tt = C.bench(lambda a, b, s: f(a, b, group_sizes=s), [(lhs, w, sizes) for w in rhs_sets])
                            best = min(best, tt)
                        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                            print(f"  {dtype_name} {cfg}: {type(exc).__name__}", flush=True)
                    peers[dtype_name] = best
            if args.peers == "all":
                rd = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.bfloat16))
                peers["xla_ragged_dot_bf16"] = C.bench(rd, [(x, w, sizes) for w in wb], n=3, rounds=3)
                w8k = [jnp.swapaxes(w, 1, 2) for w in w8t]
                peers["xla_ragged_dot_fp8"] = C.bench(rd, [(x8, w, sizes) for w in w8k], n=3, rounds=3)
                del w8k
                deq = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b.astype(jnp.bfloat16), s))
                peers["xla_int4_dequant_ragged_dot"] = C.bench(deq, [(x, w, sizes) for w in wi4], n=3, rounds=3)
            if torch_ok and args.peers != "none":
                peers.update(torch_peers(m, n, k, np.asarray(sizes)))
            for name, tp in peers.items():
                r[f"{name}_us"] = tp * 1e6
                r[f"x_{name}"] = tp / t
            if shape == "gate_up":  # fused up-projection vs GEMM + SiLU-mul + quantize, unfused
                inter = n // 2
                fused = jax.jit(functools.partial(ops.w4a8_moe_up, fused=True))  # the fused kernel at every M
                unfused = jax.jit(lambda a, sa, w, s, gs: _unfused_up(ops, a, sa, w, s, gs, inter))
                sets = [(x8, xs, w, s_, sizes) for w, s_ in zip(w4, ws)]
                # interleaved rounds: the two are within a few percent, and one process's clock drifts as much
                both = C.bench_alternating({"fused": (fused, sets), "unfused": (unfused, sets)})
                r["fused_up_us"], r["unfused_up_us"] = both["fused"] * 1e6, both["unfused"] * 1e6
                r["x_unfused_up"] = r["unfused_up_us"] / r["fused_up_us"]
                fplan = tiling.plan_moe_up(m, E, inter, k)
                if fplan.kernel == "unfused":  # what ops.w4a8_moe_up runs by default here: the composed ops
                    r["moe_up_op_us"] = C.bench(jax.jit(ops.w4a8_moe_up), sets) * 1e6
                if fplan.tile_tokens >= 16:  # the fused kernel's other MMA format at this tile
                    other = "e4m3" if fplan.mma == "f16" else "f16"
                    r[f"fused_up_{other}_us"] = C.bench(jax.jit(functools.partial(
                        ops.w4a8_moe_up, mma=other, tile_tokens=fplan.tile_tokens)), sets) * 1e6
            rows.append(r)
            print(fmt_row(r), flush=True)
            if on_row is not None:
                on_row(payload(False))
        del w4, ws, wb, w8t, wi4
    return payload(True)


def _unfused_up(ops, x8, xs, w, s, sizes, inter):
    """What the fused op replaces: bf16 [M, 2I] to memory, SiLU-mul, then the fp8 quantizer kernel."""
    import jax
    import jax.numpy as jnp

    y = ops.w4a8_grouped_gemm(x8, xs, w, s, sizes)
    h = (jax.nn.silu(y[:, :inter].astype(jnp.float32)) * y[:, inter:].astype(jnp.float32)).astype(jnp.bfloat16)
    return ops.quantize_fp8_groups(h, ue8m0=True)


def torch_peers(m, n, k, sizes):
    import torch

    out = {}
    offs = torch.tensor(np.cumsum(sizes), device="cuda", dtype=torch.int32)
    w = torch.randn(E, n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    try:
        out["torch_grouped_mm_bf16"] = C.torch_bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    except Exception as exc:  # noqa: BLE001
        print("  torch bf16:", repr(exc)[:120])
    try:
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        sa = torch.ones(m, device="cuda", dtype=torch.float32)
        sb = torch.ones(E, n, device="cuda", dtype=torch.float32)
        out["torch_scaled_grouped_mm_fp8"] = C.torch_bench(
            lambda: torch._scaled_grouped_mm(x8, w8.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16))
    except Exception as exc:  # noqa: BLE001
        print("  torch fp8:", repr(exc)[:120])
    del w, x
    torch.cuda.empty_cache()
    return out


PEERS = ["pallas_bf16", "pallas_fp8", "torch_scaled_grouped_mm_fp8", "torch_grouped_mm_bf16",
         "xla_ragged_dot_bf16", "xla_ragged_dot_fp8", "xla_int4_dequant_ragged_dot"]


def tile_times(r):
    """The alternative token tiles timed for row ``r`` (``--tiles``): {"t32": us, ...}."""
    return {k[:-3]: v for k, v in r.items() if re.fullmatch(r"t\d+_us", k)}


def mma_times(r):
    """The other tensor-core operand format timed for row ``r``: {"f16": us} or {"e4m3": us}."""
    return {k[4:-3]: v for k, v in r.items() if re.fullmatch(r"mma_[a-z0-9]+_us", k)}


def kernel_times(r):
    """The other kernel families timed for row ``r``: {"native": us}, {"cutlass": us} or {"decode8": us,
    "decode16": us} (the decode kernel's 8- and 16-row units)."""
    return {k[7:-3]: v for k, v in r.items() if re.fullmatch(r"kernel_[a-z]+[0-9]*_us", k)}


def fused_mma_times(r):
    """The fused up-projection with its other MMA format for row ``r``: {"f16": us} or {"e4m3": us}."""
    return {k[9:-3]: v for k, v in r.items() if re.fullmatch(r"fused_up_(e4m3|f16)_us", k)}


def trace_call(fn, arg_sets):
    """Where one call's device time goes (--trace-kernels): the timing loop's program traced once (JAX profiler,
    XLA's command buffers kept), per call: ``trace_kernels`` [{family, count, us}] (each kernel family's time,
    highest first: the scale / activation preparation, the GEMM, a kernel that only checks a flag), ``trace_busy_us``
    (time some kernel ran) and ``trace_span_us`` (first start to last end). Empty on a backend without device
    events."""
    families, busy, span = C.loop_kernel_breakdown(fn, arg_sets)
    return dict(trace_kernels=[dict(family=f["family"], count=f["count"], us=f["us"]) for f in families],
                trace_busy_us=busy, trace_span_us=span)


def fmt_trace(r):
    """' | kernels per call: A 1290.1 us, B 104.2 us (busy 1399.0 of 1401.2 us)' for a row traced with
    --trace-kernels."""
    if not r.get("trace_kernels"):
        return ""
    parts = ", ".join(f"{k['family']} {k['us']:.1f} us" + (f" x{k['count']:g}" if k["count"] != 1 else "")
                      for k in r["trace_kernels"][:4])
    return f" | kernels per call: {parts} (busy {r['trace_busy_us']:.1f} of {r['trace_span_us']:.1f} us)"


def folded_tflops(r):
    """TFLOP/s of a row's folded-layout call (the same routed rows' work over ``folded_us``)."""
    return r["TFLOPs"] * r["ours_us"] / r["folded_us"]


def fmt_row(r):
    peers = " ".join(f"{p}={r[f'x_{p}']:.2f}x" for p in PEERS if f"x_{p}" in r)
    fused = (f" | fused up {r['fused_up_us']:.0f} us vs unfused {r['unfused_up_us']:.0f} us"
             if "fused_up_us" in r else "")
    fused += "".join(f" (fused {k} MMA {v:.0f} us)" for k, v in fused_mma_times(r).items())
    fused += f" (the op's default, composed: {r['moe_up_op_us']:.0f} us)" if "moe_up_op_us" in r else ""
    tiles = (f" | folded layout {r['folded_us']:.1f} us {folded_tflops(r):.0f} TFLOP/s"
             if "folded_us" in r else "")
    tiles += "".join(f" | {k} {v:.0f} us" for k, v in tile_times(r).items())
    tiles += "".join(f" | {k} MMA {v:.0f} us" for k, v in mma_times(r).items())
    tiles += "".join(f" | {k} kernel {v:.0f} us" for k, v in kernel_times(r).items())
    return (f"{r['shape']:8s} M={r['M']:6d} {r['routing']:7s} {r['plan']:7s} {r['ours_us']:9.1f} us "
            f"{r['TFLOPs']:7.1f} TFLOP/s {r['weight_GBps']:7.0f} GB/s ({100 * r['frac_copy_bw']:5.1f}% copy) "
            f"err {r['rel_err_vs_simple']:.1e} | {peers}{fused}{tiles}{fmt_trace(r)}")


def report(payload, out):
    """Writes the run's table into RESULTS.md (the H200's section, or the section of the card it ran on) and its
    plot next to it (grouped_gemm.png, or grouped_gemm_h100.png and the like)."""
    rows = payload["rows"]
    png = f"grouped_gemm{C.results_suffix(payload)}.png"
    cols = (["shape", "M", "routing", "plan", "us", "TFLOP/s", "weight GB/s", "% copy BW"] + [f"vs {p}" for p in PEERS]
            + ["folded layout us (TFLOP/s)", "fused up-proj us (unfused)", "other token tiles us", "other MMA us",
               "other kernel us"])
    md = []
    for r in rows:
        d = {"shape": r["shape"], "M": r["M"], "routing": r["routing"], "plan": r["plan"],
             "us": f"{r['ours_us']:.1f}", "TFLOP/s": f"{r['TFLOPs']:.0f}", "weight GB/s": f"{r['weight_GBps']:.0f}",
             "% copy BW": f"{100 * r['frac_copy_bw']:.0f}"}
        for p in PEERS:
            if f"x_{p}" in r:
                d[f"vs {p}"] = f"{r[f'x_{p}']:.2f}x ({r[f'{p}_us']:.0f} us)"
        if "folded_us" in r:
            d["folded layout us (TFLOP/s)"] = (f"{r['folded_us']:.1f} ({folded_tflops(r):.0f})"
                                               + ("" if r.get("folded_bitwise_equal", True) else ", NOT bit for bit"))
        if "fused_up_us" in r:
            d["fused up-proj us (unfused)"] = f"{r['fused_up_us']:.0f} ({r['unfused_up_us']:.0f})" + "".join(
                f"; {k}: {v:.0f}" for k, v in fused_mma_times(r).items()) + (
                f"; op: {r['moe_up_op_us']:.0f}" if "moe_up_op_us" in r else "")
        d["other token tiles us"] = " ".join(f"{k}: {v:.0f}" for k, v in tile_times(r).items())
        d["other MMA us"] = " ".join(f"{k}: {v:.0f}" for k, v in mma_times(r).items())
        d["other kernel us"] = " ".join(f"{k}: {v:.0f}" for k, v in kernel_times(r).items())
        md.append(d)
    body = (f"Measured {payload.get('date')} on {payload.get('device')} "
            f"(jax {payload.get('jax')}{C.build_note(payload)}), "
            f"`{payload.get('command', 'python benchmarks/bench_grouped_gemm.py')}`"
            + (f" (stopped early: {len(rows)} rows measured)" if payload.get("complete") is False else "")
            + f"; copy bandwidth "
            f"{payload['copy_bw'] / 1e12:.2f} TB/s. 32 experts; activation scales "
            f"{X_SCALES.get(payload.get('x_scales', 'f32'), payload.get('x_scales'))}; weight GB/s and % copy BW: the "
            "int4 weight bytes (N*K/2 per expert"
            + (" that receives rows, its count in the JSON's `experts_with_rows`"
               if all("experts_with_rows" in r for r in rows) else ", all 32 experts")
            + "; group scales excluded) over our time, against the copy bandwidth (bytes read + written); TFLOP/s: "
            "2*M*N*K over the routed rows; `vs X` is X's time over ours (higher is better for us); "
            "plan = token tile / split-K (/ f16 MMA) from `jax_w4a8.tiling`, or `cutlass` (int4 weights "
            "converted to e4m3 once per call, then CUTLASS's grouped FP8 GEMM; the time includes the conversion); "
            "other token tiles: the same call forced to another tile (the heuristic's alternatives); other MMA: the "
            "same call with the other tensor-core operand format (`mma=`, same token tile, this library's wgmma tiles); other kernel: the "
            "same call on the other kernel families (`kernel=`: CUTLASS from M = 2048, the decode kernel up to M = 512 with 8- and 16-row units)"
            + ("; folded layout: the same call on activations the quantizer hands over already folded "
               "(`x_layout=\"folded\"`, as the MoE layer runs it where the plan folds UE8M0 scales: no preparation "
               "pass)" + (", its outputs bit for bit the standard call's" if all(
                   r.get("folded_bitwise_equal", True) for r in rows) else "") if any("folded_us" in r for r in rows)
               else "")
            + "."
            + C.card_note(payload)
            + (f" The timing loop costs {payload['harness_floor_us']:.1f} us per call by itself (a 128-element XLA "
               "op measured the same way), included in every time below; each timed program runs 10 calls, or up to "
               "200 for short ones so that its launch is shared." if "harness_floor_us" in payload else "")
            + "\n\n" + C.md_table(md, cols) + f"\n\n![grouped GEMM]({png})\n")
    C.update_results_section(C.results_section("W4A8 grouped GEMM (one EP8 shard of DeepSeek-R1)", payload), body)
    save_plot(payload, C.HERE / png)
    if out:
        save_plot(payload, pathlib.Path(out) / png)


def save_plot(payload, path):
    """:func:`plot` where matplotlib (an optional dependency) imports; otherwise says so and writes no PNG."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: {path} not written")
        return
    plot(payload, path)


def plot(payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, shape in zip(axes, SHAPES):
        rows = [r for r in payload["rows"] if r["shape"] == shape and r["routing"] == "uniform"]
        if not rows:
            continue
        ms = [r["M"] for r in rows]
        ax.plot(ms, [r["ours_us"] for r in rows], "o-", lw=2, label="jax_w4a8 W4A8")
        for p in PEERS:
            pts = [(r["M"], r[f"{p}_us"]) for r in rows if f"{p}_us" in r]
            if pts:
                ax.plot(*zip(*pts), ".--", label=p)
        n, k = SHAPES[shape]
        ax.plot(ms, [read_floor_us(r, payload["copy_bw"]) for r in rows], "k:", label="int4 weight read floor")
        ax.plot(ms, [2 * m * n * k / FP8_PEAK * 1e6 for m in ms], "k-.", label="fp8 compute floor (datasheet)")
        ax.set(xscale="log", yscale="log", xlabel="M (routed rows)", ylabel="us per call",
               title=f"{shape}: N={n} K={k}, 32 experts")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer M values (Pallas keeps every tile configuration)")
    p.add_argument("--ms", type=int, nargs="+", metavar="M",
                   help=f"routed rows to measure (default {MS_FULL}; --quick: {MS_QUICK}); skewed routing at "
                        f"those of {SKEWED_MS} listed")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--x-scales", choices=sorted(X_SCALES), default="ue8m0",
                   help="activation scales of the W4A8 calls (default ue8m0: per token group, powers of two)")
    p.add_argument("--peers", choices=["all", "fast", "none"], default="all",
                   help="fast: Pallas and torch only (XLA ragged_dot runs ~24 TFLOP/s and takes long)")
    p.add_argument("--tiles", type=int, nargs="*", default=[], choices=[8, 16, 32, 64, 128],
                   help="also time these token tiles for every case (the tile heuristic's alternatives)")
    p.add_argument("--trace-kernels", action="store_true",
                   help="also trace each row's timing loop once (JAX profiler) and record where a call's device time "
                        "goes: each kernel family's microseconds per call (the preparation, the GEMM, ...), busy and "
                        "span")
    p.add_argument("--out", help="folder for JSON and PNG (default $OUT or benchmarks/out)")
    p.add_argument("--report", help="rewrite RESULTS.md and the plot from this JSON instead of measuring")
    args = p.parse_args()
    if args.report:
        report(json.loads(pathlib.Path(args.report).read_text()), None)
        return
    out = C.out_dir(args.out)
    if args.trace_kernels:  # before JAX's backend starts: the traced loop then runs its CUDA graphs as the timed one does
        C.keep_command_buffers_while_profiling()
    # grouped_gemm.json is rewritten after every row ("complete": false until the last), so a run stopped by a
    # device call's time limit keeps what it measured (--report renders it and says it stopped early)
    payload = run(args, on_row=lambda partial: C.save_json(out / "grouped_gemm.json", partial))
    C.save_json(out / "grouped_gemm.json", payload)
    print(C.fmt_table([{"row": fmt_row(r)} for r in payload["rows"]], ["row"]))
    try:
        save_plot(dict(payload), out / "grouped_gemm.png")
    except Exception as exc:  # noqa: BLE001 - a plot never costs the measurements
        print("plot failed:", exc)


if __name__ == "__main__":
    main()
