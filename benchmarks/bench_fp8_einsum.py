"""FP8 block-scaled einsum vs what a JAX user would otherwise write, DeepSeek-V3 shapes, one process.

    python benchmarks/bench_fp8_einsum.py [--quick] [--out DIR]
    python benchmarks/bench_fp8_einsum.py --report DIR/fp8_einsum.json

Linears "md,nd->mn" (recipe (1, 128, 128), UE8M0 scales as codes) and per-head "bhr,hdr->bhd"
(MLA absorb, DeepSeek-V4 wo_a). Peers: XLA dot_general with fp8 operands to bf16 (per-tensor scale: a free
operand of its cuBLASLt GEMM), bf16 dot_general, and dequantize-to-bf16 + matmul inside jit. Each case rotates
through input sets of at least ROTATE_BYTES together, so that weights come from HBM, not L2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LINEARS = {  # name: (N, K)
    "q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168), "o_proj": (7168, 16384),
    "qkv_a": (2112, 7168),  # q_a and kv_a as the model runs them: one product (MLA.qkv_a_proj)
    "shared_up": (4096, 7168), "shared_down": (7168, 2048), "dense_up": (36864, 7168), "dense_down": (7168, 18432),
    "square": (7168, 7168),
}
MS_FULL = [1, 16, 64, 512, 4096, 16384]
MS_QUICK = [1, 64, 4096]
PER_HEAD = {  # name: (H, R, D)
    "mla_absorb_q": (128, 128, 512), "mla_absorb_o": (128, 512, 128), "v4_wo_a": (16, 4096, 1024),
}
BS_FULL = [1, 64, 4096]
# Every timed case rotates through input sets of at least this many bytes together (BENCHMARKS.md: rotating inputs
# larger than L2; the H100's L2 is 50 MB, the H200's 60 MB): two sets of a small linear (kv_a: 2 x 4 MB) or one
# per-head weight (8 MB for the MLA absorb products, 64 MB for V4's wo_a) could stay in L2. (H100, one process, at
# 1 and 64 tokens: rotated times 0.90x-1.11x the unrotated ones, mostly slower; these cases are latency-bound.)
ROTATE_BYTES = 200 * 10**6
MAX_SETS = 64  # a bound on the arguments of a timed program (kv_a, the smallest weight here, takes 49 sets)


def rotation(bytes_per_set, least=2):
    """How many input sets of ``bytes_per_set`` bytes a case rotates through: ``least``, or more to reach
    ROTATE_BYTES (at most MAX_SETS)."""
    return min(MAX_SETS, max(least, -(-ROTATE_BYTES // bytes_per_set)))


def plan_label(plan):
    return "cutlass" if plan.kernel == "cutlass" else f"t{plan.tile_tokens}/s{plan.split_k}"


def time_native_too(r, plan, fn, arg_sets, native_plan):
    """When the plan runs CUTLASS, time this library's own kernel (its plan) on the same data as well."""
    if plan.kernel != "cutlass":
        return
    r["native_plan"], r["native_us"] = plan_label(native_plan), C.bench(fn, arg_sets) * 1e6


