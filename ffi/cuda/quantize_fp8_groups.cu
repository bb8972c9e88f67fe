// CUDA handler of ops.quantize_fp8_groups: bf16/f32 [R, K] -> e4m3 [R, K] + f32 scales [R, K/128] in
// one pass. 16 threads per 128-wide group, two groups' 16-byte loads in flight per thread, a 4-step
// shuffle max, hardware saturating round-to-nearest-even conversion (two codes per instruction).
// With ue8m0 the scale is rounded up to a power of two *before* the values are divided by it.
// silu_mul (ops.silu_mul_quantize_fp8_groups): x is [R, 2K], gate then up; each group quantizes
// silu(gate) * up in float32 (SPEC's MoE activation), so the [R, K] product is never written.
// folded (layout="folded", UE8M0 only): the same codes with each token's group scales folded in, written in the
// folded K order, and one float32 multiplier per token instead of the group scales (QuantizeFoldedKernel; the
// format: jax_w4a8.quant.fold_fp8_groups), which the grouped GEMM's 128-token kernel reads as it is.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "../common/checks.h"
#include "../common/formats.h"
#include "int4_f16.cuh"
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

// A thread's eight values of its group (with silu_mul, silu(gate) * up) and the group's largest |value| over the
// thread's 16-thread team (NaN left out, as fmaxf does).
template <bool kBf16, bool kSiluMul>
__device__ __forceinline__ float GroupValues(const Raw<kBf16>& raw, const Raw<kBf16>& up, float (&v)[8],
                                             unsigned team_mask) {
  Unpack<kBf16>(raw, v);
  if constexpr (kSiluMul) {
    float w[8];
    Unpack<kBf16>(up, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = SiluMul(v[i], w[i]);
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(team_mask, amax, off));
  return amax;
}

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
      const float amax = GroupValues<kBf16, kSiluMul>(raw[u], up[kSiluMul ? u : 0], v, team_mask);
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

// ---- The folded layout (layout="folded") ----------------------------------------------------------------
// A block per token row (grid-stride over rows), 16 teams of 16 threads; team q quantizes groups q + 16 i
// (i < kHeld, so rows of up to 16 kHeld groups) as QuantizeGroupsKernel does, with UE8M0 scales, and keeps the
// codes. The row's largest scale exponent e_max and rel = max_g (largest |code| of g) 2^(e_g - e_max) give the
// lift j (jax_w4a8.quant.fold_fp8_groups: the largest folded code in [112, 448], j in [0, 15]); each group's
// codes are then multiplied by 2^(e_g - e_max + j) through f16 (ScaleE4m3x4: one rounding to e4m3, as
// hopper_gemm.cu's FoldChunk) and stored in the folded K order, and the row's multiplier is 2^(e_max - j).
constexpr int kFoldTeams = 16;
constexpr int kFoldMaxHeld = 8;  // rows of up to 128 groups (K <= 16384); longer rows: ops quantizes, then folds

// f16x2 of 2^d (d <= 15) in both halves: f16 subnormals down to 2^-24, 0 below (a code times it rounds to e4m3
// zero there either way).
__device__ __forceinline__ uint32_t Pow2F16x2(int d) {
  const uint32_t h = d >= -14 ? static_cast<uint32_t>(d + 15) << 10 : d >= -24 ? 1u << (d + 24) : 0u;
  return h * 0x10001u;
}

// float 2^d for d <= 127; 0 below 2^-126 (jax_w4a8.quant._pow2).
__device__ __forceinline__ float Pow2F32(int d) { return d >= -126 ? __uint_as_float(static_cast<uint32_t>(d + 127) << 23) : 0.0f; }

template <bool kBf16, bool kSiluMul, int kHeld>
__global__ void __launch_bounds__(256)
    QuantizeFoldedKernel(const void* x, uint8_t* codes, float* token_scale, int64_t rows, int64_t row_groups) {
  __shared__ int group_exp[kFoldTeams * kHeld];
  __shared__ float group_max[kFoldTeams * kHeld];  // the group's largest |code| (NaN codes left out)
  __shared__ int row_fold[2];                      // e_max, j
  const int team = threadIdx.x / 16, sub = threadIdx.x % 16;
  const unsigned team_mask = 0xFFFFu << (threadIdx.x & 16);
  const int64_t in_k = (kSiluMul ? 2 : 1) * row_groups * 128;  // inputs per row
  // A row's inputs are loaded while the block folds the row before it (after that row's codes are formed, ahead
  // of its barriers): a block's rows follow one another, and each row's load latency would otherwise stall it.
  Raw<kBf16> raw[kHeld], up[kSiluMul ? kHeld : 1];
  auto load_row = [&](int64_t row) {
    const int64_t in_row = row * in_k;
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int64_t g = team + kFoldTeams * i;
      const bool in = row < rows && g < row_groups;
      raw[i] = in ? LoadRaw<kBf16>(x, in_row + g * 128 + sub * 8) : Raw<kBf16>{};
      if constexpr (kSiluMul) up[i] = in ? LoadRaw<kBf16>(x, in_row + (row_groups + g) * 128 + sub * 8) : Raw<kBf16>{};
    }
  };
  // Prefetched for rows of up to 32 groups (many rows per block); longer rows load at the row (H100: the 2048
  // tokens' gate+up quantizer took 22.8-23.2 us with the prefetch's registers, 21.3-21.8 without).
  constexpr bool kPrefetch = kHeld <= 2;
  if constexpr (kPrefetch) load_row(blockIdx.x);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    if constexpr (!kPrefetch) load_row(row);
    uint2 q[kHeld];
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int64_t g = team + kFoldTeams * i;
      float v[8];
      const float amax = GroupValues<kBf16, kSiluMul>(raw[i], up[kSiluMul ? i : 0], v, team_mask);
      const float scale = CeilToUe8m0(__fdiv_rn(fmaxf(amax, 1e-4f), 448.0f));  // as QuantizeGroupsKernel
      q[i] = EncodeEight(v, scale, true);
      if (sub == 0 && g < row_groups) {
        // the group's largest |code|: amax / scale rounded as its code is (saturating; NaN inputs left out)
        const uint32_t c = __nv_cvt_float2_to_fp8x2(make_float2(amax * __frcp_rn(scale), 0.0f), __NV_SATFINITE, __NV_E4M3);
        group_max[g] = E4m3ToFloat(static_cast<uint8_t>(c & 0x7Fu));
        group_exp[g] = static_cast<int>((__float_as_uint(scale) >> 23) & 0xFFu) - 127;
      }
    }
    if constexpr (kPrefetch) load_row(row + gridDim.x);  // the block's next row (none past the last: no load)
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0: e_max, then rel = max_g group_max 2^(e_g - e_max), the lift and multiplier
      int e_max = -127;
      for (int64_t g = threadIdx.x; g < row_groups; g += 32) e_max = max(e_max, group_exp[g]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) e_max = max(e_max, __shfl_xor_sync(0xffffffffu, e_max, off));
      float rel = 0.0f;
      for (int64_t g = threadIdx.x; g < row_groups; g += 32) rel = fmaxf(rel, group_max[g] * Pow2F32(group_exp[g] - e_max));
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) rel = fmaxf(rel, __shfl_xor_sync(0xffffffffu, rel, off));
      // floor(log2(448 / rel)) - 1 for rel = m 2^p: 7 - p, 6 - p where m > 1.75 (quant.fold_fp8_groups)
      const uint32_t bits = __float_as_uint(rel);
      const int p = static_cast<int>((bits >> 23) & 0xFFu) - 127;
      const int j = rel > 0.0f ? min(max(7 - p - static_cast<int>((bits & 0x7FFFFFu) > 0x600000u), 0), 15) : 0;
      if (threadIdx.x == 0) {
        row_fold[0] = e_max, row_fold[1] = j;
        token_scale[row] = Pow2F32(e_max - j);
      }
    }
    __syncthreads();
    const int shift = row_fold[1] - row_fold[0];
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int64_t g = team + kFoldTeams * i;
      const int d = g < row_groups ? group_exp[g] + shift : -127;
      const uint32_t r2 = Pow2F16x2(d);
      const uint32_t lo = ScaleE4m3x4(q[i].x, r2), hi = ScaleE4m3x4(q[i].y, r2);  // natural words 2 sub, 2 sub + 1
      // Folded word f = 4 c + i0 holds natural word c + 8 i0: this thread stores folded words 2 sub and 2 sub + 1,
      // natural words w0 = sub / 2 + 16 (sub % 2) and w0 + 8, held by team lanes w0 / 2 and w0 / 2 + 4 in their
      // word (sub / 2) % 2.
      const int w0 = sub / 2 + 16 * (sub % 2), base = threadIdx.x & 16;
      const uint32_t a_lo = __shfl_sync(team_mask, lo, base + w0 / 2), a_hi = __shfl_sync(team_mask, hi, base + w0 / 2);
      const uint32_t b_lo = __shfl_sync(team_mask, lo, base + w0 / 2 + 4), b_hi = __shfl_sync(team_mask, hi, base + w0 / 2 + 4);
      const bool odd = (sub / 2) % 2;
      if (g < row_groups)
        __stcs(reinterpret_cast<uint2*>(codes + (row * row_groups + g) * 128 + sub * 8),
               make_uint2(odd ? a_hi : a_lo, odd ? b_hi : b_lo));
    }
    __syncthreads();  // group_exp / group_max / row_fold are rewritten by the next row
  }
}

