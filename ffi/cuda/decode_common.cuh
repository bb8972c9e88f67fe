// Helpers of the warp-level decode kernels (fp8_decode_gemm.cu, w4a8_decode_gemm.cu): streamed weight loads and
// the split-K sum of a 16-row tile's partial results over a block's warps and a cluster's blocks.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_w4a8 {
namespace decode {

namespace cg = cooperative_groups;

constexpr int kRows = 16;       // weight rows per warp (the MMA's M)
constexpr int kMaxWarps = 4;    // warps per block
constexpr int kMaxCluster = 8;  // portable cluster size

// 16 bytes read once: past L1 (no allocation), through the non-coherent path.
__device__ __forceinline__ uint4 LoadStreamed(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// tot += c * the scales, for one 16-row x 8-token MMA tile (mma.sync m16n8k16's C layout): accumulator i is weight
// row g + 8 (i / 2) (scale sw[i / 2]) and token 2 t + i % 2 (scale sx[i % 2]); both scales applied in float32 after
// the group's fresh accumulator, their product first.
__device__ __forceinline__ void AddScaledTile(float (&tot)[4], const float (&c)[4], const float (&sw)[2],
                                              const float (&sx)[2]) {
  tot[0] += c[0] * (sw[0] * sx[0]);
  tot[1] += c[1] * (sw[0] * sx[1]);
  tot[2] += c[2] * (sw[1] * sx[0]);
  tot[3] += c[3] * (sw[1] * sx[1]);
}

// Split K: the K groups [begin, end) of slice `slice` of `slices` (contiguous runs, in order).
__device__ __forceinline__ void SplitKRange(int64_t groups, int slice, int slices, int64_t& begin, int64_t& end) {
  begin = groups * slice / slices, end = groups * (slice + 1) / slices;
}

// Split K: sums the partial tiles of the block's warps in warp order, then those of the cluster's blocks in
// rank order, into `tot` of rank 0's warp 0 (the one that stores). red: [warps][4 NT][32] floats of the
// block's shared memory, free for this (the caller has synchronized the block if it held anything else).
template <int NT>
__device__ __forceinline__ void SumSplitK(float* red, int warps, int warp, int lane, int cluster, int rank,
                                          float (&tot)[NT][4]) {
  constexpr int kWarpFloats = 4 * NT * 32;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp * kWarpFloats + (4 * j + i) * 32 + lane] = tot[j][i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = tot[j][i];
        for (int w = 1; w < warps; ++w) s += red[w * kWarpFloats + (4 * j + i) * 32 + lane];
        tot[j][i] = s;
        red[(4 * j + i) * 32 + lane] = s;
      }
  }
  if (cluster > 1) {
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();  // every block's sums are in its red[0]
    if (rank == 0 && warp == 0) {
      for (int r = 1; r < cluster; ++r) {
        const float* remote = cl.map_shared_rank(red, r);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) tot[j][i] += remote[(4 * j + i) * 32 + lane];
      }
    }
    cl.sync();  // no block leaves while rank 0 reads its shared memory
  }
}

// A launch of `grid` blocks of `warps` warps in clusters of `cluster` blocks along x (the split-K kernels' ranks);
// the config points at `attr`, which holds the cluster dimension.
inline cudaLaunchConfig_t ClusterLaunchConfig(dim3 grid, int warps, int cluster, cudaStream_t stream,
                                              cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(32 * warps));
  cfg.stream = stream;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cfg;
}

}  // namespace decode
}  // namespace jax_w4a8
