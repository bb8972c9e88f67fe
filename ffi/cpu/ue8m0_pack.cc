// CPU handler of ops.pack_ue8m0: float32 powers of two -> masked exponent bytes, or an error.
#include <cstdint>
#include <string_view>

#include "../common/checks.h"
#include "../common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {
namespace {

ffi::Error Ue8m0PackCpu(ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> codes,
                         std::string_view arg) {
  if (auto err = CheckUe8m0Pack(scale, *codes); err.failure()) return err;
  const auto* s = static_cast<const uint32_t*>(scale.untyped_data());
  auto* c = static_cast<uint8_t*>(codes->untyped_data());
  int64_t bad = 0;
  for (size_t i = 0; i < scale.element_count(); ++i) {
    bad += !IsUe8m0Exact(s[i]);
    c[i] = Ue8m0Code(s[i]);
  }
  if (bad) return ffi::Error::InvalidArgument(Ue8m0RejectMessage(arg, bad));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_w4a8

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a8Ue8m0PackCpu, jax_w4a8::Ue8m0PackCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // scale
                                  .Ret<xla::ffi::AnyBuffer>()   // codes
                                  .Attr<std::string_view>("arg"));  // argument name for errors
