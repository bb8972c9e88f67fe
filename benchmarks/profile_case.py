"""One named kernel case per process, for profilers (ncu, compute-sanitizer, nsys).

    ncu --clock-control none --kernel-name regex:HopperGemmKernel --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --section SpeedOfLight -f -o decode64 \\
        python benchmarks/profile_case.py decode64
    ncu --import decode64.ncu-rep --page source --print-source sass --csv > decode64.csv
    python benchmarks/ncu_summary.py decode64.csv

Every kernel of a call with its duration (the preparation kernels too: how the folding preparation's 58 us of a
530 us prefill call was found):

    ncu --clock-control none --metrics gpu__time_duration.sum python benchmarks/profile_case.py prefill4k_fold

Cases: top8_up1 / top8_down1 (a batch-1 decode step's grouped GEMMs at V3 widths: 8 rows, one on each of 8 of
256 experts; `--tile-tokens` / `--mma` / `--split-k` / `--kernel` force a plan, e.g. `--kernel decode`), decode64 (grouped gate+up, 32 experts, M = 64: the plan's 8-token f16 kernel under stream-K), down64
(the down projection, N = 7168, K = 2048, same kernel), decode512 / down512 (the same at M = 512: the plan's
32-token f16 kernel, whole tiles), fused64 / fused512 / fused1024 (ops.w4a8_moe_up on the same gate+up weights: the
fused 8- / 32- / 64-token f16 kernels), the einsum cases of EINSUM_CASES (DeepSeek-V3 linears and
MLA / V4 per-head products at one token: the decode kernels, Fp8DecodeKernel or Fp8DecodeStagedKernel, e.g.
o_proj1, 7168 x 16384; o_proj16 / o_proj32 and kv_a64 / square64: the TMA kernel), square4096 (einsum M = N = K = 7168 /
4096 tokens: the 192-token kernel), prefill4k_e4m3 / prefill4k_f16 / prefill16k_e4m3 / prefill16k_f16 (grouped
gate+up at M = 4096 / 16384 on the 128-token kernel, e4m3 or f16 MMA), down4k_e4m3 (the down projection at M = 4096
on the same kernel), prefill4k_fold / down4k_fold (the same two with UE8M0 activation scales: the folding e4m3
kernel, launched with the plain one, which exits: take `--launch-skip 2`), prefill16k_fold / down16k_fold (the
same at M = 16384: how much of the call the preparation's folding pass takes there), prefill16k_folded /
down16k_folded (the same calls on activations the quantizer folded, x_layout="folded": the folding kernel alone,
no preparation), quantize2k / quantize2k_folded (the quantizer of 2048 tokens, K = 7168, UE8M0: the gate+up input
of 16384 routed rows at top-8, standard or folded layout), silu16k / silu16k_folded (SiLU-mul and the quantizer of
16384 rows, I = 2048: the down projection's input). Each runs twice, or `--calls N` times (the first call
compiles), so `--launch-skip 1` takes the second launch.
"""

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax_w4a8 import ops, quant, tiling  # noqa: E402
from probe_kernels import _grouped_case  # noqa: E402

GROUPED_CASES = ("top8_up1", "top8_down1", "decode64", "down64", "decode512", "down512", "fused64", "fused512", "fused1024", "prefill4k_e4m3", "prefill4k_f16",
                 "prefill16k_e4m3", "prefill16k_f16", "down4k_e4m3", "prefill4k_fold", "down4k_fold", "prefill16k_fold",
                 "down16k_fold", "prefill16k_folded", "down16k_folded", "quantize2k", "quantize2k_folded", "silu16k",
                 "silu16k_folded")
# einsum cases: (equation, activation shape, weight shape); the decode kernels' (one token) first
EINSUM_CASES = {
    "absorb_o1": ("bhr,hdr->bhd", (1, 128, 512), (128, 128, 512)),  # MLA absorb_o, 128 heads
    "absorb_q1": ("bhr,hdr->bhd", (1, 128, 128), (128, 512, 128)),  # MLA absorb_q: 4096 tiles of one K group
    "wo_a1": ("bhr,hdr->bhd", (1, 16, 4096), (16, 1024, 4096)),  # DeepSeek-V4-Pro wo_a
    "q_a1": ("md,nd->mn", (1, 7168), (1536, 7168)),
    "kv_a1": ("md,nd->mn", (1, 7168), (576, 7168)),
    "qkv_a1": ("md,nd->mn", (1, 7168), (2112, 7168)),  # q_a and kv_a in one product (MLA.qkv_a_proj)
    "o_proj1": ("md,nd->mn", (1, 16384), (7168, 16384)),
    "o_proj16": ("md,nd->mn", (16, 16384), (7168, 16384)),
    "o_proj32": ("md,nd->mn", (32, 16384), (7168, 16384)),
    "square1": ("md,nd->mn", (1, 7168), (7168, 7168)),
    "q_b1": ("md,nd->mn", (1, 1536), (24576, 1536)),  # MLA q_b (128 heads x 192)
    "shared_up1": ("md,nd->mn", (1, 7168), (4096, 7168)),  # the shared expert's gate+up projection
    "shared_down1": ("md,nd->mn", (1, 2048), (7168, 2048)),  # the shared expert's down projection
    "mlp_up1": ("md,nd->mn", (1, 7168), (36864, 7168)),  # a dense layer's gate+up projection
    "kv_a64": ("md,nd->mn", (64, 7168), (576, 7168)),
    "square64": ("md,nd->mn", (64, 7168), (7168, 7168)),
    "square4096": ("md,nd->mn", (4096, 7168), (7168, 7168)),
}
CASES = GROUPED_CASES + tuple(EINSUM_CASES)


