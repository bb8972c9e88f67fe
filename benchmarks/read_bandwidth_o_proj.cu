// Read-bandwidth probe for the fp8 einsum's one-token decode launch on DeepSeek-V3's o_proj (H200); not part of
// the library. The weights, 7168 x 16384 e4m3 (117 MB), read by 448 blocks of four warps, one 16-row tile per
// block and a quarter of K per warp, as Fp8DecodeKernel's split-K plan reads them: "tile" (a lane loads rows
// lane/4 and lane/4 + 8 at bytes [16t, +16) and [64 + 16t, +16) of each 128-byte K group: one instruction
// reads 64 bytes of each of 8 rows), D groups in flight; "tile interleaved" (warp w takes groups w, w + 4,
// ...); "rowruns" (the same tiles and quarters, one instruction reading 512 contiguous bytes of one row, the
// rows in turn); "rowstage" (16 rows x R bytes of the warp's quarter in flight per step, 512 contiguous bytes per
// instruction, as a shared-memory stage for the MMAs would be filled) and "blockstage" (the block's warps
// sharing one K stretch, 16 rows in flight per block; both added after the thirty-fourth session's runs, not
// yet run); grid-stride contiguous loads as the reference.
// Results: benchmarks/NOTEBOOK.md (thirty-fourth session). Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90a -o read_bandwidth_o_proj benchmarks/read_bandwidth_o_proj.cu && ./read_bandwidth_o_proj
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
__device__ __forceinline__ uint4 Ld(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__global__ void Stream(const uint8_t* w, int64_t bytes, unsigned* sink) {
  unsigned acc = 0;
  const int64_t n = bytes / 16, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    uint4 v = Ld(w + i * 16); acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
// Block = 16-row tile; warp w takes K groups [w*G/4, (w+1)*G/4), or with kInterleaved groups w, w + 4, ... (a
// block's 4 warps read 512 contiguous bytes of each row together); lane g=lane/4 rows g, g+8; t=lane%4 bytes
// 16t, 64+16t.
template <int D, bool kInterleaved>
__global__ void __launch_bounds__(128, 4) Tile(const uint8_t* w, int64_t k, unsigned* sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t groups = k / 128, step = kInterleaved ? 4 : 1;
  const int64_t g0 = kInterleaved ? warp : groups * warp / 4, g1 = kInterleaved ? groups : groups * (warp + 1) / 4;
  const uint8_t* r0 = w + ((int64_t)blockIdx.x * 16 + g) * k + 16 * t;
  const uint8_t* r1 = r0 + 8 * k;
  unsigned acc = 0;
  for (int64_t gr = g0; gr < g1; gr += step * D) {
    uint4 v[D][4];
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int64_t off = (gr + step * d) * 128;
      v[d][0] = Ld(r0 + off); v[d][1] = Ld(r0 + off + 64); v[d][2] = Ld(r1 + off); v[d][3] = Ld(r1 + off + 64);
    }
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc ^= v[d][i].x ^ v[d][i].y ^ v[d][i].z ^ v[d][i].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
// Same tiles, but each warp reads 512 contiguous bytes of one row per load (lane * 16), rows in turn.
template <int D>
__global__ void __launch_bounds__(128, 4) RowRuns(const uint8_t* w, int64_t k, unsigned* sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t kq = k / 4;  // bytes per warp per row
  unsigned acc = 0;
  const int chunks = kq / 512;  // per row
  for (int c = 0; c < 16 * chunks; c += D) {
    uint4 v[D];
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int cc = c + d, row = cc / chunks, ch = cc % chunks;
      v[d] = Ld(w + ((int64_t)blockIdx.x * 16 + row) * k + warp * kq + ch * 512 + lane * 16);
    }
#pragma unroll
    for (int d = 0; d < D; ++d) acc ^= v[d].x ^ v[d].y ^ v[d].z ^ v[d].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
// Same tiles and quarters, as a shared-memory stage would be filled for the MMAs: per step all 16 rows x
// kRun bytes of the warp's next K stretch in flight, one instruction reading 512 contiguous bytes (kRun >= 512:
// one row's piece) or 512 / kRun rows' pieces (kRun < 512: lanes 0..kRun/16-1 the first row, ...).
template <int kRun>
__global__ void __launch_bounds__(128, 4) RowStage(const uint8_t* w, int64_t k, unsigned* sink) {
  constexpr int kLoads = 16 * kRun / 512, kRowsPerLoad = kRun >= 512 ? 1 : 512 / kRun;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t kq = k / 4;
  const uint8_t* base = w + (int64_t)blockIdx.x * 16 * k + warp * kq;
  unsigned acc = 0;
  for (int64_t off = 0; off < kq; off += kRun) {
    uint4 v[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      int row, col;
      if constexpr (kRun >= 512) row = i / (kRun / 512), col = (i % (kRun / 512)) * 512 + 16 * lane;
      else row = i * kRowsPerLoad + lane / (kRun / 16), col = 16 * (lane % (kRun / 16));
      v[i] = Ld(base + (int64_t)row * k + off + col);
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
// A block-wide stage instead: the block's four warps share one K stretch of the tile (no split of K), warp w
// reading rows 4w .. 4w + 3, 512 contiguous bytes of each per step, D steps in flight: 16 rows in flight per
// block, not 16 per warp.
template <int D>
__global__ void __launch_bounds__(128, 4) BlockStage(const uint8_t* w, int64_t k, unsigned* sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint8_t* base = w + ((int64_t)blockIdx.x * 16 + 4 * warp) * k + 16 * lane;
  unsigned acc = 0;
  for (int64_t off = 0; off < k; off += 512 * D) {
    uint4 v[D][4];
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int r = 0; r < 4; ++r) v[d][r] = Ld(base + r * k + off + 512 * d);
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc ^= v[d][r].x ^ v[d][r].y ^ v[d][r].z ^ v[d][r].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}
template <typename F>
float Time(F f) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  cudaEventRecord(a);
  for (int i = 0; i < 20; ++i) f();
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  return ms * 1000 / 20;
}
int main() {
  const int64_t n = 7168, k = 16384, bytes = n * k;
  uint8_t* w; unsigned* sink; uint8_t* flush;
  cudaMalloc(&w, bytes); cudaMalloc(&sink, 4); cudaMalloc(&flush, 256 << 20);
  cudaMemset(w, 1, bytes);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int tiles = n / 16;
  auto report = [&](const char* name, float us) { printf("%-28s %7.1f us  %6.2f TB/s\n", name, us, bytes / us / 1e6); };
  // each timed call is preceded by nothing: 117 MB > 60 MB L2, so back-to-back calls mostly miss anyway
  report("stream 4 blocks/SM", Time([&] { Stream<<<sms * 4, 128>>>(w, bytes, sink); }));
  report("stream 8 blocks/SM x256", Time([&] { Stream<<<sms * 8, 256>>>(w, bytes, sink); }));
  report("tile D=1", Time([&] { Tile<1, false><<<tiles, 128>>>(w, k, sink); }));
  report("tile D=2", Time([&] { Tile<2, false><<<tiles, 128>>>(w, k, sink); }));
  report("tile D=4", Time([&] { Tile<4, false><<<tiles, 128>>>(w, k, sink); }));
  report("tile D=8", Time([&] { Tile<8, false><<<tiles, 128>>>(w, k, sink); }));
  report("tile interleaved D=1", Time([&] { Tile<1, true><<<tiles, 128>>>(w, k, sink); }));
  report("tile interleaved D=2", Time([&] { Tile<2, true><<<tiles, 128>>>(w, k, sink); }));
  report("tile interleaved D=4", Time([&] { Tile<4, true><<<tiles, 128>>>(w, k, sink); }));
  report("rowruns D=2", Time([&] { RowRuns<2><<<tiles, 128>>>(w, k, sink); }));
  report("rowruns D=4", Time([&] { RowRuns<4><<<tiles, 128>>>(w, k, sink); }));
  report("rowruns D=8", Time([&] { RowRuns<8><<<tiles, 128>>>(w, k, sink); }));
  report("rowstage 16 rows x 256 B", Time([&] { RowStage<256><<<tiles, 128>>>(w, k, sink); }));
  report("rowstage 16 rows x 512 B", Time([&] { RowStage<512><<<tiles, 128>>>(w, k, sink); }));
  report("rowstage 16 rows x 1024 B", Time([&] { RowStage<1024><<<tiles, 128>>>(w, k, sink); }));
  report("blockstage 16 rows x 512 B, D=1", Time([&] { BlockStage<1><<<tiles, 128>>>(w, k, sink); }));
  report("blockstage 16 rows x 512 B, D=2", Time([&] { BlockStage<2><<<tiles, 128>>>(w, k, sink); }));
  report("blockstage 16 rows x 512 B, D=4", Time([&] { BlockStage<4><<<tiles, 128>>>(w, k, sink); }));
  printf("err %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
