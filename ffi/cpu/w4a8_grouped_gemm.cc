// CPU handler of ops.w4a8_grouped_gemm (SPEC 4.1): plain loops, float32 math, one output rounding.
#include <cstdint>
#include <vector>

#include "../common/checks.h"
#include "../common/formats.h"
#include "../common/groups.h"
#include "ieee_denormals.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

ffi::Error W4a8GroupedGemmCpu(ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer w,
                              ffi::AnyBuffer w_scale, ffi::AnyBuffer group_sizes,
                              ffi::Result<ffi::AnyBuffer> out) {
  GroupedGemmDims d;
  if (auto err = CheckGroupedGemm(x, x_scale, w, w_scale, group_sizes, *out, &d); err.failure())
    return err;
  const IeeeDenormalsScope ieee;  // subnormal float32 scales count, as on the GPU (ieee_denormals.h)
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  const auto* sa = static_cast<const float*>(x_scale.untyped_data());
  const auto* wp = static_cast<const int8_t*>(w.untyped_data());
  const auto* gs = static_cast<const int32_t*>(group_sizes.untyped_data());
  const int64_t m = d.m, k = d.k, n = d.n, groups = d.groups;

  // No temporaries of the operands' size (an allocation failure here would escape the handler and end the
  // process): activations decoded through a 256-entry table, results written straight to the output.
  float e4m3[256];
  for (int c = 0; c < 256; ++c) e4m3[c] = E4m3ToFloat(static_cast<uint8_t>(c));
  auto store = [&](int64_t idx, float v) {
    if (d.out_bf16) static_cast<uint16_t*>(out->untyped_data())[idx] = FloatToBf16Bits(v);
    else static_cast<float*>(out->untyped_data())[idx] = v;
  };
  for (int64_t i = 0; i < m * n; ++i) store(i, 0.0f);  // rows past the last expert's end stay 0
  auto act_scale = [&](int64_t row, int64_t g) {
    switch (d.x_scale_kind) {
      case XScaleKind::kTensor: return sa[0];
      case XScaleKind::kToken: return sa[row];
      default: return sa[row * groups + g];
    }
  };
  auto weight_scale = [&](int64_t idx) {
    return d.w_scale_bf16 ? Bf16BitsToFloat(static_cast<const uint16_t*>(w_scale.untyped_data())[idx])
                          : static_cast<const float*>(w_scale.untyped_data())[idx];
  };

  std::vector<float> qrow(static_cast<size_t>(k));
  int64_t begin = 0;
  for (int64_t e = 0; e < d.e; ++e) {
    const int64_t end = NextGroupEnd(begin, gs[e], m);
    for (int64_t col = 0; col < n && begin < end; ++col) {
      const int8_t* row = wp + (e * n + col) * (k / 2);
      for (int64_t kk = 0; kk < k; ++kk) qrow[kk] = static_cast<float>(Int4At(row, kk));
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* xr = xp + r * k;
        float total = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          float part = 0.0f;  // a fresh accumulator per 128-K group, scales applied after it
          for (int64_t kk = g * kGroup; kk < (g + 1) * kGroup; ++kk) part += e4m3[xr[kk]] * qrow[kk];
          total += act_scale(r, g) * weight_scale((e * n + col) * groups + g) * part;
        }
        store(r * n + col, total);
      }
    }
    begin = end;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8GroupedGemmCpu, jax_w4a8::W4a8GroupedGemmCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // x_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // w
                                  .Arg<xla::ffi::AnyBuffer>()   // w_scale
                                  .Arg<xla::ffi::AnyBuffer>()   // group_sizes
                                  .Ret<xla::ffi::AnyBuffer>());  // out
