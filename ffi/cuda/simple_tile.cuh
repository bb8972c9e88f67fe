// A plain shared-memory tiled GEMM step for the simple (CUDA-core) kernels: one 128-wide K group of
// a TILE_M x TILE_N output tile, float32, a fresh accumulator per group. Correctness reference for
// the tensor-core kernels and the fallback for shapes they do not take.
#pragma once

#include <cstdint>

#include "../common/formats.h"

namespace jax_w4a8 {
namespace simple {

constexpr int kTileM = 16;
constexpr int kTileN = 64;
constexpr int kThreads = 256;  // 16 x 16; each thread owns one row and 4 columns (tx + 16 j)
constexpr int kColsPerThread = kTileN / 16;
constexpr int kK = 128;

struct Smem {
  float a[kTileM][kK + 1];
  float b[kTileN][kK + 1];
};

// part[j] = sum_k a[ty][k] * b[tx + 16 j][k] over the group now in shared memory.
__device__ __forceinline__ void GroupDot(const Smem& s, int ty, int tx, float part[kColsPerThread]) {
#pragma unroll
  for (int j = 0; j < kColsPerThread; ++j) part[j] = 0.0f;
#pragma unroll 8
  for (int k = 0; k < kK; ++k) {
    const float a = s.a[ty][k];
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) part[j] += a * s.b[tx + 16 * j][k];
  }
}

__device__ __forceinline__ void Store(void* out, bool bf16, int64_t idx, float v) {
  if (bf16) {
    static_cast<uint16_t*>(out)[idx] = FloatToBf16Bits(v);
  } else {
    static_cast<float*>(out)[idx] = v;
  }
}

}  // namespace simple
}  // namespace jax_w4a8
