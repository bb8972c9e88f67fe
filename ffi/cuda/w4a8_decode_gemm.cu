// The grouped W4A8 GEMM's decode kernel (ops.w4a8_grouped_gemm with kernel "decode"; the plan's choice for a
// few rows per expert, e.g. a batch-1 decode step's top-8 rows on 8 of 256 experts):
//   out[m, n] = sum_g sx(m, g) * sw(e(m), n, g) * sum_{k in g} x[m, k] * q[e(m), n, k]
// in one launch, with no scratch and no preparation kernel (SPEC 4.1: a fresh float32 accumulator per 128-K
// group, both scales applied in float32 after it, one rounding to the output type).
//
// Units of work: the rows of each expert in runs of 8 or 16 (the call's unit size; an expert with 11 rows has two
// 8-row units, of 8 and 3 rows, or one 16-row unit).
// Their number depends on group_sizes, which live on the device, so the grid provides for the most that any
// group_sizes can make (W4a8DecodeUnitBound) and each block finds its unit with a scan of group_sizes (one
// warp-wide pass per 32 experts, the sizes of 256 experts loaded at once); blocks past the last unit exit.
// Block (x, u): unit u, weight rows [16 (x / cluster), + 16); its warps and the cluster's blocks split the
// K groups into contiguous runs, summed in a fixed order (warps, then block ranks: decode_common.cuh), so
// the output is bitwise reproducible. Rows at or past the clamped total of group_sizes are padding: the
// blocks of unit 0 write their zeros.
//
// Each warp owns 16 weight rows of its unit's expert (the M side of mma.sync m16n8k16 f16 -> f32) and the
// unit's 8 or 16 tokens (the N side: NT tiles of 8). Per 128-K group a thread loads 16 bytes of rows g and g + 8
// (int4 codes [32 t, 32 t + 32), t = lane % 4; past L1) and 32 bytes of token g's (and g + 8's) activations (the
// same K range, through L1), kDepth groups in flight. A 16-token unit converts each weight fragment once for
// two MMAs: an expert with 9 to 16 rows reads and converts its weights once instead of twice. The codes become
// f16 exactly (int4_f16.cuh, the f16 path's K order), the
// e4m3 activations f16 exactly (cvt.e4m3x2, two byte permutes per 8 codes put them in that order); f16
// products are exact in the float32 accumulator.
#include "w4a8_decode_gemm.cuh"

#include <algorithm>

#include "../common/checks.h"
#include "../common/formats.h"
#include "../common/groups.h"
#include "decode_common.cuh"
#include "hopper_gemm.cuh"
#include "hopper_ptx.cuh"
#include "int4_f16.cuh"
#include "simple_tile.cuh"

