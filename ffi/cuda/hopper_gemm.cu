// The Hopper tensor-core kernel of ops.w4a8_grouped_gemm and ops.fp8_einsum (see hopper_gemm.cuh).
//
// Block of 384 threads (512 for the einsum's 192-token tiles, 640 for the wide f16 decode tiles), one or two per SM
// (persistent):
//   warpgroup 0  producer: one thread issues TMA loads of a weight tile (128 or 256 rows x one K group), an
//                activation tile (tile_tokens rows x 128) and its scales into a ring of stages;
//   warpgroups 1, 2  consumers, 64 weight rows each (1 to 4 with 256-row units at the unfused f16 8- to 32-token
//                tiles: see LaunchF16): run 4 wgmma m64 x n(tile_tokens) x k32 into a
//                fresh fp32 accumulator, then promote: total += sw(row, g) * sx(g, token) * partial, in
//                fp32. int4 weights are converted to e4m3 in registers, straight into wgmma's A
//                fragments (no shared-memory round trip, no proxy fence, no barrier); where registers
//                allow, two groups are in flight per warpgroup (ping-pong accumulators); where one is
//                (128-token prefill tiles), the two warpgroups take turns issuing MMAs, so one promotes
//                while the other's MMAs run.
//   f16 MMA path (int4 weights, int4_f16, token tiles 8 to 128; fused: 8 to 64): the consumers convert int4 to f16
//                instead (fewer integer instructions); the activations were converted to f16 in the
//                matching K order once per call by the preparation kernel (ConvertXToF16), each group
//                scaled by its activation scale over the token's largest (applied after the K loop and
//                any stream-K fix-up, so the promotion is total += sw(row, g) * partial), and the
//                producer loads them by TMA like the e4m3 tiles (without the scale box). 16- to
//                128-token tiles multiply on wgmma (weights in registers); 8-token tiles on warp-level
//                mma.sync m16n8k16: each warp converts and multiplies its own 16 rows, reads the
//                activation fragments with ldmatrix and frees the stage once its operands are in
//                registers, with the next group's MMAs in flight while a group is promoted (H200,
//                decode: 5-10% faster than the n8 wgmma, whose warpgroup waits on every group's MMAs;
//                benchmarks/NOTEBOOK.md).
//   int4 e4m3 at 128-token tiles, activation scales folded (kFoldX): where every token's group scales differ
//                by powers of two, the preparation folds their ratios into the e4m3 codes and the kernel
//                promotes with total += sw(row, g) * partial, each token's scale applied after the K loop
//                (FoldTokenActivations); a call it cannot fold runs the plain kernel, launched after it. It
//                reads the activations in a K order of its own (StoreFoldedKOrder) so that each thread's int4
//                codes of a K step are one 32-bit word of its 16-byte chunk of the weight row (no byte gather).
//                x_folded (x_layout="folded"): the caller's quantizer wrote that layout (quantize_fp8_groups.cu,
//                QuantizeFoldedKernel), so this kernel runs alone, without the preparation.
// Block-scaled einsum at 128- and 192-token tiles (ConsumeTokenRows): the same stages, but two or three
//                consumer warpgroups put 64 tokens each on wgmma's A side and the 128 weight rows on
//                its N side, taking turns.
// Units of work (batch, token tile, feature tile, K split) are numbered on the device from
// group_sizes, so nothing waits for the host and any group_sizes content is safe (clamped as in
// common/groups.h). Without split-K the blocks take whole units in turn: each rounds and stores its
// own tile, and padding rows of the grouped GEMM are zero-filled by units of their own. With
// split_k > 1 the kernel runs stream-K: the (unit, K group) iterations are dealt out in equal
// contiguous ranges, one per block (so no wave is left part-empty), a block's range is cut into
// pieces at unit edges. A piece that is not a whole unit stores its fp32 partial sums in a slot of
// its block (plain stores: a block's first and last pieces are the only ones that can be partial) and
// adds its K groups to the unit's counter (one per consumer warp); the warp whose count completes the
// unit sums the unit's slots in the order of the blocks that ran them, then rounds and stores. No
// atomics on the sums and a fixed order: split-K results do not vary from run to run.
// Under split-K the grouped GEMM's padding rows are zeroed by the scale preparation instead, so that
// they take no share of the iterations.
#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "../common/formats.h"
#include "../common/groups.h"
#include "hopper_gemm.cuh"
#include "hopper_ptx.cuh"
#include "int4_e4m3.cuh"
#include "int4_f16.cuh"

namespace jax_w4a8 {
namespace {

// Threads per block: a producer warpgroup and kCw consumer warpgroups of 64 weight rows (two, or four in the wide
// f16 decode tiles, see LaunchF16), or with token rows one consumer warpgroup per 64 tokens of the tile.
template <int kTok, bool kTokenRows, int kCw = 2>
constexpr int ThreadsOf() { return 128 * (1 + (kTokenRows ? kTok / 64 : kCw)); }
constexpr int kFeatTile = 128;     // weight rows per unit (64 per consumer warpgroup), but see kCw
constexpr int kKGroup = 128;       // K per stage = one scale group
constexpr int kMaxBatches = 1024;  // batches (experts / heads) the on-device unit table holds
constexpr int kPanelTiles = 8;     // token tiles per panel of the unit order (DecodeUnit)
constexpr size_t kSmemBudget = 220 * 1024;
// The int4 kernels' consumers read each weight row's scales through L1 ([F, G], a 4-byte load per row and group):
// a 32-byte sector serves 8 float32 groups, and L1 holds it in a 128-byte line of its own when a row's scales
// span 128 bytes or more (56 groups: 224 bytes), or shares the line with its neighbours (16 groups: 64 bytes).
// L1 is what the SM's shared-memory configuration leaves of 256 KiB: a block of 256 rows (32-token wide tile,
// 225 KB of shared memory: the 228 KiB configuration) kept 28 KiB for 32 KiB of lines and hit L1 38% of the time.
// SmemForScaleLines: the most shared memory per block that leaves L1 those lines (blocks x rows) plus kL1Spare.
// H100, ncu, kernel alone, gate+up over 32 experts (benchmarks/NOTEBOOK.md, forty-ninth session), L1 hit rate and
// time at 8 stages -> fewer: 32-token wide tile, 512 rows 38% -> 87%, 195 -> 183 us (L2 read sectors -12%);
// fused 32-token, 512 rows 35% -> 88%, 217 -> 199 us (L2 read sectors -14%); fused 8-token, 64 rows (two blocks
// per SM) 67% -> 86%, 168 -> 165 us. H200, timing loop (fiftieth session, three A/B runs against the former rule,
// which covered the 32-token wide tile only): the fused up-projection at 512 rows 0.84x-0.91x the time, the other
// decode cases level.
constexpr int kSmemConfigsKiB[] = {228, 196, 164, 132, 100};  // Hopper's configurations, largest first
constexpr size_t kL1Spare = 8 * 1024;
constexpr int kMinStagesForL1 = 4;
size_t SmemForScaleLines(int blocks, int64_t rows, int64_t row_scale_bytes) {
  const size_t lines = static_cast<size_t>(blocks * rows * std::min<int64_t>(row_scale_bytes, 128));
  for (int c : kSmemConfigsKiB)
    if ((256 - c) * size_t{1024} >= lines + kL1Spare) return c * size_t{1024} / blocks - 1024;  // 1 KiB: the driver's
  return 0;
}

struct KernelArgs {
  HopperGemmParams p;
  int stages;
  int64_t groups;
};

// The fused up-projection on four consumer warpgroups (kParts 2, kCw 4: the 16- and 32-token f16 tiles): each
// warpgroup holds one part's accumulators, warpgroups 0-1 the unit's 128 gate rows and 2-3 the matching 128 up
// rows, so that the main loop is the wide unfused kernel's (one part per thread); the up warpgroups hand their sums
// to the gate warpgroups through shared memory for the epilogue.
template <int kParts, int kCw>
constexpr bool SplitParts() { return kParts == 2 && kCw == 4; }
template <int kParts, int kCw>
constexpr int ThreadParts() { return SplitParts<kParts, kCw>() ? 1 : kParts; }

template <int kTok, bool kInt4, int kParts = 1, bool kF16 = false, int kCw = 2>
struct Layout {
  static constexpr bool kSplit = SplitParts<kParts, kCw>();
  static constexpr int kFeat = kSplit ? 128 : kCw * 64;  // weight rows per unit (output features: per part)
  static constexpr int kWPartBytes = kFeat * (kInt4 ? kKGroup / 2 : kKGroup);
  static constexpr int kWBytes = kParts * kWPartBytes;  // gate and up tiles when fused
  // The activations: e4m3, or on the f16 MMA path f16 (prepared once per call, ConvertXToF16) as two
  // halves of 64 K, each kTok rows of 128 bytes with TMA's 128-byte swizzle (the e4m3 tile's geometry).
  static constexpr int kXBytes = kTok * kKGroup * (kF16 ? 2 : 1);
  // Activation scales: a box of kTok + 4 floats starting at the token tile's row rounded down to a
  // multiple of 4, since TMA needs the innermost start 16-byte aligned (expert tiles start anywhere).
  // The f16 path loads none (its scales are folded into the f16 activations); its stage keeps the room.
  static constexpr int kSxBox = kTok + 4;
  static constexpr int kSxBytes = (kSxBox * 4 + 127) / 128 * 128;
  static constexpr int kStageBytes = (kWBytes + kXBytes + kSxBytes + 1023) / 1024 * 1024;
  // The fused epilogue: per-warp token maxima, then each token's scale's reciprocal.
  static constexpr int kRedBytes = kParts == 2 ? (8 + 1) * kTok * 4 : 0;
  // The int4 wgmma kernels' output staging (bf16 out, F a multiple of 8): per consumer warpgroup its 64 features
  // of each token row, 128 bytes padded to 144 (stmatrix rows 16 bytes apart in the banks; bytes 128-131 hold
  // the token's multiplier), read back in 16-byte chunks for whole-row global stores. Not the 8-token tiles
  // (mma.sync) nor the fused ones.
  static constexpr bool kStagedStore = kInt4 && kParts == 1 && kTok >= 16;
  static constexpr int kStoreRow = 144;
  // kSplit: the up warpgroups' sums for the gate warpgroups, float4 k (accumulators 4 k .. 4 k + 3) of consumer
  // thread c (of 256) at [k][c].
  static constexpr int kExchangeBytes = kSplit ? 256 * kTok / 2 * 4 : 0;
  static constexpr int kStoreBytes = kStagedStore ? kCw * kTok * kStoreRow : kExchangeBytes;
};

// fold_x calls launch the folding kernel (kFoldX) and the plain one; the preparation's flag (the int after the
// token multipliers, see FoldTokenActivations) says which of the two runs: true for the folding one. Read
// after the grid-dependency wait.
__device__ __forceinline__ bool FoldedCall(const HopperGemmParams& p) {
  return *reinterpret_cast<const volatile int*>(p.x_tok_scale + p.h * p.mp) == 0;
}

// This thread's 16-byte chunks of its fragment rows r and r + 8 (at addr and 8 rows of 64 bytes on) as words:
// the int4 codes of one 128-K group in the thread-major K order of the f16 and folded paths.
__device__ __forceinline__ void LoadRowPairChunks(uint32_t addr, uint32_t (&wa)[4], uint32_t (&wb)[4]) {
  const uint4 qa = sm90::LdShared128(addr), qb = sm90::LdShared128(addr + 8 * 64);
  wa[0] = qa.x, wa[1] = qa.y, wa[2] = qa.z, wa[3] = qa.w;
  wb[0] = qb.x, wb[1] = qb.y, wb[2] = qb.z, wb[3] = qb.w;
}

// f16 MMA path, the K order. Thread c = lane % 4 of a fragment row holds that row's int4 codes
// [32 c, 32 c + 32) of each 128-K group, as four words t (codes 32 c + 8 t + j, j < 8); word t gives
// K16 steps 2 t and 2 t + 1 (Int4x8ToF16 pairs codes j and j + 4). So at step s = 2 t + h, logical
// column 2 c + e of the step is code 32 c + 8 t + 2 h + 4 e, and column 8 + 2 c + e is code
// 32 c + 8 t + 2 h + 1 + 4 e. ConvertXToF16 writes each token's 128-K group of activations as f16 in that
// order (step s at [16 s, 16 s + 16)), so the kernel loads them with TMA as a plain K-major tile. One
// task (one token's group, word t, thread c) turns 8 e4m3 codes into four f16 pairs.
//
// The group's activation scale is folded in, as its ratio to the token's largest scale (|ratio| <= 1, so the
// f16 values stay within e4m3's 448: no overflow), and the kernel applies that largest scale once, in its
// epilogue: the promotion per group is then one FFMA per accumulator with the weight scale alone (no token-
// scale loads or products in the main loop). UE8M0 and per-token or per-tensor scales make the ratio a power
// of two (or 1): the f16 values are then exact (down to ratios of 2^-15; the smaller ones lose low bits in
// f16 subnormals, 2^-24 relative to the token's largest group) and the outputs equal the unfolded ones bit
// for bit; float32 group scales round each activation once more (to f16: 2^-11 relative).
__device__ __forceinline__ uint32_t ScaleF16x2(uint32_t v, float ratio) {
  if (ratio == 1.0f) return v;
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v));
  const __half2 h = __floats2half2_rn(f.x * ratio, f.y * ratio);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A task's 8 e4m3 codes (load them before the scales the ratio needs, so that the loads overlap).
__device__ __forceinline__ uint2 LoadXCodes(const uint8_t* x, int64_t task) {
  const int c = static_cast<int>(task & 3), t = static_cast<int>((task >> 2) & 3);
  return *reinterpret_cast<const uint2*>(x + (task >> 4) * kKGroup + 32 * c + 8 * t);  // codes [0, 8)
}

__device__ __forceinline__ void ConvertXToF16(uint2 b, uint16_t* xh, int64_t task, float ratio) {
  const int c = static_cast<int>(task & 3), t = static_cast<int>((task >> 2) & 3);
  const int64_t group = task >> 4;  // [M, H, G] flattened: group * 128 is its first K in x and xh
  const uint32_t pa = __byte_perm(b.x, b.y, 0x5140);  // j = 0, 4, 1, 5
  const uint32_t pb = __byte_perm(b.x, b.y, 0x7362);  // j = 2, 6, 3, 7
  uint32_t* d = reinterpret_cast<uint32_t*>(xh + group * kKGroup + 32 * t + 2 * c);  // step 2 t, columns 2 c
  d[0] = ScaleF16x2(E4m3x2ToF16x2(pa), ratio);         // step 2 t, columns 2 c + e
  d[4] = ScaleF16x2(E4m3x2ToF16x2(pa >> 16), ratio);   // step 2 t, columns 8 + 2 c + e
  d[8] = ScaleF16x2(E4m3x2ToF16x2(pb), ratio);         // step 2 t + 1
  d[12] = ScaleF16x2(E4m3x2ToF16x2(pb >> 16), ratio);
}

// Index of weight scale (b, row f, group 0); group g is at + g. Rows past the weights clamp.
__device__ __forceinline__ int64_t WeightScaleBase(const HopperGemmParams& p, int64_t b, int64_t f, int64_t groups) {
  const int64_t rows = p.fused_up ? p.f + p.up_offset : p.f;  // fused: gate rows, then up rows
  f = f < rows ? f : rows - 1;
  return (b * p.sw_rows + (f >> p.sw_row_shift)) * groups;
}

// Scale g of a row of int4 weight scales (float32 or bfloat16, the grouped GEMM's two types) whose group-0
// scale is at row.
__device__ __forceinline__ float LoadInt4WeightScale(bool bf16, const uint8_t* row, int g) {
  return bf16 ? Bf16BitsToFloat(__ldg(reinterpret_cast<const uint16_t*>(row) + g))
              : __ldg(reinterpret_cast<const float*>(row) + g);
}

__device__ __forceinline__ float LoadWeightScale(const HopperGemmParams& p, int64_t idx) {
  switch (p.sw_type) {
    case WeightScaleType::kF32: return __ldg(static_cast<const float*>(p.sw) + idx);
    case WeightScaleType::kBf16: return Bf16BitsToFloat(__ldg(static_cast<const uint16_t*>(p.sw) + idx));
    default: return Ue8m0ToFloat(__ldg(static_cast<const uint8_t*>(p.sw) + idx));
  }
}

// The same scale's bits as loaded (bfloat16 and UE8M0 codes in the low bits, kept in a float register), for
// WeightScaleFromBits where the scale is used: converted right after the load (a UE8M0 code is compared with
// 0xFF), the scale would be waited for there.
__device__ __forceinline__ float LoadWeightScaleBits(const HopperGemmParams& p, int64_t idx) {
  switch (p.sw_type) {
    case WeightScaleType::kF32: return __ldg(static_cast<const float*>(p.sw) + idx);
    case WeightScaleType::kBf16: return __uint_as_float(__ldg(static_cast<const uint16_t*>(p.sw) + idx));
    default: return __uint_as_float(__ldg(static_cast<const uint8_t*>(p.sw) + idx));
  }
}
__device__ __forceinline__ float WeightScaleFromBits(WeightScaleType type, float bits) {
  switch (type) {
    case WeightScaleType::kF32: return bits;
    case WeightScaleType::kBf16: return __uint_as_float(__float_as_uint(bits) << 16);
    default: return Ue8m0ToFloat(static_cast<uint8_t>(__float_as_uint(bits)));
  }
}

// The unit table, built by every block (from group_sizes in the grouped GEMM; the einsum's decode tiles need
// none, see DecodeUnit): batch token ranges and unit prefix sums.
struct UnitTable {
  int32_t* start;   // [nb]
  int32_t* end;     // [nb]
  int64_t* prefix;  // [nb + 1]: units before batch i
  int nb;           // batches incl. the zero-fill pseudo batch of the grouped GEMM
};

template <int kTok>
__device__ void BuildUnitTable(const HopperGemmParams& p, UnitTable& t, int64_t feat_tiles) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int64_t carry_end = 0, carry_units = 0;
  for (int64_t base = 0; base < p.b; base += 32) {
    const int64_t i = base + lane;
    int64_t s = 0, e = 0;
    if (p.group_sizes == nullptr) {
      e = p.m;
    } else {
      int64_t v = i < p.b ? NextGroupEnd(0, p.group_sizes[i], p.m) : 0;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int64_t o = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v = min(v + o, p.m);
      }
      const int64_t up = __shfl_up_sync(0xffffffffu, v, 1);
      s = lane == 0 ? carry_end : min(carry_end + up, p.m);
      e = min(carry_end + v, p.m);
      carry_end = min(carry_end + __shfl_sync(0xffffffffu, v, 31), p.m);
    }
    int64_t units = i < p.b ? (e - s + kTok - 1) / kTok * feat_tiles : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t o = __shfl_up_sync(0xffffffffu, units, off);
      if (lane >= off) units += o;
    }
    if (i < p.b) {
      t.start[i] = static_cast<int32_t>(s);
      t.end[i] = static_cast<int32_t>(e);
      t.prefix[i + 1] = carry_units + units;
    }
    carry_units += __shfl_sync(0xffffffffu, units, 31);
  }
  if (lane == 0) {
    t.prefix[0] = 0;
    if (t.nb > p.b) {  // rows past the last expert: zero-filled by units of their own
      t.start[p.b] = static_cast<int32_t>(carry_end);
      t.end[p.b] = static_cast<int32_t>(p.m);
      t.prefix[p.b + 1] = carry_units + (p.m - carry_end + kTok - 1) / kTok * feat_tiles;
    }
  }
}

