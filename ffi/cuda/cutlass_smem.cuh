// Shared by the CUTLASS translation units (included only when built with CUTLASS headers).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "cutlass/device_kernel.h"

namespace jax_w4a8 {

// Dynamic shared-memory opt-in of a CUTLASS kernel, once per device (the kernels need about 200 KB; setting
// it twice is harmless, so devices past the cache just set it every call).
template <class Kernel>
bool EnsureCutlassSmemOptIn() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return false;
  if (dev < kMaxDevices && done[dev].load(std::memory_order_acquire)) return true;
  const int smem = static_cast<int>(sizeof(typename Kernel::SharedStorage));
  if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return false;
  if (dev < kMaxDevices) done[dev].store(true, std::memory_order_release);
  return true;
}

}  // namespace jax_w4a8
