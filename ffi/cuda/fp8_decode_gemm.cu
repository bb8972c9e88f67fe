// The fp8 einsum's decode kernels (ops.fp8_einsum with tile_tokens 8; the plan's choice for M <= 8):
//   out[m, h, n] = sum_g sx[m, h, g] * sw(h, n, g) * sum_{k in g} x[m, h, k] * w[h, n, k]
// for at most 32 tokens, in one launch with no scratch and no scale preparation.
//
// Each warp owns 16 weight rows of one head (the M side of mma.sync m16n8k32 e4m3 -> f32) and a
// contiguous run of K groups; the tokens are the MMA's N side, in 8-token tiles (1, 2 or 4 of them).
// A fresh float32 accumulator per group, both scales applied in float32 after it (SPEC 4.2). Within a
// 128-K group a thread's 32 bytes of a row are [16t, 16t + 16) and [64 + 16t, 64 + 16t + 16)
// (t = lane % 4): the MMA's k order is a permutation of the group's, the same for weights and
// activations. The operands reach the MMA fragments one of two ways:
//  - Fp8DecodeKernel: straight from global memory: weights with 16-byte loads that skip L1 (each byte is
//    read once), activations and scales through L1 (every warp of the SM reads them); every 8 lanes of a
//    load read 64 contiguous bytes of a row. Two groups' loads are in flight per warp.
//  - Fp8DecodeStagedKernel (split K, one token tile, at least kStagedMinGroups K groups per warp): through
//    the warp's own shared-memory stages, filled by cp.async in 256-byte runs of a row (the pattern that
//    reads HBM at copy speed: benchmarks/read_bandwidth_o_proj.cu), two stages of two groups in flight.
//
// Schedules (PlanFp8Decode): split K, where the warps of a block split the K groups of the block's 16
// rows and a cluster of up to 8 blocks splits them further (partial tiles summed in warp order, then
// in block-rank order through distributed shared memory; rank 0's first warp rounds and stores); or,
// for many tiles of few K groups (MLA absorb_q: 4096 tiles of one group), whole tiles, where one wave
// of warps walks the tiles, each over all K groups, the loads running ahead across tiles. Either way the
// summation order is fixed, so outputs are bitwise reproducible. Rows past N and tokens past M are
// neither read nor written.
#include "fp8_decode_gemm.cuh"

#include <algorithm>
#include <mutex>

#include "../common/formats.h"
#include "decode_common.cuh"
#include "hopper_gemm.cuh"
#include "hopper_ptx.cuh"

namespace jax_w4a8 {
namespace {

using namespace decode;  // NOLINT(build/namespaces): the decode kernels' shared helpers and sizes

// One K group's operands of one thread, as loaded.
template <int NT>
struct Operands {
  uint4 w[2][2];    // rows g and g + 8: bytes [16t, +16) and [64 + 16t, +16) of the group
  float sw[2];      // rows g, g + 8
  float sx[NT][2];  // tokens 8j + 2t, 8j + 2t + 1 (the accumulator's columns)
  uint4 x[NT][2];   // token 8j + g: the same bytes of the activations
};

__device__ __forceinline__ float LoadScale(const void* s, bool ue8m0, int64_t idx) {
  return ue8m0 ? Ue8m0ToFloat(__ldg(static_cast<const uint8_t*>(s) + idx)) : __ldg(static_cast<const float*>(s) + idx);
}

__device__ __forceinline__ uint32_t Word(const uint4 (&v)[2], int i) {
  const uint4& h = v[i / 4];
  const int j = i % 4;
  return j == 0 ? h.x : j == 1 ? h.y : j == 2 ? h.z : h.w;
}

__device__ __forceinline__ void MmaE4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where a warp's operands of one 16-row tile live, and which of them exist.
template <int NT>
struct TileView {
  int64_t head, row[2];
  bool row_ok[2];
  const uint8_t* wrow[2];
  int64_t swrow[2];
  int64_t sxrow[NT][2];
  bool sx_ok[NT][2];

