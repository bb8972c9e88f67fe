// Read-bandwidth probe for the decode kernels' weight access patterns (H200); not part of the library:
// TMA boxes of 128 rows x W bytes (the int4 kernels' stage: W = 64, one K group), S stages in flight per
// block, B blocks per SM, with and without 256-byte L2 promotion; LDG row segments (the fp8 einsum decode
// kernel's pattern) with and without the L2::256B hint; contiguous LDG and cudaMemcpy as references.
// Results: benchmarks/NOTEBOOK.md (sixteenth session). Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a -Iffi/cuda -o read_bandwidth benchmarks/read_bandwidth.cu && ./read_bandwidth
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include "hopper_ptx.cuh"
using namespace jax_w4a8;

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__global__ void TmaRead(const __grid_constant__ CUtensorMap map, int rows, int cols, int w, int stages, uint32_t* sink) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int stage_bytes = 128 * w;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
  uint64_t* empty = full + stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { sm90::MbarInit(&full[s], 1); sm90::MbarInit(&empty[s], 1); }
    sm90::FenceBarrierInit();
  }
  __syncthreads();
  const int tiles = rows / 128, chunks = cols / w;
  if (threadIdx.x == 0) {
    int stage = 0; uint32_t phase = 0;
    for (int u = blockIdx.x; u < tiles; u += gridDim.x)
      for (int c = 0; c < chunks; ++c) {
        sm90::MbarWait(&empty[stage], phase ^ 1);
        sm90::MbarArriveExpectTx(&full[stage], stage_bytes);
        sm90::TmaLoad3d(smem + stage * stage_bytes, &map, &full[stage], c * w, u * 128, 0);
        if (++stage == stages) { stage = 0; phase ^= 1; }
      }
  } else if (threadIdx.x == 32) {
    int stage = 0; uint32_t phase = 0; uint32_t acc = 0;
    for (int u = blockIdx.x; u < tiles; u += gridDim.x)
      for (int c = 0; c < chunks; ++c) {
        sm90::MbarWait(&full[stage], phase);
        acc += *reinterpret_cast<volatile uint32_t*>(smem + stage * stage_bytes);
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sm90::SmemAddr(&empty[stage])) : "memory");
        if (++stage == stages) { stage = 0; phase ^= 1; }
      }
    if (acc == 0x12345678u) sink[0] = acc;
  }
}

__device__ __forceinline__ uint4 Ld(const uint8_t* p, bool l2_256) {
  uint4 r;
  if (l2_256)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Each warp: 16-row tiles (grid stride over warps), K in 128-byte groups; per group a lane loads rows
// lane/4 and lane/4 + 8, bytes [16t, +16) and [64 + 16t, +16) (the fp8 einsum decode pattern); D groups
// in flight.
template <int D>
__global__ void LdgRows(const uint8_t* w, int rows, int cols, bool l2_256, uint32_t* sink) {
  const int lane = threadIdx.x % 32, t = lane % 4, r = lane / 4;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nwarps = gridDim.x * blockDim.x / 32;
  const int groups = cols / 128;
  uint32_t acc = 0;
  for (int tile = warp; tile < rows / 16; tile += nwarps) {
    const uint8_t* a = w + (size_t)(tile * 16 + r) * cols + 16 * t;
    const uint8_t* b = a + (size_t)8 * cols;
    uint4 q[D][4];
#pragma unroll
    for (int d = 0; d < D; ++d) { q[d][0] = Ld(a + 128 * d, l2_256); q[d][1] = Ld(a + 128 * d + 64, l2_256); q[d][2] = Ld(b + 128 * d, l2_256); q[d][3] = Ld(b + 128 * d + 64, l2_256); }
    for (int g = 0; g < groups; g += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        acc ^= q[d][0].x ^ q[d][1].y ^ q[d][2].z ^ q[d][3].w;
        const int gn = min(g + D + d, groups - 1);
        q[d][0] = Ld(a + 128 * gn, l2_256); q[d][1] = Ld(a + 128 * gn + 64, l2_256);
        q[d][2] = Ld(b + 128 * gn, l2_256); q[d][3] = Ld(b + 128 * gn + 64, l2_256);
      }
    }
#pragma unroll
    for (int d = 0; d < D; ++d) acc ^= q[d][0].x ^ q[d][1].y ^ q[d][2].z ^ q[d][3].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void LdgContig(const uint4* w, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = w[i], b = w[i + stride], c = w[i + 2 * stride], d = w[i + 3 * stride];
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += stride) acc ^= w[i].x;
  if (acc == 0x12345678u) sink[0] = acc;
}

static PFN_cuTensorMapEncodeTiled_v12000 Encode() {
  void* ptr = nullptr; cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q));
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
}

