"""A small GPU case of every CUDA handler, for compute-sanitizer (not a pytest file).

    compute-sanitizer --tool memcheck --kernel-name kns=jax_w4a8 python tests/sanitizer_case.py
    compute-sanitizer --tool racecheck --racecheck-report hazard --kernel-name kns=jax_w4a8 python tests/sanitizer_case.py

Exercises edge tiles, padding rows, hostile group sizes and per-row / per-block scales; exits 1 if a
result is wrong, so the sanitizer run also checks values.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import np_ref  # noqa: E402
from jax_w4a8 import ops, quant  # noqa: E402


def _grouped_gemm_ok(args, mma, tok, covered, kernel=None) -> bool:
    """One grouped GEMM call through the CUDA handler: near float64, the rows from ``covered`` on zero."""
    out = jax.jit(lambda *a: ops.w4a8_grouped_gemm(*a, impl="ffi", mma=mma, tile_tokens=tok, kernel=kernel))(*args)
    out = np.asarray(out.astype(jnp.float32))
    return bool(np_ref.rel_err(out, np_ref.grouped_gemm(*args)) <= 4e-3 and (out[covered:] == 0).all())


def _quantizers_ok(rng) -> bool:
    """The quantizer kernels against the jnp references, at test_quantize_fp8_groups.py's GPU tolerances."""
    ok = True
    v = jnp.asarray(rng.standard_normal((7, 384)), jnp.bfloat16)
    q8, qs = jax.jit(lambda v: ops.quantize_fp8_groups(v, ue8m0=True, impl="ffi"))(v)
    r8, rs = jax.jit(lambda v: quant.quantize_fp8_groups(v, ue8m0=True))(v)  # jitted: cached for the sanitized runs
    ok &= q8.shape == (7, 384) and qs.shape == (7, 3)
    ok &= bool(np.allclose(np.asarray(qs), np.asarray(rs), rtol=3e-7, atol=0))
    ok &= bool((np.asarray(q8).view(np.uint8) == np.asarray(r8).view(np.uint8)).all())  # UE8M0: exact division
    for dtype in (jnp.bfloat16, jnp.float32):  # [gate, up] of 7 rows x 2 x 256: the silu_mul kernels
        v = jnp.asarray(rng.standard_normal((7, 512)), dtype)
        g8, gs = jax.jit(lambda v: ops.silu_mul_quantize_fp8_groups(v, ue8m0=True, impl="ffi"))(v)
        r8, rs = jax.jit(lambda v: ops.silu_mul_quantize_fp8_groups(v, ue8m0=True, impl="reference"))(v)
        ok &= g8.shape == (7, 256) and gs.shape == (7, 2)
        ok &= bool(np.allclose(np.asarray(gs), np.asarray(rs), rtol=2e-6, atol=0))
        ok &= bool(np.mean(np.asarray(g8).view(np.uint8) == np.asarray(r8).view(np.uint8)) > 0.995)
    return bool(ok)


