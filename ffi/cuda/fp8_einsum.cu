// CUDA handler of ops.fp8_einsum in its canonical batched form (SPEC 4.2): x [M, H, K] e4m3,
// w [H, N, K] e4m3, scales float32 or UE8M0 codes, out [M, H, N] bf16/f32.
//
// Tensor-core paths (plan from jax_w4a8/tiling.py): kernel 1 is CUTLASS's blockwise-scaled GEMM of
// fp8_blockwise_cutlass.cu (recipe (1, 128, 128), bf16 out; the prefill plan), kernel 2 cuBLASLt's of
// fp8_blockwise_cublas.cu (the same recipe, one head, M a multiple of 4); with kernel 0, tile_tokens 8
// is the decode kernel of fp8_decode_gemm.cu (M <= 32: warp MMAs, one launch, no scratch), 16 .. 192 the
// TMA/wgmma kernel of hopper_gemm.cu. The simple CUDA-core kernel: a 16 x 64 tile per block and head,
// float32 promotion per 128-K block (both scales applied with an FMA after each block), one output
// rounding. UE8M0 codes are applied as exact powers of two. Edges in M and N are masked; nothing outside
// the buffers is read.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../common/checks.h"
#include "../common/formats.h"
#include "fp8_blockwise_cublas.cuh"
#include "fp8_blockwise_cutlass.cuh"
#include "fp8_decode_gemm.cuh"
#include "hopper_gemm.cuh"
#include "simple_tile.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

using simple::kK;
using simple::kTileM;
using simple::kTileN;

struct EinsumArgs {
  const uint8_t* x;
  const void* x_scale;
  const uint8_t* w;
  const void* w_scale;
  void* out;
  int64_t m, h, n, k, groups, w_scale_rows, w_rows_per_scale;
  bool x_ue8m0, w_ue8m0, out_bf16;
};

__device__ __forceinline__ float Scale(const void* s, bool ue8m0, int64_t idx) {
  return ue8m0 ? Ue8m0ToFloat(static_cast<const uint8_t*>(s)[idx]) : static_cast<const float*>(s)[idx];
}

__global__ void __launch_bounds__(simple::kThreads) Fp8EinsumSimpleKernel(EinsumArgs a) {
  __shared__ simple::Smem s;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileM;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTileN;
  const int64_t head = blockIdx.z;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t row = r0 + ty;
  float acc[simple::kColsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t g = 0; g < a.groups; ++g) {
    __syncthreads();
    for (int i = threadIdx.x; i < kTileM * kK; i += blockDim.x) {
      const int rr = i / kK, kk = i % kK;
      const int64_t r = r0 + rr;
      s.a[rr][kk] = r < a.m ? E4m3ToFloat(a.x[(r * a.h + head) * a.k + g * kK + kk]) : 0.0f;
    }
    for (int i = threadIdx.x; i < kTileN * kK; i += blockDim.x) {
      const int cc = i / kK, kk = i % kK;
      const int64_t col = c0 + cc;
      s.b[cc][kk] = col < a.n ? E4m3ToFloat(a.w[(head * a.n + col) * a.k + g * kK + kk]) : 0.0f;
    }
    __syncthreads();
    float part[simple::kColsPerThread];
    simple::GroupDot(s, ty, tx, part);
    if (row < a.m) {
      const float sa = Scale(a.x_scale, a.x_ue8m0, (row * a.h + head) * a.groups + g);
#pragma unroll
      for (int j = 0; j < simple::kColsPerThread; ++j) {
        const int64_t col = c0 + tx + 16 * j;
        if (col < a.n) {
          const int64_t srow = head * a.w_scale_rows + col / a.w_rows_per_scale;
          acc[j] += sa * Scale(a.w_scale, a.w_ue8m0, srow * a.groups + g) * part[j];
        }
      }
    }
  }
  if (row >= a.m) return;
#pragma unroll
  for (int j = 0; j < simple::kColsPerThread; ++j) {
    const int64_t col = c0 + tx + 16 * j;
    if (col < a.n) simple::Store(a.out, a.out_bf16, (row * a.h + head) * a.n + col, acc[j]);
  }
}

