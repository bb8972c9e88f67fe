// The W4A8 grouped GEMM's prefill kernel: int4 weights converted to e4m3 (exactly) once per call, then
// CUTLASS's sm90 grouped FP8 GEMM with per-row, per-128-K scales on both sides (headers of the nvidia-cutlass
// wheel, a build dependency), bf16 output. See w4a8_grouped_cutlass.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_w4a8 {

// x_scale_kind: 0 per tensor [1], 1 per token [M], 2 per token and 128-K group [M, K/128] (float32).
struct W4a8CutlassParams {
  const uint8_t* x;            // e4m3 [M, K]
  const float* x_scale;        // see x_scale_kind
  int x_scale_kind;
  const int8_t* w;             // packed int4 [E, N, K/2], low nibble first
  const void* w_scale;         // [E, N, K/128] float32 or bfloat16
  bool w_scale_bf16;
  const int32_t* group_sizes;  // [E] device data (clamped as everywhere: negative -> 0, total cut at M)
  void* out;                   // bfloat16 [M, N]
  int64_t m, n, k, e;
  int64_t experts_per_chunk;   // experts whose e4m3 weights share the scratch at a time
  void* scratch;               // W4a8CutlassScratchBytes(...) bytes
  size_t scratch_bytes;
};

bool W4a8CutlassBuilt();

// Scratch, each region 256-byte aligned: e4m3 weights [chunk, N, K]; float32 weight scales [chunk, K/128, N];
// float32 activation scales [M x K/128] (per expert [K/128, rows]); the per-expert argument arrays
// (kW4a8CutlassArrayBytesPerExpert each); CUTLASS's workspace (kW4a8CutlassWorkspaceBytes at most).
// jax_w4a8.tiling mirrors this.
constexpr size_t kW4a8CutlassArrayBytesPerExpert = 256;
constexpr size_t kW4a8CutlassWorkspaceBytes = size_t{1} << 20;
size_t W4a8CutlassScratchBytes(int64_t m, int64_t e, int64_t n, int64_t k, int64_t experts_per_chunk);

// Empty when the kernel can run these shapes, else why not.
std::string W4a8CutlassUnsupported(int64_t m, int64_t e, int64_t n, int64_t k, int64_t experts_per_chunk);

// Launches everything on `stream` (no host sync, no allocation). On failure returns false with *why set.
bool LaunchW4a8Cutlass(const W4a8CutlassParams& p, cudaStream_t stream, std::string* why);

}  // namespace jax_w4a8
