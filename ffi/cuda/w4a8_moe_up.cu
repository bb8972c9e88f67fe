// CUDA handler of ops.w4a8_moe_up: the MoE gate+up grouped GEMM with SiLU(gate) * up and the fp8
// re-quantization for the down projection in the epilogue (hopper_gemm.cu, fused mode), so the
// [M, 2I] intermediate never goes to HBM. Hopper only; other GPUs take the unfused composition in
// Python.
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/checks.h"
#include "hopper_gemm.cuh"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

ffi::Error W4a8MoeUpCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer w,
                         ffi::AnyBuffer w_scale, ffi::AnyBuffer group_sizes, ffi::AnyBuffer down_scale,
                         ffi::Result<ffi::AnyBuffer> h8, ffi::Result<ffi::AnyBuffer> h_scale,
                         ffi::Result<ffi::AnyBuffer> scratch, int32_t tile_tokens, bool static_scale, int32_t mma,
                         bool ue8m0) {
  GroupedGemmDims d;
  int64_t inter = 0;
  if (auto err = CheckMoeUp(x, x_scale, w, w_scale, group_sizes, down_scale, *h8, *h_scale, static_scale, &d,
                            &inter);
      err.failure())
    return err;
  if (mma != 0 && mma != 1) return Invalid("w4a8_moe_up", "mma must be 0 (e4m3) or 1 (f16)");
  HopperGemmParams p = GroupedInt4Params(d, x, w, w_scale, group_sizes, h8->untyped_data(), inter, tile_tokens, 1);
  p.int4_f16 = mma == 1;
  p.fused_up = true;
  p.up_offset = inter;
  p.down_scale = static_scale ? static_cast<const float*>(down_scale.untyped_data()) : nullptr;
  p.h_scale = static_cast<float*>(h_scale->untyped_data());
  p.h_scale_ue8m0 = ue8m0;
  const char* why = nullptr;
  if (!HopperGemmSupported(p, &why)) return Invalid("w4a8_moe_up", std::string("fused kernel unavailable: ") + why);
  if (d.m == 0) return ffi::Error::Success();
  // f16 MMA: the activations as f16 follow the scales.
  const size_t scales_bytes = HopperGemmScratchBytes(d.m, 1, inter, d.k, 1);
  const size_t need = W4a8MoeUpScratchNeed(d.m, inter, d.k, p.int4_f16);
  if (scratch->size_bytes() < need)
    return Invalid("w4a8_moe_up", "scratch output too small for the tile plan (" + std::to_string(scratch->size_bytes()) +
                                      " < " + std::to_string(need) + ")");
  if (p.int4_f16) p.xh = static_cast<uint8_t*>(scratch->untyped_data()) + scales_bytes;
  p.sx_src = x_scale.untyped_data();
  p.sx_kind = ActScaleKindOf(d.x_scale_kind);
  p.sx = static_cast<float*>(scratch->untyped_data());
  cudaError_t err = cudaSuccess;
  if (static_scale)
    err = cudaMemcpyAsync(h_scale->untyped_data(), down_scale.untyped_data(), sizeof(float),
                          cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess) err = LaunchHopperGemm(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("w4a8_moe_up: kernel failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8MoeUpCuda, jax_w4a8::W4a8MoeUpCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // x_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // w13 (gate rows, then up rows)
                                  .Arg<xla::ffi::AnyBuffer>()   // w13_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // group_sizes
                                  .Arg<xla::ffi::AnyBuffer>()   // down_input_scale (f32 scalar)
                                  .Ret<xla::ffi::AnyBuffer>()   // h8
                                  .Ret<xla::ffi::AnyBuffer>()   // h_scale
                                  .Ret<xla::ffi::AnyBuffer>()   // scratch
                                  .Attr<int32_t>("tile_tokens")
                                  .Attr<bool>("static_scale")
                                  .Attr<int32_t>("mma")     // 0 e4m3, 1 f16 (jax_w4a8.tiling.MMAS)
                                  .Attr<bool>("ue8m0"),     // dynamic scales: UE8M0, else float32
                              {xla::ffi::Traits::kCmdBufferCompatible});
