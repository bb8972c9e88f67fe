// The fp8 einsum's prefill kernel for recipe (1, 128, 128): CUTLASS's sm90 FP8 blockwise-scaled GEMM
// (headers of the nvidia-cutlass wheel, a build dependency), bf16 output. See fp8_blockwise_cutlass.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_w4a8 {

struct CutlassBlockwiseParams {
  const uint8_t* x;     // e4m3 [M, H, K]
  const void* x_scale;  // [M, H, G] float32 or UE8M0 codes
  const uint8_t* w;     // e4m3 [H, N, K]
  const void* w_scale;  // [H, ceil(N/128), G] float32 or UE8M0 codes
  void* out;            // bfloat16 [M, H, N]
  int64_t m, h, n, k;
  bool x_ue8m0, w_ue8m0;
  void* scratch;  // CutlassBlockwiseScratchBytes(m, h, n, k, w_ue8m0) bytes
  size_t scratch_bytes;
};

// Whether the library was built with CUTLASS (else the launch below refuses).
bool CutlassBlockwiseBuilt();

// Scratch: activation scales as float32 [H, G, ceil4(M)] (M fastest, CUTLASS's MN-major layout), then the
// weight scales as float32 [H, ceil(N/128), G] when given as UE8M0 codes; each region 256-byte aligned.
// jax_w4a8.tiling mirrors this.
size_t CutlassBlockwiseScratchBytes(int64_t m, int64_t h, int64_t n, int64_t k, bool w_ue8m0);

// Empty when CUTLASS can run these shapes, else why not (N must be a multiple of 8 for the bf16 TMA store).
std::string CutlassBlockwiseUnsupported(int64_t m, int64_t h, int64_t n, int64_t k);

// Prepares the float32 scales in scratch, then runs the GEMM. On failure returns false with *why set.
bool LaunchCutlassBlockwise(const CutlassBlockwiseParams& p, cudaStream_t stream, std::string* why);

}  // namespace jax_w4a8
