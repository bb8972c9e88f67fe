// CUDA handler of ops.pack_ue8m0: float32 powers of two -> masked exponent bytes, or an error.
//
// The only handler here that synchronises with the host: it must read back how many values were not
// powers of two to fail the call. It is therefore not marked command-buffer compatible; the fast
// path passes UE8M0 scales as uint8 codes and never calls it.
#include <cuda_runtime.h>

#include <cstdint>
#include <string_view>

#include "../common/checks.h"
#include "../common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

__global__ void Ue8m0PackKernel(const uint32_t* s, uint8_t* c, int64_t count, unsigned int* bad) {
  unsigned int local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t b = s[i];
    local += !IsUe8m0Exact(b);
    c[i] = Ue8m0Code(b);
  }
  if (local) atomicAdd(bad, local);
}

ffi::Error Ue8m0PackCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer scale,
                         ffi::Result<ffi::AnyBuffer> codes,
                         std::string_view arg) {
  if (auto err = CheckUe8m0Pack(scale, *codes); err.failure()) return err;
  const int64_t count = static_cast<int64_t>(scale.element_count());
  if (count == 0) return ffi::Error::Success();
  auto mem = scratch.Allocate(sizeof(unsigned int));
  if (!mem.has_value()) return ffi::Error::Internal("pack_ue8m0: scratch allocation failed");
  auto* bad = static_cast<unsigned int*>(*mem);
  cudaMemsetAsync(bad, 0, sizeof(unsigned int), stream);
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 1024));
  Ue8m0PackKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(scale.untyped_data()),
                                              static_cast<uint8_t*>(codes->untyped_data()), count, bad);
  unsigned int host_bad = 0;
  cudaMemcpyAsync(&host_bad, bad, sizeof(host_bad), cudaMemcpyDeviceToHost, stream);
  if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess)
    return ffi::Error::Internal(std::string("pack_ue8m0: ") + cudaGetErrorString(err));
  if (host_bad) return ffi::Error::InvalidArgument(Ue8m0RejectMessage(arg, host_bad));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8Ue8m0PackCuda, jax_w4a8::Ue8m0PackCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()   // scale
                                  .Ret<xla::ffi::AnyBuffer>()   // codes
                                  .Attr<std::string_view>("arg"));  // argument name for errors