namespace jax_w4a8 {
namespace {

using namespace decode;  // NOLINT(build/namespaces): the decode kernels' shared helpers and sizes

// K groups' loads in flight per warp (64 bytes of 16 rows each, and each token tile's 32 bytes per row): 4 for
// 8-row units (128 registers, and 8 bytes spilled in the block's set-up, outside the loop), 3 for 16-row units
// (157 registers: three blocks per SM; 4 spilled in the loop at that size). A 16-row unit of 8 rows or fewer still
// runs its second token tile's MMAs (on zeros; their loads are skipped): the plan takes 16-row units only where
// experts are expected to hold more than 8 rows.
template <int NT>
constexpr int kDepth = NT == 1 ? 4 : 3;
constexpr int kGroupBytes = 64;      // int4 bytes of a row per 128-K group
constexpr int kSizesPerPass = 256;   // group_sizes loaded at once by a warp (8 per lane)

struct Unit {
  int expert = 0, row0 = 0, rows = 0;  // rows == 0: no such unit
};

// Unit u (the u-th run of at most kTokens rows of one expert, experts in order) and, with want_total, the
// clamped total of rows. Every lane of the warp runs it and gets the same result. Sizes are clamped as
// everywhere (common/groups.h): negative counts as 0, the running end cut at M. m < 2^30 (W4a8DecodeUnsupported).
template <int kTokens>
__device__ Unit FindUnit(const W4a8DecodeParams& p, int u, int lane, bool want_total, int& total) {
  Unit r;
  const int m = static_cast<int>(p.m);
  int end_carry = 0, unit_carry = 0;  // rows and units of the experts before this pass
  bool found = false, done = false;
  for (int64_t base = 0; base < p.e && !done; base += kSizesPerPass) {
    int32_t size[kSizesPerPass / 32];
#pragma unroll
    for (int i = 0; i < kSizesPerPass / 32; ++i) {
      const int64_t e = base + 32 * i + lane;
      size[i] = e < p.e ? __ldg(p.group_sizes + e) : 0;
    }
#pragma unroll
    for (int i = 0; i < kSizesPerPass / 32; ++i) {
      if (done) break;
      int v = static_cast<int>(NextGroupEnd(0, size[i], m));  // clamped size
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {  // inclusive scan with min(x + y, m)
        const int other = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v = min(v + other, m);
      }
      const int up = __shfl_up_sync(0xffffffffu, v, 1);
      const int start = lane == 0 ? end_carry : min(end_carry + up, m);
      const int end = min(end_carry + v, m);
      const int units = (end - start + kTokens - 1) / kTokens;
      int c = units;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {  // inclusive scan of the units
        const int other = __shfl_up_sync(0xffffffffu, c, off);
        if (lane >= off) c += other;
      }
      const int u_end = unit_carry + c, u_start = u_end - units;
      const unsigned hit = __ballot_sync(0xffffffffu, !found && units > 0 && u >= u_start && u < u_end);
      if (hit != 0) {
        const int src = __ffs(hit) - 1;
        const int s_start = __shfl_sync(0xffffffffu, start, src), s_end = __shfl_sync(0xffffffffu, end, src);
        const int s_ustart = __shfl_sync(0xffffffffu, u_start, src);
        r.expert = static_cast<int>(base) + 32 * i + src;
        r.row0 = s_start + kTokens * (u - s_ustart);
        r.rows = min(kTokens, s_end - r.row0);
        found = true;
      }
      end_carry = min(end_carry + __shfl_sync(0xffffffffu, v, 31), m);
      unit_carry += __shfl_sync(0xffffffffu, c, 31);
      // Later experts have no rows once the end reaches M; the total is only needed by unit 0's blocks.
      done = end_carry >= m || (found && !want_total);
    }
  }
  total = end_carry;
  return r;
}

// One K group's operands of one thread, as loaded (NT token tiles of 8: token j of tile n is unit row 8 n + j).
template <int NT>
struct Operands {
  uint4 w[2];       // rows g, g + 8: bytes [16 t, +16) of the group (codes [32 t, 32 t + 32))
  uint4 x[NT][2];   // token g of each tile: bytes [32 t, +32) of the group (the same K range)
  float sw[2];      // rows g, g + 8
  float sx[NT][2];  // tokens 2 t, 2 t + 1 of each tile (the accumulators' columns)
};

// Where a warp's operands live.
template <int NT>
struct View {
  const uint8_t* wrow[2];  // rows g, g + 8 at byte 16 t (nullptr: past N)
  const float* swf[2];     // their float32 scales (or bfloat16 in swb)
  const uint16_t* swb[2];
  const uint8_t* xrow[NT];  // token g of each tile at byte 32 t (nullptr: past the unit's rows)
  const float* sx[NT][2];   // tokens 2 t, 2 t + 1 of each tile: the scale of group 0 (nullptr: past the unit's rows)
  int sx_stride;            // 1 (per group), 0 (per token or tensor)
};

template <int NT>
__device__ __forceinline__ void LoadGroup(const View<NT>& v, int64_t grp, Operands<NT>& q) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (v.wrow[i] != nullptr) {
      q.w[i] = LoadStreamed(v.wrow[i] + grp * kGroupBytes);
      q.sw[i] = v.swf[i] != nullptr ? __ldg(v.swf[i] + grp) : Bf16BitsToFloat(__ldg(v.swb[i] + grp));
    } else {
      q.w[i] = make_uint4(0, 0, 0, 0);
      q.sw[i] = 0.0f;
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    if (v.xrow[n] != nullptr) {
      const uint8_t* px = v.xrow[n] + grp * kGroup;
      q.x[n][0] = __ldg(reinterpret_cast<const uint4*>(px));
      q.x[n][1] = __ldg(reinterpret_cast<const uint4*>(px + 16));
    } else {
      q.x[n][0] = q.x[n][1] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) q.sx[n][e] = v.sx[n][e] != nullptr ? __ldg(v.sx[n][e] + grp * v.sx_stride) : 0.0f;
  }
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

__device__ __forceinline__ uint32_t Permute(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// tot += this group's MMAs (a fresh float32 accumulator per token tile) times both scales. Word q of a row's
// chunk holds codes 32 t + 8 q + j (j < 8) and makes K16 steps 2 q (codes j, j + 4 for j = 0, 1) and 2 q + 1
// (j = 2, 3) (Int4WordsToF16Fragments); a token's bytes 8 q .. 8 q + 7 (words 2 q, 2 q + 1) are permuted to the
// same pairs, (0, 4) (1, 5) and (2, 6) (3, 7), and converted. The weight fragments serve every token tile.
template <int NT>
__device__ __forceinline__ void ComputeGroup(const Operands<NT>& q, float (&tot)[NT][4]) {
  float c[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t a0[4], a1[4];
    Int4WordsToF16Fragments(Word(q.w[0], w), Word(q.w[1], w), a0, a1);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const uint32_t lo = Word(q.x[n][w / 2], 2 * (w % 2)), hi = Word(q.x[n][w / 2], 2 * (w % 2) + 1);
      const uint32_t p0 = Permute(lo, hi, 0x5140u), p1 = Permute(lo, hi, 0x7362u);
      sm90::MmaF16(c[n], a0, E4m3x2ToF16x2(p0), E4m3x2ToF16x2(p0 >> 16));
      sm90::MmaF16(c[n], a1, E4m3x2ToF16x2(p1), E4m3x2ToF16x2(p1 >> 16));
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) AddScaledTile(tot[n], c[n], q.sw, q.sx[n]);
}

template <int NT, int D>
__global__ void __launch_bounds__(kMaxWarps * 32) W4a8DecodeKernel(W4a8DecodeParams p, int cluster) {
  constexpr int kTokens = 8 * NT;  // rows per unit
  __shared__ float red[kMaxWarps][4 * NT][32];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // The cluster is (cluster, 1, 1) along x (Launch): its blocks share the unit and the row tile.
  const int rank = static_cast<int>(blockIdx.x % cluster);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x / cluster) * kRows;
  const bool zeroes = blockIdx.y == 0 && rank == 0 && warp == 0;
  int total = 0;
  const Unit unit = FindUnit<kTokens>(p, static_cast<int>(blockIdx.y), lane, zeroes, total);
  if (zeroes) {  // padding rows [total, M) of this block's 16 columns
    const int64_t pad = p.m - total;
    for (int64_t i = lane; i < pad * kRows; i += 32) {
      const int64_t col = r0 + i % kRows;
      if (col < p.n) simple::Store(p.out, p.out_bf16, (total + i / kRows) * p.n + col, 0.0f);
    }
  }
  if (unit.rows == 0) return;  // past the last unit (the whole cluster: same unit)

  int64_t g_begin, g_end;
  SplitKRange(p.groups, rank * warps + warp, cluster * warps, g_begin, g_end);
  const int64_t steps = g_end - g_begin;
  View<NT> v;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = r0 + g + 8 * i;
    const bool ok = row < p.n;
    const int64_t wr = static_cast<int64_t>(unit.expert) * p.n + row;
    v.wrow[i] = ok ? p.w + wr * (p.k / 2) + 16 * t : nullptr;
    v.swf[i] = ok && !p.w_scale_bf16 ? static_cast<const float*>(p.w_scale) + wr * p.groups : nullptr;
    v.swb[i] = ok && p.w_scale_bf16 ? static_cast<const uint16_t*>(p.w_scale) + wr * p.groups : nullptr;
  }
  v.sx_stride = p.x_scale_kind == static_cast<int>(XScaleKind::kGroup) ? 1 : 0;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    v.xrow[n] = 8 * n + g < unit.rows ? p.x + static_cast<int64_t>(unit.row0 + 8 * n + g) * p.k + 32 * t : nullptr;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = 8 * n + 2 * t + e;
      const int64_t row = unit.row0 + j;
      v.sx[n][e] = j >= unit.rows ? nullptr
                   : p.x_scale_kind == static_cast<int>(XScaleKind::kTensor) ? p.x_scale
                   : p.x_scale_kind == static_cast<int>(XScaleKind::kToken)  ? p.x_scale + row
                                                                             : p.x_scale + row * p.groups;
    }
  }

  float tot[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) tot[n][0] = tot[n][1] = tot[n][2] = tot[n][3] = 0.0f;
  Operands<NT> buf[D];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < steps) LoadGroup(v, g_begin + d, buf[d]);
  for (int64_t it = 0; it < steps; it += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (it + d < steps) {
        ComputeGroup(buf[d], tot);
        if (it + d + D < steps) LoadGroup(v, g_begin + it + d + D, buf[d]);
      }
    }
  }

  SumSplitK(&red[0][0][0], warps, warp, lane, cluster, rank, tot);
  if (rank != 0 || warp != 0) return;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 8 * n + 2 * t + (i & 1);
      const int64_t col = r0 + g + 8 * (i >> 1);
      if (j < unit.rows && col < p.n)
        simple::Store(p.out, p.out_bf16, static_cast<int64_t>(unit.row0 + j) * p.n + col, tot[n][i]);
    }
}

