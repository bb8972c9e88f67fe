// CUDA handler of ops.quantize_fp8_groups: bf16/f32 [R, K] -> e4m3 [R, K] + f32 scales [R, K/128] in
// one pass. 16 threads per 128-wide group, two groups' 16-byte loads in flight per thread, a 4-step
// shuffle max, hardware saturating round-to-nearest-even conversion (two codes per instruction).
// With ue8m0 the scale is rounded up to a power of two *before* the values are divided by it.
// silu_mul (ops.silu_mul_quantize_fp8_groups): x is [R, 2K], gate then up; each group quantizes
// silu(gate) * up in float32 (SPEC's MoE activation), so the [R, K] product is never written.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "../common/checks.h"
#include "../common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

constexpr int kUnroll = 2;       // groups per 16-thread team and iteration: both loads in flight first
constexpr int kBlocksPerSm = 6;  // resident at <= 40 registers: the grid is exactly one wave
// float32 gate and up (silu_mul) hold twice the loads: 4 blocks per SM, so that nothing spills.
template <bool kBf16, bool kSiluMul>
constexpr int BlocksPerSm() { return kSiluMul && !kBf16 ? 4 : kBlocksPerSm; }

// Eight consecutive inputs of one group, as loaded (kept raw until used: fewer registers in flight).
template <bool kBf16>
struct Raw {
  uint4 a;
};
template <>
struct Raw<false> {
  float4 a, b;
};

template <bool kBf16>
__device__ __forceinline__ Raw<kBf16> LoadRaw(const void* x, int64_t base) {
  Raw<kBf16> r;
  if constexpr (kBf16) {
    r.a = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + base));
  } else {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + base);
    r.a = __ldcs(p);
    r.b = __ldcs(p + 1);
  }
  return r;
}

template <bool kBf16>
__device__ __forceinline__ void Unpack(const Raw<kBf16>& r, float (&v)[8]) {
  if constexpr (kBf16) {
    const uint32_t w[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
    v[0] = r.a.x, v[1] = r.a.y, v[2] = r.a.z, v[3] = r.a.w, v[4] = r.b.x, v[5] = r.b.y, v[6] = r.b.z, v[7] = r.b.w;
  }
}

// Eight values of one group -> eight e4m3 codes (x / scale, saturating, round-to-nearest-even), two
// per conversion instruction. A UE8M0 scale is a power of two, so x * (1 / scale) is x / scale
// exactly (the reciprocal is exact, subnormal 2^-127 included) and saves the divisions.
__device__ __forceinline__ uint2 EncodeEight(const float (&v)[8], float scale, bool ue8m0) {
  float q[8];
  if (ue8m0) {
    const float inv = __frcp_rn(scale);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = v[i] * inv;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = __fdiv_rn(v[i], scale);
  }
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * h], q[4 * h + 1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * h + 2], q[4 * h + 3]), __NV_SATFINITE, __NV_E4M3);
    word[h] = lo | (hi << 16);
  }
  return make_uint2(word[0], word[1]);
}

// silu(g) * u in float32 (IEEE division, expf: for g << 0 exp(-g) is Inf and silu(g) is -0).
__device__ __forceinline__ float SiluMul(float g, float u) { return __fdiv_rn(g, 1.0f + expf(-g)) * u; }

