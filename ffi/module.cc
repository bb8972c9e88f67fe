// The Python modules jax_w4a8._lib._ffi_cpu and jax_w4a8._lib._ffi_cuda (this file compiled twice,
// with JAX_W4A8_CUDA defined for the second): registrations() -> {target name: handler capsule}; the
// CUDA module also has built_with_cutlass().
// Target names must match jax_w4a8/_ffi.py:TARGETS.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

#if defined(JAX_W4A8_CUDA)
#define JAX_W4A8_MODULE _ffi_cuda
#define JAX_W4A8_HANDLER(name) name##Cuda
#else
#define JAX_W4A8_MODULE _ffi_cpu
#define JAX_W4A8_HANDLER(name) name##Cpu
#endif

XLA_FFI_DECLARE_HANDLER_SYMBOL(JAX_W4A8_HANDLER(JaxW4a8GroupedGemm));
XLA_FFI_DECLARE_HANDLER_SYMBOL(JAX_W4A8_HANDLER(JaxW4a8Fp8Einsum));
XLA_FFI_DECLARE_HANDLER_SYMBOL(JAX_W4A8_HANDLER(JaxW4a8Ue8m0Pack));
XLA_FFI_DECLARE_HANDLER_SYMBOL(JAX_W4A8_HANDLER(JaxW4a8QuantizeFp8Groups));
#if defined(JAX_W4A8_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxW4a8MoeUpCuda);  // CUDA only: other platforms compose unfused ops
namespace jax_w4a8 {
bool CutlassBlockwiseBuilt();  // ffi/cuda/fp8_blockwise_cutlass.cu
bool W4a8CutlassBuilt();       // ffi/cuda/w4a8_grouped_cutlass.cu
}
#endif

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(JAX_W4A8_MODULE, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_w4a8_w4a8_grouped_gemm"] = Capsule(JAX_W4A8_HANDLER(JaxW4a8GroupedGemm));
    d["jax_w4a8_fp8_einsum"] = Capsule(JAX_W4A8_HANDLER(JaxW4a8Fp8Einsum));
    d["jax_w4a8_ue8m0_pack"] = Capsule(JAX_W4A8_HANDLER(JaxW4a8Ue8m0Pack));
    d["jax_w4a8_quantize_fp8_groups"] = Capsule(JAX_W4A8_HANDLER(JaxW4a8QuantizeFp8Groups));
#if defined(JAX_W4A8_CUDA)
    d["jax_w4a8_w4a8_moe_up"] = Capsule(JaxW4a8MoeUpCuda);
#endif
    return d;
  });
#if defined(JAX_W4A8_CUDA)
  // Whether the fp8 einsum's CUTLASS prefill kernel was compiled in (jax_w4a8.tiling plans it only then).
  m.def("built_with_cutlass", []() { return jax_w4a8::CutlassBlockwiseBuilt() && jax_w4a8::W4a8CutlassBuilt(); });
#endif
}