struct Plan {
  int warps, cluster;
};

// As the fp8 einsum's decode plan at more than one token tile (fp8_decode_gemm.cu PlanFp8Decode): four warps per
// block, at least one K group per warp, and a cluster of up to 8 blocks splitting K while fewer than 12 warps per SM
// would run.
Plan PlanW4a8Decode(int64_t units, int64_t n, int64_t groups, int sms) {
  const int64_t tiles = units * ((n + kRows - 1) / kRows);
  Plan plan{static_cast<int>(std::min<int64_t>(kMaxWarps, std::max<int64_t>(groups, 1))), 1};
  while (plan.cluster < kMaxCluster && tiles * plan.cluster * plan.warps < 12LL * sms &&
         2LL * plan.cluster * plan.warps <= groups)
    plan.cluster *= 2;
  return plan;
}

}  // namespace

bool W4a8DecodeUnitRowsValid(int unit_rows) { return unit_rows == 8 || unit_rows == 16; }

int64_t W4a8DecodeUnitBound(int64_t m, int64_t e, int unit_rows) {
  // sum_e ceil(r_e / R) <= sum over experts with rows of (r_e + R - 1) / R <= (M + (R - 1) min(E, M)) / R
  return std::max<int64_t>(1, (m + (unit_rows - 1) * std::min(e, m) + unit_rows - 1) / unit_rows);
}