struct Unit {
  int64_t b, m0, m_end, f0, g0, g1;
  int head;
  bool zero;
};

// a / b and a % b, in 32-bit arithmetic where both fit (a 64-bit division is a called subroutine of a few
// hundred cycles: at one token a unit's decode was most of the latency before the first TMA load).
__device__ __forceinline__ void DivMod(int64_t a, int64_t b, int64_t& q, int64_t& r) {
  if (((a | b) >> 32) == 0) {
    const uint32_t q32 = static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    q = q32;
    r = a - static_cast<int64_t>(q32) * b;
  } else {
    q = a / b;
    r = a - q * b;
  }
}

// Units per batch of the einsum, whose batches (heads) all hold the M tokens: token tiles x feature tiles.
template <int kTok>
__device__ __forceinline__ int64_t UniformBatchUnits(const HopperGemmParams& p, int64_t feat_tiles) {
  return (p.m + kTok - 1) / kTok * feat_tiles;
}

// The einsum's decode-tile unit u: every batch (head) holds the M tokens, so the batch is a division (no
// table is built).
template <int kTok>
__device__ __forceinline__ Unit DecodeUniformUnit(const HopperGemmParams& p, int64_t u, int64_t feat_tiles) {
  const int64_t tok_tiles = (p.m + kTok - 1) / kTok;
  int64_t b, r, q, rem;
  DivMod(u, UniformBatchUnits<kTok>(p, feat_tiles), b, r);
  DivMod(r, tok_tiles, q, rem);
  Unit x;
  x.b = b;
  x.zero = false;
  x.m0 = rem * kTok;
  x.f0 = q * kFeatTile;
  x.m_end = p.m;
  x.g0 = 0;
  x.g1 = 0;
  x.head = static_cast<int>(b);
  return x;
}

// kEinsum: the fp8 einsum's decode-tile kernels (kTok <= 64, e4m3 weights), which take the einsum's units by
// division and do their divisions in 32 bits where the values fit. The other kernels keep the table search
// and 64-bit divisions, their code as before (in two A/B runs on the H200 the int4 grouped GEMM's prefill ran
// 2-3% slower with these changes, which save nothing there).
template <int kTok, bool kPanels, bool kEinsum = false, int kFeat = kFeatTile>
__device__ __forceinline__ Unit DecodeUnit(const HopperGemmParams& p, const UnitTable& t, int64_t u,
                                           int64_t feat_tiles) {
  if constexpr (kEinsum) {
    if (p.group_sizes == nullptr) return DecodeUniformUnit<kTok>(p, u, feat_tiles);
  }
  int lo = 0, hi = t.nb - 1;  // last batch with prefix[b] <= u
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.prefix[mid] <= u) lo = mid; else hi = mid - 1;
  }
  Unit x;
  x.b = lo;
  x.zero = lo >= p.b;
  const int64_t r = u - t.prefix[lo];
  const int64_t tok_tiles = (t.end[lo] - t.start[lo] + kTok - 1) / kTok;
  if constexpr (kPanels) {
    // fp8 prefill tiles: token tiles in panels of kPanelTiles, token tile fastest within a panel, then
    // feature tile, then the next panel, so the blocks running at once share one activation panel and
    // a few dozen weight tiles in L2 (token tile fastest over all of M reads every activation row once
    // per wave: at 16k tokens more than L2 holds). 32-bit: a batch's tile counts fit.
    const int rr = static_cast<int>(r), feats = static_cast<int>(feat_tiles), tt = static_cast<int>(tok_tiles);
    const int panel = rr / (kPanelTiles * feats), within = rr - panel * (kPanelTiles * feats);
    const int panel_tiles = min(kPanelTiles, tt - panel * kPanelTiles);
    x.m0 = t.start[lo] + static_cast<int64_t>(panel * kPanelTiles + within % panel_tiles) * kTok;
    x.f0 = static_cast<int64_t>(within / panel_tiles) * kFeatTile;
  } else {  // decode tiles (a batch rarely has more than one token tile) and int4 experts (whose weights
            // fit in L2 whatever the order)
    if constexpr (kEinsum) {
      int64_t q, rem;
      DivMod(r, tok_tiles, q, rem);
      x.m0 = t.start[lo] + rem * kTok;
      x.f0 = q * kFeatTile;
    } else {
      x.m0 = t.start[lo] + (r % tok_tiles) * kTok;
      x.f0 = (r / tok_tiles) * kFeat;
    }
  }
  x.m_end = t.end[lo];
  x.g0 = 0;
  x.g1 = 0;
  x.head = p.group_sizes == nullptr ? static_cast<int>(lo) : 0;
  return x;
}

// The pieces of work one block runs, in order; producer and consumers walk the same sequence.
// Whole units in turn (cursor = unit), or with split-K this block's equal share of the
// (unit, K group) iterations (cursor = iteration), cut at unit edges.
struct WorkCursor {
  int64_t cursor, end;
  int64_t start = 0;         // stream-K: this block's first iteration
  uint32_t iters = 0;        // stream-K: all (unit, K group) iterations (iters x blocks < 2^32: the launch checks)
  bool stream_k;
  bool first_piece = false;  // stream-K: the piece Next returned last is this block's first

  __device__ WorkCursor(const HopperGemmParams& p, int64_t total_units, int64_t groups) {
    stream_k = p.split_k > 1;
    if (stream_k) {
      iters = static_cast<uint32_t>(total_units * groups);
      start = cursor = BlockStart(blockIdx.x);
      end = BlockStart(blockIdx.x + 1);
    } else {
      cursor = blockIdx.x;
      end = total_units;
    }
  }

  // Stream-K: the first iteration of block b's range (the range ends where block b + 1's begins);
  // 32-bit arithmetic (a 64-bit division is a called subroutine: the fix-up would spill around it).
  __device__ __forceinline__ int64_t BlockStart(uint32_t b) const { return iters * b / gridDim.x; }

  // Stream-K: the unit of the piece Next returned last (its last iteration is cursor - 1); k32 (the einsum's
  // decode tiles, see DecodeUnit): in 32-bit arithmetic (cursor < iters < 2^32).
  template <bool k32>
  __device__ __forceinline__ int64_t PieceUnit(int64_t groups) const {
    if constexpr (k32) return static_cast<uint32_t>(cursor - 1) / static_cast<uint32_t>(groups);
    return (cursor - 1) / groups;
  }

  // Stream-K: the partial-sum slot of block b's piece in a unit that starts at iteration u0: the
  // block's first piece (slot 2b) if its range starts in the unit, else its last piece (2b + 1).
  __device__ __forceinline__ int64_t SlotOf(uint32_t b, int64_t u0) const { return 2 * b + (BlockStart(b) >= u0 ? 0 : 1); }

  template <int kTok, bool kPanels, bool kEinsum = false, int kFeat = kFeatTile>
  __device__ __forceinline__ bool Next(const HopperGemmParams& p, const UnitTable& table, int64_t feat_tiles,
                                       int64_t groups, Unit& t) {
    if (cursor >= end) return false;
    if (!stream_k) {
      t = DecodeUnit<kTok, kPanels, kEinsum, kFeat>(p, table, cursor, feat_tiles);
      t.g0 = 0;
      t.g1 = groups;
      cursor += gridDim.x;
      return true;
    }
    if constexpr (!kEinsum) {
      t = DecodeUnit<kTok, kPanels, false, kFeat>(p, table, cursor / groups, feat_tiles);
      t.g0 = cursor % groups;
    } else {
      const uint32_t unit = static_cast<uint32_t>(cursor) / static_cast<uint32_t>(groups);  // cursor < iters < 2^32
      t = DecodeUnit<kTok, kPanels, kEinsum>(p, table, unit, feat_tiles);
      t.g0 = cursor - static_cast<int64_t>(unit) * groups;
    }
    first_piece = cursor == start;
    t.g1 = min(groups, t.g0 + (end - cursor));
    cursor += t.g1 - t.g0;
    return true;
  }
};

// Calls f(unit, g, stage, phase) for every (unit, K group) whose stage this block loads, in order
// (zero-fill units load nothing), advancing the ring of stages (the TMA producer's walk through it).
template <int kTok, bool kPanels, bool kEinsum, int kFeat, typename F>
__device__ __forceinline__ void ForEachLoadedGroup(const HopperGemmParams& p, const UnitTable& table,
                                                   int64_t total_units, int64_t feat_tiles, int64_t groups,
                                                   int stages, F&& f) {
  int stage = 0;
  uint32_t phase = 0;
  WorkCursor work(p, total_units, groups);
  for (Unit t; work.Next<kTok, kPanels, kEinsum, kFeat>(p, table, feat_tiles, groups, t);) {
    if (t.zero) continue;
    for (int64_t g = t.g0; g < t.g1; ++g) {
      f(t, g, stage, phase);
      if (++stage == stages) { stage = 0; phase ^= 1; }
    }
  }
}

template <int kTok>
__device__ __forceinline__ void Wgmma(float (&d)[kTok / 2], uint64_t a, uint64_t b, int scale_d) {
  if constexpr (kTok == 16) sm90::WgmmaE4m3N16(d, a, b, scale_d);
  else if constexpr (kTok == 32) sm90::WgmmaE4m3N32(d, a, b, scale_d);
  else if constexpr (kTok == 64) sm90::WgmmaE4m3N64(d, a, b, scale_d);
  else sm90::WgmmaE4m3N128(d, a, b, scale_d);
}

template <int kTok>
__device__ __forceinline__ void WgmmaF16Rs(float (&d)[kTok / 2], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  if constexpr (kTok == 16) sm90::WgmmaF16RsN16(d, a, b, scale_d);
  else if constexpr (kTok == 32) sm90::WgmmaF16RsN32(d, a, b, scale_d);
  else if constexpr (kTok == 64) sm90::WgmmaF16RsN64(d, a, b, scale_d);
  else sm90::WgmmaF16RsN128(d, a, b, scale_d);
}

template <int kTok>
__device__ __forceinline__ void WgmmaRs(float (&d)[kTok / 2], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  if constexpr (kTok == 16) sm90::WgmmaE4m3RsN16(d, a, b, scale_d);
  else if constexpr (kTok == 32) sm90::WgmmaE4m3RsN32(d, a, b, scale_d);
  else if constexpr (kTok == 64) sm90::WgmmaE4m3RsN64(d, a, b, scale_d);
  else sm90::WgmmaE4m3RsN128(d, a, b, scale_d);
}

