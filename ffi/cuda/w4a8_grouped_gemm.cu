// CUDA handler of ops.w4a8_grouped_gemm (SPEC 4.1).
//
// The tensor-core path is hopper_gemm.cu (tile plan from jax_w4a8/tiling.py: tile_tokens, split_k).
// This file holds the handler and the simple CUDA-core kernel: a 16 x 64 output tile per block,
// float32 math, a fresh accumulator per 128-K group with both scales applied after it, one bf16/f32
// rounding. Rows are assigned to experts on the device from `group_sizes` (clamped, see
// common/groups.h), so nothing is synchronised with the host and any group_sizes content is safe.
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/checks.h"
#include "../common/formats.h"
#include "../common/groups.h"
#include "hopper_gemm.cuh"
#include "simple_tile.cuh"
#include "w4a8_decode_gemm.cuh"
#include "w4a8_grouped_cutlass.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

using simple::kK;
using simple::kTileM;
using simple::kTileN;

struct GemmArgs {
  const uint8_t* x;
  const float* x_scale;
  const int8_t* w;
  const void* w_scale;
  const int32_t* group_sizes;
  void* out;
  int64_t m, n, k, e, groups;
  int x_scale_kind;  // XScaleKind
  bool w_scale_bf16, out_bf16;
  bool x_folded;  // x in the folded K order (x_layout="folded"; its scale per token)
};

// Where code kk (< 128) of a K group sits in the folded K order: word c + 8 i of the group at word 4 c + i.
__device__ __forceinline__ int FoldedOffset(int kk) {
  const int word = kk / 4;
  return 4 * (4 * (word % 8) + word / 8) + kk % 4;
}

// Writes the expert of each of the block's rows into row_expert (-1: padding). Warp 0 runs a
// saturating inclusive scan over group_sizes, 32 experts at a time.
__device__ void AssignRows(const GemmArgs& a, int64_t r0, int* row_expert) {
  if (threadIdx.x < kTileM) row_expert[threadIdx.x] = -1;
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int64_t carry = 0;  // end of the previous chunk's last expert
  for (int64_t base = 0; base < a.e && carry < r0 + kTileM; base += 32) {
    const int64_t e = base + lane;
    int64_t v = e < a.e ? NextGroupEnd(0, a.group_sizes[e], a.m) : 0;  // clamped size
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {  // inclusive scan with min(x + y, m)
      const int64_t other = __shfl_up_sync(0xffffffffu, v, off);
      if (lane >= off) v = min(v + other, a.m);
    }
    const int64_t end = min(carry + v, a.m);
    const int64_t up = __shfl_up_sync(0xffffffffu, v, 1);  // every lane takes part in the shuffle
    const int64_t prev = lane == 0 ? carry : min(carry + up, a.m);
    if (e < a.e) {
      for (int64_t r = max(prev, r0); r < min(end, r0 + kTileM); ++r) row_expert[r - r0] = static_cast<int>(e);
    }
    carry = min(carry + __shfl_sync(0xffffffffu, v, 31), a.m);
  }
}

__device__ __forceinline__ float WeightScale(const GemmArgs& a, int64_t idx) {
  return a.w_scale_bf16 ? Bf16BitsToFloat(static_cast<const uint16_t*>(a.w_scale)[idx])
                        : static_cast<const float*>(a.w_scale)[idx];
}

__device__ __forceinline__ float ActScale(const GemmArgs& a, int64_t row, int64_t g) {
  switch (a.x_scale_kind) {
    case static_cast<int>(XScaleKind::kTensor): return a.x_scale[0];
    case static_cast<int>(XScaleKind::kToken): return a.x_scale[row];
    default: return a.x_scale[row * a.groups + g];
  }
}

