"""How the CUDA handlers cut a GEMM into tensor-core tiles: chosen from static shapes plus an
optional hint of expected rows per expert, never from device data (so no host sync and no
recompilation when ``group_sizes`` change).

The Hopper kernel (``ffi/cuda/hopper_gemm.cu``) runs "swap AB": 128 weight rows (two warpgroups of
64) on the wide side of the MMA and ``tile_tokens`` activation rows on the narrow side, one 128-wide K
group per pipeline stage. One exception: the block-scaled einsum (one weight scale per 128 rows) at
128- and 192-token tiles puts the tokens on the MMA's A side (64 per consumer warpgroup, so two or
three of them) and the 128 weight rows on its N side, which makes the per-group promotion two scale
products and one FMA per accumulator. The grouped GEMM's unfused f16 tiles of 8, 16 and 32 tokens run 256
weight rows per block instead (four consumer warpgroups, one block per SM) wherever the plan takes whole units
(``split_k`` 1) and N is a multiple of 256: each f16 activation tile (2 bytes per K and token) then serves
twice the weight rows, and at 32 tokens those activation bytes equal the int4 weight tile's (0.5 byte per K and
row). H200, timing loop, 32 experts: gate+up M = 256 / 512 0.87x / 0.93x the time of two 128-row blocks, down
0.90x / 0.94x (forty-fourth session; the 8-token tile since the forty-fifth: H100 down M = 64 0.69x, batch-1
down 0.93x, within the run's spread). The plan counts units of 128 rows either way (a 256-row block is two of
them, one block per SM holds as many rows as two blocks of 128). The heuristic:

* ``tile_tokens``: the smallest of 16, 32, 64, 128 (the grouped GEMM: 8, 16, 32, 64, 128; the fused
  up-projection: 8, 16, 32, 64; 8 only with the f16 MMA, so ``mma="e4m3"`` never gets it) that holds
  the rows of one batch: all M rows of a head of the einsum, or for the
  grouped GEMM the expected rows of an expert plus two standard deviations of routing spread
  (``r + 2 sqrt(r)``, Poisson-like). The 8-token tile exists for int4 weights with the f16 MMA
  (warp-level ``mma.sync m16n8k16``): at about 2-4 rows per expert it loads half the activation bytes of a
  16-token tile per 128 weight rows. H200, bench_grouped_gemm.py's run, 32 experts, M = 64: gate+up 149.8 us
  (73% of copy bandwidth) vs 175 at 16 tokens, down 98.5 vs 112 (eighteenth session; seventeenth, on the n8
  wgmma: 158.9 vs 170, 94.0 vs 110); the seventeenth session's six probe runs (same process each), us, 8
  vs 16 tokens: gate+up M = 64 158-161 vs 167-182 in five, 181 vs 178-180 in one; M = 128 176 vs 204 and
  211 vs 201-211; down M = 64 96-103 vs 105-109; M = 128 107 vs 110 and 110 vs 117-135. Three blocks
  per SM at 8 tokens (72-register consumers) spilled in the main loop and lost (gate+up / down M = 64
  204 / 128 vs 181 / 100 us). An expert whose rows overflow
  the tile gets a second token tile, which reads all of its weights again: at decode that costs
  far more than a wider MMA (16 rows per expert: tile 32, not 16). Prefill uses 128 for arithmetic
  intensity; the block-scaled einsum uses 192 from M = 2048 where that pads M by at most 10% more
  than 128 would. H200, same run, M = 2048 / 4096 / 16384, 192 vs 128-token tiles: q_a
  1.16x / 1.22x / 1.10x, o_proj 1.03x / 1.03x / 1.08x, dense MLP up 1.06x / 1.03x / 1.04x, q_b
  1.10x / 1.06x / 0.98x, square 7168 0.98x / 1.00x / 1.00x, kv_a 1.24x / 0.93x / 0.98x; at M = 256
  .. 1024, where 192 pads more, it loses up to 0.62x.
* ``split_k``: when the expected units of work (batches with rows x token tiles x 128-row weight
  tiles; at batch-1 decode only ~top-k experts of the grouped GEMM have rows) do not fill the
  resident blocks (two per SM at token tiles <= 32, else one), or, for the einsum (whose units are
  known exactly), when its waves would keep less than three quarters of the blocks busy on average, the
  kernel runs stream-K: the (unit, K group) iterations are dealt out in equal contiguous ranges, one
  per resident block, so every block streams the same number of K groups whatever the tile count. Not where
  whole units of 256 rows (the f16 8- to 32-token tiles, N a multiple of 256) make one wave that fills at least
  90% of the SMs, as a batch-1 DeepSeek-V3 gate+up does (8 experts x 16 units on 132 SMs; ``_one_wide_wave``).
  ``split_k`` is then the number of pieces an average tile is cut into (any value above 1 selects
  stream-K in the kernel). A piece that is not a whole tile stores its float32 partial sums in a
  slot of its block (two per block) and counts its K groups on the tile's counter (one per consumer
  warp); the warp whose count completes the tile adds the tile's slots in block order and rounds
  once. That order is fixed, so split-K outputs are bitwise the same from run to run (they differ
  from the ``split_k == 1`` plan's in float32 summation order only). The einsum cuts a tile into
  at most 8 pieces (the grid is cut to 8 blocks per tile): the completing warp waits for one L2 round
  trip per piece. H200, same run (two rounds), us, up to 53 pieces vs at most 16 / 8 / 4: kv_a
  (N 576, K 7168) at 1 token 19-21 vs 12-14 / 12-13 / 14-16, at 64 tokens 29-30 vs 21-22 / 19 / 20;
  q_a (N 1536) at 1 token 17-18 vs 15 / 13 / 14, at 64 tokens 20-22 vs 20-23 / 18-20 / 21. The
  grouped GEMM also runs stream-K when under 90% of the experts are expected to have rows (rows per
  expert about 2 or fewer): which units exist is only known on the device, and dealing whole units left the last of
  about 3.3 waves of units 30% full. H200, same run, 32 experts, 64 rows: gate+up 234 -> 211 us,
  down 141 -> 129 us; at 256 rows (every expert busy, no stream-K) forcing it gave gate+up
  255 -> 244 but down 133 -> 152, and from 512 rows it lost 10-60%. Only for deep tiles, though (at least
  ``_SPARSE_MIN_GROUPS`` K groups): a split tile costs a fix-up (partial sums stored, counted, summed by the
  completing warp) that a shallow tile does not repay. H200, same process, two rounds, us, 32 experts,
  8-token tiles, stream-K vs whole tiles: down (K = 2048, 16 groups) at 16 / 32 / 64 rows 56, 57 / 79, 78 /
  94, 91 vs 53, 49 / 68, 70 / 87, 84; gate+up (K = 7168, 56 groups) 85, 81 / 124, 126 / 150, 150 vs 89, 86 /
  126, 126 / 162, 176.
* ``mma`` (int4 weights, grouped GEMM and fused up-projection): the tensor-core operand format.
  ``"e4m3"``: the int4 codes become e4m3 in registers and meet the fp8 activations in an fp8 MMA.
  ``"f16"`` (grouped GEMM: token tiles 8 to 128; fused up-projection: 8 to 64): the codes become f16 (five
  integer and four f16 instructions per eight codes instead of
  fourteen integer ones; at decode the integer pipe is the limit) and meet the activations as f16,
  converted once per call by the scale-preparation kernel into the scratch (2 M K bytes, in the K
  order of the weight fragments) and loaded by TMA like the e4m3 tiles; an f16 MMA with float32
  accumulation. Both are exact (int4 and e4m3 values are f16 values, products exact in float32). The
  plans take f16 at the 8- to 32-token tiles, the fused up-projection's too (H200, same run, gate+up M = 512:
  fused f16 268 us, fused e4m3 327, unfused GEMM + SiLU-mul + quantize 284; skewed routing 379 / 474
  / 345). H200, same runs (two rounds, one process per build), us, f16 with the
  once-per-call conversion vs the former per-stage conversion by three producer warps: 16-token tiles
  gate+up 64 / 256 rows 170, 164 / 197, 199 vs 198, 183 / 222, 226; down 104, 113 / 127, 115 vs 119,
  123 / 126, 129; 32-token tiles at 512 rows gate+up 262, 255 vs 316, 312 and down 148, 148 vs 184,
  188, where e4m3 took 304, 296 (gate+up) and 180, 171 (down).
  The grouped GEMM plan also takes f16 at 64-token tiles (one block per SM, two groups in flight per
  warpgroup), and takes that tile instead of 128 up to ``_F16_HALF_TILE_ROWS`` (64) expected rows per
  expert. H200, same process, 32 experts, us, best of two rounds, f16 at 64 tokens vs e4m3 at 64 / 128
  tokens: gate+up M = 1024 295 vs 371 / -, 1536 292-299 vs - / 439, 2048 429-444 vs 558 / 447-451; down
  190 vs 227-238 / -, 184-189 vs - / 287, 259-269 vs 324 / 282-303. From 80 rows per expert the 128-token
  e4m3 tile wins (M = 2560 / 3072: gate+up 451 / 457 vs f16 at 64 tokens 559 / 559, down 283 / 291-294 vs
  349 / 366). f16 at 128-token tiles (one group in flight, the warpgroups taking turns) does not pay:
  gate+up M = 4096 665-678 vs e4m3 640-648 us, M = 16384 2174 vs 1912 (down 1260 vs 1197); ``ncu`` at 16384
  rows puts its tensor pipe at 67% busy with both warpgroups' MMA waits the top stall (29%), and in the
  timed loop it runs 20% slower than a single launch (2.17 vs 1.79 ms: the f16 MMA at that duty draws the
  clock down), where e4m3 loses 4% (1.91 vs 1.84).
  The e4m3 128-token tile folds the activation scales into the e4m3 codes where each token's group scales
  differ by powers of two (UE8M0; per-token and per-tensor scales), so that its promotion per K group is
  one FFMA per accumulator (554 instead of 750 main-loop instructions per two groups); the scratch then also
  holds the token multipliers, a flag and the folded codes (M K bytes), and a call whose scales cannot be
  folded runs the unfolded kernel (``hopper_gemm.cu`` FoldTokenActivations). H200, us, gate+up / down,
  same-day processes, main's unfolded kernel vs folded: M = 4096 UE8M0 637-645 / 419-429 vs 593-603 /
  429-434, per tensor 624-634 / 418-424 vs 577-591 / 422-430; M = 16384 UE8M0 1870-1894 / 1171-1181 vs
  1777-1780 / 1168, per tensor 1882-1894 / 1166-1174 vs 1685-1709 / 1129-1139; float32 group scales (not
  folded) 631-643 / 412-419 vs 642-661 / 429-446 and 1871-1892 / 1171-1174 vs 1894-1903 / 1177-1216. At
  16384 rows CUTLASS stayed ahead then (1641-1709 us gate+up, 893-910 down, same processes).
  The 64-feature tiles' bf16 output goes through shared memory (stmatrix) and 16-byte row stores, eight
  threads per token row; each token's multiplier is loaded before the K loop (one register) and read back
  from the staging row's padding (loaded after the loop, it cost ~2900 cycles per unit, 11%). H200, us,
  M = 4096 UE8M0 gate+up / down: row bulk copies and late multipliers 563-573 / 367-369, 16-byte stores
  551-554 / 349-352, both 546 / 326-333.
* ``tile_tokens=8`` (einsum only, at most 32 tokens; the plan's choice up to 8): the decode kernel
  (``ffi/cuda/fp8_decode_gemm.cu``): warp-level fp8 MMAs (16 weight rows x 8-token tiles) fed straight
  from global memory, or, at one token tile where each warp has at least 8 K groups, through per-warp
  shared-memory stages that cp.async fills in 256-byte row runs (H200, kernel alone under ncu: o_proj
  38.7 -> 33.2 us, the dense MLP's 36864 x 7168 84.2 -> 71.7, V4 wo_a 23.7 -> 21.6); the K groups split
  over the warps of a block and a cluster of up to 8 blocks, partial sums added in a fixed order through
  shared and distributed shared memory. One launch, no
  scratch, no scale preparation: the TMA kernel's fixed costs (a preparation launch, block prologue,
  stream-K fix-up) dominate one-token calls. H200, same process, us at 1 / 8 tokens, this kernel vs
  the 16-token TMA plan: kv_a 10.3 / 12.9 vs 18.3 / 17.9, q_a 17.6 / 18.0 vs 18.3 / 24.8, o_proj
  48.4 / 47.3 vs 56.5 / 52.7, 7168 x 7168 33.2 / 27.4 vs 36.4 / 37.0, 7168 x 2048 12.5 / 14.5 vs
  18.3 / 24.7, MLA absorb_q 11.1 / 11.8 vs 17.6 / 12.3, absorb_o 14.3 / 16.9 vs 22.6 / 17.1, V4
  wo_a 38.7 / 36.5 vs 39.1 / 38.7. At 16 tokens it mostly lost (its MMA runs as f16 HMMA on
  sm_90, four times the instructions per weight byte at two token tiles): the plan stops at 8.
  Blocks have four warps, or two where four would need more warps than fit on the GPU at once and two
  fit (one wave): q_a 15.6 vs 19.6 us, MLA absorb_o 13.5 vs 15.4, V4 wo_a 31.5 vs 33.6 at one token.
* ``kernel="cutlass"`` (einsum, recipe (1, 128, 128), bfloat16 output, N a multiple of 8): CUTLASS 4.2's
  Hopper FP8 blockwise-scaled GEMM (``ffi/cuda/fp8_blockwise_cutlass.cu``; 128 x 128 x 128 tiles, tokens on
  the MMA's A side in two consumer warpgroups, no clusters (as fast as 1 x 2 multicast, and racecheck runs on
  it), a persistent scheduler, no split-K). The plan
  takes it from ``CUTLASS_MIN_TOKENS`` (128) rows per head when there are at least 32 output tiles (with
  fewer, this library's stream-K plans fill the GPU better). H200, same process, UE8M0 codes, this library's
  plan / CUTLASS time, M = 128 / 256 / 512 / 1024 / 2048 / 4096: square 7168 1.09 / 1.82 / 1.26 / 1.14 /
  1.43 / 1.32; o_proj 1.01 / 1.44 / 1.29 / 1.25 / 1.25 / 1.32; q_b 1.58 / 1.38 / 1.61 / 1.59 / 1.67 / 1.69;
  shared_down (7168 x 2048) 2.08 / 2.09 / 1.32 / 1.40 / 1.88 / 1.64; q_a (12 tile columns) 0.70 / 0.89 /
  1.24 / 1.67 / 1.02 / 1.13; kv_a (5 tile columns) 0.80 / 0.80 / 0.97 / 1.23 / 1.50 / 1.09; per head, b =
  256 / 512 / 1024 / 4096: MLA absorb_q 1.76 / 2.79 / 2.98 / 3.00, absorb_o 1.21 / 1.17 / 1.39 / 1.37, V4
  wo_a 1.16 / 1.26 / 1.40 / 1.32. At 64 rows (a half-empty 128-row tile) it wins only with a full wave
  of tiles and enough K per tile: V4 wo_a (128 tiles, K 4096) 1.09 and 1.42 (two runs; 36 us, 43% of copy
  bandwidth), MLA absorb_o (128 tiles, K 512) 1.24, but absorb_q (K 128) 0.78, and with 56 tiles o_proj
  0.88, square 0.98, q_a (12 tiles) 0.76; so from 64 rows the plan asks for 128 tiles and K >= 512.
  At M = 4096, N = K = 7168 it runs 1101-1300 TFLOP/s, about XLA's per-tensor fp8 GEMM.
* ``kernel="cutlass"`` (grouped GEMM, bfloat16 output, N a multiple of 8; ``ffi/cuda/w4a8_grouped_cutlass.cu``):
  the int4 weights of the experts that have rows become e4m3 once per call (exact; 3.8 TB/s, a plain copy's
  speed), then CUTLASS 4.2's Hopper grouped FP8 GEMM with per-row scales on both sides runs every expert in
  one persistent launch (128 x 128 x 128 tiles, problem sizes and pointers written on the device from
  ``group_sizes``). The conversion costs a fixed ~370 us for 32 experts of gate+up (4096 x 7168) and reads
  twice the weight bytes back, so it pays only where the GEMM is long: from 576 expected rows per expert.
  H200, same process, 32 experts, UE8M0 activation scales, this library's kernel / CUTLASS time, M = 8192 /
  16384 / 20480 / 24576 / 32768 (rows per expert M / 32): gate+up 0.81 / 0.96 / 1.04 / 1.04 / 1.09; down
  (K 2048) 0.79 / 0.98 / 1.04 / 1.08 / 1.15 (before the staged epilogue the crossover was at 384 rows for
  gate+up, 256 for down). The converted weights live in the call's scratch, ``CUTLASS_WEIGHT_SCRATCH_BYTES``
  (1 GiB) at a time: more experts than fit run in chunks of a conversion and a GEMM each.
* ``kernel="decode"`` (grouped GEMM, opt-in; ``ffi/cuda/w4a8_decode_gemm.cu``): for a few rows per expert,
  e.g. a batch-1 decode step's 8 rows on 8 of 256 experts. Runs of at most ``tile_tokens`` (8 or 16) rows of one
  expert are the units; the grid provides for :func:`decode_unit_bound` of them and each block finds its unit
  from ``group_sizes`` on the device. Each warp owns 16 weight rows, reads their int4 codes and the unit's
  activations straight from global memory (no preparation kernel, no scratch, one launch), converts both to
  f16 exactly and runs ``mma.sync`` m16n8k16 (one or two 8-token tiles per converted weight fragment); the K
  groups split over the block's warps and a cluster of blocks as in the einsum's decode kernel. 16-row units
  read and convert the weights of an expert with 9 to 16 rows once instead of twice (the benchmark's 256 and
  512 rows over 32 experts), at 157 registers and three K groups in flight; the plan's default is 16 where an
  expert's expected rows plus two standard deviations pass 8. Motivation (H200, ``ncu``, the plan's kernel): the batch-1 step's gate+up reads its 117 MB
  in 50.6-52.3 us plus a 4.2 us preparation (2.2 TB/s), its down projection 59 MB in 32.3 + 3.0 us, where the
  einsum's decode kernel reads o_proj's 117 MB in 32.9 us. Timed on an H100 (2026-12-05, timing loop,
  ``benchmarks/experiments/grouped_decode_ab.py``; correct there: its GPU tests and memcheck pass) it is slower
  than the plan everywhere, so the plan never chooses it; us, plan / 8-row units / 16-row units: batch-1 top-8
  gate+up 74.9 / 83.9 / 117.2, down 45.0 / 58.5 / 85.4; 64 rows over 32 experts 202.4 / 275.8 / 350.2 and
  101.9 / 150.7 / 228.8; 512 rows 252.9 / 632.2 / 540.4 and 136.1 / 394.3 / 388.2. Under ``ncu`` (512 rows,
  16-row units) its DRAM throughput is 34% of peak at 3 blocks (12 warps) per SM: too few loads in flight.
* ``tile_tokens=0`` selects the plain CUDA-core kernel (a correctness reference; always available).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

__all__ = ["GemmPlan", "plan_grouped_gemm", "plan_moe_up", "plan_fp8_einsum", "TILE_TOKENS", "EINSUM_TILE_TOKENS",
           "GROUPED_TILE_TOKENS", "F16_TILE_TOKENS", "FUSED_F16_TILE_TOKENS",
           "DECODE_MAX_TOKENS", "MMAS", "EINSUM_KERNELS", "CUTLASS_MIN_TOKENS", "FUSED_UP_MAX_ROWS", "moe_up_fuses",
           "folds_activations", "grouped_gemm_layout"]

TILE_TOKENS = (16, 32, 64, 128)
GROUPED_TILE_TOKENS = (8,) + TILE_TOKENS  # 8: int4 weights with the f16 MMA only
F16_TILE_TOKENS = (8, 16, 32, 64)  # the grouped GEMM plan's f16-MMA tiles (H200: module docstring)
FUSED_F16_TILE_TOKENS = (8, 16, 32, 64)  # the fused up-projection's f16 tiles (the grouped GEMM runs f16 at all of its)
_F16_HALF_TILE_ROWS = 64  # the grouped plan takes 64-token f16 tiles over 128-token e4m3 ones up to this many
# expected rows per expert (H200: module docstring)
# ops.w4a8_moe_up runs its fused kernel up to this many expected rows per expert, the composed ops above (H200:
# see plan_moe_up).
FUSED_UP_MAX_ROWS = 64
EINSUM_TILE_TOKENS = (8,) + TILE_TOKENS + (192,)  # 8: the einsum's decode kernel; 192: block-scaled only
DECODE_MAX_TOKENS = 32  # tile_tokens 8 (ffi/cuda/fp8_decode_gemm.cuh kDecodeMaxTokens)
_DECODE_TOKENS = 8  # the einsum plan takes the decode kernel up to this many tokens (H200: see docstring)
_FEAT_TILE = 128
_COUNTER_SLOTS = 12  # stream-K piece counters per unit: 3 consumer warpgroups x 4 warps
_DEFAULT_SMS = 132  # H100 / H200 SXM
_MAX_PIECES = 8  # einsum stream-K: pieces per tile at most (H200: see module docstring)
_SPARSE_BUSY = 0.9  # stream-K below this expected fraction of experts with rows (H200: see module docstring)
_SPARSE_MIN_GROUPS = 32  # ... for tiles of at least this many K groups (H200: see module docstring)
EINSUM_KERNELS = ("native", "cutlass", "cublas")  # index = the fp8 einsum handler's `kernel` attribute
CUTLASS_MIN_TOKENS = 128  # the einsum plan takes CUTLASS's blockwise kernel from this many rows per head
_CUTLASS_MIN_TILES = 32  # ... and this many 128 x 128 output tiles (it runs no split-K; H200: see docstring)
_CUTLASS_WAVE_TILES = 128  # from 64 rows per head: with a full wave of tiles and K >= 512 (H200: see docstring)


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """Static launch plan of one CUDA GEMM call (what the benchmark prints)."""

    tile_tokens: int  # 0 (simple kernel), 8 (einsum: its decode kernel; int4: the f16 MMA's 8-token tile), 16, 32,
    # 64, 128 or (block-scaled einsum) 192
    split_k: int
    scratch_bytes: int  # activation scales [G, H, ceil4(M)] f32 (+ f16 activations with mma "f16"; + token
    # multipliers, flag and folded codes at e4m3 128-token tiles; + split-K piece counters and partial tiles)
    units: int  # expected units of work
    mma: str = "e4m3"  # int4 weights: "e4m3" or "f16" tensor-core operands
    kernel: str = "native"  # "native" (this library's kernels, by tile_tokens), "cutlass", "cublas" (the einsum's,
    # opt-in) or "decode"; the fused up-projection's plan: "fused" (its CUDA kernel, by tile_tokens) or "unfused"
    experts_per_chunk: int = 0  # grouped GEMM on CUTLASS: experts whose e4m3 weights share the scratch


def _num_sms() -> int:
    try:
        dev = jax.devices("gpu")[0]
        return int(getattr(dev, "core_count", 0)) or _DEFAULT_SMS
    except RuntimeError:
        return _DEFAULT_SMS


def _tile_for(rows: float, spread: bool, tiles: tuple[int, ...] = TILE_TOKENS) -> int:
    need = rows + 2.0 * math.sqrt(rows) if spread else rows
    return next((t for t in tiles if need <= t), tiles[-1])


def _blocks_per_sm(tile_tokens: int) -> int:
    """Resident blocks of the Hopper kernel per SM (``Occupancy`` in hopper_gemm.cu, unfused), in blocks of 128
    weight rows: the f16 8-, 16- and 32-token tiles of whole units run one 256-row block per SM instead, as many rows
    (module docstring); split-K, which sizes its scratch by this count, always runs the 128-row blocks."""
    return 2 if tile_tokens <= 32 else 1


def _plan(m: int, h: int, f: int, k: int, batches: int, rows: float, tile_tokens: int | None,
          num_sms: int | None, *, spread: bool = False, busy: float | None = None,
          exact: bool = False, allowed: tuple[int, ...] = TILE_TOKENS, split_k: int | None = None) -> GemmPlan:
    groups = k // 128
    if tile_tokens is None:
        tile_tokens = _tile_for(rows, spread, tuple(t for t in allowed if t <= 128))
    if tile_tokens not in (0,) + allowed:
        raise ValueError(f"argument 'tile_tokens' must be None, 0 or one of {allowed}, got {tile_tokens!r}")
    if tile_tokens == 0:
        return GemmPlan(0, 1, 0, 0)
    if num_sms is not None:
        _check_int("num_sms", num_sms, 1, "None or an int")
    slots = (num_sms or _num_sms()) * _blocks_per_sm(tile_tokens)
    busy = batches if busy is None else busy  # batches with rows (expected)
    units = batches * max(1, math.ceil(rows / tile_tokens)) * math.ceil(f / _FEAT_TILE)
    work = busy * max(1, math.ceil(rows / tile_tokens)) * math.ceil(f / _FEAT_TILE)
    out_bytes = m * h * f * 4  # float32 output size: stream-K is left to outputs of at most 64 MB (as measured)
    ragged_wave = exact and work > 0 and work / (math.ceil(work / slots) * slots) < 0.75  # (no heads: no work)
    # grouped GEMM, some experts expected empty, deep tiles
    sparse = not exact and busy < _SPARSE_BUSY * batches and groups >= _SPARSE_MIN_GROUPS
    bound = (h * math.ceil(m / tile_tokens) + (0 if exact else batches)) * math.ceil(f / _FEAT_TILE)
    dealable = bound * groups * slots < 1 << 32  # the kernel deals stream-K iterations in 32-bit arithmetic
    split = 1
    blocks = min(slots, bound * groups)  # stream-K blocks: those that can get an iteration
    if exact:  # the einsum: at most _MAX_PIECES pieces per tile (the completing warp sums them one by one)
        blocks = min(blocks, max(work, 1) * _MAX_PIECES)
    if groups > 1 and dealable and work > 0 and (work < slots or ((ragged_wave or sparse) and out_bytes <= 64 << 20)):
        split = max(2, min(math.ceil(blocks / max(work, 1)), groups))
    if split_k is not None:  # forced (probes): any split the kernel can deal
        if not (isinstance(split_k, int) and 1 <= split_k <= max(groups, 1) and (split_k == 1 or dealable)):
            raise ValueError(f"argument 'split_k' must be an int in [1, K/128 = {groups}] (1 where the stream-K "
                             f"iterations overflow 32 bits), got {split_k!r}")
        split = split_k
    mp = -(-m // 4) * 4
    scratch = -(-(groups * h * mp * 4) // 256) * 256
    if split > 1:  # int32 piece counters (12 per unit bound; hopper_gemm.cu CounterBytes), then two float32
        # partial tiles per stream-K block (PartialBlockBytes): the kernel's grid is the resident blocks,
        # cut to the blocks whose slots fit
        scratch += -(-(bound * _COUNTER_SLOTS * 4) // 256) * 256 + blocks * 2 * tile_tokens * _FEAT_TILE * 4
    return GemmPlan(tile_tokens, split, scratch, units)


def _busy_experts(m: int, e: int) -> float:
    """Expected experts with at least one of m rows routed uniformly."""
    return e * (1.0 - (1.0 - 1.0 / e) ** m) if e > 0 else 0.0


MMAS = ("e4m3", "f16")  # tensor-core operand formats for int4 weights (index = the FFI attribute)
GROUPED_KERNELS = ("native", "cutlass", "decode")  # index = the grouped GEMM handler's `kernel` attribute
DECODE_UNIT_ROWS = (8, 16)  # the grouped decode kernel's rows per unit (tile_tokens; w4a8_decode_gemm.cu)
_DECODE_MAX_UNITS = 65535  # ... units it can provide for (one row of blocks each: W4a8DecodeUnsupported)
# The grouped GEMM plan takes CUTLASS from this many expected rows per expert, by K bound (None: any K); 576 for
# gate+up and down alike (H200: see docstring).
CUTLASS_GROUPED_MIN_ROWS = {None: 576}
CUTLASS_WEIGHT_SCRATCH_BYTES = 1 << 30  # e4m3 weights converted per chunk of experts (at least one expert)
_MAX_CHUNK_EXPERTS = 65535  # the conversion kernels put a chunk's experts on the grid's y axis
_ARRAY_BYTES_PER_EXPERT = 256  # w4a8_grouped_cutlass.cuh kW4a8CutlassArrayBytesPerExpert
_CUTLASS_WORKSPACE_BYTES = 1 << 20  # ... kW4a8CutlassWorkspaceBytes


def _align256(v: int) -> int:
    return -(-v // 256) * 256


def grouped_cutlass_scratch(m: int, e: int, n: int, k: int, experts_per_chunk: int) -> int:
    """Scratch of the grouped GEMM's CUTLASS path (w4a8_grouped_cutlass.cuh ``W4a8CutlassScratchBytes``): e4m3
    weights [chunk, N, K], float32 weight scales [chunk, K/128, N], float32 activation scales (M x K/128), the
    per-expert arrays and CUTLASS's workspace."""
    g = k // 128
    return (_align256(experts_per_chunk * n * k) + _align256(experts_per_chunk * n * g * 4) + _align256(m * g * 4)
            + _align256(e * _ARRAY_BYTES_PER_EXPERT) + _CUTLASS_WORKSPACE_BYTES)