  __device__ __forceinline__ void Set(const Fp8DecodeParams& p, int64_t tile, int64_t tiles_n, int g, int t) {
    head = tile / tiles_n;
    const int64_t r0 = (tile - head * tiles_n) * kRows;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row[i] = r0 + g + 8 * i;
      row_ok[i] = row[i] < p.n;
      wrow[i] = p.w + (head * p.n + (row_ok[i] ? row[i] : 0)) * p.k + 16 * t;
      swrow[i] = (head * p.w_scale_rows + ((row_ok[i] ? row[i] : 0) >> p.w_row_shift)) * p.groups;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t ms = 8 * j + 2 * t + e;
        sx_ok[j][e] = ms < p.m;
        sxrow[j][e] = ((sx_ok[j][e] ? ms : 0) * p.h + head) * p.groups;
      }
    }
  }
};

template <int NT>
__device__ __forceinline__ void LoadGroup(const Fp8DecodeParams& p, const TileView<NT>& v, const uint8_t* const (&xrow)[NT],
                                          int64_t grp, Operands<NT>& q) {
  const int64_t off = grp * kGroup;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (v.row_ok[i]) {
      q.w[i][0] = LoadStreamed(v.wrow[i] + off);
      q.w[i][1] = LoadStreamed(v.wrow[i] + off + 64);
      q.sw[i] = LoadScale(p.w_scale, p.w_ue8m0, v.swrow[i] + grp);
    } else {
      q.w[i][0] = q.w[i][1] = make_uint4(0, 0, 0, 0);
      q.sw[i] = 0.0f;
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (xrow[j] != nullptr) {
      const uint8_t* px = xrow[j] + v.head * p.k + off;
      q.x[j][0] = __ldg(reinterpret_cast<const uint4*>(px));
      q.x[j][1] = __ldg(reinterpret_cast<const uint4*>(px + 64));
    } else {
      q.x[j][0] = q.x[j][1] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) q.sx[j][e] = v.sx_ok[j][e] ? LoadScale(p.x_scale, p.x_ue8m0, v.sxrow[j][e] + grp) : 0.0f;
  }
}

// tot += this group's MMAs (a fresh float32 accumulator) times both scales.
template <int NT>
__device__ __forceinline__ void ComputeGroup(const Operands<NT>& q, float (&tot)[NT][4]) {
  float c[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k32 steps: words 2s and 2s + 1 of each operand
#pragma unroll
    for (int j = 0; j < NT; ++j)
      MmaE4m3(c[j], Word(q.w[0], 2 * s), Word(q.w[1], 2 * s), Word(q.w[0], 2 * s + 1), Word(q.w[1], 2 * s + 1),
              Word(q.x[j], 2 * s), Word(q.x[j], 2 * s + 1));
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) AddScaledTile(tot[j], c[j], q.sw, q.sx[j]);
}

template <int NT>
__device__ __forceinline__ void StoreTile(const Fp8DecodeParams& p, int64_t tile, int64_t tiles_n, int g, int t,
                                          const float (&tot)[NT][4]) {
  const int64_t head = tile / tiles_n, r0 = (tile - head * tiles_n) * kRows;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t m = 8 * j + 2 * t + (i & 1), row = r0 + g + 8 * (i >> 1);
      if (m >= p.m || row >= p.n) continue;
      const int64_t idx = (m * p.h + head) * p.n + row;
      if (p.out_bf16) static_cast<uint16_t*>(p.out)[idx] = FloatToBf16Bits(tot[j][i]);
      else static_cast<float*>(p.out)[idx] = tot[j][i];
    }
}

constexpr int kDepth = 2;  // groups' loads in flight per warp

