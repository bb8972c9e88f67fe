// CPU handler of ops.fp8_einsum in its canonical batched form (SPEC 4.2): x [M, H, K], w [H, N, K].
#include <cstdint>
#include <vector>

#include "../common/checks.h"
#include "../common/formats.h"
#include "ieee_denormals.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

float ScaleAt(const ffi::AnyBuffer& s, int64_t idx) {
  if (s.element_type() == ffi::F32) return static_cast<const float*>(s.untyped_data())[idx];
  return Ue8m0ToFloat(static_cast<const uint8_t*>(s.untyped_data())[idx]);
}

ffi::Error Fp8EinsumCpu(ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer w,
                        ffi::AnyBuffer w_scale, ffi::Result<ffi::AnyBuffer> out) {
  Fp8EinsumDims d;
  if (auto err = CheckFp8Einsum(x, x_scale, w, w_scale, *out, &d); err.failure()) return err;
  for (const auto* s : {&x_scale, &w_scale}) {  // host memory: a UE8M0 NaN code is cheap to reject here
    if (s->element_type() == ffi::F32) continue;
    const auto* c = static_cast<const uint8_t*>(s->untyped_data());
    for (size_t i = 0; i < s->element_count(); ++i)
      if (c[i] == 0xFF)
        return Invalid("fp8_einsum", std::string(s == &x_scale ? "x_scale" : "w_scale") +
                                         " holds UE8M0 code 0xFF, which is NaN");
  }
  const IeeeDenormalsScope ieee;  // UE8M0 code 0 is the subnormal 2^-127 (ieee_denormals.h)
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const int64_t m = d.m, h = d.h, n = d.n, k = d.k, groups = d.groups;

  // No temporaries of the operands' size (an allocation failure here would escape the handler and end the
  // process): activations decoded through a 256-entry table, results written straight to the output.
  float e4m3[256];
  for (int c = 0; c < 256; ++c) e4m3[c] = E4m3ToFloat(static_cast<uint8_t>(c));
  std::vector<float> wrow(static_cast<size_t>(k));
  auto store = [&](int64_t idx, float v) {
    if (d.out_bf16) static_cast<uint16_t*>(out->untyped_data())[idx] = FloatToBf16Bits(v);
    else static_cast<float*>(out->untyped_data())[idx] = v;
  };
  for (int64_t head = 0; head < h; ++head) {
    for (int64_t col = 0; col < n; ++col) {
      const uint8_t* wr = wp + (head * n + col) * k;
      for (int64_t kk = 0; kk < k; ++kk) wrow[kk] = E4m3ToFloat(wr[kk]);
      const int64_t srow = head * d.w_scale_rows + col / d.w_rows_per_scale;
      for (int64_t row = 0; row < m; ++row) {
        const uint8_t* xr = xp + (row * h + head) * k;
        float total = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          float part = 0.0f;  // fp32 promotion per 128-K block
          for (int64_t kk = g * kGroup; kk < (g + 1) * kGroup; ++kk) part += e4m3[xr[kk]] * wrow[kk];
          total += ScaleAt(x_scale, (row * h + head) * groups + g) * ScaleAt(w_scale, srow * groups + g) * part;
        }
        store((row * h + head) * n + col, total);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8Fp8EinsumCpu, jax_w4a8::Fp8EinsumCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // x_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // w
                                  .Arg<xla::ffi::AnyBuffer>()   // w_scale
                                  .Ret<xla::ffi::AnyBuffer>());  // out