template <bool kBf16, bool kSiluMul>
cudaError_t LaunchQuantizeFolded(cudaStream_t stream, const void* x, uint8_t* codes, float* token_scale,
                                 int64_t rows, int64_t row_groups, int sms) {
  const int blocks = static_cast<int>(std::min<int64_t>(rows, static_cast<int64_t>(sms) * 8));
  const int held = static_cast<int>((row_groups + kFoldTeams - 1) / kFoldTeams);
  auto kernel = held <= 1   ? QuantizeFoldedKernel<kBf16, kSiluMul, 1>
                : held <= 2 ? QuantizeFoldedKernel<kBf16, kSiluMul, 2>
                : held <= 4 ? QuantizeFoldedKernel<kBf16, kSiluMul, 4>
                            : QuantizeFoldedKernel<kBf16, kSiluMul, kFoldMaxHeld>;
  kernel<<<blocks, 256, 0, stream>>>(x, codes, token_scale, rows, row_groups);
  return cudaGetLastError();
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
                                 ffi::Result<ffi::AnyBuffer> s, bool ue8m0, bool silu_mul, bool folded) {
  const char* op = silu_mul ? "silu_mul_quantize_fp8_groups" : "quantize_fp8_groups";
  int64_t rows = 0, k = 0;  // k: the output's (quantized) channels
  if (auto err = CheckQuantizeGroups(x, *q, *s, silu_mul, &rows, &k, folded); err.failure()) return err;
  if (folded) {
    if (!ue8m0) return Invalid(op, "the folded layout takes UE8M0 scales (ue8m0=True)");
    if (k / kGroup > kFoldTeams * kFoldMaxHeld)
      return Invalid(op, "the folded layout's kernel takes rows of at most " +
                             std::to_string(kFoldTeams * kFoldMaxHeld * kGroup) + " channels");
  }
  const int64_t groups = rows * (k / kGroup);
  if (groups == 0) return ffi::Error::Success();
  int sms = 132, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const bool bf16 = x.element_type() == ffi::BF16;
  if (folded) {
    auto* codes = static_cast<uint8_t*>(q->untyped_data());
    auto* token = static_cast<float*>(s->untyped_data());
    const void* in = x.untyped_data();
    const int64_t rg = k / kGroup;
    const cudaError_t err =
        bf16 ? (silu_mul ? LaunchQuantizeFolded<true, true>(stream, in, codes, token, rows, rg, sms)
                         : LaunchQuantizeFolded<true, false>(stream, in, codes, token, rows, rg, sms))
             : (silu_mul ? LaunchQuantizeFolded<false, true>(stream, in, codes, token, rows, rg, sms)
                         : LaunchQuantizeFolded<false, false>(stream, in, codes, token, rows, rg, sms));
    if (err != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": launch failed: " + cudaGetErrorString(err));
    return ffi::Error::Success();
  }
  const int per_sm = silu_mul ? (bf16 ? BlocksPerSm<true, true>() : BlocksPerSm<false, true>()) : kBlocksPerSm;
  const int blocks = static_cast<int>(
      std::min<int64_t>((groups + 16 * kUnroll - 1) / (16 * kUnroll), static_cast<int64_t>(sms) * per_sm));
  auto* codes = static_cast<uint8_t*>(q->untyped_data());
  auto* scales = static_cast<float*>(s->untyped_data());
  const void* in = x.untyped_data();
  if (silu_mul) LaunchQuantizeGroups<true>(stream, blocks, bf16, in, codes, scales, groups, k / kGroup, ue8m0);
  else LaunchQuantizeGroups<false>(stream, blocks, bf16, in, codes, scales, groups, k / kGroup, ue8m0);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": launch failed: " + cudaGetErrorString(err));
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
                                  .Attr<bool>("silu_mul")
                                  .Attr<bool>("folded"),  // layout="folded": codes in the folded K order, token scales
                              {xla::ffi::Traits::kCmdBufferCompatible});