ffi::Error LaunchSimple(cudaStream_t stream, const Fp8EinsumDims& d, const ffi::AnyBuffer& x,
                        const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& w, const ffi::AnyBuffer& w_scale,
                        ffi::AnyBuffer& out) {
  if (d.h > 65535) return Invalid("fp8_einsum", "at most 65535 heads are supported by the simple kernel");
  if ((d.n + kTileN - 1) / kTileN > 65535)
    return Invalid("fp8_einsum", "the simple kernel takes at most 65535 column tiles (N <= " +
                                     std::to_string(65535 * kTileN) + ")");
  EinsumArgs a{static_cast<const uint8_t*>(x.untyped_data()), x_scale.untyped_data(),
               static_cast<const uint8_t*>(w.untyped_data()), w_scale.untyped_data(), out.untyped_data(),
               d.m, d.h, d.n, d.k, d.groups, d.w_scale_rows, d.w_rows_per_scale,
               d.x_scale_ue8m0, d.w_scale_ue8m0, d.out_bf16};
  const dim3 grid(static_cast<unsigned>((d.m + kTileM - 1) / kTileM),
                  static_cast<unsigned>((d.n + kTileN - 1) / kTileN), static_cast<unsigned>(d.h));
  Fp8EinsumSimpleKernel<<<grid, simple::kThreads, 0, stream>>>(a);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    return ffi::Error::Internal(std::string("fp8_einsum: kernel launch failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error Fp8EinsumCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer w,
                         ffi::AnyBuffer w_scale, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> scratch, int32_t tile_tokens, int32_t split_k,
                         int32_t kernel, int32_t cublas_algo) {
  Fp8EinsumDims d;
  if (auto err = CheckFp8Einsum(x, x_scale, w, w_scale, *out, &d); err.failure()) return err;
  if (split_k < 1 || split_k > d.groups) return Invalid("fp8_einsum", "split_k must be in [1, K/128]");
  if (kernel < 0 || kernel > 2)
    return Invalid("fp8_einsum", "kernel must be 0 (this library's), 1 (CUTLASS) or 2 (cuBLASLt)");
  // An option error is an error (the simple kernel stands in only for what the platform cannot run).
  if (tile_tokens != 0 && tile_tokens != 8 && tile_tokens != 16 && tile_tokens != 32 && tile_tokens != 64 &&
      tile_tokens != 128 && tile_tokens != 192)
    return Invalid("fp8_einsum", "tile_tokens must be 0, 8, 16, 32, 64, 128 or 192");
  if (d.m == 0 || d.h == 0) return ffi::Error::Success();
  if (kernel == 1) {
    if (d.w_rows_per_scale == 1 || !d.out_bf16)
      return Invalid("fp8_einsum", "the CUTLASS kernel needs recipe (1, 128, 128) and bfloat16 output");
    if (std::string u = CutlassBlockwiseUnsupported(d.m, d.h, d.n, d.k); !u.empty())
      return Invalid("fp8_einsum", "the CUTLASS kernel cannot run these shapes: " + u);
    if (!CurrentDeviceIsSm90()) return LaunchSimple(stream, d, x, x_scale, w, w_scale, *out);
    const CutlassBlockwiseParams p{static_cast<const uint8_t*>(x.untyped_data()), x_scale.untyped_data(),
                                   static_cast<const uint8_t*>(w.untyped_data()), w_scale.untyped_data(),
                                   out->untyped_data(), d.m, d.h, d.n, d.k, d.x_scale_ue8m0, d.w_scale_ue8m0,
                                   scratch->untyped_data(), scratch->size_bytes()};
    std::string why;
    if (!LaunchCutlassBlockwise(p, stream, &why)) return ffi::Error::Internal("fp8_einsum: CUTLASS kernel: " + why);
    return ffi::Error::Success();
  }
  if (kernel == 2) {
    if (d.w_rows_per_scale == 1 || !d.out_bf16)
      return Invalid("fp8_einsum", "the cuBLASLt kernel needs recipe (1, 128, 128) and bfloat16 output");
    if (std::string u = CublasBlockwiseUnsupported(d.m, d.h, d.n, d.k); !u.empty())
      return Invalid("fp8_einsum", "the cuBLASLt kernel cannot run these shapes: " + u);
    // cuBLASLt's block scaling runs on compute capability 9.0 only
    if (!CurrentDeviceIsSm90()) return LaunchSimple(stream, d, x, x_scale, w, w_scale, *out);
    const CublasBlockwiseParams p{static_cast<const uint8_t*>(x.untyped_data()), x_scale.untyped_data(),
                                  static_cast<const uint8_t*>(w.untyped_data()), w_scale.untyped_data(),
                                  out->untyped_data(), d.m, d.n, d.k, d.x_scale_ue8m0, d.w_scale_ue8m0,
                                  scratch->untyped_data(), scratch->size_bytes(), cublas_algo};
    std::string why;
    if (!LaunchCublasBlockwise(p, stream, &why)) return ffi::Error::Internal("fp8_einsum: cuBLASLt: " + why);
    return ffi::Error::Success();
  }
  if (tile_tokens == 0) return LaunchSimple(stream, d, x, x_scale, w, w_scale, *out);
  if (tile_tokens == 8) {
    if (d.m > kDecodeMaxTokens)
      return Invalid("fp8_einsum", "tile_tokens 8 (the decode kernel) takes at most " +
                                       std::to_string(kDecodeMaxTokens) + " tokens, got M = " + std::to_string(d.m));
    if (d.h > 65535) return Invalid("fp8_einsum", "at most 65535 heads are supported by the CUDA kernels");
    const Fp8DecodeParams p{static_cast<const uint8_t*>(x.untyped_data()), x_scale.untyped_data(),
                            static_cast<const uint8_t*>(w.untyped_data()), w_scale.untyped_data(), out->untyped_data(),
                            d.m, d.h, d.n, d.k, d.groups, d.w_scale_rows, d.w_rows_per_scale == 1 ? 0 : 7,
                            d.x_scale_ue8m0, d.w_scale_ue8m0, d.out_bf16};
    if (cudaError_t err = LaunchFp8Decode(p, stream); err != cudaSuccess)
      return ffi::Error::Internal(std::string("fp8_einsum: decode kernel launch failed: ") + cudaGetErrorString(err));
    return ffi::Error::Success();
  }
  if (tile_tokens == 192 && d.w_rows_per_scale == 1)
    return Invalid("fp8_einsum", "tile_tokens 192 needs one weight scale per 128 rows (recipe (1, 128, 128))");

  HopperGemmParams p{};
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.w_int4 = false;
  p.sw = w_scale.untyped_data();
  p.sw_type = d.w_scale_ue8m0 ? WeightScaleType::kUe8m0 : WeightScaleType::kF32;
  p.sw_rows = d.w_scale_rows;
  p.sw_row_shift = d.w_rows_per_scale == 1 ? 0 : 7;
  p.group_sizes = nullptr;
  p.out = out->untyped_data();
  p.out_bf16 = d.out_bf16;
  p.m = d.m, p.h = d.h, p.f = d.n, p.k = d.k, p.b = d.h, p.mp = (d.m + 3) / 4 * 4;
  p.split_k = split_k;
  p.tile_tokens = tile_tokens;
  const char* why = nullptr;
  if (!HopperGemmSupported(p, &why)) return LaunchSimple(stream, d, x, x_scale, w, w_scale, *out);
  const size_t need = HopperGemmScratchBytes(d.m, d.h, d.n, d.k, split_k, tile_tokens);
  if (scratch->size_bytes() < need)
    return Invalid("fp8_einsum", "scratch output too small for the tile plan (" +
                                     std::to_string(scratch->size_bytes()) + " < " + std::to_string(need) + ")");
  auto* base = static_cast<uint8_t*>(scratch->untyped_data());
  p.sx_src = x_scale.untyped_data();
  p.sx_kind = d.x_scale_ue8m0 ? ActScaleKind::kGroupUe8m0 : ActScaleKind::kGroupF32;
  p.sx = reinterpret_cast<float*>(base);
  const size_t scales_bytes = HopperGemmScratchBytes(d.m, d.h, d.n, d.k, 1);  // the split-K region follows them
  p.split_ws = reinterpret_cast<float*>(base + scales_bytes);
  p.split_bytes = static_cast<int64_t>(scratch->size_bytes() - scales_bytes);
  const cudaError_t err = LaunchHopperGemm(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("fp8_einsum: tensor-core kernel failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8Fp8EinsumCuda, jax_w4a8::Fp8EinsumCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // x_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // w
                                  .Arg<xla::ffi::AnyBuffer>()   // w_scale
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>()   // scratch (uint8, size from jax_w4a8.tiling)
                                  .Attr<int32_t>("tile_tokens")
                                  .Attr<int32_t>("split_k")
                                  .Attr<int32_t>("kernel")    // 0: tile_tokens picks; 1: CUTLASS; 2: cuBLASLt
                                  .Attr<int32_t>("cublas_algo"),  // kernel 2: which heuristic result
                              {xla::ffi::Traits::kCmdBufferCompatible});