// Fused MoE up-projection epilogue: h = silu(gate) * up in fp32, then e4m3 codes for the down
// projection, per tensor (static scale) or per token over this unit's 128 channels (UE8M0 scale,
// rounded up *before* quantizing). Both consumer warpgroups (256 threads) take part.
// - silu(g) = g / (1 + exp(-g)) with the approximate division (__fdividef: within 2 ulp of the IEEE quotient; an
//   e4m3 code moves only where h lies within a relative 2^-22 of a rounding boundary). Each IEEE division was a
//   branchy sequence (reciprocal, Newton steps, a check and a called slow path) that ptxas kept in order, one
//   element after another, while the block's MMAs waited for the epilogue. exp's argument is capped at 88, so
//   that 1 + exp(-g) stays finite (e^88 = 1.65e38): from g = -87.3 it lies between 2^126 and 2^128, where
//   __fdividef returns 0 where the IEEE quotient is at most 1.1e-36 in magnitude (silu(-87.34)).
// - A UE8M0 scale is a power of two, so h * (1 / scale) is h / scale exactly (as in the quantizer's EncodeEight).
// - Each token's UE8M0 scale is formed once, by one thread (the maximum over the 8 warps' partial maxima, the
//   division by 448, the rounding up): all 32 lanes of each of the 8 warps did it for their tokens, kTok / 4
//   divisions and 2 kTok shared loads per thread, in order. The scale and its reciprocal come from the maximum's
//   bits (Ue8m0ScaleForE4m3, Ue8m0Reciprocal: exactly what the divisions gave), so no division runs between the
//   epilogue's two barriers, where all 256 threads wait for the kTok that form the scales.
// H100, ncu, kernel alone, gate+up over 32 experts at M = 512 / 1024 / 64 rows (the 32- / 64- / 8-token kernels),
// us (fifty-second session): 204.6 -> 192.8 / 269.8 -> 246.2 / 169.8 -> 167.6; the scale from the bits,
// fifty-third: 194.9 -> 191.9 / 248.0 -> 248.2 / 168.5 -> 168.0. Timing-only builds without one part each
// (benchmarks/experiments/fused_epilogue_probes.py: no SiLU, no barriers, no stores) took 192-196 at M = 512, so
// no one part holds the kernel behind the plain gate+up GEMM (183); a build that returns before the epilogue
// loses its MMAs as dead code (3 of 48 HGMMA left) and only streams the weights: 167.
template <int kTok>
__device__ void FusedUpEpilogue(const HopperGemmParams& p, const Unit& t, const float (&gate)[kTok / 2],
                                const float (&up)[kTok / 2], float* red, int cw, int warp, int lane, int64_t row0) {
  float h[kTok / 2];
#pragma unroll
  for (int i = 0; i < kTok / 2; ++i)
    h[i] = __fdividef(gate[i], 1.0f + expf(fminf(-gate[i], 88.0f))) * up[i];
  // per token (i / 4, i % 2) of this thread: the static scale, the UE8M0 one's reciprocal or the float32 one
  float scale[kTok / 4];
  const bool dynamic = p.down_scale == nullptr;
  const bool by_reciprocal = dynamic && p.h_scale_ue8m0;
  if (!dynamic) {
    const float s = *p.down_scale;
#pragma unroll
    for (int j = 0; j < kTok / 4; ++j) scale[j] = s;
  } else {
    // Each warp's token maxima over its 16 features into red; then one thread per token takes the maximum over the
    // 8 warps, forms the scale, stores it to h_scale and shares in tok_inv (after red) its reciprocal (exact) if
    // it is UE8M0, else the float32 scale itself (h / s below, as the quantizer's EncodeEight).
#pragma unroll
    for (int j = 0; j < kTok / 4; ++j) {
      const int i = 4 * (j / 2) + (j % 2);
      float m = fmaxf(fabsf(h[i]), fabsf(h[i + 2]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      if (lane < 4) red[(cw * 4 + warp) * kTok + 8 * (j / 2) + 2 * lane + (j % 2)] = m;
    }
    sm90::NamedBarrierSync(3, 256);
    float* tok_inv = red + 8 * kTok;
    const int ct = static_cast<int>(threadIdx.x) - 128;  // consumer thread (cw * 128 + warp * 32 + lane)
    if (ct < kTok) {
      float m = 0.0f;
#pragma unroll
      for (int w = 0; w < 8; ++w) m = fmaxf(m, red[w * kTok + ct]);
      float s;
      if (by_reciprocal) {
        s = Ue8m0ScaleForE4m3(fmaxf(m, 1e-4f));  // CeilToUe8m0(max / 448), exact, no division
        tok_inv[ct] = Ue8m0Reciprocal(s);
      } else {
        s = __fdiv_rn(fminf(fmaxf(m, 1e-4f), FLT_MAX), 448.0f);  // capped: an Inf h saturates, never NaN
        tok_inv[ct] = s;
      }
      const int64_t tok = t.m0 + ct;
      if (tok < t.m_end) p.h_scale[tok * (p.f / kFeatTile) + t.f0 / kFeatTile] = s;
    }
    // tok_inv is rewritten by the next unit after its first barrier, which every thread reaches after its reads
    // below; red, before that barrier, but its reads above ended at this one
    sm90::NamedBarrierSync(3, 256);
#pragma unroll
    for (int j = 0; j < kTok / 4; ++j) scale[j] = tok_inv[8 * (j / 2) + 2 * (lane % 4) + (j % 2)];
  }
#pragma unroll
  for (int i = 0; i < kTok / 2; ++i) {
    const int64_t m = t.m0 + 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
    const int64_t f = row0 + 8 * ((i / 2) % 2);
    if (m >= t.m_end || f >= p.f) continue;
    const int j = 2 * (i / 4) + (i % 2);
    const float q = by_reciprocal ? h[i] * scale[j] : __fdiv_rn(h[i], scale[j]);
    static_cast<uint8_t*>(p.out)[m * p.f + f] = __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
  }
}

// One output element rounded to the output type and stored.
__device__ __forceinline__ void StoreRounded(const HopperGemmParams& p, int64_t idx, float v) {
  if (p.out_bf16) static_cast<uint16_t*>(p.out)[idx] = FloatToBf16Bits(v);
  else static_cast<float*>(p.out)[idx] = v;
}

// Elements idx and idx + 1 in one store (idx even, so the pair is 4- / 8-byte aligned).
__device__ __forceinline__ void StoreOutputPair(const HopperGemmParams& p, int64_t idx, float a, float b) {
  if (p.out_bf16) {
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + idx) =
        static_cast<uint32_t>(FloatToBf16Bits(a)) | (static_cast<uint32_t>(FloatToBf16Bits(b)) << 16);
  } else {
    *reinterpret_cast<float2*>(static_cast<float*>(p.out) + idx) = make_float2(a, b);
  }
}

// Stream-K fix-up (split_k > 1) of a piece that is not a whole unit, called by a whole warp with its
// lanes' partial sums in total (kAcc per thread; thread ct of n_threads consumer threads). The sums
// go to this piece's slot (plain float4 stores, thread-interleaved so a warp's stores coalesce), then
// the warp adds the piece's K groups to its counter for the unit (one per consumer warp: the same warp
// of every piece holds the same elements). In the warp whose count completes the unit's K groups,
// total becomes the sum of the unit's slots in the order of the blocks that ran them (its own
// included) and the result is true: that warp rounds and stores. Ordering: the warp barrier puts
// every lane's stores before lane 0's release fence and count; the completing lane 0 fences again
// (acquire) before the barrier after which its lanes read the slots from L2. (The former form added
// the sums with float atomics and fenced with __threadfence() in every lane, a sequentially
// consistent fence; on the H200 small split einsums ran 10-50% slower than with the separate
// rounding kernel before it.)
constexpr int kCounterSlots = 12;  // counters per unit: up to 3 consumer warpgroups x 4 warps

template <bool k32, int kAcc>
__device__ __forceinline__ bool StreamKFixUp(const HopperGemmParams& p, const WorkCursor& work, const Unit& t,
                                             int64_t groups, int ct, int n_threads, int warp_slot, int lane,
                                             float (&total)[kAcc]) {
  static_assert(kAcc % 4 == 0, "partial slots are written in float4s");
  const int64_t unit = work.template PieceUnit<k32>(groups), u0 = unit * groups;
  float* slots = p.split_ws + p.partial_offset;
  auto at = [&](int64_t slot, int i) {
    return reinterpret_cast<float4*>(slots + (slot * kAcc + static_cast<int64_t>(i)) * n_threads) + ct;
  };
  const int64_t mine = 2 * static_cast<int64_t>(blockIdx.x) + (work.first_piece ? 0 : 1);
#pragma unroll
  for (int i = 0; i < kAcc; i += 4) *at(mine, i) = make_float4(total[i], total[i + 1], total[i + 2], total[i + 3]);
  __syncwarp();
  int done = 0;
  if (lane == 0) {
    const int count = static_cast<int>(t.g1 - t.g0);
    int* counters = reinterpret_cast<int*>(p.split_ws);
    sm90::FenceReleaseGpu();  // release: this warp's slot before the count says so
    done = sm90::AtomicAddRelaxedGpu(counters + unit * kCounterSlots + warp_slot, count) + count;
    if (done == groups) sm90::FenceAcquireGpu();  // acquire: the other pieces' slots, released before their counts
  }
  done = __shfl_sync(0xffffffffu, done, 0);
  if (done != groups) return false;
  __syncwarp();  // memory ordering: lane 0's acquire before every lane's reads
#pragma unroll
  for (int i = 0; i < kAcc; ++i) total[i] = 0.0f;
  // The unit's pieces in block order: from the block whose range holds its first iteration (the
  // largest b with BlockStart(b) <= u0) to the last block starting before its end; empty ranges skipped.
  // The lanes look the blocks up 32 at a time (lane j: block first + j; the blocks in the unit are a
  // prefix), so the sum waits for one L2 round trip per piece, not also for the 32-bit divisions of
  // BlockStart (H200, kv_a at one token over 53 pieces: 38 -> 20 us). Loading pieces ahead (2 or 4)
  // measured the same and spilled in other kernels' main loops.
  uint32_t first = static_cast<uint32_t>(u0) * gridDim.x / work.iters;
  while (first + 1 < gridDim.x && work.BlockStart(first + 1) <= u0) ++first;
  for (;; first += 32) {
    const uint32_t b = first + static_cast<uint32_t>(lane);
    const bool in_unit = b < gridDim.x && work.BlockStart(b) < u0 + groups;
    const int slot = in_unit && work.BlockStart(b + 1) != work.BlockStart(b) ? static_cast<int>(work.SlotOf(b, u0)) : -1;
    const int n = __popc(__ballot_sync(0xffffffffu, in_unit));
    for (int j = 0; j < n; ++j) {
      const int s = __shfl_sync(0xffffffffu, slot, j);
      if (s < 0) continue;  // a block with no iterations
#pragma unroll
      for (int i = 0; i < kAcc; i += 4) {
        const float4 v = __ldcg(at(s, i));
        total[i] += v.x, total[i + 1] += v.y, total[i + 2] += v.z, total[i + 3] += v.w;
      }
    }
    if (n < 32) break;
  }
  return true;
}

// Bytes of one block's partial-sum slots: two pieces of a kTok x 128 tile.
constexpr int64_t PartialBlockBytes(int tile_tokens) { return 2 * static_cast<int64_t>(tile_tokens) * kFeatTile * 4; }

// Units of work at most (the einsum's exactly): a batch's rows in token tiles, each expert of the grouped
// GEMM adding at most one partial tile, times the feature tiles.
static int64_t UnitsBound(int64_t m, int64_t h, int64_t f, int tile_tokens, int64_t grouped_batches) {
  const int64_t tile = tile_tokens > 0 ? tile_tokens : 1;
  return (h * ((m + tile - 1) / tile) + grouped_batches) * ((f + kFeatTile - 1) / kFeatTile);
}

// Split-K piece counters (int32 per unit and consumer warp), rounded up to 256 bytes; the partial-sum
// slots follow them.
static size_t CounterBytes(int64_t m, int64_t h, int64_t f, int tile_tokens, int64_t grouped_batches) {
  const size_t bytes = static_cast<size_t>(UnitsBound(m, h, f, tile_tokens, grouped_batches)) * kCounterSlots * 4;
  return (bytes + 255) / 256 * 256;
}

// The consumers of the block-scaled einsum's 128- and 192-token tiles (e4m3 weights, one weight scale
// per 128 rows and K group): tokens on wgmma's A side (64 per warpgroup, kTok / 64 warpgroups), the 128
// weight rows on its N side. Every accumulator of a thread then shares one weight scale and one of two token scales, so
// the promotion is one FFMA per accumulator plus two products (the swapped form needs a scale per
// (row, token) pair: 32 loads and 32 products more per group), and the epilogue writes pairs of
// adjacent features. The warpgroups take turns issuing MMAs in a ring (warpgroup cw waits on named
// barrier 1 + cw and passes to the next one's).
template <int kTok, bool kStreamK>
__device__ __forceinline__ void ConsumeTokenRows(const HopperGemmParams& p, const UnitTable& table,
                                                 int64_t total_units, int64_t feat_tiles, int64_t groups,
                                                 int stages, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                                 int cw) {
  constexpr int kCw = kTok / 64;  // consumer warpgroups, 64 tokens each
  using L = Layout<kTok, false, 1, false>;
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int tok_row = cw * 64 + warp * 16 + lane / 4;  // this thread's token rows in the tile: +0, +8
  int stage = 0;
  uint32_t phase = 0;
  bool issued_any = false;
  // Stage 0's descriptors: tokens (A: this warpgroup's 64 rows of the activation tile) and weights (B).
  // The warpgroup index through a shuffle: warp-uniform, so the descriptors live in uniform registers.
  const uint64_t desc_x0 = sm90::DescSw128(smem + L::kWBytes + __shfl_sync(0xffffffffu, cw, 0) * 64 * kKGroup, 0);
  const uint64_t desc_w0 = sm90::DescSw128(smem, 0);
  WorkCursor work(p, total_units, groups);
  for (Unit t; work.Next<kTok, true>(p, table, feat_tiles, groups, t);) {
    float total[kFeatTile / 2];
#pragma unroll
    for (int i = 0; i < kFeatTile / 2; ++i) total[i] = 0.0f;
    // 32-bit copies of what the group loop needs (K groups and tile rows fit; registers are scarce).
    const int g1 = static_cast<int>(t.g1), g_begin = t.zero ? g1 : static_cast<int>(t.g0);
    const uint32_t sx_off = L::kWBytes + L::kXBytes + 4 * static_cast<uint32_t>((t.m0 & 3) + tok_row);
    const int64_t sw_base = WeightScaleBase(p, t.b, t.f0, groups);
    // Weight scales two groups ahead, as in the swapped consumers.
    float pre[2] = {0.0f, 0.0f};
    auto load_scale = [&](int g) { return LoadWeightScale(p, sw_base + min(g, g1 - 1)); };
    if (g_begin < g1) {
      pre[0] = load_scale(g_begin);
      pre[1] = load_scale(g_begin + 1);
    }
    auto step = [&](auto pre_slot, int g) {
      constexpr int J = decltype(pre_slot)::value;
      const float sw = pre[J];
      sm90::MbarWait(&full[stage], phase);
      uint8_t* st = smem + static_cast<size_t>(stage) * L::kStageBytes;
      const int my_stage = stage;
      // Descriptors of this stage's tiles, advanced from stage 0's: the address field is bits 0..13 of
      // the descriptor (bytes / 16; shared memory < 256 KB, so no carry), 32 K bytes = 2.
      const uint64_t stage_desc = static_cast<uint64_t>(__shfl_sync(0xffffffffu, my_stage, 0)) * (L::kStageBytes >> 4);
      if (++stage == stages) { stage = 0; phase ^= 1; }
      float acc[kFeatTile / 2];
      if (issued_any || cw > 0) sm90::NamedBarrierSync(1 + cw, 256);
      sm90::WgmmaFence();
#pragma unroll
      for (int kc = 0; kc < 4; ++kc)
        Wgmma<kFeatTile>(acc, desc_x0 + stage_desc + 2 * kc, desc_w0 + stage_desc + 2 * kc, kc > 0);
      sm90::WgmmaCommit();
      sm90::NamedBarrierArrive(1 + (cw + 1) % kCw, 256);
      issued_any = true;
      pre[J] = load_scale(g + 2);
      // The token scales are read while this group's MMAs (just issued, hundreds of cycles) run, so
      // they have landed long before the stage is freed below (the swapped consumers, which read theirs
      // after the wait, need a cross-proxy fence there; see retire).
      const uint32_t sx = sm90::SmemAddr(st) + sx_off;
      const float s0 = sw * sm90::LdSharedF32(sx), s1 = sw * sm90::LdSharedF32(sx + 32);
      sm90::WgmmaWait<0>();
      // Accumulator i: token row tok_row + 8 ((i / 2) % 2), feature 8 (i / 4) + 2 (lane % 4) + i % 2.
#pragma unroll
      for (int i = 0; i < kFeatTile / 2; ++i) total[i] = fmaf((i / 2) % 2 ? s1 : s0, acc[i], total[i]);
      __syncwarp();
      sm90::MbarArriveIf(&empty[my_stage], lane == 0);
    };
    using Pre0 = std::integral_constant<int, 0>;
    using Pre1 = std::integral_constant<int, 1>;
    int g = g_begin;
    for (; g + 1 < g1; g += 2) {
      step(Pre0{}, g);
      step(Pre1{}, g + 1);
    }
    if (g < g1) step(Pre0{}, g);

    // This thread's output pairs: accumulators i, i + 1 are features f, f + 1 of one token; fn(i, idx of
    // feature f, whether f + 1 < F) for tokens of this batch and features f < F.
    auto for_each_pair = [&](auto&& fn) {
#pragma unroll
      for (int i = 0; i < kFeatTile / 2; i += 2) {
        const int64_t m = t.m0 + tok_row + 8 * ((i / 2) % 2);
        const int64_t f = t.f0 + 8 * (i / 4) + 2 * (lane % 4);
        if (m >= t.m_end || f >= p.f) continue;
        fn(i, (m * p.h + t.head) * p.f + f, f + 1 < p.f);
      }
    };
    // Stream-K (a kernel of its own: the fix-up costs the 192-token MMA loop spills): a partial piece
    // hands its sums to the fix-up; only the warp completing the unit goes on, with the unit's sums.
    if constexpr (kStreamK) {
      if (!(t.g0 == 0 && t.g1 == groups) &&
          !StreamKFixUp<false>(p, work, t, groups, cw * 128 + tid, kCw * 128, cw * 4 + warp, lane, total))
        continue;
    }
    // Epilogue: one store per pair where F is even (the pair is aligned).
    const bool paired = p.f % 2 == 0;
    for_each_pair([&](int i, int64_t idx, bool second) {
      if (paired && second) {
        StoreOutputPair(p, idx, total[i], total[i + 1]);
      } else {
        StoreRounded(p, idx, total[i]);
        if (second) StoreRounded(p, idx + 1, total[i + 1]);
      }
    });
  }
  // The last warpgroup's last pass (to warpgroup 0) has no matching wait: take it, so no barrier is
  // left half-arrived.
  if (cw == 0 && issued_any) sm90::NamedBarrierSync(1, 256);
}

// Narrow token tiles (decode) are latency-bound per group: run two blocks per SM there, or one of four consumer
// warpgroups (kCw 4, the wide f16 tiles).
template <int kTok, int kParts, int kCw = 2>
struct Occupancy {
  static constexpr int kBlocksPerSm = kCw == 2 && kTok * kParts <= 32 ? 2 : 1;
  // setmaxnreg moves registers within the block's launch allocation (384 x 80 at two blocks per SM, 640 x 96 at
  // four consumer warpgroups).
  static constexpr uint32_t kProducerRegs = kBlocksPerSm == 2 || kCw == 4 ? 32 : 40;
  static constexpr uint32_t kConsumerRegs = kCw == 4 ? 112 : kBlocksPerSm == 2 ? 104 : 232;
};

// Groups in flight per consumer warpgroup (per warp on mma.sync): two (the next group's operand is built and
// its MMAs issued while the current one runs) where the second accumulator and A fragments fit the register
// budget.
template <int kTok, bool kInt4, int kParts, bool kF16 = false, int kCw = 2>
struct Pipeline {
  // Registers of two slots: accumulators, running total and (int4, wgmma) A fragments (twice as many as f16).
  // With mma.sync the fragments are built and used within one K step, so only the accumulators count.
  // The f16 path's 8-token tiles run on mma.sync (see the consumers), the 16- to 128-token ones on wgmma.
  static constexpr bool kSync = kF16 && kTok == 8;
  static constexpr int kTp = ThreadParts<kParts, kCw>();  // parts per consumer thread
  static constexpr int kRegs = 3 * kTp * (kTok / 2) + (kInt4 && !kSync ? 2 * kTp * (kF16 ? 32 : 16) : 0);
  static constexpr int kDepth =
      kRegs <= (kSync ? 24 : Occupancy<kTok, kParts, kCw>::kConsumerRegs < 160 ? 56 : 160) ? 2 : 1;
};

// kStreamK (token rows only): the split_k > 1 form, with the fix-up that rounds completed units.
// kFoldX (int4 e4m3, 128-token tiles): the activation scales folded into the activations (FoldTokenActivations).
// kCw: consumer warpgroups of the weights-on-A kernels (4: the wide f16 decode tiles, whole units only).
template <int kTok, bool kInt4, int kParts, bool kF16, bool kTokenRows = false, bool kStreamK = false,
          bool kFoldX = false, int kCw = 2>
__global__ void __launch_bounds__(ThreadsOf<kTok, kTokenRows, kCw>(), Occupancy<kTok, kParts, kCw>::kBlocksPerSm)
    HopperGemmKernel(const __grid_constant__ KernelArgs args, const __grid_constant__ CUtensorMap map_w,
                     const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_sx) {
  static_assert(!kF16 || (kInt4 && (kTok <= 64 || (kParts == 1 && kTok <= 128))),
                "the f16 path: int4 weights, token tiles up to 64 (fused) or 128");
  // The kernels of a fold_x call: this one (kFoldX) and the plain int4 e4m3 128-token kernel.
  constexpr bool kFoldPair = kInt4 && !kF16 && kParts == 1 && kTok == 128 && !kTokenRows;
  static_assert(!kFoldX || kFoldPair, "folded activation scales: int4 weights, e4m3 MMA, 128-token tiles");
  static_assert(kCw == 2 || (kCw == 4 && kF16 && kTok <= 32 && !kTokenRows),
                "four consumer warpgroups: the f16 decode tiles (8 to 32 tokens)");
  using L = Layout<kTok, kInt4, kParts, kF16, kCw>;
  using Occ = Occupancy<kTok, kParts, kCw>;
  constexpr int kThreads = ThreadsOf<kTok, kTokenRows, kCw>();
  constexpr int kConsumers = kThreads / 128 - 1;
  constexpr bool kPanels = kTok >= 128 && !kInt4;  // unit order: see DecodeUnit
  constexpr bool kEinsum = !kInt4 && !kPanels;      // see DecodeUnit
  const HopperGemmParams& p = args.p;
  const int stages = args.stages;
  const int64_t groups = args.groups;
  const int64_t feat_tiles = (p.f + L::kFeat - 1) / L::kFeat;
  // The plain kernel of a fold_x call, launched as this one's programmatic dependent, may start (its blocks wait
  // for this grid to complete before anything else; they find SMs as this grid's blocks finish).
  if constexpr (kFoldX) sm90::LaunchDependents();

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* staging = smem + static_cast<size_t>(stages) * L::kStageBytes;  // L::kStoreBytes
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + L::kStoreBytes);
  uint64_t* empty = full + stages;
  // A third mbarrier per stage, unused since the f16 path's activations are converted before the kernel;
  // kept so that the shared-memory layout (and the SASS) of every other kernel stays as measured.
  uint64_t* spare = empty + stages;
  UnitTable table;
  // The grouped GEMM's rows past the last expert: zero-filled by units of their own without split-K; with
  // split-K by the scale preparation before this kernel (zero units would take a share of the stream-K
  // iterations, most of them under expert parallelism, where most rows are padding).
  table.nb = static_cast<int>(p.b) + ((p.group_sizes != nullptr && p.split_k == 1) ? 1 : 0);
  table.prefix = reinterpret_cast<int64_t*>(spare + stages);
  table.start = reinterpret_cast<int32_t*>(table.prefix + table.nb + 1);
  table.end = table.start + table.nb;
  float* red = reinterpret_cast<float*>(table.end + table.nb + 4);  // after the table (float accesses only)

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      sm90::MbarInit(&full[s], 1);
      sm90::MbarInit(&empty[s], kThreads / 32 - 4);  // one arrival per consumer warp
      sm90::MbarInit(&spare[s], 3);
    }
    sm90::FenceBarrierInit();
  }
  if (threadIdx.x == 32) {
    sm90::PrefetchTensorMap(&map_w);
    sm90::PrefetchTensorMap(&map_x);
    sm90::PrefetchTensorMap(&map_sx);
  }
  // The einsum's decode-tile units are arithmetic (DecodeUnit), the other kernels' come from the table.
  const bool uniform = kEinsum && p.group_sizes == nullptr;
  if (!uniform) BuildUnitTable<kTok>(p, table, feat_tiles);
  __syncthreads();
  const int64_t total_units = uniform ? p.b * UniformBatchUnits<kTok>(p, feat_tiles) : table.prefix[table.nb];
  const int wg = threadIdx.x / 128;

  if (wg == 0) {
    // ------------------------------------------------------------------------------- producer
    sm90::ReleaseNReg<kConsumers == 3 ? 32 : Occ::kProducerRegs>();
    if (threadIdx.x != 0) return;
    // Launched as a programmatic dependent of the preparation kernel (activations, scales, counters): its
    // launch and this prologue ran while the preparation did.
    sm90::GridDependencyWait();
    if constexpr (kFoldPair) {
      if (p.fold_x && FoldedCall(p) != kFoldX) return;  // the other kernel of the pair runs this call
    }
    ForEachLoadedGroup<kTok, kPanels, kEinsum, L::kFeat>(p, table, total_units, feat_tiles, groups, stages,
                             [&](const Unit& t, int64_t g, int stage, uint32_t phase) {
      sm90::MbarWait(&empty[stage], phase ^ 1);
      uint8_t* st = smem + static_cast<size_t>(stage) * L::kStageBytes;
      // The f16 path's activation scales are folded into its f16 activations (ConvertXToF16): no scale box.
      sm90::MbarArriveExpectTx(&full[stage], L::kWBytes + L::kXBytes + (kF16 || kFoldX ? 0 : L::kSxBox * 4));
#pragma unroll
      for (int part = 0; part < kParts; ++part)
        sm90::TmaLoad3d(st + part * L::kWPartBytes, &map_w, &full[stage],
                        static_cast<int>(g * (kInt4 ? kKGroup / 2 : kKGroup)),
                        static_cast<int>(t.f0 + part * p.up_offset), static_cast<int>(t.b));
      sm90::TmaLoad3d(st + L::kWBytes, &map_x, &full[stage], static_cast<int>(g * kKGroup), t.head,
                      static_cast<int>(t.m0));
      if constexpr (kF16)  // the f16 tile's second half: K [64, 128) of the group
        sm90::TmaLoad3d(st + L::kWBytes + L::kXBytes / 2, &map_x, &full[stage], static_cast<int>(g * kKGroup + 64),
                        t.head, static_cast<int>(t.m0));
      if constexpr (!kF16 && !kFoldX)
        sm90::TmaLoad3d(st + L::kWBytes + L::kXBytes, &map_sx, &full[stage], static_cast<int>(t.m0 & ~int64_t{3}),
                        t.head, static_cast<int>(g));
    });
    return;
  }

  // --------------------------------------------------------------------------------- consumers
  sm90::GridDependencyWait();  // split-K counters and zeroed rows come from the preparation kernel
  if constexpr (kFoldPair) {
    if (p.fold_x && FoldedCall(p) != kFoldX) return;
  }
  sm90::SetMaxNReg<kConsumers == 3 ? 160 : Occ::kConsumerRegs>();
  if constexpr (kTokenRows) {
    static_assert((kTok == 128 || kTok == 192) && !kInt4 && kParts == 1 && !kF16,
                  "token rows: the einsum's 128- or 192-token tiles");
    ConsumeTokenRows<kTok, kStreamK>(p, table, total_units, feat_tiles, groups, stages, smem, full, empty, wg - 1);
    return;
  } else {
  constexpr int kPipe = Pipeline<kTok, kInt4, kParts, kF16, kCw>::kDepth;
  constexpr bool kSync = Pipeline<kTok, kInt4, kParts, kF16, kCw>::kSync;  // f16 path on mma.sync
  const int cw = wg - 1;                 // consumer warpgroup: weight rows [64 cw, 64 cw + 64)
  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int frag_row = cw * 64 + warp * 16 + lane / 4;  // this thread's A rows in the tile: +0 and +8
  // Parts per thread, and kSplit (L::kSplit): this warpgroup's part (0 gate, 1 up) and output features (rows
  // [64 (cw % 2), + 64) of the unit's 128); otherwise the thread's rows are its output features.
  constexpr int kTp = ThreadParts<kParts, kCw>();
  const int my_part = L::kSplit ? cw / 2 : 0;
  const int feat_row = L::kSplit ? frag_row - 128 * my_part : frag_row;
  // int4 tile rows are 64 bytes (one K group) with TMA's 64-byte swizzle: 16-byte chunk c of row r sits
  // at chunk c ^ ((r / 2) % 4), which makes the fragment loads below bank-conflict free.
  const uint32_t frag_swz = static_cast<uint32_t>((frag_row >> 1) & 3);
  const uint32_t nib_sel = static_cast<uint32_t>(2 * (lane % 4)) | (static_cast<uint32_t>(2 * (lane % 4) + 1) << 4);
  int stage = 0;
  uint32_t phase = 0;
  // One group in flight per warpgroup: the two warpgroups take turns issuing their MMAs (named
  // barriers 1 and 2), so one's MMAs finish while the other's are queued and its promotion runs
  // under them; issued at the same time, both would finish together and promote with the tensor
  // cores idle.
  constexpr bool ordered = kPipe == 1 && kTok == 128;
  bool issued_any = false;
  auto turn_wait = [&] {
    if constexpr (ordered) {
      if (cw == 1 || issued_any) sm90::NamedBarrierSync(1 + cw, 256);
    }
  };
  auto turn_pass = [&] {
    if constexpr (ordered) {
      sm90::NamedBarrierArrive(2 - cw, 256);
      issued_any = true;
    }
  };
  // Stage 0's descriptors (activation tile; e4m3 weight rows of this warpgroup), on the uniform datapath
  // (the warp-uniform warpgroup index through a shuffle); a stage adds its offset / 16, 32 K bytes add 2.
  const uint64_t desc_x0 = sm90::DescSw128(smem + L::kWBytes, 0);
  // f16 path: K16 step s reads 32 bytes at 32 (s % 4) of the rows of half s / 4 (kTok x 128 bytes each).
  uint64_t desc_w0[kTp];
#pragma unroll
  for (int part = 0; part < kTp; ++part)
    desc_w0[part] = sm90::DescSw128(smem + part * L::kWPartBytes + __shfl_sync(0xffffffffu, cw, 0) * 64 * kKGroup, 0);
  // The staged epilogue (L::kStagedStore): bf16 output whose rows are 16-byte aligned, whole units only.
  const bool staged = L::kStagedStore && p.out_bf16 && p.f % 8 == 0 && p.split_k == 1 &&
                    (reinterpret_cast<uintptr_t>(p.out) & 15) == 0;
  bool exchanged = false;  // kSplit: an up warpgroup has written the exchange buffer (see the epilogue)
  WorkCursor work(p, total_units, groups);
  for (Unit t; work.Next<kTok, kPanels, kEinsum, L::kFeat>(p, table, feat_tiles, groups, t);) {
    const int64_t row0 = t.f0 + feat_row;  // this thread's output features: row0, row0 + 8
    float total[kTp][kTok / 2];
#pragma unroll
    for (int part = 0; part < kTp; ++part)
#pragma unroll
      for (int i = 0; i < kTok / 2; ++i) total[part][i] = 0.0f;

    const int64_t g_begin = t.zero ? t.g1 : t.g0;
    // f16 path: this thread's tokens' largest activation scales (PrepareActScalesKernel: the group-0 plane),
    // applied after the loop and any stream-K fix-up (apply_token_scales); 0 past the unit's rows and on
    // zero-fill units (whose rows' scales may be anything; their totals stay 0). Loaded here, so that the
    // loads complete under the loop.
    // From 64-token tiles they are loaded after the loop instead (their registers are the accumulators').
    constexpr bool kEarlyTokS = kF16 && kTok <= 32;
    float tok_s[kEarlyTokS ? kTok / 4 : 1];
    // kFoldX: the token multipliers of the folded activations (FoldTokenActivations).
    auto token_scale = [&](int j) {
      const int64_t m = t.m0 + 8 * (j / 2) + 2 * (lane % 4) + (j % 2);
      return !t.zero && m < t.m_end ? __ldg((kFoldX ? p.x_tok_scale : p.sx) + t.head * p.mp + m) : 0.0f;
    };
    if constexpr (kEarlyTokS) {
#pragma unroll
      for (int j = 0; j < kTok / 4; ++j) tok_s[j] = token_scale(j);
    }
    // The staged epilogue's token multipliers (larger tiles): thread tid loads token tid's here, one register
    // under the K loop, and puts it in the padding of its staging row after the loop, where the epilogue reads
    // them. Loaded after the loop instead, the kTok / 4 loads took ~2900 cycles per unit (H200 trace, 128-token
    // folded e4m3 kernel, down M = 4096: 11% of its time).
    constexpr bool kStagedTokS = L::kStagedStore && (kF16 || kFoldX) && !kEarlyTokS;
    float staged_tok_s = 0.0f;
    if constexpr (kStagedTokS) {
      const int64_t m = t.m0 + tid;
      if (staged && tid < kTok && !t.zero && m < t.m_end)
        staged_tok_s = __ldg((kFoldX ? p.x_tok_scale : p.sx) + t.head * p.mp + m);
    }
    // Weight scales of rows row0 and row0 + 8: pre[j] holds those of the groups g_begin + j, + 2, + 4, ...,
    // loaded one and a half to two groups before they are needed, so that the global-load latency hides
    // behind MMAs and promotions (one group ahead stalled every other group). kDirect (the
    // mma.sync and f16 kernels, and those with two groups in flight): the promotion reads the slot itself,
    // which is reloaded right after it (fp8 weights: the scale's raw bits, converted there, so that a UE8M0
    // code's 0xFF test does not wait for the load either). The former form, still taken by the other
    // kernels (whose loops spill without it), copies the slot into sw_copy when the group is issued; there
    // ptxas moved each freshly loaded scale into the loop-carried register at the end of the iteration,
    // which waited for the load (H200, ncu: 18% of the fused 8-token kernel's stall samples on one move).
    constexpr bool kDirect = kSync || kF16 || kPipe == 2;
    float pre[2][kTp][2] = {};
    float sw_copy[kDirect ? 1 : kPipe][kTp][2];
    float acc[kPipe][kTp][kTok / 2];
    // int4 paths: this thread's A fragments, 4 K steps of 32 (e4m3) or 8 K16 steps (f16).
    uint32_t afrag[kPipe][kTp][kF16 ? 8 : 4][4];
    int slot_stage[kPipe];
    int64_t sw_base[kTp][2];
#pragma unroll
    for (int part = 0; part < kTp; ++part) {
      sw_base[part][0] = WeightScaleBase(p, t.b, row0 + (part + my_part) * p.up_offset, groups);
      sw_base[part][1] = WeightScaleBase(p, t.b, row0 + 8 + (part + my_part) * p.up_offset, groups);
    }
    // int4 weights: the rows' group-0 scales as pointers, set once per unit, so that a load is a 32-bit
    // clamp, an address and the load (the 64-bit index arithmetic per load was a tenth of the 8-token
    // kernel's main loop).
    const uint8_t* sw_ptr[kTp][2];
    const int sw_shift = p.sw_type == WeightScaleType::kF32 ? 2 : p.sw_type == WeightScaleType::kBf16 ? 1 : 0;
    const bool sw_bf16 = p.sw_type == WeightScaleType::kBf16;  // int4 weights: float32 or bfloat16 scales
#pragma unroll
    for (int part = 0; part < kTp; ++part)
#pragma unroll
      for (int r = 0; r < 2; ++r) sw_ptr[part][r] = static_cast<const uint8_t*>(p.sw) + (sw_base[part][r] << sw_shift);
    const int g_last = static_cast<int>(t.g1) - 1;
    // The fused kernels: the expert's scales as one pointer, this thread's two rows as 32-bit byte offsets
    // (clamped to the last gate row) and the up rows a uniform delta further. Four 64-bit row pointers did not
    // fit the 8-token kernel's registers (ptxas rebuilt them, 64-bit clamps and products, for every load in
    // the main loop), and the wgmma kernels' 64-bit indices and scale-type switch per load cost as much: main
    // loops 668 -> 520 (8 tokens), 436 / 455 -> 299 / 322 (f16, 16 / 32), 625 / 1134 / 738 -> 489 / 924 / 604
    // (e4m3, 16 / 32 / 64) SASS instructions.
    constexpr bool kCompactScales = kInt4 && kTp == 2;
    const uint8_t* sw_unit = nullptr;
    uint32_t sw_off[2] = {0u, 0u};
    uint32_t up_delta = 0;
    if constexpr (kCompactScales) {
      sw_unit = static_cast<const uint8_t*>(p.sw) + ((t.b * p.sw_rows * groups) << sw_shift);
      const int64_t last = p.f - 1;
      sw_off[0] = static_cast<uint32_t>((min(row0, last) * groups) << sw_shift);
      sw_off[1] = static_cast<uint32_t>((min(row0 + 8, last) * groups) << sw_shift);
      up_delta = static_cast<uint32_t>((p.up_offset * groups) << sw_shift);
    }
    auto load_scales = [&](auto pre_slot, int64_t g) {
      constexpr int J = decltype(pre_slot)::value;
      if constexpr (kCompactScales) {
        const int gc = min(static_cast<int>(g), g_last);
#pragma unroll
        for (int part = 0; part < kTp; ++part) {
          const uint32_t d = part == 0 ? 0u : up_delta;
          pre[J][part][0] = LoadInt4WeightScale(sw_bf16, sw_unit + (sw_off[0] + d), gc);
          pre[J][part][1] = LoadInt4WeightScale(sw_bf16, sw_unit + (sw_off[1] + d), gc);
        }
      } else if constexpr (kInt4) {  // the plain kernels: a row pointer each (one part per thread)
        const int gc = min(static_cast<int>(g), g_last);
#pragma unroll
        for (int part = 0; part < kTp; ++part) {
          pre[J][part][0] = LoadInt4WeightScale(sw_bf16, sw_ptr[part][0], gc);
          pre[J][part][1] = LoadInt4WeightScale(sw_bf16, sw_ptr[part][1], gc);
        }
      } else {
        g = min(g, t.g1 - 1);
#pragma unroll
        for (int part = 0; part < kTp; ++part) {
          pre[J][part][0] = kDirect ? LoadWeightScaleBits(p, sw_base[part][0] + g)
                                    : LoadWeightScale(p, sw_base[part][0] + g);
          pre[J][part][1] = kDirect ? LoadWeightScaleBits(p, sw_base[part][1] + g)
                                    : LoadWeightScale(p, sw_base[part][1] + g);
        }
      }
    };
    // This thread's f16-path weight bytes in a stage (+ stage address, + part).
    const uint32_t frag_off = frag_row * 64 + ((static_cast<uint32_t>(lane % 4) ^ frag_swz) * 16);
    using Pre0 = std::integral_constant<int, 0>;
    using Pre1 = std::integral_constant<int, 1>;
    if (g_begin < t.g1) {
      load_scales(Pre0{}, g_begin);
      load_scales(Pre1{}, g_begin + 1);
    }

    // Wait for the next group's stage, build the A operand and issue its MMAs into slot S (wgmma:
    // asynchronously; mma.sync: the stage is freed here); !kDirect: its weight scales from pre[J] to sw_copy[S].
    auto issue = [&](auto slot, auto pre_slot) {
      constexpr int S = decltype(slot)::value;
      constexpr int J = decltype(pre_slot)::value;
      if constexpr (!kDirect) {
#pragma unroll
        for (int part = 0; part < kTp; ++part)
          sw_copy[S][part][0] = pre[J][part][0], sw_copy[S][part][1] = pre[J][part][1];
      }
      sm90::MbarWait(&full[stage], phase);
      uint8_t* st = smem + static_cast<size_t>(stage) * L::kStageBytes;
      slot_stage[S] = stage;
      if (++stage == stages) { stage = 0; phase ^= 1; }
      if constexpr (kSync) {
        // 8-token tiles: each warp on its own (mma.sync m16n8k16), rows r and r + 8 of its 16 (this thread's 16
        // bytes of each, as below), converted one 32-bit word (two K16 steps) at a time and multiplied by the
        // activation tile's fragments (ldmatrix of the 128-byte-swizzled f16 rows: 16-byte chunk c of token
        // row n sits at chunk c ^ (n % 8); step s of half s / 4 is chunks 2 (s % 4) and + 1). The stage is
        // freed once its operands are in registers.
        const uint32_t st_addr = sm90::SmemAddr(st);
        uint4 qa[kTp], qb[kTp];
#pragma unroll
        for (int part = 0; part < kTp; ++part) {
          const uint32_t base = st_addr + part * L::kWPartBytes + frag_off;
          qa[part] = sm90::LdShared128(base);
          qb[part] = sm90::LdShared128(base + 8 * 64);
        }
        const uint32_t xrow = st_addr + L::kWBytes + static_cast<uint32_t>(lane % 8) * 128;
#pragma unroll
        for (int part = 0; part < kTp; ++part)
#pragma unroll
          for (int i = 0; i < kTok / 2; ++i) acc[S][part][i] = 0.0f;
        static_assert(kTok == 8, "mma.sync: one m16n8 tile of tokens");
#pragma unroll
        for (int t4 = 0; t4 < 4; ++t4) {
          // Steps 2 t4 and 2 t4 + 1: half t4 / 2, chunks 4 (t4 % 2) .. + 3 (matrix lane / 8 of the ldmatrix):
          // b[0], b[1] of step 2 t4, b[2], b[3] of step 2 t4 + 1.
          uint32_t b[4];
          const uint32_t chunk = (static_cast<uint32_t>(4 * (t4 % 2) + lane / 8) ^ static_cast<uint32_t>(lane % 8)) * 16;
          sm90::LdMatrixX4(b, xrow + (t4 / 2) * (kTok * 128) + chunk);
#pragma unroll
          for (int part = 0; part < kTp; ++part) {
            const uint32_t wa[4] = {qa[part].x, qa[part].y, qa[part].z, qa[part].w};
            const uint32_t wb[4] = {qb[part].x, qb[part].y, qb[part].z, qb[part].w};
            uint32_t a0[4], a1[4];
            Int4WordsToF16Fragments(wa[t4], wb[t4], a0, a1);
            sm90::MmaF16(acc[S][part], a0, b[0], b[1]);
            sm90::MmaF16(acc[S][part], a1, b[2], b[3]);
          }
        }
        // Every operand of the stage is in registers (the MMAs above have read them): free the stage. The
        // cross-proxy fence orders these reads before the producer's next TMA write (see retire).
        sm90::FenceProxyAsyncShared();
        __syncwarp();
        sm90::MbarArriveIf(&empty[slot_stage[S]], lane == 0);
      } else if constexpr (kF16) {
        // Rows r and r + 8: this thread's 16 bytes (codes [32 c, 32 c + 32)) of each, 4 words -> 8 K16
        // steps (order in ConvertXToF16). Fused: the up part is converted while the gate part's MMAs run,
        // or, at two blocks per SM (104 registers: ptxas would serialize every wgmma), into the same
        // registers once they are done.
        constexpr bool kReuse = kTp == 2 && Occupancy<kTok, kParts, kCw>::kBlocksPerSm == 2;
        static_assert(!kReuse || kPipe == 1, "the wait below would also drain another group in flight");
        uint64_t stage_desc = 0;
#pragma unroll
        for (int part = 0; part < kTp; ++part) {
          uint32_t wa[4], wb[4];
          LoadRowPairChunks(sm90::SmemAddr(st + part * L::kWPartBytes) + frag_off, wa, wb);
          uint32_t(&fr)[8][4] = afrag[S][kReuse ? 0 : part];
#pragma unroll
          for (int t4 = 0; t4 < 4; ++t4) Int4WordsToF16Fragments(wa[t4], wb[t4], fr[2 * t4], fr[2 * t4 + 1]);
          if (part == 0) turn_wait();
          sm90::WgmmaFence();
          if (part == 0)
            stage_desc = static_cast<uint64_t>(__shfl_sync(0xffffffffu, slot_stage[S], 0)) * (L::kStageBytes >> 4);
#pragma unroll
          for (int step = 0; step < 8; ++step)
            WgmmaF16Rs<kTok>(acc[S][part], fr[step],
                             desc_x0 + stage_desc + (step / 4) * (L::kXBytes / 2 / 16) + 2 * (step % 4), step > 0);
          if (kReuse && part + 1 < kTp) {  // the fragments are read by the MMAs until they finish
            sm90::WgmmaCommit();
            sm90::WgmmaWait<0>();
          }
        }
        sm90::WgmmaCommit();
        turn_pass();
      } else {
        const uint8_t* x_tile = st + L::kWBytes;
        if constexpr (kFoldX) {
          // Folded activations are in the thread-major K order (StoreFoldedKOrder): thread c's codes of every K step
          // are its 16-byte chunk c of each row, word kc (8 codes) for step kc, converted as loaded.
#pragma unroll
          for (int part = 0; part < kTp; ++part) {
            uint32_t wa[4], wb[4];
            LoadRowPairChunks(sm90::SmemAddr(st + part * L::kWPartBytes) + frag_off, wa, wb);
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
              Int4x8ToE4m3(wa[kc], afrag[S][part][kc][0], afrag[S][part][kc][2]);
              Int4x8ToE4m3(wb[kc], afrag[S][part][kc][1], afrag[S][part][kc][3]);
            }
          }
        } else if constexpr (kInt4) {
          // int4 -> e4m3 straight into the wgmma A fragments: per K step one 16-byte chunk of each of the
          // two rows; bytes 2c, 2c + 1 of each 8-byte half are this thread's 4 + 4 codes.
#pragma unroll
          for (int part = 0; part < kTp; ++part) {
            const uint32_t base = sm90::SmemAddr(st + part * L::kWPartBytes) + frag_row * 64;
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) {
              const uint32_t off = (static_cast<uint32_t>(kc) ^ frag_swz) * 16;
              const uint4 qa = sm90::LdShared128(base + off);
              const uint4 qb = sm90::LdShared128(base + 8 * 64 + off);
              afrag[S][part][kc][0] = Int4x4ToE4m3(__byte_perm(qa.x, qa.y, nib_sel));
              afrag[S][part][kc][1] = Int4x4ToE4m3(__byte_perm(qb.x, qb.y, nib_sel));
              afrag[S][part][kc][2] = Int4x4ToE4m3(__byte_perm(qa.z, qa.w, nib_sel));
              afrag[S][part][kc][3] = Int4x4ToE4m3(__byte_perm(qb.z, qb.w, nib_sel));
            }
          }
        }
        turn_wait();
        sm90::WgmmaFence();
        // Uniform-datapath descriptors pay everywhere except in the fused kernels (their registers are
        // tight: they would spill in the loop).
        const uint64_t stage_desc =
            static_cast<uint64_t>(__shfl_sync(0xffffffffu, slot_stage[S], 0)) * (L::kStageBytes >> 4);
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)
#pragma unroll
          for (int part = 0; part < kTp; ++part) {
            const uint64_t desc_x =
                kTp == 1 ? desc_x0 + stage_desc + 2 * kc : sm90::DescSw128(x_tile, kc * 32);
            if constexpr (kInt4) {
              WgmmaRs<kTok>(acc[S][part], afrag[S][part][kc], desc_x, kc > 0);
            } else {
              Wgmma<kTok>(acc[S][part], desc_w0[part] + stage_desc + 2 * kc, desc_x, kc > 0);
            }
          }
        sm90::WgmmaCommit();
        turn_pass();
      }
    };
    // Promote the finished group in slot S, whose weight scales are in pre[J] (kDirect) or sw_copy[S]: total
    // += sw * sx * partial in fp32 (f16 path: total += sw * partial, its token scales folded into the
    // activations and applied after the loop); free its stage (wgmma; mma.sync freed it in issue).
    auto retire = [&](auto slot, auto pre_slot) {
      constexpr int S = decltype(slot)::value;
      constexpr int J = decltype(pre_slot)::value;
      // fp8 weights, kDirect: the scales from their bits here.
      float sw[kTp][2];
#pragma unroll
      for (int part = 0; part < kTp; ++part)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float v = kDirect ? pre[J][part][r] : sw_copy[kDirect ? 0 : S][part][r];
          sw[part][r] = kDirect && !kInt4 ? WeightScaleFromBits(p.sw_type, v) : v;
        }
      if constexpr (kF16 || kFoldX) {
        // Accumulator i is row (i / 2) % 2 (see promote below).
#pragma unroll
        for (int part = 0; part < kTp; ++part)
#pragma unroll
          for (int i = 0; i < kTok / 2; ++i)
            total[part][i] = fmaf(sw[part][(i / 2) % 2], acc[S][part][i], total[part][i]);
        if constexpr (kSync) return;  // the stage is already free
      } else {
        const uint32_t sx = sm90::SmemAddr(smem + static_cast<size_t>(slot_stage[S]) * L::kStageBytes + L::kWBytes +
                                           L::kXBytes) + 4 * static_cast<uint32_t>((t.m0 & 3) + 2 * (lane % 4));
        // This thread's tokens: 8 (j / 2) + 2 (lane % 4) + j % 2, j < kTok / 4; rows row0 and row0 + 8.
        // Accumulator i holds token j = 2 (i / 4) + i % 2 of row (i / 2) % 2. One scale product per
        // (row, token), made where it is used; with 128-row scale blocks (the block-scaled einsum) both
        // rows share one weight scale, so one product per token (a uniform branch, not a select).
        auto promote = [&](auto shared_row_scale) {
#pragma unroll
          for (int j = 0; j < kTok / 4; ++j) {
            const float a = sm90::LdSharedF32(sx + 4 * (8 * (j / 2) + (j % 2)));
#pragma unroll
            for (int part = 0; part < kTp; ++part) {
              const float s0 = sw[part][0] * a;
              const float s1 = decltype(shared_row_scale)::value ? s0 : sw[part][1] * a;
              const int i = 4 * (j / 2) + (j % 2);
              total[part][i] = fmaf(s0, acc[S][part][i], total[part][i]);
              total[part][i + 2] = fmaf(s1, acc[S][part][i + 2], total[part][i + 2]);
            }
          }
        };
        if (!kInt4 && p.sw_row_shift == 7) promote(std::true_type{});
        else promote(std::false_type{});
      }
      // The scale loads above (f16 path: the weight fragments' loads in issue) read the stage through the
      // generic proxy; the producer's next TMA writes
      // it through the async proxy once the stage is free: a cross-proxy fence orders the two (without
      // it the H200 now and then freed the stage before those loads had read it: one token's scale of
      // one group was taken from the group `stages` later). DeepEP met the same LDS-then-TMA race
      // (deepseek-ai/DeepEP#642) and fixed it with this CTA-scope fence at no measured cost.
      sm90::FenceProxyAsyncShared();
      __syncwarp();
      sm90::MbarArriveIf(&empty[slot_stage[S]], lane == 0);
    };
    using Slot0 = std::integral_constant<int, 0>;
    // 32-bit group indices (a unit's K groups fit): 64-bit compares cost two instructions each.
    const int g1 = static_cast<int>(t.g1);
    int g = static_cast<int>(g_begin);
    static_assert(!kSync || kPipe == 2, "mma.sync: two slots (its registers always allow them)");
    if constexpr (kSync) {
      // mma.sync: always one group's MMAs in flight while the other slot's group is promoted (a warp's
      // MMAs are tracked per register, so they may run across loop edges).
      using Slot1 = std::integral_constant<int, 1>;
      if (g < g1) {
        issue(Slot0{}, Pre0{});
        for (;; g += 2) {
          if (g + 1 >= g1) { retire(Slot0{}, Pre0{}); break; }
          issue(Slot1{}, Pre1{});
          retire(Slot0{}, Pre0{});
          load_scales(Pre0{}, g + 2);
          if (g + 2 >= g1) { retire(Slot1{}, Pre1{}); break; }
          issue(Slot0{}, Pre0{});
          retire(Slot1{}, Pre1{});
          load_scales(Pre1{}, g + 3);
        }
        g = g1;
      }
    } else if constexpr (kPipe == 1 && kDirect) {
      // One group in flight (two blocks' registers, or the fused kernels' gate + up accumulators), groups
      // in pairs so that each scale slot keeps its role.
      for (; g + 1 < g1; g += 2) {
        issue(Slot0{}, Pre0{});
        sm90::WgmmaWait<0>();
        retire(Slot0{}, Pre0{});
        load_scales(Pre0{}, g + 2);
        issue(Slot0{}, Pre1{});
        sm90::WgmmaWait<0>();
        retire(Slot0{}, Pre1{});
        load_scales(Pre1{}, g + 3);
      }
    } else if constexpr (kPipe == 1 && kTp == 2) {
      // Fused gate + up: one group at a time, scales one group ahead (two ahead spills registers).
      for (; g + 1 < g1; ++g) {
        issue(Slot0{}, Pre0{});
        load_scales(Pre0{}, g + 1);
        sm90::WgmmaWait<0>();
        retire(Slot0{}, Pre0{});
      }
    } else if constexpr (kPipe == 1) {
      for (; g + 1 < g1; g += 2) {
        issue(Slot0{}, Pre0{});
        load_scales(Pre0{}, g + 2);
        sm90::WgmmaWait<0>();
        retire(Slot0{}, Pre0{});
        issue(Slot0{}, Pre1{});
        load_scales(Pre1{}, g + 3);
        sm90::WgmmaWait<0>();
        retire(Slot0{}, Pre1{});
      }
    } else {
      // Groups in pairs: group g + 1's A operand is built and its MMAs issued while group g's run, and
      // group g is promoted while g + 1's run. Nothing is in flight across a loop edge (ptxas would
      // otherwise serialize every wgmma).
      using Slot1 = std::integral_constant<int, kPipe - 1>;
      for (; g + 1 < g1; g += 2) {
        issue(Slot0{}, Pre0{});
        issue(Slot1{}, Pre1{});
        sm90::WgmmaWait<1>();
        retire(Slot0{}, Pre0{});
        load_scales(Pre0{}, g + 2);
        sm90::WgmmaWait<0>();
        retire(Slot1{}, Pre1{});
        load_scales(Pre1{}, g + 3);
      }
    }
    if constexpr (!kSync) {  // an odd last group (the mma.sync loop takes every group itself)
      if (g < g1) {
        issue(Slot0{}, Pre0{});
        sm90::WgmmaWait<0>();
        retire(Slot0{}, Pre0{});
      }
    }

    // f16 path: the tokens' largest activation scales, folded out of the f16 activations, multiplied in
    // after the stream-K fix-up has summed the pieces (a piece without a token's infinite-scale group sums to
    // 0, and 0 * Inf would turn the unit's +-Inf into NaN).
    auto apply_token_scales = [&] {
      if constexpr (kF16 || kFoldX) {
#pragma unroll
        for (int j = 0; j < kTok / 4; ++j) {
          const int i = 4 * (j / 2) + (j % 2);
          float s;
          if constexpr (kEarlyTokS) s = tok_s[j];
          else s = token_scale(j);
#pragma unroll
          for (int part = 0; part < kTp; ++part) total[part][i] *= s, total[part][i + 2] *= s;
        }
      }
    };
    if constexpr (L::kSplit) {
      // The up warpgroups' sums to the gate warpgroups, which run the epilogue: named barrier 5 says the exchange
      // buffer is written, 6 that it is read (each 256 threads arriving, 256 waiting).
      apply_token_scales();
      float4* xchg = reinterpret_cast<float4*>(staging) + ((cw % 2) * 128 + tid);
      if (my_part == 1) {
        if (exchanged) sm90::NamedBarrierSync(6, 512);  // the gate warpgroups have read the previous unit's
#pragma unroll
        for (int k = 0; k < kTok / 8; ++k)
          xchg[k * 256] = make_float4(total[0][4 * k], total[0][4 * k + 1], total[0][4 * k + 2], total[0][4 * k + 3]);
        sm90::NamedBarrierArrive(5, 512);
        exchanged = true;
      } else {
        sm90::NamedBarrierSync(5, 512);
        float up[kTok / 2];
#pragma unroll
        for (int k = 0; k < kTok / 8; ++k) {
          const float4 v = xchg[k * 256];
          up[4 * k] = v.x, up[4 * k + 1] = v.y, up[4 * k + 2] = v.z, up[4 * k + 3] = v.w;
        }
        sm90::NamedBarrierArrive(6, 512);
        FusedUpEpilogue<kTok>(p, t, total[0], up, red, cw, warp, lane, row0);
      }
    } else if constexpr (kParts == 2) {
      apply_token_scales();
      FusedUpEpilogue<kTok>(p, t, total[0], total[1], red, cw, warp, lane, row0);
    } else {
      // Epilogue: fn(i, idx) for this thread's accumulators i of rows of this batch and features < F.
      auto for_each_element = [&](auto&& fn) {
#pragma unroll
        for (int i = 0; i < kTok / 2; ++i) {
          const int64_t m = t.m0 + 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
          const int64_t f = row0 + 8 * ((i / 2) % 2);
          if (m >= t.m_end || f >= p.f) continue;
          fn(i, (m * p.h + t.head) * p.f + f);
        }
      };
      // Stream-K: a partial piece hands its sums to the fix-up; only the warp completing the unit
      // stores, the unit's sums.
      if constexpr (kCw == 2) {  // the wide tiles run whole units only (the launch checks)
        if (p.split_k > 1 && !(t.g0 == 0 && t.g1 == groups) &&
            !StreamKFixUp<kEinsum>(p, work, t, groups, cw * 128 + warp * 32 + lane, 256, cw * 4 + warp, lane,
                                   total[0]))
          continue;
      }
      if constexpr (L::kStagedStore) {
        if (staged) {
          // Staged epilogue: this warpgroup's 64 x kTok tile as bf16 into its staging rows (stmatrix, transposed
          // to token rows), then read back in 16-byte chunks, eight threads per token row, and stored with
          // 16-byte st.global (each warp instruction: four whole 128-byte rows). No TMA: the per-row bulk copies
          // this replaces took ~22k cycles per unit to drain through the SM's TMA unit (H200 trace, down
          // M = 4096), and tensor-map stores were slower still.
          const uint32_t sbase = sm90::SmemAddr(staging) + static_cast<uint32_t>(cw * kTok * L::kStoreRow);
          // Token r's multiplier at byte 128 of staging row r (past its 64 bf16 features, which neither
          // stmatrix nor the read-back touch). The previous unit read them before its second barrier.
          constexpr uint32_t kTokSOffset = 128;
          if constexpr (kStagedTokS) {
            if (tid < kTok)
              sm90::StShared32(sbase + static_cast<uint32_t>(tid * L::kStoreRow) + kTokSOffset,
                               __float_as_uint(staged_tok_s));
          }
          sm90::NamedBarrierSync(3 + cw, 128);  // the previous unit's reads of the staging are done
          if constexpr (kStagedTokS) {
#pragma unroll
            for (int j = 0; j < kTok / 4; ++j) {
              const int i = 4 * (j / 2) + (j % 2);
              const int r = 8 * (j / 2) + 2 * (lane % 4) + (j % 2);  // token_scale(j)'s row
              const float s = sm90::LdSharedF32(sbase + static_cast<uint32_t>(r * L::kStoreRow) + kTokSOffset);
              total[0][i] *= s, total[0][i + 2] *= s;
            }
          } else {
            apply_token_scales();
          }
          // Matrix q of instruction s: token block b = 2 s + q / 2 (tokens 8 b ..), feature half q % 2 of the
          // warp's 16; lane 8 q + k gives the address of token row 8 b + k.
          const int q = lane / 8, k = lane % 8;
          const uint32_t row_addr = sbase + static_cast<uint32_t>((8 * (q / 2) + k) * L::kStoreRow +
                                                                  (warp * 16 + 8 * (q % 2)) * 2);
#pragma unroll
          for (int s = 0; s < kTok / 16; ++s) {
            uint32_t r[4];
#pragma unroll
            for (int qq = 0; qq < 4; ++qq) {
              const int i = 4 * (2 * s + qq / 2) + 2 * (qq % 2);
              r[qq] = sm90::PackBf16x2(total[0][i], total[0][i + 1]);
            }
            sm90::StMatrixX4Trans(row_addr + static_cast<uint32_t>(s * 16 * L::kStoreRow), r);
          }
          sm90::NamedBarrierSync(3 + cw, 128);
          // Chunk c of token rows tid / 8 + 16 it: features f_wg + 8 c .. + 7, inside F or wholly past it (F % 8
          // == 0). A quarter warp reads one 128-byte row: no bank conflicts.
          const int c = tid % 8;
          const int64_t f = t.f0 + cw * 64 + 8 * c;
#pragma unroll
          for (int it = 0; it < kTok / 16; ++it) {
            const int r = tid / 8 + 16 * it;
            const uint4 v = sm90::LdShared128(sbase + static_cast<uint32_t>(r * L::kStoreRow + 16 * c));
            const int64_t m = t.m0 + r;
            if (m < t.m_end && f < p.f)
              *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.out) + (m * p.h + t.head) * p.f + f) = v;
          }
          continue;
        }
      }
      apply_token_scales();
      for_each_element([&](int i, int64_t idx) { StoreRounded(p, idx, total[0][i]); });
    }
  }
  // The gate warpgroups' last read of the exchange buffer has no matching wait: take it (as below).
  if constexpr (L::kSplit) {
    if (my_part == 1 && exchanged) sm90::NamedBarrierSync(6, 512);
  }
  // Warpgroup 1's last turn_pass has no matching wait: take it, so no barrier is left half-arrived.
  if constexpr (ordered) {
    if (cw == 0 && issued_any) sm90::NamedBarrierSync(1, 256);
  }
  }  // weights on the A side
}

