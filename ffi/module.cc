// The Python modules jax_w4a8._lib._ffi_cpu and jax_w4a8._lib._ffi_cuda (this file compiled twice,
// with JAX_W4A8_CUDA defined for the second): registrations() -> {target name: handler capsule} and
// source_sha256() (the fingerprint of the ffi/ sources it was built from); the CUDA module also has
// built_with_cutlass(), built_with_cublaslt() and load_cublaslt(path) (the einsum's cuBLASLt path), the scratch each
// CUDA handler checks for a plan (w4a8_grouped_gemm_scratch,
// w4a8_moe_up_scratch, fp8_einsum_scratch) and the einsum decode kernel's launch (fp8_decode_launch;
// tests/test_tiling.py).
// Target names must match jax_w4a8/_ffi.py:TARGETS.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <string>
#include <tuple>

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
#include "cuda/fp8_decode_gemm.cuh"  // PlanFp8Decode (host code)

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxW4a8MoeUpCuda);  // CUDA only: other platforms compose unfused ops
namespace jax_w4a8 {
bool CutlassBlockwiseBuilt();  // ffi/cuda/fp8_blockwise_cutlass.cu
bool W4a8CutlassBuilt();       // ffi/cuda/w4a8_grouped_cutlass.cu
// The scratch the CUDA handlers check for a plan (hopper_gemm.cuh, w4a8_grouped_cutlass.cuh, fp8_blockwise_cutlass.cuh)
size_t W4a8GroupedGemmScratchNeed(int64_t m, int64_t e, int64_t n, int64_t k, int tile_tokens, int split_k, bool f16,
                                  bool x_folded);
size_t W4a8MoeUpScratchNeed(int64_t m, int64_t inter, int64_t k, bool f16);
size_t HopperGemmScratchBytes(int64_t m, int64_t h, int64_t f, int64_t k, int split_k, int tile_tokens,
                              int64_t grouped_batches);
size_t W4a8CutlassScratchBytes(int64_t m, int64_t e, int64_t n, int64_t k, int64_t experts_per_chunk);
size_t CutlassBlockwiseScratchBytes(int64_t m, int64_t h, int64_t n, int64_t k, bool w_ue8m0);
bool CublasBlockwiseBuilt();                                          // ffi/cuda/fp8_blockwise_cublas.cu
size_t CublasBlockwiseLoad(const std::string& path, std::string* why);
size_t CublasBlockwiseScratchBytes(int64_t m, int64_t n, int64_t k);
}
#endif

#ifndef JAX_W4A8_SOURCE_SHA256  // set by CMakeLists.txt: the fingerprint of the ffi/ sources compiled here
#define JAX_W4A8_SOURCE_SHA256 "unknown"
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
  // Which sources this module was built from (jax_w4a8.build_info() compares it with a source checkout's).
  m.def("source_sha256", []() { return JAX_W4A8_SOURCE_SHA256; });
#if defined(JAX_W4A8_CUDA)
  // Whether the fp8 einsum's CUTLASS prefill kernel was compiled in (jax_w4a8.tiling plans it only then).
  m.def("built_with_cutlass", []() { return jax_w4a8::CutlassBlockwiseBuilt() && jax_w4a8::W4a8CutlassBuilt(); });
  // Whether the einsum's cuBLASLt path was compiled in, and loading cuBLASLt (path "": the copy in the process or
  // the loader's search): (version, "") or (0, why not). jax_w4a8._ffi.cublaslt() calls it.
  m.def("built_with_cublaslt", []() { return jax_w4a8::CublasBlockwiseBuilt(); });
  m.def("load_cublaslt", [](const std::string& path) {
    std::string why;
    const size_t version = jax_w4a8::CublasBlockwiseLoad(path, &why);
    return std::make_tuple(version, version ? std::string() : why);
  });
  // The scratch bytes each CUDA handler checks for a plan (tests compare jax_w4a8.tiling's plans with them).
  m.def("w4a8_grouped_gemm_scratch", [](int64_t m_, int64_t e, int64_t n, int64_t k, int tile_tokens, int split_k,
                                        bool f16, bool cutlass, int64_t experts_per_chunk, bool x_folded) {
    return cutlass ? jax_w4a8::W4a8CutlassScratchBytes(m_, e, n, k, experts_per_chunk)
                   : jax_w4a8::W4a8GroupedGemmScratchNeed(m_, e, n, k, tile_tokens, split_k, f16, x_folded);
  });
  m.def("w4a8_moe_up_scratch", [](int64_t m_, int64_t inter, int64_t k, bool f16) {
    return jax_w4a8::W4a8MoeUpScratchNeed(m_, inter, k, f16);
  });
  // The fp8 einsum decode kernel's launch for M tokens, H heads, N rows, K / 128 groups on `sms` SMs (tests pin the
  // measured plans of DeepSeek-V3's linears; tests/test_tiling.py).
  m.def("fp8_decode_launch", [](int64_t m_, int64_t h, int64_t n, int64_t groups, int sms) {
    const jax_w4a8::Fp8DecodeLaunch p = jax_w4a8::PlanFp8Decode(m_, h, n, groups, sms);
    nb::dict d;
    d["warps"] = p.warps;
    d["cluster"] = p.cluster;
    d["whole_tiles"] = p.whole_tiles;
    d["blocks"] = p.blocks;
    d["staged"] = p.staged;
    return d;
  });
  m.def("fp8_einsum_scratch", [](int64_t m_, int64_t h, int64_t n, int64_t k, int tile_tokens, int split_k,
                                 bool cutlass, bool w_ue8m0, bool cublas) -> size_t {
    if (cublas) return jax_w4a8::CublasBlockwiseScratchBytes(m_, n, k);
    if (cutlass) return jax_w4a8::CutlassBlockwiseScratchBytes(m_, h, n, k, w_ue8m0);
    return tile_tokens == 8 ? 0 : jax_w4a8::HopperGemmScratchBytes(m_, h, n, k, split_k, tile_tokens, 0);
  });
#endif
}
