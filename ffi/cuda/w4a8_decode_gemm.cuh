// The grouped W4A8 GEMM's decode kernel (ops.w4a8_grouped_gemm with kernel "decode"): warp-level f16 MMAs on
// int4 weights and e4m3 activations loaded straight from global memory, one launch, no scratch. See
// w4a8_decode_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_w4a8 {

struct W4a8DecodeParams {
  const uint8_t* x;            // e4m3 [M, K]
  const float* x_scale;        // float32 [1], [M] or [M, G] (x_scale_kind)
  int x_scale_kind;            // XScaleKind (common/checks.h)
  const uint8_t* w;            // packed int4 [E, N, K / 2] (code k in the low nibble of byte k / 2 for even k)
  const void* w_scale;         // [E, N, G] float32 or bfloat16
  bool w_scale_bf16;
  const int32_t* group_sizes;  // [E] rows per expert (clamped as common/groups.h)
  void* out;                   // [M, N] bfloat16 or float32
  bool out_bf16;
  int64_t m, n, k, e, groups;
};

// Rows of one expert per unit of work (the MMA's N: one or two tiles of 8 tokens): 8 or 16.
bool W4a8DecodeUnitRowsValid(int unit_rows);

// Units of work the launch provides for (an upper bound on sum_e ceil(rows_e / unit_rows) for any group_sizes).
int64_t W4a8DecodeUnitBound(int64_t m, int64_t e, int unit_rows);

// Why the decode kernel cannot take these sizes (nullptr when it can): unit rows other than 8 or 16, or more
// units than the grid's rows of blocks.
const char* W4a8DecodeUnsupported(int64_t m, int64_t e, int unit_rows);

// Runs out = grouped GEMM on the stream; the caller has checked shapes and W4a8DecodeUnsupported.
cudaError_t LaunchW4a8Decode(const W4a8DecodeParams& p, int unit_rows, cudaStream_t stream);

}  // namespace jax_w4a8
