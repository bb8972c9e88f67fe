// Argument checks and shape math shared by the CPU and CUDA handlers.
//
// The Python wrappers in jax_w4a8/ops.py validate first and raise errors naming the argument; these
// checks repeat them so that a custom call reached another way (a hand-written jaxpr, an exported
// module) fails with ffi::Error::InvalidArgument instead of touching memory out of bounds.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_w4a8 {

namespace ffi = xla::ffi;

inline constexpr int64_t kGroup = 128;  // K-group of every scale in this library

inline ffi::Error Invalid(const std::string& op, const std::string& msg) {
  return ffi::Error::InvalidArgument(op + ": " + msg);
}

inline std::string ShapeStr(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// ---------------------------------------------------------------------------------------------
// w4a8_grouped_gemm
// ---------------------------------------------------------------------------------------------
enum class XScaleKind { kTensor, kToken, kGroup };

struct GroupedGemmDims {
  int64_t m = 0, k = 0, e = 0, n = 0, groups = 0;
  XScaleKind x_scale_kind = XScaleKind::kGroup;
  bool w_scale_bf16 = false;
  bool out_bf16 = false;  // not set by CheckMoeUp (its output is e4m3)
};

// The inputs shared by w4a8_grouped_gemm and w4a8_moe_up.
inline ffi::Error CheckGroupedGemmInputs(const std::string& op, const ffi::AnyBuffer& x,
                                         const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& w,
                                         const ffi::AnyBuffer& w_scale, const ffi::AnyBuffer& group_sizes,
                                         GroupedGemmDims* d) {
  if (x.element_type() != ffi::F8E4M3FN || x.dimensions().size() != 2)
    return Invalid(op, "x must be float8_e4m3fn [M, K], got shape " + ShapeStr(x.dimensions()));
  d->m = x.dimensions()[0];
  d->k = x.dimensions()[1];
  if (d->k <= 0 || d->k % kGroup) return Invalid(op, "x: K must be a positive multiple of 128");
  d->groups = d->k / kGroup;
  if ((w.element_type() != ffi::S8 && w.element_type() != ffi::U8) || w.dimensions().size() != 3)
    return Invalid(op, "w must be int8 packed int4 [E, N, K/2], got shape " + ShapeStr(w.dimensions()));
  d->e = w.dimensions()[0];
  d->n = w.dimensions()[1];
  if (w.dimensions()[2] * 2 != d->k || d->e <= 0 || d->n <= 0)
    return Invalid(op, "w must be [E, N, K/2] with K as x, got " + ShapeStr(w.dimensions()));
  if (w_scale.element_type() != ffi::F32 && w_scale.element_type() != ffi::BF16)
    return Invalid(op, "w_scale must be float32 or bfloat16");
  auto ws = w_scale.dimensions();
  if (ws.size() != 3 || ws[0] != d->e || ws[1] != d->n || ws[2] != d->groups)
    return Invalid(op, "w_scale must be [E, N, K/128], got " + ShapeStr(ws));
  d->w_scale_bf16 = w_scale.element_type() == ffi::BF16;
  if (group_sizes.element_type() != ffi::S32 || group_sizes.dimensions().size() != 1 ||
      group_sizes.dimensions()[0] != d->e)
    return Invalid(op, "group_sizes must be int32 [E]");
  if (x_scale.element_type() != ffi::F32) return Invalid(op, "x_scale must be float32");
  auto xs = x_scale.dimensions();
  if (xs.size() == 1 && xs[0] == 1) {
    d->x_scale_kind = XScaleKind::kTensor;
  } else if (xs.size() == 1 && xs[0] == d->m) {
    d->x_scale_kind = XScaleKind::kToken;
  } else if (xs.size() == 2 && xs[0] == d->m && xs[1] == d->groups) {
    d->x_scale_kind = XScaleKind::kGroup;
  } else {
    return Invalid(op, "x_scale must be [1], [M] or [M, K/128], got " + ShapeStr(xs));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckGroupedGemm(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scale,
                                   const ffi::AnyBuffer& w, const ffi::AnyBuffer& w_scale,
                                   const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& out,
                                   GroupedGemmDims* d) {
  const std::string op = "w4a8_grouped_gemm";
  if (auto err = CheckGroupedGemmInputs(op, x, x_scale, w, w_scale, group_sizes, d); err.failure()) return err;
  if (out.element_type() != ffi::BF16 && out.element_type() != ffi::F32)
    return Invalid(op, "the output must be bfloat16 or float32 (never float16)");
  auto os = out.dimensions();
  if (os.size() != 2 || os[0] != d->m || os[1] != d->n)
    return Invalid(op, "the output must be [M, N], got " + ShapeStr(os));
  d->out_bf16 = out.element_type() == ffi::BF16;
  return ffi::Error::Success();
}

// w4a8_moe_up: w13 [E, 2I, K/2] (gate rows first) -> h8 [M, I] e4m3 and h_scale ([M, I/128] or [1])
inline ffi::Error CheckMoeUp(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& w,
                             const ffi::AnyBuffer& w_scale, const ffi::AnyBuffer& group_sizes,
                             const ffi::AnyBuffer& down_scale, const ffi::AnyBuffer& h8,
                             const ffi::AnyBuffer& h_scale, bool static_scale, GroupedGemmDims* d,
                             int64_t* inter) {
  const std::string op = "w4a8_moe_up";
  if (auto err = CheckGroupedGemmInputs(op, x, x_scale, w, w_scale, group_sizes, d); err.failure()) return err;
  if (d->n % (2 * kGroup)) return Invalid(op, "w13 must have 2I rows with I a multiple of 128");
  *inter = d->n / 2;
  if (down_scale.element_type() != ffi::F32 || down_scale.element_count() != 1)
    return Invalid(op, "down_input_scale must be a float32 scalar");
  auto hd = h8.dimensions();
  if (h8.element_type() != ffi::F8E4M3FN || hd.size() != 2 || hd[0] != d->m || hd[1] != *inter)
    return Invalid(op, "the codes output must be float8_e4m3fn [M, I]");
  const int64_t want = static_scale ? 1 : d->m * (*inter / kGroup);
  if (h_scale.element_type() != ffi::F32 || static_cast<int64_t>(h_scale.element_count()) != want)
    return Invalid(op, "the scale output must be float32 [M, I/128] (dynamic) or [1] (static)");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// fp8_einsum, canonical batched form: x [M, H, K], w [H, N, K] -> out [M, H, N]
// ---------------------------------------------------------------------------------------------
struct Fp8EinsumDims {
  int64_t m, h, n, k, groups;
  int64_t w_scale_rows;     // N (per-row weight scales) or ceil(N/128) (128x128 blocks)
  int64_t w_rows_per_scale;  // 1 or 128
  bool x_scale_ue8m0, w_scale_ue8m0, out_bf16;
};

inline bool IsScaleType(ffi::DataType t) {
  return t == ffi::F32 || t == ffi::U8 || t == ffi::F8E8M0FNU;
}

inline ffi::Error CheckFp8Einsum(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scale,
                                 const ffi::AnyBuffer& w, const ffi::AnyBuffer& w_scale,
                                 const ffi::AnyBuffer& out, Fp8EinsumDims* d) {
  const std::string op = "fp8_einsum";
  if (x.element_type() != ffi::F8E4M3FN || x.dimensions().size() != 3)
    return Invalid(op, "x must be float8_e4m3fn [M, H, K], got shape " + ShapeStr(x.dimensions()));
  d->m = x.dimensions()[0];
  d->h = x.dimensions()[1];
  d->k = x.dimensions()[2];
  if (d->k <= 0 || d->k % kGroup) return Invalid(op, "x: K must be a positive multiple of 128");
  d->groups = d->k / kGroup;
  auto wd = w.dimensions();
  if (w.element_type() != ffi::F8E4M3FN || wd.size() != 3 || wd[0] != d->h || wd[2] != d->k ||
      wd[1] <= 0)
    return Invalid(op, "w must be float8_e4m3fn [H, N, K] matching x, got " + ShapeStr(wd));
  d->n = wd[1];
  if (!IsScaleType(x_scale.element_type()) || !IsScaleType(w_scale.element_type()))
    return Invalid(op, "scales must be float32 or UE8M0 codes (uint8 / float8_e8m0fnu)");
  auto xs = x_scale.dimensions();
  if (xs.size() != 3 || xs[0] != d->m || xs[1] != d->h || xs[2] != d->groups)
    return Invalid(op, "x_scale must be [M, H, K/128], got " + ShapeStr(xs));
  auto ws = w_scale.dimensions();
  const int64_t nb = (d->n + kGroup - 1) / kGroup;
  if (ws.size() != 3 || ws[0] != d->h || ws[2] != d->groups || (ws[1] != d->n && ws[1] != nb))
    return Invalid(op, "w_scale must be [H, ceil(N/128), K/128] or [H, N, K/128], got " + ShapeStr(ws));
  d->w_scale_rows = ws[1];
  d->w_rows_per_scale = ws[1] == d->n ? 1 : kGroup;
  d->x_scale_ue8m0 = x_scale.element_type() != ffi::F32;
  d->w_scale_ue8m0 = w_scale.element_type() != ffi::F32;
  if (out.element_type() != ffi::BF16 && out.element_type() != ffi::F32)
    return Invalid(op, "the output must be bfloat16 or float32 (never float16)");
  auto os = out.dimensions();
  if (os.size() != 3 || os[0] != d->m || os[1] != d->h || os[2] != d->n)
    return Invalid(op, "the output must be [M, H, N], got " + ShapeStr(os));
  d->out_bf16 = out.element_type() == ffi::BF16;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// ue8m0_pack: float32 powers of two -> uint8 codes
// ---------------------------------------------------------------------------------------------
inline ffi::Error CheckUe8m0Pack(const ffi::AnyBuffer& scale, const ffi::AnyBuffer& codes) {
  if (scale.element_type() != ffi::F32) return Invalid("pack_ue8m0", "scale must be float32");
  if (codes.element_type() != ffi::U8 || codes.element_count() != scale.element_count())
    return Invalid("pack_ue8m0", "the output must be uint8 with as many elements as scale");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// quantize_fp8_groups: x [R, K] (bf16 / f32) -> e4m3 [R, K] + f32 scales [R, K/128]
// ---------------------------------------------------------------------------------------------
// silu_mul: x is [..., 2K] (gate, then up) and the outputs cover K channels; k is the outputs' K.
// folded (the CUDA handler's layout="folded"): the second output holds one float32 multiplier per row.
inline ffi::Error CheckQuantizeGroups(const ffi::AnyBuffer& x, const ffi::AnyBuffer& q, const ffi::AnyBuffer& s,
                                      bool silu_mul, int64_t* rows, int64_t* k, bool folded = false) {
  const std::string op = silu_mul ? "silu_mul_quantize_fp8_groups" : "quantize_fp8_groups";
  if (x.element_type() != ffi::BF16 && x.element_type() != ffi::F32)
    return Invalid(op, "x must be bfloat16 or float32");
  auto d = x.dimensions();
  const int64_t per = silu_mul ? 2 * kGroup : kGroup;
  if (d.size() < 1 || d.back() <= 0 || d.back() % per)
    return Invalid(op, "x must have its last axis a positive multiple of " + std::to_string(per) + ", got " +
                           ShapeStr(d));
  *k = silu_mul ? d.back() / 2 : d.back();
  *rows = static_cast<int64_t>(x.element_count()) / d.back();
  if (q.element_type() != ffi::F8E4M3FN || static_cast<int64_t>(q.element_count()) != *rows * *k)
    return Invalid(op, silu_mul ? "the codes output must be float8_e4m3fn [..., K] for x [..., 2K]"
                                : "the codes output must be float8_e4m3fn with the shape of x");
  if (folded && (s.element_type() != ffi::F32 || static_cast<int64_t>(s.element_count()) != *rows))
    return Invalid(op, "the token scales output must be float32 [...], one per row");
  if (!folded && (s.element_type() != ffi::F32 || static_cast<int64_t>(s.element_count()) != *rows * (*k / kGroup)))
    return Invalid(op, "the scales output must be float32 [..., K/128]");
  return ffi::Error::Success();
}

inline std::string Ue8m0RejectMessage(std::string_view arg, int64_t bad) {
  return "pack_ue8m0: argument '" + std::string(arg) + "' is declared UE8M0 but " + std::to_string(bad) +
         " value(s) are not positive powers of two in [2**-126, 2**127] "
         "(sign or mantissa bits set); round with ceil_to_ue8m0 before quantizing";
}

}  // namespace jax_w4a8