// Activation scale of (token row, head, group g) as the caller gave it.
__device__ __forceinline__ float ActScaleAt(const void* src, ActScaleKind kind, int64_t row, int64_t head, int64_t h,
                                            int64_t groups, int64_t g) {
  switch (kind) {
    case ActScaleKind::kTensorF32: return static_cast<const float*>(src)[0];
    case ActScaleKind::kTokenF32: return static_cast<const float*>(src)[row];
    case ActScaleKind::kGroupF32: return static_cast<const float*>(src)[(row * h + head) * groups + g];
    default: return Ue8m0ToFloat(static_cast<const uint8_t*>(src)[(row * h + head) * groups + g]);
  }
}

// The largest |scale| of a token row and head over its groups (warp-collective: every lane gets it). NaN
// scales are skipped here and reach the output through their own group's ratio.
__device__ __forceinline__ float TokenScaleMax(const void* src, ActScaleKind kind, int64_t row, int64_t head,
                                               int64_t h, int64_t groups, int lane) {
  if (kind == ActScaleKind::kTensorF32 || kind == ActScaleKind::kTokenF32)
    return fabsf(ActScaleAt(src, kind, row, head, h, groups, 0));
  float v = 0.0f;
  for (int64_t g = lane; g < groups; g += 32) v = fmaxf(v, fabsf(ActScaleAt(src, kind, row, head, h, groups, g)));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// A group's scale over its token's largest (see ScaleF16x2): s * 0 where the largest is 0 (0 for a token whose
// scales are all 0, so that its totals are 0 before the multiply by 0, never Inf * 0; NaN stays NaN), and
// +-1 where |s| is the largest (an infinite scale gives +-Inf outputs, not Inf / Inf; two infinite scales of
// opposite sign in one token give +-Inf too, where float64 gives Inf - Inf = NaN).
__device__ __forceinline__ float GroupScaleRatio(float s, float s_max) {
  return s_max == 0.0f ? s * 0.0f : fabsf(s) == s_max ? copysignf(1.0f, s) : __fdiv_rn(s, s_max);
}

// ---- Folded activation scales (fold_x: int4 weights, e4m3 MMA, 128-token tiles) --------------------------
// The e4m3 path promotes each K group with total += sw * sx * partial: a token-scale load and a product per
// accumulator on top of the FFMA, a quarter of the 128-token kernel's main loop. Where each token's group scales
// differ by powers of two only (UE8M0 codes; per-token and per-tensor scales trivially), the ratios are folded
// into the e4m3 codes instead, x' = x * r_g with r_g = (s_g / s_max) 2^j (per-group scales), and the kernel
// multiplies each token's ref = s_max 2^-j in after its K loop, so that its promotion is total += sw * partial
// (as on the f16 path). j in [0, 15] lifts the token's largest |x * s| to at least 112 ref (to [112, 224] ref, or
// (224, 448] where no lift is needed), so that a group with a large scale but small codes cannot push the other
// groups' codes out of e4m3's range. Like the f16 path, the K loop then sums sw * partial before the activation
// scales: only weight scales beyond about 1e30 (a dequantized int4 weight is q * sw) could overflow float32
// there where the unfolded sums sw * sx * partial would not. x * r_g is exact unless
// it falls below e4m3's smallest normal (2^-6), where it is rounded to a multiple of 2^-9: each activation
// moves by at most 2^-10 ref < 2^-16.8 of the token's largest |x * s|. One token that cannot be folded (ratios
// not powers of two, as float32 group scales in general; a zero, subnormal, infinite or NaN largest scale; a
// lift beyond 2^15) sets the call's flag, and the call runs the unfolded kernel on the caller's codes and
// scales instead: its result is then exactly that of the unfolded kernel. The flag: the int after the token
// multipliers [H, Mp] (cleared before the preparation).
// An e4m3 magnitude code (7 bits) as float (0x7F, the NaN code, gives NaN).
__device__ __forceinline__ float E4m3MagnitudeToFloat(uint32_t mag) {
  const uint32_t h = E4m3x2ToF16x2(mag) & 0xFFFFu;
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

// The folded activations' K order (thread-major), which the folding kernel's int4 -> e4m3 conversion reads
// without a byte gather: within a 128-K group, wgmma step kc (32 K) takes from thread c = lane % 4 of a fragment
// row the int4 codes [32 c + 8 kc, + 8) (word kc of its 16-byte chunk c; Int4x8ToE4m3 puts codes + 0..3 in the
// step's columns 4 c + j and + 4..7 in 16 + 4 c + j). So step kc's column 4 c + j holds activation
// 32 c + 8 kc + j and column 16 + 4 c + j activation 32 c + 8 kc + 4 + j: in 4-byte words, word 8 kc + c of a
// folded group is word 8 c + 2 kc of the caller's, word 8 kc + 4 + c is word 8 c + 2 kc + 1; that is, the folded
// group's 16-byte chunk c is the caller's words c, c + 8, c + 16, c + 24.
// StoreFoldedKOrder writes it a warp and four groups at a time: lane (q, c) = (lane / 8, lane % 8) holds chunk c
// (words 4 c .. 4 c + 3) of its group q and stores the group's folded chunk c, gathered through the warp's stage
// of shared memory (groups 40 words apart: the gathering loads hit 32 different banks). The callers' 16-byte loads
// and these stores move 512 contiguous bytes per warp instruction where the four groups are contiguous (a lane
// per group, the former scheme, took 58 us for M = 4096, K = 7168 on the H200). dst: the group's folded codes (nullptr: none for this lane's group);
// every lane of the warp calls it.
constexpr int kFoldStageWords = 4 * 40;
constexpr int kPrepThreads = 256;  // PrepareActScalesKernel's and PrepareFoldHeldKernel's block
constexpr size_t kPrepFoldSmemBytes = kPrepThreads / 32 * 2 * kFoldStageWords * sizeof(uint32_t);  // 2 per warp
__device__ __forceinline__ void StoreFoldedKOrder(uint4 v, uint8_t* dst, uint32_t* stage, int lane) {
  const int q = lane / 8, c = lane % 8;
  __syncwarp();  // the stage's previous gathers are done
  reinterpret_cast<uint4*>(stage + 40 * q)[c] = v;
  __syncwarp();
  const uint32_t* src = stage + 40 * q + c;
  if (dst != nullptr) reinterpret_cast<uint4*>(dst)[c] = uint4{src[0], src[8], src[16], src[24]};
}

__device__ __forceinline__ uint4 LoadChunk(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

// Groups i0 .. i0 + 7 of n (fewer at the end) into dst in the folded K order, in two warp steps of four groups whose
// chunks are all loaded first: chunk(i) is this lane's 16 bytes (chunk lane % 8) of group i < n, as written.
template <typename Chunk>
__device__ __forceinline__ void StoreEightGroupsFolded(int64_t i0, int64_t n, Chunk chunk, uint8_t* dst,
                                                       uint32_t* stage, int lane) {
  const int64_t ia = i0 + lane / 8, ib = ia + 4;
  const uint4 zero{0u, 0u, 0u, 0u};
  const uint4 a = ia < n ? chunk(ia) : zero, b = ib < n ? chunk(ib) : zero;
  StoreFoldedKOrder(a, ia < n ? dst + ia * kKGroup : nullptr, stage, lane);
  StoreFoldedKOrder(b, ib < n ? dst + ib * kKGroup : nullptr, stage + kFoldStageWords, lane);
}

// The lift j of a token with largest |scale| s_max and largest |x * s| t (warp-uniform inputs); fold becomes false
// where the token cannot be folded (t or the lift out of range).
__device__ __forceinline__ int FoldLift(float s_max, float t, bool& fold) {
  int j = 0;
  if (fold && t > 0.0f) {
    const float q = 448.0f * (s_max / t);  // >= 1 up to rounding; t or q beyond float32's range: not folded
    if (t <= 3.40282347e38f && q <= 3.40282347e38f) {
      j = ilogbf(q) - 1;  // 2^j <= q / 2 < 2^(j + 2): |x r| in [112, 224]
      fold = j <= 15 && j <= ilogbf(s_max) + 126;  // r <= 2^15 (f16); ref = s_max 2^-j normal
      j = max(j, 0);
    } else {
      fold = false;
    }
  }
  return j;
}

// The largest magnitude of a 16-byte chunk of e4m3 codes, as float (NaN where the chunk holds the NaN code: fmaxf
// then skips the chunk, whose NaN reaches the output through its own products).
__device__ __forceinline__ float ChunkMaxMagnitude(uint4 v) {
  uint32_t m4 = __vmaxu4(__vmaxu4(v.x & 0x7F7F7F7Fu, v.y & 0x7F7F7F7Fu), __vmaxu4(v.z & 0x7F7F7F7Fu, v.w & 0x7F7F7F7Fu));
  m4 = __vmaxu4(m4, m4 >> 16);
  return E4m3MagnitudeToFloat(__vmaxu4(m4, m4 >> 8) & 0xFFu);
}

// The warp's largest |x * s| (t, each lane's part) and its fold verdict combined, the lift, the token's multiplier
// (lane 0 writes it to *tok_scale_at) and the call's flag where the token does not fold; returns the lift.
__device__ __forceinline__ int SettleFold(float s_max, float t, bool& fold, float* tok_scale_at, int* flag, int lane) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, off));
  fold = __all_sync(0xffffffffu, fold);
  const int j = FoldLift(s_max, t, fold);
  if (lane == 0) {
    *tok_scale_at = ldexpf(s_max, -j);
    if (!fold) *flag = 1;
  }
  return j;
}

