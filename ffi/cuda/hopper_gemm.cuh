// The Hopper tensor-core kernel behind both ops: a persistent, warp-specialised, TMA-fed fp8 wgmma
// GEMM with float32 promotion per 128-wide K group, run "swap AB" (weights on the wide MMA side), except
// for the block-scaled einsum's 128- and 192-token tiles, which put the tokens on the MMA's A side.
//
// Problem, for each batch b (an expert of the grouped GEMM, or a head of the per-head einsum):
//   out[m, head, f] = sum_g sx[g, head, m] * sw(b, f, g) * sum_{k in g} x[m, head, k] * w[b, f, k]
// with m over the batch's token rows: [start_b, end_b) from the clamped group sizes (grouped, H == 1,
// head 0), or [0, M) for every head (einsum, B == H, head b). Weights are packed int4 (converted
// exactly in registers, to e4m3 for an fp8 MMA or to f16 for an f16 MMA) or e4m3.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/checks.h"

namespace jax_w4a8 {

enum class WeightScaleType : int { kF32 = 0, kBf16 = 1, kUe8m0 = 2 };

// Activation scales as the caller has them: a scalar, [M] float32, [M, H, G] float32 or [M, H, G]
// UE8M0 codes. LaunchHopperGemm rewrites them into the layout the kernel reads, float32 [G, H, Mp]
// (zero past M), in the same small kernel that clears the split-K workspace.
enum class ActScaleKind : int { kTensorF32, kTokenF32, kGroupF32, kGroupUe8m0 };

struct HopperGemmParams {
  const void* x;               // e4m3 [M, H, K]
  const void* w;               // int4 packed [B, F, K/2] (w_int4) or e4m3 [B, F, K]
  bool w_int4;
  const void* sx_src;          // activation scales as given, of kind sx_kind
  ActScaleKind sx_kind;
  float* sx;                   // scratch: float32 [G, H, Mp] activation scales, Mp = M rounded up to 4 (int4_f16:
                               // only the group-0 plane, each token's largest scale, rows >= M left unwritten
                               // and never read; see ConvertXToF16)
  const void* sw;              // [B, sw_rows, G] weight scales of type sw_type (int4 weights: kF32 or kBf16)
  WeightScaleType sw_type;
  int64_t sw_rows;             // F (per-row scales) or ceil(F / 128) (128-row blocks)
  int sw_row_shift;            // 0 (per row) or 7 (per 128 rows)
  const int32_t* group_sizes;  // [B] for the grouped GEMM (H == 1); nullptr for the einsum
  void* out;                   // [M, H, F] bfloat16 or float32
  bool out_bf16;
  // split_k > 1: int32 piece counters per unit (cleared by the launch), then float32 partial sums,
  // two slots of one tile per block; split_bytes is the size of that region (it bounds the grid).
  float* split_ws;
  int64_t split_bytes;
  int64_t partial_offset;      // floats from split_ws to the partial slots (set by LaunchHopperGemm)
  int64_t m, h, f, k, b, mp;
  int split_k;                 // > 1: stream-K (partial tiles summed in block order by the piece completing a tile)
  int tile_tokens;             // 16, 32, 64 or 128; 192 for the block-scaled fp8 einsum; 8 for int4_f16
  // int4 weights: MMA in f16 (int4 -> f16 costs half the integer instructions of int4 -> e4m3) instead of
  // e4m3; tile_tokens 8 to 128 (fused: 8 to 64). The activations go to f16 once per call, before the GEMM, into
  // xh (scratch, HopperGemmF16ActivationBytes): [M, H, K] f16 with each 128-K group in the K order of the
  // kernel's int4 -> f16 fragments (see ConvertXToF16 in hopper_gemm.cu).
  bool int4_f16 = false;
  // Fused MoE up-projection (w4a8 only, split_k 1, tile_tokens <= 64): the weights hold gate rows
  // [0, F) and up rows [up_offset, up_offset + F); out receives e4m3 codes of silu(gate) * up [M, F]
  // quantized per tensor by *down_scale, or per token and 128 channels with scales written to h_scale
  // [M, F / 128] when down_scale is null: UE8M0 (h_scale_ue8m0) or float32 (max(amax, 1e-4) / 448, codes h / s).
  bool fused_up = false;
  int64_t up_offset = 0;
  const float* down_scale = nullptr;
  float* h_scale = nullptr;
  bool h_scale_ue8m0 = true;
  void* xh = nullptr;          // int4_f16: the f16 activations (see int4_f16)
  // int4 weights, e4m3 MMA, 128-token tiles, unfused: the activation scales folded into the activations where
  // they differ by powers of two (see FoldTokenActivations in hopper_gemm.cu). x_tok_scale (scratch, float32
  // [H, Mp], then an int flag): each token's multiplier, applied after the K loop, and whether the call could
  // not be folded (it then runs the unfolded kernel); x_fold (scratch, e4m3 [M, H, K]): the folded activations
  // in the K order its int4 conversion reads (StoreFoldedKOrder; per tensor or per token x, reordered only).
  bool fold_x = false;
  float* x_tok_scale = nullptr;
  void* x_fold = nullptr;
  // x_folded (the grouped GEMM's x_layout="folded"): the caller's x is already folded, in that K order, with one
  // multiplier per token (x_tok_scale, [M] float32): only the folding kernel runs, without a preparation (its
  // fields: fold_x false, x_fold = x, x_tok_scale = the caller's multipliers).
  bool x_folded = false;
  bool dependent_launch = false;  // set by LaunchHopperGemm: the GEMM is a programmatic dependent of its preparation
};

// The current device's SM count (cached per device, as the launches below use it).
int CurrentSmCount();

// Whether the current device is an sm_90 Hopper (cached per device): the CUTLASS kernels, compiled for sm_90a
// only, run there; their handlers fall back to the plain CUDA-core kernels elsewhere.
bool CurrentDeviceIsSm90();

// Whether the current device and these shapes can take the tensor-core kernel (else use the simple one).
bool HopperGemmSupported(const HopperGemmParams& p, const char** why);

// Bytes of the f16 activations of the int4 f16 MMA path (int4_f16), 256-byte aligned.
size_t HopperGemmF16ActivationBytes(int64_t m, int64_t h, int64_t k);

// Whether the grouped GEMM folds its activation scales (fold_x): int4 weights, e4m3 MMA, 128-token tiles.
inline bool W4a8FoldsActivationScales(int tile_tokens, bool f16) { return tile_tokens == 128 && !f16; }

// Bytes of the folded activations' scratch (fold_x): the token multipliers [H, Mp] float32 and the flag (int32)
// (HopperGemmFoldTokenBytes), then the folded e4m3 activations [M, H, K], each 256-byte aligned.
size_t HopperGemmFoldTokenBytes(int64_t m, int64_t h);
size_t HopperGemmFoldBytes(int64_t m, int64_t h, int64_t k);

// Bytes of scratch LaunchHopperGemm needs at least: the prepared activation scales and, with split_k > 1,
// the piece counters (tile_tokens, and for the grouped GEMM its batch count, bound the number of units)
// and the partial-sum slots of one block. Every further block's slots (2 x tile_tokens x 128 floats)
// let one more block run, up to the resident blocks; jax_w4a8.tiling sizes it for all of them.
size_t HopperGemmScratchBytes(int64_t m, int64_t h, int64_t f, int64_t k, int split_k, int tile_tokens = 0,
                              int64_t grouped_batches = 0);

// Scratch the tensor-core handlers check their scratch output against, per plan: w4a8_grouped_gemm (its
// own kernel; f16: mma 1) and w4a8_moe_up. jax_w4a8.tiling mirrors them; a CPU test compares the two
// through the CUDA module (module.cc).
// x_folded: the activations come folded (x_layout="folded"): no folded copy in the scratch.
size_t W4a8GroupedGemmScratchNeed(int64_t m, int64_t e, int64_t n, int64_t k, int tile_tokens, int split_k, bool f16,
                                  bool x_folded = false);
size_t W4a8MoeUpScratchNeed(int64_t m, int64_t inter, int64_t k, bool f16);

// Prepares the activation scales (and clears the split-K piece counters), then runs the GEMM.
cudaError_t LaunchHopperGemm(const HopperGemmParams& p, cudaStream_t stream);


// The int4 grouped-GEMM parameters shared by w4a8_grouped_gemm and w4a8_moe_up (f: output rows per
// tile family, the intermediate size when fused); the caller sets sx, split_ws, split_bytes and the fused fields.
inline HopperGemmParams GroupedInt4Params(const GroupedGemmDims& d, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                          const ffi::AnyBuffer& w_scale, const ffi::AnyBuffer& group_sizes,
                                          void* out, int64_t f, int tile_tokens, int split_k) {
  HopperGemmParams p{};
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.w_int4 = true;
  p.sw = w_scale.untyped_data();
  p.sw_type = d.w_scale_bf16 ? WeightScaleType::kBf16 : WeightScaleType::kF32;
  p.sw_rows = d.n;
  p.sw_row_shift = 0;
  p.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  p.out = out;
  p.out_bf16 = d.out_bf16;
  p.m = d.m, p.h = 1, p.f = f, p.k = d.k, p.b = d.e, p.mp = (d.m + 3) / 4 * 4;
  p.split_k = split_k;
  p.tile_tokens = tile_tokens;
  return p;
}

inline ActScaleKind ActScaleKindOf(XScaleKind kind) {
  return kind == XScaleKind::kTensor  ? ActScaleKind::kTensorF32
         : kind == XScaleKind::kToken ? ActScaleKind::kTokenF32
                                      : ActScaleKind::kGroupF32;
}

}  // namespace jax_w4a8