const char* W4a8DecodeUnsupported(int64_t m, int64_t e, int unit_rows) {
  if (!W4a8DecodeUnitRowsValid(unit_rows)) return "its units hold 8 or 16 rows (tile_tokens 8 or 16)";
  if (W4a8DecodeUnitBound(m, e, unit_rows) > 65535)
    return "it takes at most 65535 units of work (M + (tile_tokens - 1) min(E, M) <= 65535 tile_tokens)";
  return nullptr;
}

cudaError_t LaunchW4a8Decode(const W4a8DecodeParams& p, int unit_rows, cudaStream_t stream) {
  const int64_t units = W4a8DecodeUnitBound(p.m, p.e, unit_rows);
  const Plan plan = PlanW4a8Decode(units, p.n, p.groups, CurrentSmCount());
  cudaLaunchAttribute attr;
  const dim3 grid(static_cast<unsigned>((p.n + kRows - 1) / kRows * plan.cluster), static_cast<unsigned>(units));
  cudaLaunchConfig_t cfg = decode::ClusterLaunchConfig(grid, plan.warps, plan.cluster, stream, attr);
  if (unit_rows == 16) return cudaLaunchKernelEx(&cfg, W4a8DecodeKernel<2, kDepth<2>>, p, plan.cluster);
  return cudaLaunchKernelEx(&cfg, W4a8DecodeKernel<1, kDepth<1>>, p, plan.cluster);
}

}  // namespace jax_w4a8