def time_cublas_too(r, plan, m, n, k, arg_sets, ref):
    """Where the plan runs CUTLASS on a linear, time the opt-in cuBLASLt path (``kernel="cublas"``) on the same data
    as well, when cuBLASLt loads and takes these shapes (``cublas_us``; ``cublas_rel_err_vs_simple`` against
    ``ref``, the simple kernel's float32 output on ``arg_sets[0]``)."""
    import jax
    import jax.numpy as jnp

    from jax_w4a8 import ops, tiling

    if plan.kernel != "cutlass":
        return
    try:
        tiling.plan_fp8_einsum(m, 1, n, k, block_scaled=True, kernel="cublas")
    except ValueError as exc:
        r["cublas_skipped"] = str(exc)
        return
    fn = jax.jit(lambda a, sa, c, sc: ops.fp8_einsum("md,nd->mn", a, sa, c, sc, kernel="cublas"))
    r["cublas_us"] = C.bench(fn, arg_sets) * 1e6
    got = fn(*arg_sets[0]).astype(jnp.float32)
    r["cublas_rel_err_vs_simple"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def xla_fp8_per_tensor(a, b):
    """The per-tensor fp8 peer of ``md,nd->mn``: XLA ``dot_general`` of e4m3 operands to bf16 (one cuBLASLt fp8 GEMM;
    a per-tensor scale is one of its scalar operands, free)."""
    import jax
    import jax.numpy as jnp

    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def run(args, on_row=None):
    """Measures every case; ``on_row(payload)`` after each row with the rows so far (``complete`` False), so that a
    run stopped by a time limit still leaves its measured rows."""
    import jax
    import jax.numpy as jnp

    from jax_w4a8 import ops, quant, tiling

    bw, detail = C.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s {({k: round(v / 1e12, 2) for k, v in detail.items()})}", flush=True)
    floor = C.harness_floor()
    print(f"timing harness floor {floor * 1e6:.1f} us per call (adaptive n)", flush=True)
    key = jax.random.key(0)
    rows = []

    def payload(complete):
        return dict(copy_bw=bw, copy_bw_detail=detail, harness_floor_us=floor * 1e6, rows=list(rows),
                    rotate_bytes=ROTATE_BYTES, complete=complete,
                    command="python benchmarks/bench_fp8_einsum.py " + " ".join(sys.argv[1:]))

    def keep(r):  # a measured row: printed, and handed to on_row with the rows so far
        rows.append(r)
        print(fmt_row(r), flush=True)
        if on_row is not None:
            on_row(payload(False))
    ms = MS_QUICK if args.quick else MS_FULL
    linears = {k: v for k, v in LINEARS.items() if not args.quick or k in ("q_a", "kv_a", "qkv_a", "square", "o_proj")}
    for name, (n, k) in linears.items():
        w8, wbf = [], []
        for i in range(rotation(n * k)):  # fp8 weights past the L2 (their bf16 copies for the peers twice that)
            w = jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32) * 0.02
            q, s = quant.quantize_fp8_blocks(w, ue8m0=True)
            w8.append((q, quant.encode_ue8m0(s)))
            wbf.append(w.astype(jnp.bfloat16))
            del w
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            x8, xs = quant.quantize_fp8_groups(x, ue8m0=True)
            xc = quant.encode_ue8m0(xs)
            plan = tiling.plan_fp8_einsum(m, 1, n, k, block_scaled=True)  # UE8M0 128x128 weight blocks
            native_plan = tiling.plan_fp8_einsum(m, 1, n, k, block_scaled=True, kernel="native")
            ours = jax.jit(lambda a, sa, b, sb: ops.fp8_einsum("md,nd->mn", a, sa, b, sb))
            t = C.bench(ours, [(x8, xc, q, s) for q, s in w8])
            got = ours(x8, xc, *w8[0]).astype(jnp.float32)
            ref = ops.fp8_einsum("md,nd->mn", x8, xc, *w8[0], tile_tokens=0).astype(jnp.float32)
            r = dict(case=name, eq="md,nd->mn", M=m, N=n, K=k, plan=plan_label(plan),
                     rel_err_vs_simple=float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)))
            r.update(ours_us=t * 1e6, TFLOPs=2 * m * n * k / t / 1e12, weight_GBps=n * k / t / 1e9,
                     frac_copy_bw=n * k / t / bw)
            native = jax.jit(lambda a, sa, c, sc: ops.fp8_einsum("md,nd->mn", a, sa, c, sc, kernel="native"))
            time_native_too(r, plan, native, [(x8, xc, q, s) for q, s in w8], native_plan)
            time_cublas_too(r, plan, m, n, k, [(x8, xc, q, s) for q, s in w8], ref)
            peers = {}
            if args.peers == "none":
                keep(r)
                continue
            # e4m3 x e4m3 -> bf16, as BENCHMARKS.md's anchor: XLA runs it as one cuBLASLt fp8 GEMM whose per-tensor
            # scale operands are free (here 1). Multiplying the bf16 product by a float32 scale instead promoted the
            # result to float32 in a second pass (H100, M=4096: 364 vs 300 us at N=K=7168, 725 vs 691 us for o_proj),
            # flattering ours up to 1.2x; the scaled form XLA rewrites into those operands outputs float32 and took
            # 1307 us.
            fp8 = jax.jit(xla_fp8_per_tensor)
            # the headline peer in interleaved rounds with ours (prefill runs at the power cap, where the clock
            # drifts between two measurements taken one after the other): its ratio is to ours of those rounds
            pair = C.bench_alternating({"ours": (ours, [(x8, xc, q, s) for q, s in w8]),
                                        "xla_fp8": (fp8, [(x8, q) for q, _ in w8])})
            r["ours_us_beside_xla_fp8"] = pair["ours"] * 1e6
            bf = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))))
            peers["xla_bf16"] = C.bench(bf, [(x, w) for w in wbf])
            deq = jax.jit(lambda a, b, s: jax.lax.dot_general(
                a, quant.dequantize_fp8_blocks(b, quant.decode_ue8m0(s), dtype=jnp.bfloat16), (((1,), (1,)), ((), ()))))
            peers["dequant_bf16_matmul"] = C.bench(deq, [(x, q, s) for q, s in w8])
            for p, tp in peers.items():
                r[f"{p}_us"], r[f"x_{p}"] = tp * 1e6, tp / t
            r["xla_fp8_per_tensor_us"] = pair["xla_fp8"] * 1e6
            r["x_xla_fp8_per_tensor"] = pair["xla_fp8"] / pair["ours"]
            keep(r)
        del w8, wbf
    bs = [1, 64] if args.quick else BS_FULL
    for name, (h, rr, d) in PER_HEAD.items():
        wsets, wbfs = [], []
        for i in range(rotation(h * d * rr, least=1)):
            w = jax.random.normal(jax.random.fold_in(key, 99 + i), (h, d, rr), jnp.float32) * 0.02
            wsets.append(quant.quantize_fp8_blocks(w))
            wbfs.append(w.astype(jnp.bfloat16))
            del w
        wq, wsc = wsets[0]
        for b in bs:
            x = jax.random.normal(jax.random.fold_in(key, b), (b, h, rr), jnp.bfloat16)
            x8, xs = quant.quantize_fp8_groups(x)
            plan = tiling.plan_fp8_einsum(b, h, d, rr, block_scaled=True)
            native_plan = tiling.plan_fp8_einsum(b, h, d, rr, block_scaled=True, kernel="native")
            ours = jax.jit(lambda a, sa, c, sc: ops.fp8_einsum("bhr,hdr->bhd", a, sa, c, sc))
            t = C.bench(ours, [(x8, xs, q, s) for q, s in wsets])
            got = ours(x8, xs, wq, wsc).astype(jnp.float32)
            ref = ops.fp8_einsum("bhr,hdr->bhd", x8, xs, wq, wsc, tile_tokens=0).astype(jnp.float32)
            r = dict(case=name, eq="bhr,hdr->bhd", M=b, N=d, K=rr, H=h, plan=plan_label(plan),
                     rel_err_vs_simple=float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)))
            r.update(ours_us=t * 1e6, TFLOPs=2 * b * h * d * rr / t / 1e12, weight_GBps=h * d * rr / t / 1e9,
                     frac_copy_bw=h * d * rr / t / bw)
            native = jax.jit(lambda a, sa, c, sc: ops.fp8_einsum("bhr,hdr->bhd", a, sa, c, sc, kernel="native"))
            time_native_too(r, plan, native, [(x8, xs, q, s) for q, s in wsets], native_plan)
            if args.peers != "none":
                bf = jax.jit(lambda a, c: jnp.einsum("bhr,hdr->bhd", a, c))
                tp = C.bench(bf, [(x, w) for w in wbfs])
                r["xla_bf16_us"], r["x_xla_bf16"] = tp * 1e6, tp / t
            keep(r)
        del wsets, wbfs, wq, wsc
    # The activation quantizer (bf16 -> e4m3 + UE8M0 group scales): bytes moved over time vs copy bandwidth.
    for m in ([16384] if args.quick else [4096, 16384]):
        k = 7168
        xsets = [(jax.random.normal(jax.random.fold_in(key, 7 * m + i), (m, k), jnp.bfloat16),)
                 for i in range(rotation(m * k * 2, least=1))]
        x = xsets[0][0]
        ours = jax.jit(lambda v: ops.quantize_fp8_groups(v, ue8m0=True))
        t = C.bench(ours, xsets)
        q, _ = ours(x)
        q_ref, _ = quant.quantize_fp8_groups(x, ue8m0=True)
        moved = m * k * 2 + m * k + m * (k // 128) * 4
        r = dict(case="quantizer", eq="x -> e4m3 + ue8m0", M=m, N=k, K=k, plan="-", ours_us=t * 1e6, TFLOPs=0.0,
                 weight_GBps=moved / t / 1e9, frac_copy_bw=moved / t / bw,
                 rel_err_vs_simple=float(jnp.mean(jax.lax.bitcast_convert_type(q, jnp.uint8)
                                                  != jax.lax.bitcast_convert_type(q_ref, jnp.uint8))))
        if args.peers != "none":
            tp = C.bench(jax.jit(lambda v: quant.quantize_fp8_groups(v, ue8m0=True)), xsets)
            r["xla_jnp_quantizer_us"], r["x_xla_jnp_quantizer"] = tp * 1e6, tp / t
            # The same traffic without any quantizing: a plain bf16 -> e4m3 cast (XLA, and torch when it
            # imports), i.e. what this read:write mix (2 bytes in, 1 out) reaches on this GPU.
            cast_bytes = m * k * 3
            tp = C.bench(jax.jit(lambda v: v.astype(jnp.float8_e4m3fn)), xsets)
            r["xla_cast_us"], r["x_xla_cast"], r["xla_cast_frac_copy_bw"] = tp * 1e6, tp / t, cast_bytes / tp / bw
            if C.have_torch():
                import torch

                xts = itertools.cycle([torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in xsets])
                tp = C.torch_bench(lambda: next(xts).to(torch.float8_e4m3fn))
                r["torch_cast_us"], r["x_torch_cast"], r["torch_cast_frac_copy_bw"] = tp * 1e6, tp / t, cast_bytes / tp / bw
                del xts
        keep(r)
        del xsets, x
    return payload(True)


PEERS = ["xla_fp8_per_tensor", "xla_bf16", "dequant_bf16_matmul", "xla_jnp_quantizer", "xla_cast", "torch_cast"]


def fmt_row(r):
    peers = " ".join(f"{p}={r[f'x_{p}']:.2f}x" for p in PEERS if f"x_{p}" in r)
    native = f" | native {r['native_plan']} {r['native_us']:.1f} us" if "native_us" in r else ""
    native += f" | cublas {r['cublas_us']:.1f} us" if "cublas_us" in r else ""
    return (f"{r['case']:13s} M={r['M']:6d} N={r['N']:6d} K={r['K']:6d} {r['plan']:7s} {r['ours_us']:9.1f} us "
            f"{r['TFLOPs']:7.1f} TFLOP/s {r['weight_GBps']:7.0f} GB/s ({100 * r['frac_copy_bw']:5.1f}% copy) "
            f"err {r['rel_err_vs_simple']:.1e} | {peers}{native}")


def report(payload):
    cols = ["case", "equation", "M or b", "N", "K", "plan", "us", "TFLOP/s", "GB/s (weights; quantizer: bytes moved)", "% copy BW"] + [
        f"vs {p}" for p in PEERS] + ["this library's kernel (plan, us)", "cuBLASLt path (us)"]
    md = []
    for r in payload["rows"]:
        d = {"case": r["case"] + (f" (h={r['H']})" if "H" in r else ""), "equation": r["eq"], "M or b": r["M"],
             "N": r["N"], "K": r["K"], "plan": r["plan"], "us": f"{r['ours_us']:.1f}", "TFLOP/s": f"{r['TFLOPs']:.0f}",
             "GB/s (weights; quantizer: bytes moved)": f"{r['weight_GBps']:.0f}", "% copy BW": f"{100 * r['frac_copy_bw']:.0f}"}
        for p in PEERS:
            if f"x_{p}" in r:
                d[f"vs {p}"] = f"{r[f'x_{p}']:.2f}x"
        if "native_us" in r:
            d["this library's kernel (plan, us)"] = f"{r['native_plan']}, {r['native_us']:.1f}"
        if "cublas_us" in r:
            d["cuBLASLt path (us)"] = f"{r['cublas_us']:.1f}"
        md.append(d)
    body = (f"Measured {payload.get('date')} on {payload.get('device')} "
            f"(jax {payload.get('jax')}{C.build_note(payload)}), "
            f"`{payload.get('command', 'python benchmarks/bench_fp8_einsum.py')}`"
            + (f" (stopped early: {len(payload['rows'])} rows measured)" if payload.get("complete") is False else "")
            + f"; copy bandwidth {payload['copy_bw'] / 1e12:.2f} TB/s. "
            "UE8M0 block scales as codes for the linears, fp32 scales per head; `vs X` is X's time over ours"
            + (" (XLA fp8's over ours timed in interleaved rounds with it: `ours_us_beside_xla_fp8` in the JSON)"
               if any("ours_us_beside_xla_fp8" in r for r in payload["rows"]) else "") + "; "
            "plan `cutlass` = CUTLASS's blockwise-scaled GEMM (`kernel=\"cutlass\"`), with this library's own "
            "kernel timed on the same data in the next column, and the opt-in cuBLASLt path (`kernel=\"cublas\"`, "
            "cuBLASLt's own block-scaled FP8 GEMM) in the last where it ran. GB/s: the fp8 weight bytes (scales excluded) over our "
            "time" + ("; each case rotates through weight sets (the quantizer: inputs) of at least "
                      f"{payload['rotate_bytes'] / 1e6:.0f} MB together, past the L2."
                      if "rotate_bytes" in payload else ".")
            + (f" The timing loop costs {payload['harness_floor_us']:.1f} us per call by itself (a 128-element XLA "
               "op measured the same way), included in every time below; each timed program runs 10 calls, or up to "
               "200 for short ones so that its launch is shared." if "harness_floor_us" in payload else "")
            + C.card_note(payload)
            + "\n\n"
            + C.md_table(md, cols) + "\n")
    for r in payload["rows"]:
        if r["case"] == "quantizer" and "xla_cast_frac_copy_bw" in r:
            casts = [f"{100 * r[f'{n}_cast_frac_copy_bw']:.0f}% ({n})" for n in ("xla", "torch")
                     if f"{n}_cast_frac_copy_bw" in r]
            body += (f"\nThe quantizer's traffic (2 bytes read, 1 written per element) on its own: a plain bf16 -> e4m3 "
                     f"cast of the same [{r['M']}, {r['K']}] tensor reaches {' / '.join(casts)} of copy bandwidth; the "
                     f"quantizer reaches {100 * r['frac_copy_bw']:.0f}% while also finding the group maxima and writing scales.\n")
    C.update_results_section(C.results_section("FP8 block-scaled einsum (DeepSeek-V3 linears, per-head products)",
                                               payload), body)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out")
    p.add_argument("--peers", choices=["all", "none"], default="all")
    p.add_argument("--report")
    args = p.parse_args()
    if args.report:
        report(json.loads(pathlib.Path(args.report).read_text()))
        return
    out = C.out_dir(args.out)
    # fp8_einsum.json is rewritten after every row ("complete": false until the last), so a run stopped by a device
    # call's time limit keeps what it measured (--report renders it and says it stopped early)
    payload = run(args, on_row=lambda partial: C.save_json(out / "fp8_einsum.json", partial))
    C.save_json(out / "fp8_einsum.json", payload)


if __name__ == "__main__":
    main()