// Two schedules (Fp8DecodeLaunch::whole_tiles):
//  whole tiles: warp w of the grid takes tiles w, w + all warps, ... each over all K groups, and stores them;
//  split K:     block (x, head) takes row tile x / cluster; its warps and the cluster's blocks split the K
//               groups into contiguous runs, summed in a fixed order (warps, then block ranks).
// Either way a warp walks one sequence of (tile, group) steps with kDepth groups' loads in flight.
template <int NT>
__global__ void __launch_bounds__(kMaxWarps * 32) Fp8DecodeKernel(Fp8DecodeParams p, Fp8DecodeLaunch plan) {
  constexpr int D = kDepth;
  __shared__ float red[kMaxWarps][4 * NT][32];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t tiles_n = (p.n + kRows - 1) / kRows, tiles = tiles_n * p.h;
  const int cluster = plan.cluster;
  // The cluster is (cluster, 1, 1) along x (Launch), so a block's rank in it is blockIdx.x % cluster.
  const int rank = plan.whole_tiles ? 0 : static_cast<int>(blockIdx.x % cluster);
  int64_t tile0, tile_stride, n_tiles, g_begin, g_end;
  if (plan.whole_tiles) {
    tile0 = static_cast<int64_t>(blockIdx.x) * warps + warp;
    tile_stride = static_cast<int64_t>(gridDim.x) * warps;
    n_tiles = tile0 < tiles ? (tiles - 1 - tile0) / tile_stride + 1 : 0;
    g_begin = 0, g_end = p.groups;
  } else {
    tile0 = blockIdx.y * tiles_n + blockIdx.x / cluster;
    tile_stride = 1, n_tiles = 1;
    SplitKRange(p.groups, rank * warps + warp, cluster * warps, g_begin, g_end);
  }
  const int64_t per_tile = g_end - g_begin, steps = n_tiles * per_tile;

  float tot[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) tot[j][0] = tot[j][1] = tot[j][2] = tot[j][3] = 0.0f;
  const uint8_t* xrow[NT];  // token 8j + g's activations at byte 16t of head 0 (nullptr past M)
#pragma unroll
  for (int j = 0; j < NT; ++j) xrow[j] = 8 * j + g < p.m ? p.x + (8 * j + g) * p.h * p.k + 16 * t : nullptr;
  TileView<NT> lv;  // the tile being loaded (c_tile: the one being computed)
  int64_t l_tile = tile0, l_grp = g_begin, c_tile = tile0, c_grp = g_begin;
  if (steps > 0) lv.Set(p, l_tile, tiles_n, g, t);
  auto load_next = [&](Operands<NT>& q) {
    LoadGroup(p, lv, xrow, l_grp, q);
    if (++l_grp == g_end) {
      l_grp = g_begin, l_tile += tile_stride;
      if (l_tile < tiles) lv.Set(p, l_tile, tiles_n, g, t);
    }
  };
  Operands<NT> buf[D];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < steps) load_next(buf[d]);
  for (int64_t it = 0; it < steps; it += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (it + d < steps) {
        ComputeGroup(buf[d], tot);
        if (it + d + D < steps) load_next(buf[d]);
        if (++c_grp == g_end && plan.whole_tiles) {  // a whole tile is done: store it, go on with the next
          StoreTile(p, c_tile, tiles_n, g, t, tot);
#pragma unroll
          for (int j = 0; j < NT; ++j) tot[j][0] = tot[j][1] = tot[j][2] = tot[j][3] = 0.0f;
          c_grp = g_begin, c_tile += tile_stride;
        }
      }
    }
  }
  if (plan.whole_tiles) return;

  SumSplitK(&red[0][0][0], warps, warp, lane, cluster, rank, tot);
  if (rank == 0 && warp == 0) StoreTile(p, c_tile, tiles_n, g, t, tot);
}

// ------------------------------------------------------------------------ the staged split-K kernel
// Each warp has kDepth stages of its own in shared memory, a stage holding kStageGroups K groups (kRun bytes
// of a row) of its 16 weight rows and 8 NT token rows, filled by cp.async: a warp's copy instruction reads
// kRun contiguous bytes of each of 512 / kRun rows, weights past L1, activations through it. Fragments are
// read back with 16-byte LDS. In a stage, row r's 16-byte chunk c sits at chunk c ^ (4 (r & 1)) of its row:
// the fragment reads of a quarter warp (rows 2i, 2i + 1, chunks t or 4 + t) and the copies (16 consecutive
// chunks of a row) meet eight distinct bank groups. The scales go to registers when a stage is issued.
// H200, kernel time under ncu (benchmarks/profile_case.py, 20 calls, medians, us), Fp8DecodeKernel vs this
// kernel at one token: o_proj (32 groups per warp) 38.4 vs 34.4, V4-Pro wo_a (16) 23.7 vs 22.0, 7168 x 7168
// (14) 19.2 vs 18.6, q_a (3.5) 9.9 vs 9.7; where a warp has few groups it loses: 7168 x 2048 (4) 8.7 vs 9.1,
// kv_a (1.75) 6.8 vs 7.3, MLA absorb_o (2) 7.4 vs 8.4.
constexpr int kStagedMinGroups = 8;              // K groups per warp from which PlanFp8Decode takes this kernel
constexpr int kStageGroups = 2;                  // K groups per stage
constexpr int kRun = kStageGroups * kGroup;      // bytes of a row per stage
constexpr int kLanesPerRow = kRun / 16;          // lanes copying one row's run
constexpr int kRowsPerCopy = 32 / kLanesPerRow;  // rows per copy instruction
static_assert(kLanesPerRow <= 32 && 32 % kLanesPerRow == 0, "a copy instruction covers whole row runs");