// A 16-byte chunk of a group with scale s folded: its codes times r = (s / s_max) 2^j, rounded to f16 (+-2^-24 ..
// 2^15, or +-0). Where the token folds, s / s_max is +-2^e exactly (every nonzero |s| normal with s_max's mantissa,
// s_max normal or 0), so r is built from the exponents: the value __float2half_rn(ldexpf(__fdiv_rn(s, s_max), j))
// takes (+-2^d, d = e + j, from 2^-24 up; +-0 below, 2^-25 rounding to even 0), without the division's and ldexpf's
// instructions (16 per row and lane).
__device__ __forceinline__ uint4 FoldChunk(uint4 v, float s, float s_max, int j) {
  uint32_t h = 0;  // s_max == 0: r = +0
  if (s_max > 0.0f) {
    h = (__float_as_uint(s) >> 16) & 0x8000u;  // +-0 for s = +-0 or below f16's smallest subnormal
    const int d = static_cast<int>((__float_as_uint(s) >> 23) & 0xFFu) -
                  static_cast<int>((__float_as_uint(s_max) >> 23) & 0xFFu) + j;  // <= j <= 15
    if (s != 0.0f && d >= -14) h |= static_cast<uint32_t>(d + 15) << 10;
    else if (s != 0.0f && d >= -24) h |= 1u << (d + 24);
  }
  const uint32_t r2 = h * 0x10001u;
  return uint4{ScaleE4m3x4(v.x, r2), ScaleE4m3x4(v.y, r2), ScaleE4m3x4(v.z, r2), ScaleE4m3x4(v.w, r2)};
}

