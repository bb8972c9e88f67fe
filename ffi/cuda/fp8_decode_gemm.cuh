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

// Runs out = einsum on the stream; the caller has checked shapes and M <= kDecodeMaxTokens.
cudaError_t LaunchFp8Decode(const Fp8DecodeParams& p, cudaStream_t stream);

}  // namespace jax_w4a8