template <int NT>
constexpr int StageRows() { return kRows + 8 * NT; }  // weight rows, then token rows
template <int NT>
constexpr uint32_t StageBytes() { return StageRows<NT>() * kRun; }
template <int NT>
constexpr size_t StagedSmemBytes(int warps) { return size_t{kDepth} * StageBytes<NT>() * warps; }
static_assert(StagedSmemBytes<1>(kMaxWarps) <= 48 * 1024, "one token tile's stages need no shared-memory opt-in");
static_assert(kDepth * StageBytes<1>() >= 4 * 32 * sizeof(float), "a warp's stages hold its split-K partial tile");

// Byte offset of row r's 16-byte chunk c in a stage.
__device__ __forceinline__ uint32_t StageOffset(int r, int c) {
  return static_cast<uint32_t>(r * kRun + ((c ^ (4 * (r & 1))) * 16));
}

// One stage's scales in one thread: per K group, rows g, g + 8 and tokens 8j + 2t, 8j + 2t + 1.
template <int NT>
struct StageScales {
  float sw[kStageGroups][2];
  float sx[kStageGroups][NT][2];
};

// What a warp needs to issue the copies and scale loads of its 16-row tile.
template <int NT>
struct StagedTile {
  int64_t head;
  const uint8_t* wcopy;  // this lane's copy row (tile row lane / kLanesPerRow) at its chunk
  int rows_left;         // tile rows from this lane's copy row on that exist (copy i: row + kRowsPerCopy i)
  bool row_ok[2];        // the MMA rows g, g + 8
  int64_t swrow[2];
  int64_t sxrow[NT][2];
  bool sx_ok[NT][2];

  __device__ __forceinline__ void Set(const Fp8DecodeParams& p, int64_t tile, int64_t tiles_n, int lane) {
    const int g = lane / 4, t = lane % 4;
    head = tile / tiles_n;
    const int64_t r0 = (tile - head * tiles_n) * kRows;
    const int64_t crow = r0 + lane / kLanesPerRow;
    rows_left = static_cast<int>(std::min<int64_t>(std::max<int64_t>(p.n - crow, 0), kRows));
    wcopy = p.w + (head * p.n + (rows_left > 0 ? crow : 0)) * p.k + 16 * (lane % kLanesPerRow);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t row = r0 + g + 8 * i;
      row_ok[i] = row < p.n;
      swrow[i] = (head * p.w_scale_rows + ((row_ok[i] ? row : 0) >> p.w_row_shift)) * p.groups;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t ms = 8 * j + 2 * t + e;
        sx_ok[j][e] = ms < p.m;
        sxrow[j][e] = ((sx_ok[j][e] ? ms : 0) * p.h + head) * p.groups;
      }
    }
  }
};

// Issues the copies of groups [grp, grp + cnt) of the tile into the stage at `stage` (shared address) and
// loads their scales. Groups past cnt and token rows past M are not copied (their scales are 0).
template <int NT>
__device__ __forceinline__ void IssueStage(const Fp8DecodeParams& p, const StagedTile<NT>& v, int64_t grp, int cnt,
                                           uint32_t stage, int lane, StageScales<NT>& q) {
  const int c = lane % kLanesPerRow, r = lane / kLanesPerRow;
  const bool group_ok = c / 8 < cnt;
  const int64_t off = grp * kGroup;
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerCopy; ++i)
    if (group_ok && kRowsPerCopy * i < v.rows_left)
      sm90::CpAsyncCg16(stage + StageOffset(r + kRowsPerCopy * i, c), v.wcopy + kRowsPerCopy * i * p.k + off);
#pragma unroll
  for (int i = 0; i < 8 * NT / kRowsPerCopy; ++i) {
    const int m = r + kRowsPerCopy * i;
    if (group_ok && m < p.m)
      sm90::CpAsyncCa16(stage + StageOffset(kRows + m, c), p.x + (m * p.h + v.head) * p.k + off + 16 * c);
  }