// One token row and head (a warp; warp-uniform): its folded codes into xf (per-group scales) and its multiplier;
// the call's flag set if it cannot be folded (above).
__device__ void FoldTokenActivations(const void* src, ActScaleKind kind, int64_t row, int64_t head, int64_t h,
                                     int64_t groups, int64_t mp, const uint8_t* x, uint8_t* xf, float* tok_scale,
                                     int* flag, uint32_t* stage, int lane) {
  constexpr float kMinNormal = 1.17549435e-38f;
  // Scales first (cheap): the largest |s|, and every nonzero |s| a power of two times it (NaN fails both tests).
  float s_max = 0.0f;
  for (int64_t g = lane; g < groups; g += 32) s_max = fmaxf(s_max, fabsf(ActScaleAt(src, kind, row, head, h, groups, g)));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s_max = fmaxf(s_max, __shfl_xor_sync(0xffffffffu, s_max, off));
  const uint32_t mant = __float_as_uint(s_max) & 0x7FFFFFu;
  bool fold = isfinite(s_max) && (s_max == 0.0f || s_max >= kMinNormal);  // all-zero scales: r = 0, exact
  for (int64_t g = lane; g < groups; g += 32) {
    const float as = fabsf(ActScaleAt(src, kind, row, head, h, groups, g));
    fold &= as == 0.0f || (as >= kMinNormal && (__float_as_uint(as) & 0x7FFFFFu) == mant);
  }
  const int64_t rh = row * h + head;
  const uint8_t* xr = x + rh * groups * kKGroup;
  uint8_t* yr = xf + rh * groups * kKGroup;
  // The codes, 8 lanes per K group (16 codes each), 4 groups per pass: t = max |s_g| * max |x_g| (NaN codes
  // skipped: they reach the output through their own products), then the lift j.
  float t = 0.0f;
  if (__all_sync(0xffffffffu, fold)) {
#pragma unroll 4
    for (int64_t g = lane / 8; g < groups; g += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(xr + g * kKGroup + 16 * (lane % 8));
      t = fmaxf(t, fabsf(ActScaleAt(src, kind, row, head, h, groups, g)) * ChunkMaxMagnitude(v));
    }
  } else {
    fold = false;
  }
  const int j = SettleFold(s_max, t, fold, tok_scale + head * mp + row, flag, lane);
  if (!fold) return;
  // Eight groups per warp step, written in the folded K order.
  auto fold_chunk = [&](int64_t g) {
    return FoldChunk(LoadChunk(xr + g * kKGroup + 16 * (lane % 8)), ActScaleAt(src, kind, row, head, h, groups, g),
                     s_max, j);
  };
  for (int64_t g0 = 0; g0 < groups; g0 += 8) StoreEightGroupsFolded(g0, groups, fold_chunk, yr, stage, lane);
}

