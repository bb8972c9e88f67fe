"""Runs both ops through the FFI on random DeepSeek-shaped data and checks them against the reference.

    python -m jax_w4a8.demo [--rows 64] [--experts 8]

Shapes: one slice of a DeepSeek-R1 MoE layer (hidden K = 7168, the gate+up projection cut to
N = 512 so the CPU handler finishes in seconds), the kv_a projection (576 x 7168) and MLA's absorbed
per-head product (h = 16, r = 512 -> d = 128). The weights are random, not a model.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_w4a8 import build_info, ffi_available, ops, quant


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _timed(fn, *args):
    jax.block_until_ready(fn(*args))  # compile
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, (time.perf_counter() - t) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64, help="routed rows (tokens x top-k)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    backend = jax.default_backend()
    print(f"jax {jax.__version__} on {backend}: {jax.devices()[0].device_kind}")
    info = build_info()
    for plat in ("cpu", "cuda"):
        st = ffi_available(plat)
        built = f", built from ffi sources {info[plat]['source_sha256'][:12]}" if st else ""
        print(f"  FFI handlers for {plat}: {'yes' + built if st else 'no (' + st.reason + ')'}")
    if info["checkout"] and info["checkout"]["stale"]:
        print(f"  WARNING: {info['checkout']['ffi_dir']} has changed since the {info['checkout']['stale']} module(s) "
              "were built: rebuild (rerun ./scripts/test.sh; by hand: cmake --build build && "
              "cmake --install build)")
    rng = np.random.default_rng(args.seed)
    k, n, e, m = 7168, 512, args.experts, args.rows

    w_packed, w_scale = quant.quantize_w4(jnp.asarray(rng.standard_normal((e, n, k)) * 0.02, jnp.float32))
    x8, x_scale = quant.quantize_fp8_groups(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16))
    sizes = jnp.asarray(rng.multinomial(m, np.ones(e) / e), jnp.int32)
    gemm = jax.jit(ops.w4a8_grouped_gemm)
    out, ms = _timed(gemm, x8, x_scale, w_packed, w_scale, sizes)
    ref = ops.w4a8_grouped_gemm(x8, x_scale, w_packed, w_scale, sizes, impl="reference", out_dtype=jnp.float32)
    rows = [("w4a8_grouped_gemm", f"M={m} E={e} N={n} K={k}", ms, _rel(out, ref))]

    wq, wsb = quant.quantize_fp8_blocks(jnp.asarray(rng.standard_normal((576, k)) * 0.02, jnp.float32), ue8m0=True)
    x8b, xsb = quant.quantize_fp8_groups(jnp.asarray(rng.standard_normal((16, k)), jnp.float32), ue8m0=True)
    codes = (quant.encode_ue8m0(xsb), quant.encode_ue8m0(wsb))
    lin = jax.jit(lambda *a: ops.fp8_einsum("md,nd->mn", *a))
    out, ms = _timed(lin, x8b, codes[0], wq, codes[1])
    ref = ops.fp8_einsum("md,nd->mn", x8b, xsb, wq, wsb, impl="reference", out_dtype=jnp.float32)
    rows.append(("fp8_einsum md,nd->mn", "kv_a: M=16 N=576 K=7168 UE8M0", ms, _rel(out, ref)))

    wh, wsh = quant.quantize_fp8_blocks(jnp.asarray(rng.standard_normal((16, 128, 512)) * 0.05, jnp.float32))
    xh, xsh = quant.quantize_fp8_groups(jnp.asarray(rng.standard_normal((1, 16, 512)), jnp.float32))
    per_head = jax.jit(lambda *a: ops.fp8_einsum("bhr,hdr->bhd", *a))
    out, ms = _timed(per_head, xh, xsh, wh, wsh)
    ref = ops.fp8_einsum("bhr,hdr->bhd", xh, xsh, wh, wsh, impl="reference", out_dtype=jnp.float32)
    rows.append(("fp8_einsum bhr,hdr->bhd", "b=1 h=16 r=512 d=128 fp32 scales", ms, _rel(out, ref)))

    print(f"\n{'op':26s} {'shape':34s} {'ms':>8s} {'rel err vs reference':>22s}")
    ok = True
    for name, shape, ms, err in rows:
        good = np.isfinite(err) and err <= 4e-3
        ok &= good
        print(f"{name:26s} {shape:34s} {ms:8.2f} {err:22.2e}  {'ok' if good else 'FAIL'}")
    print("\nall outputs bf16, compared with the float32 reference on the same quantized operands")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
