// CPU handler of ops.quantize_fp8_groups: per-token, per-128-channel fp8 quantization (SPEC 3); with silu_mul
// (ops.silu_mul_quantize_fp8_groups) of silu(gate) * up in float32, x being [R, 2K] gate then up.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "../common/checks.h"
#include "../common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

ffi::Error QuantizeFp8GroupsCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> s,
                                bool ue8m0, bool silu_mul) {
  int64_t rows = 0, k = 0;  // k: the output's channels
  if (auto err = CheckQuantizeGroups(x, *q, *s, silu_mul, &rows, &k); err.failure()) return err;
  const bool bf16 = x.element_type() == ffi::BF16;
  auto* codes = static_cast<uint8_t*>(q->untyped_data());
  auto* scales = static_cast<float*>(s->untyped_data());
  auto input = [&](int64_t i) {
    return bf16 ? Bf16BitsToFloat(static_cast<const uint16_t*>(x.untyped_data())[i])
                : static_cast<const float*>(x.untyped_data())[i];
  };
  auto value = [&](int64_t i) {  // output element i (row i / k, channel i % k)
    if (!silu_mul) return input(i);
    const int64_t at = i + (i / k) * k;  // the gate in the row of 2k inputs; the up k further
    const float g = input(at);
    return g / (1.0f + std::exp(-g)) * input(at + k);
  };
  for (int64_t g = 0; g < rows * (k / kGroup); ++g) {
    const int64_t base = g * kGroup;
    float amax = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(value(base + j)));
    // rounded up to a power of two first, then quantize with it; float32 scales cap the amax at FLT_MAX (an
    // Inf, or a silu * up product past float32's range, saturates to +-448 instead of Inf / Inf = NaN)
    const float scale = ue8m0 ? CeilToUe8m0(std::max(amax, 1e-4f) / 448.0f)
                              : std::min(std::max(amax, 1e-4f), FLT_MAX) / 448.0f;
    scales[g] = scale;
    for (int64_t j = 0; j < kGroup; ++j) codes[base + j] = FloatToE4m3Sat(value(base + j) / scale);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8QuantizeFp8GroupsCpu, jax_w4a8::QuantizeFp8GroupsCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Ret<xla::ffi::AnyBuffer>()   // codes
                                  .Ret<xla::ffi::AnyBuffer>()   // scales
                                  .Attr<bool>("ue8m0")
                                  .Attr<bool>("silu_mul"));
