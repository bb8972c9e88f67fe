// The fp8 einsum's cuBLASLt path for recipe (1, 128, 128): cuBLASLt's own block-scaled FP8 GEMM on Hopper
// (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F activation scales x BLK128x128_32F weight scales, cuBLAS >= 12.9,
// compute capability 9.0 only), bf16 output. cuBLASLt is loaded at run time (dlopen: the copy JAX's CUDA plugin
// already loaded, or a path from jax_w4a8._ffi); building needs only its header. See fp8_blockwise_cublas.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_w4a8 {

struct CublasBlockwiseParams {
  const uint8_t* x;     // e4m3 [M, K]
  const void* x_scale;  // [M, G] float32 or UE8M0 codes
  const uint8_t* w;     // e4m3 [N, K]
  const void* w_scale;  // [ceil(N/128), G] float32 or UE8M0 codes
  void* out;            // bfloat16 [M, N]
  int64_t m, n, k;
  bool x_ue8m0, w_ue8m0;
  void* scratch;  // CublasBlockwiseScratchBytes(m, n, k) bytes
  size_t scratch_bytes;
  int algo;  // which of cuBLASLt's heuristic results to run: 0 (its first choice) .. kCublasMaxAlgos - 1
};

// How many heuristic results a call may choose among (jax_w4a8.tiling.cublas_algo).
constexpr int kCublasMaxAlgos = 16;

// cuBLASLt's workspace inside the scratch (NVIDIA recommends 32 MiB on Hopper).
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Whether the library was compiled with the cuBLASLt path (its header was found at build time).
bool CublasBlockwiseBuilt();

// Loads cuBLASLt (path empty: the copy already in the process, else the loader's search by soname) and returns
// its version (e.g. 130002), or 0 with *why set. A loaded library stays loaded; later calls return its version.
size_t CublasBlockwiseLoad(const std::string& path, std::string* why);

// Scratch: activation scales as float32 [G, M] (M fastest, cuBLASLt's VEC128 layout of its B operand), weight
// scales as float32 [ceil(N/128), ceil4(G)] (K blocks fastest, rows padded to a multiple of 4 with zeros: its
// BLK128x128 layout), then the workspace (at the next 256-byte boundary: 256 bytes of slack); each region
// 256-byte aligned relative to the scratch. jax_w4a8.tiling mirrors this.
size_t CublasBlockwiseScratchBytes(int64_t m, int64_t n, int64_t k);

// Empty when cuBLASLt's block-scaled GEMM can run these shapes, else why not.
std::string CublasBlockwiseUnsupported(int64_t m, int64_t h, int64_t n, int64_t k);

// Prepares the float32 scales in scratch, then runs the GEMM on `stream`. On failure returns false with *why set.
bool LaunchCublasBlockwise(const CublasBlockwiseParams& p, cudaStream_t stream, std::string* why);

}  // namespace jax_w4a8
