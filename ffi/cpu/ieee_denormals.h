// CPU handlers compute with IEEE subnormals, as the CUDA kernels do (nvcc without -ftz). XLA's CPU runtime runs
// computations with subnormal inputs and results flushed to zero (x86 MXCSR DAZ / FTZ, the FPCR's FZ on
// Arm), which would turn UE8M0 code 0 (2^-127, a float32 subnormal) and subnormal float32 scales into 0: a
// product sx * sw * part that is a normal number (2^-127 * 2^127 * 512 = 512) came out 0. A scope of this
// type clears those modes on the handler's thread and restores the caller's on exit.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace jax_w4a8 {

class IeeeDenormalsScope {
 public:
  IeeeDenormalsScope() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~kFtzDaz);
#elif defined(__aarch64__)
    asm volatile("mrs %0, fpcr" : "=r"(saved_) : : "memory");
    asm volatile("msr fpcr, %0" : : "r"(saved_ & ~kFz) : "memory");
#endif
  }
  ~IeeeDenormalsScope() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    asm volatile("msr fpcr, %0" : : "r"(saved_) : "memory");
#endif
  }
  IeeeDenormalsScope(const IeeeDenormalsScope&) = delete;
  IeeeDenormalsScope& operator=(const IeeeDenormalsScope&) = delete;

 private:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kFtzDaz = 0x8040u;  // MXCSR bit 15 flush-to-zero, bit 6 denormals-are-zero
  unsigned saved_ = 0;
#elif defined(__aarch64__)
  static constexpr uint64_t kFz = uint64_t{1} << 24;  // FPCR.FZ
  uint64_t saved_ = 0;
#endif
};

}  // namespace jax_w4a8
