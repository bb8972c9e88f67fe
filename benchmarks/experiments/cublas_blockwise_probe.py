"""Probe (not on main's code path): how fast is cuBLASLt's own DeepSeek-style block-scaled FP8 GEMM on this GPU?

cuBLASLt (12.9 and later) takes per-128-K-group activation scales (``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F``) and
128 x 128 weight block scales (``BLK128x128_32F``) on Hopper. torch's ``_scaled_mm`` reaches them with
"blockwise 1x128" / "128x128" scales. This script times, in one process and on the same data, for the einsum's
``md,nd->mn`` linears at prefill sizes:

  torch_blockwise   torch._scaled_mm, x [M, K] with 1x128 scales, w [N, K] with 128x128 block scales (cuBLASLt)
  torch_per_tensor  torch._scaled_mm with scalar scales (the plain fp8 GEMM, as XLA's fp8 dot_general)
  ours              jax_w4a8.ops.fp8_einsum("md,nd->mn", ...) with float32 scales (the plan's kernel)
  ours_cublas       the same with kernel="cublas" (this library's cuBLASLt path: scale preparation + cuBLASLt)
  xla_fp8           XLA dot_general e4m3 x e4m3 -> bf16

Every case rotates through at least 200 MB of weights. Outputs are checked against a float64 reference on 64
sampled rows. Run on the GPU machine from the repository root:

    PYTHONPATH=$PWD python benchmarks/experiments/cublas_blockwise_probe.py [--ms 4096 16384] [--cases square o_proj]

Sixty-first session (H100): the cuBLASLt path and torch run the same kernel
(``nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA_algo2_Ablk128_Bvec128_TNN``, the heuristic's only result; 328 us
alone under ``ncu`` through either), so torch's lower times here come from how the loops load the GPU, not from a
better algorithm: the kernel slows by about 10% over 160 back-to-back calls (the 700 W cap), torch's 20-call rounds
read 328-336 us, its 60 ms rounds 348-363, and the interleaved JAX rounds, which keep the GPU busy for about a
second, 384-421. ``--min-program-ms`` sets every timed round's length, ``--trace jax|torch`` gives the kernels' own
times inside the loops, and ``one_gemm_ncu.py`` each kernel alone under ``ncu``.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

LINEARS = {"q_a": (1536, 7168), "kv_a": (576, 7168), "square": (7168, 7168), "o_proj": (7168, 16384),
           "mlp_up": (36864, 7168)}
ROTATE_BYTES = 200 * 10**6


def blockwise_mm(torch, a, b_t, sa, sb):
    """torch._scaled_mm in its blockwise form: a [M, K] row-major e4m3, b_t [K, N] column-major (w [N, K] transposed),
    sa [M, K/128] float32, sb [N/128, K/128] float32. Tries the layouts torch versions have asked for; returns
    (fn, layout name) for the first that runs, or raises with every error."""
    errors = []
    m = a.shape[0]
    variants = {
        # 1x128: outer-dim (M) major; 128x128: the scale tensor of b = w^T, [K/128, N/128], from w's [N/128, K/128]
        "sa M-major, sb (K/128, N/128) from w's": (sa.t().contiguous().t(), sb.t()),
        "sa M-major, sb (N/128, K/128)": (sa.t().contiguous().t(), sb),
        "sa M-major, sb (K/128, N/128) contiguous": (sa.t().contiguous().t(), sb.t().contiguous()),
        "sa row-major, sb (K/128, N/128) from w's": (sa.contiguous(), sb.t()),
    }
    for name, (xa, xb) in variants.items():
        try:
            fn = lambda a=a, b=b_t, xa=xa, xb=xb: torch._scaled_mm(a, b, xa, xb, out_dtype=torch.bfloat16)
            fn()
            torch.cuda.synchronize()
            return fn, name
        except Exception as e:  # noqa: BLE001 - a probe: report every failure
            errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    raise RuntimeError(f"no blockwise layout ran (M={m}):\n  " + "\n  ".join(errors))


def torch_trace(torch, fn, calls):
    """torch's side of --trace: ``calls`` back-to-back calls under torch.profiler; the GEMM kernel's median time and
    its first / last tenth's."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gemm = lambda name: "gemm" in name.lower() or "nvjet" in name  # noqa: E731
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and gemm(e.name)),
                 key=lambda e: e.time_range.start)
    d = [e.time_range.elapsed_us() for e in evs]
    if d:
        tenth = max(1, len(d) // 10)
        print(f"    trace torch_blockwise ({calls} calls): {evs[0].name[:60]} x{len(d)} median {np.median(d):.1f} us; "
              f"first / last tenth {np.median(d[:tenth]):.1f} / {np.median(d[-tenth:]):.1f} us", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", type=int, nargs="+", default=[4096])
    p.add_argument("--cases", nargs="+", default=["square", "o_proj", "q_a", "kv_a"], choices=list(LINEARS))
    p.add_argument("--no-jax", action="store_true", help="time torch only")
    p.add_argument("--algos", type=int, default=1,
                   help="also time the cuBLASLt path with its heuristic's results 1 .. N-1 ($JAX_W4A8_CUBLAS_ALGO)")
    p.add_argument("--min-program-ms", type=float, default=5.0,
                   help="each timed round lasts at least this long, torch's and JAX's alike (the GPU reaches its "
                        "power cap only in rounds of tens of ms: compare the frameworks at 50-100)")
    p.add_argument("--trace", choices=["jax", "torch"],
                   help="also trace once, with one profiler per process: 'jax' each JAX loop (the JAX profiler, XLA's "
                        "command buffers kept as in the timed loops): its kernels' times per call and the device's "
                        "busy time against the span, to tell kernel time from gaps; 'torch' torch's blockwise loop "
                        "(torch.profiler)")
    p.add_argument("--trace-calls", type=int, default=0,
                   help="calls in the traced loop (default two per weight set); with many (150 = about 60 ms), "
                        "the first and last tenth's kernel times show whether the kernel slows as the load lasts")
    args = p.parse_args()
    if args.trace == "jax" and args.no_jax:
        p.error("--trace jax needs the JAX loops: drop --no-jax")

    import torch

    import _common as C

    print(f"torch {torch.__version__} cuda {torch.version.cuda} {torch.cuda.get_device_name()} "
          f"cublasLt {torch._C._cuda_getCompiledVersion() if hasattr(torch._C, '_cuda_getCompiledVersion') else ''}",
          flush=True)
    if not args.no_jax:
        if args.trace == "jax" and not C.keep_command_buffers_while_profiling():  # before JAX's backend starts
            print("    note: XLA_FLAGS already set the command buffers off while profiling: traces run op by op",
                  flush=True)
        import jax
        import jax.numpy as jnp

        from jax_w4a8 import ops, tiling
    rng = np.random.default_rng(0)

    def torch_n(fn):  # calls per timed round: at least 20 and --min-program-ms, at most 2000 (as the JAX loops)
        return min(2000, max(20, int(np.ceil(args.min_program_ms / 1e3 / C.torch_bench(fn, n=5, rounds=1)))))
    fp8 = torch.float8_e4m3fn
    for name in args.cases:
        n, k = LINEARS[name]
        sets = max(2, -(-ROTATE_BYTES // (n * k)))
        ws = []
        for _ in range(sets):
            w = torch.randn(n, k, device="cuda") * 2.0
            sw = torch.rand(-(-n // 128), k // 128, device="cuda") * 0.02 + 0.001
            ws.append((w.clamp(-448, 448).to(fp8), sw))
            del w
        for m in args.ms:
            x = (torch.randn(m, k, device="cuda") * 2.0).clamp(-448, 448).to(fp8)
            sx = torch.rand(m, k // 128, device="cuda") * 0.02 + 0.001
            row = dict(case=name, M=m, N=n, K=k)
            # float64 reference on sampled rows, from the same codes and scales
            pick = np.sort(rng.choice(m, size=min(m, 64), replace=False))
            xs = (x[pick].double().reshape(len(pick), k // 128, 128) * sx[pick].double()[..., None]).reshape(len(pick), k)
            wq, sw = ws[0]
            sw_full = sw.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
            ref = (xs @ (wq.double() * sw_full).t()).cpu().numpy()

            def err(out):
                got = out[pick].double().cpu().numpy()
                return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

            try:
                fn, layout = blockwise_mm(torch, x, wq.t(), sx, sw)
                row["blockwise_layout"] = layout
                row["blockwise_rel_err"] = err(fn())
                fns = [blockwise_mm(torch, x, q.t(), sx, s)[0] for q, s in ws]
                it = iter(range(1 << 62))
                rotating = lambda: fns[next(it) % len(fns)]()  # noqa: E731 - every weight set, as timed
                row["torch_blockwise_us"] = C.torch_bench(rotating, n=torch_n(rotating)) * 1e6
                if args.trace == "torch":
                    torch_trace(torch, rotating, args.trace_calls or 2 * len(fns))
            except Exception as e:  # noqa: BLE001
                row["torch_blockwise_error"] = str(e)
            one = torch.ones((), device="cuda")
            it2 = iter(range(1 << 62))
            pt = lambda: torch._scaled_mm(x, ws[next(it2) % sets][0].t(), one, one, out_dtype=torch.bfloat16)
            row["torch_per_tensor_us"] = C.torch_bench(pt, n=torch_n(pt)) * 1e6
            if not args.no_jax:
                xj = jnp.asarray(x.view(torch.uint8).cpu().numpy()).view(jnp.float8_e4m3fn)
                sxj = jnp.asarray(sx.cpu().numpy())
                wj = [(jnp.asarray(q.view(torch.uint8).cpu().numpy()).view(jnp.float8_e4m3fn), jnp.asarray(s.cpu().numpy()))
                      for q, s in ws]
                ours = jax.jit(lambda a, sa, b, sb: ops.fp8_einsum("md,nd->mn", a, sa, b, sb))
                out = np.asarray(ours(xj, sxj, *wj[0]).astype(jnp.float32))
                row["ours_rel_err"] = float(np.linalg.norm(out[pick] - ref) / np.linalg.norm(ref))
                row["ours_plan"] = str(tiling.plan_fp8_einsum(m, 1, n, k, block_scaled=True))
                xla = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                               preferred_element_type=jnp.bfloat16))
                lt = jax.jit(lambda a, sa, b, sb: ops.fp8_einsum("md,nd->mn", a, sa, b, sb, kernel="cublas"))
                out = np.asarray(lt(xj, sxj, *wj[0]).astype(jnp.float32))
                row["ours_cublas_rel_err"] = float(np.linalg.norm(out[pick] - ref) / np.linalg.norm(ref))
                loops = {"ours": (ours, [(xj, sxj, q, s) for q, s in wj]),
                         "ours_cublas": (lt, [(xj, sxj, q, s) for q, s in wj]),
                         "xla_fp8": (xla, [(xj, q) for q, _ in wj])}
                pair = C.bench_alternating(loops, min_program_s=args.min_program_ms / 1e3, max_n=2000)
                for key2, t in pair.items():
                    row[f"{key2}_us"] = t * 1e6
                if args.trace == "jax":
                    for key2, (fn2, sets2) in loops.items():
                        reps = args.trace_calls or 2 * len(sets2)
                        many = jax.jit(C._unrolled(fn2, len(sets2), reps))
                        flat = [a for s2 in sets2 for a in s2]
                        jax.block_until_ready(many(*flat))
                        kernels = C.trace_kernels(lambda: many(*flat))
                        rows, busy, span = C.kernel_breakdown(kernels, reps)
                        top = [d for _, nm, _, d in sorted(kernels, key=lambda e: e[2])  # in time order
                               if rows and C.kernel_family(nm) == rows[0]["family"]]
                        tenth = max(1, len(top) // 10)
                        drift = (f"; top kernel first / last tenth {np.median(top[:tenth]):.1f} / "
                                 f"{np.median(top[-tenth:]):.1f} us" if top else "")
                        print(f"    trace {key2} ({reps} calls): busy {busy:.1f} us / span {span:.1f} us per call; "
                              + "; ".join(f"{r['family'][:60]} x{r['count']:.0f} {r['median_us']:.1f}"
                                          for r in rows[:4])
                              + drift, flush=True)
                for a in range(1, args.algos):  # cuBLASLt's other heuristic results, each traced afresh
                    os.environ["JAX_W4A8_CUBLAS_ALGO"] = str(a)
                    try:
                        la = jax.jit(lambda a_, sa, b, sb: ops.fp8_einsum("md,nd->mn", a_, sa, b, sb, kernel="cublas"))
                        out = np.asarray(la(xj, sxj, *wj[0]).astype(jnp.float32))
                        err_a = float(np.linalg.norm(out[pick] - ref) / np.linalg.norm(ref))
                        t_a = C.bench(la, [(xj, sxj, q, s) for q, s in wj], min_program_s=args.min_program_ms / 1e3,
                                      max_n=2000) * 1e6
                        print(f"    cublas algo {a}: {t_a:8.1f} us, rel err {err_a:.2e}", flush=True)
                    except Exception as exc:  # noqa: BLE001 - past the heuristic's results: say so and stop
                        print(f"    cublas algo {a}: {str(exc).splitlines()[0][:200]}", flush=True)
                        break
                    finally:
                        os.environ.pop("JAX_W4A8_CUBLAS_ALGO", None)
                del xj, wj
            flops = 2 * m * n * k
            line = f"{name:7s} M={m:6d} N={n:6d} K={k:6d}"
            for key in ("torch_blockwise_us", "torch_per_tensor_us", "ours_us", "ours_cublas_us", "xla_fp8_us"):
                if key in row:
                    line += f" | {key[:-3]} {row[key]:8.1f} us {flops / row[key] / 1e6:6.0f} TF"
            print(line, flush=True)
            print("   ", {k2: v for k2, v in row.items() if "err" in k2 or "layout" in k2 or "plan" in k2}, flush=True)
        del ws


if __name__ == "__main__":
    main()