def _einsum_case(key, eq, x_shape, w_shape):
    x = jax.random.normal(key, x_shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
    w = jax.random.normal(jax.random.fold_in(key, 1), w_shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
    xs = jnp.ones(x_shape[:-1] + (x_shape[-1] // 128,), jnp.float32)
    ws = jnp.ones(w_shape[:-2] + (-(-w_shape[-2] // 128), w_shape[-1] // 128), jnp.float32)
    return jax.jit(lambda *a: ops.fp8_einsum(eq, *a)), (x, xs, w, ws)


def _top8_case(key, n, k, e=256, top_k=8):
    """One token routed to top_k of e experts (a batch-1 decode step's grouped GEMM): top_k rows, one per
    expert, the experts spread over the table; the other experts' weights are zeros (never read)."""
    busy = jnp.arange(top_k) * (e // top_k)
    x, xs, wb, wsb, _ = _grouped_case(key, top_k, n, k, 0, e=top_k)
    w = jnp.zeros((e, n, k // 2), jnp.int8).at[busy].set(wb)
    ws = jnp.full((e, n, k // 128), 0.01, jnp.float32).at[busy].set(wsb)
    sizes = jnp.zeros((e,), jnp.int32).at[busy].set(1)
    return x, xs, w, ws, sizes


def build(case, key, tile_tokens=None, mma=None, kernel=None):
    grouped = functools.partial(ops.w4a8_grouped_gemm, tile_tokens=tile_tokens, mma=mma, kernel=kernel)
    if case in ("top8_up1", "top8_down1"):  # V3 batch 1: 8 rows over 8 of 256 experts
        n, k = (4096, 7168) if case == "top8_up1" else (7168, 2048)
        return jax.jit(grouped), _top8_case(key, n, k)
    if case == "decode64":  # probe_kernels.py's grouped case: 32 experts, gate+up N = 4096, K = 7168
        return jax.jit(grouped), _grouped_case(key, 64, 4096, 7168, 0)
    if case == "down64":
        return jax.jit(grouped), _grouped_case(key, 64, 7168, 2048, 0)
    if case == "decode512":
        return jax.jit(grouped), _grouped_case(key, 512, 4096, 7168, 0)
    if case == "down512":
        return jax.jit(grouped), _grouped_case(key, 512, 7168, 2048, 0)
    if case in ("fused64", "fused512", "fused1024"):  # the fused up-projection on the gate+up weights (I = 2048)
        return jax.jit(ops.w4a8_moe_up), _grouped_case(key, int(case[5:]), 4096, 7168, 0)
    if case in ("down4k_e4m3", "prefill4k_fold", "down4k_fold", "prefill16k_fold", "down16k_fold"):
        # the 128-token e4m3 kernel; fold: UE8M0 scales
        f = functools.partial(ops.w4a8_grouped_gemm, tile_tokens=128, mma="e4m3")
        m = 16384 if "16k" in case else 4096
        x, xs, w, ws, gs = _grouped_case(key, m, 4096 if case.startswith("prefill") else 7168,
                                         7168 if case.startswith("prefill") else 2048, 0)
        return jax.jit(f), (x, quant.ceil_to_ue8m0(xs) if case.endswith("fold") else xs, w, ws, gs)
    if case in ("prefill16k_folded", "down16k_folded"):  # the caller's folded activations: no preparation
        n, k = (4096, 7168) if case.startswith("prefill") else (7168, 2048)
        x, xs, w, ws, gs = _grouped_case(key, 16384, n, k, 0)
        xf, tok = quant.fold_fp8_groups(x, quant.ceil_to_ue8m0(xs))
        return jax.jit(functools.partial(ops.w4a8_grouped_gemm, x_layout="folded")), (xf, tok, w, ws, gs)
    if case.startswith(("quantize2k", "silu16k")):  # the quantizers of a prefill's gate+up and down inputs
        layout = "folded" if case.endswith("folded") else "standard"
        if case.startswith("quantize"):
            f, shape = functools.partial(ops.quantize_fp8_groups, ue8m0=True, layout=layout), (2048, 7168)
        else:
            f, shape = functools.partial(ops.silu_mul_quantize_fp8_groups, ue8m0=True, layout=layout), (16384, 4096)
        return jax.jit(f), (jax.random.normal(key, shape, jnp.bfloat16),)
    if case.startswith("prefill"):  # this library's 128-token grouped kernel (gate+up), either MMA format
        m = 4096 if case.startswith("prefill4k") else 16384
        f = functools.partial(ops.w4a8_grouped_gemm, tile_tokens=128, mma=case.rsplit("_", 1)[1])
        return jax.jit(f), _grouped_case(key, m, 4096, 7168, 0)
    return _einsum_case(key, *EINSUM_CASES[case])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=CASES)
    ap.add_argument("--calls", type=int, default=2, help="calls of the op (the first compiles); default 2")
    ap.add_argument("--tile-tokens", type=int, help="top8 / decode / down cases: force the grouped GEMM's token tile")
    ap.add_argument("--mma", choices=("e4m3", "f16"), help="top8 / decode / down cases: force the operand format")
    ap.add_argument("--kernel", choices=tiling.GROUPED_KERNELS, help="top8 / decode / down cases: force the kernel")
    ap.add_argument("--split-k", type=int, help="top8 cases: force the K split (1: whole tiles; more: stream-K)")
    args = ap.parse_args()
    if args.split_k is not None:  # ops.w4a8_grouped_gemm plans through tiling.plan_grouped_gemm
        tiling.plan_grouped_gemm = functools.partial(tiling.plan_grouped_gemm, split_k=args.split_k)
    f, a = build(args.case, jax.random.key(0), args.tile_tokens, args.mma, args.kernel)
    for _ in range(args.calls):
        jax.block_until_ready(f(*a))


if __name__ == "__main__":
    main()