def _gpu_is_sm90() -> bool:
    """Whether the first GPU is a Hopper sm_90 (the CUTLASS kernels' only target); True without a GPU (the
    CUDA handlers then never run, so the plan's choice does not matter)."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return True
    cc = getattr(dev, "compute_capability", None)
    return cc is None or str(cc) == "9.0"


def _check_int(name: str, v, low: int, what: str = "an int") -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise ValueError(f"argument '{name}' must be {what} >= {low}, got {v!r}")


def _check_sizes(**sizes) -> None:
    """The planners' shape arguments: non-negative ints (``m`` and ``h`` may be 0), the others at least 1, and K a
    multiple of 128 (the kernels' K group)."""
    for name, v in sizes.items():
        _check_int(name, v, 0 if name in ("m", "h") else 1)
    if sizes["k"] % 128:
        raise ValueError(f"argument 'k' must be a multiple of 128, got {sizes['k']}")


def _options(**options):
    """The planners' integer options (``tile_tokens``, ``split_k``, ``num_sms``): None or an int (a NumPy integer
    too; not a bool or a float), returned as Python ints; ``tile_tokens`` may be 0, the others at least 1."""
    out = []
    for name, v in options.items():
        if v is not None:
            _check_int(name, v, 0 if name == "tile_tokens" else 1, "None or an int")
            v = int(v)
        out.append(v)
    return out


def _check_rows(rows_per_expert) -> None:
    if rows_per_expert is None:
        return
    ok = isinstance(rows_per_expert, (int, float, np.integer, np.floating)) and not isinstance(rows_per_expert, bool)
    if not ok or not math.isfinite(rows_per_expert) or rows_per_expert < 0:
        raise ValueError(f"argument 'rows_per_expert' must be None or a finite number >= 0, got {rows_per_expert!r}")


def decode_unit_bound(m: int, e: int, unit_rows: int = 8) -> int:
    """Units of at most ``unit_rows`` (8 or 16) rows of one expert that any ``group_sizes`` can make of M rows
    over E experts (the grouped decode kernel's grid rows; w4a8_decode_gemm.cu ``W4a8DecodeUnitBound``)."""
    if unit_rows not in DECODE_UNIT_ROWS:
        raise ValueError(f"argument 'unit_rows' must be one of {DECODE_UNIT_ROWS}, got {unit_rows!r}")
    return max(1, -(-(m + (unit_rows - 1) * min(e, m)) // unit_rows))


def cutlass_grouped_min_rows(k: int) -> int:
    """Expected rows per expert from which the grouped GEMM plan takes the CUTLASS path (``CUTLASS_GROUPED_MIN_ROWS``)."""
    return next(v for bound, v in CUTLASS_GROUPED_MIN_ROWS.items() if bound is None or k <= bound)


def _grouped_cutlass_unsupported(m: int, e: int, n: int, k: int, *, out_bf16: bool, built: bool) -> str:
    """Empty when the CUTLASS path can run x [M, K], w [E, N, K/2], else why not (``W4a8CutlassUnsupported``)."""
    if not built:
        return "the library was built without CUTLASS (pip install nvidia-cutlass, then rebuild)"
    if not out_bf16:
        return "it writes bfloat16 output only"
    if n % 8:
        return f"it needs N (output features) a multiple of 8, got {n}"
    if k % 128:
        return f"it needs K a multiple of 128, got {k}"
    if max(m, e, n, k) >= 1 << 31:
        return "its problem sizes are 32-bit (M, E, N and K below 2**31)"
    return ""


def plan_grouped_gemm(m: int, e: int, n: int, k: int, *, rows_per_expert: float | None = None,
                      tile_tokens: int | None = None, num_sms: int | None = None,
                      mma: str | None = None, kernel: str | None = None, out_bf16: bool = True,
                      cutlass: bool | None = None, split_k: int | None = None, x_folded: bool = False) -> GemmPlan:
    """Plan for ``w4a8_grouped_gemm`` with x [M, K] and w [E, N, K/2]; rows per expert default M / E.

    ``rows_per_expert``: the rows each expert is expected to get where M counts padding too (expert parallelism:
    each device's buffer has room for every routed row); the plan is then the one for E * rows_per_expert rows
    routed uniformly (the experts expected to get none included) over the M rows' buffer.

    ``mma`` None picks the operand format from the tile (module docstring); "e4m3" or "f16" forces it
    ("e4m3" without ``tile_tokens`` keeps the plan off the f16-only 8-token tile).
    ``kernel``: None lets the plan choose (the CUTLASS path for bfloat16 output from
    :func:`cutlass_grouped_min_rows` expected rows per expert, when built with it); "cutlass", "native" or
    "decode" (opt-in: units of 8 or 16 rows of one expert, ``tile_tokens``; None picks 16 where an expert's
    expected rows plus two standard deviations pass 8; :func:`decode_unit_bound`) forces one. ``cutlass``: whether the CUTLASS kernels can run (default: built with them and an sm_90 GPU).
    ``split_k``: force this library's kernels' K split (1: whole tiles; more: stream-K with at most that many
    pieces per tile), for probes of the heuristic (``benchmarks/profile_case.py --split-k``); ignored by CUTLASS.
    ``x_folded``: the activations come folded (``x_layout="folded"``; pass ``tile_tokens=128, mma="e4m3"``): the
    scratch holds no folded copy.
    Raises ValueError naming ``tile_tokens``, ``mma``, ``kernel`` or ``split_k`` (unknown value; "f16" with
    tile 0, the plain CUDA-core kernel; "e4m3" with tile 8; a kernel choice these shapes cannot run, "decode"
    with another tile, MMA or split included; a split outside [1, K/128]).
    """
    _check_sizes(m=m, e=e, n=n, k=k)
    _check_rows(rows_per_expert)
    tile_tokens, split_k, num_sms = _options(tile_tokens=tile_tokens, split_k=split_k, num_sms=num_sms)
    if kernel not in (None,) + GROUPED_KERNELS:
        raise ValueError(f"argument 'kernel' must be None or one of {GROUPED_KERNELS}, got {kernel!r}")
    if kernel == "cutlass" and (tile_tokens is not None or mma is not None):
        raise ValueError("arguments 'tile_tokens' and 'mma' select this library's kernels; leave them None with "
                         "kernel='cutlass'")
    if kernel == "decode" and ((tile_tokens is not None and tile_tokens not in DECODE_UNIT_ROWS)
                               or mma not in (None, "f16") or split_k not in (None, 1)):
        raise ValueError("kernel='decode' runs 8- or 16-row units on the f16 MMA without split-K tiles: leave "
                         "'tile_tokens', 'mma' and 'split_k' None (or 8 / 16, 'f16', 1)")
    rows = rows_per_expert if rows_per_expert is not None else m / e
    if kernel == "decode":
        unit_rows = tile_tokens if tile_tokens is not None else _tile_for(rows, True, DECODE_UNIT_ROWS)
        units = decode_unit_bound(m, e, unit_rows)
        if units > _DECODE_MAX_UNITS:
            raise ValueError(f"argument 'kernel'='decode' provides for at most {_DECODE_MAX_UNITS} units of "
                             f"{unit_rows} rows; M = {m} rows over E = {e} experts can make {units}")
        return GemmPlan(unit_rows, 1, 0, units * math.ceil(n / 16), mma="f16", kernel="decode")
    if kernel == "cutlass" or (kernel is None and tile_tokens is None and mma is None
                               and rows >= cutlass_grouped_min_rows(k)):
        if cutlass is None:  # built with it, and a GPU that runs it (else the handler falls back to its plain
            # kernel: no need for the conversion's scratch)
            from . import _ffi  # noqa: PLC0415 - the plan is also used without the CUDA module
            cutlass = _ffi.built_with_cutlass() and _gpu_is_sm90()
        why = _grouped_cutlass_unsupported(m, e, n, k, out_bf16=out_bf16, built=cutlass)
        if why and kernel == "cutlass":
            raise ValueError(f"argument 'kernel'='cutlass' cannot run this grouped GEMM: {why}")
        if not why:
            chunk = max(1, min(e, CUTLASS_WEIGHT_SCRATCH_BYTES // (n * k), _MAX_CHUNK_EXPERTS))
            scratch = grouped_cutlass_scratch(m, e, n, k, chunk)
            units = e * max(1, math.ceil(rows / 128)) * math.ceil(n / 128)
            return GemmPlan(128, 1, scratch, units, kernel="cutlass", experts_per_chunk=chunk)
    # experts expected to get rows: of M rows routed uniformly, or of E * rows_per_expert (a hint of few rows per
    # expert, as under expert parallelism's decode, leaves experts empty; from a few rows on, every one is busy)
    busy = _busy_experts(m if rows_per_expert is None else rows * e, e)
    # e4m3 asked for without a tile: the plan picks among the e4m3 tiles (8 is the f16 MMA's only)
    tiles = TILE_TOKENS if (mma == "e4m3" and tile_tokens is None) else GROUPED_TILE_TOKENS
    plan = _plan(m, 1, n, k, e, rows, tile_tokens, num_sms, spread=True, busy=busy, allowed=tiles, split_k=split_k)
    if mma != "e4m3" and tile_tokens is None and plan.tile_tokens == 128 and rows <= _F16_HALF_TILE_ROWS:
        plan = _plan(m, 1, n, k, e, rows, 64, num_sms, spread=True, busy=busy, allowed=tiles, split_k=split_k)
    if mma is None:  # measured on the H200: f16 wins at 8- to 64-row tiles (module docstring)
        mma = "f16" if plan.tile_tokens in F16_TILE_TOKENS else "e4m3"
    if split_k is None and mma == "f16" and plan.split_k > 1 and _one_wide_wave(plan, busy, rows, n, num_sms):
        plan = _plan(m, 1, n, k, e, rows, plan.tile_tokens, num_sms, spread=True, busy=busy, allowed=tiles, split_k=1)
    plan = _with_mma(plan, mma, m, k, GROUPED_TILE_TOKENS, x_folded=x_folded)
    if x_folded and not folds_activations(plan):
        raise ValueError("folded activations (x_folded) run the native kernel's 128-token e4m3 tiles: pass "
                         "tile_tokens=128, mma='e4m3'")
    return plan


def folds_activations(plan: GemmPlan) -> bool:
    """Whether a grouped GEMM plan runs the 128-token e4m3 kernel that folds its activation scales, i.e. whether
    activations quantized with ``layout="folded"`` save it a pass (``ops.w4a8_grouped_gemm(x_layout="folded")``)."""
    return plan.kernel == "native" and plan.mma == "e4m3" and plan.tile_tokens == 128


def grouped_gemm_layout(m: int, e: int, n: int, k: int, *, rows_per_expert: float | None = None,
                        out_bf16: bool = True) -> str:
    """The activation layout to quantize UE8M0 rows in for ``ops.w4a8_grouped_gemm`` with x [M, K] and w [E, N,
    K/2] (``rows_per_expert`` as :func:`plan_grouped_gemm`; ``out_bf16``: bfloat16 output, the op's default, else
    float32, which CUTLASS's kernel does not write): "folded" where the call's plan runs the 128-token e4m3
    kernel (:func:`folds_activations`: prefill, many rows per expert), which then skips its preparation pass;
    "standard" elsewhere (folded activations would force that kernel onto shapes whose plan takes other tiles).
    From static shapes only: decide once per traced shape. ``ops.quantize_fp8_groups(x, ue8m0=True,
    layout=...)`` and ``ops.silu_mul_quantize_fp8_groups`` take it; the GEMM then gets ``x_layout=`` the same.

    Raises ValueError as :func:`plan_grouped_gemm` for sizes or a hint out of range."""
    plan = plan_grouped_gemm(m, e, n, k, rows_per_expert=rows_per_expert, out_bf16=out_bf16)
    return "folded" if folds_activations(plan) else "standard"


_WIDE_TILES = (8, 16, 32)  # the f16 tiles that run 256-row blocks on whole units (hopper_gemm.cu LaunchF16)
_WIDE_MIN_FILL = 0.9  # ... taken over split-K where their busy units are one wave filling this much of the SMs


def _one_wide_wave(plan: GemmPlan, busy: float, rows: float, n: int, num_sms: int | None) -> bool:
    """Whether whole units of 256 rows (one block per SM) make one wave that fills the GPU where the plan split K
    (split-K runs the 128-row blocks and pays a fix-up per split unit). A batch-1 DeepSeek-V3 decode step's gate+up
    (8 of 256 experts, N = 4096: 128 units for 132 SMs): H200, the kernel alone (`ncu`, thirty-ninth session,
    128-row blocks), split 1 45.7-46.5 us + 3.2-3.5 us of preparation vs split 2 50.6-52.3 + 4.2-4.4; with 256-row
    blocks (forty-seventh session) H100 `ncu` 58.8-60.9 vs 64.5-66.8 us, H200 timing loop 58.9 vs 61.9-66.2 us.
    Several waves are left to split-K (64 rows over 32 experts: 443 units, 3.4 waves, the last 36% full)."""
    if plan.tile_tokens not in _WIDE_TILES or n % 256:
        return False
    sms = num_sms or _num_sms()
    units = busy * max(1, math.ceil(rows / plan.tile_tokens)) * (n // 256)
    return _WIDE_MIN_FILL * sms <= units <= sms


def _with_mma(plan: GemmPlan, mma: str, m: int, k: int, f16_tiles: tuple[int, ...] = FUSED_F16_TILE_TOKENS,
              x_folded: bool = False) -> GemmPlan:
    """``plan`` with the int4 operand format ``mma`` (checked against its token tile); with "f16" the
    activations as f16 (M x K x 2 bytes, hopper_gemm.cuh HopperGemmF16ActivationBytes) follow the scales in
    the scratch."""
    if mma not in MMAS:
        raise ValueError(f"argument 'mma' must be None or one of {MMAS}, got {mma!r}")
    if mma == "f16" and plan.tile_tokens not in f16_tiles:
        raise ValueError(f"argument 'mma'='f16' runs token tiles of {', '.join(map(str, f16_tiles))}; the plan "
                         f"for these shapes has "
                         f"{plan.tile_tokens} (pass 'tile_tokens' to force one)")
    if mma == "e4m3" and plan.tile_tokens == 8:
        raise ValueError("argument 'tile_tokens'=8 runs the f16 MMA only: leave 'mma' None or pass 'f16'")
    extra = _align256(2 * m * k) if mma == "f16" else 0
    if mma == "e4m3" and plan.tile_tokens == 128 and not x_folded:  # folded activation scales (HopperGemmFoldBytes):
        # the token multipliers [ceil4(M)] float32 and a flag, then the folded e4m3 activations [M, K]
        extra = _align256((-(-m // 4) * 4 + 1) * 4) + _align256(m * k)
    return dataclasses.replace(plan, mma=mma, scratch_bytes=plan.scratch_bytes + extra)


def plan_moe_up(m: int, e: int, inter: int, k: int, *, rows_per_expert: float | None = None,
                tile_tokens: int | None = None, num_sms: int | None = None, mma: str | None = None,
                fused: bool | None = None) -> GemmPlan:
    """Plan for ``w4a8_moe_up``: its fused kernel (gate and up accumulators: token tiles up to 64, no split-K),
    or the composed ops (``kernel="unfused"``: the gate+up grouped GEMM in bf16, then
    ``ops.silu_mul_quantize_fp8_groups``, SiLU-mul and the quantizer in one pass; with a static scale or I not
    a multiple of 128 SiLU-mul and the quantizer in XLA).

    ``fused``: None takes the fused kernel up to ``FUSED_UP_MAX_ROWS`` (64) expected rows per expert, or
    whenever ``tile_tokens`` or ``mma`` is given (they configure it), and the composed ops above: at 128 rows
    per expert the fused kernel, whose tiles stop at 64 tokens, took 838 us for gate+up at M = 4096 against
    547 us for the grouped GEMM (bf16 out, 128-token tiles) + SiLU-mul + quantizer (H200, thirtieth session;
    0.67x in earlier sessions), where at 32 / 64 rows per expert it is 1.02x faster (below). True forces
    the fused kernel, False the composed ops. The returned tile fields are the fused kernel's in both cases.

    ``mma``: the tensor-core operand format as in :func:`plan_grouped_gemm` ("f16" at every fused tile, 8
    to 64: the activations as f16, converted once per call, follow the scales in the scratch); None takes
    f16 at 8 to 32 tokens, and at 64 up to ``_F16_HALF_TILE_ROWS`` (64) expected rows per expert (where it
    was measured; e4m3 above). H200, same process, gate+up 32 experts, us, fused f16 vs fused e4m3 at 64
    tokens vs the unfused GEMM + SiLU-mul + quantizer: M = 1024 304 / 352 / 309, M = 2048 455 / 514 / 465
    (h8 codes of the two formats 98% equal: float32 summation order and the folded-scale rounding). Raises
    ValueError naming ``tile_tokens``, ``mma`` or ``fused``.
    """
    _check_sizes(m=m, e=e, inter=inter, k=k)
    _check_rows(rows_per_expert)
    tile_tokens, num_sms = _options(tile_tokens=tile_tokens, num_sms=num_sms)
    if fused is not None and not isinstance(fused, (bool, np.bool_)):
        raise ValueError(f"argument 'fused' must be None, True or False, got {fused!r}")
    if fused is False and (tile_tokens is not None or mma is not None):
        raise ValueError("arguments 'tile_tokens' and 'mma' configure the fused kernel; leave them None with "
                         "fused=False")
    rows = rows_per_expert if rows_per_expert is not None else m / e
    if fused is None:
        fused = tile_tokens is not None or mma is not None or rows <= FUSED_UP_MAX_ROWS
    if tile_tokens is None:
        tile_tokens = _tile_for(rows, spread=True, tiles=GROUPED_TILE_TOKENS[1 if mma == "e4m3" else 0:4])
    if tile_tokens not in GROUPED_TILE_TOKENS[:4]:
        raise ValueError(f"argument 'tile_tokens' must be None, 8, 16, 32 or 64 for the fused kernel, "
                         f"got {tile_tokens!r}")
    plan = _plan(m, 1, inter, k, e, rows, tile_tokens, num_sms, allowed=GROUPED_TILE_TOKENS)
    scratch = _align256((k // 128) * (-(-m // 4) * 4) * 4)
    if mma is None:  # f16 where measured faster (H200: see above)
        mma = "f16" if tile_tokens < 64 or rows <= _F16_HALF_TILE_ROWS else "e4m3"
    return dataclasses.replace(_with_mma(GemmPlan(plan.tile_tokens, 1, scratch, plan.units), mma, m, k),
                               kernel="fused" if fused else "unfused")


def moe_up_fuses(m: int, e: int, inter: int, k: int, *, expected_rows: int | None = None,
                 num_sms: int | None = None) -> bool:
    """Whether a model's ``moe_up="auto"`` (``DeepseekV3ForCausalLM.set_moe_up``) fuses the up-projection of M
    routed rows over E experts: where :func:`plan_moe_up` takes the fused kernel (up to ``FUSED_UP_MAX_ROWS``
    expected rows per expert) and there is at least one expected row per expert (M >= E), except where the
    composed path's gate+up GEMM (:func:`plan_grouped_gemm`, N = 2I) runs 8-token tiles on whole units (split-K 1:
    the wide kernel, 256 weight rows per block), which the fused kernel's 8-token tile, with no wide form, does not
    beat.

    Measured (H100, 2-layer DeepSeek-V3 W4A8 model, ``bench_generate.py --moe-up unfused fused``, decode step
    time unfused / fused, above 1 where fused is faster; fifty-seventh session, two rounds each, UE8M0 | float32
    activation scales): below one row per expert, batch 8 / 16 (64 / 128 rows, K split in two) 0.998 / 0.991-0.995
    | 0.968 / 0.984-0.986; from one row per expert, batch 32 / 64 (K split in two) 1.006-1.007 / 1.044-1.045 |
    1.029-1.031 / 1.088-1.097; where the unfused GEMM runs the wide kernel, batch 1 / 128, 0.984-0.985 /
    0.945-0.948 | 0.991 / 0.943-0.944; batch 256 (16-token tiles) 1.004 | 1.006; prefill 1024 tokens 1.017-1.040 |
    1.031-1.034. The fifty-fifth session's UE8M0 run agreed (batch 16 / 32 / 64: 0.995 / 1.007 / 1.035-1.051).

    ``expected_rows``: the routed rows to decide for where the M-row buffer also holds padding (default M). Under
    expert parallelism each device's buffer has room for every row its experts could receive, about n times the
    rows it expects from uniform routing (``models.deepseek.layers.MoE`` passes those: tokens x top-k / n).

    Raises ValueError naming the size that is not an int in range (``m``, ``expected_rows`` >= 0; ``e``, ``inter``,
    ``k`` >= 1), as :func:`plan_moe_up`."""
    if expected_rows is not None:
        _check_int("expected_rows", expected_rows, 0, "None or an int")
        m = int(expected_rows)
    if plan_moe_up(m, e, inter, k, num_sms=num_sms).kernel != "fused" or m < e:
        return False
    plain = plan_grouped_gemm(m, e, 2 * inter, k, num_sms=num_sms)
    return plain.split_k > 1 or plain.tile_tokens > 8


def _einsum_tile(m: int, block_scaled: bool) -> int:
    """Token tile of the einsum: the decode kernel (8) up to ``_DECODE_TOKENS`` tokens, else as
    :func:`_tile_for`, except that a block-scaled einsum with at least 2048 rows (where 192 was
    measured to pay) takes 192-token tiles unless they pad M by over 10% more than 128-token tiles."""
    if m <= _DECODE_TOKENS:
        return 8
    tile = _tile_for(m, spread=False)
    if block_scaled and m >= 2048 and -(-m // 192) * 192 <= 1.1 * (-(-m // 128) * 128):
        return 192
    return tile


def _cutlass_scratch(m: int, h: int, n: int, k: int) -> int:
    """Scratch of the CUTLASS kernel (fp8_blockwise_cutlass.cuh): float32 activation scales [H, G, ceil4(M)],
    then float32 weight scales [H, ceil(N/128), G] (used when they come as UE8M0 codes)."""
    g = k // 128
    return _align256(h * g * (-(-m // 4) * 4) * 4) + _align256(h * -(-n // 128) * g * 4)


CUBLAS_WORKSPACE_BYTES = 32 << 20  # cuBLASLt's workspace in the einsum's scratch (fp8_blockwise_cublas.cuh)
CUBLAS_MAX_ALGOS = 16  # ... kCublasMaxAlgos: the heuristic results a call may choose among
CUBLAS_ALGO_ENV = "JAX_W4A8_CUBLAS_ALGO"


def cublas_algo() -> int:
    """Which of cuBLASLt's heuristic results the einsum's ``kernel="cublas"`` path runs: 0 (its first choice), or
    the index in ``$JAX_W4A8_CUBLAS_ALGO`` (read when an einsum is traced), for sweeps of its algorithms
    (``benchmarks/experiments/cublas_blockwise_probe.py --algos``). Raises ValueError naming the variable for a
    value that is not an int in [0, CUBLAS_MAX_ALGOS)."""
    raw = os.environ.get(CUBLAS_ALGO_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value < CUBLAS_MAX_ALGOS:
        raise ValueError(f"${CUBLAS_ALGO_ENV} must be an int in [0, {CUBLAS_MAX_ALGOS}), got {raw!r}")
    return value


def _cublas_scratch(m: int, n: int, k: int) -> int:
    """Scratch of the cuBLASLt path (fp8_blockwise_cublas.cuh): float32 activation scales [G, M], float32 weight
    scales [ceil(N/128), ceil4(G)], then cuBLASLt's workspace (from the next 256-byte boundary: 256 bytes of
    slack)."""
    g = k // 128
    return _align256(g * m * 4) + _align256(-(-n // 128) * (-(-g // 4) * 4) * 4) + 256 + CUBLAS_WORKSPACE_BYTES


def _cublas_unsupported(m: int, h: int, n: int, k: int, *, block_scaled: bool, out_bf16: bool,
                        available: bool | None) -> str:
    """Empty when cuBLASLt's block-scaled GEMM can run the einsum x [M, H, K], w [H, N, K], else why not (the
    shape checks of ``CublasBlockwiseUnsupported`` in fp8_blockwise_cublas.cu; ``available`` None asks
    :func:`jax_w4a8._ffi.cublaslt`)."""
    if not block_scaled:
        return "it needs recipe (1, 128, 128): w_scale [.., ceil(N/128), K/128]"
    if not out_bf16:
        return "it writes bfloat16 output only"
    if h != 1:
        return f"it runs one head (the \"md,nd->mn\" linears), got H = {h}"
    if m % 4:
        return f"it needs M (tokens) a multiple of 4, got {m}"
    if n % 16:
        return f"it needs N (output features) a multiple of 16, got {n}"
    if max(m, n, k) >= 1 << 31:
        return "its problem sizes are 32-bit (M, N and K below 2**31)"
    if available is None:
        from . import _ffi  # noqa: PLC0415 - the plan is also used without the CUDA module
        version, why = _ffi.cublaslt()
        if not version:
            return why
    elif not available:
        return "cuBLASLt is not available"
    return ""


def _cutlass_unsupported(m: int, h: int, n: int, k: int, *, block_scaled: bool, out_bf16: bool, built: bool) -> str:
    """Empty when the CUTLASS kernel can run the einsum x [M, H, K], w [H, N, K], else why not
    (the same checks as ``CutlassBlockwiseUnsupported`` in fp8_blockwise_cutlass.cu)."""
    if not built:
        return "the library was built without CUTLASS (pip install nvidia-cutlass, then rebuild)"
    if not block_scaled:
        return "it needs recipe (1, 128, 128): w_scale [.., ceil(N/128), K/128]"
    if not out_bf16:
        return "it writes bfloat16 output only"
    if n % 8:
        return f"it needs N (output features) a multiple of 8, got {n}"
    if max(m, h, n, k, -(-m // 4) * 4 * (k // 128)) >= 1 << 31:
        return "its problem sizes are 32-bit (M, H, N, K and ceil4(M) x K/128 below 2**31)"
    return ""


def plan_fp8_einsum(m: int, h: int, n: int, k: int, *, block_scaled: bool = False,
                    tile_tokens: int | None = None, num_sms: int | None = None, kernel: str | None = None,
                    out_bf16: bool = True, cutlass: bool | None = None, cublas: bool | None = None) -> GemmPlan:
    """Plan for ``fp8_einsum`` in canonical form: x [M, H, K], w [H, N, K].

    ``block_scaled``: one weight scale per 128 rows (recipe (1, 128, 128)); only then are 192-token
    tiles and the CUTLASS kernel available. ``tile_tokens=8`` is the decode kernel (M <= 32, no scratch).
    ``kernel``: None lets the plan choose (CUTLASS's blockwise kernel for block-scaled bf16 einsums with at
    least ``CUTLASS_MIN_TOKENS`` rows per head and 32 output tiles, or 64 rows with 128 tiles and K >= 512,
    when built with it); "cutlass" or "native" forces one; "cublas" (opt-in) runs cuBLASLt's block-scaled
    FP8 GEMM (cuBLAS >= 12.9 on compute capability 9.0: recipe (1, 128, 128), bfloat16 output, one head,
    M a multiple of 4, N a multiple of 16; :func:`_cublas_unsupported`).
    ``cutlass`` / ``cublas``: whether the library has the CUTLASS kernel / can load cuBLASLt (default: ask
    the built library, :func:`jax_w4a8._ffi.cublaslt`).
    Raises ValueError naming ``tile_tokens`` or ``kernel`` for a choice these shapes cannot run.
    """
    _check_sizes(m=m, h=h, n=n, k=k)
    tile_tokens, num_sms = _options(tile_tokens=tile_tokens, num_sms=num_sms)
    if kernel not in (None,) + EINSUM_KERNELS:
        raise ValueError(f"argument 'kernel' must be None or one of {EINSUM_KERNELS}, got {kernel!r}")
    if kernel in ("cutlass", "cublas") and tile_tokens is not None:
        raise ValueError(f"argument 'tile_tokens' selects this library's kernels; leave it None with "
                         f"kernel={kernel!r}")
    tiles = h * -(-m // 128) * -(-n // 128)
    if kernel == "cublas":
        why = _cublas_unsupported(m, h, n, k, block_scaled=block_scaled, out_bf16=out_bf16, available=cublas)
        if why:
            raise ValueError(f"argument 'kernel'='cublas' cannot run this einsum: {why}")
        return GemmPlan(128, 1, _cublas_scratch(m, n, k), tiles, kernel="cublas")
    wide = m >= CUTLASS_MIN_TOKENS and tiles >= _CUTLASS_MIN_TILES
    wave = m >= 64 and tiles >= _CUTLASS_WAVE_TILES and k >= 512
    if kernel == "cutlass" or (kernel is None and tile_tokens is None and block_scaled and (wide or wave)):
        if cutlass is None:
            from . import _ffi  # noqa: PLC0415 - the plan is also used without the CUDA module
            cutlass = _ffi.built_with_cutlass()
        why = _cutlass_unsupported(m, h, n, k, block_scaled=block_scaled, out_bf16=out_bf16, built=cutlass)
        if why and kernel == "cutlass":
            raise ValueError(f"argument 'kernel'='cutlass' cannot run this einsum: {why}")
        if not why:
            return GemmPlan(128, 1, _cutlass_scratch(m, h, n, k), tiles, kernel="cutlass")
    if tile_tokens == 192 and not block_scaled:
        raise ValueError("argument 'tile_tokens'=192 needs block-scaled weights (recipe (1, 128, 128), "
                         "w_scale [.., ceil(N/128), K/128]); per-row weight scales run tiles up to 128")
    if tile_tokens is None:
        tile_tokens = _einsum_tile(m, block_scaled)
    if tile_tokens == 8:
        if m > DECODE_MAX_TOKENS:
            raise ValueError(f"argument 'tile_tokens'=8 (the decode kernel) takes at most {DECODE_MAX_TOKENS} "
                             f"tokens, got M = {m}")
        return GemmPlan(8, 1, 0, h * -(-n // 16))
    return _plan(m, h, n, k, h, m, tile_tokens, num_sms, exact=True, allowed=EINSUM_TILE_TOKENS)