template <bool kBf16, bool kSiluMul>
__global__ void __launch_bounds__(256, (BlocksPerSm<kBf16, kSiluMul>()))
    QuantizeGroupsKernel(const void* x, uint8_t* codes, float* scales, int64_t groups, int64_t row_groups, bool ue8m0) {
  const int sub = threadIdx.x % 16;  // 16 threads x 8 values = one group
  // The team's own lanes: a warp's two teams may leave the loop an iteration apart (their groups differ by one).
  const unsigned team_mask = 0xFFFFu << (threadIdx.x & 16);
  const int64_t teams = static_cast<int64_t>(gridDim.x) * (blockDim.x / 16);
  const int64_t team = blockIdx.x * static_cast<int64_t>(blockDim.x / 16) + threadIdx.x / 16;
  // Team t takes groups t + j * teams for j < kUnroll, then moves on by kUnroll * teams.
  for (int64_t g0 = team; g0 < groups; g0 += kUnroll * teams) {
    // Output group g of row g / row_groups; with silu_mul its gate at 2 (g - c) + c (c = g % row_groups, in
    // groups of 128 inputs), its up row_groups groups further.
    Raw<kBf16> raw[kUnroll], up[kSiluMul ? kUnroll : 1];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = g0 + u * teams;
      const int64_t in = kSiluMul ? 2 * g - g % row_groups : g;
      if (g < groups) raw[u] = LoadRaw<kBf16>(x, in * 128 + sub * 8);
      else raw[u] = Raw<kBf16>{};
      if constexpr (kSiluMul)
        up[u] = g < groups ? LoadRaw<kBf16>(x, (in + row_groups) * 128 + sub * 8) : Raw<kBf16>{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = g0 + u * teams;
      float v[8];
      Unpack<kBf16>(raw[u], v);
      if constexpr (kSiluMul) {
        float w[8];
        Unpack<kBf16>(up[u], w);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = SiluMul(v[i], w[i]);
      }
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(team_mask, amax, off));
      // An Inf (or a silu * up product past float32's range) caps the amax at FLT_MAX: its code saturates to
      // +-448 instead of Inf / Inf = NaN (UE8M0: CeilToUe8m0 of Inf is 2**127, the same saturation).
      float scale = ue8m0 ? CeilToUe8m0(__fdiv_rn(fmaxf(amax, 1e-4f), 448.0f))
                          : __fdiv_rn(fminf(fmaxf(amax, 1e-4f), FLT_MAX), 448.0f);
      if (g < groups) {
        __stcs(reinterpret_cast<uint2*>(codes + g * 128 + sub * 8), EncodeEight(v, scale, ue8m0));
        if (sub == 0) scales[g] = scale;
      }
    }
  }
}

template <bool kSiluMul>
void LaunchQuantizeGroups(cudaStream_t stream, int blocks, bool bf16, const void* x, uint8_t* codes, float* scales,
                          int64_t groups, int64_t row_groups, bool ue8m0) {
  if (bf16) {
    QuantizeGroupsKernel<true, kSiluMul><<<blocks, 256, 0, stream>>>(x, codes, scales, groups, row_groups, ue8m0);
  } else {
    QuantizeGroupsKernel<false, kSiluMul><<<blocks, 256, 0, stream>>>(x, codes, scales, groups, row_groups, ue8m0);
  }
}

ffi::Error QuantizeFp8GroupsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                 ffi::Result<ffi::AnyBuffer> s, bool ue8m0, bool silu_mul) {
  int64_t rows = 0, k = 0;  // k: the output's (quantized) channels
  if (auto err = CheckQuantizeGroups(x, *q, *s, silu_mul, &rows, &k); err.failure()) return err;
  const int64_t groups = rows * (k / kGroup);
  if (groups == 0) return ffi::Error::Success();
  int sms = 132, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const bool bf16 = x.element_type() == ffi::BF16;
  const int per_sm = silu_mul ? (bf16 ? BlocksPerSm<true, true>() : BlocksPerSm<false, true>()) : kBlocksPerSm;
  const int blocks = static_cast<int>(
      std::min<int64_t>((groups + 16 * kUnroll - 1) / (16 * kUnroll), static_cast<int64_t>(sms) * per_sm));
  auto* codes = static_cast<uint8_t*>(q->untyped_data());
  auto* scales = static_cast<float*>(s->untyped_data());
  const void* in = x.untyped_data();
  if (silu_mul) LaunchQuantizeGroups<true>(stream, blocks, bf16, in, codes, scales, groups, k / kGroup, ue8m0);
  else LaunchQuantizeGroups<false>(stream, blocks, bf16, in, codes, scales, groups, k / kGroup, ue8m0);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    return ffi::Error::Internal(std::string(silu_mul ? "silu_mul_quantize_fp8_groups" : "quantize_fp8_groups") +
                                ": launch failed: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8QuantizeFp8GroupsCuda, jax_w4a8::QuantizeFp8GroupsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Ret<xla::ffi::AnyBuffer>()   // codes
                                  .Ret<xla::ffi::AnyBuffer>()   // scales
                                  .Attr<bool>("ue8m0")
                                  .Attr<bool>("silu_mul"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
