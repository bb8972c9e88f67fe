// Exact int4 -> f16 and e4m3 -> f16 conversions for the f16 tensor-core paths (mma.sync m16n8k16 and the f16
// wgmma): the int4 kernels of hopper_gemm.cu and the grouped decode kernel (w4a8_decode_gemm.cu); and e4m3
// codes scaled by powers of two through f16 (the folded activations of hopper_gemm.cu and
// quantize_fp8_groups.cu).
#pragma once

#include <cstdint>

namespace jax_w4a8 {

// Eight int4 codes (one 32-bit word, code j in nibble j) -> four f16x2, exactly, with 5 integer and 4
// f16 instructions (the integer pipe is what limits decode): f[0] = (code 0, code 4), f[1] = (1, 5),
// f[2] = (2, 6), f[3] = (3, 7). A masked nibble n, xor 8 (v + 8, in [0, 16)), or'ed into the mantissa
// of 1024.0 gives 1024 + (v + 8) (or 1024 + 16 (v + 8) one nibble up); one f16 op maps it to v.
__device__ __forceinline__ void Int4x8ToF16(uint32_t w, uint32_t (&f)[4]) {
  const uint32_t w2 = w >> 8;
  uint32_t lo0, hi0, lo1, hi1;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(lo0) : "r"(w), "r"(0x000F000Fu), "r"(0x64086408u));
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(hi0) : "r"(w), "r"(0x00F000F0u), "r"(0x64806480u));
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(lo1) : "r"(w2), "r"(0x000F000Fu), "r"(0x64086408u));
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(hi1) : "r"(w2), "r"(0x00F000F0u), "r"(0x64806480u));
  // 1032 = 0x6408, 1 / 16 = 0x2C00, -72 = 0xD480 (all exact; results are small integers).
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(f[0]) : "r"(lo0), "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(f[1]) : "r"(hi0), "r"(0x2C002C00u), "r"(0xD480D480u));
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(f[2]) : "r"(lo1), "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(f[3]) : "r"(hi1), "r"(0x2C002C00u), "r"(0xD480D480u));
}

// The A fragments of K16 steps 2 t and 2 t + 1 from word t of rows r (wa) and r + 8 (wb): a[0] = (r, k),
// a[1] = (r + 8, k), a[2] = (r, k + 8), a[3] = (r + 8, k + 8) in the K order of hopper_gemm.cu's ConvertXToF16.
__device__ __forceinline__ void Int4WordsToF16Fragments(uint32_t wa, uint32_t wb, uint32_t (&s0)[4], uint32_t (&s1)[4]) {
  uint32_t fa[4], fb[4];
  Int4x8ToF16(wa, fa);
  Int4x8ToF16(wb, fb);
  s0[0] = fa[0], s0[1] = fb[0], s0[2] = fa[1], s0[3] = fb[1];
  s1[0] = fa[2], s1[1] = fb[2], s1[2] = fa[3], s1[3] = fb[3];
}

// Two e4m3 codes (bits 0..15) -> f16x2, exactly (low byte -> low half).
__device__ __forceinline__ uint32_t E4m3x2ToF16x2(uint32_t v) {
  uint32_t out;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(out) : "r"(v));
  return out;
}

// Two f16 -> two e4m3 codes (low half -> low byte), rounded to nearest even, saturating (NaN stays NaN).
__device__ __forceinline__ uint32_t F16x2ToE4m3x2(uint32_t v) {
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(out) : "r"(v));
  return out;
}

// Four e4m3 codes times r (f16x2 of a power of two or 0; the product is exact in f16 down to 2^-21, below
// which e4m3 rounds it to 0 either way), back to e4m3.
__device__ __forceinline__ uint32_t ScaleE4m3x4(uint32_t w, uint32_t r2) {
  uint32_t lo = E4m3x2ToF16x2(w & 0xFFFFu), hi = E4m3x2ToF16x2(w >> 16);
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(r2));
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(r2));
  return F16x2ToE4m3x2(lo) | (F16x2ToE4m3x2(hi) << 16);
}

}  // namespace jax_w4a8