// FoldTokenActivations with the token's codes held in registers (groups <= 4 kPasses; kPasses even): lane (q, c) =
// (lane / 8, lane % 8) loads chunk c of groups 4 i + q (i < kPasses) at once, computes the same largest product, lift,
// multiplier and flag from them, and folds and stores them in StoreEightGroupsFolded's order, so that each code is
// read once and all of a row's loads are in flight together. The loop above reads the codes twice, in dependent
// passes of four groups: latency-bound, it moved a 16384 x 7168 call's activations at 1.6 TB/s. H100, ncu, the
// preparation kernel alone (sixty-second session, benchmarks/NOTEBOOK.md), loop -> held: gate+up M = 4096 44 -> 33 us,
// M = 16384 147 -> 104 us; down (16 groups) M = 16384 43 -> 31 us. Same results, bit for bit.
template <int kPasses>
__device__ void FoldTokenActivationsHeld(const void* src, ActScaleKind kind, int64_t row, int64_t head, int64_t h,
                                         int64_t groups, int64_t mp, const uint8_t* x, uint8_t* xf, float* tok_scale,
                                         int* flag, uint32_t* stage, int lane) {
  static_assert(kPasses % 2 == 0, "two passes per warp step of StoreFoldedKOrder");
  constexpr float kMinNormal = 1.17549435e-38f;
  const int q = lane / 8, c = lane % 8;
  const int64_t rh = row * h + head;
  const uint8_t* xr = x + rh * groups * kKGroup;
  uint8_t* yr = xf + rh * groups * kKGroup;
  uint4 v[kPasses];
  float s[kPasses];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int64_t g = 4 * i + q;
    v[i] = g < groups ? LoadChunk(xr + g * kKGroup + 16 * c) : uint4{0u, 0u, 0u, 0u};
    s[i] = g < groups ? ActScaleAt(src, kind, row, head, h, groups, g) : 0.0f;
  }
  // The largest |s|, and every nonzero |s| a power of two times it (NaN fails both tests), as above.
  float s_max = 0.0f;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) s_max = fmaxf(s_max, fabsf(s[i]));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s_max = fmaxf(s_max, __shfl_xor_sync(0xffffffffu, s_max, off));
  const uint32_t mant = __float_as_uint(s_max) & 0x7FFFFFu;
  bool fold = isfinite(s_max) && (s_max == 0.0f || s_max >= kMinNormal);
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const float as = fabsf(s[i]);
    fold &= as == 0.0f || (as >= kMinNormal && (__float_as_uint(as) & 0x7FFFFFu) == mant);
  }
  float t = 0.0f;
  if (__all_sync(0xffffffffu, fold)) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      if (4 * i + q >= groups) continue;
      t = fmaxf(t, fabsf(s[i]) * ChunkMaxMagnitude(v[i]));
    }
  } else {
    fold = false;
  }
  const int j = SettleFold(s_max, t, fold, tok_scale + head * mp + row, flag, lane);
  if (!fold) return;
#pragma unroll
  for (int i = 0; i < kPasses; i += 2) {
    if (4 * i >= groups) break;  // warp-uniform
    const int64_t ga = 4 * i + q, gb = ga + 4;
    const uint4 a = ga < groups ? FoldChunk(v[i], s[i], s_max, j) : uint4{0u, 0u, 0u, 0u};
    const uint4 b = gb < groups ? FoldChunk(v[i + 1], s[i + 1], s_max, j) : uint4{0u, 0u, 0u, 0u};
    StoreFoldedKOrder(a, ga < groups ? yr + ga * kKGroup : nullptr, stage, lane);
    StoreFoldedKOrder(b, gb < groups ? yr + gb * kKGroup : nullptr, stage + kFoldStageWords, lane);
  }
}

// Activation scales into the kernel's layout, and the split-K workspace cleared (n_zero floats): one
// launch for both. The f16 MMA path (xh): the activations to f16 with each group's scale folded in
// (ConvertXToF16), and in the scale layout's group-0 plane each token's largest scale, which the GEMM
// applies in its epilogue (the other planes are not read there). fold_x (tok_scale set): also the folded
// activations (FoldTokenActivations; xf: the folded codes in the folded K order, per tensor or per token the
// caller's codes in that order) and the call's flag.
// kHeld > 0: a fold_x call with per-group scales and at most 4 kHeld groups, folded by FoldTokenActivationsHeld<kHeld>
// (PrepareFoldHeldKernel; the other calls, decode's included, run PrepareActScalesKernel: its registers and code).
template <int kHeld>
__device__ __forceinline__ void PrepareActScales(const void* src, ActScaleKind kind, float* dst, int64_t m, int64_t h,
                                                 int64_t groups, int64_t mp, float* zero, int64_t n_zero,
                                                 const int32_t* group_sizes, int64_t b, void* out, bool out_bf16,
                                                 int64_t f, const uint8_t* x, uint16_t* xh, float* tok_scale,
                                                 uint8_t* xf, bool zero_pad) {
  sm90::LaunchDependents();  // the GEMM's blocks may start (they wait for this grid before reading its output)
  // fold_x: each warp's two stages for the folded K order (StoreFoldedKOrder; 16-byte stores), in dynamic shared
  // memory that only a fold_x launch asks for (kPrepFoldSmemBytes, kPrepThreads): other launches' blocks take no
  // stage (only the 1 KB that the GEMM kernel's 1024-byte alignment of dynamic shared memory reserves in every
  // kernel of this file), leaving the SM's shared memory to the GEMM blocks launched as this grid's dependents.
  extern __shared__ __align__(16) uint32_t prep_fold_smem[];
  uint32_t* const fold_stage = prep_fold_smem + (threadIdx.x / 32) * (2 * kFoldStageWords);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t thread = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (xh != nullptr) {
    // The f16 MMA path's activations: a warp per token row, head and pair of groups (32 tasks of 8 codes).
    // The loop is warp-uniform (block and grid sizes are multiples of 32), as TokenScaleMax needs.
    const int lane = threadIdx.x % 32;
    const int64_t pairs = (groups + 1) / 2, warps = m * h * pairs;
    for (int64_t w = thread / 32; w < warps; w += stride / 32) {
      const int64_t rh = w / pairs, row = rh / h, head = rh % h, g = 2 * (w % pairs) + lane / 16;
      const int64_t task = ((rh * groups + g) << 4) | (lane & 15);
      // The codes and this group's scale first: their loads then overlap the largest scale's.
      const bool in = g < groups;
      const uint2 codes = in ? LoadXCodes(x, task) : uint2{0u, 0u};
      const float s = in ? ActScaleAt(src, kind, row, head, h, groups, g) : 0.0f;
      const float s_max = TokenScaleMax(src, kind, row, head, h, groups, lane);
      if (in) ConvertXToF16(codes, xh, task, GroupScaleRatio(s, s_max));
      if (w % pairs == 0 && lane == 0) dst[head * mp + row] = s_max;  // the group-0 plane (rows < m are read)
    }
  }
  // The grouped GEMM's rows past the last expert (group_sizes given): never read by the GEMM, so fold_x does
  // not check them, and under split-K their output rows are zeroed here (the GEMM's units cover the experts'
  // rows only, so that padding takes no share of the stream-K iterations: under expert parallelism most rows
  // are padding).
  __shared__ int64_t pad_start;
  if (group_sizes != nullptr) {
    if (threadIdx.x < 32) {
      int64_t rows = 0;  // each size clamped to [0, m], as the unit table does
      for (int64_t i = threadIdx.x; i < b; i += 32) rows += NextGroupEnd(0, group_sizes[i], m);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) rows += __shfl_xor_sync(0xffffffffu, rows, off);
      if (threadIdx.x == 0) pad_start = rows < m ? rows : m;
    }
    __syncthreads();
  }
  const int64_t rows_used = group_sizes != nullptr ? pad_start : m;
  if (tok_scale != nullptr) {
    int* flag = reinterpret_cast<int*>(tok_scale + h * mp);
    if (kind == ActScaleKind::kGroupF32 || kind == ActScaleKind::kGroupUe8m0) {
      // per-group scales: a warp per token row and head (warp-uniform loop, as above)
      for (int64_t w = thread / 32; w < rows_used * h; w += stride / 32) {
        if constexpr (kHeld > 0) {
          FoldTokenActivationsHeld<kHeld>(src, kind, w / h, w % h, h, groups, mp, x, xf, tok_scale, flag, fold_stage,
                                          threadIdx.x % 32);
        } else {
          FoldTokenActivations(src, kind, w / h, w % h, h, groups, mp, x, xf, tok_scale, flag, fold_stage,
                               threadIdx.x % 32);
        }
      }
    } else {  // per tensor or per token: nothing to fold; the scale is the multiplier, the codes only reordered
      for (int64_t i = thread; i < rows_used * h; i += stride) {
        const float s = ActScaleAt(src, kind, i / h, i % h, h, groups, 0);
        tok_scale[(i % h) * mp + i / h] = s;
        if (!(fabsf(s) >= 1.17549435e-38f && isfinite(s))) *flag = 1;  // 0 * Inf: the unfolded kernel
      }
      // the codes reordered: a warp per eight groups of the flat [rows, heads, groups] order (warp-uniform loop, as
      // above)
      const int64_t n_groups = rows_used * h * groups;
      const int lane = threadIdx.x % 32;
      auto chunk = [&](int64_t i) { return LoadChunk(x + i * kKGroup + 16 * (lane % 8)); };
      for (int64_t i0 = thread / 32 * 8; i0 < n_groups; i0 += stride / 32 * 8)
        StoreEightGroupsFolded(i0, n_groups, chunk, xf, fold_stage, lane);
    }
  }
  for (int64_t i = thread; i < n_zero; i += stride) zero[i] = 0.0f;
  if (zero_pad) {
    for (int64_t i = pad_start * f + thread; i < m * f; i += stride) {
      if (out_bf16) static_cast<uint16_t*>(out)[i] = 0;
      else static_cast<float*>(out)[i] = 0.0f;
    }
  }
  if (xh != nullptr) return;  // the f16 path's scales: written with its activations above
  const int64_t n = groups * h * mp;
  for (int64_t i = thread; i < n; i += stride) {
    const int64_t row = i % mp, head = (i / mp) % h, g = i / (mp * h);
    dst[i] = row < m ? ActScaleAt(src, kind, row, head, h, groups, g) : 0.0f;
  }
}

#define JAX_W4A8_PREP_PARAMS                                                                                    \
  const void *src, ActScaleKind kind, float *dst, int64_t m, int64_t h, int64_t groups, int64_t mp, float *zero, \
      int64_t n_zero, const int32_t *group_sizes, int64_t b, void *out, bool out_bf16, int64_t f, const uint8_t *x, \
      uint16_t *xh, float *tok_scale, uint8_t *xf, bool zero_pad
#define JAX_W4A8_PREP_ARGS \
  src, kind, dst, m, h, groups, mp, zero, n_zero, group_sizes, b, out, out_bf16, f, x, xh, tok_scale, xf, zero_pad

__global__ void PrepareActScalesKernel(JAX_W4A8_PREP_PARAMS) { PrepareActScales<0>(JAX_W4A8_PREP_ARGS); }

// 16 chunks held per lane (K <= 8192) take about 164 registers unbounded (one block of 8 warps per SM); two blocks
// per SM cap them at 128 (no spills). Four chunks per lane fit three blocks (72 registers).
template <int kHeld>
__global__ void __launch_bounds__(kPrepThreads, kHeld > 4 ? 2 : 3) PrepareFoldHeldKernel(JAX_W4A8_PREP_PARAMS) {
  PrepareActScales<kHeld>(JAX_W4A8_PREP_ARGS);
}
#undef JAX_W4A8_PREP_PARAMS
#undef JAX_W4A8_PREP_ARGS

// ------------------------------------------------------------------------------------------ host
PFN_cuTensorMapEncodeTiled_v12000 EncodeFn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

bool Encode3d(CUtensorMap* map, CUtensorMapDataType type, int elem_bytes, const void* base, uint64_t d0,
              uint64_t d1, uint64_t d2, uint32_t b0, uint32_t b1, uint32_t b2, CUtensorMapSwizzle swizzle) {
  auto fn = EncodeFn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[3] = {d0, d1, d2};
  const cuuint64_t strides[2] = {d0 * elem_bytes, d0 * d1 * elem_bytes};
  const cuuint32_t box[3] = {b0, b1, b2};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return fn(map, type, 3, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

struct DeviceInfo {
  int id = 0, sms = 0, major = 0, minor = 0;
  size_t smem_optin = 0;
};

DeviceInfo CurrentDevice() {
  static std::mutex mu;
  static DeviceInfo cache[64];
  static bool known[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 64 && known[dev]) return cache[dev];
  DeviceInfo info;
  info.id = dev;
  int v = 0;
  cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, dev);
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  info.smem_optin = static_cast<size_t>(v);
  if (dev < 64) { cache[dev] = info; known[dev] = true; }
  return info;
}

size_t TableBytes(int64_t nb) { return static_cast<size_t>(nb + 1) * 8 + static_cast<size_t>(nb) * 8; }

template <int kTok, bool kInt4, int kParts, bool kF16 = false, bool kTokenRows = false, bool kStreamK = false,
          bool kFoldX = false, int kCw = 2>
cudaError_t Launch(const HopperGemmParams& p, cudaStream_t stream, const DeviceInfo& dev) {
  using L = Layout<kTok, kInt4, kParts, kF16, kCw>;
  if (kCw != 2 && p.split_k != 1) return cudaErrorInvalidValue;
  const int64_t nb = p.b + 1;
  const size_t fixed = 1024 + TableBytes(nb) + 16 + L::kRedBytes + L::kStoreBytes;
  constexpr int kBlocks = Occupancy<kTok, kParts, kCw>::kBlocksPerSm;
  const size_t budget = std::min(kSmemBudget / kBlocks - (kBlocks - 1) * 2048, dev.smem_optin);
  int stages = static_cast<int>((budget - fixed - 24 * 8) / (L::kStageBytes + 24));  // + 3 mbarriers
  stages = std::max(2, std::min(stages, 8));
  const auto smem_of = [&](int n) { return static_cast<size_t>(n) * (L::kStageBytes + 24) + fixed; };
  // Fewer stages where the weight scales' lines would not fit L1 (SmemForScaleLines), on the f16 MMA path (the
  // decode tiles; the e4m3 kernels keep theirs, unmeasured).
  if constexpr (kInt4 && kF16) {
    const int64_t row_bytes = (p.k / kKGroup) * (p.sw_type == WeightScaleType::kBf16 ? 2 : 4);
    const size_t cap = SmemForScaleLines(kBlocks, int64_t{L::kFeat} * kParts, row_bytes);
    while (stages > kMinStagesForL1 && smem_of(stages) > cap) --stages;
  }
  const size_t smem = smem_of(stages);
  if (smem > dev.smem_optin) return cudaErrorInvalidConfiguration;

  CUtensorMap map_w, map_x, map_sx;
  const int64_t kb = kInt4 ? p.k / 2 : p.k;
  const int64_t w_rows = p.fused_up ? p.f + p.up_offset : p.f;
  bool ok = Encode3d(&map_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.w, kb, w_rows, p.b, kInt4 ? kKGroup / 2 : kKGroup,
                     L::kFeat, 1, kInt4 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B);
  if constexpr (kF16) {  // the f16 activations in xh, 64 K (128 bytes) per box row
    ok = ok && Encode3d(&map_x, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, p.xh, p.k, p.h, p.m, kKGroup / 2, 1, kTok,
                        CU_TENSOR_MAP_SWIZZLE_128B);  // p.xh checked by LaunchHopperGemm
  } else {
    // The folding kernel reads the folded codes (in the folded K order; per tensor or per token only reordered).
    ok = ok && Encode3d(&map_x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, kFoldX ? p.x_fold : p.x, p.k, p.h, p.m, kKGroup,
                        1, kTok, CU_TENSOR_MAP_SWIZZLE_128B);
  }
  ok = ok && Encode3d(&map_sx, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.sx, p.mp, p.h, p.k / kKGroup, L::kSxBox, 1, 1,
                      CU_TENSOR_MAP_SWIZZLE_NONE);
  if (!ok) return cudaErrorInvalidValue;

  auto kernel = HopperGemmKernel<kTok, kInt4, kParts, kF16, kTokenRows, kStreamK, kFoldX, kCw>;
  // The shared-memory opt-in once per device (to the device's limit): a host call saved on every launch.
  static std::mutex mu;
  static bool opted_in[64] = {};
  const int dev_id = dev.id;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (dev_id >= 64 || !opted_in[dev_id]) {
      if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(dev.smem_optin));
          e != cudaSuccess)
        return e;
      if (dev_id < 64) opted_in[dev_id] = true;
    }
  }
  KernelArgs args{p, stages, p.k / kKGroup};
  // Persistent: the resident blocks; under split-K no more than have partial-sum slots in the scratch.
  int64_t grid = static_cast<int64_t>(dev.sms) * kBlocks;
  if (p.split_k > 1) {
    grid = std::min(grid, (p.split_bytes - p.partial_offset * 4) / PartialBlockBytes(kTok));
    // Stream-K deals iterations in 32-bit arithmetic: iterations x blocks must stay below 2^32.
    const int64_t iters = UnitsBound(p.m, p.h, p.f, kTok, p.group_sizes != nullptr ? p.b : 0) * (p.k / kKGroup);
    if (iters * grid >= (int64_t{1} << 32)) return cudaErrorInvalidValue;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(ThreadsOf<kTok, kTokenRows, kCw>());
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.dependent_launch ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kernel, args, map_w, map_x, map_sx);
  return cudaGetLastError();  // the launch's error, if any, cleared from the thread's state as it is returned
}

