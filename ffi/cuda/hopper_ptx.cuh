// Thin wrappers over the Hopper (sm_90a) PTX this library uses: mbarriers, TMA bulk tensor loads, cp.async,
// shared-space loads, wgmma (fp8 e4m3 x e4m3 -> f32; B, and A unless it comes from registers, K-major
// in shared memory with 128-byte swizzle) and register reallocation. Only what the kernels need; each wrapper is one
// instruction, named as in the PTX ISA.
#pragma once

#include <cuda.h>
#include <cstdint>

namespace jax_w4a8 {
namespace sm90 {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------------------------ mbarrier
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}

__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)), "r"(bytes)
               : "memory");
}

// Arrive only where pred holds, without a branch (a branch between in-flight wgmma would serialize them).
__device__ __forceinline__ void MbarArriveIf(uint64_t* bar, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(SmemAddr(bar)),
      "r"(static_cast<int>(pred))
      : "memory");
}

__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Named barrier over `threads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void NamedBarrierSync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Shared-space loads (ld.shared: no generic-address conversion).
// Not volatile: repeated loads of the same address may be merged (callers order them with barriers).
__device__ __forceinline__ float LdSharedF32(uint32_t addr) {
  float v;
  asm("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 LdShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint2 LdShared64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void StShared32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void StShared128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// ------------------------------------------------------------------------------------ cp.async (sm_80)
// 16 bytes global -> shared, in this thread's current copy group: .cg caches in L2 only (bytes read once),
// .ca through L1 too (bytes every warp of the SM reads).
__device__ __forceinline__ void CpAsyncCg16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncCa16(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncCommitGroup() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are pending (its own copies only).
template <int N>
__device__ __forceinline__ void CpAsyncWaitGroup() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8 x 8 b16 matrices from shared memory (lane l gives row l % 8 of matrix l / 8): r[j] is
// matrix j's element pair (row lane / 4, columns 2 (lane % 4) + {0, 1}).
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// One warp's D[16 x 8] += A[16 x 16] * B[16 x 8], f16 operands, f32 accumulators (HMMA): a as for the
// f16 wgmma's register A (rows lane / 4 and + 8 of the warp's 16), b0 = B(k = 2 (lane % 4) + {0, 1},
// n = lane / 4), b1 the same at k + 8; d[0], d[1]: row lane / 4, columns 2 (lane % 4) + {0, 1}; d[2], d[3]:
// row + 8. Not volatile: the compiler schedules it by its register dependencies.
__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Orders this thread's shared-memory accesses through the generic proxy with later async-proxy ones: writes
// made visible to later wgmma reads, and reads of a stage done before the producer's next TMA write into it.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// stmatrix m8n8.x4.trans: four 8 x 8 b16 matrices from the mma fragment layout (this thread: row lane / 4,
// columns 2 (lane % 4) and + 1 of matrix q in r[q]), each stored transposed: its row k (the fragment's
// column k) at the address given by lane 8 q + k, 16 bytes.
__device__ __forceinline__ void StMatrixX4Trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// Two floats -> bf16x2 (round to nearest even), lo in the low half.
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// GPU-scope release and acquire fences (not __threadfence(), a sequentially consistent fence:
// MEMBAR.SC.GPU plus an L1 invalidation in every lane). Release is MEMBAR.ALL.GPU in SASS, acquire
// an L1 invalidation. After a warp or block barrier a release also covers the writes the other
// threads made before it (cumulativity; CUTLASS's GenericBarrier releases a block's partial tiles
// with one thread's fence after __syncthreads).
// fence.release / fence.acquire need PTX ISA 8.6 (CUDA 12.8); older toolkits get the acquire-release
// fence, which is both (CUTLASS's GenericBarrier uses it for the release).
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 8))
__device__ __forceinline__ void FenceReleaseGpu() { asm volatile("fence.release.gpu;" ::: "memory"); }
__device__ __forceinline__ void FenceAcquireGpu() { asm volatile("fence.acquire.gpu;" ::: "memory"); }
#else
__device__ __forceinline__ void FenceReleaseGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void FenceAcquireGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
#endif

// Relaxed GPU-scope atomic add on a global int; returns the old value (ordering comes from the fences).
__device__ __forceinline__ int AtomicAddRelaxedGpu(int* ptr, int v) {
  int old;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
  return old;
}

// --------------------------------------------------------------- programmatic dependent launch
// Wait until the grid this one depends on has completed and its writes are visible (at once without PDL).
__device__ __forceinline__ void GridDependencyWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Let the dependent grid launch now (its blocks still wait in GridDependencyWait for this grid's end).
__device__ __forceinline__ void LaunchDependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// ----------------------------------------------------------------------------------------- TMA
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void TmaLoad3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                          int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// ---------------------------------------------------------------------------------------- wgmma
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, rows of 128 bytes, 8-row groups 1024
// bytes apart (SBO), tile base 1024-byte aligned. Advancing K by 32 fp8 adds 32 bytes to the start.
__device__ __forceinline__ uint64_t DescSw128(const void* tile, uint32_t k_byte_offset) {
  const uint64_t addr = SmemAddr(tile) + k_byte_offset;
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= uint64_t{1} << 16;             // leading byte offset (unused for swizzled K-major)
  desc |= uint64_t{1024 >> 4} << 32;     // stride byte offset: 8 rows x 128 B
  desc |= uint64_t{1} << 62;             // layout: 128-byte swizzle
  return desc;
}

// Shared-memory matrix descriptor: K-major, no swizzle (8 x 16-byte core matrices), core matrices
// lbo bytes apart along K and sbo bytes apart along M/N.
__device__ __forceinline__ uint64_t DescNoSwizzle(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= uint64_t{lbo >> 4} << 16;
  desc |= uint64_t{sbo >> 4} << 32;
  return desc;  // layout type 0: no swizzle
}

template <uint32_t kRegs>
__device__ __forceinline__ void SetMaxNReg() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void ReleaseNReg() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Accumulator operands of the wgmma wrappers below: the instruction lists %0 .. %(n - 1), bound to d[0] ..
// d[n - 1] read and written ("+f"); the A / B operands and the scale-d flag follow as %n, %n + 1, ...
#define JAX_W4A8_WGMMA_ACC8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define JAX_W4A8_WGMMA_ACC16 JAX_W4A8_WGMMA_ACC8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define JAX_W4A8_WGMMA_ACC32 JAX_W4A8_WGMMA_ACC16 ", %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define JAX_W4A8_WGMMA_ACC64 JAX_W4A8_WGMMA_ACC32 ", %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define JAX_W4A8_WGMMA_OUT8(d, i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define JAX_W4A8_WGMMA_OUT16(d, i) JAX_W4A8_WGMMA_OUT8(d, i), JAX_W4A8_WGMMA_OUT8(d, i + 8)
#define JAX_W4A8_WGMMA_OUT32(d, i) JAX_W4A8_WGMMA_OUT16(d, i), JAX_W4A8_WGMMA_OUT16(d, i + 16)
#define JAX_W4A8_WGMMA_OUT64(d, i) JAX_W4A8_WGMMA_OUT32(d, i), JAX_W4A8_WGMMA_OUT32(d, i + 32)

// One wrapper per token-tile width N (accumulator: N / 2 floats per thread). Fragment
// layout of d[i]: row 16 * warp + lane / 4 + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2 * (lane % 4) + i % 2.
// D[64 x 16] (+)= A[64 x 32] * B[16 x 32]^T, e4m3 x e4m3 -> f32; A, B K-major in shared memory.
__device__ __forceinline__ void WgmmaE4m3N16(float (&d)[8], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC8 "}, %8, %9, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT8(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 32] (+)= A[64 x 32] * B[32 x 32]^T, e4m3 x e4m3 -> f32; A, B K-major in shared memory.
__device__ __forceinline__ void WgmmaE4m3N32(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC16 "}, %16, %17, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT16(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 64] (+)= A[64 x 32] * B[64 x 32]^T, e4m3 x e4m3 -> f32; A, B K-major in shared memory.
__device__ __forceinline__ void WgmmaE4m3N64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC32 "}, %32, %33, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT32(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T, e4m3 x e4m3 -> f32; A, B K-major in shared memory.
__device__ __forceinline__ void WgmmaE4m3N128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC64 "}, %64, %65, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT64(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// A from registers (the int4 path converts weights straight into these): per thread four b32 of four
// e4m3 each, rows r = 16 * warp + lane / 4 and r + 8, K columns 4 * (lane % 4) + [0, 4) and + 16:
// a[0] = (r, k), a[1] = (r + 8, k), a[2] = (r, k + 16), a[3] = (r + 8, k + 16), byte i = column + i.

// D[64 x 16] (+)= A[64 x 32] * B[16 x 32]^T with A in registers (a: this thread's fragment, see above).
__device__ __forceinline__ void WgmmaE4m3RsN16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC8
      "}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT8(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 32] (+)= A[64 x 32] * B[32 x 32]^T with A in registers (a: this thread's fragment, see above).
__device__ __forceinline__ void WgmmaE4m3RsN32(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC16
      "}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT16(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 64] (+)= A[64 x 32] * B[64 x 32]^T with A in registers (a: this thread's fragment, see above).
__device__ __forceinline__ void WgmmaE4m3RsN64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT32(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T with A in registers (a: this thread's fragment, see above).
__device__ __forceinline__ void WgmmaE4m3RsN128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" JAX_W4A8_WGMMA_ACC64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : JAX_W4A8_WGMMA_OUT64(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// f16 x f16 -> f32 with A in registers: per thread four f16x2, rows r = 16 * warp + lane / 4 and r + 8,
// K columns 2 * (lane % 4) + {0, 1} and + 8: a[0] = (r, k), a[1] = (r + 8, k), a[2] = (r, k + 8),
// a[3] = (r + 8, k + 8); B K-major in shared memory (descriptor).

// D[64 x 16] (+)= A[64 x 16] * B[16 x 16]^T.
__device__ __forceinline__ void WgmmaF16RsN16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {" JAX_W4A8_WGMMA_ACC8
      "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : JAX_W4A8_WGMMA_OUT8(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 32] (+)= A[64 x 16] * B[32 x 16]^T.
__device__ __forceinline__ void WgmmaF16RsN32(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {" JAX_W4A8_WGMMA_ACC16
      "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : JAX_W4A8_WGMMA_OUT16(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 64] (+)= A[64 x 16] * B[64 x 16]^T.
__device__ __forceinline__ void WgmmaF16RsN64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" JAX_W4A8_WGMMA_ACC32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : JAX_W4A8_WGMMA_OUT32(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T.
__device__ __forceinline__ void WgmmaF16RsN128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" JAX_W4A8_WGMMA_ACC64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : JAX_W4A8_WGMMA_OUT64(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}
#undef JAX_W4A8_WGMMA_ACC8
#undef JAX_W4A8_WGMMA_ACC16
#undef JAX_W4A8_WGMMA_ACC32
#undef JAX_W4A8_WGMMA_ACC64
#undef JAX_W4A8_WGMMA_OUT8
#undef JAX_W4A8_WGMMA_OUT16
#undef JAX_W4A8_WGMMA_OUT32
#undef JAX_W4A8_WGMMA_OUT64
}  // namespace sm90
}  // namespace jax_w4a8
