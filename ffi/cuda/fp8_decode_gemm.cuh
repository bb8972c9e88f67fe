// The fp8 einsum's decode kernel (tile_tokens 8, M <= 32 tokens): warp-level fp8 MMAs straight from
// global memory, one launch, no scratch. See fp8_decode_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_w4a8 {

constexpr int kDecodeMaxTokens = 32;  // four 8-token MMA tiles per warp

struct Fp8DecodeParams {
  const uint8_t* x;     // e4m3 [M, H, K]
  const void* x_scale;  // [M, H, G] float32 or UE8M0 codes
  const uint8_t* w;     // e4m3 [H, N, K]
  const void* w_scale;  // [H, w_scale_rows, G] float32 or UE8M0 codes
  void* out;            // [M, H, N] bfloat16 or float32
  int64_t m, h, n, k, groups, w_scale_rows;
  int w_row_shift;  // 0: a scale per weight row; 7: one per 128 rows
  bool x_ue8m0, w_ue8m0, out_bf16;
};

// How a launch spreads the work (PlanFp8Decode).
struct Fp8DecodeLaunch {
  int warps;         // warps per block
  int cluster;       // split K: blocks per cluster splitting a tile's K groups (summed through DSMEM)
  bool whole_tiles;  // each warp walks whole 16-row tiles (else: a block per tile and cluster rank, split K)
  int blocks;        // whole tiles: the grid (one wave); split K: tiles x cluster
  bool staged;       // split K through shared-memory stages (Fp8DecodeStagedKernel)
};

// The launch LaunchFp8Decode takes for M tokens of H heads, N weight rows and K / 128 groups on a GPU of `sms`
// SMs (host code; the CUDA module exposes it to tests as fp8_decode_launch).
Fp8DecodeLaunch PlanFp8Decode(int64_t m, int64_t h, int64_t n, int64_t groups, int sms);

// Runs out = einsum on the stream; the caller has checked shapes and M <= kDecodeMaxTokens.
cudaError_t LaunchFp8Decode(const Fp8DecodeParams& p, cudaStream_t stream);

}  // namespace jax_w4a8