def main() -> int:
    rng = np.random.default_rng(0)
    ok = True
    w, ws = quant.quantize_w4(rng.standard_normal((3, 70, 256)).astype(np.float32))
    x = rng.standard_normal((45, 256)).astype(np.float32)
    x8, xs = quant.quantize_fp8_groups(x)
    x8u, xsu = quant.quantize_fp8_groups(x * np.repeat([[1.0, 2.0**-5]], 128, axis=1), ue8m0=True)
    for sizes in ([10, 0, 30], [-4, 2**31 - 1, 9], [0, 0, 0]):
        # both tensor-core operand formats (f16: x converted once per call), and the f16 tiles of 8 (mma.sync),
        # 64 (two groups in flight) and 128 tokens (one, the warpgroups taking turns); e4m3 at 128 tokens with
        # float32 scales (not folded) and power-of-two ones (folded into the codes)
        for mma, tok, folded in (("e4m3", None, False), ("f16", None, False), ("f16", 8, False),
                                 ("f16", 64, False), ("f16", 128, False), ("e4m3", 128, False), ("e4m3", 128, True)):
            args = (x8u, xsu) if folded else (x8, xs)
            args += (w, ws, jnp.asarray(sizes, jnp.int32))
            ok &= _grouped_gemm_ok(args, mma, tok, covered=min(sum(max(v, 0) for v in sizes), 45))
        # the decode kernel: units of at most 8 or 16 rows found from group_sizes on the device, 70 rows (a
        # partial 16-row tile), split K over a block's warps (two K groups)
        for unit_rows in (8, 16):
            ok &= _grouped_gemm_ok((x8, xs, w, ws, jnp.asarray(sizes, jnp.int32)), None, unit_rows,
                                   covered=min(sum(max(v, 0) for v in sizes), 45), kernel="decode")
    # the decode kernel split K over a cluster of 4 blocks (16 K groups, 4 units bound: 8 tiles of 16 rows), rows 24
    # (a partial tile), an expert with more than 8 rows (two 8-row units; one 16-row unit), one with more than 16
    wd, wsd = quant.quantize_w4(rng.standard_normal((3, 24, 2048)).astype(np.float32))
    xd8, xsd = quant.quantize_fp8_groups(rng.standard_normal((32, 2048)).astype(np.float32))
    for unit_rows in (8, 16):
        ok &= _grouped_gemm_ok((xd8, xsd, wd, wsd, jnp.asarray([3, 9, 20], jnp.int32)), None, unit_rows, covered=32,
                               kernel="decode")
    # the wgmma kernels' staged epilogue (N a multiple of 8; token multipliers through the staging rows' padding
    # at 128-token e4m3 folded and 64 / 128-token f16 tiles): whole and partial units, a feature tile past F's
    # first 64-feature half; e4m3 plain and folded
    wb, wsb = quant.quantize_w4(rng.standard_normal((3, 136, 256)).astype(np.float32))
    xb = rng.standard_normal((300, 256)).astype(np.float32)
    for mma, tok in (("e4m3", 128), ("f16", 64), ("f16", 128)):
        for xb8, xbs in (quant.quantize_fp8_groups(xb), quant.quantize_fp8_groups(xb, ue8m0=True)):
            ok &= _grouped_gemm_ok((xb8, xbs, wb, wsb, jnp.asarray([150, 5, 140], jnp.int32)), mma, tok, covered=295)
    # one per-tensor scale at 128-token e4m3 (the preparation reorders the codes for the folding kernel), K groups
    # not a multiple of the preparation's four per warp step
    wc, wsc = quant.quantize_w4(rng.standard_normal((3, 136, 640)).astype(np.float32))
    xc = rng.standard_normal((300, 640)).astype(np.float32)
    xc_t = jnp.asarray(np.abs(xc).max() / 448, jnp.float32)
    ok &= _grouped_gemm_ok((quant.quantize_fp8_tensor(xc, xc_t), xc_t, wc, wsc, jnp.asarray([150, 5, 140], jnp.int32)),
                           "e4m3", 128, covered=295)
    for n, scales in ((200, "block"), (1, "row"), (576, "block")):
        wf = rng.standard_normal((n, 384)).astype(np.float32)
        w8, sw = quant.quantize_fp8_blocks(wf) if scales == "block" else quant.quantize_fp8_groups(wf)
        a8, sa = quant.quantize_fp8_groups(rng.standard_normal((17, 384)).astype(np.float32), ue8m0=True)
        out = jax.jit(lambda *a: ops.fp8_einsum("md,nd->mn", *a, impl="ffi"))(a8, quant.encode_ue8m0(sa), w8, sw)
        ref = np_ref.fp8_einsum_mhk(a8[:, None], sa[:, None], w8[None], sw[None])[:, 0]
        ok &= np_ref.rel_err(np.asarray(out.astype(jnp.float32)), ref) <= 4e-3
    # 128- and 192-token tiles, tokens on the A side: stream-K, then not (partial last tiles)
    for m, n, tok in ((150, 257, 128), (1300, 1153, 128), (150, 257, 192), (2000, 1153, 192)):
        w8, sw = quant.quantize_fp8_blocks(rng.standard_normal((n, 256)).astype(np.float32))
        a8, sa = quant.quantize_fp8_groups(rng.standard_normal((m, 256)).astype(np.float32))
        out = jax.jit(lambda *a, tok=tok: ops.fp8_einsum("md,nd->mn", *a, impl="ffi", tile_tokens=tok))(a8, sa, w8, sw)
        ref = np_ref.fp8_einsum_mhk(a8[:, None], sa[:, None], w8[None], sw[None])[:, 0]
        ok &= np_ref.rel_err(np.asarray(out.astype(jnp.float32)), ref) <= 4e-3
    # the decode kernel (tile 8): split K over a cluster (576 rows), partial row tiles, 2 and 4 token
    # tiles, and whole tiles per warp (128 heads, one K group); the staged kernel (on 132 SMs: 199 tiles, the
    # last of 2 rows, a cluster of 2, 8 K groups per warp in shared-memory stages)
    for m, h, n, k in ((1, 1, 576, 2048), (5, 3, 130, 384), (11, 2, 40, 256), (27, 1, 33, 640), (1, 128, 512, 128),
                       (3, 1, 3170, 8192)):
        wf = rng.standard_normal((h, n, k)).astype(np.float32)
        w8, sw = quant.quantize_fp8_blocks(wf)
        a8, sa = quant.quantize_fp8_groups(rng.standard_normal((m, h, k)).astype(np.float32), ue8m0=True)
        out = jax.jit(lambda *a: ops.fp8_einsum("bhr,hdr->bhd", *a, impl="ffi", tile_tokens=8))(
            a8, quant.encode_ue8m0(sa), w8, sw)
        ok &= np_ref.rel_err(np.asarray(out.astype(jnp.float32)), np_ref.fp8_einsum_mhk(a8, sa, w8, sw)) <= 4e-3
    # CUTLASS's blockwise kernel (batch mode over heads, partial tiles in M and N, UE8M0 codes and float32)
    for m, h, n, k, codes in ((150, 1, 264, 256, True), (300, 3, 576, 384, False), (1, 1, 8, 128, True)):
        w8, sw = quant.quantize_fp8_blocks(rng.standard_normal((h, n, k)).astype(np.float32), ue8m0=codes)
        a8, sa = quant.quantize_fp8_groups(rng.standard_normal((m, h, k)).astype(np.float32), ue8m0=codes)
        enc = quant.encode_ue8m0 if codes else (lambda v: v)
        out = jax.jit(lambda *a: ops.fp8_einsum("bhr,hdr->bhd", *a, impl="ffi", kernel="cutlass"))(
            a8, enc(sa), w8, enc(sw))
        ok &= np_ref.rel_err(np.asarray(out.astype(jnp.float32)), np_ref.fp8_einsum_mhk(a8, sa, w8, sw)) <= 4e-3
    # the grouped GEMM's CUTLASS path: hostile sizes, an empty call, bf16 weight scales, per-token x_scale, chunks
    from jax_w4a8 import tiling
    w, ws = quant.quantize_w4(rng.standard_normal((3, 72, 256)).astype(np.float32))
    for sizes, chunk_bytes in (([10, 0, 30], 1 << 30), ([-4, 2**31 - 1, 9], 72 * 256), ([0, 0, 0], 1 << 30)):
        tiling.CUTLASS_WEIGHT_SCRATCH_BYTES = chunk_bytes  # 72 * 256: one expert per conversion
        for xsc, wsc in ((xs, ws), (jnp.asarray(rng.uniform(0.5, 1.5, 45), jnp.float32), ws.astype(jnp.bfloat16))):
            args = (x8, xsc, w, wsc, jnp.asarray(sizes, jnp.int32))
            out = jax.jit(lambda *a: ops.w4a8_grouped_gemm(*a, impl="ffi", kernel="cutlass"))(*args)
            ok &= np_ref.rel_err(np.asarray(out.astype(jnp.float32)), np_ref.grouped_gemm(*args)) <= 4e-3
            covered = min(sum(max(v, 0) for v in sizes), 45)
            ok &= bool((np.asarray(out.astype(jnp.float32))[covered:] == 0).all())
    tiling.CUTLASS_WEIGHT_SCRATCH_BYTES = 1 << 30
    # the fused up-projection (I = 128), both MMA formats; one reference (eager ops are slow under a sanitizer)
    w13, s13 = quant.quantize_w4(rng.standard_normal((3, 256, 256)).astype(np.float32))
    args = (x8, xs, w13, s13, jnp.asarray([10, 0, 30], jnp.int32))
    r8 = np.asarray(jax.jit(lambda *a: ops.w4a8_moe_up(*a, impl="reference")[0])(*args)).view(np.uint8)
    for tok, mma in ((16, "e4m3"), (64, "e4m3"), (8, "f16"), (16, "f16"), (32, "f16"), (64, "f16")):
        h8, hs = jax.jit(lambda *a, tok=tok, mma=mma: ops.w4a8_moe_up(*a, tile_tokens=tok, mma=mma))(*args)
        ok &= np.mean(np.asarray(h8).view(np.uint8) == r8) > 0.97
    ok &= _quantizers_ok(rng)
    codes = jax.jit(lambda s: ops.pack_ue8m0(s, impl="ffi"))(jnp.array([1.0, 0.5, 8.0], jnp.float32))
    ok &= np.asarray(codes).tolist() == [127, 126, 130]
    print("sanitizer case:", "ok" if ok else "WRONG RESULTS")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