#pragma unroll
  for (int s = 0; s < kStageGroups; ++s) {
    const bool ok = s < cnt;
#pragma unroll
    for (int i = 0; i < 2; ++i)
      q.sw[s][i] = ok && v.row_ok[i] ? LoadScale(p.w_scale, p.w_ue8m0, v.swrow[i] + grp + s) : 0.0f;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        q.sx[s][j][e] = ok && v.sx_ok[j][e] ? LoadScale(p.x_scale, p.x_ue8m0, v.sxrow[j][e] + grp + s) : 0.0f;
  }
}

// tot += the stage's first cnt groups: per group a fresh float32 accumulator of 4 k32 MMAs per token tile,
// then both scales (ComputeGroup's math on operands read from the stage).
template <int NT>
__device__ __forceinline__ void ComputeStage(uint32_t stage, int cnt, int lane, const StageScales<NT>& q,
                                             float (&tot)[NT][4]) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < kStageGroups; ++s) {
    if (s >= cnt) break;
    Operands<NT> o;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      o.w[i][0] = sm90::LdShared128(stage + StageOffset(g + 8 * i, 8 * s + t));
      o.w[i][1] = sm90::LdShared128(stage + StageOffset(g + 8 * i, 8 * s + 4 + t));
      o.sw[i] = q.sw[s][i];
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      o.x[j][0] = sm90::LdShared128(stage + StageOffset(kRows + 8 * j + g, 8 * s + t));
      o.x[j][1] = sm90::LdShared128(stage + StageOffset(kRows + 8 * j + g, 8 * s + 4 + t));
      o.sx[j][0] = q.sx[s][j][0];
      o.sx[j][1] = q.sx[s][j][1];
    }
    ComputeGroup(o, tot);
  }
}

// Split K only: block (x, head) takes row tile x / cluster; its warps and the cluster's blocks split the K
// groups into contiguous runs (as Fp8DecodeKernel), each warp walking its run in stages, kDepth in flight.
template <int NT>
__global__ void __launch_bounds__(kMaxWarps * 32, NT == 1 ? 4 : 2)
    Fp8DecodeStagedKernel(Fp8DecodeParams p, Fp8DecodeLaunch plan) {
  static_assert(NT == 1, "more token tiles need more than 48 KB of stages per block (a shared-memory opt-in)");
  constexpr int D = kDepth;
  constexpr uint32_t kStage = StageBytes<NT>();
  extern __shared__ __align__(128) uint8_t smem[];  // [warps][D] stages; after the loop: SumSplitK's red
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t tiles_n = (p.n + kRows - 1) / kRows;
  const int cluster = plan.cluster;
  const int rank = static_cast<int>(blockIdx.x % cluster);  // the cluster is (cluster, 1, 1) along x
  const int64_t tile = blockIdx.y * tiles_n + blockIdx.x / cluster;
  int64_t g_begin, g_end;
  SplitKRange(p.groups, rank * warps + warp, cluster * warps, g_begin, g_end);
  const int64_t steps = (g_end - g_begin + kStageGroups - 1) / kStageGroups;

  // This warp's stages. The token rows that no copy writes (past M) are zeros: only their own output columns,
  // never stored, would see anything else, but so they stay finite. Weight rows past N are not copied either:
  // whatever their slots hold reaches only their own accumulator rows, which are never stored.
  // (LdShared128 reads are ordered after the copies by the volatile asm sequence wait_group, __syncwarp, ld;
  // the refill is issued after the second __syncwarp.)
  const uint32_t stages = sm90::SmemAddr(smem) + static_cast<uint32_t>(warp * D * kStage);
  for (int i = lane; i < D * 8 * NT * kLanesPerRow; i += 32) {
    const int d = i / (8 * NT * kLanesPerRow), m = i / kLanesPerRow % (8 * NT);
    if (m >= p.m)
      sm90::StShared128(stages + d * kStage + kRows * kRun + (m * kLanesPerRow + i % kLanesPerRow) * 16,
                        make_uint4(0, 0, 0, 0));
  }

  float tot[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) tot[j][0] = tot[j][1] = tot[j][2] = tot[j][3] = 0.0f;
  StagedTile<NT> view;
  view.Set(p, tile, tiles_n, lane);
  int64_t l_grp = g_begin, c_grp = g_begin;  // the next group to issue, to compute
  auto issue_next = [&](int d, StageScales<NT>& q) {
    IssueStage(p, view, l_grp, static_cast<int>(std::min<int64_t>(kStageGroups, g_end - l_grp)),
               stages + d * kStage, lane, q);
    l_grp += kStageGroups;
  };
  StageScales<NT> sc[D];
#pragma unroll
  for (int d = 0; d < D; ++d) {
    if (d < steps) issue_next(d, sc[d]);
    sm90::CpAsyncCommitGroup();  // one copy group per step, empty or not: step i's is the i-th
  }
  for (int64_t it = 0; it < steps; it += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (it + d < steps) {
        sm90::CpAsyncWaitGroup<D - 1>();  // this lane's copies of step it + d have landed ...
        __syncwarp();                     // ... and every lane's
        ComputeStage(stages + d * kStage, static_cast<int>(std::min<int64_t>(kStageGroups, g_end - c_grp)), lane,
                     sc[d], tot);
        c_grp += kStageGroups;
        __syncwarp();  // every lane has read the stage before it is refilled
        if (it + d + D < steps) issue_next(d, sc[d]);
        sm90::CpAsyncCommitGroup();
      }
    }
  }
  sm90::CpAsyncWaitGroup<0>();
  __syncthreads();  // every warp is done with its stages: SumSplitK's red reuses them
  SumSplitK(reinterpret_cast<float*>(smem), warps, warp, lane, cluster, rank, tot);
  if (rank == 0 && warp == 0) StoreTile(p, tile, tiles_n, g, t, tot);
}