// The f16 MMA path's token tiles (int4 weights; kParts 2: the fused up-projection).
template <int kParts>
cudaError_t LaunchF16(const HopperGemmParams& p, cudaStream_t stream, const DeviceInfo& dev) {
  // The unfused 8-, 16- and 32-token tiles of whole units, F a multiple of 256 (what the GPU tests cover): 256
  // weight rows per block (four consumer warpgroups, one block per SM), so that each activation tile a stage loads
  // serves twice the weight rows (at 32 tokens its f16 rows are as many L2 -> SM bytes as the 128-row int4 weight
  // tile's). Timing loop, wide / two blocks of 128 rows, 32 experts, outputs bitwise equal: H200 gate+up M = 256 /
  // 512 0.87 / 0.93, down 0.90 / 0.94; H100 gate+up / down M = 512 0.93 / 0.87, M = 256 1.00 / 0.98; H100 kernel
  // alone (ncu) gate+up M = 512 212.5 -> 199.2 us (benchmarks/NOTEBOOK.md, forty-fourth session). The 8-token
  // tile (mma.sync) too: at or below main wherever it runs (H100, three rounds: down M = 64 0.69, batch-1 down
  // 0.93; H200, two rounds: 0.87, 0.85), but within the runs' spread (kernels it does not change moved 0.92-0.98
  // on the H100; main's down M = 64 took 101-209 us) (forty-fifth session).
  const bool wide = kParts == 1 && p.split_k == 1 && p.f % 256 == 0;
  // The fused up-projection's 16- and 32-token tiles always run on four consumer warpgroups (SplitParts): 128
  // gate and 128 up rows per unit (HopperGemmSupported: I % 128 == 0, split_k 1). Its 8-token tile keeps two
  // blocks of two warpgroups per SM: on four it took 1.03x the time (H100, ncu, fifty-first session).
  if constexpr (kParts == 2) {
    if (p.split_k != 1 || p.f % kFeatTile) return cudaErrorInvalidValue;  // the handler's check comes first
  }
  switch (p.tile_tokens) {
    case 8:
      if (wide) return Launch<8, true, 1, true, false, false, false, 4>(p, stream, dev);
      return Launch<8, true, kParts, true>(p, stream, dev);
    case 16:
      if constexpr (kParts == 2) {
        return Launch<16, true, 2, true, false, false, false, 4>(p, stream, dev);
      } else {
        if (wide) return Launch<16, true, 1, true, false, false, false, 4>(p, stream, dev);
        return Launch<16, true, 1, true>(p, stream, dev);
      }
    case 32:
      if constexpr (kParts == 2) {
        return Launch<32, true, 2, true, false, false, false, 4>(p, stream, dev);
      } else {
        if (wide) return Launch<32, true, 1, true, false, false, false, 4>(p, stream, dev);
        return Launch<32, true, 1, true>(p, stream, dev);
      }
    case 64: return Launch<64, true, kParts, true>(p, stream, dev);
    case 128:
      if constexpr (kParts == 1) return Launch<128, true, 1, true>(p, stream, dev);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

bool DependentLaunchEnabled();

template <bool kInt4>
cudaError_t LaunchTok(const HopperGemmParams& p, cudaStream_t stream, const DeviceInfo& dev) {
  if constexpr (kInt4) {
    if (p.int4_f16) return LaunchF16<1>(p, stream, dev);
  }
  switch (p.tile_tokens) {
    case 16: return Launch<16, kInt4, 1>(p, stream, dev);
    case 32: return Launch<32, kInt4, 1>(p, stream, dev);
    case 64: return Launch<64, kInt4, 1>(p, stream, dev);
    case 128:
      // The block-scaled einsum (one weight scale per 128 rows) runs with tokens on the A side.
      if (!kInt4 && p.sw_row_shift == 7) {
        return p.split_k > 1 ? Launch<128, false, 1, false, true, true>(p, stream, dev)
                             : Launch<128, false, 1, false, true>(p, stream, dev);
      }
      if constexpr (kInt4) {
        if (p.x_folded) return Launch<128, true, 1, false, false, false, true>(p, stream, dev);  // folded by the caller
        if (p.fold_x) {  // the folding kernel, then the plain one (the preparation's flag lets one of them run)
          if (cudaError_t e = Launch<128, true, 1, false, false, false, true>(p, stream, dev); e != cudaSuccess)
            return e;
          HopperGemmParams q = p;
          q.dependent_launch = DependentLaunchEnabled();  // a programmatic dependent of the folding kernel
          return Launch<128, true, 1>(q, stream, dev);
        }
      }
      return Launch<128, kInt4, 1>(p, stream, dev);
    case 192:  // block-scaled einsum only (HopperGemmSupported): three consumer warpgroups of 64 tokens
      if constexpr (!kInt4) {
        return p.split_k > 1 ? Launch<192, false, 1, false, true, true>(p, stream, dev)
                             : Launch<192, false, 1, false, true>(p, stream, dev);
      }
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchFusedUp(const HopperGemmParams& p, cudaStream_t stream, const DeviceInfo& dev) {
  if (p.int4_f16) return LaunchF16<2>(p, stream, dev);
  switch (p.tile_tokens) {  // gate + up accumulators: token tiles up to 64
    case 16: return Launch<16, true, 2>(p, stream, dev);
    case 32: return Launch<32, true, 2>(p, stream, dev);
    case 64: return Launch<64, true, 2>(p, stream, dev);
    default: return cudaErrorInvalidValue;
  }
}

// Programmatic dependent launch of the GEMM after its preparation kernel (on unless JAX_W4A8_NO_PDL=1, read
// once): the GEMM's launch and prologue (barriers, unit table, tensor-map prefetch) overlap the preparation; its
// producer and consumers wait for the preparation grid (griddepcontrol.wait) before touching anything it writes.
// H200, same process, us, without / with: decode gate+up 145, 143 / 143, 140 (M = 64), 241, 240 / 229, 234
// (M = 512); down M = 64 89, 88 / 87, 86; fused up-projection M = 64 170, 170 / 164, 169; einsum M = 64 square
// 37, 38 / 33, 35, kv_a 22, 23 / 20, 20; outputs bitwise equal.
bool DependentLaunchEnabled() {
  static const bool enabled = [] {
    const char* e = std::getenv("JAX_W4A8_NO_PDL");
    return e == nullptr || e[0] == '\0' || e[0] == '0';
  }();
  return enabled;
}

}  // namespace

int CurrentSmCount() { return CurrentDevice().sms; }

bool CurrentDeviceIsSm90() {
  const DeviceInfo dev = CurrentDevice();
  return dev.major == 9 && dev.minor == 0;
}

bool HopperGemmSupported(const HopperGemmParams& p, const char** why) {
  const DeviceInfo dev = CurrentDevice();
  if (dev.major != 9) { *why = "not a Hopper (sm_90) device"; return false; }
  if (EncodeFn() == nullptr) { *why = "cuTensorMapEncodeTiled unavailable"; return false; }
  if (p.b > kMaxBatches) { *why = "more than 1024 experts/heads"; return false; }
  if (p.m >= (int64_t{1} << 31) || p.f >= (int64_t{1} << 31) || p.h >= (int64_t{1} << 31)) {
    *why = "dimension too large for TMA coordinates"; return false;
  }
  if (p.tile_tokens != 8 && p.tile_tokens != 16 && p.tile_tokens != 32 && p.tile_tokens != 64 &&
      p.tile_tokens != 128 && p.tile_tokens != 192) {
    *why = "tile_tokens must be 8, 16, 32, 64, 128 or 192"; return false;
  }
  if (p.w_int4 && p.sw_type == WeightScaleType::kUe8m0) {  // the int4 kernels load float32 or bfloat16 scales
    *why = "int4 weights take float32 or bfloat16 weight scales"; return false;
  }
  if (p.tile_tokens == 8 && !(p.w_int4 && p.int4_f16)) {
    *why = "tile_tokens 8 is for int4 weights with the f16 MMA"; return false;
  }
  if (p.tile_tokens == 192 && (p.w_int4 || p.sw_row_shift != 7)) {
    *why = "tile_tokens 192 is for the block-scaled fp8 einsum (one weight scale per 128 rows)"; return false;
  }
  if (p.int4_f16 && (!p.w_int4 || p.tile_tokens > (p.fused_up ? 64 : 128))) {
    *why = "the f16 MMA path needs int4 weights and tile_tokens <= 128 (<= 64 fused)"; return false;
  }
  if (p.fused_up && (!p.w_int4 || p.split_k != 1 || p.tile_tokens > 64 || p.f % kFeatTile)) {
    *why = "the fused up-projection needs int4 weights, split_k 1, tile_tokens <= 64 and I % 128 == 0";
    return false;
  }
  if (p.fused_up && p.sw_rows * (p.k / kKGroup) * 4 >= (int64_t{1} << 32)) {  // 32-bit offsets (kCompactScales)
    *why = "the fused up-projection takes at most 4 GiB of weight scales per expert";
    return false;
  }
  return true;
}

size_t HopperGemmF16ActivationBytes(int64_t m, int64_t h, int64_t k) {
  return (static_cast<size_t>(m * h * k) * 2 + 255) / 256 * 256;
}

size_t W4a8GroupedGemmScratchNeed(int64_t m, int64_t e, int64_t n, int64_t k, int tile_tokens, int split_k, bool f16,
                                  bool x_folded) {
  return HopperGemmScratchBytes(m, 1, n, k, split_k, tile_tokens, e) + (f16 ? HopperGemmF16ActivationBytes(m, 1, k) : 0) +
         (W4a8FoldsActivationScales(tile_tokens, f16) && !x_folded ? HopperGemmFoldBytes(m, 1, k) : 0);
}

size_t W4a8MoeUpScratchNeed(int64_t m, int64_t inter, int64_t k, bool f16) {
  return HopperGemmScratchBytes(m, 1, inter, k, 1) + (f16 ? HopperGemmF16ActivationBytes(m, 1, k) : 0);
}

size_t HopperGemmFoldTokenBytes(int64_t m, int64_t h) {
  const int64_t mp = (m + 3) / 4 * 4;
  return (static_cast<size_t>(h * mp + 1) * 4 + 255) / 256 * 256;
}

size_t HopperGemmFoldBytes(int64_t m, int64_t h, int64_t k) {
  return HopperGemmFoldTokenBytes(m, h) + (static_cast<size_t>(m * h * k) + 255) / 256 * 256;
}

size_t HopperGemmScratchBytes(int64_t m, int64_t h, int64_t f, int64_t k, int split_k, int tile_tokens,
                              int64_t grouped_batches) {
  const int64_t mp = (m + 3) / 4 * 4;
  size_t bytes = static_cast<size_t>(k / kKGroup) * h * mp * sizeof(float);
  bytes = (bytes + 255) / 256 * 256;
  if (split_k > 1) bytes += CounterBytes(m, h, f, tile_tokens, grouped_batches) + PartialBlockBytes(tile_tokens);
  return bytes;
}

cudaError_t LaunchHopperGemm(const HopperGemmParams& p, cudaStream_t stream) {
  const DeviceInfo dev = CurrentDevice();
  // x_folded: the activations come folded, so there are no activation scales to prepare (n = 0); the
  // preparation kernel runs only where split-K has counters to clear.
  const int64_t mp = (p.m + 3) / 4 * 4, n = p.x_folded ? 0 : (p.k / kKGroup) * p.h * mp;
  const bool f16_x = p.w_int4 && p.int4_f16;
  if (f16_x && p.xh == nullptr) return cudaErrorInvalidValue;
  // fold_x or x_folded: exactly the kernel that folds (HopperGemmKernel kFoldX), with its scratch or the caller's
  // folded activations.
  const bool fold_kernel = p.w_int4 && !p.int4_f16 && !p.fused_up && p.tile_tokens == 128;
  if ((p.fold_x || p.x_folded) != fold_kernel || (p.fold_x && p.x_folded)) return cudaErrorInvalidValue;
  if ((p.fold_x || p.x_folded) && (p.x_tok_scale == nullptr || p.x_fold == nullptr)) return cudaErrorInvalidValue;
  if (p.fold_x) {  // the flag after the token multipliers: cleared, then set by the preparation where it cannot fold
    if (cudaError_t e = cudaMemsetAsync(p.x_tok_scale + p.h * mp, 0, sizeof(int), stream); e != cudaSuccess) return e;
  }
  if (p.w_int4 && p.sw_type == WeightScaleType::kUe8m0) return cudaErrorInvalidValue;  // see HopperGemmSupported
  // split_k > 1: the piece counters are cleared; the partial-sum slots after them need no clearing
  // (every slot a fix-up reads was written by its piece first).
  HopperGemmParams q = p;
  q.dependent_launch = false;  // set below once the preparation kernel is on the stream
  const size_t counter_bytes =
      p.split_k > 1 ? CounterBytes(p.m, p.h, p.f, p.tile_tokens, p.group_sizes != nullptr ? p.b : 0) : 0;
  const int64_t n_zero = static_cast<int64_t>(counter_bytes / 4);
  q.partial_offset = n_zero;
  if (p.split_k > 1 && p.split_bytes < static_cast<int64_t>(counter_bytes) + PartialBlockBytes(p.tile_tokens))
    return cudaErrorInvalidValue;  // the handlers check the scratch size first
  // Grouped GEMM under split-K: the padding rows are zeroed here, not by units of the GEMM (see the kernel).
  const bool zero_padding = p.split_k > 1 && p.group_sizes != nullptr;
  if (n > 0 || n_zero > 0) {
    const int64_t work = std::max({n, n_zero, zero_padding ? p.m * p.f : int64_t{0},
                                   f16_x ? p.m * p.h * (p.k / kKGroup) * 16 : int64_t{0},
                                   p.fold_x ? p.m * p.h * 32 : int64_t{0}});
    const int blocks =
        static_cast<int>(std::min<int64_t>((work + kPrepThreads - 1) / kPrepThreads, int64_t{dev.sms} * 8));
    const size_t fold_smem = p.fold_x ? kPrepFoldSmemBytes : 0;
    // fold_x with per-group scales: the codes of a row held in registers where they fit 16 chunks per lane
    const int64_t groups = p.k / kKGroup;
    const bool held = p.fold_x && (p.sx_kind == ActScaleKind::kGroupF32 || p.sx_kind == ActScaleKind::kGroupUe8m0);
    auto prepare = held && groups <= 16 ? PrepareFoldHeldKernel<4>
                   : held && groups <= 64 ? PrepareFoldHeldKernel<16>
                                          : PrepareActScalesKernel;
    // x_folded: no scale planes to write (0 groups); the launch clears the split-K counters and padding only
    prepare<<<blocks, kPrepThreads, fold_smem, stream>>>(
        p.sx_src, p.sx_kind, p.sx, p.m, p.h, p.x_folded ? 0 : groups, mp, p.split_ws, n_zero,
        zero_padding || p.fold_x ? p.group_sizes : nullptr, p.b, p.out, p.out_bf16, p.f,
        static_cast<const uint8_t*>(p.x), f16_x ? static_cast<uint16_t*>(p.xh) : nullptr,
        p.fold_x ? p.x_tok_scale : nullptr, p.fold_x ? static_cast<uint8_t*>(p.x_fold) : nullptr, zero_padding);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    q.dependent_launch = DependentLaunchEnabled();
  }
  if (p.fused_up) return LaunchFusedUp(q, stream, dev);
  return p.w_int4 ? LaunchTok<true>(q, stream, dev) : LaunchTok<false>(q, stream, dev);
}

}  // namespace jax_w4a8
