// The fp8 einsum's decode kernel (ops.fp8_einsum with tile_tokens 8; the plan's choice for M <= 8):
//   out[m, h, n] = sum_g sx[m, h, g] * sw(h, n, g) * sum_{k in g} x[m, h, k] * w[h, n, k]
// for at most 32 tokens, in one launch with no scratch and no scale preparation.
//
// Each warp owns 16 weight rows of one head (the M side of mma.sync m16n8k32 e4m3 -> f32) and a
// contiguous run of K groups; the tokens are the MMA's N side, in 8-token tiles (1, 2 or 4 of them).
// Operands come straight from global memory into MMA fragments: weights with 16-byte loads that skip
// L1 (each byte is read once), activations and scales through L1 (every warp of the SM reads them).
// Within a 128-K group a thread's 32 bytes of a row are [16t, 16t + 16) and [64 + 16t, 64 + 16t + 16)
// (t = lane % 4): the MMA's k order is a permutation of the group's, the same for weights and
// activations, so every 8 lanes of a load read 64 contiguous bytes of a row. A fresh float32
// accumulator per group, both scales applied in float32 after it (SPEC 4.2). Two groups' loads are
// in flight per warp.
//
// Schedules (PlanFp8Decode): split K, where the warps of a block split the K groups of the block's 16
// rows and a cluster of up to 8 blocks splits them further (partial tiles summed in warp order, then
// in block-rank order through distributed shared memory; rank 0's first warp rounds and stores); or,
// for many tiles of few K groups (MLA absorb_q: 4096 tiles of one group), whole tiles, where one wave
// of warps walks the tiles, each over all K groups, the loads running ahead across tiles. Either way the
// summation order is fixed, so outputs are bitwise reproducible. Rows past N and tokens past M are
// neither read nor written.
#include "fp8_decode_gemm.cuh"

#include <cooperative_groups.h>

#include <algorithm>

#include "../common/formats.h"
#include "hopper_gemm.cuh"

namespace jax_w4a8 {
namespace {

namespace cg = cooperative_groups;

constexpr int kRows = 16;       // weight rows per warp (the MMA's M)
constexpr int kMaxWarps = 4;    // warps per block
constexpr int kMaxCluster = 8;  // portable cluster size

// How a launch spreads the work (PlanFp8Decode).
struct Fp8DecodeLaunch {
  int warps;         // warps per block
  int cluster;       // split K: blocks per cluster splitting a tile's K groups (summed through DSMEM)
  bool whole_tiles;  // each warp walks whole 16-row tiles (else: a block per tile and cluster rank, split K)
  int blocks;        // whole tiles: the grid (one wave); split K: tiles x cluster
};

// One K group's operands of one thread, as loaded.
template <int NT>
struct Operands {
  uint4 w[2][2];    // rows g and g + 8: bytes [16t, +16) and [64 + 16t, +16) of the group
  float sw[2];      // rows g, g + 8
  float sx[NT][2];  // tokens 8j + 2t, 8j + 2t + 1 (the accumulator's columns)
  uint4 x[NT][2];   // token 8j + g: the same bytes of the activations
};

__device__ __forceinline__ uint4 LoadStreamed(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

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
  for (int j = 0; j < NT; ++j) {
    tot[j][0] += c[j][0] * (q.sw[0] * q.sx[j][0]);
    tot[j][1] += c[j][1] * (q.sw[0] * q.sx[j][1]);
    tot[j][2] += c[j][2] * (q.sw[1] * q.sx[j][0]);
    tot[j][3] += c[j][3] * (q.sw[1] * q.sx[j][1]);
  }
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
    const int slices = cluster * warps, slice = rank * warps + warp;
    g_begin = p.groups * slice / slices, g_end = p.groups * (slice + 1) / slices;
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

  // Split K: the block's warps in order, then the cluster's blocks in rank order.
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][4 * j + i][lane] = tot[j][i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = tot[j][i];
        for (int w = 1; w < warps; ++w) s += red[w][4 * j + i][lane];
        tot[j][i] = s;
        red[0][4 * j + i][lane] = s;
      }
  }
  if (cluster > 1) {
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();  // every block's sums are in its red[0]
    if (rank == 0 && warp == 0) {
      for (int r = 1; r < cluster; ++r) {
        const float* remote = cl.map_shared_rank(&red[0][0][0], r);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) tot[j][i] += remote[(4 * j + i) * 32 + lane];
      }
    }
    cl.sync();  // no block leaves while rank 0 reads its shared memory
  }
  if (rank == 0 && warp == 0) StoreTile(p, c_tile, tiles_n, g, t, tot);
}

template <int NT>
cudaError_t Launch(const Fp8DecodeParams& p, const Fp8DecodeLaunch& plan, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  const int64_t tiles_n = (p.n + kRows - 1) / kRows;
  cfg.gridDim = plan.whole_tiles ? dim3(static_cast<unsigned>(plan.blocks))
                                 : dim3(static_cast<unsigned>(tiles_n * plan.cluster), static_cast<unsigned>(p.h));
  cfg.blockDim = dim3(static_cast<unsigned>(32 * plan.warps));
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, Fp8DecodeKernel<NT>, p, plan);
}

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
Fp8DecodeLaunch PlanFp8Decode(int64_t m, int64_t h, int64_t n, int64_t groups, int sms) {
  const int64_t tiles = h * ((n + kRows - 1) / kRows);
  const int nt = m <= 8 ? 1 : m <= 16 ? 2 : 4;
  const int64_t resident = static_cast<int64_t>(sms) * (nt == 1 ? 4 : 2);  // 4-warp blocks that fit (registers)
  Fp8DecodeLaunch plan{kMaxWarps, 1, false, 0};
  plan.warps = static_cast<int>(std::min<int64_t>(kMaxWarps, std::max<int64_t>(groups, 1)));
  if (plan.warps < kMaxWarps && tiles > resident) {  // few K groups, many tiles: one wave walks whole tiles
    plan.warps = kMaxWarps;
    plan.whole_tiles = true;
    plan.blocks = static_cast<int>(std::min<int64_t>((tiles + kMaxWarps - 1) / kMaxWarps, resident));
    return plan;
  }
  // Split K over a cluster while the warps are fewer than 12 per SM, at least one K group per warp.
  auto cluster_for = [&](int warps) {
    int c = 1;
    while (c < kMaxCluster && tiles * c * warps < 12LL * sms && 2 * c * warps <= groups) c *= 2;
    return c;
  };
  plan.cluster = cluster_for(plan.warps);
  if (nt == 1 && plan.warps == kMaxWarps) {
    const int64_t fit = 16LL * sms;  // warps resident at once
    const int c2 = cluster_for(2);
    if (tiles * plan.cluster * kMaxWarps > fit && tiles * c2 * 2 <= fit) {
      plan.warps = 2;
      plan.cluster = c2;
    }
  }
  plan.blocks = static_cast<int>(tiles * plan.cluster);
  return plan;
}

}  // namespace

cudaError_t LaunchFp8Decode(const Fp8DecodeParams& p, cudaStream_t stream) {
  const Fp8DecodeLaunch plan = PlanFp8Decode(p.m, p.h, p.n, p.groups, CurrentSmCount());
  if (p.m <= 8) return Launch<1>(p, plan, stream);
  if (p.m <= 16) return Launch<2>(p, plan, stream);
  return Launch<4>(p, plan, stream);
}

}  // namespace jax_w4a8
