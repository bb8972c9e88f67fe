// Exact int4 -> e4m3 conversions (every int4 code -8..7 is an e4m3 value) for the fp8 tensor-core paths: the int4
// kernels of hopper_gemm.cu (e4m3 wgmma A fragments, in registers) and the CUTLASS prefill path's one-pass
// conversion (w4a8_grouped_cutlass.cu).
//
// Byte-permute lookups: prmt picks each output byte from the 8 bytes of its two sources by the low 3 bits of a
// 4-bit selector (bit 3 set would replicate the picked byte's sign instead, so selectors keep it clear). One
// lookup by the low three bits of each code (idx: nibble i = code i & 7) in the table of codes 0..7 (pos), one in
// the table of codes -8..-1 (neg), then a third permute, PickE4m3, that takes byte i from neg where code i is
// negative (selector nibble i = i + 4 * sign_i). prmt reads only the low 16 bits of its selector.
//
// The pick selector is (sign >> 1) + 0x3210 with sign = codes & 0x8888...: the shifted sign bits and 0x3210 share
// no bit, so the sum is their or, and ptxas makes the shift and add one LEA.HI; a selector for codes 4..7 of a word
// is (sign >> 17) + 0x3210, another LEA.HI. (The former ((codes >> 1) & 0x4444...) | 0x3210... took a shift and
// two LOP3s, its immediates not fitting one LOP3, and a shift more for codes 4..7: nvcc 13.0, 235 -> 227
// instructions per K group in the folding 128-token kernel, 1 per 4 codes fewer in the other e4m3 int4 kernels,
// same registers.)
#pragma once

#include <cstdint>

namespace jax_w4a8 {

__device__ __forceinline__ void Int4E4m3Lookups(uint32_t idx, uint32_t& pos, uint32_t& neg) {
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(pos) : "r"(0x44403800u), "r"(0x4E4C4A48u), "r"(idx));  //  0 1 2 3 | 4 5 6 7
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(neg) : "r"(0xCACCCED0u), "r"(0xB8C0C4C8u), "r"(idx));  // -8 -7 -6 -5 | -4 .. -1
}

__device__ __forceinline__ uint32_t PickE4m3(uint32_t pos, uint32_t neg, uint32_t sel) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(pos), "r"(neg), "r"(sel));
  return out;
}

// Four int4 codes (bits 0..15; the bits above are ignored) -> four e4m3 bytes.
__device__ __forceinline__ uint32_t Int4x4ToE4m3(uint32_t nibbles) {
  uint32_t pos, neg;
  Int4E4m3Lookups(nibbles & 0x7777u, pos, neg);
  return PickE4m3(pos, neg, ((nibbles & 0x8888u) >> 1) + 0x3210u);
}

// Eight int4 codes (one 32-bit word, code j in nibble j) -> e4m3 codes 0..3 in lo and 4..7 in hi (the index and
// sign words computed once for the word: 11 instructions, 6 of them prmt).
__device__ __forceinline__ void Int4x8ToE4m3(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t idx = w & 0x77777777u, sign = w & 0x88888888u;
  uint32_t pos_lo, neg_lo, pos_hi, neg_hi;
  Int4E4m3Lookups(idx, pos_lo, neg_lo);
  Int4E4m3Lookups(idx >> 16, pos_hi, neg_hi);
  lo = PickE4m3(pos_lo, neg_lo, (sign >> 1) + 0x3210u);
  hi = PickE4m3(pos_hi, neg_hi, (sign >> 17) + 0x3210u);
}

}  // namespace jax_w4a8