template <typename F> float TimeUs(F f, int reps = 20) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  f(); f(); CK(cudaDeviceSynchronize());
  CK(cudaEventRecord(a)); for (int i = 0; i < reps; ++i) f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
  float ms; CK(cudaEventElapsedTime(&ms, a, b)); CK(cudaGetLastError());
  return ms * 1000 / reps;
}

int main() {
  const size_t bytes = size_t{32} * 4096 * 3584;  // gate+up int4 of 32 experts: 470 MB
  uint8_t *w, *w2; uint32_t* sink;
  CK(cudaMalloc(&w, bytes)); CK(cudaMalloc(&w2, bytes)); CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(w, 0x5A, bytes));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const float t_copy = TimeUs([&] { CK(cudaMemcpyAsync(w2, w, bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_bw = 2.0 * bytes / t_copy / 1e3;  // GB/s (read + write)
  printf("memcpy D2D %zu MB: %.1f us, copy bandwidth %.0f GB/s\n", bytes >> 20, t_copy, copy_bw);
  auto report = [&](const char* name, float us) { printf("%-60s %8.1f us %6.0f GB/s %5.1f%% of copy BW\n", name, us, bytes / us / 1e3, 100.0 * bytes / us / 1e3 / copy_bw); };
  for (int blk : {4, 8}) {
    char nm[128]; snprintf(nm, sizeof nm, "LDG contiguous 16B x4, %d blocks/SM x 256", blk);
    report(nm, TimeUs([&] { LdgContig<<<sms * blk, 256>>>((const uint4*)w, bytes / 16, sink); }));
  }
  auto enc = Encode();
  for (int l2 : {0, 1}) for (int w_bytes : {64, 128, 256}) {
    const int cols = 3584, rows = (int)(bytes / cols);
    CUtensorMap map;
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, 1};
    const cuuint64_t strides[2] = {(cuuint64_t)cols, (cuuint64_t)bytes};
    const cuuint32_t box[3] = {(cuuint32_t)w_bytes, 128, 1}, es[3] = {1, 1, 1};
    if (enc(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, w, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
            w_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_NONE,
            l2 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      printf("encode failed W=%d\n", w_bytes); continue; }
    for (int bps : {1, 2}) for (int kb_in_flight : {32, 64, 96}) {
      const int stage_bytes = 128 * w_bytes;
      const int stages = kb_in_flight * 1024 / bps / stage_bytes;
      if (stages < 2) continue;
      const int smem = stages * stage_bytes + 1024 + 16 * stages;
      if (smem > 227 * 1024 / bps) continue;
      CK(cudaFuncSetAttribute(TmaRead, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      char nm[160]; snprintf(nm, sizeof nm, "TMA 128x%dB box, L2prom %s, %d blk/SM, %d stages (%d KB/SM)", w_bytes, l2 ? "256" : "none", bps, stages, stages * stage_bytes * bps / 1024);
      report(nm, TimeUs([&] { TmaRead<<<sms * bps, 64, smem>>>(map, rows, cols, w_bytes, stages, sink); }));
    }
  }
  for (int l2 : {0, 1}) for (int cols : {3584, 16384}) for (int wps : {8, 16, 32}) {
    const int rows = (int)(bytes / cols);
    char nm[160];
    snprintf(nm, sizeof nm, "LDG rows (einsum decode) cols %d, %d warps/SM, D=2, L2 %s", cols, wps, l2 ? "256" : "none");
    report(nm, TimeUs([&] { LdgRows<2><<<sms * wps / 4, 128>>>(w, rows, cols, l2, sink); }));
    snprintf(nm, sizeof nm, "LDG rows (einsum decode) cols %d, %d warps/SM, D=4, L2 %s", cols, wps, l2 ? "256" : "none");
    report(nm, TimeUs([&] { LdgRows<4><<<sms * wps / 4, 128>>>(w, rows, cols, l2, sink); }));
  }
  return 0;
}
