// Number formats shared by the CPU and CUDA handlers (SPEC section 2). Host and device inline.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__CUDACC__)
#define W4A8_HD __host__ __device__ __forceinline__
#else
#define W4A8_HD inline
#endif

namespace jax_w4a8 {

W4A8_HD float BitsToFloat(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
#endif
}

W4A8_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
#endif
}

// float8_e4m3fn -> float, exact. 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F/0xFF are NaN.
W4A8_HD float E4m3ToFloat(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t exp = (v >> 3) & 0xF;
  const uint32_t man = v & 0x7;
  if (exp == 0xF && man == 0x7) return BitsToFloat(0x7FC00000u | sign);
  if (exp == 0) {  // subnormal: man * 2^-9
    const float mag = static_cast<float>(man) * (1.0f / 512.0f);
    return sign ? -mag : mag;
  }
  return BitsToFloat(sign | ((exp + 120u) << 23) | (man << 20));
}

// float -> float8_e4m3fn bits, round to nearest even, saturating to +-448; NaN -> 0x7F. Host side
// (the CUDA kernels use the hardware conversion, which has the same semantics).
inline uint8_t FloatToE4m3Sat(float v) {
  const uint32_t bits = FloatToBits(v);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  float a = BitsToFloat(bits & 0x7FFFFFFFu);
  if (a != a) return 0x7F;
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0.015625f) {  // subnormal range: steps of 2^-9, rounding may reach the smallest normal
    const float q = std::nearbyint(a * 512.0f);
    return sign | static_cast<uint8_t>(q);
  }
  int e = 0;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  float q = std::nearbyint((m * 2.0f - 1.0f) * 8.0f);
  int exp = e - 1;
  if (q >= 8.0f) { q = 0.0f; ++exp; }
  const int code = ((exp + 7) << 3) | static_cast<int>(q);
  return sign | static_cast<uint8_t>(code > 0x7E ? 0x7E : code);
}

// UE8M0 code -> float: 2^(code - 127); 0xFF is NaN; code 0 is the fp32 subnormal 2^-127.
W4A8_HD float Ue8m0ToFloat(uint8_t code) {
  if (code == 0xFF) return BitsToFloat(0x7FC00000u);
  if (code == 0) return BitsToFloat(0x00400000u);
  return BitsToFloat(static_cast<uint32_t>(code) << 23);
}

// True when a float32 is exactly a UE8M0 value: positive power of two with a normal exponent 1..254.
W4A8_HD bool IsUe8m0Exact(uint32_t bits) {
  const uint32_t exp = (bits >> 23) & 0xFF;
  return (bits & 0x807FFFFFu) == 0 && exp >= 1 && exp <= 254;
}

// A positive scale rounded up to a UE8M0 value (a power of two, exponent clamped to 1..254): what the
// UE8M0 quantizers divide by (rounded *before* quantizing, so codes and scale agree).
W4A8_HD float CeilToUe8m0(float x) {
  const uint32_t b = FloatToBits(x);
  uint32_t e = ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0);
#if defined(__CUDA_ARCH__)
  e = min(max(e, 1u), 254u);
#else
  e = std::min<uint32_t>(std::max<uint32_t>(e, 1), 254);
#endif
  return BitsToFloat(e << 23);
}

// The UE8M0 scale of a group whose largest magnitude is amax (amax >= 2^-117, or +inf; the kernels floor it at
// 1e-4) for e4m3 codes: CeilToUe8m0(amax / 448) with the quotient rounded as IEEE division rounds it, exactly,
// from amax's bits alone (an IEEE division is a branchy instruction sequence on the GPU). The smallest 2^k with
// 448 2^k >= amax: 448 = 1.75 * 2^8, so for amax = 1.m * 2^E that is 2^(E - 8) where 1.m <= 1.75, else 2^(E - 7).
// The rounded quotient agrees: where amax exceeds 448 2^k, it does by at least one ulp of amax, 2^-23 / 1.75 of
// it, more than the half ulp (2^-24) that would round amax / 448 down onto 2^k. +inf gives 2^127, as
// CeilToUe8m0(inf) does. Checked against the division for every float from 1e-4 up (tests/test_ffi_formats.py).
W4A8_HD float Ue8m0ScaleForE4m3(float amax) {
  const uint32_t b = FloatToBits(amax);
  const uint32_t exp = b >> 23;
  const uint32_t e = exp == 255 ? 254 : exp - 8 + ((b & 0x7FFFFF) > 0x600000);
  return BitsToFloat(e << 23);
}

// 1 / s for a UE8M0 value s = 2^(e - 127), e in 1..254, exactly (2^-127 is subnormal: one mantissa bit).
W4A8_HD float Ue8m0Reciprocal(float s) {
  const uint32_t e = FloatToBits(s) >> 23;
  return BitsToFloat(e < 254 ? (254 - e) << 23 : 1u << 22);
}

// The masked exponent byte of a float32 that IsUe8m0Exact accepted.
W4A8_HD uint8_t Ue8m0Code(uint32_t bits) { return static_cast<uint8_t>((bits >> 23) & 0xFF); }

// float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN, overflow goes to Inf as
// in every bf16 conversion (bf16 has float32's range, so a finite float32 sum never overflows).
W4A8_HD uint16_t FloatToBf16Bits(float f) {
  const uint32_t b = FloatToBits(f);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu)) return static_cast<uint16_t>((b >> 16) | 0x40);
  const uint32_t rounded = b + 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

W4A8_HD float Bf16BitsToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Signed int4 code at position `k` of a packed row: element 2i in the low nibble of byte i.
W4A8_HD int Int4At(const int8_t* row, int64_t k) {
  const int byte = static_cast<uint8_t>(row[k >> 1]);
  const int nib = (k & 1) ? (byte >> 4) : (byte & 0xF);
  return (nib ^ 8) - 8;
}

}  // namespace jax_w4a8