__global__ void __launch_bounds__(simple::kThreads) GroupedGemmSimpleKernel(GemmArgs a) {
  __shared__ simple::Smem s;
  __shared__ int row_expert[kTileM];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileM;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  AssignRows(a, r0, row_expert);
  __syncthreads();

  float acc[simple::kColsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  int seg = 0;
  while (seg < kTileM) {  // the block's rows form runs of one expert each (rows are sorted)
    const int e = row_expert[seg];
    int seg_end = seg + 1;
    while (seg_end < kTileM && row_expert[seg_end] == e) ++seg_end;
    if (e >= 0) {
      for (int64_t g = 0; g < a.groups; ++g) {
        __syncthreads();
        for (int i = threadIdx.x; i < kTileM * kK; i += blockDim.x) {
          const int rr = i / kK, kk = i % kK;
          const int64_t row = r0 + rr;
          s.a[rr][kk] = (rr >= seg && rr < seg_end && row < a.m) ? E4m3ToFloat(a.x[row * a.k + g * kK + (a.x_folded ? FoldedOffset(kk) : kk)]) : 0.0f;
        }
        for (int i = threadIdx.x; i < kTileN * kK; i += blockDim.x) {
          const int cc = i / kK, kk = i % kK;
          const int64_t col = c0 + cc;
          s.b[cc][kk] = col < a.n ? static_cast<float>(Int4At(a.w + (e * a.n + col) * (a.k / 2), g * kK + kk)) : 0.0f;
        }
        __syncthreads();
        float part[simple::kColsPerThread];
        simple::GroupDot(s, ty, tx, part);
        const int64_t row = r0 + ty;
        if (ty >= seg && ty < seg_end && row < a.m) {
          const float sa = ActScale(a, row, g);
#pragma unroll
          for (int j = 0; j < simple::kColsPerThread; ++j) {
            const int64_t col = c0 + tx + 16 * j;
            if (col < a.n) acc[j] += sa * WeightScale(a, (e * a.n + col) * a.groups + g) * part[j];
          }
        }
      }
    }
    seg = seg_end;
  }
  const int64_t row = r0 + ty;
  if (row >= a.m) return;
#pragma unroll
  for (int j = 0; j < simple::kColsPerThread; ++j) {
    const int64_t col = c0 + tx + 16 * j;
    if (col < a.n) simple::Store(a.out, a.out_bf16, row * a.n + col, acc[j]);
  }
}

ffi::Error LaunchSimple(cudaStream_t stream, const GroupedGemmDims& d, const ffi::AnyBuffer& x,
                        const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& w, const ffi::AnyBuffer& w_scale,
                        const ffi::AnyBuffer& group_sizes, ffi::AnyBuffer& out, bool x_folded = false) {
  if ((d.n + kTileN - 1) / kTileN > 65535)
    return Invalid("w4a8_grouped_gemm", "the simple kernel takes at most 65535 column tiles (N <= " +
                                            std::to_string(65535 * kTileN) + ")");
  GemmArgs a{static_cast<const uint8_t*>(x.untyped_data()), static_cast<const float*>(x_scale.untyped_data()),
             static_cast<const int8_t*>(w.untyped_data()), w_scale.untyped_data(),
             static_cast<const int32_t*>(group_sizes.untyped_data()), out.untyped_data(),
             d.m, d.n, d.k, d.e, d.groups, static_cast<int>(d.x_scale_kind), d.w_scale_bf16, d.out_bf16, x_folded};
  const dim3 grid(static_cast<unsigned>((d.m + kTileM - 1) / kTileM),
                  static_cast<unsigned>((d.n + kTileN - 1) / kTileN));
  GroupedGemmSimpleKernel<<<grid, simple::kThreads, 0, stream>>>(a);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    return ffi::Error::Internal(std::string("w4a8_grouped_gemm: kernel launch failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error W4a8GroupedGemmCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                               ffi::AnyBuffer w, ffi::AnyBuffer w_scale, ffi::AnyBuffer group_sizes,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> scratch,
                               int32_t tile_tokens, int32_t split_k, int32_t mma, int32_t kernel,
                               int32_t experts_per_chunk, bool x_folded) {
  GroupedGemmDims d;
  if (auto err = CheckGroupedGemm(x, x_scale, w, w_scale, group_sizes, *out, &d); err.failure())
    return err;
  // x_layout="folded": the 128-token e4m3 kernel that reads folded activations (or, off Hopper, the simple kernel
  // reading that K order), with one multiplier per token.
  const bool per_token = d.x_scale_kind == XScaleKind::kToken || (d.x_scale_kind == XScaleKind::kTensor && d.m == 1);
  if (x_folded && (!per_token || kernel != 0 || mma != 0 || tile_tokens != 128))
    return Invalid("w4a8_grouped_gemm", "folded activations (x_layout 'folded') take one scale per token and run "
                                        "the native kernel's 128-token e4m3 tiles");
  if (split_k < 1 || split_k > d.groups) return Invalid("w4a8_grouped_gemm", "split_k must be in [1, K/128]");
  if (mma != 0 && mma != 1) return Invalid("w4a8_grouped_gemm", "mma must be 0 (e4m3) or 1 (f16)");
  if (kernel < 0 || kernel > 2)
    return Invalid("w4a8_grouped_gemm", "kernel must be 0 (native), 1 (cutlass) or 2 (decode)");
  // Option errors are errors (the simple kernel below stands in only for what the platform cannot run).
  if (tile_tokens != 0 && tile_tokens != 8 && tile_tokens != 16 && tile_tokens != 32 && tile_tokens != 64 &&
      tile_tokens != 128)
    return Invalid("w4a8_grouped_gemm", "tile_tokens must be 0, 8, 16, 32, 64 or 128");
  if (kernel == 0 && mma == 0 && tile_tokens == 8)
    return Invalid("w4a8_grouped_gemm", "tile_tokens 8 runs the f16 MMA (mma 1) only");
  if (d.m == 0) return ffi::Error::Success();
  if (kernel == 2) {  // the decode kernel (w4a8_decode_gemm.cu): warp-level f16 MMAs, one launch, no scratch
    if ((tile_tokens != 8 && tile_tokens != 16) || mma != 1)
      return Invalid("w4a8_grouped_gemm", "kernel 'decode' runs 8- or 16-row units on the f16 MMA (tile_tokens 8 or 16, mma 1)");
    if (const char* why = W4a8DecodeUnsupported(d.m, d.e, tile_tokens); why != nullptr)
      return Invalid("w4a8_grouped_gemm", std::string("kernel 'decode': ") + why);
    if (!CurrentDeviceIsSm90()) return LaunchSimple(stream, d, x, x_scale, w, w_scale, group_sizes, *out);
    const W4a8DecodeParams p{static_cast<const uint8_t*>(x.untyped_data()), static_cast<const float*>(x_scale.untyped_data()),
                             static_cast<int>(d.x_scale_kind), static_cast<const uint8_t*>(w.untyped_data()),
                             w_scale.untyped_data(), d.w_scale_bf16, static_cast<const int32_t*>(group_sizes.untyped_data()),
                             out->untyped_data(), d.out_bf16, d.m, d.n, d.k, d.e, d.groups};
    if (cudaError_t err = LaunchW4a8Decode(p, tile_tokens, stream); err != cudaSuccess)
      return ffi::Error::Internal(std::string("w4a8_grouped_gemm: decode kernel failed: ") + cudaGetErrorString(err));
    return ffi::Error::Success();
  }
  if (tile_tokens == 0) return LaunchSimple(stream, d, x, x_scale, w, w_scale, group_sizes, *out);
  if (kernel == 1) {  // CUTLASS's grouped FP8 GEMM on e4m3-converted weights (w4a8_grouped_cutlass.cu)
    if (!d.out_bf16) return Invalid("w4a8_grouped_gemm", "the CUTLASS kernel writes bfloat16 output only");
    if (const std::string u = W4a8CutlassUnsupported(d.m, d.e, d.n, d.k, experts_per_chunk); !u.empty())
      return Invalid("w4a8_grouped_gemm", "kernel 'cutlass': " + u);
    if (!CurrentDeviceIsSm90()) return LaunchSimple(stream, d, x, x_scale, w, w_scale, group_sizes, *out);
    W4a8CutlassParams p{static_cast<const uint8_t*>(x.untyped_data()), static_cast<const float*>(x_scale.untyped_data()),
                        static_cast<int>(d.x_scale_kind), static_cast<const int8_t*>(w.untyped_data()),
                        w_scale.untyped_data(), d.w_scale_bf16, static_cast<const int32_t*>(group_sizes.untyped_data()),
                        out->untyped_data(), d.m, d.n, d.k, d.e, experts_per_chunk, scratch->untyped_data(),
                        scratch->size_bytes()};
    std::string why;
    if (!LaunchW4a8Cutlass(p, stream, &why)) return ffi::Error::Internal("w4a8_grouped_gemm: " + why);
    return ffi::Error::Success();
  }

  HopperGemmParams p = GroupedInt4Params(d, x, w, w_scale, group_sizes, out->untyped_data(), d.n, tile_tokens,
                                         split_k);
  p.int4_f16 = mma == 1;
  const char* why = nullptr;
  if (!HopperGemmSupported(p, &why)) {  // e.g. not a Hopper GPU: the simple kernel is always correct
    return LaunchSimple(stream, d, x, x_scale, w, w_scale, group_sizes, *out, x_folded);
  }
  // f16 MMA: the activations as f16 follow the scales; e4m3 at 128-token tiles: the token multipliers and
  // folded activations (then the split-K region).
  p.x_folded = x_folded;
  p.fold_x = W4a8FoldsActivationScales(tile_tokens, p.int4_f16) && !x_folded;
  const size_t xh_bytes = p.int4_f16 ? HopperGemmF16ActivationBytes(d.m, 1, d.k)
                          : p.fold_x ? HopperGemmFoldBytes(d.m, 1, d.k)
                                     : 0;
  const size_t need = W4a8GroupedGemmScratchNeed(d.m, d.e, d.n, d.k, tile_tokens, split_k, p.int4_f16, x_folded);
  if (scratch->size_bytes() < need)
    return Invalid("w4a8_grouped_gemm", "scratch output too small for the tile plan (" +
                                            std::to_string(scratch->size_bytes()) + " < " + std::to_string(need) + ")");
  auto* base = static_cast<uint8_t*>(scratch->untyped_data());
  p.sx_src = x_scale.untyped_data();
  p.sx_kind = ActScaleKindOf(d.x_scale_kind);
  p.sx = reinterpret_cast<float*>(base);
  const size_t scales_bytes = HopperGemmScratchBytes(d.m, 1, d.n, d.k, 1);  // the split-K region follows them
  if (p.int4_f16) p.xh = base + scales_bytes;
  if (p.fold_x) {
    p.x_tok_scale = reinterpret_cast<float*>(base + scales_bytes);
    p.x_fold = base + scales_bytes + HopperGemmFoldTokenBytes(d.m, 1);  // after the multipliers and the flag
  }
  if (x_folded) {
    p.x_tok_scale = static_cast<float*>(x_scale.untyped_data());
    p.x_fold = x.untyped_data();
  }
  p.split_ws = reinterpret_cast<float*>(base + scales_bytes + xh_bytes);
  p.split_bytes = static_cast<int64_t>(scratch->size_bytes() - scales_bytes - xh_bytes);
  const cudaError_t err = LaunchHopperGemm(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("w4a8_grouped_gemm: tensor-core kernel failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8GroupedGemmCuda, jax_w4a8::W4a8GroupedGemmCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // x_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // w
                                  .Arg<xla::ffi::AnyBuffer>()   // w_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>()   // scratch (uint8, size from jax_w4a8.tiling)
                                  .Attr<int32_t>("tile_tokens")
                                  .Attr<int32_t>("split_k")
                                  .Attr<int32_t>("mma")  // 0: e4m3 MMA, 1: f16 MMA
                                  .Attr<int32_t>("kernel")  // 0: this library's kernels, 1: CUTLASS (prefill), 2: decode
                                  .Attr<int32_t>("experts_per_chunk")  // CUTLASS: experts per weight conversion
                                  .Attr<bool>("x_folded"),  // x_layout="folded" (see W4a8GroupedGemmCuda)
                              {xla::ffi::Traits::kCmdBufferCompatible});