// The staged kernel's blocks per SM (4 x 48 KB of stages at one token tile) need all of L1 that can be shared
// memory: a function attribute, set once per device.
cudaError_t PreferSharedCarveout() {
  constexpr int kDevices = 64;
  static std::mutex mu;
  static bool done[kDevices] = {};
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < kDevices && done[dev]) return cudaSuccess;
  if (cudaError_t e = cudaFuncSetAttribute(Fp8DecodeStagedKernel<1>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared);
      e != cudaSuccess)
    return e;
  if (dev < kDevices) done[dev] = true;
  return cudaSuccess;
}

template <int NT>
cudaError_t Launch(const Fp8DecodeParams& p, const Fp8DecodeLaunch& plan, cudaStream_t stream) {
  const int64_t tiles_n = (p.n + kRows - 1) / kRows;
  const dim3 grid = plan.whole_tiles ? dim3(static_cast<unsigned>(plan.blocks))
                                     : dim3(static_cast<unsigned>(tiles_n * plan.cluster), static_cast<unsigned>(p.h));
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = decode::ClusterLaunchConfig(grid, plan.warps, plan.cluster, stream, attr);
  if constexpr (NT == 1) {  // the staged kernel is built for one token tile (PlanFp8Decode takes it only there)
    if (plan.staged) {
      if (cudaError_t e = PreferSharedCarveout(); e != cudaSuccess) return e;
      cfg.dynamicSmemBytes = StagedSmemBytes<NT>(plan.warps);
      return cudaLaunchKernelEx(&cfg, Fp8DecodeStagedKernel<NT>, p, plan);
    }
  }
  return cudaLaunchKernelEx(&cfg, Fp8DecodeKernel<NT>, p, plan);
}

}  // namespace

// H200, one-token and 8-token calls of the DeepSeek-V3 linears and MLA products (us, default vs forced
// alternatives in the same process): more blocks per tile pay while the warps are few (kv_a, 36 tiles:
// cluster 8 10.3 vs 4 13.7; q_a, 96 tiles: 8 17.6 vs 4 20.1), not once they fill the SMs (o_proj, 448
// tiles: 1 48.4, 2 51.3, 4 57.3; 7168 x 2048: 1 12.5 vs 2 17.4); one K group per tile (MLA absorb_q,
// 4096 tiles) needs whole tiles per warp (11.1 vs 21.9 with a one-warp block per tile).
// Two-warp blocks: where the 4-warp plan has more warps than fit on the GPU at once (16 per SM at up to 8
// tokens: 128 registers) and the 2-warp plan fits, two warps per block run it in one wave. H200, same
// process, us at 1 / 8 tokens, 4-warp vs 2-warp blocks: q_a (96 tiles, cluster 8) 18.8 / 19.1 vs 14.0 /
// 14.4, V4 wo_a (1024 tiles) 32.4 / 35.0 vs 31.6 / 29.3; where the 4-warp plan fits, the 2-warp one (a
// doubled cluster, or half the warps) lost: o_proj 44.4 vs 65.5, square 23.0 vs 33.6, 7168 x 2048 14.5 vs
// 16.0, kv_a 9.9 vs 12.0 (one token). This rule against the former plan, means of two rounds, 1 / 8 tokens:
// q_a 15.6 / 15.1 vs 19.6 / 18.0, wo_a 31.5 / 31.4 vs 33.6 / 33.3, MLA absorb_o (1024 tiles of 4 groups)
// 13.5 / 13.4 vs 15.4 / 15.5; unchanged plans moved by up to 15% between rounds.
// At one token tile (up to 8 tokens) the cluster doubles only while fewer than 8 warps per SM run (12 before the
// forty-second session, and still 12 at more tokens).
// H200, kernel alone under ncu (medians of 3, us), forced (warps, cluster): q_a + kv_a in one product (132 tiles,
// 56 groups) (4, 4) 14.46, (4, 2) 10.78; shared gate+up (256 tiles) (4, 2) 13.25, (4, 4) 20.80; kv_a (36 tiles)
// (4, 8) 6.72, (4, 4) 7.68. The rule against the former one, H200, ncu, one token (four calls each, us): q_a + kv_a
// 14.1-14.6 -> 10.5-11.1 (528 -> 264 blocks), q_a 9.6-10.2 -> 8.9-9.9; q_b, kv_a, o_proj and the shared expert's
// linears keep their plans.
Fp8DecodeLaunch PlanFp8Decode(int64_t m, int64_t h, int64_t n, int64_t groups, int sms) {
  const int64_t tiles = h * ((n + kRows - 1) / kRows);
  const int nt = m <= 8 ? 1 : m <= 16 ? 2 : 4;
  const int64_t resident = static_cast<int64_t>(sms) * (nt == 1 ? 4 : 2);  // 4-warp blocks that fit (registers)
  Fp8DecodeLaunch plan{kMaxWarps, 1, false, 0, false};
  plan.warps = static_cast<int>(std::min<int64_t>(kMaxWarps, std::max<int64_t>(groups, 1)));
  if (plan.warps < kMaxWarps && tiles > resident) {  // few K groups, many tiles: one wave walks whole tiles
    plan.warps = kMaxWarps;
    plan.whole_tiles = true;
    plan.blocks = static_cast<int>(std::min<int64_t>((tiles + kMaxWarps - 1) / kMaxWarps, resident));
    return plan;
  }
  // Split K over a cluster while the warps are fewer than 8 per SM at one token tile (12 at more), at least one
  // K group per warp.
  const int64_t warps_per_sm = nt == 1 ? 8 : 12;
  auto cluster_for = [&](int warps) {
    int c = 1;
    while (c < kMaxCluster && tiles * c * warps < warps_per_sm * sms && 2 * c * warps <= groups) c *= 2;
    return c;
  };
  plan.cluster = cluster_for(plan.warps);
  if (nt == 1 && plan.warps == kMaxWarps) {
    const int64_t fit = 16LL * sms;  // warps resident at once
    const int c2 = cluster_for(2);
    // Two-warp blocks where they fit in one wave and four would not, or where four-warp blocks would not fit
    // anyway and leave each warp under 4 K groups (q_b: 1536 tiles of 12 groups; kernel alone under ncu, (4, 1) vs
    // (2, 1): H200 18.46 vs 17.54 us, thirty-ninth session; H100 21.1-21.2 vs 20.3-20.5, forty-third).
    if ((tiles * plan.cluster * kMaxWarps > fit && tiles * c2 * 2 <= fit) ||
        (plan.cluster == 1 && tiles * kMaxWarps > fit && groups < 4LL * kMaxWarps)) {
      plan.warps = 2;
      plan.cluster = c2;
    }
  }
  plan.blocks = static_cast<int>(tiles * plan.cluster);
  plan.staged = nt == 1 && groups >= static_cast<int64_t>(kStagedMinGroups) * plan.cluster * plan.warps;
  return plan;
}

cudaError_t LaunchFp8Decode(const Fp8DecodeParams& p, cudaStream_t stream) {
  const Fp8DecodeLaunch plan = PlanFp8Decode(p.m, p.h, p.n, p.groups, CurrentSmCount());
  if (p.m <= 8) return Launch<1>(p, plan, stream);
  if (p.m <= 16) return Launch<2>(p, plan, stream);
  return Launch<4>(p, plan, stream);
}

}  // namespace jax_w4a8
